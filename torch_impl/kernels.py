"""The Triton kernels of the PyTorch kernel path: the elementwise and per-row work between
the matrix products (cuBLAS's) of a block of logits z [R, C] (R rows, C vocabulary columns
at column offset v0).

Over a block (one program per row, looping over its columns; z read in its own dtype, the
math in fp32, the bias and the softcap applied on the fly):
- `block_stats_`: merges the block into running per-row statistics (online max m, sum of
  exponentials l of scale * s, s at the target s_y, class-weighted sum ws), so
  lse = m + log(l) once every column block of the rows has been seen.
- `block_grad_`: turns the block into dz (interop/SPEC.md), in place or into another
  buffer, from per-row lse and coefficients (P, T, S), optionally with a second softmax
  term (distillation at a temperature: interop/SPEC-DISTILLATION.md).
- `put_entries_`: overwrites up to K given entries per row of a block (the exact values
  of a top-K teacher's positions).

The cross-entropy's per-row math (`RowMath`), so that a row block costs one launch instead
of a few dozen small PyTorch ops (at small heads those launches, not the GPU, set the time):
- `ce_rows_`: a block of whole rows (C = V): the statistics, lse and the row losses, and
  optionally dz written over the logits (the "speed" forward pass), in one pass per row.
- `ce_losses_`: lse and the row losses from running statistics (blocks of partial rows).
- `ce_coefficients_`: the coefficients (P, T, S) of dz from lse and the upstream gradients.
Targets are int64 and may be anything: ignore_index, out of range (NaN loss and P), or a
class. `mean` divides by a device scalar (`TargetCheck`, which also counts bad targets), so
that no value has to come back to the host before the work is queued; the check is launched
by the first per-row kernel, after the first logits product, so that the GPU starts on the
product while the host still prepares the rest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interop.options import CrossEntropyOptions
from interop.tuning import BLOCK_COLS, ROW_KERNEL_ROWS, WHOLE_ROW_STATS_COLS, WHOLE_ROW_STATS_WARPS

FILTER_COLS = 512  # columns per tile of gradient filtering


@triton.jit
def _expm1(x):
    # exp(x) - 1 to full relative precision near 0 (Kahan: the rounding of w = exp(x) cancels
    # in (w - 1) / log(w)); -1 where exp underflows (log(0) would give 0); portable across
    # Triton versions (no libdevice).
    w = tl.exp(x)
    return tl.where(w == 1.0, x, tl.where(w == 0.0, -1.0, (w - 1.0) * x / tl.log(w)))


@triton.jit
def _tanh(u):
    # tanh(|u|) = -expm1(-2|u|) / (2 + expm1(-2|u|)): no cancellation for small u, where a
    # softcap c much larger than the logits puts u = z / c (1 - 2 / (exp(2u) + 1) loses all
    # of tanh(u) below u ~ 1e-8, and with it every capped logit).
    # |u| capped at 20 (tanh is 1 in fp32 from ~9): exp(-2|u|) never reaches fp32's
    # subnormals, where the GPU's exp and log lose the digits Kahan's quotient needs (|tanh|
    # came out above 1 for |u| in 44-52); the cap keeps a NaN.
    e = _expm1(-2.0 * tl.minimum(tl.abs(u), 20.0, propagate_nan=tl.PropagateNan.ALL))
    t = -e / (2.0 + e)
    return tl.where(u < 0, -t, t)


@triton.jit
def nan_max(a, b):
    # max that propagates NaN (Triton's default, like fmax, drops it): a NaN logit must
    # make its row's lse NaN, not vanish from the statistics.
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_max_reduce(v):
    """The NaN-propagating max of a 1-D block."""
    return tl.reduce(v, 0, nan_max)


@triton.jit
def _softcap_slope(z, cap):
    # d(c tanh(z / c)) / dz = sech(u)^2 = 4 w / (1 + w)^2, w = exp(-2|u|): accurate where the
    # cap saturates, which 1 - tanh(u)^2 cancels to rounding noise.
    w = tl.exp(-2.0 * tl.abs(z / cap))
    return 4.0 * w / ((1.0 + w) * (1.0 + w))


@triton.jit
def _logits(z_ptrs, b_ptr, cols, mask, HAS_BIAS: tl.constexpr):
    z = tl.load(z_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return z


@triton.jit
def _capped_logits(z_ptrs, b_ptr, cols, mask, cap, HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr):
    z = _logits(z_ptrs, b_ptr, cols, mask, HAS_BIAS)
    if HAS_CAP:
        z = cap * _tanh(z / cap)
    return z


@triton.jit
def row_stats(z_row_ptr, b_ptr, cw_ptr, y, C, cap, scale,
               HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_CAP: tl.constexpr, NEED_WS: tl.constexpr,
               BLOCK: tl.constexpr):
    """(m, l, s_y, ws) of one row's C logits: m = max and l = sum of exp(scale * s - m), s_y = s
    at column y (0 unless y lies in [0, C)), ws = sum_j cw_j s_j (0 unless NEED_WS); b_ptr and
    cw_ptr point at the row's first column. Per-lane running values, reduced at the end; one
    exponential per logit (the lane's sum is rescaled only when its max grows), s_y read once."""
    m_vec = tl.full([BLOCK], -float("inf"), tl.float32)
    l_vec = tl.zeros([BLOCK], tl.float32)
    ws_vec = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        s = _capped_logits(z_row_ptr + offs, b_ptr, offs, mask, cap, HAS_BIAS, HAS_CAP)
        s_in = tl.where(mask, s * scale, -float("inf"))
        # Of exp(m - s) (a new max: l = l e + 1) and exp(s - m) (l = l + e) one is needed;
        # a -inf logit (or a masked lane) adds nothing, also against a lane that saw only -inf.
        d = s_in - m_vec
        e = tl.where(s_in == -float("inf"), 0.0, tl.exp(-tl.abs(d)))
        l_vec = tl.where(d > 0, l_vec * e + 1.0, l_vec + e)
        m_vec = nan_max(m_vec, s_in)
        if NEED_WS:
            if HAS_CW:
                s = s * tl.load(cw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            ws_vec += tl.where(mask, s, 0.0)
    m = nan_max_reduce(m_vec)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    l = tl.sum(tl.where(m_vec == -float("inf"), 0.0, l_vec * tl.exp(m_vec - m_safe)), axis=0)
    y_in = (y >= 0) & (y < C)
    y_col = tl.where(y_in, y, 0)
    s_y = _capped_logits(z_row_ptr + y_col, b_ptr, y_col, y_in, cap, HAS_BIAS, HAS_CAP)
    return m, l, s_y, tl.sum(ws_vec, axis=0)


@triton.jit
def _block_stats_kernel(
    z_ptr, stride_zr,            # [R, C] logits block
    b_ptr, cw_ptr,               # [V] bias, class weights (unused unless HAS_BIAS / HAS_CW)
    y_ptr,                       # [R] int64 target (any value)
    m_ptr, l_ptr, sy_ptr, ws_ptr,  # [R] fp32 running statistics, updated in place
    C, v0, cap, scale,           # the statistics are those of scale * s
    HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_CAP: tl.constexpr, NEED_WS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m_blk, l_blk, sy, ws = row_stats(z_ptr + row * stride_zr, b_ptr + v0, cw_ptr + v0, tl.load(y_ptr + row) - v0,
                                      C, cap, scale, HAS_BIAS, HAS_CW, HAS_CAP, NEED_WS, BLOCK)
    m_old = tl.load(m_ptr + row)
    m = nan_max(m_old, m_blk)
    m_safe = tl.where(m == -float("inf"), 0.0, m)
    l_new = tl.load(l_ptr + row) * tl.exp(m_old - m_safe) + tl.where(m_blk == -float("inf"), 0.0, l_blk * tl.exp(m_blk - m_safe))
    tl.store(l_ptr + row, l_new)
    tl.store(m_ptr + row, m)
    tl.store(sy_ptr + row, tl.load(sy_ptr + row) + sy)
    tl.store(ws_ptr + row, tl.load(ws_ptr + row) + ws)


@triton.jit
def row_grad(z_row_ptr, dz_row_ptr, b_ptr, cw_ptr, y, lse, p_coef, t_coef, s_coef, p2_coef, lse2, C, cap, scale,
             filter_eps, tiles_ptr, target_ptr,
             HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_P2: tl.constexpr,
             FILTER: tl.constexpr, BLOCK: tl.constexpr):
    """Write one row's dz = (P exp(scale s - lse) [+ P2 exp(s - lse2)] - T [j == y] - S cw_j)
    * softcap'(z) over its C columns; b_ptr and cw_ptr point at the row's first column.

    FILTER (gradient filtering): the target's term -T softcap'(z_y) is left out of dz and
    stored at target_ptr (when y lies in [0, C)); tiles_ptr[t] is set to 1 for each tile t of
    BLOCK columns holding an entry above filter_eps * max(|P|, |T|) in magnitude."""
    if FILTER:
        threshold = filter_eps * tl.maximum(tl.abs(p_coef), tl.abs(t_coef))
        y_in = (y >= 0) & (y < C)
        if HAS_CAP:  # softcap'(z_y), from the target's one logit
            z_y = _logits(z_row_ptr + tl.where(y_in, y, 0), b_ptr, tl.where(y_in, y, 0), y_in, HAS_BIAS)
            tl.store(target_ptr, -t_coef * _softcap_slope(z_y, cap), mask=y_in)
        else:
            tl.store(target_ptr, -t_coef, mask=y_in)
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        z = _logits(z_row_ptr + offs, b_ptr, offs, mask, HAS_BIAS)
        s = cap * _tanh(z / cap) if HAS_CAP else z
        dz = p_coef * tl.exp(s * scale - lse)
        if not FILTER:
            dz -= tl.where(offs == y, t_coef, 0.0)
        if HAS_P2:
            dz += p2_coef * tl.exp(s - lse2)
        if HAS_CW:
            dz -= s_coef * tl.load(cw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            dz -= s_coef
        if HAS_CAP:
            dz *= _softcap_slope(z, cap)
        if FILTER:
            # A tile holding NaN is kept: its NaN must reach the gradients.
            tile_max = nan_max_reduce(tl.where(mask, tl.abs(dz), 0.0))
            tl.store(tiles_ptr + c0 // BLOCK, 1, mask=(tile_max <= threshold) == 0)
        tl.store(dz_row_ptr + offs, dz.to(dz_row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _block_grad_kernel(
    z_ptr, stride_zr,            # [R, C] logits block
    dz_ptr, stride_dr,           # [R, C] output (may be z itself)
    b_ptr, cw_ptr,               # [V]
    y_ptr, lse_ptr,              # [R] int64 target (any value), fp32 lse of scale * s
    p_ptr, t_ptr, s_ptr,         # [R] fp32 coefficients: dz = P p - T [j == y] - S cw_j
    p2_ptr, lse2_ptr,            # [R] fp32, with HAS_P2: dz += P2 exp(s - lse2)
    tiles_ptr, target_ptr,       # with FILTER: [ceil(C / BLOCK)] int32 tile flags, [R] fp32 target terms
    C, v0, cap, scale, filter_eps,  # p = exp(scale * s - lse)
    HAS_BIAS: tl.constexpr, HAS_CW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_P2: tl.constexpr,
    FILTER: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p2_coef, lse2 = 0.0, 0.0
    if HAS_P2:
        p2_coef = tl.load(p2_ptr + row)
        lse2 = tl.load(lse2_ptr + row)
    row_grad(z_ptr + row * stride_zr, dz_ptr + row * stride_dr, b_ptr + v0, cw_ptr + v0, tl.load(y_ptr + row) - v0,
             tl.load(lse_ptr + row), tl.load(p_ptr + row), tl.load(t_ptr + row), tl.load(s_ptr + row), p2_coef, lse2,
             C, cap, scale, filter_eps, tiles_ptr, target_ptr + row,
             HAS_BIAS, HAS_CW, HAS_CAP, HAS_P2, FILTER, BLOCK)


@triton.jit
def _scale_kernel(t_ptr, g_ptr, n, BLOCK: tl.constexpr):
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:  # the usual upstream gradient of a loss: nothing to read or write
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        t = tl.load(t_ptr + offs, mask=mask)
        tl.store(t_ptr + offs, (t.to(tl.float32) * g).to(t_ptr.dtype.element_ty), mask=mask)


def scale_(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """t *= g in place, in fp32 (g: a 0-d device tensor); when g == 1 the kernel returns
    without touching t (a dense grad_weight is 2 V D bytes to read and write). Returns t."""
    if not t.is_contiguous():
        return t.copy_(t.float() * g)  # not g rounded to t's dtype first
    _scale_kernel[(triton.cdiv(t.numel(), 4096),)](t, g, t.numel(), BLOCK=4096, num_warps=8)
    return t


def arg_or(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """t, or `like` standing in for an optional pointer argument the kernel will not read."""
    return like if t is None else t


@triton.jit
def _put_entries_kernel(
    dz_ptr, stride_dr,           # [R, C] block, columns v0..v0+C
    ids_ptr, val_ptr,            # [R, K] int64 column ids (any value), fp32 values
    K, C, v0,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    cols = tl.load(ids_ptr + row * K + ks, mask=ks < K, other=-1) - v0
    vals = tl.load(val_ptr + row * K + ks, mask=ks < K, other=0.0)
    mask = (ks < K) & (cols >= 0) & (cols < C)
    tl.store(dz_ptr + row * stride_dr + cols, vals.to(dz_ptr.dtype.element_ty), mask=mask)


def block_stats_(z_RC, v0: int, b_V, cw_V, y_R, m_R, l_R, sy_R, ws_R, softcap, need_ws: bool, scale: float = 1.0) -> None:
    """Merge logits block z [R, C] (columns v0..v0+C) into the running statistics, in place.

    y_R: int64 targets (any value; only those in [v0, v0+C) are picked up);
    m/l/sy/ws_R: fp32 [R], start at (-inf, 0, 0, 0); m and l are those of scale * s, s_y
    and ws of s.
    """
    R, C = z_RC.shape
    if R == 0:
        return
    _block_stats_kernel[(R,)](
        z_RC, z_RC.stride(0), arg_or(b_V, z_RC), arg_or(cw_V, z_RC), y_R, m_R, l_R, sy_R, ws_R,
        C, v0, 1.0 if softcap is None else float(softcap), float(scale),
        HAS_BIAS=b_V is not None, HAS_CW=cw_V is not None, HAS_CAP=softcap is not None, NEED_WS=need_ws,
        BLOCK=min(BLOCK_COLS, triton.next_power_of_2(C)), num_warps=8,
    )


def block_grad_(z_RC, dz_RC, v0: int, b_V, cw_V, y_R, lse_R, p_R, t_R, s_R, softcap, scale: float = 1.0,
                second=None, tile_filter=None) -> None:
    """Write dz [R, C] for logits block z [R, C] (columns v0..v0+C); dz may be z itself.

    dz = (P exp(scale s - lse) [+ P2 exp(s - lse2)] - T [j == y] - S cw_j) * softcap'(z),
    with second = (P2, lse2), fp32 [R] each, or None. tile_filter: a `TileFilter` for
    gradient filtering (the target term goes to its `target`, not into dz), or None.
    """
    R, C = z_RC.shape
    if R == 0:
        return
    p2_R, lse2_R = (lse_R, lse_R) if second is None else second
    f = tile_filter
    _block_grad_kernel[(R,)](
        z_RC, z_RC.stride(0), dz_RC, dz_RC.stride(0), arg_or(b_V, z_RC), arg_or(cw_V, z_RC),
        y_R, lse_R, p_R, t_R, s_R, p2_R, lse2_R, *((lse_R, lse_R) if f is None else (f.tiles, f.target)),
        C, v0, 1.0 if softcap is None else float(softcap), float(scale), 0.0 if f is None else f.eps,
        HAS_BIAS=b_V is not None, HAS_CW=cw_V is not None, HAS_CAP=softcap is not None, HAS_P2=second is not None,
        FILTER=f is not None, BLOCK=grad_block(C, f), num_warps=8,
    )


def grad_block(C: int, tile_filter) -> int:
    """Columns per step of `row_grad`: the filter's tile width when filtering."""
    return FILTER_COLS if tile_filter is not None else min(BLOCK_COLS, triton.next_power_of_2(C))


class TileFilter:
    """Gradient filtering over one block of whole rows [R, C]: `tiles` [ceil(C / FILTER_COLS)]
    int32 flags (1: some entry of that column tile is kept), `target` [R] fp32 target terms
    -T softcap'(z_y) (0 where the target is not a column of the block), threshold `eps`."""

    def __init__(self, eps: float, rows: int, cols: int, device):
        self.eps = float(eps)
        self.tiles = torch.zeros(triton.cdiv(cols, FILTER_COLS), dtype=torch.int32, device=device)
        self.target = torch.zeros(rows, dtype=torch.float32, device=device)


def put_entries_(dz_RC, v0: int, ids_RK, values_RK) -> None:
    """dz[r, ids[r, k] - v0] = values[r, k] where that column lies in the block [v0, v0+C);
    ids int64 [R, K] (other ids are skipped), values fp32 [R, K]. Equal ids of a row must
    carry equal values."""
    R, C = dz_RC.shape
    K = ids_RK.shape[1]
    if R == 0 or K == 0:
        return
    _put_entries_kernel[(R,)](dz_RC, dz_RC.stride(0), ids_RK, values_RK, K, C, v0,
                              BLOCK_K=triton.next_power_of_2(K), num_warps=1)

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
    after it; with watch=False (compiled or captured code, which never asks) it is not copied."""

    def __init__(self, y_N: torch.Tensor, cw_V, ignore_index: int, vocab: int, watch: bool = True):
        self._args = (y_N, cw_V, ignore_index, vocab)
        self._watch = watch
        self._counts = None  # [2] fp32 on the device once launched
        self._bad = None  # the bad count on the host (pinned), behind `_event`
        self._event = None

    def launch(self) -> None:
        """Queue the check (once)."""
        if self._counts is not None:
            return
        self._counts = check_targets(*self._args)
        if self._counts.is_cuda and self._watch:
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
            BLOCK_STATS=min(WHOLE_ROW_STATS_COLS, triton.next_power_of_2(V)), BLOCK=grad_block(V, f),
            num_warps=WHOLE_ROW_STATS_WARPS if V >= WHOLE_ROW_STATS_COLS else 8,
        )

    def losses_(self, m_R, l_R, sy_R, ws_R, rs: slice, lse_R, loss_R) -> None:
        """lse = m + log(l) and the row losses of rows rs from their statistics (all [R] fp32)."""
        R, o = m_R.shape[0], self.opts
        self.check.launch()  # the call's first per-row kernel queues the check
        if R == 0:
            return
        _ce_losses_kernel[(triton.cdiv(R, ROW_KERNEL_ROWS),)](
            m_R, l_R, sy_R, ws_R, self.y[rs], arg_or(self.cw, m_R), arg_or(self.cw_sum, m_R), lse_R, loss_R,
            R, self.vocab, o.ignore_index, o.label_smoothing, o.z_loss,
            HAS_CW=self.cw is not None, HAS_LS=o.label_smoothing > 0, HAS_Z=o.z_loss > 0, BLOCK_R=ROW_KERNEL_ROWS,
        )

    def coefficients(self, lse_R, grad_loss, grad_lse_R, rs: slice):
        """(P, T, S), fp32 [R] each, of rows rs; grad_loss: 0-d, or [N] for reduction "none"
        (read at rs); grad_lse_R: [R] or None."""
        R, o = lse_R.shape[0], self.opts
        p_R, t_R, s_R = (torch.empty_like(lse_R) for _ in range(3))
        if R == 0:
            return p_R, t_R, s_R
        g = grad_loss[rs] if grad_loss.ndim else grad_loss
        _ce_coefficients_kernel[(triton.cdiv(R, ROW_KERNEL_ROWS),)](
            lse_R, self.y[rs], arg_or(self.cw, lse_R), arg_or(self.cw_sum, lse_R), g, g.stride(0) if g.ndim else 0,
            arg_or(self.denominator, lse_R), arg_or(grad_lse_R, lse_R), p_R, t_R, s_R,
            R, self.vocab, o.ignore_index, o.label_smoothing, o.z_loss,
            HAS_CW=self.cw is not None, MEAN=o.reduction == "mean", HAS_GLSE=grad_lse_R is not None, BLOCK_R=ROW_KERNEL_ROWS,
        )
        return p_R, t_R, s_R

    def reduce(self, loss_N: torch.Tensor) -> torch.Tensor:
        """The reduced loss from the row losses [N]."""
        if self.opts.reduction == "none":
            return loss_N
        total = loss_N.sum()
        return total / self.denominator if self.opts.reduction == "mean" else total
