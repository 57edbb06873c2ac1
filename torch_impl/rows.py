"""Per-row pieces of the spec (interop/SPEC.md) that every PyTorch path shares.

Every path reduces a block of logits to per-row statistics (lse, s_y = s at the target,
ws = sum_j cw_j s_j) and turns per-row coefficients (P, T, S) back into dz; what is per
row, O(N), lives here.
"""

from __future__ import annotations

import torch

from interop.options import CrossEntropyOptions


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 32-bit inputs, fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class TargetRows:
    """Per-row facts about the target, all [N]: safe_y (int64, 0 where out of range),
    valid (not ignore_index), in_range, bad (valid but out of range) and cw_y (cw[y], 0 if
    ignored), in `dtype`."""

    def __init__(self, target_N: torch.Tensor, class_weight_V, vocab: int, ignore_index: int, dtype):
        y = target_N.to(torch.int64)
        self.valid = y != ignore_index
        self.in_range = (y >= 0) & (y < vocab)
        self.safe_y = torch.where(self.in_range, y, torch.zeros_like(y))
        cw_y = torch.ones_like(y, dtype=dtype) if class_weight_V is None else class_weight_V.to(dtype)[self.safe_y]
        self.cw_y = torch.where(self.valid, cw_y, torch.zeros_like(cw_y))
        self.bad = self.valid & ~self.in_range


def row_loss(lse, s_y, ws, rows: TargetRows, opts: CrossEntropyOptions, cw_sum, vocab: int, sl=slice(None)):
    """Per-row loss from the row statistics (0 for ignored rows, NaN for out-of-range targets).

    lse, s_y, ws: [R] for the rows `sl` of `rows`; ws = sum_j cw_j s_j (only read when
    label_smoothing > 0); cw_sum = sum_j cw_j (V without class weights).
    """
    eps = opts.label_smoothing
    loss = (1 - eps) * rows.cw_y[sl] * (lse - s_y)
    if eps:
        loss = loss + eps * (cw_sum * lse - ws) / vocab
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    loss = torch.where(rows.bad[sl], torch.full_like(loss, float("nan")), loss)
    return torch.where(rows.valid[sl], loss, torch.zeros_like(loss))


def reduce_loss(loss_N, rows: TargetRows, reduction: str):
    """none: loss_N; sum; mean: divided by the valid rows' summed class weight."""
    if reduction == "none":
        return loss_N
    if reduction == "sum":
        return loss_N.sum()
    return loss_N.sum() / rows.cw_y.sum()


def row_coefficients(
    grad_loss, grad_lse, lse, rows: TargetRows, cw_sum, opts: CrossEntropyOptions, vocab: int, sl=slice(None)
):
    """(P, T, S), each [R] in lse's dtype: ds_ij = P_i p_ij - T_i [j == y_i] - S_i cw_j.

    For the rows `sl` of `rows`, with lse [R] (and grad_lse [R] or None) of those rows.
    grad_loss: the upstream gradient of the reduced loss (0-d), or of each row ([R], for
    reduction="none"). T is 0 where the target is out of range; P is NaN there, so those
    rows' gradients are NaN.
    """
    eps = opts.label_smoothing
    if opts.reduction == "mean":
        grad_loss = grad_loss / rows.cw_y.sum()
    valid, cw_y = rows.valid[sl], rows.cw_y[sl]
    r = torch.where(valid, grad_loss.to(lse.dtype).expand_as(lse), torch.zeros_like(lse))
    p_coef = r * ((1 - eps) * cw_y + eps * cw_sum / vocab + 2 * opts.z_loss * lse)
    if grad_lse is not None:
        p_coef = p_coef + grad_lse.to(lse.dtype)
    p_coef = torch.where(rows.bad[sl], torch.full_like(p_coef, float("nan")), p_coef)
    t_coef = r * (1 - eps) * cw_y * rows.in_range[sl]
    return p_coef, t_coef, r * eps / vocab
