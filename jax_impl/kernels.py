"""Pallas kernels over one block of logits z [R, C] (R rows, C vocabulary columns at
column offset v0): the row-wise work between the matrix products, as in
`torch_impl.kernels`.

- `block_stats`: merges the block into running per-row statistics (m, l of scale * s,
  s_y, ws), so lse = m + log(l) once every column block of the rows has been seen.
- `block_grad`: rewrites the block as dz (interop/SPEC.md) from per-row lse and the
  coefficients (P, T, S), optionally with a second softmax term (distillation at a
  temperature), in place (the output aliases z).
- `rows_stats_grad`: both over whole rows in one kernel, the coefficients from the row's
  lse (cross-entropy's gradients formed in the forward pass).

One program per row, looping over its columns. All use the Triton lowering of
`pallas_call` (masked loads over a vocabulary that is no power of two), which exists in
JAX 0.10 and 0.11; JAX 0.11 deprecates it in favour of Mosaic GPU, and the warning it
emits at lowering is silenced here: it concerns this library, not its users.

Every Pallas call of `jax_impl` goes through `pallas`: its outputs typed for shard_map
(`jax_impl.sharding.struct`), and a derivative that refuses clearly (the kernels have none:
the losses' gradients are custom_vjp rules). Every running maximum of the online
logsumexp is `max_keep_nan` / `reduce_max_keep_nan`: the Triton lowering of `jnp.maximum`
and `jnp.max` is maxnum, which drops a NaN (interpret mode keeps it), and a NaN logit must
make its row's lse NaN on the GPU as on the CPU.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from interop.tuning import BLOCK_COLS, JAX_ROW_KERNEL_PARAMS
from jax_impl.sharding import struct, vary, varying_axes


warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def kernels_can_run(platform: str) -> bool:
    """The kernels run on a GPU, and elsewhere in interpret mode when asked (tests)."""
    return platform == "gpu" or os.environ.get("LOGITLESS_PALLAS_INTERPRET") == "1"


SECOND_ORDER_MESSAGE = (
    "strategy='speed' and strategy='memory' run Pallas kernels, which have no derivatives: their gradient (a "
    "jax.custom_vjp rule) can't be differentiated again, so second derivatives (jax.hessian, or jax.jvp / jax.grad "
    "of the gradient) are not supported; strategy='chunked' supports them (its custom_vjp rule is plain XLA, which "
    "JAX differentiates)"
)


def no_derivative(primals, tangents):
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


def pallas(kernel, out_shape, **params):
    """pl.pallas_call(kernel, out_shape=out_shape, **params) as a function of its operands
    (arrays only), with out_shape's structs (a ShapeDtypeStruct or a list of them) varying
    over the shard_map axes its operands vary over, and a derivative that raises
    NotImplementedError naming the strategy that supports second derivatives, in place of
    Pallas' bare errors (forward-mode differentiation reaches a kernel only when a gradient
    is differentiated)."""

    def run(*operands):
        axes = varying_axes(*operands)
        typed = jax.tree.map(lambda s: struct(s.shape, s.dtype, axes), out_shape)
        return pl.pallas_call(kernel, out_shape=typed, **params)(*operands)

    def call(*operands):
        axes = varying_axes(*operands)
        if axes and params.get("interpret"):
            return _interpret_varying(run, operands, axes)
        return run(*operands)

    call = jax.custom_jvp(call)
    call.defjvp(no_derivative)
    return call


def _interpret_varying(run, operands, axes: frozenset):
    """run(*operands) in interpret mode for operands that vary over shard_map's `axes`:
    Pallas' interpreter mixes them with constants that don't vary (padding, its loop's
    carry), which check_vma refuses ("Primitive pad requires varying manual axes to
    match"). So every device's operands are gathered into values that vary over no axis
    (a psum of each device's operands in its own slot), the kernel runs on each device's
    (vmap), and each device keeps its own outputs. Only tests interpret kernels; the
    Triton lowering takes the operands as they are."""
    axes = tuple(sorted(axes))
    mine = jax.lax.axis_index(axes)
    devices = jax.lax.psum(1, axes)

    def gather(a):
        return jax.lax.psum(jnp.zeros((devices,) + a.shape, a.dtype).at[mine].set(a), axes)

    outputs = jax.vmap(run)(*map(gather, vary(operands, frozenset(axes))))
    return jax.tree.map(lambda o: o[mine], outputs)


def max_keep_nan(a, b):
    """Elementwise max of a and b, NaN where either is NaN, in the Triton lowering (whose
    max is maxnum: NaN only if both are) and in interpret mode alike."""
    return jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.nan, jnp.maximum(a, b))


def reduce_max_keep_nan(v, axis=None):
    """jnp.max(v, axis), NaN where the reduced values hold a NaN: Triton's max reduction is
    maxnum too, so the NaNs are added on, a sum every lowering propagates."""
    return jnp.max(v, axis=axis) + jnp.sum(jnp.where(jnp.isnan(v), v, 0.0), axis=axis)


def _logits(z_ref, b_ref, row, v0, start, block, mask):
    """z + b, fp32 [block], of a row's columns start..start+block."""
    z = plt.load(z_ref.at[row, pl.ds(start, block)], mask=mask, other=0.0).astype(jnp.float32)
    if b_ref is not None:
        z = z + plt.load(b_ref.at[pl.ds(v0 + start, block)], mask=mask, other=0.0).astype(jnp.float32)
    return z


def _grad_columns(z_ref, b_ref, row, v0, start, block, C, cap):
    """A gradient kernel's columns start..start+block of a row: (their offsets, the mask of
    those < C, the logits z + b, s = softcap(z + b)); fp32 [block] each."""
    offs = start + jnp.arange(block)
    mask = offs < C
    z = _logits(z_ref, b_ref, row, v0, start, block, mask)
    return offs, mask, z, z if cap is None else cap * jnp.tanh(z / cap)


def _store_dz(dz_ref, row, start, block, mask, ds, z, cap):
    """Write dz = ds * softcap'(z) (ds: the gradient of the capped logits s) in dz_ref's dtype."""
    dz = ds if cap is None else ds * softcap_slope(z, cap)
    plt.store(dz_ref.at[row, pl.ds(start, block)], dz.astype(dz_ref.dtype), mask=mask)


def _capped(z_ref, b_ref, row, v0, start, block, mask, cap):
    """softcap(z + b), fp32 [block], of a row's columns start..start+block. jnp.tanh: the
    Triton lowering calls libdevice's tanhf (as jnp.exp its expf), accurate for any
    u = z / c, where 1 - 2 / (exp(2u) + 1) loses a small u's digits (every capped logit is
    0 at c = 1e30)."""
    z = _logits(z_ref, b_ref, row, v0, start, block, mask)
    return z if cap is None else cap * jnp.tanh(z / cap)


def softcap_slope(z, cap):
    """d(c tanh(z / c)) / dz = sech(u)^2 = 4 w / (1 + w)^2 with w = exp(-2|u|), u = z / c:
    accurate where the cap saturates, which 1 - (s / c)^2 cancels to rounding noise."""
    w = jnp.exp(-2.0 * jnp.abs(z / cap))
    return 4.0 * w / ((1.0 + w) * (1.0 + w))


def column_loop(C: int, block: int, body, init):
    """fori_loop of body(i, carry) over the ceil(C / block) column tiles of a row, with an
    int32 index (like pl.program_id's) also when JAX's 64-bit mode is on: the kernels'
    indices must share one integer type."""
    return jax.lax.fori_loop(jnp.int32(0), jnp.int32(pl.cdiv(C, block)), body, init)


def _store_scalar(ref, row, value):
    plt.store(ref.at[pl.ds(row, 1)], jnp.reshape(value, (1,)))


def _load_scalar(ref, row):
    return plt.load(ref.at[pl.ds(row, 1)])[0]


def _stats_columns(z_ref, b_ref, cw_ref, row, v0, y, C, cap, scale, need_ws, block):
    """A row's columns 0..C of the block in one loop: per lane, the running max m and sum l
    of exp(scale s - m) and the class-weighted sum ws of s (0 unless need_ws), fp32 [block]
    each; and s at the target y (a column index; 0 outside [0, C)), read once after the loop.
    One exponential per logit: of exp(m - s) (a new max: l = l e + 1) and exp(s - m) (l = l +
    e) one is needed; a -inf logit (or a masked lane) adds nothing, also to a lane that saw
    only -inf; a NaN makes its lane's l NaN. The loop is bound by its arithmetic, not by
    memory: with two exponentials and a target compare per logit, Q's block (4096 x 128256)
    took 734 us on an H200, with one exponential 542."""
    ninf = jnp.float32(-jnp.inf)

    def body(i, carry):
        m_vec, l_vec, ws_vec = carry
        start = i * block
        offs = start + jnp.arange(block)
        mask = offs < C
        s = _capped(z_ref, b_ref, row, v0, start, block, mask, cap)
        s_in = jnp.where(mask, s * scale, ninf)
        d = s_in - m_vec
        e = jnp.where(s_in == ninf, 0.0, jnp.exp(-jnp.abs(d)))
        l_vec = jnp.where(d > 0, l_vec * e + 1.0, l_vec + e)
        m_vec = max_keep_nan(m_vec, s_in)
        if need_ws:
            if cw_ref is not None:
                s = s * plt.load(cw_ref.at[pl.ds(v0 + start, block)], mask=mask, other=0.0).astype(jnp.float32)
            ws_vec = ws_vec + jnp.where(mask, s, 0.0)
        return m_vec, l_vec, ws_vec

    zeros = jnp.zeros((block,), jnp.float32)
    m_vec, l_vec, ws_vec = column_loop(C, block, body, (jnp.full((block,), ninf), zeros, zeros))
    inside = (y >= 0) & (y < C)
    y_col = jnp.where(inside, y, 0)
    s_y = jnp.where(inside, _capped(z_ref, b_ref, row, v0, y_col, 1, jnp.full((1,), inside), cap)[0], 0.0)
    return m_vec, l_vec, s_y, ws_vec


def _merged(m_old, l_old, m_vec, l_vec):
    """(m, l): the lanes' running (m_vec, l_vec) merged into a row's (m_old, l_old)."""
    ninf = jnp.float32(-jnp.inf)
    m = max_keep_nan(m_old, reduce_max_keep_nan(m_vec))
    m_safe = jnp.where(m == ninf, 0.0, m)
    l_blk = jnp.sum(jnp.where(m_vec == ninf, 0.0, l_vec * jnp.exp(m_vec - m_safe)))
    return m, l_old * jnp.exp(m_old - m_safe) + l_blk


def _grad_loop(z_ref, b_ref, cw_ref, dz_ref, row, v0, y, C, cap, scale, block, lse, p_coef, t_coef, s_coef,
               second=None):
    """Write a row's dz over columns 0..C: (P exp(scale s - lse) [+ P2 exp(s - lse2)] - T [j == y]
    - S cw_j) * softcap'(z), second = (P2, lse2) or None."""

    def body(i, carry):
        start = i * block
        offs, mask, z, s = _grad_columns(z_ref, b_ref, row, v0, start, block, C, cap)
        dz = p_coef * jnp.exp(s * scale - lse) - jnp.where(offs == y, t_coef, 0.0)
        if second is not None:
            dz = dz + second[0] * jnp.exp(s - second[1])
        if cw_ref is not None:
            dz = dz - s_coef * plt.load(cw_ref.at[pl.ds(v0 + start, block)], mask=mask, other=0.0).astype(jnp.float32)
        else:
            dz = dz - s_coef
        _store_dz(dz_ref, row, start, block, mask, dz, z, cap)
        return carry

    column_loop(C, block, body, 0)


def _split_refs(refs, has_bias, has_cw):
    """(b_ref or None, cw_ref or None, the other refs)."""
    b_ref = refs[0] if has_bias else None
    cw_ref = refs[int(has_bias)] if has_cw else None
    return b_ref, cw_ref, refs[int(has_bias) + int(has_cw):]


def _stats_kernel(v0_ref, z_ref, *refs, C, cap, scale, has_bias, has_cw, need_ws, block):
    b_ref, cw_ref, (y_ref, m_in, l_in, sy_in, ws_in, m_out, l_out, sy_out, ws_out) = _split_refs(refs, has_bias, has_cw)
    row = pl.program_id(0)
    v0 = _load_scalar(v0_ref, 0)
    m_vec, l_vec, s_y, ws_vec = _stats_columns(z_ref, b_ref, cw_ref, row, v0, _load_scalar(y_ref, row) - v0, C, cap,
                                               scale, need_ws, block)
    m, l = _merged(_load_scalar(m_in, row), _load_scalar(l_in, row), m_vec, l_vec)
    _store_scalar(l_out, row, l)
    _store_scalar(m_out, row, m)
    _store_scalar(sy_out, row, _load_scalar(sy_in, row) + s_y)
    _store_scalar(ws_out, row, _load_scalar(ws_in, row) + jnp.sum(ws_vec))


def _grad_kernel(v0_ref, z_ref, *refs, C, cap, scale, has_bias, has_cw, has_p2, block):
    b_ref, cw_ref, (y_ref, lse_ref, p_ref, t_ref, s_ref, p2_ref, lse2_ref, dz_ref) = _split_refs(refs, has_bias, has_cw)
    row = pl.program_id(0)
    v0 = _load_scalar(v0_ref, 0)
    second = (_load_scalar(p2_ref, row), _load_scalar(lse2_ref, row)) if has_p2 else None
    _grad_loop(z_ref, b_ref, cw_ref, dz_ref, row, v0, _load_scalar(y_ref, row) - v0, C, cap, scale, block,
               _load_scalar(lse_ref, row), _load_scalar(p_ref, row), _load_scalar(t_ref, row), _load_scalar(s_ref, row),
               second)


def _rows_kernel(z_ref, *refs, C, cap, has_bias, has_cw, need_ws, z_loss2, block):
    """One whole row: its statistics, then dz over the same row from its lse (the second
    read of the row often still in L2), P = G (A + 2 z_loss lse)."""
    b_ref, cw_ref, (y_ref, g_ref, a_ref, t_ref, s_ref, lse_out, sy_out, ws_out, dz_ref) = _split_refs(refs, has_bias, has_cw)
    row, v0 = pl.program_id(0), jnp.int32(0)
    y = _load_scalar(y_ref, row)
    m_vec, l_vec, s_y, ws_vec = _stats_columns(z_ref, b_ref, cw_ref, row, v0, y, C, cap, 1.0, need_ws, block)
    m, l = _merged(jnp.float32(-jnp.inf), jnp.float32(0.0), m_vec, l_vec)
    lse = m + jnp.log(l)
    _store_scalar(lse_out, row, lse)
    _store_scalar(sy_out, row, s_y)
    _store_scalar(ws_out, row, jnp.sum(ws_vec))
    p_coef = _load_scalar(g_ref, row) * (_load_scalar(a_ref, row) + z_loss2 * lse)
    _grad_loop(z_ref, b_ref, cw_ref, dz_ref, row, v0, y, C, cap, 1.0, block, lse, p_coef, _load_scalar(t_ref, row),
               _load_scalar(s_ref, row))


def v0_array(v0):
    """A column offset (int or traced) as the int32 [1] array the kernels take."""
    return jnp.asarray(v0, jnp.int32).reshape(1)


def _block(C: int) -> int:
    return min(BLOCK_COLS, pl.next_power_of_2(C))


def _extras(b_V, cw_V):
    return [a for a in (b_V, cw_V) if a is not None]


def block_stats(z_RC, v0, b_V, cw_V, y_R, stats, softcap, need_ws: bool, interpret: bool, scale: float = 1.0):
    """Merge logits block z [R, C] (columns v0..v0+C; v0 an int32 [1] array) into the
    running statistics `stats` = (m, l, s_y, ws), each fp32 [R]; returns the new ones.
    m and l are those of scale * s. interpret: Pallas interpret mode (anywhere but a GPU)."""
    R, C = z_RC.shape
    kernel = functools.partial(_stats_kernel, C=C, cap=softcap, scale=float(scale), has_bias=b_V is not None, has_cw=cw_V is not None,
                               need_ws=need_ws, block=_block(C))
    args = [v0, z_RC, *_extras(b_V, cw_V), y_R, *stats]
    first_stat = len(args) - 4
    return pallas(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((R,), jnp.float32)] * 4,
        grid=(R,),
        input_output_aliases={first_stat + k: k for k in range(4)},
        interpret=interpret,
        compiler_params=plt.CompilerParams(**JAX_ROW_KERNEL_PARAMS),
    )(*args)


def rows_stats_grad(z_RC, b_V, cw_V, y_R, g_R, a_R, t_R, s_R, softcap, need_ws: bool, z_loss: float, interpret: bool):
    """(lse, s_y, ws, dz) of whole-row logits z [R, V] in one kernel: the statistics of
    `block_stats` from empty ones (lse = m + log l; ws only with need_ws), then dz of
    `block_grad` (scale 1) with P = G (A + 2 z_loss lse), written over z. lse, s_y, ws fp32
    [R]; y int32 [R] (column indices, outside [0, V): none); g, a, t, s fp32 [R]
    (`rows.lse_coefficients`). One program
    reads its row twice, the second time mostly from L2, where two kernels read the block
    from memory twice."""
    R, C = z_RC.shape
    kernel = functools.partial(_rows_kernel, C=C, cap=softcap, has_bias=b_V is not None, has_cw=cw_V is not None,
                               need_ws=need_ws, z_loss2=float(2 * z_loss), block=_block(C))
    return pallas(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((R,), jnp.float32)] * 3 + [jax.ShapeDtypeStruct((R, C), z_RC.dtype)],
        grid=(R,),
        input_output_aliases={0: 3},
        interpret=interpret,
        compiler_params=plt.CompilerParams(**JAX_ROW_KERNEL_PARAMS),
    )(z_RC, *_extras(b_V, cw_V), y_R, g_R, a_R, t_R, s_R)


def block_grad(z_RC, v0, b_V, cw_V, y_R, lse_R, p_R, t_R, s_R, softcap, interpret: bool, scale: float = 1.0,
               second=None):
    """dz [R, C] (z's dtype, written over z) for logits block z (columns v0..v0+C):
    (P exp(scale s - lse) [+ P2 exp(s - lse2)] - T [j == y] - S cw_j) * softcap'(z), with
    second = (P2, lse2), fp32 [R] each, or None."""
    R, C = z_RC.shape
    kernel = functools.partial(_grad_kernel, C=C, cap=softcap, scale=float(scale), has_bias=b_V is not None,
                               has_cw=cw_V is not None, has_p2=second is not None, block=_block(C))
    p2_R, lse2_R = (lse_R, lse_R) if second is None else second
    return pallas(
        kernel,
        out_shape=jax.ShapeDtypeStruct((R, C), z_RC.dtype),
        grid=(R,),
        input_output_aliases={1: 0},
        interpret=interpret,
        compiler_params=plt.CompilerParams(**JAX_ROW_KERNEL_PARAMS),
    )(v0, z_RC, *_extras(b_V, cw_V), y_R, lse_R, p_R, t_R, s_R, p2_R, lse2_R)
