"""The cross-entropy's per-row math (interop/SPEC.md) in Triton, so that the kernel path
spends one launch per row block on it instead of a few dozen small PyTorch ops (at the S
preset those launches, not the GPU, set the time).

- `ce_rows_`: a block of whole rows (C = V): the statistics, lse and the row losses, and
  optionally dz written over the logits (the "speed" forward pass), in one pass per row.
- `ce_losses_`: lse and the row losses from running statistics (blocks of partial rows).
- `ce_coefficients_`: the coefficients (P, T, S) of dz from lse and the upstream gradients.

Targets are int64 and may be anything: ignore_index, out of range (NaN loss and P), or a
class. The row math is fp32. `mean` divides by a device scalar (`TargetCheck`, which also
counts bad targets), so that no value has to come back to the host before the work is
queued; the check is launched by the first per-row kernel, after the first logits product,
so that the GPU starts on the product while the host still prepares the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interop.options import CrossEntropyOptions
from torch_impl.kernels import TileFilter, arg_or, grad_block, row_grad, row_stats

# The whole-row kernel's statistics pass: columns per step and warps (H100, one L block of
# 2048 x 128256 bf16 without gradients: 0.28 ms with 2048 columns and 8 warps, 0.25 ms with
# these; with gradients, and at G, the same within 1%).
ROWS_BLOCK_STATS, ROWS_WARPS = 4096, 16

BLOCK_ROWS = 1024  # rows per program of the per-row kernels


@triton.jit
def _target_facts(y, cw_ptr, ignore_index, vocab, HAS_CW: tl.constexpr):
    """(valid, in_range, cw_y) of targets y: cw_y = cw[y] (cw[0] for an out-of-range target),
    0 for ignored rows."""
    valid = y != ignore_index
    in_range = (y >= 0) & (y < vocab)
    if HAS_CW:
        cw_y = tl.load(cw_ptr + tl.where(in_range, y, 0)).to(tl.float32)
    else:
        cw_y = tl.full(y.shape, 1.0, tl.float32)
    return valid, in_range, tl.where(valid, cw_y, 0.0)


@triton.jit
def _ce_loss(lse, sy, ws, valid, in_range, cw_y, vocab, eps, z_loss, cw_sum, HAS_LS: tl.constexpr, HAS_Z: tl.constexpr):
    """The row loss: (1 - eps) cw_y (lse - s_y) + eps (cw_sum lse - ws) / V + zl lse^2, NaN for
    an out-of-range target, 0 for an ignored row."""
    loss = (1 - eps) * cw_y * (lse - sy)
    if HAS_LS:
        loss += eps * (cw_sum * lse - ws) / vocab
    if HAS_Z:
        loss += z_loss * lse * lse
    loss = tl.where(in_range, loss, float("nan"))
    return tl.where(valid, loss, 0.0)


@triton.jit
def _ce_coefficients(lse, r, glse, valid, in_range, cw_y, vocab, eps, z_loss, cw_sum):
    """(P, T, S) of ds = P p - T [j == y] - S cw_j for the upstream gradient r of the row's loss
    (already divided by the mean's denominator) and glse of its lse."""
    r = tl.where(valid, r, 0.0)
    p_coef = r * ((1 - eps) * cw_y + eps * cw_sum / vocab + 2 * z_loss * lse) + glse
    p_coef = tl.where(valid & (in_range == 0), float("nan"), p_coef)
    t_coef = tl.where(in_range, r * (1 - eps) * cw_y, 0.0)
    return p_coef, t_coef, r * eps / vocab


@triton.jit
def _ce_rows_kernel(
    z_ptr, stride_zr,              # [R, V] logits block of whole rows; dz is written over it
    b_ptr, cw_ptr, cw_sum_ptr,     # [V] bias, class weights; their sum (with HAS_CW)
    y_ptr, denom_ptr,              # [R] int64 targets; the mean's denominator (with MEAN)
    lse_ptr, loss_ptr,             # [R] fp32 outputs
    tiles_ptr, target_ptr,         # with FILTER: [ceil(V / BLOCK)] int32 tile flags, [R] fp32 target terms
    V, ignore_index, eps, z_loss, cap, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_LS: tl.constexpr,
    HAS_Z: tl.constexpr, MEAN: tl.constexpr, GRAD: tl.constexpr, FILTER: tl.constexpr,
    BLOCK_STATS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_zr
    y = tl.load(y_ptr + row)
    m, l, sy, ws = row_stats(z_row, b_ptr, cw_ptr, y, V, cap, 1.0, HAS_BIAS, HAS_CW, HAS_CAP, HAS_LS, BLOCK_STATS)
    lse = m + tl.log(l)
    cw_sum = tl.load(cw_sum_ptr).to(tl.float32) if HAS_CW else V * 1.0
    valid, in_range, cw_y = _target_facts(y, cw_ptr, ignore_index, V, HAS_CW)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, _ce_loss(lse, sy, ws, valid, in_range, cw_y, V, eps, z_loss, cw_sum, HAS_LS, HAS_Z))
    if GRAD:
        r = 1.0 / tl.load(denom_ptr) if MEAN else 1.0
        p_coef, t_coef, s_coef = _ce_coefficients(lse, r, 0.0, valid, in_range, cw_y, V, eps, z_loss, cw_sum)
        row_grad(z_row, z_row, b_ptr, cw_ptr, y, lse, p_coef, t_coef, s_coef, 0.0, 0.0, V, cap, 1.0,
                 filter_eps, tiles_ptr, target_ptr + row, HAS_BIAS, HAS_CW, HAS_CAP, False, FILTER, BLOCK)


@triton.jit
def _ce_losses_kernel(
    m_ptr, l_ptr, sy_ptr, ws_ptr,  # [R] fp32 statistics of whole rows
    y_ptr, cw_ptr, cw_sum_ptr,     # [R] int64 targets; [V] class weights, their sum (with HAS_CW)
    lse_ptr, loss_ptr,             # [R] fp32 outputs
    R, vocab, ignore_index, eps, z_loss,
    HAS_CW: tl.constexpr, HAS_LS: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < R
    lse = tl.load(m_ptr + rows, mask=mask, other=0.0) + tl.log(tl.load(l_ptr + rows, mask=mask, other=1.0))
    y = tl.load(y_ptr + rows, mask=mask, other=ignore_index)
    cw_sum = tl.load(cw_sum_ptr).to(tl.float32) if HAS_CW else vocab * 1.0
    valid, in_range, cw_y = _target_facts(y, cw_ptr, ignore_index, vocab, HAS_CW)
    loss = _ce_loss(lse, tl.load(sy_ptr + rows, mask=mask, other=0.0), tl.load(ws_ptr + rows, mask=mask, other=0.0),
                    valid, in_range, cw_y, vocab, eps, z_loss, cw_sum, HAS_LS, HAS_Z)
    tl.store(lse_ptr + rows, lse, mask=mask)
    tl.store(loss_ptr + rows, loss, mask=mask)


@triton.jit
def _ce_coefficients_kernel(
    lse_ptr, y_ptr, cw_ptr, cw_sum_ptr,  # [R] fp32 lse, int64 targets; [V] class weights, their sum
    g_ptr, g_stride, denom_ptr,    # upstream gradient of the loss (stride 0: one for all rows); mean's denominator
    glse_ptr,                      # [R] upstream gradient of lse (with HAS_GLSE)
    p_ptr, t_ptr, s_ptr,           # [R] fp32 outputs
    R, vocab, ignore_index, eps, z_loss,
    HAS_CW: tl.constexpr, MEAN: tl.constexpr, HAS_GLSE: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < R
    lse = tl.load(lse_ptr + rows, mask=mask, other=0.0)
    y = tl.load(y_ptr + rows, mask=mask, other=ignore_index)
    r = tl.load(g_ptr + rows * g_stride, mask=mask, other=0.0).to(tl.float32)
    if MEAN:
        r = r / tl.load(denom_ptr)
    glse = tl.load(glse_ptr + rows, mask=mask, other=0.0).to(tl.float32) if HAS_GLSE else 0.0
    cw_sum = tl.load(cw_sum_ptr).to(tl.float32) if HAS_CW else vocab * 1.0
    valid, in_range, cw_y = _target_facts(y, cw_ptr, ignore_index, vocab, HAS_CW)
    p_coef, t_coef, s_coef = _ce_coefficients(lse, r, glse, valid, in_range, cw_y, vocab, eps, z_loss, cw_sum)
    tl.store(p_ptr + rows, p_coef, mask=mask)
    tl.store(t_ptr + rows, t_coef, mask=mask)
    tl.store(s_ptr + rows, s_coef, mask=mask)


@triton.jit
def _target_check_kernel(y_ptr, cw_ptr, out_ptr, N, vocab, ignore_index, HAS_CW: tl.constexpr, BLOCK: tl.constexpr):
    # One program, rows in a fixed order (a deterministic sum): out = [bad targets, sum cw_y].
    bad = tl.zeros([BLOCK], tl.float32)
    weight = tl.zeros([BLOCK], tl.float32)
    for r0 in range(0, N, BLOCK):
        rows = r0 + tl.arange(0, BLOCK)
        y = tl.load(y_ptr + rows, mask=rows < N, other=ignore_index).to(tl.int64)
        valid, in_range, cw_y = _target_facts(y, cw_ptr, ignore_index, vocab, HAS_CW)
        bad += (valid & (in_range == 0)).to(tl.float32)
        weight += cw_y
    tl.store(out_ptr, tl.sum(bad, axis=0))
    tl.store(out_ptr + 1, tl.sum(weight, axis=0))


def check_targets(y_N: torch.Tensor, cw_V, ignore_index: int, vocab: int) -> torch.Tensor:
    """[2] fp32 on y's device: the number of targets outside [0, V) that are not ignore_index,
    and the mean's denominator, sum over rows not ignored of cw[y] (their count without class
    weights), in one launch that leaves both on the device."""
    out = torch.empty(2, dtype=torch.float32, device=y_N.device)
    _target_check_kernel[(1,)](y_N, arg_or(cw_V, out), out, y_N.shape[0], vocab, ignore_index,
                               HAS_CW=cw_V is not None, BLOCK=4096, num_warps=8)
    return out


class TargetCheck:
    """`check_targets` of one call, launched on first use: `denominator` (0-d fp32, on y's
    device) for the mean, and `bad_count()` on the host. The bad count is copied to pinned
    memory right behind the check, so the host waits for the check, not for the work queued
    after it."""

    def __init__(self, y_N: torch.Tensor, cw_V, ignore_index: int, vocab: int):
        self._args = (y_N, cw_V, ignore_index, vocab)
        self._counts = None  # [2] fp32 on the device once launched
        self._bad = None  # the bad count on the host (pinned), behind `_event`
        self._event = None

    def launch(self) -> None:
        """Queue the check (once)."""
        if self._counts is not None:
            return
        self._counts = check_targets(*self._args)
        if self._counts.is_cuda:
            self._bad = torch.empty(1, dtype=torch.float32, pin_memory=True)
            self._bad.copy_(self._counts[:1], non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self._counts.device))
        else:
            self._bad = self._counts[:1]

    @property
    def denominator(self) -> torch.Tensor:
        self.launch()
        return self._counts[1]

    def bad_count(self) -> int:
        """The number of targets outside [0, V) that are not ignore_index (waits for the check)."""
        self.launch()
        if self._event is not None:
            self._event.synchronize()
        return int(self._bad.item())


class RowMath:
    """The options and per-call tensors the per-row kernels share: targets y [N] (int64),
    class weights cw [V] (fp32) or None and their sum, and the call's `TargetCheck` (made
    here over y when not given), launched by the first per-row kernel."""

    def __init__(self, y_N: torch.Tensor, cw_V, opts: CrossEntropyOptions, vocab: int, check: TargetCheck | None = None):
        self.y, self.cw, self.opts, self.vocab = y_N, cw_V, opts, vocab
        self.cw_sum = None if cw_V is None else cw_V.sum()
        self.check = TargetCheck(y_N, cw_V, opts.ignore_index, vocab) if check is None else check

    @property
    def denominator(self) -> torch.Tensor | None:
        """The mean's denominator, None for other reductions."""
        return self.check.denominator if self.opts.reduction == "mean" else None

    def rows_(self, z_RV: torch.Tensor, b_V, rs: slice, lse_R: torch.Tensor, loss_R: torch.Tensor, grad: bool,
              tile_filter: TileFilter | None = None) -> None:
        """Whole rows rs of logits z [R, V] (no bias): write lse and the row losses [R]; with
        `grad`, write dz for an upstream gradient of 1 of the reduced loss over z (filtered
        by `tile_filter`, as `torch_impl.kernels.row_grad` says, if given)."""
        R, V = z_RV.shape
        self.check.launch()  # the call's first per-row kernel queues the check
        if R == 0:
            return
        o, y, f = self.opts, self.y[rs], tile_filter
        _ce_rows_kernel[(R,)](
            z_RV, z_RV.stride(0), arg_or(b_V, z_RV), arg_or(self.cw, z_RV), arg_or(self.cw_sum, z_RV), y,
            arg_or(self.denominator, lse_R), lse_R, loss_R,
            *((lse_R, lse_R) if f is None else (f.tiles, f.target)),
            V, o.ignore_index, o.label_smoothing, o.z_loss, 1.0 if o.softcap is None else o.softcap, 0.0 if f is None else f.eps,
            HAS_BIAS=b_V is not None, HAS_CW=self.cw is not None, HAS_CAP=o.softcap is not None,
            HAS_LS=o.label_smoothing > 0, HAS_Z=o.z_loss > 0, MEAN=o.reduction == "mean", GRAD=grad, FILTER=f is not None,
            BLOCK_STATS=min(ROWS_BLOCK_STATS, triton.next_power_of_2(V)), BLOCK=grad_block(V, f),
            num_warps=ROWS_WARPS if V >= ROWS_BLOCK_STATS else 8,
        )

    def losses_(self, m_R, l_R, sy_R, ws_R, rs: slice, lse_R, loss_R) -> None:
        """lse = m + log(l) and the row losses of rows rs from their statistics (all [R] fp32)."""
        R, o = m_R.shape[0], self.opts
        self.check.launch()  # the call's first per-row kernel queues the check
        if R == 0:
            return
        _ce_losses_kernel[(triton.cdiv(R, BLOCK_ROWS),)](
            m_R, l_R, sy_R, ws_R, self.y[rs], arg_or(self.cw, m_R), arg_or(self.cw_sum, m_R), lse_R, loss_R,
            R, self.vocab, o.ignore_index, o.label_smoothing, o.z_loss,
            HAS_CW=self.cw is not None, HAS_LS=o.label_smoothing > 0, HAS_Z=o.z_loss > 0, BLOCK_R=BLOCK_ROWS,
        )

    def coefficients(self, lse_R, grad_loss, grad_lse_R, rs: slice):
        """(P, T, S), fp32 [R] each, of rows rs; grad_loss: 0-d, or [N] for reduction "none"
        (read at rs); grad_lse_R: [R] or None."""
        R, o = lse_R.shape[0], self.opts
        p_R, t_R, s_R = (torch.empty_like(lse_R) for _ in range(3))
        if R == 0:
            return p_R, t_R, s_R
        g = grad_loss[rs] if grad_loss.ndim else grad_loss
        _ce_coefficients_kernel[(triton.cdiv(R, BLOCK_ROWS),)](
            lse_R, self.y[rs], arg_or(self.cw, lse_R), arg_or(self.cw_sum, lse_R), g, g.stride(0) if g.ndim else 0,
            arg_or(self.denominator, lse_R), arg_or(grad_lse_R, lse_R), p_R, t_R, s_R,
            R, self.vocab, o.ignore_index, o.label_smoothing, o.z_loss,
            HAS_CW=self.cw is not None, MEAN=o.reduction == "mean", HAS_GLSE=grad_lse_R is not None, BLOCK_R=BLOCK_ROWS,
        )
        return p_R, t_R, s_R

    def reduce(self, loss_N: torch.Tensor) -> torch.Tensor:
        """The reduced loss from the row losses [N]."""
        if self.opts.reduction == "none":
            return loss_N
        total = loss_N.sum()
        return total / self.denominator if self.opts.reduction == "mean" else total
