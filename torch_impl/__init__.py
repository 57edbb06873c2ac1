"""logitless for PyTorch: fused linear-head cross-entropy that never builds the N x V logits."""

from torch_impl.functional import linear_cross_entropy
from torch_impl.module import LinearCrossEntropyLoss

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss"]
