"""The PyTorch API of logitless (the names of `logitless.jax`, plus the nn.Module form and
the Hugging Face patch)."""

from logitless.origin import load

load("interop")
load("torch_impl")

from torch_impl import (LinearCrossEntropyLoss, linear_cross_entropy, linear_distillation,  # noqa: E402
                        linear_log_probs, linear_policy_loss, linear_topk_distillation)
from torch_impl.transformers import patch_causal_lm, unpatch_causal_lm  # noqa: E402
from torch_impl.openrlhf import patch_openrlhf  # noqa: E402
from torch_impl.trl import patch_trl  # noqa: E402
from torch_impl.verl import patch_verl  # noqa: E402

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "linear_topk_distillation", "linear_distillation",
           "linear_log_probs", "linear_policy_loss", "patch_causal_lm", "unpatch_causal_lm", "patch_trl",
           "patch_verl", "patch_openrlhf"]
