"""A Pallas kernel that computes the row statistics of x W^T without writing any logits:
each program multiplies a tile of rows by the tiles of W's columns in one vocabulary split
and merges every [BM, BN] tile of logits, in registers, into running per-row statistics.

It serves the forward pass of "memory" (`jax_impl.blocked`), which only needs lse, the
target's logit and, with label smoothing, the class-weighted sum of the logits: no logits
block, no copy of W's column slices, no second pass over the logits, so a forward pass
without gradients is faster than XLA's products into blocks followed by
`kernels.block_stats`, although the product itself runs slower than XLA's. Each fp32 tile of logits is rounded to the
input dtype before it enters the statistics: the backward pass recomputes the logits in
that dtype (XLA's products, `row_products.logits`), and p = exp(s - lse) from those sums
to 1 only if lse comes from the same values (fp32 statistics against bf16 logits make the
gradient's error grow with the logits' scale: 21 times naive bf16's at |z| ~ 300).
Triton lowering of `pallas_call`, as `jax_impl.kernels`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from interop.tuning import FUSED_STATS_K_BYTES, FUSED_STATS_PARAMS, FUSED_STATS_TILE
from jax_impl.kernels import max_keep_nan, pallas, reduce_max_keep_nan

BM, BN = FUSED_STATS_TILE  # rows, vocabulary columns of a logits tile


def _kernel(n_ref, x_ref, w_ref, *refs, N, V, D, bk, split, vd, cap, has_bias, has_cw, need_ws):
    b_ref = refs[0] if has_bias else None
    cw_ref = refs[int(has_bias)] if has_cw else None
    y_ref, m_ref, l_ref, sy_ref, ws_ref = refs[int(has_bias) + int(has_cw):]
    i, s = pl.program_id(0), pl.program_id(1)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    ninf = jnp.float32(-jnp.inf)

    @pl.when(i * BM < n_ref[0])
    def _():
        rows = i * BM + jnp.arange(BM, dtype=jnp.int32)
        row_mask = rows < N
        y = plt.load(y_ref.at[pl.ds(i * BM, BM)], mask=row_mask, other=-1)
        c0 = s * split
        end = jnp.minimum(V, c0 + split)

        def tile(j, carry):
            m, l, sy, ws = carry
            start = c0 + j * BN
            cols = start + jnp.arange(BN, dtype=jnp.int32)
            col_mask = cols < V

            def step(k, acc):
                ks = k * bk + jnp.arange(bk, dtype=jnp.int32)
                k_mask = ks < D
                x_mask = row_mask[:, None] & k_mask[None, :]
                x = plt.load(x_ref.at[pl.ds(i * BM, BM), pl.ds(k * bk, bk)], mask=x_mask, other=0.0)
                if vd:
                    w_tile, w_mask = w_ref.at[pl.ds(start, BN), pl.ds(k * bk, bk)], col_mask[:, None] & k_mask[None, :]
                else:
                    w_tile, w_mask = w_ref.at[pl.ds(k * bk, bk), pl.ds(start, BN)], k_mask[:, None] & col_mask[None, :]
                w = plt.load(w_tile, mask=w_mask, other=0.0)
                dims = (((1,), (1 if vd else 0,)), ((), ()))
                return acc + jax.lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32)

            z = jax.lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(D, bk)), step, jnp.zeros((BM, BN), jnp.float32))
            z = z.astype(x_ref.dtype).astype(jnp.float32)  # the logits the backward pass recomputes
            if b_ref is not None:
                z = z + plt.load(b_ref.at[pl.ds(start, BN)], mask=col_mask, other=0.0).astype(jnp.float32)[None, :]
            if cap is not None:
                z = cap * jnp.tanh(z / cap)
            z_in = jnp.where(col_mask[None, :], z, ninf)
            m_new = max_keep_nan(m, reduce_max_keep_nan(z_in, axis=1))
            l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z_in - m_new[:, None]), axis=1)
            sy = sy + jnp.sum(jnp.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
            if need_ws:
                if cw_ref is not None:
                    z = z * plt.load(cw_ref.at[pl.ds(start, BN)], mask=col_mask, other=0.0).astype(jnp.float32)[None, :]
                ws = ws + jnp.sum(jnp.where(col_mask[None, :], z, 0.0), axis=1)
            return m_new, l, sy, ws

        zeros = jnp.zeros((BM,), jnp.float32)
        init = (jnp.full((BM,), ninf), zeros, zeros, zeros)
        stats = jax.lax.fori_loop(jnp.int32(0), (end - c0 + BN - 1) // BN, tile, init)
        for ref, value in zip((m_ref, l_ref, sy_ref, ws_ref), stats):
            plt.store(ref.at[s, pl.ds(i * BM, BM)], value, mask=row_mask)


def row_stats(x_ND, W, b_V, cw_V, y_N, n_rows, weight_layout: str, softcap, need_ws: bool, interpret: bool,
              programs: int):
    """(lse, s_y, ws), fp32 [N] each, of the logits s = softcap(x W^T + b) of x's first
    n_rows rows (an int32 scalar, may be traced); the other rows get 0. W is [V, D]
    ("VD") or [D, V] ("DV"); y [N] int32 targets in [0, V) (s_y = s[y]); ws = sum_j cw_j
    s_j (cw = 1 without class weights), 0 unless need_ws. x and W: bf16, fp16 or fp32
    (fp32 products in full fp32); x W^T is rounded to x's dtype, as the backward pass's.
    programs: about how many programs to run (the vocabulary is split to reach it)."""
    N, D = x_ND.shape
    V = W.shape[0] if weight_layout == "VD" else W.shape[1]
    if N == 0:
        return (jnp.zeros((0,), jnp.float32),) * 3
    row_tiles = pl.cdiv(N, BM)
    splits = max(1, min(pl.cdiv(V, BN), pl.cdiv(programs, row_tiles)))
    split = pl.cdiv(pl.cdiv(V, splits), BN) * BN
    splits = pl.cdiv(V, split)  # none empty
    kernel = functools.partial(_kernel, N=N, V=V, D=D, bk=FUSED_STATS_K_BYTES // x_ND.dtype.itemsize, split=split,
                               vd=weight_layout == "VD", cap=softcap, has_bias=b_V is not None,
                               has_cw=cw_V is not None, need_ws=need_ws)
    n = jnp.asarray(n_rows, jnp.int32).reshape(1)
    extras = [a for a in (b_V, cw_V) if a is not None]
    m, l, s_y, ws = pallas(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((splits, N), jnp.float32)] * 4,
        grid=(row_tiles, splits),
        interpret=interpret,
        compiler_params=plt.CompilerParams(**FUSED_STATS_PARAMS),
    )(n, x_ND, W, *extras, y_N)
    computed = jnp.arange(N) < n[0]
    m_max = m.max(0)
    lse = m_max + jnp.log((l * jnp.exp(m - m_max)).sum(0))
    return tuple(jnp.where(computed, a, 0.0) for a in (lse, s_y.sum(0), ws.sum(0)))
