"""Per-row pieces of the spec (interop/SPEC.md) that every JAX path shares: target facts,
the loss from per-row statistics (lse, s_y, ws = sum_j cw_j s_j), the gradient
coefficients (P, T, S) with ds_ij = P_i p_ij - T_i [j == y_i] - S_i cw_j, and the loop over
row blocks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from interop.options import CrossEntropyOptions
from jax_impl.sharding import vary, vary_like, varying_axes

_INT32 = np.iinfo(np.int32)


def compute_dtype(dtype) -> jnp.dtype:
    """fp32 for 16- and 32-bit inputs, fp64 for fp64."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def equals(y, value: int):
    """bool: y == value for integer y, False everywhere when y's dtype can't hold `value`
    (an ignore_index of 2**40 and int32 targets: JAX raises OverflowError, or with x64 on
    wraps 2**40 to 0 and matches class 0)."""
    info = jnp.iinfo(y.dtype)
    if not info.min <= value <= info.max:
        return jnp.zeros(y.shape, bool)
    return y == value


def narrow_indices(y, vocab: int, below: int, above: int):
    """int32 indices (as the kernels take) of integer y of any width: y where 0 <= y < V,
    `below` where y < 0, `above` where y >= V. Compared in y's own dtype (widened to int32
    if narrower, so that 0 and V fit), before any narrowing: an int64 2**32 - 100 must not
    wrap to -100, nor 2**32 + 5 to class 5."""
    if jnp.dtype(y.dtype).itemsize < 4:
        y = y.astype(jnp.int32)
    inside = (y >= 0) & (y < vocab)
    y32 = jnp.where(inside, y, 0).astype(jnp.int32)
    return jnp.where(inside, y32, jnp.where(y < 0, below, above).astype(jnp.int32))


def narrow_targets(y, vocab: int, ignore_index: int):
    """(int32 targets, int32 ignore_index) meaning what (y, ignore_index) mean: classes kept,
    ignored rows marked by ignore_index (-2 in its place where int32 can't hold it), any
    other target outside [0, V) by -1 (-2 if ignore_index is -1): out of range, and never
    taken for ignore_index."""
    ignore32 = ignore_index if _INT32.min <= ignore_index <= _INT32.max else -2
    bad32 = -2 if ignore32 == -1 else -1
    y32 = narrow_indices(y, vocab, bad32, bad32)
    return jnp.where(equals(y, ignore_index), jnp.int32(ignore32), y32), ignore32


@dataclasses.dataclass
class TargetRows:
    """Per-row target facts, all [N]: safe_y (0 where out of range), valid (not
    ignore_index), in_range, bad (valid but out of range), cw_y (cw[y], 0 if ignored)."""

    safe_y: jax.Array
    valid: jax.Array
    in_range: jax.Array
    bad: jax.Array
    cw_y: jax.Array

    @classmethod
    def build(cls, y_N, cw_V, vocab: int, ignore_index: int, dtype) -> "TargetRows":
        valid = y_N != ignore_index
        in_range = (y_N >= 0) & (y_N < vocab)
        safe_y = jnp.where(in_range, y_N, 0)
        cw_y = jnp.ones(y_N.shape, dtype) if cw_V is None else cw_V.astype(dtype)[safe_y]
        return cls(safe_y, valid, in_range, valid & ~in_range, jnp.where(valid, cw_y, 0))


def row_loss(lse, s_y, ws, rows: TargetRows, opts: CrossEntropyOptions, cw_sum, vocab: int):
    """Per-row loss [N] (0 for ignored rows, NaN for out-of-range targets); ws is only read
    with label smoothing; cw_sum = sum_j cw_j (V without class weights)."""
    eps = opts.label_smoothing
    loss = (1 - eps) * rows.cw_y * (lse - s_y)
    if eps:
        loss = loss + eps * (cw_sum * lse - ws) / vocab
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    loss = jnp.where(rows.bad, jnp.nan, loss)
    return jnp.where(rows.valid, loss, 0)


def reduce_loss(loss_N, rows: TargetRows, reduction: str):
    """none: loss_N; sum; mean: divided by the valid rows' summed class weight."""
    if reduction == "sum":
        return loss_N.sum()
    if reduction == "mean":
        return loss_N.sum() / rows.cw_y.sum()
    return loss_N


def lse_coefficients(g_loss, rows: TargetRows, cw_sum, opts: CrossEntropyOptions, vocab: int, dtype):
    """(G, A, T, S), each [N] in dtype, of the coefficients before lse is known: G each
    row's upstream gradient (0 where ignored), P = G (A + 2 z_loss lse) (+ the upstream
    gradient of lse), T and S as `row_coefficients`'. A is NaN where the target is out of
    range, so P is too. g_loss as there."""
    eps = opts.label_smoothing
    g = g_loss.astype(dtype)
    if opts.reduction == "mean":
        g = g / rows.cw_y.sum()
    g_rows = jnp.where(rows.valid, jnp.broadcast_to(g, rows.valid.shape), 0)
    a_coef = jnp.where(rows.bad, jnp.nan, (1 - eps) * rows.cw_y + eps * cw_sum / vocab)
    t_coef = jnp.where(rows.in_range, g_rows * (1 - eps) * rows.cw_y, 0)
    return g_rows, a_coef, t_coef, g_rows * eps / vocab


def row_coefficients(g_loss, g_lse, lse, rows: TargetRows, cw_sum, opts: CrossEntropyOptions, vocab: int):
    """(P, T, S), each [N] in lse's dtype. g_loss: upstream gradient of the reduced loss
    (0-d) or of each row ([N] for "none"); g_lse: of lse ([N]) or None. T is 0 where the
    target is out of range; P is NaN there, so those rows' gradients are NaN."""
    g_rows, a_coef, t_coef, s_coef = lse_coefficients(g_loss, rows, cw_sum, opts, vocab, lse.dtype)
    p_coef = g_rows * (a_coef + 2 * opts.z_loss * lse)
    if g_lse is not None:
        p_coef = p_coef + g_lse.astype(lse.dtype)
    return p_coef, t_coef, s_coef


def row_loop(row_step, carry, per_row, n_rows: int, block_rows: int, keep=None, tail_split: int = 1):
    """(carry, outs) of row_step over blocks of block_rows (<= n_rows) rows: a loop over the
    full blocks and a loop of one trip for the remainder (static), so no input is padded
    and every block's rows are new.

    row_step(carry, xs) -> (carry, ys): xs holds the block's rows of each per-row array
    ([N, ...] -> [R, ...]); ys is a tuple of [R, ...] arrays, written into outs ([N, ...]
    each) in place.

    keep: optional bool [N], the rows that must be computed (a traced count). The rows are
    then taken kept rows first (each group in ascending order), each block's rows gathered
    and its outputs scattered back: the full blocks of kept rows, then blocks of
    block_rows / tail_split rows (block_rows if it does not divide them) up to the last
    kept row, then the static remainder of those smaller blocks if it holds kept rows (a
    loop of 0 or 1 trips). Rows that share those blocks with kept rows are computed too;
    the others are never visited and get zeros in outs.
    """
    block_rows = max(block_rows, 1)  # no rows: a plan of 0-row blocks, no block to compute
    keep = None if n_rows == 0 else keep
    n_full, rest = divmod(n_rows, block_rows)
    if n_full == 1 and not rest:
        return row_step(carry, per_row)
    block = tuple(jax.ShapeDtypeStruct((block_rows,) + a.shape[1:], a.dtype) for a in per_row)
    carry_shapes, shapes = jax.eval_shape(row_step, carry, block)
    outs = tuple(jnp.zeros((n_rows,) + s.shape[1:], s.dtype) for s in shapes)
    order = None if keep is None else kept_first(keep)

    def step(start, size, state):
        if order is None:
            xs = tuple(jax.lax.dynamic_slice_in_dim(a, start, size) for a in per_row)
            carry, ys = row_step(state[0], xs)
            return carry, tuple(jax.lax.dynamic_update_slice_in_dim(o, y, start, 0) for o, y in zip(state[1], ys))
        rows = jax.lax.dynamic_slice_in_dim(order, start, size)
        carry, ys = row_step(state[0], tuple(jnp.take(a, rows, axis=0, mode="clip") for a in per_row))
        return carry, tuple(o.at[rows].set(y, unique_indices=True) for o, y in zip(state[1], ys))

    def blocks(state, first, count, size):  # `count` blocks of `size` rows from row `first`
        return jax.lax.fori_loop(0, count, lambda i, st: step(first + i * size, size, st), state)

    # shard_map: the carry's and each output's type as row_step's (a row's value the same on
    # every device, as combined statistics are, stays so)
    typed = lambda a, s: vary(a, varying_axes(s, *per_row))
    state = (jax.tree.map(typed, vary_like(carry, per_row, carry), carry_shapes), tuple(map(typed, outs, shapes)))
    if keep is None:
        if n_full:  # (no rows: no loop)
            state = blocks(state, 0, n_full, block_rows)
        return blocks(state, n_full * block_rows, unfolded_count(1), rest) if rest else state
    n_kept = unfolded_count(keep.sum(dtype=jnp.int32))  # constant targets would make it known
    tail = block_rows // tail_split if block_rows % tail_split == 0 else block_rows
    n_big = jnp.minimum(n_kept // block_rows, n_full)
    state = blocks(state, 0, n_big, block_rows)
    first = n_big * block_rows
    n_small = jnp.minimum((n_kept - first + tail - 1) // tail, (n_rows - first) // tail)
    state = blocks(state, first, n_small, tail)
    rest = n_rows % tail
    if not rest:
        return state
    # A loop of 0 or 1 trips, not lax.cond: XLA copies a carry that a conditional passes
    # through, which costs one more grad_weight.
    last = n_rows - rest
    return blocks(state, last, (n_kept > last).astype(jnp.int32), rest)


def kept_first(keep):
    """The int32 [N] order of the rows with keep [N] (bool) True first, each group ascending."""
    return jnp.argsort(~keep, stable=True).astype(jnp.int32)


def unfolded_count(count):
    """An int32 loop trip count that XLA cannot fold (optimization_barrier). A loop that XLA
    knows runs once becomes a call of its own, whose temporaries XLA does not share with
    the other loops' (JAX "memory" then holds about one more grad_weight)."""
    return jax.lax.optimization_barrier(jnp.asarray(count, jnp.int32))
