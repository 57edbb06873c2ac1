"""`linear_log_probs` for JAX, with the arguments, defaults and semantics of
`torch_impl.linear_log_probs` (interop/SPEC.md, "Log-probabilities"): per-token log p(target)
at a temperature, the entropy and the argmax, without the N x V logits.

The block loops of the distillation losses (`jax_impl.distill_blocked`'s configuration, rows
by `jax_impl.rows.row_loop`, columns by `jax_impl.blocked.Head.col_loop`) with the
"log_prob" steps of `jax_impl.steps`: Pallas kernels ("speed", "memory") or jax.numpy
("chunked"). The forward pass merges each block into per-row running statistics and keeps
lse and the entropy; the backward rule of the `jax.custom_vjp` recomputes each block and
turns the upstream gradients into dz, whose products give grad_input and grad_weight
(accumulated as cross-entropy's strategies accumulate it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from interop.blocking import xla_memory_block_shape, xla_memory_blocks_fit
from interop.log_probs import LogProbsOptions
from interop.options import check_inputs, check_strategy, check_tuning
from interop.tuning import Tuning
from jax_impl.distill_blocked import DistillConfig, plan_distillation
from jax_impl.functional import (as_array, check_target_range, choose_strategy, dtype_name, maybe_array, platform_of,
                                 shape_of, whole_vocab)
from jax_impl import partitioned
from jax_impl.log_probs_kernels import NO_COLUMN
from jax_impl.partitioned import Axes, Layout
from jax_impl.rows import compute_dtype, narrow_targets, row_loop
from jax_impl.sharding import on_mesh, row_spec, with_rows_axes
from jax_impl.vocab_parallel import local_columns, summed_grad_input


def _running(R: int, wide):
    """Per-row statistics before any column: (m, l, a, largest u, its column, u at the target)."""
    ninf, zeros = jnp.full((R,), -jnp.inf, wide), jnp.zeros((R,), wide)
    return ninf, zeros, zeros, ninf, jnp.full((R,), NO_COLUMN, jnp.int32), zeros


def _combine(running, cfg: DistillConfig, axis: str | None):
    """Each row's statistics (`_running`) over the classes of every device along `axis` (a
    head split over the vocabulary inside shard_map, equal slices of cfg.vocab classes in the
    axis' order): (m, l, a) merged as two column blocks merge, the largest u (a NaN first)
    and its first global column, u at the target; a pmax, a psum and a pmin of a few
    numbers per row, never logits. A NaN or +inf logit on any device makes the row's m NaN,
    as on one device. Without an axis, the device's own."""
    if axis is None:
        return running
    m, l, a, best, idx, u_y = running
    broken = jnp.isnan(m) | jnp.isnan(l) | jnp.isnan(a)
    best_nan = jnp.isnan(best)
    m_all, best_all = jax.lax.pmax((jnp.where(broken, -jnp.inf, m), jnp.where(best_nan, -jnp.inf, best)), axis)
    shift = jnp.where(jnp.isfinite(m_all), m_all, 0)
    seen = (m != -jnp.inf) & ~broken
    d = jnp.where(seen, m - shift, 0)
    f = jnp.where(seen, jnp.exp(d), 0)
    l_all, a_all, broken_all, nan_all, u_y_all = jax.lax.psum(
        (f * l, f * (a + l * d), broken.astype(m.dtype), best_nan.astype(m.dtype), u_y), axis)
    m_all = jnp.where(broken_all > 0, jnp.nan, jnp.where(jnp.isfinite(m_all), shift, m_all))
    mine = jnp.where(nan_all > 0, best_nan, best == best_all)
    first = jax.lax.axis_index(axis) * cfg.vocab
    col = jax.lax.pmin(jnp.where(mine, idx + first, NO_COLUMN).astype(jnp.int32), axis)
    return m_all, l_all, a_all, jnp.where(nan_all > 0, jnp.nan, best_all), col, u_y_all


def _classes(cfg: DistillConfig, axis: str | None) -> int:
    """The whole head's classes: cfg.vocab, times the axis' size on a split head."""
    return cfg.vocab if axis is None else cfg.vocab * jax.lax.psum(1, axis)


def _outputs(running, y_R, cfg: DistillConfig, axis: str | None = None):
    """(log_probs, entropy, argmax, lse) of rows' merged statistics (over `axis`: `_combine`)."""
    m, l, a, _, argmax, u_y = _combine(running, cfg, axis)
    o = cfg.options
    # lse = m + log l; H = lse - E[u] = log l - a / l: two small terms, where lse and
    # E[u] of a peaked row are large and nearly equal
    lse, entropy = m + jnp.log(l), jnp.log(l) - a / l
    valid, in_range = y_R != o.ignore_index, (y_R >= 0) & (y_R < _classes(cfg, axis))
    return jnp.where(valid, jnp.where(in_range, u_y - lse, jnp.nan), 0), entropy, argmax, lse


def _upstream(g, y_N, cfg: DistillConfig, wide, axis: str | None = None):
    """The log-probabilities' upstream gradient as the steps take it: 0 where ignored, NaN
    where the target is out of range."""
    valid, in_range = y_N != cfg.options.ignore_index, (y_N >= 0) & (y_N < _classes(cfg, axis))
    return jnp.where(valid, jnp.where(in_range, g.astype(wide), jnp.nan), 0)


def _layout(cfg: DistillConfig, operands: tuple, outputs: tuple) -> Layout:
    """x, W, b, y, then `operands`' factors; outputs named, "W" for W's factors."""
    w = "v d" if cfg.weight_layout == "VD" else "d v"
    return Layout(("n d", w, "v", "n") + operands, tuple(w if o == "W" else o for o in outputs))


def _local(cfg: DistillConfig, x_ND, W) -> DistillConfig:
    return cfg.local(x_ND.shape[0], W.shape[0] if cfg.weight_layout == "VD" else W.shape[1])


def _grads_factors(b_V) -> tuple:
    return ("n d", "W", None if b_V is None else "v")


def forward(x_ND, W, b_V, y_N, cfg: DistillConfig, keep=None, axis: str | None = None):
    """(log_probs, entropy, argmax, lse), per row; keep: bool [N], the only rows computed
    (`jax_impl.rows.row_loop`; the others' outputs are 0), or None. axis: the shard_map axis
    of a head split over the vocabulary (W and b this device's classes, y global), or None;
    under jit, split over sharded operands (`jax_impl.partitioned`)."""
    return partitioned.run(_forward_pass, cfg, _layout(cfg, ("n",), ("n",) * 4), x_ND, W, b_V, y_N, keep, axis=axis,
                           whole=cfg.unpartitioned)


def _forward_pass(cfg: DistillConfig, axes: Axes, x_ND, W, b_V, y_N, keep):
    cfg, axis = _local(cfg, x_ND, W), axes.vocab
    o, ops, head, wide = cfg.options, cfg.ops, cfg.head(x_ND, W, b_V), compute_dtype(x_ND.dtype)

    def row_step(carry, xs):
        x_R, y_R = xs
        y_cols = local_columns(y_R, cfg.vocab, axis)
        running = head.col_loop(
            lambda v0, cols, run: ops.log_prob_stats(head.logits(x_R, head.head_cols(v0, cols)), v0, b_V, y_cols, run,
                                                     o.softcap, 1.0 / o.temperature), _running(x_R.shape[0], wide))
        return carry, _outputs(running, y_R, cfg, axis)

    return row_loop(row_step, (), (x_ND, y_N), x_ND.shape[0], cfg.block_rows, keep)[1]


def forward_with_grads(x_ND, W, b_V, y_N, per_row, cfg: DistillConfig, upstream, keep=None, axis: str | None = None):
    """(log_probs [N], entropy [N], dx, dW, db) with the gradients formed in the forward pass,
    in blocks of whole rows (cfg.block_cols == V: one product per block, 6 N D V flops in
    all), for upstream gradients that each row's values decide: upstream(logp_R, entropy_R,
    per_row_R) -> (g_R, g_h_R or None) (hashable: a static of the pass), per_row a tuple of
    [N] arrays given by rows; keep and axis: as for `forward` (the other rows' dx is 0; on a
    split head, dx is summed over the axis)."""
    layout = _layout(cfg, ("n",) * (1 + len(per_row)), ("n", "n") + _grads_factors(b_V))
    return partitioned.run(_with_grads_pass, (cfg, upstream), layout, x_ND, W, b_V, y_N, keep, *per_row, axis=axis,
                           whole=cfg.unpartitioned)


def _with_grads_pass(static, axes: Axes, x_ND, W, b_V, y_N, keep, *per_row):
    (cfg, upstream), axis = static, axes.vocab
    cfg = _local(cfg, x_ND, W)
    o, ops, head, wide = cfg.options, cfg.ops, cfg.head(x_ND, W, b_V), compute_dtype(x_ND.dtype)

    def row_step(carry, xs):
        x_R, y_R, *rest = xs
        y_cols = local_columns(y_R, cfg.vocab, axis)
        z = head.logits(x_R, head.head_cols(0, cfg.vocab))
        running = ops.log_prob_stats(z, 0, b_V, y_cols, _running(x_R.shape[0], wide), o.softcap, 1.0 / o.temperature)
        logp, entropy, _, lse = _outputs(running, y_R, cfg, axis)
        g, g_h = upstream(logp, entropy, tuple(rest))
        dz = ops.log_prob_grad(z, 0, b_V, y_cols, lse, entropy, _upstream(g, y_R, cfg, wide, axis), g_h, o.softcap,
                               1.0 / o.temperature)
        dW, db, dx_R = head.add_shares(dz, x_R, 0, cfg.vocab, *carry, jnp.zeros(x_R.shape, wide))
        return (dW, db), (logp, entropy, dx_R if axis is not None else dx_R.astype(x_R.dtype))

    init = (jnp.zeros(W.shape, cfg.accumulate_dtype(W.dtype)), None if b_V is None else jnp.zeros(b_V.shape, wide))
    (dW, db), (logp, entropy, dx) = row_loop(row_step, init, (x_ND, y_N) + tuple(per_row), x_ND.shape[0],
                                             cfg.block_rows, keep)
    return logp, entropy, summed_grad_input(dx, x_ND, axis), dW.astype(W.dtype), None if db is None else db.astype(b_V.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def log_probs(x_ND, W, b_V, y_N, cfg: DistillConfig, with_entropy: bool, axis: str | None = None):
    """(log_probs [N], entropy [N], argmax [N] int32) over flattened rows x [N, D] and int32
    targets y [N]; fp32 (fp64 for fp64 inputs). with_entropy: whether the entropy's upstream
    gradient is used; axis: as for `forward`."""
    return forward(x_ND, W, b_V, y_N, cfg, axis=axis)[:3]


def _fwd(x_ND, W, b_V, y_N, cfg, with_entropy, axis):
    logp, entropy, argmax, lse = forward(x_ND, W, b_V, y_N, cfg, axis=axis)
    return (logp, entropy, argmax), (x_ND, W, b_V, y_N, lse, entropy)


def _bwd(cfg, with_entropy, axis, res, cotangents):
    g_lp, g_H, _ = cotangents
    return grads(*res, g_lp, g_H if with_entropy else None, cfg, axis=axis) + (None,)


def grads(x_ND, W, b_V, y_N, lse, entropy, g_lp, g_H, cfg: DistillConfig, keep=None, axis: str | None = None):
    """(dx, dW, db) for the upstream gradients of the log-probabilities and entropy ([N];
    g_H None when the entropy has none), recomputing the logits block by block; keep and
    axis: as for `forward_with_grads`."""
    layout = _layout(cfg, ("n",) * 5, _grads_factors(b_V))
    return partitioned.run(_grads_pass, cfg, layout, x_ND, W, b_V, y_N, lse, entropy, g_lp, g_H, keep, axis=axis,
                           whole=cfg.unpartitioned)


def _grads_pass(cfg: DistillConfig, axes: Axes, x_ND, W, b_V, y_N, lse, entropy, g_lp, g_H, keep):
    cfg, axis = _local(cfg, x_ND, W), axes.vocab
    o, ops, head, wide = cfg.options, cfg.ops, cfg.head(x_ND, W, b_V), lse.dtype
    g_lp = _upstream(g_lp, y_N, cfg, wide, axis)

    def row_step(carry, xs):
        x_R, y_R, lse_R, entropy_R, g_R, *g_h = xs
        g_h_R = g_h[0] if g_h else None
        y_cols = local_columns(y_R, cfg.vocab, axis)

        def body(v0, cols, c):
            dz = ops.log_prob_grad(head.logits(x_R, head.head_cols(v0, cols)), v0, b_V, y_cols, lse_R, entropy_R,
                                   g_R, g_h_R, o.softcap, 1.0 / o.temperature)
            return head.add_shares(dz, x_R, v0, cols, *c)

        dW, db, dx_R = head.col_loop(body, carry + (jnp.zeros(x_R.shape, wide),))
        return (dW, db), (dx_R if axis is not None else dx_R.astype(x_R.dtype),)

    db = None if b_V is None else jnp.zeros(b_V.shape, wide)
    per_row = (x_ND, y_N, lse, entropy, g_lp) + (() if g_H is None else (g_H.astype(wide),))
    (dW, db), (dx,) = row_loop(row_step, (jnp.zeros(W.shape, cfg.accumulate_dtype(W.dtype)), db), per_row,
                               x_ND.shape[0], cfg.block_rows, keep)
    return summed_grad_input(dx, x_ND, axis), dW.astype(W.dtype), None if db is None else db.astype(b_V.dtype)


log_probs.defvjp(_fwd, _bwd)


def plan(t: Tuning, o: LogProbsOptions, weight_layout, strategy, n_rows, hidden, vocab, dtype, accumulate_in_input_dtype,
         platform) -> DistillConfig:
    """The distillation losses' blocks (`plan_distillation`), but "memory" in the rows x
    columns blocks of cross-entropy's (`interop.blocking.xla_memory_block_shape`), sized for
    what XLA's products hold beyond the gradients (a copy of each block's x and of W's
    columns, a GEMM workspace), where at least min(N, t.min_block) of their rows fit."""
    cfg = plan_distillation(t, o, weight_layout, strategy, n_rows, hidden, vocab, dtype, accumulate_in_input_dtype,
                            platform)
    itemsize = jnp.dtype(dtype).itemsize
    if strategy != "memory" or not xla_memory_blocks_fit(t, n_rows, hidden, vocab, itemsize):
        return cfg
    rows, cols = xla_memory_block_shape(t, n_rows, hidden, vocab, itemsize)
    return dataclasses.replace(cfg, block_rows=rows, block_cols=cols)


def checked_call(input, linear_weight, target, linear_bias, o: LogProbsOptions, weight_layout, strategy, tuning,
                 vocab_parallel: str | None = None):
    """(input, linear_weight, target, linear_bias as arrays, their ProblemShape, the Tuning) of
    a call on the policy head, or the error naming what is wrong (a target out of range too).
    With vocab_parallel (a shard_map axis splitting the head), the shape's vocab is the whole
    head's."""
    check_strategy(strategy)
    tuning = check_tuning(tuning)
    input, linear_weight = as_array("input", input), as_array("linear_weight", linear_weight)
    target, linear_bias = as_array("target", target), maybe_array("linear_bias", linear_bias)
    shape = check_inputs(
        input_shape=input.shape, input_dtype=dtype_name(input), weight_shape=linear_weight.shape,
        weight_dtype=dtype_name(linear_weight), target_shape=target.shape, target_dtype=dtype_name(target),
        bias_shape=shape_of(linear_bias), bias_dtype=dtype_name(linear_bias), weight_layout=weight_layout,
        classes=None if vocab_parallel is None else whole_vocab(linear_weight, weight_layout, vocab_parallel))
    check_target_range(target, shape.vocab, o.ignore_index)
    return input, linear_weight, target, linear_bias, shape, tuning


def linear_log_probs(input, linear_weight, target, *, linear_bias=None, temperature: float = 1.0,
                     softcap: float | None = None, ignore_index: int | None = -100, return_entropy: bool = False,
                     return_argmax: bool = False, weight_layout: str = "VD", strategy: str = "auto",
                     accumulate_in_input_dtype: bool = False, tuning: Tuning | None = None,
                     vocab_parallel: str | None = None):
    """Per-token log p(target) at a temperature, and on request the entropy and argmax.

    The arguments of `torch_impl.linear_log_probs`: input [..., D], linear_weight [V, D]
    ("VD") or [D, V] ("DV", Flax nnx.Linear's kernel), target [...] integer ids, optional
    linear_bias [V]; u = softcap(input @ W^T + b) / temperature. Differentiable in input,
    linear_weight and linear_bias (`jax.custom_vjp`); usable under `jax.jit`, where a
    target out of [0, V) that is not ignore_index gives a NaN log-probability instead of
    the eager call's ValueError. strategy: as for `jax_impl.linear_cross_entropy`.
    vocab_parallel: inside `jax.shard_map`, the name of the mesh axis over which the head is
    split by vocabulary (equal slices in the axis' order, input and targets the same on
    every device), as for `jax_impl.linear_cross_entropy`: the devices exchange a few
    statistics per row, never logits; every output is global, grad_weight the device's
    slice, grad_input the full gradient (summed over the axis).

    Returns:
        log-probabilities [...] in fp32 (fp64 for fp64 input), 0 where ignored; with
        return_entropy and/or return_argmax, the tuple (log_probs, entropy, argmax) of those
        asked for: the entropy of every row, argmax int32 (the first of equal maxima).
    """
    o = LogProbsOptions(temperature, softcap, ignore_index)
    input, linear_weight, target, linear_bias, shape, tuning = checked_call(
        input, linear_weight, target, linear_bias, o, weight_layout, strategy, tuning, vocab_parallel)
    n = shape.n_rows
    y, ignore32 = narrow_targets(target.reshape(n), shape.vocab, o.ignore_index)
    platform = platform_of(input)
    local_vocab = linear_weight.shape[0 if weight_layout == "VD" else 1]
    strategy = choose_strategy(strategy, input.dtype, n, shape.hidden, local_vocab, platform, tuning)
    cfg = plan(tuning, dataclasses.replace(o, ignore_index=ignore32), weight_layout, strategy, n, shape.hidden,
               local_vocab, input.dtype, accumulate_in_input_dtype, platform)

    def rows(x, W, b, y):
        outs = log_probs(x.reshape(n, shape.hidden), W, b, y, cfg, return_entropy, vocab_parallel)
        return tuple(a.reshape(shape.lead_shape) for a in outs)

    if vocab_parallel is not None:  # inside shard_map: the device's own operands
        logp, entropy, argmax = rows(input, *with_rows_axes((linear_weight, linear_bias), input), y)
    else:
        logp, entropy, argmax = on_mesh(rows, (input, linear_weight, linear_bias, y), lambda: (row_spec(input),) * 3)
    outs = (logp,) + ((entropy,) if return_entropy else ()) + ((argmax,) if return_argmax else ())
    return outs[0] if len(outs) == 1 else outs
