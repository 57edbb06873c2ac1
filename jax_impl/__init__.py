"""logitless for JAX: fused linear-head losses that never build the N x V logits."""

__library__ = "logitless"  # `logitless.origin` tells this package from another of the same name

from jax_impl.distillation import linear_distillation, linear_topk_distillation
from jax_impl.functional import linear_cross_entropy
from jax_impl.log_probs import linear_log_probs
from jax_impl.policy_loss import linear_policy_loss

__all__ = ["linear_cross_entropy", "linear_topk_distillation", "linear_distillation", "linear_log_probs",
           "linear_policy_loss"]
