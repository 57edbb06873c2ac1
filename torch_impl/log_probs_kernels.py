"""Triton kernels of `linear_log_probs` (interop/SPEC.md, "Log-probabilities") over one block
of logits z [R, C] (columns v0..v0+C, no bias; z read in its own dtype, the math in fp32):

- `log_prob_stats_`: merges the block into running per-row statistics of u = softcap(z + b) / T:
  the max m, l = sum exp(u - m), a = sum exp(u - m) (u - m), the largest u and its first
  column, and u at the target. Once every column block is merged, lse = m + log l and the
  entropy H = log l - a / l (both terms small, so a peaked row keeps its digits).
- `log_prob_grad_`: writes dz = (g ([j == y] - p_j) - h p_j (log p_j + H)) / T * softcap'(z),
  in place or into another buffer, from the per-row lse, H and upstream gradients g, h.

One program per row, looping over its columns.
"""

from __future__ import annotations

import triton
import triton.language as tl

from interop.tuning import BLOCK_COLS
from torch_impl.kernels import _capped_logits, _logits, _softcap_slope, _tanh, arg_or, nan_max, nan_max_reduce


@triton.jit
def _merge(m, l, a, m_new, l_new, a_new):
    # (m, l, a) and (m_new, l_new, a_new) of two sets of values as one set's: each (l, a) is
    # rescaled to the larger max (a = sum e^(u - m) (u - m) gains l (m - M) from the shift);
    # a set that saw only -inf adds nothing.
    big = nan_max(m, m_new)
    safe = tl.where(big == -float("inf"), 0.0, big)
    f, f_new = tl.exp(m - safe), tl.exp(m_new - safe)
    part = tl.where(m == -float("inf"), 0.0, f * (a + l * (m - safe)))
    part_new = tl.where(m_new == -float("inf"), 0.0, f_new * (a_new + l_new * (m_new - safe)))
    return big, tl.where(m == -float("inf"), 0.0, l * f) + tl.where(m_new == -float("inf"), 0.0, l_new * f_new), part + part_new


@triton.jit
def _best(v, i, v_new, i_new):
    # the larger value and its index, a NaN counting as the largest, the first index on ties
    take = (v_new > v) | ((v_new != v_new) & (v == v)) | ((v_new == v) & (i_new < i)) | \
        ((v_new != v_new) & (v != v) & (i_new < i))
    return tl.where(take, v_new, v), tl.where(take, i_new, i)


@triton.jit
def _log_prob_stats_kernel(
    z_ptr, stride_zr,                # [R, C] logits block
    b_ptr,                           # [V] bias (unused unless HAS_BIAS)
    y_ptr,                           # [R] int64 target (any value)
    m_ptr, l_ptr, a_ptr,             # [R] fp32 running statistics of u, updated in place
    best_ptr, idx_ptr, uy_ptr,       # [R] fp32 largest u, int64 its column, fp32 u at the target
    C, v0, cap, inv_t,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_zr
    m_vec = tl.full([BLOCK], -float("inf"), tl.float32)
    l_vec = tl.zeros([BLOCK], tl.float32)
    a_vec = tl.zeros([BLOCK], tl.float32)
    best_vec = tl.full([BLOCK], -float("inf"), tl.float32)
    # the block's own columns (C < 2^31) in int32 in the loop, which 64-bit compares and
    # selects would slow; v0 is added once at the end
    idx_vec = tl.full([BLOCK], 2**31 - 1, tl.int32)
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        u = tl.where(mask, _capped_logits(z_row + offs, b_ptr + v0, offs, mask, cap, HAS_BIAS, HAS_CAP) * inv_t, -float("inf"))
        m_vec, l_vec, a_vec = _merge(m_vec, l_vec, a_vec, u, tl.where(u == -float("inf"), 0.0, 1.0), tl.zeros([BLOCK], tl.float32))
        best_vec, idx_vec = _best(best_vec, idx_vec, u, tl.where(mask, offs, 2**31 - 1))
    m = nan_max_reduce(m_vec)
    safe = tl.where(m == -float("inf"), 0.0, m)
    f = tl.where(m_vec == -float("inf"), 0.0, tl.exp(m_vec - safe))
    l_blk = tl.sum(l_vec * f, axis=0)
    a_blk = tl.sum(tl.where(m_vec == -float("inf"), 0.0, f * (a_vec + l_vec * (m_vec - safe))), axis=0)
    best = nan_max_reduce(best_vec)
    tie = tl.where(best != best, best_vec != best_vec, best_vec == best)
    col = tl.min(tl.where(tie, idx_vec, 2**31 - 1), axis=0)
    idx = tl.where(col == 2**31 - 1, 2**62, col.to(tl.int64) + v0)
    m_run, l_run, a_run = _merge(tl.load(m_ptr + row), tl.load(l_ptr + row), tl.load(a_ptr + row), m, l_blk, a_blk)
    tl.store(m_ptr + row, m_run)
    tl.store(l_ptr + row, l_run)
    tl.store(a_ptr + row, a_run)
    best_run, idx_run = _best(tl.load(best_ptr + row), tl.load(idx_ptr + row), best, idx)
    tl.store(best_ptr + row, best_run)
    tl.store(idx_ptr + row, idx_run)
    y = tl.load(y_ptr + row) - v0
    y_in = (y >= 0) & (y < C)
    y_col = tl.where(y_in, y, 0)
    u_y = _capped_logits(z_row + y_col, b_ptr + v0, y_col, y_in, cap, HAS_BIAS, HAS_CAP) * inv_t
    tl.store(uy_ptr + row, tl.load(uy_ptr + row) + tl.where(y_in, u_y, 0.0))


@triton.jit
def _log_prob_grad_kernel(
    z_ptr, stride_zr, dz_ptr, stride_dr,   # [R, C] logits block, dz output (may be z itself)
    b_ptr, y_ptr,                          # [V] bias, [R] int64 target (any value)
    lse_ptr, h_ptr, g_ptr, gh_ptr,         # [R] fp32 lse and entropy of u, upstream gradients of log p(y) and H
    C, v0, cap, inv_t,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, HAS_H: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    y = tl.load(y_ptr + row) - v0
    lse, g = tl.load(lse_ptr + row), tl.load(g_ptr + row)
    entropy, g_h = 0.0, 0.0
    if HAS_H:
        entropy, g_h = tl.load(h_ptr + row), tl.load(gh_ptr + row)
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        z = _logits(z_ptr + row * stride_zr + offs, b_ptr + v0, offs, mask, HAS_BIAS)
        s = cap * _tanh(z / cap) if HAS_CAP else z
        log_p = s * inv_t - lse
        p = tl.exp(log_p)
        du = tl.where(offs == y, g, 0.0) - g * p
        if HAS_H:  # dH/du_j = -p_j (log p_j + H); 0 where p_j is (log p_j = -inf)
            du -= g_h * tl.where(p == 0.0, 0.0, p * (log_p + entropy))
        dz = du * inv_t
        if HAS_CAP:
            dz *= _softcap_slope(z, cap)
        tl.store(dz_ptr + row * stride_dr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def log_prob_stats_(z_RC, v0: int, b_V, y_R, running, softcap, inv_t: float) -> None:
    """Merge logits block z [R, C] into `running` (m, l, a, best, idx, u_y: [R] each, fp32
    but idx int64; they start at (-inf, 0, 0, -inf, 0, 0): a row of -inf keeps column 0), in place."""
    R, C = z_RC.shape
    if R == 0:
        return
    _log_prob_stats_kernel[(R,)](
        z_RC, z_RC.stride(0), arg_or(b_V, z_RC), y_R, *running, C, v0, 1.0 if softcap is None else float(softcap),
        float(inv_t), HAS_BIAS=b_V is not None, HAS_CAP=softcap is not None,
        BLOCK=min(BLOCK_COLS, triton.next_power_of_2(C)), num_warps=8,
    )


def log_prob_grad_(z_RC, dz_RC, v0: int, b_V, y_R, lse_R, entropy_R, g_R, g_h_R, softcap, inv_t: float) -> None:
    """Write dz [R, C] of logits block z [R, C] (dz may be z itself); entropy_R and g_h_R
    None when the entropy has no upstream gradient."""
    R, C = z_RC.shape
    if R == 0:
        return
    has_h = g_h_R is not None
    _log_prob_grad_kernel[(R,)](
        z_RC, z_RC.stride(0), dz_RC, dz_RC.stride(0), arg_or(b_V, z_RC), y_R, lse_R, entropy_R if has_h else lse_R,
        g_R, g_h_R if has_h else lse_R, C, v0, 1.0 if softcap is None else float(softcap), float(inv_t),
        HAS_BIAS=b_V is not None, HAS_CAP=softcap is not None, HAS_H=has_h,
        BLOCK=min(BLOCK_COLS, triton.next_power_of_2(C)), num_warps=8,
    )
