"""The distillation losses over blocks of logits (interop/SPEC-DISTILLATION.md), for
PyTorch: the same blocks and strategies as `torch_impl.blocked`, the block steps from
`torch_impl.steps` (Triton kernels, or PyTorch ops for the fallback).

- top-K teacher: per row block, the student's statistics at temperature T (and at 1 for a
  hard-label term), s at the teacher ids (gathered from the blocks), then dz = the dense
  cross-entropy-shaped term from the grad kernel, with the exact values at the teacher ids
  written over it.
- dense teacher: the teacher's logits are blocked like the student's (its own buffer);
  statistics of both, the divergence's row sums, then dz over the student's block.

"speed" (whole rows) with a reduced loss forms the gradients in the forward pass; otherwise
the backward pass recomputes the blocks.
"""

from __future__ import annotations

import math

import torch

from interop.distillation import DenseDistillationOptions, TopKDistillationOptions
from torch_impl.blocks import HeadBlocks, final_grad
from torch_impl.vocab_parallel import VocabSplit, combine_stats
from torch_impl.autograd import first_order_only, scale_formed
from torch_impl.distill_rows import TopKGradRows, TopKTeacher, gather_entries, reduce_rows, row_weights, topk_row_terms
from torch_impl.rows import compute_dtype
from torch_impl.steps import TorchOps


def _head(x, W, b, layout, plan, ops, vocab=None, active=None) -> HeadBlocks:
    dtype = compute_dtype(x.dtype) if ops.logits_dtype == "compute" else None
    return HeadBlocks(x, W, b, layout, plan, vocab=vocab, logits_dtype=dtype, active=active)


def _running(R: int, dtype, device):
    """(m, l, s_y) before any column: (-inf, 0, 0)."""
    return (torch.full((R,), -math.inf, dtype=dtype, device=device), torch.zeros(R, dtype=dtype, device=device),
            torch.zeros(R, dtype=dtype, device=device))


SECOND_ORDER_MESSAGE = "logitless: the distillation losses give first-order gradients only (no double backward or Hessians)"

# ----------------------------------------------------------------------------- top-K teacher


def topk_forward(x, W, b_V, teacher: TopKTeacher, y_N, valid_N, o: TopKDistillationOptions, layout, plan, ops,
                 num_items, grads_now=(False, False, False), active=None, split: VocabSplit | None = None):
    """(loss, saved, grads): saved = (lse_T, lse_1, s_ids, s_y) per row for the backward
    pass; grads = (dx, dW, db) for an upstream gradient of 1 if any of grads_now is set.
    x: the rows [N, D]; y_N: int64, -1 where there is no (valid, in-range) target. active:
    int64 [A], the only rows of x computed (HeadBlocks), or None; the teacher, y_N, valid_N,
    the losses and saved are then over those A rows, dx over all of x's. split: a head split
    over the vocabulary (W this rank's classes; teacher.ids and y_N this rank's columns, -1
    for the others'): the statistics are combined over the ranks before the row terms (each
    row block's where its gradients are formed here, else every row's after the loop: one
    combine), and grad_input is summed over them in fp32."""
    x_ND = x if split is None else split.whole_rows(x)
    blocks = _head(x_ND, W, b_V, layout, plan, ops, active=active)
    n, dev, K = blocks.n_rows, x_ND.device, teacher.ids.shape[1]
    wide = compute_dtype(x_ND.dtype)
    two = o.weight_hard > 0 and o.temperature != 1.0
    group = None if split is None else split.group
    m, l, s_y = _running(n, wide, dev)
    m1, l1, sy1 = _running(n, wide, dev)
    lse_T, lse_1 = torch.empty(n, dtype=wide, device=dev), torch.empty(n, dtype=wide, device=dev)
    s_ids = torch.zeros(n, K, dtype=wide, device=dev)
    loss = torch.empty(n, dtype=wide, device=dev)
    in_forward = any(grads_now)
    assert not in_forward or blocks.whole_rows, "gradients in the forward pass need whole rows"
    dx, _, dW, db = blocks.gradient_buffers(*grads_now, wide_dx=split is not None)
    r_N = row_weights(valid_N, o.reduction, torch.ones((), device=dev), num_items, wide) if in_forward else None

    def row_terms(rs):
        """Rows rs' lse (combined over a split's ranks) and losses; their (A, C)."""
        lses = combine_stats([(m[rs], l[rs]), (m1[rs], l1[rs])] if two else [(m[rs], l[rs])], [s_y[rs], s_ids[rs]],
                             group)
        lse_T[rs], lse_1[rs] = lses[0], lses[-1]
        loss[rs], A, C = topk_row_terms(s_ids[rs], lse_T[rs], lse_1[rs], s_y[rs], teacher, rs, o)
        return A, C

    for rs in blocks.row_blocks():
        for v0, cols in blocks.col_blocks():
            z = blocks.logits(rs, v0, cols)
            ops.stats_(z, v0, b_V, y_N[rs], m[rs], l[rs], s_y[rs], o.softcap, 1.0 / o.temperature)
            if two:
                ops.stats_(z, v0, b_V, y_N[rs], m1[rs], l1[rs], sy1[rs], o.softcap, 1.0)
            s_ids[rs] += gather_entries(z, v0, teacher.ids[rs], b_V, o.softcap, wide)
        if group is not None and not in_forward:
            continue  # a split's row terms once after the loop: one combine of every row's statistics
        A, C = row_terms(rs)
        if in_forward:
            g = TopKGradRows(r_N[rs], A, C, s_ids[rs], lse_T[rs], lse_1[rs], teacher, y_N[rs], rs, o)
            dz = ops.grad(z, 0, b_V, y_N[rs], o.softcap, 1.0 / o.temperature, lse_T[rs], g.p1, g.ty, g.second)
            ops.put_(dz, 0, teacher.ids[rs], g.at_ids)
            dx_R = None if dx is None else blocks.dx_rows(dx, rs)
            blocks.add_grads(dz, rs, 0, blocks.vocab, dx_R, dW, db)
            if dx_R is not None:
                blocks.scatter_dx_rows(dx, rs, dx_R)
    if group is not None and not in_forward:
        row_terms(slice(0, n))
    total = reduce_rows(loss, valid_N, o.reduction, num_items)
    z = dz = blocks = None  # the logits buffer goes before dW's conversion allocates its result
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return total, (lse_T, lse_1, s_ids, s_y), (dx, final_grad(dW, W), final_grad(db, b_V))


def topk_backward(grad_loss, x, W, b_V, teacher: TopKTeacher, y_N, valid_N, saved, o, layout, plan, ops, num_items,
                  need=(True, True, True), active=None, split: VocabSplit | None = None):
    """(dx, dW, db) recomputing the logits block by block; None where not needed; active
    and split as for topk_forward."""
    x_ND = x if split is None else split.whole_rows(x)
    blocks = _head(x_ND, W, b_V, layout, plan, ops, active=active)
    lse_T, lse_1, s_ids, s_y = saved
    r_N = row_weights(valid_N, o.reduction, grad_loss, num_items, lse_T.dtype)
    dx, dx_acc, dW, db = blocks.gradient_buffers(*need, wide_dx=split is not None)
    for rs in blocks.row_blocks():
        _, A, C = topk_row_terms(s_ids[rs], lse_T[rs], lse_1[rs], s_y[rs], teacher, rs, o)
        g = TopKGradRows(r_N[rs], A, C, s_ids[rs], lse_T[rs], lse_1[rs], teacher, y_N[rs], rs, o)
        dx_out = dx_rows(blocks, dx, dx_acc, rs)
        for v0, cols in blocks.col_blocks():
            dz = ops.grad(blocks.logits(rs, v0, cols), v0, b_V, y_N[rs], o.softcap, 1.0 / o.temperature, lse_T[rs],
                          g.p1, g.ty, g.second)
            ops.put_(dz, v0, teacher.ids[rs], g.at_ids)
            blocks.add_grads(dz, rs, v0, cols, dx_out, dW, db, dx_accumulate=dx_acc is not None)
        store_dx_rows(blocks, dx, dx_acc, dx_out, rs)
    dz = blocks = dx_acc = None
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return dx, final_grad(dW, W), final_grad(db, b_V)


def dx_rows(blocks: HeadBlocks, dx, dx_acc, rs):
    """Where row block rs's grad_input shares go: the fp32 accumulator (rows spanning several
    column blocks), else dx's rows (`HeadBlocks.dx_rows`); None without dx. Shared by every
    loss whose backward pass walks `HeadBlocks` with block steps."""
    if dx is None:
        return None
    return blocks.dx_rows(dx, rs) if dx_acc is None else dx_acc[: rs.stop - rs.start]


def store_dx_rows(blocks: HeadBlocks, dx, dx_acc, dx_out, rs) -> None:
    """After row block rs: `dx_rows`'s block into dx's rows (the accumulator zeroed for the next)."""
    if dx is None:
        return
    if dx_acc is None:
        blocks.scatter_dx_rows(dx, rs, dx_out)
    else:
        blocks.put_dx_rows(dx, rs, dx_out)
        dx_acc.zero_()


class TopKDistillation(torch.autograd.Function):
    """Over flattened rows: x [N, D], W, b [V] or None; returns the reduced loss (fp32, or
    fp64 for fp64 inputs). Non-tensor arguments: the teacher (TopKTeacher), y [N] int64 (-1:
    none), valid [N], options, layout, plan, ops, num_items (None, a number or a 0-d tensor),
    active (int64 [A] or None: the only rows computed; the teacher, y and valid then [A]),
    split (a head split over the vocabulary, `topk_forward`)."""

    @staticmethod
    def forward(ctx, x_ND, W, b_V, teacher, y_N, valid_N, o, layout, plan, ops, num_items, active, split):
        need = ctx.needs_input_grad[:3]
        # the classes the plan is for: W's, or a split's largest slice (every rank decides alike)
        vocab = (W.shape[0] if layout == "VD" else W.shape[1]) if split is None else split.largest
        in_forward = any(need) and plan.block_cols >= vocab and o.reduction != "none"
        loss, saved, grads = topk_forward(x_ND, W, b_V, teacher, y_N, valid_N, o, layout, plan, ops, num_items,
                                          need if in_forward else (False, False, False), active, split)
        ctx.grads = grads if in_forward else None
        ctx.args = (teacher, y_N, valid_N, o, layout, plan, ops, num_items, active, split)
        ctx.save_for_backward(x_ND, W, b_V, *saved)
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return first_order_only(ctx, TopKDistillation._backward, grad_loss, message=SECOND_ORDER_MESSAGE)

    @staticmethod
    def _backward(ctx, grad_loss):
        none = (None,) * 10
        if grad_loss is None:
            return (None, None, None) + none
        x_ND, W, b_V, *saved = ctx.saved_tensors
        teacher, y_N, valid_N, o, layout, plan, ops, num_items, active, split = ctx.args
        if ctx.grads is not None:  # the first backward of gradients formed in the forward pass
            grads, ctx.grads = ctx.grads, None
            return scale_formed(grads, grad_loss, kernels=ops is not TorchOps) + none
        grads = topk_backward(grad_loss, x_ND, W, b_V, teacher, y_N, valid_N, saved, o, layout, plan, ops, num_items,
                              ctx.needs_input_grad[:3], active, split)
        return tuple(grads) + none


# ----------------------------------------------------------------------------- dense teacher


def _divergence(a, b, o: DenseDistillationOptions):
    if o.divergence == "forward_kl":
        return a
    if o.divergence == "reverse_kl":
        return b
    return o.beta * a + (1 - o.beta) * b


def dense_forward(x, W, xt_ND, Wt, valid_N, o: DenseDistillationOptions, layout, vocab, plan, ops, num_items,
                  grads_now=(False, False), active=None, split: VocabSplit | None = None):
    """(loss, saved, grads) over the first `vocab` classes of both heads: saved = (lse_s,
    lse_t, b) per row; grads = (dx, dW) for an upstream gradient of 1 if grads_now. active
    as for topk_forward (valid_N, the losses and saved over its rows). split: both heads
    split over the vocabulary alike (W and Wt this rank's classes): each row block's
    statistics, then its divergence sums, are combined over the ranks; grad_input is summed
    over them in fp32."""
    x_ND = x if split is None else split.whole_rows(x)
    group = None if split is None else split.group
    student = _head(x_ND, W, None, layout, plan, ops, vocab, active)
    teacher = _head(xt_ND if split is None else split.whole_rows(xt_ND), Wt, None, layout, plan, ops, vocab, active)
    n, dev, wide = student.n_rows, x_ND.device, compute_dtype(x_ND.dtype)
    lse_s, lse_t, kl_q = (torch.empty(n, dtype=wide, device=dev) for _ in range(3))
    loss = torch.empty(n, dtype=wide, device=dev)
    no_y = torch.full((n,), -1, dtype=torch.int64, device=dev)
    in_forward = any(grads_now)
    dx, _, dW, _ = student.gradient_buffers(*grads_now, False, wide_dx=split is not None)
    r_N = row_weights(valid_N, o.reduction, torch.ones((), device=dev), num_items, wide) if in_forward else None
    for rs in student.row_blocks():
        R = rs.stop - rs.start
        ms, ls, sy = _running(R, wide, dev)
        mt, lt, _ = _running(R, wide, dev)
        for v0, cols in student.col_blocks():
            s, t = student.logits(rs, v0, cols), teacher.logits(rs, v0, cols)
            ops.stats_(s, v0, None, no_y[rs], ms, ls, sy, None, 1.0 / o.temperature)
            ops.stats_(t, v0, None, no_y[rs], mt, lt, sy, None, 1.0 / o.temperature)
        lse_s[rs], lse_t[rs] = combine_stats([(ms, ls), (mt, lt)], [], group)
        a, b = torch.zeros(R, dtype=wide, device=dev), torch.zeros(R, dtype=wide, device=dev)
        for v0, cols in student.col_blocks():
            if not student.whole_rows:
                s, t = student.logits(rs, v0, cols), teacher.logits(rs, v0, cols)
            ops.pair_sums_(s, t, lse_s[rs], lse_t[rs], a, b, o)
        if split is not None:
            split.sum_([a, b])
        loss[rs], kl_q[rs] = o.scale * _divergence(a, b, o), b
        if in_forward:
            dz = ops.pair_grad(s, t, lse_s[rs], lse_t[rs], b, r_N[rs] * (o.scale / o.temperature), o)
            dx_R = None if dx is None else student.dx_rows(dx, rs)
            student.add_grads(dz, rs, 0, student.vocab, dx_R, dW, None)
            if dx_R is not None:
                student.scatter_dx_rows(dx, rs, dx_R)
    total = reduce_rows(loss, valid_N, o.reduction, num_items)
    s = t = dz = student = teacher = None
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return total, (lse_s, lse_t, kl_q), (dx, final_grad(dW, W))


def dense_backward(grad_loss, x, W, xt_ND, Wt, valid_N, saved, o, layout, vocab, plan, ops, num_items, need=(True, True),
                   active=None, split: VocabSplit | None = None):
    """(dx, dW) recomputing both heads' logits block by block; None where not needed; active
    and split as for dense_forward."""
    x_ND = x if split is None else split.whole_rows(x)
    student = _head(x_ND, W, None, layout, plan, ops, vocab, active)
    teacher = _head(xt_ND if split is None else split.whole_rows(xt_ND), Wt, None, layout, plan, ops, vocab, active)
    lse_s, lse_t, kl_q = saved
    coef_N = row_weights(valid_N, o.reduction, grad_loss, num_items, lse_s.dtype) * (o.scale / o.temperature)
    dx, dx_acc, dW, _ = student.gradient_buffers(*need, False, wide_dx=split is not None)
    for rs in student.row_blocks():
        dx_out = dx_rows(student, dx, dx_acc, rs)
        for v0, cols in student.col_blocks():
            s, t = student.logits(rs, v0, cols), teacher.logits(rs, v0, cols)
            dz = ops.pair_grad(s, t, lse_s[rs], lse_t[rs], kl_q[rs], coef_N[rs], o)
            student.add_grads(dz, rs, v0, cols, dx_out, dW, None, dx_accumulate=dx_acc is not None)
        store_dx_rows(student, dx, dx_acc, dx_out, rs)
    s = t = dz = student = teacher = dx_acc = None
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return dx, final_grad(dW, W)


class DenseDistillation(torch.autograd.Function):
    """Over flattened rows: student x [N, D] and W, teacher xt [N, Dt] and Wt (no gradient);
    returns the reduced loss (fp32, fp64 for fp64 inputs). Non-tensor arguments: valid [N],
    options, layout, vocab (min of both), plan, ops, num_items, active (as for
    TopKDistillation; valid then [A]), split (both heads split alike, `dense_forward`)."""

    @staticmethod
    def forward(ctx, x_ND, W, xt_ND, Wt, valid_N, o, layout, vocab, plan, ops, num_items, active, split):
        need = ctx.needs_input_grad[:2]
        # the classes the plan is for: both heads', or a split's largest slice (every rank decides alike)
        in_forward = any(need) and plan.block_cols >= (vocab if split is None else split.largest) \
            and o.reduction != "none"
        loss, saved, grads = dense_forward(x_ND, W, xt_ND, Wt, valid_N, o, layout, vocab, plan, ops, num_items,
                                           need if in_forward else (False, False), active, split)
        ctx.grads = grads if in_forward else None
        ctx.args = (valid_N, o, layout, vocab, plan, ops, num_items, active, split)
        ctx.save_for_backward(x_ND, W, xt_ND, Wt, *saved)
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return first_order_only(ctx, DenseDistillation._backward, grad_loss, message=SECOND_ORDER_MESSAGE)

    @staticmethod
    def _backward(ctx, grad_loss):
        none = (None,) * 11
        if grad_loss is None:
            return (None, None) + none
        x_ND, W, xt_ND, Wt, *saved = ctx.saved_tensors
        valid_N, o, layout, vocab, plan, ops, num_items, active, split = ctx.args
        if ctx.grads is not None:  # the first backward of gradients formed in the forward pass
            grads, ctx.grads = ctx.grads, None
            return scale_formed(grads, grad_loss, kernels=ops is not TorchOps) + none
        grads = dense_backward(grad_loss, x_ND, W, xt_ND, Wt, valid_N, saved, o, layout, vocab, plan, ops, num_items,
                               ctx.needs_input_grad[:2], active, split)
        return tuple(grads) + none
