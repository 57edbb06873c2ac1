"""Cross-entropy (interop/SPEC.md) as a rule of the block engine (`jax_impl.engine`), on a
`blocked.Problem` (the plan's blocks and block steps: the Pallas kernels for "speed" and
"memory", jax.numpy for "chunked"), and its `engine.Call`.

The primal computes the statistics only (a call that takes no gradient); "memory" takes
them from `jax_impl.fused_stats`, which forms no logits block. Under differentiation, a
kernel plan of whole-row blocks with a reduced loss and no returned lse forms the
gradients in the forward rule (6 N D V flops) and the backward rule scales them; every
other plan saves its inputs and lse, and the backward rule recomputes the logits block by
block (8 N D V flops; grad_weight accumulated in fp32, or in the input dtype for "memory"
and with accumulate_in_input_dtype), unless "speed" kept them (`engine.keeps_logits`: 6 N D
V in all). On "chunked"'s jax.numpy steps both rules are plain
XLA, so the derivative can be differentiated again. The kernel plans' passes run through
`jax_impl.partitioned`, which splits them over the devices of sharded operands under jit:
a device plans its blocks for its rows and classes, a split head combines the statistics
over its axis, and with split rows "mean" is "sum" over the global denominator. Inside
shard_map, the `vocab_parallel` axis is the same split.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_impl import blocked, engine, partitioned
from jax_impl.blocked import BlockedConfig, Problem
from jax_impl.fused_stats import row_stats
from jax_impl.partitioned import Axes, Layout
from jax_impl.rows import TargetRows, compute_dtype, kept_first, lse_coefficients, reduce_loss, row_coefficients, row_loss
from jax_impl.vocab_parallel import global_lse, local_columns


def _fused_row_stats(prob: Problem, x_ND, y_N):
    """(lse, s_y, ws) [N] from `fused_stats.row_stats`: of the rows to compute (`prob.keep`,
    gathered first), the others 0; y [N] int32 column indices (-1: none, s_y 0)."""
    opts = prob.cfg.options
    stats = functools.partial(row_stats, W=prob.W, b_V=prob.b, cw_V=prob.cw, weight_layout=prob.cfg.weight_layout,
                              softcap=opts.softcap, need_ws=opts.label_smoothing > 0, interpret=prob.cfg.interpret,
                              programs=prob.cfg.tuning.fused_stats_programs)
    if prob.keep is None:
        return stats(x_ND, y_N=y_N, n_rows=x_ND.shape[0])
    order = kept_first(prob.keep)
    kept = stats(x_ND[order], y_N=y_N[order], n_rows=prob.keep.sum(dtype=jnp.int32))
    return tuple(jnp.zeros_like(a).at[order].set(a, unique_indices=True) for a in kept)


def _call(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis: str | None):
    """(problem, the targets as its steps read them, the call's TargetRows, cw_sum, V). On a
    head split over `axis` (the vocabulary axis of a shard_map, or of `jax_impl.partitioned`)
    the problem is the device's classes: its targets are its columns (-1 where another device
    holds the class) and its class weights its slice, while the rows' facts, cw_sum and V are
    the whole head's."""
    if axis is None:
        prob = Problem(x_ND, W, b_V, cw_V, y_N, cfg)
        return prob, prob.rows.safe_y, prob.rows, prob.cw_sum, prob.vocab
    local_vocab = W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]
    first = jax.lax.axis_index(axis) * local_vocab
    y_cols = local_columns(y_N, local_vocab, axis).astype(jnp.int32)
    cw_local = None if cw_V is None else jax.lax.dynamic_slice_in_dim(cw_V, first, local_vocab)
    prob = Problem(x_ND, W, b_V, cw_local, y_cols, cfg)
    vocab = local_vocab * jax.lax.psum(1, axis)
    cw = None if cw_V is None else cw_V.astype(prob.wide)
    rows = TargetRows.build(y_N, cw, vocab, cfg.options.ignore_index, prob.wide)
    return prob, y_cols, rows, vocab if cw is None else cw.sum(), vocab


def _combined(stats, axis: str | None):
    """A row block's (lse, s_y, ws) over the whole head: the devices' combined over `axis`
    (a pmax and psums of a few floats per row, never logits)."""
    if axis is None:
        return stats
    lse, s_y, ws = stats
    return (global_lse(lse, axis), *jax.lax.psum((s_y, ws), axis))


class _CrossEntropyRule(engine.Rule):
    """Cross-entropy's per-row math on a `Problem`. A row block's operands: x, y (on a split,
    the global targets, read as the device's columns), valid, bad, in_range, cw_y; in the
    backward pass x, y as the problem's columns, then lse and the coefficients (P, T, S).
    scale: each row's upstream gradient where the forward pass forms gradients ("mean" is
    "sum" times 1 / the valid rows' summed class weight, a global the row blocks can't see)."""

    kept_whole = True  # per-row statistics and dz written over z: one block holds one [N, V]

    def __init__(self, prob: Problem, axis: str | None, cw_sum=None, vocab=None, scale=None):
        self.prob, self.axis, self.cw_sum, self.vocab, self.scale = prob, axis, cw_sum, vocab, scale
        self.opts = dataclasses.replace(prob.cfg.options, reduction="sum")

    def _y(self, xs):
        return local_columns(xs[1], self.prob.vocab, self.axis)  # in the step: the outputs stay the same on every device

    def init(self, xs):
        """(m, l, s_y, ws) before any column: (-inf, 0, 0, 0), [R] each."""
        zeros = jnp.zeros(xs[0].shape[0], self.prob.wide)
        return jnp.full(zeros.shape, -jnp.inf, self.prob.wide), zeros, zeros, zeros

    def stats(self, z, v0, xs, state, sweep):
        p, o = self.prob, self.opts
        return p.ops.stats(z, v0, p.b, self._y(xs), state, o.softcap, 1.0, p.cw, o.label_smoothing > 0)

    def done(self, xs, state, sweep):
        m, l, s_y, ws = state
        return _combined((m + jnp.log(l), s_y, ws), self.axis)

    def outputs(self, xs, state):
        return tuple(state)

    def _rows(self, xs):
        """The row block's TargetRows (forward pass: xs holds valid, bad, in_range, cw_y)."""
        valid, bad, in_range, cw_y = xs[2:6]
        return TargetRows(self._y(xs), valid, in_range, bad, cw_y)

    def coefficients(self, xs, state):
        if state is None:
            return tuple(xs[2:6])
        coefs = row_coefficients(self.scale, None, state[0], self._rows(xs), self.cw_sum, self.opts, self.vocab)
        return (state[0],) + tuple(coefs)

    def grad(self, z, v0, xs, coef):
        (lse, p, t, s), prob = coef, self.prob
        return prob.ops.grad(z, v0, prob.b, self._y(xs), self.opts.softcap, 1.0, lse, p, t, None, prob.cw, s)

    def stats_grad(self, z, xs):
        """The kernels' fused whole-row step (`kernels.rows_stats_grad`), which forms P's part
        that depends on lse from the row's lse."""
        p, o = self.prob, self.opts
        if p.ops.rows_stats_grad is None:
            return None
        rows = self._rows(xs)
        coefs = lse_coefficients(self.scale, rows, self.cw_sum, o, self.vocab, p.wide)
        lse, s_y, ws, dz = p.ops.rows_stats_grad(z, p.b, rows.safe_y, coefs, o.softcap, p.cw, o.label_smoothing > 0,
                                                 o.z_loss)
        return (lse, s_y, ws), dz


def forward(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, with_grads: bool, axis: str | None = None, scale=None):
    """(loss, lse [N], grads, logits) where grads = (dx, dW, db) for an upstream gradient of 1
    if with_grads (whole-row blocks), else None, and logits [N, V] with cfg.keep_logits
    (`engine.forward`'s, for `backward`), else None. axis: a head split over the vocabulary (W and
    b this device's equal slice of the classes, cw_V and y_N whole; `blocked.split_config`):
    each row block's statistics are combined over it before its dz, so the gradients still
    come from one product per block (6 N D V / P flops per device); grad_input is summed
    over it. scale: the gradients' upstream gradient where cfg's "sum" is a device's share
    of a mean over rows split across devices (`_local`), taken into dz's coefficients: a
    pass over grad_weight and its copy saved, and dz rounded as one device rounds it."""
    prob, y_cols, rows, cw_sum, vocab = _call(x_ND, W, b_V, cw_V, y_N, cfg, axis)
    opts, grads, kept = cfg.options, None, ()
    if cfg.fused_stats and not with_grads:
        lse, s_y, ws = _combined(_fused_row_stats(prob, x_ND, y_cols), axis)
    else:
        if scale is None:
            scale = 1.0 / rows.cw_y.sum() if opts.reduction == "mean" else jnp.asarray(1.0, prob.wide)
        per_row = (x_ND, rows.safe_y if axis is None else y_N, rows.valid, rows.bad, rows.in_range, rows.cw_y)
        acc = W.dtype if cfg.accumulate_in_input_dtype else prob.wide
        (lse, s_y, ws, *kept), grads = engine.forward(_CrossEntropyRule(prob, axis, cw_sum, vocab, scale), prob,
                                                      per_row, cfg.block_rows, with_grads, acc, prob.keep, axis,
                                                      cfg.tail_split, cfg.keep_logits and not with_grads)
    loss = reduce_loss(row_loss(lse, s_y, ws, rows, opts, cw_sum, vocab), rows, opts.reduction)
    return loss, lse, grads, kept[0] if kept else None


def backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N, cfg: BlockedConfig, axis: str | None = None, logits=None):
    """(dx, dW, db) recomputing the logits block by block, or from the forward pass's
    `logits` where it kept them (`engine.backward_kept`); axis as for `forward`."""
    prob, y_cols, rows, cw_sum, vocab = _call(x_ND, W, b_V, cw_V, y_N, cfg, axis)
    coefs = row_coefficients(g_loss, g_lse, lse_N, rows, cw_sum, cfg.options, vocab)
    rule, per_row = _CrossEntropyRule(prob, None), (x_ND, y_cols, lse_N) + tuple(coefs)
    if logits is not None:
        return engine.backward_kept(rule, prob, per_row, logits, cfg.block_rows, axis)
    acc = W.dtype if cfg.accumulate_in_input_dtype else prob.wide
    return engine.backward(rule, prob, per_row, cfg.block_rows, acc, prob.keep, axis, cfg.tail_split)


def _layout(cfg: BlockedConfig, outputs: tuple) -> Layout:
    """x, W, b, the class weights (every class on every device: "c"), y; the outputs named,
    "W" for W's factors."""
    w = "v d" if cfg.weight_layout == "VD" else "d v"
    return Layout(("n d", w, "v", "c", "n"), tuple(w if o == "W" else o for o in outputs))


def _local(cfg: BlockedConfig, axes: Axes, x_ND, W, y_N, cw_V):
    """(configuration, scale): the plan for a device's rows and classes, with split rows
    "mean" as "sum" and scale the reciprocal of every device's valid rows' summed class
    weight (else None); on whole operands, the call's own."""
    if not axes.rows and axes.vocab is None:
        return cfg, None
    opts, scale = cfg.options, None
    vocab = W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]
    whole = vocab * (jax.lax.psum(1, axes.vocab) if axes.vocab else 1)
    if axes.rows and opts.reduction == "mean":
        opts = dataclasses.replace(opts, reduction="sum")
        wide = compute_dtype(x_ND.dtype)
        rows = TargetRows.build(y_N, None if cw_V is None else cw_V.astype(wide), whole, opts.ignore_index, wide)
        scale = 1.0 / jax.lax.psum(rows.cw_y.sum(), axes.rows)
    local = blocked.plan(cfg.tuning, opts, cfg.weight_layout, cfg.strategy, x_ND.shape[0], x_ND.shape[1], vocab,
                         x_ND.dtype, cfg.accumulate_in_input_dtype, cfg.return_lse, "cpu" if cfg.interpret else "gpu",
                         whole if axes.vocab else None, split_rows=axes if axes.rows else None)
    local = dataclasses.replace(local, keep_logits=cfg.keep_logits)
    return (blocked.split_config(local) if axes.vocab else local), scale


def _forward_pass(static, axes: Axes, x_ND, W, b_V, cw_V, y_N):
    """(loss, lse, dx, dW, db, logits) of a device's rows and classes; the gradients (for an
    upstream gradient of 1) where static's with_grads is set, else None; the logits where
    the plan keeps them, else None."""
    cfg, with_grads = static
    local, scale = _local(cfg, axes, x_ND, W, y_N, cw_V)
    loss, lse, grads, logits = forward(x_ND, W, b_V, cw_V, y_N, local, with_grads, axes.vocab, scale)
    loss = loss if scale is None else (loss * scale).astype(loss.dtype)
    return (loss, lse) + (grads or (None,) * 3) + (logits,)


def _backward_pass(cfg: BlockedConfig, axes: Axes, g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N, logits):
    """(dx, dW, db) of a device's rows and classes, from its kept logits or recomputing them."""
    local, scale = _local(cfg, axes, x_ND, W, y_N, cw_V)
    g_loss = g_loss if scale is None else g_loss * scale
    return backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N, local, axes.vocab, logits)


def _forward(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis, with_grads: bool):
    loss = "" if cfg.options.reduction != "none" else "n"
    grads = ("n d", "W", None if b_V is None else "v") if with_grads else (None,) * 3
    kept = "n v" if cfg.keep_logits and not with_grads else None
    return partitioned.run(_forward_pass, (cfg, with_grads), _layout(cfg, (loss, "n") + grads + (kept,)), x_ND, W, b_V,
                           cw_V, y_N, axis=axis)


def _statistics(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis):
    """(loss, lse, logits): the kernels' through `partitioned`; "chunked"'s directly (plain
    XLA, which the partitioner splits itself, and which stays differentiable); logits
    where the plan keeps them, else None."""
    if cfg.strategy == "chunked":
        loss, lse, _, logits = forward(x_ND, W, b_V, cw_V, y_N, cfg, False, axis)
        return loss, lse, logits
    loss, lse, *_, logits = _forward(x_ND, W, b_V, cw_V, y_N, cfg, axis, False)
    return loss, lse, logits


@dataclasses.dataclass(frozen=True)
class CrossEntropyCall(engine.Call):
    """(loss, lse [N]) over arrays (x [N, D], W, b, cw, y [N] int32); fp32 (fp64 for fp64
    input). axis: inside shard_map, the axis splitting the head over the vocabulary (W and b
    the device's slice; cfg then `blocked.split_config`'s)."""

    cfg: BlockedConfig
    axis: str | None = None

    def forward(self, arrays, with_grads):
        if with_grads:
            loss, lse, *grads, _ = _forward(*arrays, self.cfg, self.axis, True)
            return (loss, lse), None, tuple(grads)
        loss, lse, logits = _statistics(*arrays, self.cfg, self.axis)
        return (loss, lse), (lse, logits), None

    def backward(self, arrays, saved, cotangents):
        cfg, (g_loss, g_lse), (lse, logits) = self.cfg, cotangents, saved
        if cfg.strategy == "chunked":
            return backward(g_loss, g_lse, *arrays, lse, cfg, self.axis)
        grads = ("n d", "W", None if arrays[2] is None else "v")
        layout = Layout(("" if cfg.options.reduction != "none" else "n", "n") + _layout(cfg, ()).operands + ("n", "n v"),
                        _layout(cfg, grads).outputs)
        return partitioned.run(_backward_pass, cfg, layout, g_loss, g_lse, *arrays, lse, logits, axis=self.axis)


def blocked_linear_cross_entropy(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis: str | None = None):
    """`CrossEntropyCall`'s (loss, lse) through `engine.apply`."""
    return engine.apply(CrossEntropyCall(cfg, axis), x_ND, W, b_V, cw_V, y_N)
