"""What both frameworks share: the options and input checks, the float64 references (numpy,
the tests' oracle) and the zero-copy DLPack bridge between PyTorch and JAX."""

from logitless.origin import load

load("interop")

from interop.cross import jax_loss_in_torch, torch_loss_in_jax  # noqa: E402
from interop.distill_reference import linear_distillation_reference, linear_topk_distillation_reference  # noqa: E402
from interop.distillation import DenseDistillationOptions, TopKDistillationOptions  # noqa: E402
from interop.dlpack import to_jax, to_torch  # noqa: E402
from interop.log_probs import LogProbsOptions  # noqa: E402
from interop.log_probs_reference import linear_log_probs_reference, linear_policy_loss_reference  # noqa: E402
from interop.options import CrossEntropyOptions, ProblemShape, check_inputs  # noqa: E402
from interop.policy_loss import PolicyLossOptions  # noqa: E402
from interop.reference import linear_cross_entropy_reference  # noqa: E402
from interop.tuning import Tuning  # noqa: E402

__all__ = ["CrossEntropyOptions", "TopKDistillationOptions", "DenseDistillationOptions", "LogProbsOptions",
           "PolicyLossOptions", "Tuning", "ProblemShape", "check_inputs", "linear_cross_entropy_reference",
           "linear_topk_distillation_reference", "linear_distillation_reference", "linear_log_probs_reference",
           "linear_policy_loss_reference", "to_jax", "to_torch", "jax_loss_in_torch", "torch_loss_in_jax"]
