"""The distillation losses over blocks of logits (interop/SPEC-DISTILLATION.md) for JAX: the
blocks and strategies of `jax_impl.blocked`, the block steps of `jax_impl.steps`
(Pallas kernels, or jax.numpy for the fallback), inside a `jax.custom_vjp`.

As in `torch_impl.distill_blocked`: the top-K loss gathers s at the teacher ids from the
blocks and writes the exact dz there over the grad kernel's dense term; the dense loss
blocks the teacher's logits like the student's. Whole-row blocks with a reduced loss form
the gradients in the forward rule; otherwise the backward rule recomputes the blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from interop.blocking import block_shape, chunk_rows
from interop.distillation import DenseDistillationOptions
from interop.tuning import Tuning
from jax_impl import partitioned
from jax_impl.blocked import Head
from jax_impl.partitioned import Axes, Layout
from jax_impl.steps import steps_of
from jax_impl.distill_rows import (TopKGradRows, TopKTeacher, gather_entries, global_denominator, put_entries,
                                   reduce_rows, row_weights, topk_row_terms)
from jax_impl.rows import compute_dtype, row_loop
from jax_impl.vocab_parallel import global_lse, local_columns, summed_grad_input


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Static configuration of one call (a nondiff argument of the custom_vjp)."""

    options: object  # TopKDistillationOptions or DenseDistillationOptions
    weight_layout: str
    strategy: str  # "speed", "memory" or "chunked"
    block_rows: int
    block_cols: int
    vocab: int  # the classes covered (dense: min of both heads')
    accumulate_in_input_dtype: bool
    interpret: bool

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
        return Head(x, W, b, self.weight_layout, self.block_cols, self.vocab, logits)

    def local(self, n_rows: int, vocab: int) -> "DistillConfig":
        """The plan for a device's rows and classes (`jax_impl.partitioned`): the same blocks,
        at most its rows, whole rows staying whole."""
        cols = vocab if self.block_cols >= self.vocab else min(self.block_cols, vocab)
        return dataclasses.replace(self, block_rows=min(self.block_rows, n_rows), block_cols=cols, vocab=vocab)

    def accumulate_dtype(self, dtype):
        if self.accumulate_in_input_dtype or self.strategy == "memory":
            return dtype
        return compute_dtype(dtype)


def plan_distillation(t: Tuning, options, weight_layout, strategy, n_rows, hidden, vocab, dtype, accumulate_in_input_dtype,
                      platform) -> DistillConfig:
    """The blocks of one call; a dense teacher's logits are blocked beside the student's (2 buffers)."""
    if strategy == "chunked":
        rows, cols = chunk_rows(t, n_rows, hidden, vocab), vocab
    else:
        buffers = 2 if isinstance(options, DenseDistillationOptions) else 1
        rows, cols = block_shape(t, strategy, n_rows, hidden, vocab, jnp.dtype(dtype).itemsize, buffers)
    return DistillConfig(options, weight_layout, strategy, rows, cols, vocab, accumulate_in_input_dtype,
                         interpret=platform != "gpu")


def _vocab(W, cfg: DistillConfig) -> int:
    return W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]


def _running(R: int, dtype):
    """(m, l, s_y, ws) before any column: (-inf, 0, 0, 0)."""
    zeros = jnp.zeros((R,), dtype)
    return jnp.full((R,), -jnp.inf, dtype), zeros, zeros, zeros


def _grad_buffers(cfg: DistillConfig, W, bias: bool):
    acc = cfg.accumulate_dtype(W.dtype)
    db = jnp.zeros((W.shape[0] if cfg.weight_layout == "VD" else W.shape[1],), compute_dtype(W.dtype)) if bias else None
    return jnp.zeros(W.shape, acc), db


def _final(g, like):
    return None if g is None else g.astype(like.dtype)


# ----------------------------------------------------------------------------- top-K teacher


def _teacher_rows(t: TopKTeacher):
    return (t.ids, t.P, t.logP, t.entry, t.slot, t.bad)


def _topk_forward(x_ND, W, b_V, teacher: TopKTeacher, y_N, valid_N, num_items, cfg: DistillConfig, with_grads: bool,
                  axis: str | None = None):
    """(loss, saved = (lse_T, lse_1, s_y, s_ids) per row, grads (dx, dW, db) for an upstream
    gradient of 1 or None). axis: the shard_map axis of a head split over the vocabulary
    (W, b this device's classes; teacher ids and y global, read as its columns): each row
    block's statistics are combined over it before its row terms, and grad_input is summed
    over it."""
    o, ops, head = cfg.options, cfg.ops, cfg.head(x_ND, W, b_V)
    n, wide, K = x_ND.shape[0], compute_dtype(x_ND.dtype), teacher.ids.shape[1]
    two = o.weight_hard > 0 and o.temperature != 1.0
    inv_t = 1.0 / o.temperature

    def stats(z, v0, x_R, y_R, ids_R, c):
        st, st1, s_ids = c
        st = ops.stats(z, v0, b_V, y_R, st, o.softcap, inv_t)
        st1 = ops.stats(z, v0, b_V, y_R, st1, o.softcap, 1.0) if two else st1
        return st, st1, s_ids + gather_entries(z, v0, ids_R, b_V, o.softcap, wide)

    def row_step(carry, xs):
        x_R, y_R, r_R, ids_R, P_R, logP_R, entry_R, slot_R, bad_R = xs
        y_R, ids_R = local_columns(y_R, cfg.vocab, axis), local_columns(ids_R, cfg.vocab, axis)
        R = x_R.shape[0]
        init = (_running(R, wide), _running(R, wide), jnp.zeros((R, K), wide))
        if with_grads:
            z = head.logits(x_R, W)
            (m, l, sy, _), (m1, l1, _, _), s_ids = stats(z, 0, x_R, y_R, ids_R, init)
        else:
            body = lambda v0, cols, c: stats(head.logits(x_R, head.head_cols(v0, cols)), v0, x_R, y_R, ids_R, c)
            (m, l, sy, _), (m1, l1, _, _), s_ids = head.col_loop(body, init)
        lse_T = m + jnp.log(l)
        lse_1 = m1 + jnp.log(l1) if two else lse_T
        if axis is not None:  # every device's classes: a pmax and psums of a few numbers per row
            lse_T, sy, s_ids = global_lse(lse_T, axis), *jax.lax.psum((sy, s_ids), axis)
            lse_1 = global_lse(lse_1, axis) if two else lse_T
        loss_R, A, C = topk_row_terms(s_ids, lse_T, lse_1, sy, P_R, logP_R, entry_R, bad_R, o)
        outs = (loss_R, lse_T, lse_1, sy, s_ids)
        if not with_grads:
            return carry, outs
        g = TopKGradRows.build(r_R, A, C, s_ids, lse_T, lse_1, ids_R, slot_R, y_R, o)
        dz = ops.grad(z, 0, b_V, y_R, o.softcap, inv_t, lse_T, g.p1, g.ty, g.second)
        dz = put_entries(dz, 0, ids_R, g.at_ids)
        dW, db, dx_R = head.add_shares(dz, x_R, 0, cfg.vocab, *carry, jnp.zeros(x_R.shape, wide))
        return (dW, db), outs + (dx_R if axis is not None else dx_R.astype(x_R.dtype),)

    r_N = row_weights(valid_N, o.reduction, 1.0, num_items, wide)
    per_row = (x_ND, y_N, r_N) + _teacher_rows(teacher)
    carry = _grad_buffers(cfg, W, b_V is not None) if with_grads else None
    carry, outs = row_loop(row_step, carry, per_row, n, cfg.block_rows)
    loss = reduce_rows(outs[0], valid_N, o.reduction, num_items)
    if not with_grads:
        return loss, outs[1:5], None
    dW, db = carry
    return loss, outs[1:5], (summed_grad_input(outs[5], x_ND, axis), _final(dW, W), _final(db, b_V))


def _topk_backward(g_loss, x_ND, W, b_V, teacher: TopKTeacher, y_N, valid_N, num_items, saved, cfg: DistillConfig,
                   axis: str | None = None):
    o, ops, head = cfg.options, cfg.ops, cfg.head(x_ND, W, b_V)
    n, wide = x_ND.shape[0], compute_dtype(x_ND.dtype)

    def row_step(carry, xs):
        x_R, y_R, r_R, lse_T, lse_1, s_y, s_ids, ids_R, P_R, logP_R, entry_R, slot_R, bad_R = xs
        y_R, ids_R = local_columns(y_R, cfg.vocab, axis), local_columns(ids_R, cfg.vocab, axis)
        _, A, C = topk_row_terms(s_ids, lse_T, lse_1, s_y, P_R, logP_R, entry_R, bad_R, o)
        g = TopKGradRows.build(r_R, A, C, s_ids, lse_T, lse_1, ids_R, slot_R, y_R, o)

        def body(v0, cols, c):
            dz = ops.grad(head.logits(x_R, head.head_cols(v0, cols)), v0, b_V, y_R, o.softcap, 1.0 / o.temperature,
                          lse_T, g.p1, g.ty, g.second)
            return head.add_shares(put_entries(dz, v0, ids_R, g.at_ids), x_R, v0, cols, *c)

        dW, db, dx_R = head.col_loop(body, carry + (jnp.zeros(x_R.shape, wide),))
        return (dW, db), (dx_R if axis is not None else dx_R.astype(x_R.dtype),)

    r_N = row_weights(valid_N, o.reduction, g_loss, num_items, wide)
    per_row = (x_ND, y_N, r_N) + tuple(saved) + _teacher_rows(teacher)
    (dW, db), (dx,) = row_loop(row_step, _grad_buffers(cfg, W, b_V is not None), per_row, n, cfg.block_rows)
    return summed_grad_input(dx, x_ND, axis), _final(dW, W), _final(db, b_V)


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
    cfg = cfg.local(x_ND.shape[0], _vocab(W, cfg))
    loss, saved, grads = _topk_forward(x_ND, W, b_V, TopKTeacher(*teacher), y_N, valid_N, num_items, cfg, with_grads,
                                       axes.vocab)
    return (loss, *saved, *(grads or (None,) * 3))


def _topk_backward_pass(cfg: DistillConfig, axes: Axes, g_loss, *saved_and_rows):
    *saved, x_ND, W, b_V = saved_and_rows[:7]
    *teacher, y_N, valid_N, num_items = saved_and_rows[7:]
    cfg = cfg.local(x_ND.shape[0], _vocab(W, cfg))
    return _topk_backward(g_loss, x_ND, W, b_V, TopKTeacher(*teacher), y_N, valid_N, num_items, saved, cfg, axes.vocab)


def _loss_factors(cfg: DistillConfig) -> str:
    return "n" if cfg.options.reduction == "none" else ""


def _topk_passes_forward(x_ND, W, b_V, teacher, y_N, valid_N, num_items, cfg, with_grads, axis):
    """(loss, saved, grads or None) through `jax_impl.partitioned`."""
    num_items = global_denominator(valid_N, num_items, cfg.options.reduction, compute_dtype(x_ND.dtype))
    grads = ("n d", "W", None if b_V is None else "v") if with_grads else (None,) * 3
    layout = _topk_layout(cfg, (), (_loss_factors(cfg), "n", "n", "n", "n k") + grads)
    loss, *rest = partitioned.run(_topk_forward_pass, (cfg, with_grads), layout, x_ND, W, b_V, *teacher,
                                  y_N, valid_N, num_items, axis=axis, whole=cfg.unpartitioned)
    return loss, tuple(rest[:4]), (tuple(rest[4:]) if with_grads else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def topk_distillation(x_ND, W, b_V, teacher: TopKTeacher, y_N, valid_N, num_items, cfg: DistillConfig,
                      axis: str | None = None):
    """The reduced top-K loss over flattened rows (x [N, D], y [N] int32 with -1 for no
    target, valid [N], num_items None or a 0-d array); fp32 (fp64 for fp64 inputs). axis:
    as for `_topk_forward`."""
    return _topk_passes_forward(x_ND, W, b_V, teacher, y_N, valid_N, num_items, cfg, False, axis)[0]


def _topk_fwd(x_ND, W, b_V, teacher, y_N, valid_N, num_items, cfg, axis):
    args = (teacher, y_N, valid_N, num_items)
    if cfg.grads_in_forward:
        loss, _, grads = _topk_passes_forward(x_ND, W, b_V, *args, cfg, True, axis)
        return loss, (True, grads)
    loss, saved, _ = _topk_passes_forward(x_ND, W, b_V, *args, cfg, False, axis)
    return loss, (False, (x_ND, W, b_V, args, saved))


def _scaled(grads, g):
    return tuple(None if a is None else (a * g.astype(jnp.float32)).astype(a.dtype) for a in grads)


def _topk_bwd(cfg, axis, res, g_loss):
    in_forward, payload = res
    if in_forward:
        return _scaled(payload, g_loss) + (None,) * 4
    x_ND, W, b_V, (teacher, y_N, valid_N, num_items), saved = payload
    num_items = global_denominator(valid_N, num_items, cfg.options.reduction, compute_dtype(x_ND.dtype))
    layout = _topk_layout(cfg, (_loss_factors(cfg), "n", "n", "n", "n k"), ("n d", "W", None if b_V is None else "v"))
    grads = partitioned.run(_topk_backward_pass, cfg, layout, g_loss, *saved, x_ND, W, b_V, *teacher,
                            y_N, valid_N, num_items, axis=axis, whole=cfg.unpartitioned)
    return grads + (None,) * 4


topk_distillation.defvjp(_topk_fwd, _topk_bwd)


# ----------------------------------------------------------------------------- dense teacher


def _divergence(a, b, o):
    if o.divergence == "forward_kl":
        return a
    if o.divergence == "reverse_kl":
        return b
    return o.beta * a + (1 - o.beta) * b


def _dense_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg: DistillConfig, with_grads: bool,
                   axis: str | None = None):
    """(loss, saved = (lse_s, lse_t, b) per row, grads (dx, dW) for an upstream gradient of 1 or None).
    axis: the shard_map axis over which both heads are split alike (each device the same
    slice of classes of each): each row block's lse of both heads and the divergence's row
    sums are combined over it before its row terms, and grad_input is summed over it."""
    o, ops = cfg.options, cfg.ops
    student, teacher = cfg.head(x_ND, W), cfg.head(xt_ND, Wt)
    n, wide, inv_t = x_ND.shape[0], compute_dtype(x_ND.dtype), 1.0 / cfg.options.temperature

    def row_step(carry, xs):
        x_R, xt_R, r_R = xs
        R = x_R.shape[0]
        no_y = jnp.full((R,), -1, jnp.int32)
        pair = lambda v0, cols: (student.logits(x_R, student.head_cols(v0, cols)),
                                 teacher.logits(xt_R, teacher.head_cols(v0, cols)))

        def stats(v0, cols, c):
            s, t = pair(v0, cols)
            return ops.stats(s, v0, None, no_y, c[0], None, inv_t), ops.stats(t, v0, None, no_y, c[1], None, inv_t)

        (ms, ls, _, _), (mt, lt, _, _) = student.col_loop(stats, (_running(R, wide), _running(R, wide)))
        lse_s, lse_t = ms + jnp.log(ls), mt + jnp.log(lt)
        if axis is not None:
            lse_s, lse_t = global_lse(lse_s, axis), global_lse(lse_t, axis)
        sums = lambda v0, cols, c: ops.pair_sums(*pair(v0, cols), lse_s, lse_t, c, o)
        a, b = student.col_loop(sums, (jnp.zeros((R,), wide), jnp.zeros((R,), wide)))
        if axis is not None:
            a, b = jax.lax.psum((a, b), axis)
        outs = (o.scale * _divergence(a, b, o), lse_s, lse_t, b)
        if not with_grads:
            return carry, outs
        dz = ops.pair_grad(*pair(0, cfg.vocab), lse_s, lse_t, b, r_R * (o.scale * inv_t), o)
        dW, _, dx_R = student.add_shares(dz, x_R, 0, cfg.vocab, carry, None, jnp.zeros(x_R.shape, wide))
        return dW, outs + (dx_R if axis is not None else dx_R.astype(x_R.dtype),)

    r_N = row_weights(valid_N, o.reduction, 1.0, num_items, wide)
    carry = _grad_buffers(cfg, W, False)[0] if with_grads else None
    carry, outs = row_loop(row_step, carry, (x_ND, xt_ND, r_N), n, cfg.block_rows)
    loss = reduce_rows(outs[0], valid_N, o.reduction, num_items)
    if not with_grads:
        return loss, outs[1:4], None
    return loss, outs[1:4], (summed_grad_input(outs[4], x_ND, axis), _final(carry, W))


def _dense_backward(g_loss, x_ND, W, xt_ND, Wt, valid_N, num_items, saved, cfg: DistillConfig,
                    axis: str | None = None):
    o, ops = cfg.options, cfg.ops
    student, teacher = cfg.head(x_ND, W), cfg.head(xt_ND, Wt)
    n, wide = x_ND.shape[0], compute_dtype(x_ND.dtype)

    def row_step(dW, xs):
        x_R, xt_R, coef_R, lse_s, lse_t, kl_q = xs

        def body(v0, cols, c):
            s = student.logits(x_R, student.head_cols(v0, cols))
            t = teacher.logits(xt_R, teacher.head_cols(v0, cols))
            dz = ops.pair_grad(s, t, lse_s, lse_t, kl_q, coef_R, o)
            dW, _, dx = student.add_shares(dz, x_R, v0, cols, c[0], None, c[1])
            return dW, dx

        dW, dx_R = student.col_loop(body, (dW, jnp.zeros(x_R.shape, wide)))
        return dW, (dx_R if axis is not None else dx_R.astype(x_R.dtype),)

    coef_N = row_weights(valid_N, o.reduction, g_loss, num_items, wide) * (o.scale / o.temperature)
    per_row = (x_ND, xt_ND, coef_N) + tuple(saved)
    dW, (dx,) = row_loop(row_step, _grad_buffers(cfg, W, False)[0], per_row, n, cfg.block_rows)
    return summed_grad_input(dx, x_ND, axis), _final(dW, W)


def _dense_layout(cfg: DistillConfig, head: tuple, outputs: tuple) -> Layout:
    """The dense passes' operands after `head`: x, W, the teacher's xt and Wt ("e" its hidden
    dimension, "u" its classes), valid, num_items; under jit both heads' classes on every
    device (a split of one would need the other's alike: the shard_map axis' case)."""
    w, wt = ("v d", "u e") if cfg.weight_layout == "VD" else ("d v", "e u")
    operands = head + ("n d", w, "n e", wt, "n", "")
    return Layout(operands, tuple(w if o == "W" else o for o in outputs), split_vocab=False)


def _dense_forward_pass(static, axes: Axes, x_ND, W, xt_ND, Wt, valid_N, num_items):
    cfg, with_grads = static
    cfg = cfg.local(x_ND.shape[0], cfg.vocab)
    loss, saved, grads = _dense_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg, with_grads, axes.vocab)
    return (loss, *saved, *(grads or (None,) * 2))


def _dense_backward_pass(cfg: DistillConfig, axes: Axes, g_loss, lse_s, lse_t, kl_q, x_ND, W, xt_ND, Wt, valid_N,
                         num_items):
    cfg = cfg.local(x_ND.shape[0], cfg.vocab)
    return _dense_backward(g_loss, x_ND, W, xt_ND, Wt, valid_N, num_items, (lse_s, lse_t, kl_q), cfg, axes.vocab)


def _dense_passes_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg, with_grads, axis):
    """(loss, saved, grads or None) through `jax_impl.partitioned`."""
    num_items = global_denominator(valid_N, num_items, cfg.options.reduction, compute_dtype(x_ND.dtype))
    grads = ("n d", "W") if with_grads else (None,) * 2
    layout = _dense_layout(cfg, (), (_loss_factors(cfg), "n", "n", "n") + grads)
    loss, *rest = partitioned.run(_dense_forward_pass, (cfg, with_grads), layout, x_ND, W, xt_ND, Wt, valid_N,
                                  num_items, axis=axis, whole=cfg.unpartitioned)
    return loss, tuple(rest[:3]), (tuple(rest[3:]) if with_grads else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def dense_distillation(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg: DistillConfig, axis: str | None = None):
    """The reduced dense-teacher loss over flattened rows (student x [N, D], teacher xt
    [N, Dt]; the teacher gets no gradient); fp32 (fp64 for fp64 inputs). axis: as for
    `_dense_forward`."""
    return _dense_passes_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg, False, axis)[0]


def _dense_fwd(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg, axis):
    if cfg.grads_in_forward:
        loss, _, grads = _dense_passes_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg, True, axis)
        return loss, (True, grads)
    loss, saved, _ = _dense_passes_forward(x_ND, W, xt_ND, Wt, valid_N, num_items, cfg, False, axis)
    return loss, (False, (x_ND, W, xt_ND, Wt, valid_N, num_items, saved))


def _dense_bwd(cfg, axis, res, g_loss):
    in_forward, payload = res
    if in_forward:
        return _scaled(payload, g_loss) + (None,) * 4
    x_ND, W, xt_ND, Wt, valid_N, num_items, saved = payload
    num_items = global_denominator(valid_N, num_items, cfg.options.reduction, compute_dtype(x_ND.dtype))
    layout = _dense_layout(cfg, (_loss_factors(cfg), "n", "n", "n"), ("n d", "W"))
    return partitioned.run(_dense_backward_pass, cfg, layout, g_loss, *saved, x_ND, W, xt_ND, Wt, valid_N,
                           num_items, axis=axis, whole=cfg.unpartitioned) + (None,) * 4


dense_distillation.defvjp(_dense_fwd, _dense_bwd)
