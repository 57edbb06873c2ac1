"""The three matrix products of a block of whole rows as Pallas kernels (Triton lowering,
fp32 accumulation), for JAX "memory" on heads too small for XLA's products
(`interop.blocking.kernel_memory_block_rows`): those keep a 32 MiB cuBLAS workspace among
the temporaries, alone more than the memory-first bound's tenth of the gradients' bytes
at S (70 MiB), GPT-2's or Llama-2-7B's head. These kernels hold none and read W in place.
On larger heads XLA's products stay: they are faster (H100, bf16, one block of 373 rows at
L: logits 0.61 / grad_input 0.76 / grad_weight += 1.24 ms against cuBLAS's 0.57 / 0.55 /
0.93), and the rows the dropped workspace gives L's blocks (373 instead of 250) did not
pay for that (fwd+bwd 123 against 121 ms).

- `logits(x_RD, W)`: z = x W^T [R, V] in x's dtype.
- `grad_input(dz_RV, W, out_dtype, splits)`: dz W [R, D], optionally split over the
  vocabulary (fp32 partial sums) for more programs.
- `add_grad_weight(dW, dz_RV, x_RD)`: dW + dz^T x in dW's dtype and buffer (the kernel's
  output aliases dW: one rounding per block, no share written apart).

W is [V, D] (vd=True) or [D, V]. fp32 operands are multiplied in full fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# (output tile rows, output tile columns, K step in bytes of one operand row, warps, stages)
LOGITS_TILE = (128, 256, 128, 8, 4)  # [rows, classes]
GRAD_INPUT_TILE = (64, 256, 128, 4, 4)  # [rows, hidden]: few rows, so short tiles (more programs)
GRAD_WEIGHT_TILE = (256, 128, 64, 8, 4)  # [classes, hidden] ([hidden, classes] for "DV")


def _span(start, size: int, bound: int):
    """(start + arange(size), the mask of those < bound, or None when bound is a multiple
    of size: no tile crosses it)."""
    idx = start + jnp.arange(size, dtype=jnp.int32)
    return idx, (None if bound % size == 0 else idx < bound)


def _both(row_mask, col_mask):
    """The [rows, cols] mask of a row mask and a column mask (None: all true)."""
    if row_mask is None and col_mask is None:
        return None
    if row_mask is None:
        return col_mask[None, :]
    if col_mask is None:
        return row_mask[:, None]
    return row_mask[:, None] & col_mask[None, :]


def _load(ref, mask):
    return plt.load(ref) if mask is None else plt.load(ref, mask=mask, other=0.0)


def _store(ref, value, mask):
    if mask is None:
        plt.store(ref, value)
    else:
        plt.store(ref, value, mask=mask)


def _weight_tile(w_ref, vd: bool, v0, bv: int, v_mask, d0, bd: int, d_mask):
    """W's classes v0..v0+bv by hidden d0..d0+bd: [bv, bd] for "VD", [bd, bv] for "DV"."""
    if vd:
        return _load(w_ref.at[pl.ds(v0, bv), pl.ds(d0, bd)], _both(v_mask, d_mask))
    return _load(w_ref.at[pl.ds(d0, bd), pl.ds(v0, bv)], _both(d_mask, v_mask))


def _dot(a, b, a_axis: int, b_axis: int):
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((a_axis,), (b_axis,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _k_steps(size: int, step: int):
    """fori_loop bounds over ceil(size / step) steps, int32 as the program ids."""
    return jnp.int32(0), jnp.int32(pl.cdiv(size, step))


def _tile(edge: int, dim: int) -> int:
    """A tile edge: `edge`, or the next power of two >= dim (at least 16) when dim is smaller."""
    return max(16, min(edge, pl.next_power_of_2(dim)))


def _call(kernel, tile, grid, out_shape, interpret: bool, **kw):
    params = plt.CompilerParams(num_warps=tile[3], num_stages=tile[4])
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret, compiler_params=params, **kw)


def _times_weight_kernel(a_ref, w_ref, o_ref, *, R, K, C, vd, to_classes, bm, bn, bk, steps):
    """o[s] = a W over split s's range of K: a [R, K]; W contracted over its hidden axis
    into classes (to_classes: K = D, C = V, the logits) or over its classes into hidden
    (K = V, C = D, grad_input)."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)  # row tiles vary fastest: they share W's tile
    _, r_mask = _span(i * bm, bm, R)
    _, c_mask = _span(j * bn, bn, C)

    def step(k, acc):
        _, k_mask = _span(k * bk, bk, K)
        a = _load(a_ref.at[pl.ds(i * bm, bm), pl.ds(k * bk, bk)], _both(r_mask, k_mask))
        if to_classes:
            w, w_axis = _weight_tile(w_ref, vd, j * bn, bn, c_mask, k * bk, bk, k_mask), (1 if vd else 0)
        else:
            w, w_axis = _weight_tile(w_ref, vd, k * bk, bk, k_mask, j * bn, bn, c_mask), (0 if vd else 1)
        return acc + _dot(a, w, 1, w_axis)

    end = jnp.minimum((s + 1) * steps, pl.cdiv(K, bk))
    acc = jax.lax.fori_loop(s * steps, end, step, jnp.zeros((bm, bn), jnp.float32))
    _store(o_ref.at[s, pl.ds(i * bm, bm), pl.ds(j * bn, bn)], acc.astype(o_ref.dtype), _both(r_mask, c_mask))


def _times_weight(a, W, vd: bool, to_classes: bool, tile, out_dtype, splits: int, interpret: bool):
    R, K = a.shape
    V, D = W.shape if vd else W.shape[::-1]
    C = V if to_classes else D
    bm, bn, bk = _tile(tile[0], R), _tile(tile[1], C), _tile(tile[2] // a.dtype.itemsize, K)
    steps = pl.cdiv(pl.cdiv(K, bk), splits)
    kernel = functools.partial(_times_weight_kernel, R=R, K=K, C=C, vd=vd, to_classes=to_classes, bm=bm, bn=bn, bk=bk,
                               steps=steps)
    parts = _call(kernel, tile, (pl.cdiv(R, bm), pl.cdiv(C, bn), splits),
                  jax.ShapeDtypeStruct((splits, R, C), out_dtype if splits == 1 else jnp.float32), interpret)(a, W)
    return parts.sum(0).astype(out_dtype)


def logits(x_RD, W, vd: bool, interpret: bool):
    """z = x W^T: [R, V] in x's dtype (x: [R, D]; W: [V, D] if vd else [D, V])."""
    return _times_weight(x_RD, W, vd, True, LOGITS_TILE, x_RD.dtype, 1, interpret)


def grad_input(dz_RV, W, vd: bool, out_dtype, splits: int, interpret: bool):
    """dz W: [R, D] in out_dtype (dz: [R, V]; W: [V, D] if vd else [D, V]); with splits > 1,
    `splits` programs per output tile each sum a range of the vocabulary into fp32 partial
    sums [splits, R, D], which are then added (more programs for a small output)."""
    return _times_weight(dz_RV, W, vd, False, GRAD_INPUT_TILE, out_dtype, splits, interpret)


def _grad_weight_kernel(dz_ref, x_ref, dw_in, dw_ref, *, R, V, D, vd, bv, bd, bk):
    del dw_in  # aliased to dw_ref
    j, i = pl.program_id(0), pl.program_id(1)  # hidden tiles vary fastest: they share dz's tile
    _, v_mask = _span(i * bv, bv, V)
    _, d_mask = _span(j * bd, bd, D)

    def step(k, acc):
        _, k_mask = _span(k * bk, bk, R)
        dz = _load(dz_ref.at[pl.ds(k * bk, bk), pl.ds(i * bv, bv)], _both(k_mask, v_mask))
        x = _load(x_ref.at[pl.ds(k * bk, bk), pl.ds(j * bd, bd)], _both(k_mask, d_mask))
        return acc + (_dot(dz, x, 0, 0) if vd else _dot(x, dz, 0, 0))

    if vd:
        tile, mask = dw_ref.at[pl.ds(i * bv, bv), pl.ds(j * bd, bd)], _both(v_mask, d_mask)
    else:
        tile, mask = dw_ref.at[pl.ds(j * bd, bd), pl.ds(i * bv, bv)], _both(d_mask, v_mask)
    acc = jax.lax.fori_loop(*_k_steps(R, bk), step, jnp.zeros((bv, bd) if vd else (bd, bv), jnp.float32))
    _store(tile, (_load(tile, mask).astype(jnp.float32) + acc).astype(dw_ref.dtype), mask)


def add_grad_weight(dW, dz_RV, x_RD, vd: bool, interpret: bool):
    """dW + dz^T x ([V, D] if vd, else x^T dz: [D, V]) in dW's dtype, written over dW (the
    output aliases it); fp32 inside, one rounding. dz: [R, V], x: [R, D]."""
    R, V = dz_RV.shape
    D = x_RD.shape[1]
    bv, bd = _tile(GRAD_WEIGHT_TILE[0], V), _tile(GRAD_WEIGHT_TILE[1], D)
    bk = _tile(GRAD_WEIGHT_TILE[2] // dz_RV.dtype.itemsize, R)
    kernel = functools.partial(_grad_weight_kernel, R=R, V=V, D=D, vd=vd, bv=bv, bd=bd, bk=bk)
    return _call(kernel, GRAD_WEIGHT_TILE, (pl.cdiv(D, bd), pl.cdiv(V, bv)), jax.ShapeDtypeStruct(dW.shape, dW.dtype),
                 interpret, input_output_aliases={2: 0})(dz_RV, x_RD.astype(dz_RV.dtype), dW)
