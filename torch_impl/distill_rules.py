"""The distillation losses (interop/SPEC-DISTILLATION.md) as rules of the block engine
(`torch_impl.engine`), on block steps (`torch_impl.steps`: Triton kernels, or PyTorch ops
for the fallback).

- top-K teacher: per row block, the student's statistics at temperature T (and at 1 for a
  hard-label term), s at the teacher ids (gathered from the blocks), then dz = the dense
  cross-entropy-shaped term from the grad step, with the exact values at the teacher ids
  written over it.
- dense teacher: the teacher's logits are blocked like the student's (its own buffer);
  statistics of both (the first sweep), the divergence's row sums (the second), then dz
  over the student's block.

"speed" (whole rows) with a reduced loss forms the gradients in the forward pass; otherwise
the backward pass recomputes the blocks (the student's are read where the engine kept them).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from interop.distillation import DenseDistillationOptions, TopKDistillationOptions
from torch_impl import engine
from torch_impl.head import BlockPlan, HeadBlocks
from torch_impl.distill_rows import TopKGradRows, TopKTeacher, gather_entries, reduce_rows, row_weights, topk_row_terms
from torch_impl.rows import compute_dtype
from torch_impl.steps import TorchOps
from torch_impl.vocab_parallel import VocabSplit, combine_stats

SECOND_ORDER_MESSAGE = "logitless: the distillation losses give first-order gradients only (no double backward or Hessians)"


def _head(x, W, b, layout, plan, ops, split, vocab=None, active=None) -> HeadBlocks:
    """The blocks of a head over x's rows (with a split's sequence parallel, gathered)."""
    dtype = compute_dtype(x.dtype) if ops.logits_dtype == "compute" else None
    x = x if split is None else split.whole_rows(x)
    return HeadBlocks(x, W, b, layout, plan, vocab=vocab, logits_dtype=dtype, active=active)


def _running(n: int, dtype, device):
    """(m, l, s_y) before any column: (-inf, 0, 0)."""
    return (torch.full((n,), -math.inf, dtype=dtype, device=device), torch.zeros(n, dtype=dtype, device=device),
            torch.zeros(n, dtype=dtype, device=device))


def _forms_grads(need, plan: BlockPlan, vocab: int, reduction: str) -> bool:
    """Whether the forward pass forms the gradients: some are needed, the plan's blocks are
    whole rows of `vocab` classes (a split's largest slice: every rank decides alike) and the
    loss is reduced (its upstream gradient is one number)."""
    return any(need) and plan.block_cols >= vocab and reduction != "none"


# ----------------------------------------------------------------------------- top-K teacher


class TopKRule(engine.Rule):
    """Top-K distillation's per-row math over the rows `blocks` computes: the teacher and y
    [N] (int64, -1 where there is no valid, in-range target) in this rank's columns; valid
    [N]. saved: (lse_T, lse_1, s_ids, s_y) of the forward pass, for the backward pass;
    grad_loss: the upstream gradient (0-d, or [N] for "none"; 1 where the forward pass forms
    the gradients)."""

    def __init__(self, blocks: HeadBlocks, teacher: TopKTeacher, y_N, valid_N, o: TopKDistillationOptions, ops,
                 num_items, split: VocabSplit | None, saved=None, grad_loss=None):
        self.blocks, self.teacher, self.y, self.valid, self.o, self.ops = blocks, teacher, y_N, valid_N, o, ops
        self.num_items, self.group = num_items, None if split is None else split.group
        n, dev, K = blocks.n_rows, blocks.x.device, teacher.ids.shape[1]
        wide = compute_dtype(blocks.x.dtype)
        self.two = o.weight_hard > 0 and o.temperature != 1.0
        if saved is None:
            self.m, self.l, self.s_y = _running(n, wide, dev)
            self.m1, self.l1, self.sy1 = _running(n, wide, dev)
            self.lse_T, self.lse_1, self.loss = (torch.empty(n, dtype=wide, device=dev) for _ in range(3))
            self.s_ids = torch.zeros(n, K, dtype=wide, device=dev)
        else:
            self.lse_T, self.lse_1, self.s_ids, self.s_y = saved
        self.r = None if grad_loss is None else row_weights(valid_N, o.reduction, grad_loss, num_items, wide)

    @property
    def saved(self):
        return self.lse_T, self.lse_1, self.s_ids, self.s_y

    def stats_(self, z, v0, rs, sweep):
        o, b = self.o, self.blocks.b
        self.ops.stats_(z, v0, b, self.y[rs], self.m[rs], self.l[rs], self.s_y[rs], o.softcap, 1.0 / o.temperature)
        if self.two:
            self.ops.stats_(z, v0, b, self.y[rs], self.m1[rs], self.l1[rs], self.sy1[rs], o.softcap, 1.0)
        self.s_ids[rs] += gather_entries(z, v0, self.teacher.ids[rs], b, o.softcap, self.s_ids.dtype)

    def rows_done(self, rs, sweep):
        pairs = [(self.m[rs], self.l[rs]), (self.m1[rs], self.l1[rs])] if self.two else [(self.m[rs], self.l[rs])]
        lses = combine_stats(pairs, [self.s_y[rs], self.s_ids[rs]], self.group)
        self.lse_T[rs], self.lse_1[rs] = lses[0], lses[-1]
        self.loss[rs] = topk_row_terms(self.s_ids[rs], self.lse_T[rs], self.lse_1[rs], self.s_y[rs], self.teacher, rs,
                                       self.o)[0]

    def total(self):
        """The reduced loss (or [N] for "none") of the forward pass."""
        return reduce_rows(self.loss, self.valid, self.o.reduction, self.num_items)

    def coefficients(self, rs):
        _, A, C = topk_row_terms(self.s_ids[rs], self.lse_T[rs], self.lse_1[rs], self.s_y[rs], self.teacher, rs, self.o)
        self.g = TopKGradRows(self.r[rs], A, C, self.s_ids[rs], self.lse_T[rs], self.lse_1[rs], self.teacher,
                              self.y[rs], rs, self.o)

    def grad(self, z, v0, rs):
        o, g = self.o, self.g
        dz = self.ops.grad(z, v0, self.blocks.b, self.y[rs], o.softcap, 1.0 / o.temperature, self.lse_T[rs], g.p1, g.ty,
                           g.second)
        self.ops.put_(dz, v0, self.teacher.ids[rs], g.at_ids)
        return dz


@dataclasses.dataclass
class TopKCall(engine.Call):
    """`TopKRule` on tensors (x [N, D], W, b [V] or None, y [N] int64, -1 where there is no
    (valid, in-range) target; valid [N]); outputs (the reduced loss, fp32 or fp64 for fp64
    inputs); saved (lse_T, lse_1, s_ids, s_y) per row. num_items: None, a number or a 0-d
    tensor; active: int64 [A], the only rows of x computed (HeadBlocks), or None (the
    teacher, y, valid, the losses and saved are then over those A rows, dx over all of
    x's). split: a head split over the vocabulary (W this rank's classes; the teacher's ids
    and y this rank's columns, -1 for the others')."""

    teacher: TopKTeacher
    o: TopKDistillationOptions
    layout: str
    plan: BlockPlan
    ops: type
    num_items: object
    active: torch.Tensor | None
    split: VocabSplit | None
    message = SECOND_ORDER_MESSAGE

    def __post_init__(self):
        self.kernels = self.ops is not TorchOps

    def forward(self, tensors, need):
        x, W, b, y, valid = tensors
        W_vocab = W.shape[0] if self.layout == "VD" else W.shape[1]
        now = _forms_grads(need, self.plan, W_vocab if self.split is None else self.split.largest, self.o.reduction)
        blocks = _head(x, W, b, self.layout, self.plan, self.ops, self.split, active=self.active)
        one = torch.ones((), device=x.device) if now else None
        rule = TopKRule(blocks, self.teacher, y, valid, self.o, self.ops, self.num_items, self.split, grad_loss=one)
        grads = engine.forward(rule, blocks, need if now else (False,) * 3, self.split, x)
        return (rule.total(),), rule.saved, grads if now else None

    def backward(self, tensors, saved, grad_outputs, need):
        x, W, b, y, valid = tensors
        blocks = _head(x, W, b, self.layout, self.plan, self.ops, self.split, active=self.active)
        rule = TopKRule(blocks, self.teacher, y, valid, self.o, self.ops, self.num_items, self.split, saved,
                        grad_outputs[0])
        return engine.backward(rule, blocks, need, self.split, x)


# ----------------------------------------------------------------------------- dense teacher


class DenseRule(engine.Rule):
    """Dense distillation's per-row math: the student's blocks and the teacher's (over the
    same rows and `vocab` classes), valid [N]. saved: (lse_s, lse_t, kl_q) of the forward
    pass; grad_loss as for `TopKRule`."""

    sweeps = 2

    def __init__(self, student: HeadBlocks, teacher: HeadBlocks, valid_N, o: DenseDistillationOptions, ops, num_items,
                 split: VocabSplit | None, saved=None, grad_loss=None):
        self.blocks, self.teacher, self.valid, self.o, self.ops = student, teacher, valid_N, o, ops
        self.num_items, self.split = num_items, split
        n, dev, wide = student.n_rows, student.x.device, compute_dtype(student.x.dtype)
        self.no_y = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.last = None  # (row block, v0) of the teacher's logits in its buffer
        if saved is None:
            self.ms, self.ls, self.sy = _running(n, wide, dev)
            self.mt, self.lt, _ = _running(n, wide, dev)
            self.lse_s, self.lse_t, self.kl_q, self.loss = (torch.empty(n, dtype=wide, device=dev) for _ in range(4))
            self.a, self.b = torch.zeros(n, dtype=wide, device=dev), torch.zeros(n, dtype=wide, device=dev)
        else:
            self.lse_s, self.lse_t, self.kl_q = saved
        if grad_loss is not None:
            self.coef = row_weights(valid_N, o.reduction, grad_loss, num_items, wide) * (o.scale / o.temperature)

    @property
    def saved(self):
        return self.lse_s, self.lse_t, self.kl_q

    def _teacher_logits(self, rs, v0, cols):
        """The teacher's block of rows rs and columns v0..v0+cols (kept while the student's
        block is reused: whole rows)."""
        if self.last != (rs.start, v0):
            self.t, self.last = self.teacher.logits(rs, v0, cols), (rs.start, v0)
        return self.t

    def stats_(self, z, v0, rs, sweep):
        t, T = self._teacher_logits(rs, v0, z.shape[1]), self.o.temperature
        if sweep == 0:
            self.ops.stats_(z, v0, None, self.no_y[rs], self.ms[rs], self.ls[rs], self.sy[rs], None, 1.0 / T)
            self.ops.stats_(t, v0, None, self.no_y[rs], self.mt[rs], self.lt[rs], self.sy[rs], None, 1.0 / T)
        else:
            self.ops.pair_sums_(z, t, self.lse_s[rs], self.lse_t[rs], self.a[rs], self.b[rs], self.o)

    def rows_done(self, rs, sweep):
        if sweep == 0:
            self.lse_s[rs], self.lse_t[rs] = combine_stats([(self.ms[rs], self.ls[rs]), (self.mt[rs], self.lt[rs])], [],
                                                           None if self.split is None else self.split.group)
            return
        a, b = self.a[rs], self.b[rs]
        if self.split is not None:
            self.split.sum_([a, b])
        o = self.o
        divergence = a if o.divergence == "forward_kl" else b if o.divergence == "reverse_kl" else o.beta * a + (1 - o.beta) * b
        self.loss[rs], self.kl_q[rs] = o.scale * divergence, b

    def total(self):
        return reduce_rows(self.loss, self.valid, self.o.reduction, self.num_items)

    def coefficients(self, rs):
        pass  # every row's coefficient is formed at once

    def grad(self, z, v0, rs):
        t = self._teacher_logits(rs, v0, z.shape[1])
        return self.ops.pair_grad(z, t, self.lse_s[rs], self.lse_t[rs], self.kl_q[rs], self.coef[rs], self.o)

    def release(self):
        self.teacher.release()  # the teacher's logits buffer, as the loop releases the student's
        self.t = None


@dataclasses.dataclass
class DenseCall(engine.Call):
    """`DenseRule` on tensors (student x [N, D] and W, teacher xt [N, Dt] and Wt (no
    gradient), valid [N]) over the first `vocab` classes of both heads; outputs (the reduced
    loss, fp32 or fp64 for fp64 inputs); saved (lse_s, lse_t, kl_q) per row. num_items and
    active as for TopKCall; split: both heads split over the vocabulary alike."""

    o: DenseDistillationOptions
    layout: str
    vocab: int
    plan: BlockPlan
    ops: type
    num_items: object
    active: torch.Tensor | None
    split: VocabSplit | None
    n_grads = 2
    message = SECOND_ORDER_MESSAGE

    def __post_init__(self):
        self.kernels = self.ops is not TorchOps

    def forward(self, tensors, need):
        x, W, xt, Wt, valid = tensors
        now = _forms_grads(need, self.plan, self.vocab if self.split is None else self.split.largest, self.o.reduction)
        student, teacher = self._heads(x, W, xt, Wt)
        one = torch.ones((), device=x.device) if now else None
        rule = DenseRule(student, teacher, valid, self.o, self.ops, self.num_items, self.split, grad_loss=one)
        dx, dW, _ = engine.forward(rule, student, (*need, False) if now else (False,) * 3, self.split, x)
        return (rule.total(),), rule.saved, (dx, dW) if now else None

    def backward(self, tensors, saved, grad_outputs, need):
        x, W, xt, Wt, valid = tensors
        student, teacher = self._heads(x, W, xt, Wt)
        rule = DenseRule(student, teacher, valid, self.o, self.ops, self.num_items, self.split, saved, grad_outputs[0])
        return engine.backward(rule, student, (*need, False), self.split, x)[:2]

    def _heads(self, x, W, xt, Wt):
        return tuple(_head(a, w, None, self.layout, self.plan, self.ops, self.split, self.vocab, self.active)
                     for a, w in ((x, W), (xt, Wt)))
