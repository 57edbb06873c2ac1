"""The three matrix products of JAX "memory"'s blocks of rows and vocabulary columns as
Pallas kernels (Triton lowering, fp32 accumulation; `jax_impl.head.Head` with
kernel_products, sized by `interop.blocking.kernel_memory_block_shape`). XLA's products keep
a cuBLAS workspace among the temporaries (`Tuning.xla_gemm_workspace`), alone more than the
memory-first bound's tenth of the gradients' bytes at small heads (GPT-2's, Llama-2-7B's),
and copy each column block's slice of W, so that at D 2048 XLA's blocks hold a few hundred
rows and their loop steps cost more than their products. These kernels hold no workspace
and read W, and write grad_weight, in place at the block's first class v0 (an int or an
int32 scalar), so their blocks hold thousands of rows; their products run about a fifth
slower than cuBLAS, and the planner weighs both (`interop.blocking.memory_plan_seconds`).

- `logits(x_RD, W, v0, cols)`: z = x W_c^T [R, cols] in x's dtype.
- `add_grad_input(dx_RD, dz_RC, W, v0)`: dx + dz W_c into the fp32 accumulator dx.
- `add_grad_weight(dW, dz_RC, x_RD, v0)`: dW's classes v0..v0+C plus dz^T x, in dW's dtype.
The last two write over their accumulator (the output aliases it: no share written apart).

W is [V, D] (vd=True) or [D, V]. fp32 operands are multiplied in full fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from interop.tuning import GRAD_INPUT_TILE, GRAD_WEIGHT_TILE, LOGITS_TILE
from jax_impl.kernels import pallas, v0_array



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
    return pallas(kernel, out_shape=out_shape, grid=grid, interpret=interpret, compiler_params=params, **kw)


def _times_weight_kernel(v0_ref, a_ref, w_ref, *refs, R, K, M, vd, to_classes, bm, bn, bk):
    """o [R, M] = a [R, K] times W's classes from v0: W contracted over its hidden axis into
    M classes (to_classes: K = D, the logits), or over K classes into hidden (M = D,
    grad_input: added to the fp32 accumulator that o aliases)."""
    o_ref = refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)  # row tiles vary fastest: they share W's tile
    v0 = plt.load(v0_ref.at[pl.ds(0, 1)])[0]
    _, r_mask = _span(i * bm, bm, R)
    _, c_mask = _span(j * bn, bn, M)

    def step(k, acc):
        _, k_mask = _span(k * bk, bk, K)
        a = _load(a_ref.at[pl.ds(i * bm, bm), pl.ds(k * bk, bk)], _both(r_mask, k_mask))
        if to_classes:
            w, w_axis = _weight_tile(w_ref, vd, v0 + j * bn, bn, c_mask, k * bk, bk, k_mask), (1 if vd else 0)
        else:
            w, w_axis = _weight_tile(w_ref, vd, v0 + k * bk, bk, k_mask, j * bn, bn, c_mask), (0 if vd else 1)
        return acc + _dot(a, w, 1, w_axis)

    acc = jax.lax.fori_loop(*_k_steps(K, bk), step, jnp.zeros((bm, bn), jnp.float32))
    tile, mask = o_ref.at[pl.ds(i * bm, bm), pl.ds(j * bn, bn)], _both(r_mask, c_mask)
    if not to_classes:
        acc = acc + _load(tile, mask)
    _store(tile, acc.astype(o_ref.dtype), mask)


def _times_weight(a, W, v0, vd: bool, to_classes: bool, tile, out, interpret: bool):
    (R, K), M = a.shape, out.shape[1]
    bm, bn, bk = _tile(tile[0], R), _tile(tile[1], M), _tile(tile[2] // a.dtype.itemsize, K)
    kernel = functools.partial(_times_weight_kernel, R=R, K=K, M=M, vd=vd, to_classes=to_classes, bm=bm, bn=bn, bk=bk)
    args = (v0_array(v0), a, W) + (() if to_classes else (out,))
    aliases = {} if to_classes else {3: 0}
    return _call(kernel, tile, (pl.cdiv(R, bm), pl.cdiv(M, bn)), jax.ShapeDtypeStruct(out.shape, out.dtype),
                 interpret, input_output_aliases=aliases)(*args)


def logits(x_RD, W, v0, cols: int, vd: bool, interpret: bool):
    """z = x W_c^T: [R, cols] in x's dtype, W_c W's classes v0..v0+cols (v0 an int or int32
    scalar; x: [R, D]; W: [V, D] if vd else [D, V], read in place)."""
    out = jax.ShapeDtypeStruct((x_RD.shape[0], cols), x_RD.dtype)
    return _times_weight(x_RD, W, v0, vd, True, LOGITS_TILE, out, interpret)


def add_grad_input(dx_RD, dz_RC, W, v0, vd: bool, interpret: bool):
    """dx + dz W_c: [R, D] in dx's dtype (fp32), written over dx (the output aliases it);
    dz [R, C] against W's classes v0..v0+C."""
    return _times_weight(dz_RC, W, v0, vd, False, GRAD_INPUT_TILE, dx_RD, interpret)


def _grad_weight_kernel(v0_ref, dz_ref, x_ref, dw_in, dw_ref, *, R, C, D, vd, bv, bd, bk):
    del dw_in  # aliased to dw_ref
    j, i = pl.program_id(0), pl.program_id(1)  # hidden tiles vary fastest: they share dz's tile
    v0 = plt.load(v0_ref.at[pl.ds(0, 1)])[0]
    _, v_mask = _span(i * bv, bv, C)
    _, d_mask = _span(j * bd, bd, D)

    def step(k, acc):
        _, k_mask = _span(k * bk, bk, R)
        dz = _load(dz_ref.at[pl.ds(k * bk, bk), pl.ds(i * bv, bv)], _both(k_mask, v_mask))
        x = _load(x_ref.at[pl.ds(k * bk, bk), pl.ds(j * bd, bd)], _both(k_mask, d_mask))
        return acc + (_dot(dz, x, 0, 0) if vd else _dot(x, dz, 0, 0))

    if vd:
        tile, mask = dw_ref.at[pl.ds(v0 + i * bv, bv), pl.ds(j * bd, bd)], _both(v_mask, d_mask)
    else:
        tile, mask = dw_ref.at[pl.ds(j * bd, bd), pl.ds(v0 + i * bv, bv)], _both(d_mask, v_mask)
    acc = jax.lax.fori_loop(*_k_steps(R, bk), step, jnp.zeros((bv, bd) if vd else (bd, bv), jnp.float32))
    _store(tile, (_load(tile, mask).astype(jnp.float32) + acc).astype(dw_ref.dtype), mask)


def add_grad_weight(dW, dz_RC, x_RD, v0, vd: bool, interpret: bool):
    """dW with dz^T x added to its classes v0..v0+C ([C, D] rows of a [V, D] dW if vd, else
    x^T dz into [D, C] columns of [D, V]), in dW's dtype, written over dW (the output aliases
    it); fp32 inside, one rounding. dz: [R, C], x: [R, D]."""
    R, C = dz_RC.shape
    D = x_RD.shape[1]
    bv, bd = _tile(GRAD_WEIGHT_TILE[0], C), _tile(GRAD_WEIGHT_TILE[1], D)
    bk = _tile(GRAD_WEIGHT_TILE[2] // dz_RC.dtype.itemsize, R)
    kernel = functools.partial(_grad_weight_kernel, R=R, C=C, D=D, vd=vd, bv=bv, bd=bd, bk=bk)
    return _call(kernel, GRAD_WEIGHT_TILE, (pl.cdiv(D, bd), pl.cdiv(C, bv)), jax.ShapeDtypeStruct(dW.shape, dW.dtype),
                 interpret, input_output_aliases={3: 0})(v0_array(v0), dz_RC, x_RD.astype(dz_RC.dtype), dW)
