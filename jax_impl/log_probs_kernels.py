"""Pallas kernels of `linear_log_probs` over one block of logits z [R, C] (columns v0..v0+C),
as `torch_impl.log_probs_kernels` (which says what the statistics hold):

- `log_prob_stats`: merges the block into running per-row statistics of u = softcap(z + b) / T
  (m, l, a, the largest u and its first column, u at the target); returns the new ones.
- `log_prob_grad`: dz = (g ([j == y] - p_j) - h p_j (log p_j + H)) / T * softcap'(z), written
  over z.

One program per row, looping over its columns; the Triton lowering of `pallas_call`, with the
NaN-keeping maxima of `jax_impl.kernels`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from interop.tuning import JAX_ROW_KERNEL_PARAMS
from jax_impl.kernels import (_block, _capped, _grad_columns, _load_scalar, _store_dz, _store_scalar, column_loop,
                              max_keep_nan, pallas, reduce_max_keep_nan)

NO_COLUMN = 2**30  # an index above any column: the running argmax before its first value


def merge_running(m, l, a, m_new, l_new, a_new):
    """(m, l, a) of two sets of values as one set's: each (l, a) rescaled to the larger max
    (a = sum e^(u - m) (u - m) gains l (m - M)); a set that saw only -inf adds nothing."""
    ninf = -jnp.inf
    big = max_keep_nan(m, m_new)
    safe = jnp.where(big == ninf, 0.0, big)
    l_out, a_out = 0.0, 0.0
    for mx, lx, ax in ((m, l, a), (m_new, l_new, a_new)):
        f = jnp.exp(mx - safe)
        l_out = l_out + jnp.where(mx == ninf, 0.0, lx * f)
        a_out = a_out + jnp.where(mx == ninf, 0.0, f * (ax + lx * (mx - safe)))
    return big, l_out, a_out


def larger_first(v, i, v_new, i_new):
    """The larger value and its index: a NaN counts as the largest, the first index wins ties."""
    nan, nan_new = jnp.isnan(v), jnp.isnan(v_new)
    take = (v_new > v) | (nan_new & ~nan) | (((v_new == v) | (nan_new & nan)) & (i_new < i))
    return jnp.where(take, v_new, v), jnp.where(take, i_new, i)


def _stats_kernel(v0_ref, z_ref, *refs, C, cap, inv_t, has_bias, block):
    b_ref = refs[0] if has_bias else None
    y_ref, *ins_outs = refs[int(has_bias):]
    ins, outs = ins_outs[:6], ins_outs[6:]
    row = pl.program_id(0)
    v0 = _load_scalar(v0_ref, 0)
    y = _load_scalar(y_ref, row) - v0
    ninf = jnp.float32(-jnp.inf)

    def body(i, carry):
        m_vec, l_vec, a_vec, best_vec, idx_vec, uy_vec = carry
        start = i * block
        offs = start + jnp.arange(block)
        mask = offs < C
        u = jnp.where(mask, _capped(z_ref, b_ref, row, v0, start, block, mask, cap) * inv_t, ninf)
        m_vec, l_vec, a_vec = merge_running(m_vec, l_vec, a_vec, u, jnp.where(u == ninf, 0.0, 1.0), jnp.zeros_like(u))
        best_vec, idx_vec = larger_first(best_vec, idx_vec, u, jnp.where(mask, v0 + offs, NO_COLUMN).astype(jnp.int32))
        return m_vec, l_vec, a_vec, best_vec, idx_vec, uy_vec + jnp.where((offs == y) & mask, u, 0.0)

    zeros = jnp.zeros((block,), jnp.float32)
    init = (jnp.full((block,), ninf), zeros, zeros, jnp.full((block,), ninf), jnp.full((block,), NO_COLUMN, jnp.int32),
            zeros)
    m_vec, l_vec, a_vec, best_vec, idx_vec, uy_vec = column_loop(C, block, body, init)
    m = reduce_max_keep_nan(m_vec)
    safe = jnp.where(m == ninf, 0.0, m)
    f = jnp.where(m_vec == ninf, 0.0, jnp.exp(m_vec - safe))
    l_blk = jnp.sum(l_vec * f)
    a_blk = jnp.sum(jnp.where(m_vec == ninf, 0.0, f * (a_vec + l_vec * (m_vec - safe))))
    best = reduce_max_keep_nan(best_vec)
    tie = jnp.where(jnp.isnan(best), jnp.isnan(best_vec), best_vec == best)
    idx = jnp.min(jnp.where(tie, idx_vec, NO_COLUMN))
    old = [_load_scalar(ref, row) for ref in ins]
    m_run, l_run, a_run = merge_running(old[0], old[1], old[2], m, l_blk, a_blk)
    best_run, idx_run = larger_first(old[3], old[4], best, idx)
    for ref, value in zip(outs, (m_run, l_run, a_run, best_run, idx_run, old[5] + jnp.sum(uy_vec))):
        _store_scalar(ref, row, value)


def _grad_kernel(v0_ref, z_ref, *refs, C, cap, inv_t, has_bias, has_h, block):
    b_ref = refs[0] if has_bias else None
    y_ref, lse_ref, h_ref, g_ref, gh_ref, dz_ref = refs[int(has_bias):]
    row = pl.program_id(0)
    v0 = _load_scalar(v0_ref, 0)
    y = _load_scalar(y_ref, row) - v0
    lse, g = _load_scalar(lse_ref, row), _load_scalar(g_ref, row)
    if has_h:
        entropy, g_h = _load_scalar(h_ref, row), _load_scalar(gh_ref, row)

    def body(i, carry):
        start = i * block
        offs, mask, z, s = _grad_columns(z_ref, b_ref, row, v0, start, block, C, cap)
        log_p = s * inv_t - lse
        p = jnp.exp(log_p)
        du = jnp.where(offs == y, g, 0.0) - g * p
        if has_h:  # dH/du_j = -p_j (log p_j + H); 0 where p_j is (log p_j = -inf)
            du = du - g_h * jnp.where(p == 0.0, 0.0, p * (log_p + entropy))
        _store_dz(dz_ref, row, start, block, mask, du * inv_t, z, cap)
        return carry

    column_loop(C, block, body, 0)


def log_prob_stats(z_RC, v0, b_V, y_R, running, softcap, inv_t: float, interpret: bool):
    """Merge logits block z [R, C] (columns v0..v0+C; v0 an int32 [1] array) into `running`
    = (m, l, a, best, idx, u_y), fp32 [R] each but idx int32; returns the new ones."""
    R, C = z_RC.shape
    kernel = functools.partial(_stats_kernel, C=C, cap=softcap, inv_t=float(inv_t), has_bias=b_V is not None,
                               block=_block(C))
    args = [v0, z_RC] + ([] if b_V is None else [b_V]) + [y_R, *running]
    first = len(args) - 6
    return tuple(pallas(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((R,), r.dtype) for r in running],
        grid=(R,),
        input_output_aliases={first + k: k for k in range(6)},
        interpret=interpret,
        compiler_params=plt.CompilerParams(**JAX_ROW_KERNEL_PARAMS),
    )(*args))


def log_prob_grad(z_RC, v0, b_V, y_R, lse_R, entropy_R, g_R, g_h_R, softcap, inv_t: float, interpret: bool):
    """dz [R, C] (z's dtype, written over z) of logits block z; g_h_R None when the entropy
    has no upstream gradient."""
    R, C = z_RC.shape
    has_h = g_h_R is not None
    kernel = functools.partial(_grad_kernel, C=C, cap=softcap, inv_t=float(inv_t), has_bias=b_V is not None,
                               has_h=has_h, block=_block(C))
    return pallas(
        kernel,
        out_shape=jax.ShapeDtypeStruct((R, C), z_RC.dtype),
        grid=(R,),
        input_output_aliases={1: 0},
        interpret=interpret,
        compiler_params=plt.CompilerParams(**JAX_ROW_KERNEL_PARAMS),
    )(v0, z_RC, *([] if b_V is None else [b_V]), y_R, lse_R, entropy_R if has_h else lse_R, g_R,
      g_h_R if has_h else lse_R)
