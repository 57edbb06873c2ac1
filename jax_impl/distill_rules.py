"""The distillation losses (interop/SPEC-DISTILLATION.md) as rules of the block engine
(`jax_impl.engine`), with the block steps of `jax_impl.steps` (Pallas kernels, or jax.numpy
for the fallback), differentiated by `engine.apply`.

As in `torch_impl.distill_rules`: the top-K loss gathers s at the teacher ids from the
blocks and writes the exact dz there over the grad kernel's dense term; the dense loss
blocks the teacher's logits like the student's (statistics of both in a first sweep, the
divergence's row sums in a second). Whole-row blocks with a reduced loss form the gradients
in the forward rule; otherwise the backward rule recomputes the blocks, or "speed" keeps
the student's logits for it (`engine.keeps_logits`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from interop import planning
from interop.distillation import DenseDistillationOptions
from interop.tuning import Tuning
from jax_impl import engine, partitioned
from jax_impl.head import Head
from jax_impl.partitioned import Axes, Layout
from jax_impl.steps import steps_of
from jax_impl.distill_rows import (TopKGradRows, TopKTeacher, gather_entries, global_denominator, put_entries,
                                   reduce_rows, row_weights, topk_row_terms)
from jax_impl.rows import compute_dtype
from jax_impl.vocab_parallel import global_lse, local_columns


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Static configuration of one call (hashable: part of its `engine.Call`)."""

    options: object  # TopKDistillationOptions or DenseDistillationOptions
    weight_layout: str
    strategy: str  # "speed", "memory" or "chunked"
    block_rows: int
    block_cols: int
    vocab: int  # the classes covered (dense: min of both heads')
    accumulate_in_input_dtype: bool  # grad_weight accumulates in the input dtype (the plan's narrow_accumulator)
    interpret: bool
    split_rows: object = None  # the Axes of rows split across devices (`Head.split_rows`), or None
    kernel_products: bool = False  # "memory" blocks multiplied by `row_products`' kernels, not XLA
    keep_logits: bool = False  # the forward pass keeps the logits for the backward pass (`engine.keeps_logits`)

    @property
    def grads_in_forward(self) -> bool:
        return self.block_cols >= self.vocab and self.options.reduction != "none"

    @property
    def ops(self):
        return steps_of(self.strategy, self.interpret)

    @property
    def unpartitioned(self) -> bool:
        """jax.numpy passes ("chunked") run as they are (`partitioned.run`'s whole): XLA
        partitions them itself, and they stay twice differentiable."""
        return self.strategy == "chunked"

    def head(self, x, W, b=None) -> Head:
        logits = compute_dtype(x.dtype) if self.ops.compute_logits else None
        return Head(x, W, b, self.weight_layout, self.block_cols, self.vocab, logits, self.split_rows,
                    self.kernel_products, self.interpret)

    def local(self, n_rows: int, vocab: int, axes) -> "DistillConfig":
        """The plan for a device's rows and classes (`jax_impl.partitioned`, its `Axes`): the
        same blocks, at most its rows, whole rows staying whole."""
        cols = vocab if self.block_cols >= self.vocab else min(self.block_cols, vocab)
        return dataclasses.replace(self, block_rows=min(self.block_rows, n_rows), block_cols=cols, vocab=vocab,
                                   split_rows=axes if axes.rows else None)

    def accumulate_dtype(self, dtype):
        return dtype if self.accumulate_in_input_dtype else compute_dtype(dtype)


def plan_steps(t: Tuning, loss: str, options, weight_layout, strategy, n_rows, hidden, vocab, dtype,
               accumulate_in_input_dtype, platform, whole_vocab: int | None = None,
               recomputes: bool = False) -> DistillConfig:
    """The configuration of a call of the block-step losses (loss "distillation" or
    "log_probs", the policy loss's too): `interop.planning.plan`'s blocks; a dense teacher's
    logits are blocked beside the student's (2 buffers); whole_vocab: a split head's classes
    (vocab: the device's); recomputes: the call's backward pass would recompute the logits
    (its upstream gradients unknown in the forward pass), which its forward pass then keeps
    where `engine.keeps_logits` says so."""
    buffers = 2 if isinstance(options, DenseDistillationOptions) else 1
    p = planning.plan(t, "jax", loss, strategy, n_rows, hidden, vocab, jnp.dtype(dtype).itemsize,
                      accumulate_in_input_dtype, buffers=buffers, whole_vocab=whole_vocab)
    keep = recomputes and engine.keeps_logits(t, strategy, p.cols >= vocab, n_rows, vocab, dtype, platform)
    return DistillConfig(options, weight_layout, strategy, p.rows, p.cols, vocab, p.narrow_accumulator,
                         interpret=platform != "gpu", kernel_products=p.kernel_products, keep_logits=keep)


def _vocab(W, cfg: DistillConfig) -> int:
    return W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]


def _running(R: int, dtype):
    """(m, l, s_y, ws) before any column: (-inf, 0, 0, 0)."""
    zeros = jnp.zeros((R,), dtype)
    return jnp.full((R,), -jnp.inf, dtype), zeros, zeros, zeros


# ----------------------------------------------------------------------------- top-K teacher


def _teacher_rows(t: TopKTeacher):
    return (t.ids, t.P, t.logP, t.entry, t.slot, t.bad)


class _TopKRule(engine.Rule):
    """Top-K distillation's per-row math. A row block's operands: x, y (-1: no target), r
    (the rows' upstream weights), the teacher's `_teacher_rows`, then in the backward pass
    what the forward pass saved (lse_T, lse_1, s_y, s_ids). axis: the shard_map axis of a
    head split over the vocabulary (teacher ids and y global, read as its columns)."""

    def __init__(self, cfg: DistillConfig, b_V, wide, axis: str | None):
        self.cfg, self.o, self.ops, self.b, self.wide, self.axis = cfg, cfg.options, cfg.ops, b_V, wide, axis
        self.two = self.o.weight_hard > 0 and self.o.temperature != 1.0

    def _cols(self, xs):
        """The block's targets and teacher ids as this device's columns."""
        return local_columns(xs[1], self.cfg.vocab, self.axis), local_columns(xs[3], self.cfg.vocab, self.axis)

    def init(self, xs):
        R, K = xs[3].shape
        return _running(R, self.wide), _running(R, self.wide), jnp.zeros((R, K), self.wide)

    def stats(self, z, v0, xs, c, sweep):
        (y, ids), o, (st, st1, s_ids) = self._cols(xs), self.o, c
        st = self.ops.stats(z, v0, self.b, y, st, o.softcap, 1.0 / o.temperature)
        st1 = self.ops.stats(z, v0, self.b, y, st1, o.softcap, 1.0) if self.two else st1
        return st, st1, s_ids + gather_entries(z, v0, ids, self.b, o.softcap, self.wide)

    def done(self, xs, c, sweep):
        """(lse_T, lse_1, s_y, s_ids), over every device's classes: a pmax and psums of a few
        numbers per row."""
        (m, l, sy, _), (m1, l1, _, _), s_ids = c
        lse_T = m + jnp.log(l)
        lse_1 = m1 + jnp.log(l1) if self.two else lse_T
        if self.axis is not None:
            lse_T, sy, s_ids = global_lse(lse_T, self.axis), *jax.lax.psum((sy, s_ids), self.axis)
            lse_1 = global_lse(lse_1, self.axis) if self.two else lse_T
        return lse_T, lse_1, sy, s_ids

    def _terms(self, xs, st):
        lse_T, lse_1, sy, s_ids = st
        _, _, _, _, P, logP, entry, _, bad = xs[:9]
        return topk_row_terms(s_ids, lse_T, lse_1, sy, P, logP, entry, bad, self.o)

    def outputs(self, xs, st):
        return (self._terms(xs, st)[0],) + tuple(st)

    def coefficients(self, xs, st):
        st = tuple(xs[9:]) if st is None else st
        (y, ids), (_, A, C) = self._cols(xs), self._terms(xs, st)
        lse_T, lse_1, _, s_ids = st
        return lse_T, TopKGradRows.build(xs[2], A, C, s_ids, lse_T, lse_1, ids, xs[7], y, self.o)

    def grad(self, z, v0, xs, coef):
        (y, ids), (lse_T, g), o = self._cols(xs), coef, self.o
        dz = self.ops.grad(z, v0, self.b, y, o.softcap, 1.0 / o.temperature, lse_T, g.p1, g.ty, g.second)
        return put_entries(dz, v0, ids, g.at_ids)


def _topk_forward(x_ND, W, b_V, teacher: TopKTeacher, y_N, valid_N, num_items, cfg: DistillConfig, with_grads: bool,
                  axis: str | None = None):
    """(loss, saved = (lse_T, lse_1, s_y, s_ids) per row and the logits [N, V] where
    cfg.keep_logits, grads (dx, dW, db) for an upstream gradient of 1 or None). axis: as for `_TopKRule` (grad_input summed over it)."""
    o, wide = cfg.options, compute_dtype(x_ND.dtype)
    r_N = row_weights(valid_N, o.reduction, 1.0, num_items, wide)
    outs, grads = engine.forward(_TopKRule(cfg, b_V, wide, axis), cfg.head(x_ND, W, b_V),
                                 (x_ND, y_N, r_N) + _teacher_rows(teacher), cfg.block_rows, with_grads,
                                 cfg.accumulate_dtype(W.dtype), axis=axis, keep_logits=cfg.keep_logits and not with_grads)
    return reduce_rows(outs[0], valid_N, o.reduction, num_items), outs[1:], grads


def _topk_backward(g_loss, x_ND, W, b_V, teacher: TopKTeacher, y_N, valid_N, num_items, saved, cfg: DistillConfig,
                   axis: str | None = None):
    wide = compute_dtype(x_ND.dtype)
    r_N = row_weights(valid_N, cfg.options.reduction, g_loss, num_items, wide)
    per_row = (x_ND, y_N, r_N) + _teacher_rows(teacher) + tuple(saved[:4])
    rule, head = _TopKRule(cfg, b_V, wide, axis), cfg.head(x_ND, W, b_V)
    if saved[4] is not None:
        return engine.backward_kept(rule, head, per_row, saved[4], cfg.block_rows, axis)
    return engine.backward(rule, head, per_row, cfg.block_rows, cfg.accumulate_dtype(W.dtype), axis=axis)


def _topk_layout(cfg: DistillConfig, head: tuple, outputs: tuple) -> Layout:
    """The top-K passes' operands after `head` (the upstream gradient's factors, or none):
    x, W, b, the teacher's entries (`TopKTeacher`'s fields), y, valid, num_items; outputs named,
    "W" for W's factors."""
    w = "v d" if cfg.weight_layout == "VD" else "d v"
    operands = head + ("n d", w, "v", "n k", "n k", "n k", "n k", "n k", "n", "n", "n", "")
    return Layout(operands, tuple(w if o == "W" else o for o in outputs))


def _topk_forward_pass(static, axes: Axes, x_ND, W, b_V, *rows):
    cfg, with_grads = static
    *teacher, y_N, valid_N, num_items = rows
    cfg = cfg.local(x_ND.shape[0], _vocab(W, cfg), axes)
    loss, saved, grads = _topk_forward(x_ND, W, b_V, TopKTeacher(*teacher), y_N, valid_N, num_items, cfg, with_grads,
                                       axes.vocab)
    saved += (None,) * (5 - len(saved))  # no logits kept
    return (loss, *saved[:4], *(grads or (None,) * 3), saved[4])


def _topk_backward_pass(cfg: DistillConfig, axes: Axes, g_loss, *saved_and_rows):
    *saved, x_ND, W, b_V = saved_and_rows[:8]
    *teacher, y_N, valid_N, num_items = saved_and_rows[8:]
    cfg = cfg.local(x_ND.shape[0], _vocab(W, cfg), axes)
    return _topk_backward(g_loss, x_ND, W, b_V, TopKTeacher(*teacher), y_N, valid_N, num_items, saved, cfg, axes.vocab)


def _loss_factors(cfg: DistillConfig) -> str:
    return "n" if cfg.options.reduction == "none" else ""


def _kept_factors(cfg: DistillConfig, with_grads: bool):
    """The kept logits' factors where a forward pass keeps them, else None."""
    return "n v" if cfg.keep_logits and not with_grads else None


def _topk_passes_forward(x_ND, W, b_V, teacher, y_N, valid_N, num_items, cfg, with_grads, axis):
    """(loss, saved, grads or None) through `jax_impl.partitioned`."""
    num_items = global_denominator(valid_N, num_items, cfg.options.reduction, compute_dtype(x_ND.dtype))
    grads = ("n d", "W", None if b_V is None else "v") if with_grads else (None,) * 3
    layout = _topk_layout(cfg, (), (_loss_factors(cfg), "n", "n", "n", "n k") + grads + (_kept_factors(cfg, with_grads),))
    loss, *rest = partitioned.run(_topk_forward_pass, (cfg, with_grads), layout, x_ND, W, b_V, *teacher,
                                  y_N, valid_N, num_items, axis=axis, whole=cfg.unpartitioned)
    return loss, tuple(rest[:4]) + (rest[7],), (tuple(rest[4:7]) if with_grads else None)


@dataclasses.dataclass(frozen=True)
class _TopKCall(engine.Call):
    """The reduced top-K loss over arrays (x [N, D], W, b, the teacher, y [N] int32 with -1
    for no target, valid [N], num_items None or a 0-d array); fp32 (fp64 for fp64 inputs).
    axis: as for `_topk_forward`."""

    cfg: DistillConfig
    axis: str | None = None

    def forward(self, arrays, with_grads):
        return _topk_passes_forward(*arrays, self.cfg, with_grads, self.axis)

    def backward(self, arrays, saved, g_loss):
        cfg, (x_ND, W, b_V, teacher, y_N, valid_N, num_items) = self.cfg, arrays
        num_items = global_denominator(valid_N, num_items, cfg.options.reduction, compute_dtype(x_ND.dtype))
        layout = _topk_layout(cfg, (_loss_factors(cfg), "n", "n", "n", "n k", "n v"),
                              ("n d", "W", None if b_V is None else "v"))
        return partitioned.run(_topk_backward_pass, cfg, layout, g_loss, *saved, x_ND, W, b_V, *teacher,
                               y_N, valid_N, num_items, axis=self.axis, whole=cfg.unpartitioned)


def topk_distillation(x_ND, W, b_V, teacher: TopKTeacher, y_N, valid_N, num_items, cfg: DistillConfig,
                      axis: str | None = None):
    """`_TopKCall`'s loss through `engine.apply`."""
    return engine.apply(_TopKCall(cfg, axis), x_ND, W, b_V, teacher, y_N, valid_N, num_items)


# ----------------------------------------------------------------------------- dense teacher


class _DenseRule(engine.Rule):
    """Dense distillation's per-row math. A row block's operands: x, the teacher's xt, r (the
    rows' upstream weights); in the backward pass the coefficient r scale / T and what the
    forward pass saved (lse_s, lse_t, kl_q) instead of r. axis: the mesh axis (shard_map's,
    or jit's vocabulary axis) over which both heads are split alike (each device the same
    slice of classes of each)."""

    sweeps = 2

    def __init__(self, cfg: DistillConfig, teacher: Head, wide, axis: str | None):
        self.o, self.ops, self.teacher, self.wide, self.axis = cfg.options, cfg.ops, teacher, wide, axis

    def _t(self, z, v0, xs):
        return self.teacher.col_logits(xs[1], v0, z.shape[1])

    def init(self, xs):
        R = xs[0].shape[0]
        return _running(R, self.wide), _running(R, self.wide)

    def stats(self, z, v0, xs, c, sweep):
        t, inv_t = self._t(z, v0, xs), 1.0 / self.o.temperature
        if sweep == 0:
            no_y = jnp.full((z.shape[0],), -1, jnp.int32)
            return self.ops.stats(z, v0, None, no_y, c[0], None, inv_t), self.ops.stats(t, v0, None, no_y, c[1], None, inv_t)
        lse_s, lse_t, ab = c
        return lse_s, lse_t, self.ops.pair_sums(z, t, lse_s, lse_t, ab, self.o)

    def done(self, xs, c, sweep):
        """After the statistics: (lse_s, lse_t, the divergence's row sums (0, 0)); after the
        sums: (lse_s, lse_t, a, b); each over every device's classes."""
        if sweep == 0:
            (ms, ls, _, _), (mt, lt, _, _) = c
            lse_s, lse_t = ms + jnp.log(ls), mt + jnp.log(lt)
            if self.axis is not None:
                lse_s, lse_t = global_lse(lse_s, self.axis), global_lse(lse_t, self.axis)
            zeros = jnp.zeros(lse_s.shape, self.wide)
            return lse_s, lse_t, (zeros, zeros)
        lse_s, lse_t, (a, b) = c
        return lse_s, lse_t, *(jax.lax.psum((a, b), self.axis) if self.axis is not None else (a, b))

    def outputs(self, xs, st):
        lse_s, lse_t, a, b = st
        o = self.o
        divergence = a if o.divergence == "forward_kl" else b if o.divergence == "reverse_kl" else o.beta * a + (1 - o.beta) * b
        return o.scale * divergence, lse_s, lse_t, b

    def coefficients(self, xs, st):
        if st is None:  # the backward pass: (coefficient, lse_s, lse_t, kl_q) given by rows
            return xs[3], xs[4], xs[5], xs[2]
        lse_s, lse_t, _, b = st
        return lse_s, lse_t, b, xs[2] * (self.o.scale / self.o.temperature)

    def grad(self, z, v0, xs, coef):
        lse_s, lse_t, kl_q, c = coef
        return self.ops.pair_grad(z, self._t(z, v0, xs), lse_s, lse_t, kl_q, c, self.o)


def _dense_rule(cfg: DistillConfig, x_ND, W, xt_ND, Wt, axis):
    wide = compute_dtype(x_ND.dtype)
    return _DenseRule(cfg, cfg.head(xt_ND, Wt), wide, axis), cfg.head(x_ND, W), wide


def _dense_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg: DistillConfig, with_grads: bool,
                   axis: str | None = None):
    """(loss, saved = (lse_s, lse_t, b) per row and the logits [N, V] where cfg.keep_logits,
    grads (dx, dW) for an upstream gradient of 1 or None). axis: as for `_DenseRule` (grad_input summed over it)."""
    rule, student, wide = _dense_rule(cfg, x_ND, W, xt_ND, Wt, axis)
    r_N = row_weights(valid_N, cfg.options.reduction, 1.0, num_items, wide)
    outs, grads = engine.forward(rule, student, (x_ND, xt_ND, r_N), cfg.block_rows, with_grads,
                                 cfg.accumulate_dtype(W.dtype), axis=axis, keep_logits=cfg.keep_logits and not with_grads)
    return reduce_rows(outs[0], valid_N, cfg.options.reduction, num_items), outs[1:], grads and grads[:2]


def _dense_backward(g_loss, x_ND, W, xt_ND, Wt, valid_N, num_items, saved, cfg: DistillConfig,
                    axis: str | None = None):
    rule, student, wide = _dense_rule(cfg, x_ND, W, xt_ND, Wt, axis)
    o = cfg.options
    coef_N = row_weights(valid_N, o.reduction, g_loss, num_items, wide) * (o.scale / o.temperature)
    per_row = (x_ND, xt_ND, coef_N) + tuple(saved[:3])
    if saved[3] is not None:
        return engine.backward_kept(rule, student, per_row, saved[3], cfg.block_rows, axis)[:2]
    return engine.backward(rule, student, per_row, cfg.block_rows, cfg.accumulate_dtype(W.dtype), axis=axis)[:2]


def _dense_layout(cfg: DistillConfig, head: tuple, outputs: tuple, W, Wt) -> Layout:
    """The dense passes' operands after `head`: x, W, the teacher's xt and Wt ("e" its hidden
    dimension, "u" its classes), valid, num_items. A teacher of the student's classes has them
    split alike with the student's head (a replicated teacher is sliced where it lies); one of
    other classes keeps both heads' classes on every device (`Layout.split_vocab`)."""
    w, wt = ("v d", "u e") if cfg.weight_layout == "VD" else ("d v", "e u")
    operands = head + ("n d", w, "n e", wt, "n", "")
    return Layout(operands, tuple(w if o == "W" else o for o in outputs),
                  split_vocab=_vocab(W, cfg) == _vocab(Wt, cfg))


def _dense_forward_pass(static, axes: Axes, x_ND, W, xt_ND, Wt, valid_N, num_items):
    cfg, with_grads = static
    cfg = cfg.local(x_ND.shape[0], min(_vocab(W, cfg), _vocab(Wt, cfg)), axes)
    loss, saved, grads = _dense_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg, with_grads, axes.vocab)
    saved += (None,) * (4 - len(saved))  # no logits kept
    return (loss, *saved[:3], *(grads or (None,) * 2), saved[3])


def _dense_backward_pass(cfg: DistillConfig, axes: Axes, g_loss, lse_s, lse_t, kl_q, logits, x_ND, W, xt_ND, Wt,
                         valid_N, num_items):
    cfg = cfg.local(x_ND.shape[0], min(_vocab(W, cfg), _vocab(Wt, cfg)), axes)
    return _dense_backward(g_loss, x_ND, W, xt_ND, Wt, valid_N, num_items, (lse_s, lse_t, kl_q, logits), cfg,
                           axes.vocab)


def _dense_passes_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg, with_grads, axis):
    """(loss, saved, grads or None) through `jax_impl.partitioned`."""
    num_items = global_denominator(valid_N, num_items, cfg.options.reduction, compute_dtype(x_ND.dtype))
    grads = ("n d", "W") if with_grads else (None,) * 2
    layout = _dense_layout(cfg, (), (_loss_factors(cfg), "n", "n", "n") + grads + (_kept_factors(cfg, with_grads),), W, Wt)
    loss, *rest = partitioned.run(_dense_forward_pass, (cfg, with_grads), layout, x_ND, W, xt_ND, Wt, valid_N,
                                  num_items, axis=axis, whole=cfg.unpartitioned)
    return loss, tuple(rest[:3]) + (rest[5],), (tuple(rest[3:5]) if with_grads else None)


@dataclasses.dataclass(frozen=True)
class _DenseCall(engine.Call):
    """The reduced dense-teacher loss over arrays (student x [N, D] and W, teacher xt [N, Dt]
    and Wt (no gradient), valid [N], num_items); fp32 (fp64 for fp64 inputs). axis: as for
    `_dense_forward`."""

    cfg: DistillConfig
    axis: str | None = None
    n_grads = 2

    def forward(self, arrays, with_grads):
        return _dense_passes_forward(*arrays, self.cfg, with_grads, self.axis)

    def backward(self, arrays, saved, g_loss):
        cfg, (x_ND, W, xt_ND, Wt, valid_N, num_items) = self.cfg, arrays
        num_items = global_denominator(valid_N, num_items, cfg.options.reduction, compute_dtype(x_ND.dtype))
        layout = _dense_layout(cfg, (_loss_factors(cfg), "n", "n", "n", "n v"), ("n d", "W"), W, Wt)
        return partitioned.run(_dense_backward_pass, cfg, layout, g_loss, *saved, x_ND, W, xt_ND, Wt, valid_N,
                               num_items, axis=self.axis, whole=cfg.unpartitioned)


def dense_distillation(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg: DistillConfig, axis: str | None = None):
    """`_DenseCall`'s loss through `engine.apply` (the teacher gets no gradient)."""
    return engine.apply(_DenseCall(cfg, axis), x_ND, W, xt_ND, Wt, valid_N, num_items)
