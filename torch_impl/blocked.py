"""The GPU path: blocks of logits from cuBLAS, turned into statistics and dz by Triton.

The logits are computed one block of [R rows, C vocabulary columns] at a time into one
reused buffer; the Triton kernels of `torch_impl.kernels` reduce a block to per-row
statistics or rewrite it, in place, as dz; cuBLAS then adds dz's share to the gradients.

Two strategies (`torch_impl.head.plan`, from interop.planning):
- "speed": blocks of whole rows (C = V). When the loss is reduced ("mean"/"sum") and
  no lse is returned, the gradients are computed during the forward pass (6 N D V flops)
  and the backward pass only scales them. grad_weight is accumulated across row blocks in
  fp32 (or in the input dtype with `accumulate_in_input_dtype`), in slabs
  (`WeightGrad`); with one row block it is one product written in the input dtype.
- "memory": blocks of [R, C] sized so that the logits block and the fp32 grad_input
  accumulator of one row block together stay under a few percent of the gradients'
  bytes (on a split head, of the whole head's: interop.planning). The backward pass recomputes the logits (8 N D V flops). grad_weight is
  accumulated in fp32 inside each row block (one matrix product over R rows) and in the
  input dtype across row blocks. Where enough whole rows fit in its budget
  (interop.blocking.whole_row_memory_scratch), "memory" takes blocks of whole rows as
  "speed" does (layout "rows", 6 N D V flops) with grad_weight in the input dtype; those
  blocks' logits lie in a scratch that follows grad_input in one buffer and in grad_input's
  rows not written yet, so the first blocks are the largest.
Either may compute only some rows (`active`: those whose target is not ignored, from
`torch_impl.functional.rows_to_compute`), gathered block by block.

With a `VocabSplit` (a head split over the vocabulary, `torch_impl.vocab_parallel`) each rank
computes the blocks of its own classes, and each row block's statistics are combined over
the ranks before its losses (and in blocks of whole rows its dz: "speed" still forms the
gradients in the forward pass), a few floats per row; the ranks plan the same row blocks
(for the largest rank's classes; "memory" one device's block for the whole head, its
columns cut to those classes), so they make the same collectives. grad_input
is summed over the ranks in fp32 (`VocabSplit.sum_grad_input`), so it is not kept in the
logits' buffer ("memory" takes tiles), and no gradient is filtered.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from interop.options import CrossEntropyOptions
from torch_impl import engine
from torch_impl.arguments import dense
from torch_impl.autograd import SECOND_ORDER_MESSAGE
from torch_impl.head import BlockPlan, HeadBlocks, addmm_
from torch_impl.kernels import FILTER_COLS, RowMath, TargetCheck, TileFilter, block_grad_, block_stats_
from torch_impl.vocab_parallel import VocabSplit, combine_stats


class CrossEntropyKernelRule(engine.Rule):
    """Cross-entropy's per-row math on the kernels over `blocks`: y and cw are the call's
    (global with a split); y_cols and cw_cols, what the block kernels read: the targets as
    columns of this rank's classes and their class weights. In a plan of whole rows
    ("rows") each block's statistics, losses and (with `forming`) dz come from one row
    kernel (`RowMath.rows_`), filtered where the plan filters; in tiles, the block kernels
    merge statistics and the losses follow per row block. For the backward pass: lse and the
    upstream gradients (grad_loss 0-d or [N], grad_lse [N] or None)."""

    def __init__(self, blocks: HeadBlocks, cw_V, y_N, opts: CrossEntropyOptions, check: TargetCheck | None,
                 split: VocabSplit | None, forming: bool = False, lse=None, grad_loss=None, grad_lse=None):
        self.blocks, self.opts, self.split, self.forming = blocks, opts, split, forming
        self.cw = None if cw_V is None else cw_V.float()
        self.y = blocks.active_rows(y_N.to(torch.int64))
        self.rows = RowMath(self.y, self.cw, opts, blocks.vocab if split is None else split.vocab, check)
        self.y_cols, self.cw_cols = (self.y, self.cw) if split is None else split.columns(self.y, self.cw, blocks.vocab)
        # a split's ranks take the plan's branch, not their own slice's (a narrow slice can be whole in tiles)
        self.fused = blocks.whole_rows if split is None else blocks.plan.layout == "rows"
        n, dev = blocks.n_rows, blocks.x.device
        self.filter = None
        if lse is None:
            self.lse, self.loss = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(2))
            if not self.fused:
                self.m = torch.full((n,), -math.inf, dtype=torch.float32, device=dev)
                self.l, self.sy, self.ws = (torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(3))
        else:
            self.lse = lse
            self.grad_loss = torch.zeros((), dtype=torch.float32, device=dev) if grad_loss is None else \
                blocks.active_rows(grad_loss) if grad_loss.ndim else grad_loss
            self.grad_lse = None if grad_lse is None else blocks.active_rows(grad_lse)

    def _losses_(self, m, l, sy, ws, rs: slice) -> None:
        """lse and the row losses of rows rs from this rank's statistics (fp32 [R] each),
        combined over the split's ranks first."""
        if self.split is not None:
            (lse,) = combine_stats([(m, l)], [sy, ws], self.split.group)
            m, l = lse, torch.ones_like(lse)  # m + log(l) is then the combined lse itself
        self.rows.losses_(m, l, sy, ws, rs, self.lse[rs], self.loss[rs])

    def _tile_filter(self, rs: slice) -> TileFilter | None:
        """A fresh TileFilter for the whole rows rs when the plan filters, else None."""
        if self.blocks.plan.filter_eps is None or not self.blocks.whole_rows:
            return None
        return TileFilter(self.blocks.plan.filter_eps, rs.stop - rs.start, self.blocks.vocab, self.blocks.x.device)

    def stats_(self, z, v0, rs, sweep):
        o, b = self.opts, self.blocks.b
        if not self.fused:
            block_stats_(z, v0, b, self.cw_cols, self.y_cols[rs], self.m[rs], self.l[rs], self.sy[rs], self.ws[rs],
                         o.softcap, o.label_smoothing > 0)
            return
        self.filter = self._tile_filter(rs) if self.forming else None
        if self.split is None:  # lse, the row losses and dz in place: one kernel
            self.rows.rows_(z, b, rs, self.lse[rs], self.loss[rs], grad=self.forming, tile_filter=self.filter)
            return
        R, dev = z.shape[0], z.device  # a split: the rank's statistics, combined over the ranks, then dz
        m = torch.full((R,), -math.inf, dtype=torch.float32, device=dev)
        l, sy, ws = (torch.zeros(R, dtype=torch.float32, device=dev) for _ in range(3))
        block_stats_(z, 0, b, self.cw_cols, self.y_cols[rs], m, l, sy, ws, o.softcap, o.label_smoothing > 0)
        self._losses_(m, l, sy, ws, rs)
        if self.forming:
            p_R, t_R, s_R = self.rows.coefficients(self.lse[rs], torch.ones((), dtype=torch.float32, device=dev), None, rs)
            block_grad_(z, z, 0, b, self.cw_cols, self.y_cols[rs], self.lse[rs], p_R, t_R, s_R, o.softcap)

    def rows_done(self, rs, sweep):
        if not self.fused:  # (the first launches the target check, behind the first product)
            self._losses_(self.m[rs], self.l[rs], self.sy[rs], self.ws[rs], rs)

    def total(self):
        """The reduced loss (or [N] for "none", over all of x's rows) of the forward pass."""
        return self.rows.reduce(self.blocks.all_rows(self.loss) if self.opts.reduction == "none" else self.loss)

    def coefficients(self, rs):
        if self.forming:
            return  # dz was formed with the statistics
        grad_lse = None if self.grad_lse is None else self.grad_lse[rs]
        self.p, self.t, self.s = self.rows.coefficients(self.lse[rs], self.grad_loss, grad_lse, rs)
        self.filter = self._tile_filter(rs)

    def grad(self, z, v0, rs):
        if not self.forming:
            block_grad_(z, z, v0, self.blocks.b, self.cw_cols, self.y_cols[rs], self.lse[rs], self.p, self.t, self.s,
                        self.opts.softcap, tile_filter=self.filter)
        return z

    def add_grads(self, dz, rs, v0, cols, dx_out, dW, db, accumulate):
        if self.filter is None:
            self.blocks.add_grads(dz, rs, v0, cols, dx_out, dW, db, dx_accumulate=accumulate)
        else:
            self._add_filtered_grads(dz, rs, dx_out, dW, db)

    def _add_filtered_grads(self, dz, rs: slice, dx_out, dW, db) -> None:
        """Add a filtered block of whole rows to the gradients: dz [R, V] on the tiles that
        the filter keeps (gathered when few are, else the others zeroed in place) plus the
        target terms, sparse. Asks the GPU once which tiles are kept (unless the plan may not
        wait for it: then zeroed in place). Never with a split (y is global)."""
        assert self.split is None, "a split head computes every entry"
        blocks, f = self.blocks, self.filter
        vocab = blocks.vocab
        kept = f.tiles.nonzero().squeeze(1).tolist() if blocks.plan.host_sync else None
        if kept is None or len(kept) > blocks.plan.tuning.gather_share * f.tiles.shape[0]:
            if kept is None or len(kept) < f.tiles.shape[0]:
                dz.mul_(f.tiles.repeat_interleave(FILTER_COLS)[:vocab].to(dz.dtype))
            cols, W_A = None, blocks.head_cols(0, vocab)
        else:
            cols = kept_columns(kept, vocab, dz.device)
            dz, W_A = dz.index_select(1, cols), blocks.head_rows(cols)
        y = self.y[rs]
        y = torch.where((y >= 0) & (y < vocab), y, 0)  # the target term is 0 where y is not a class
        target = f.target
        if dx_out is not None:
            acc = torch.empty(dx_out.shape, dtype=target.dtype, device=dz.device)
            addmm_(acc, dz, W_A, beta=0.0)
            acc.addcmul_(target[:, None], blocks.head_rows(y).to(acc.dtype))
            dx_out.copy_(acc)
        x_R = blocks.x_rows(rs)
        if dW is not None:
            if cols is None:
                dW.add_(dz, x_R, 0)
            else:
                part = torch.empty(cols.shape[0], x_R.shape[1], dtype=target.dtype, device=dz.device)
                addmm_(part, dz.T, x_R, beta=0.0)
                dW.index_add_(cols, part)
            dW.index_add_(y, target[:, None] * x_R.to(target.dtype))
        if db is not None:
            sums = dz.sum(0, dtype=db.dtype)
            if cols is None:
                db += sums
            else:
                db.index_add_(0, cols, sums)
            db.index_add_(0, y, target.to(db.dtype))


def _blocks(x, W, b_V, weight_layout, plan, active, split) -> HeadBlocks:
    return HeadBlocks(x if split is None else split.whole_rows(x), W, b_V, weight_layout, plan, active=active)


def forward(x, W, b_V, cw_V, y_N, opts, weight_layout, plan: BlockPlan, grads_now=(False, False, False),
            check: TargetCheck | None = None, active=None, split: VocabSplit | None = None):
    """Loss (reduced, or [N] for "none"), lse (fp32, [N], or [A] over `active`) and, if any of
    grads_now = (x, W, b) is set, those gradients for an upstream gradient of 1 (else None):
    (loss, lse, dx, dW, db). x: the rows [N, D] (with a split's sequence parallel, this rank's
    part of them). check: the call's TargetCheck over all of y (launched here, after the first
    logits product), or None to check y here. active: int64 [A], the only rows computed
    (HeadBlocks), or None. split: this rank's place in a head split over the vocabulary."""
    blocks = _blocks(x, W, b_V, weight_layout, plan, active, split)
    rule = CrossEntropyKernelRule(blocks, cw_V, y_N, opts, check, split, forming=any(grads_now))
    grads = engine.forward(rule, blocks, grads_now, split, x)
    return (rule.total(), rule.lse, *grads)


def backward(grad_loss, grad_lse, x, W, b_V, cw_V, y_N, lse, opts, weight_layout, plan: BlockPlan, need=(True, True, True),
             check: TargetCheck | None = None, active=None, split: VocabSplit | None = None):
    """(dx, dW, db) by recomputing the logits block by block (or from those the forward pass
    kept, `torch_impl.engine`); None for what is not needed.
    grad_loss: 0-d, or [N] for "none"; grad_lse [N] or None; lse as `forward` gave it; the
    other arguments as `forward`'s."""
    blocks = _blocks(x, W, b_V, weight_layout, plan, active, split)
    rule = CrossEntropyKernelRule(blocks, cw_V, y_N, opts, check, split, lse=lse, grad_loss=grad_loss, grad_lse=grad_lse)
    return engine.backward(rule, blocks, need, split, x)


def kept_columns(kept_tiles: list[int], vocab: int, device) -> torch.Tensor:
    """The classes [A] (int64, ascending) of the kept filter tiles (FILTER_COLS classes each,
    the last one cut at vocab)."""
    tiles = torch.tensor(kept_tiles, dtype=torch.int64).to(device, non_blocking=True)
    cols = (tiles[:, None] * FILTER_COLS + torch.arange(FILTER_COLS, device=device)).flatten()
    last = kept_tiles[-1] * FILTER_COLS + FILTER_COLS - vocab if kept_tiles else 0
    return cols[: cols.shape[0] - max(0, last)]


@dataclasses.dataclass
class KernelCall(engine.Call):
    """`forward` and `backward` on tensors (x [N, D], W, b, cw, y [N], active); outputs
    (reduced loss, lse [N] or [A] over `active`), fp32. When the loss is reduced, no lse is
    returned and an input needs a gradient, a plan of whole rows forms the gradients in the
    forward pass. The inputs are saved on every plan (x [N, D] stays alive until the
    backward pass, as a linear layer's input does). check: the call's TargetCheck over all
    of y; the caller asks it for bad targets after the forward pass is queued."""

    opts: CrossEntropyOptions
    layout: str
    plan: BlockPlan
    return_lse: bool
    check: TargetCheck
    split: VocabSplit | None = None
    message = SECOND_ORDER_MESSAGE

    def forward(self, tensors, need):
        x, W, b, cw, y, active = tensors
        now = any(need) and self.plan.layout == "rows" and self.opts.reduction != "none" and not self.return_lse
        loss, lse, *grads = forward(x, W, b, cw, y, self.opts, self.layout, self.plan, need if now else (False,) * 3,
                                    self.check, active, self.split)
        return (loss, lse), (lse,), tuple(grads) if now else None

    def backward(self, tensors, saved, grad_outputs, need):
        (x, W, b, cw, y, active), (lse,) = tensors, saved
        grad_loss, grad_lse = (dense(g) for g in grad_outputs)  # an expanded upstream gradient has stride 0
        return backward(grad_loss, grad_lse, x, W, b, cw, y, lse, self.opts, self.layout, self.plan, need, self.check,
                        active, self.split)
