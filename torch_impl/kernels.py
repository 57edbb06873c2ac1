"""Triton kernels over one block of logits z [R, C] (R rows, C vocabulary columns at
column offset v0): the elementwise and row-wise work between the matrix products.

- `block_stats_`: merges the block into running per-row statistics (online max m, sum of
  exponentials l of scale * s, s at the target s_y, class-weighted sum ws), so
  lse = m + log(l) once every column block of the rows has been seen.
- `block_grad_`: turns the block into dz (interop/SPEC.md), in place or into another
  buffer, from per-row lse and coefficients (P, T, S), optionally with a second softmax
  term (distillation at a temperature: interop/SPEC-DISTILLATION.md).
- `put_entries_`: overwrites up to K given entries per row of a block (the exact values
  of a top-K teacher's positions).

Both apply the bias and the softcap on the fly; z is read in its own dtype and the math is
fp32. One program handles one row of the block, looping over its columns; the per-row loops
are the device functions `row_stats` and `row_grad`, which `torch_impl.ce_kernels` reuses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 2048
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
        return t.mul_(g.to(t.dtype))
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
        BLOCK=min(BLOCK_C, triton.next_power_of_2(C)), num_warps=8,
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
    return FILTER_COLS if tile_filter is not None else min(BLOCK_C, triton.next_power_of_2(C))


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
