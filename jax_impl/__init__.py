"""logitless for JAX: fused linear-head cross-entropy that never builds the N x V logits."""

from jax_impl.functional import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
