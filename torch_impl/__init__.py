"""logitless for PyTorch: fused linear-head losses that never build the N x V logits."""

__library__ = "logitless"  # `logitless.origin` tells this package from another of the same name

from torch_impl.distillation import linear_distillation, linear_topk_distillation
from torch_impl.functional import linear_cross_entropy
from torch_impl.log_probs import linear_log_probs
from torch_impl.policy_loss import linear_policy_loss
from torch_impl.module import LinearCrossEntropyLoss

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "linear_topk_distillation", "linear_distillation",
           "linear_log_probs",
           "linear_policy_loss"]
