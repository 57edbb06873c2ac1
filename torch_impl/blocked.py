"""The GPU path: blocks of logits from cuBLAS, turned into statistics and dz by Triton.

The logits are computed one block of [R rows, C vocabulary columns] at a time into one
reused buffer; the Triton kernels of `torch_impl.kernels` reduce a block to per-row
statistics or rewrite it, in place, as dz; cuBLAS then adds dz's share to the gradients.

Two strategies (`plan_blocks`):
- "speed": blocks of whole rows (C = V). When the loss is reduced ("mean"/"sum") and
  no lse is returned, the gradients are computed during the forward pass (6 N D V flops)
  and the backward pass only scales them. grad_weight is accumulated across row blocks in
  fp32 (or in the input dtype with `accumulate_in_input_dtype`), in vocabulary slabs
  (`WeightGrad`); with one row block it is one product written in the input dtype.
- "memory": blocks of [R, C] sized so that the logits block and the fp32 grad_input
  accumulator of one row block together stay under a few percent of the gradients'
  bytes. The backward pass recomputes the logits (8 N D V flops). grad_weight is
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
(for the largest rank's classes), so they make the same collectives. grad_input
is summed over the ranks in fp32 (`VocabSplit.sum_grad_input`), so it is not kept in the
logits' buffer ("memory" takes tiles), and no gradient is filtered.
"""

from __future__ import annotations

import math

import torch

from interop.blocking import block_shape, forward_only_rows, whole_row_memory_scratch
from interop.options import CrossEntropyOptions
from interop.tuning import Tuning
from torch_impl.blocks import BlockPlan, HeadBlocks, addmm_, final_grad
from torch_impl.kernels import FILTER_COLS, RowMath, TargetCheck, TileFilter, block_grad_, block_stats_
from torch_impl.vocab_parallel import VocabSplit, combine_stats


def plan_blocks(t: Tuning, strategy: str, n_rows: int, hidden: int, vocab: int, dtype: torch.dtype,
                accumulate_in_input_dtype: bool, filter_eps: float | None = None, gathered_rows: bool = False,
                n_all: int | None = None, forward_only: bool = False, split: bool = False) -> BlockPlan:
    """The blocks (interop.blocking) and dW accumulation dtype of "speed" or "memory";
    n_rows: the rows computed, of n_all (default n_rows); gathered_rows: they are gathered
    from x (HeadBlocks.active); forward_only: the call takes no gradient ("speed" then
    takes larger blocks: interop.blocking.forward_only_rows). "memory" in blocks of whole
    rows (interop.blocking.whole_row_memory_scratch) accumulates grad_weight in the input
    dtype and keeps the logits in a scratch after grad_input. split: a head split over the
    vocabulary (vocab: the largest rank's classes), whose grad_input is an fp32 sum over the
    ranks and holds no scratch."""
    itemsize = dtype.itemsize
    n_all = n_rows if n_all is None else n_all
    scratch = None
    if strategy == "memory" and not split:
        scratch = whole_row_memory_scratch(t, n_all, n_rows, hidden, vocab, itemsize, gathered_rows)
    if scratch:
        return BlockPlan("memory", "rows", min(n_rows, scratch // vocab), vocab, dtype, filter_eps, scratch, t)
    rows, cols = block_shape(t, strategy, n_rows, hidden, vocab, itemsize, gathered_rows=gathered_rows,
                             narrow_accumulator=accumulate_in_input_dtype)
    if strategy == "speed" and forward_only:
        rows = forward_only_rows(t, n_rows, hidden, vocab, itemsize)
    if strategy == "speed":
        return BlockPlan("speed", "rows", rows, cols, dtype if accumulate_in_input_dtype else torch.float32, filter_eps,
                         tuning=t)
    return BlockPlan("memory", "tiles", rows, cols, dtype, filter_eps, tuning=t)


class _Blocks(HeadBlocks):
    """A cross-entropy call: the head's blocks plus the per-row math of its targets and options.
    y and cw are the call's (global with a split); y_cols and cw_cols, what the block kernels
    read: the targets as columns of this rank's classes and their class weights."""

    def __init__(self, x_ND, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, plan: BlockPlan,
                 check: TargetCheck | None = None, active=None, split: VocabSplit | None = None):
        super().__init__(x_ND, W, b_V, weight_layout, plan, active=active)
        self.opts, self.split = opts, split
        self.cw = None if cw_V is None else cw_V.float()
        self.y = self.active_rows(y_N.to(torch.int64))
        self.rows = RowMath(self.y, self.cw, opts, self.vocab if split is None else split.vocab, check)
        self.y_cols, self.cw_cols = (self.y, self.cw) if split is None else split.columns(self.y, self.cw, self.vocab)

    def losses_(self, m, l, sy, ws, rs: slice, lse_R, loss_R) -> None:
        """lse and the row losses of rows rs from this rank's statistics (fp32 [R] each),
        combined over the split's ranks first."""
        if self.split is not None:
            (lse,) = combine_stats([(m, l)], [sy, ws], self.split.group)
            m, l = lse, torch.ones_like(lse)  # m + log(l) is then the combined lse itself
        self.rows.losses_(m, l, sy, ws, rs, lse_R, loss_R)

    def row_terms_(self, z, b_V, rs: slice, lse_R, loss_R, grad: bool, tile_filter: TileFilter | None) -> None:
        """Whole rows rs of logits z [R, V_r]: lse and the row losses, and with `grad` dz in
        place for an upstream gradient of 1 (`RowMath.rows_`: one kernel). With a split, the
        rank's statistics, combined over the ranks, then dz (two kernels)."""
        if self.split is None:
            self.rows.rows_(z, b_V, rs, lse_R, loss_R, grad=grad, tile_filter=tile_filter)
            return
        R, dev, o = z.shape[0], z.device, self.opts
        m = torch.full((R,), -math.inf, dtype=torch.float32, device=dev)
        l, sy, ws = (torch.zeros(R, dtype=torch.float32, device=dev) for _ in range(3))
        block_stats_(z, 0, b_V, self.cw_cols, self.y_cols[rs], m, l, sy, ws, o.softcap, o.label_smoothing > 0)
        self.losses_(m, l, sy, ws, rs, lse_R, loss_R)
        if grad:
            p_R, t_R, s_R = self.rows.coefficients(lse_R, torch.ones((), dtype=torch.float32, device=dev), None, rs)
            block_grad_(z, z, 0, b_V, self.cw_cols, self.y_cols[rs], lse_R, p_R, t_R, s_R, o.softcap)

    def tile_filter(self, rs: slice) -> TileFilter | None:
        """A fresh TileFilter for the whole rows rs when the plan filters, else None."""
        if self.plan.filter_eps is None or not self.whole_rows:
            return None
        return TileFilter(self.plan.filter_eps, rs.stop - rs.start, self.vocab, self.x.device)

    def add_filtered_grads(self, dz, rs: slice, f: TileFilter, dx_out, dW, db) -> None:
        """Add a filtered block of whole rows to the gradients: dz [R, V] on the tiles that
        f.tiles keeps (gathered when few are, else the others zeroed in place) plus the
        target terms f.target, sparse. Asks the GPU once which tiles are kept (unless the
        plan may not wait for it: then zeroed in place). Never with a split (y is global)."""
        assert self.split is None, "a split head computes every entry"
        vocab = self.vocab
        kept = f.tiles.nonzero().squeeze(1).tolist() if self.plan.host_sync else None
        if kept is None or len(kept) > self.plan.tuning.gather_share * f.tiles.shape[0]:
            if kept is None or len(kept) < f.tiles.shape[0]:
                dz.mul_(f.tiles.repeat_interleave(FILTER_COLS)[:vocab].to(dz.dtype))
            cols, W_A = None, self.head_cols(0, vocab)
        else:
            cols = kept_columns(kept, vocab, dz.device)
            dz, W_A = dz.index_select(1, cols), self.head_rows(cols)
        y = self.y[rs]
        y = torch.where((y >= 0) & (y < vocab), y, 0)  # the target term is 0 where y is not a class
        target = f.target
        if dx_out is not None:
            acc = torch.empty(dx_out.shape, dtype=target.dtype, device=dz.device)
            addmm_(acc, dz, W_A, beta=0.0)
            acc.addcmul_(target[:, None], self.head_rows(y).to(acc.dtype))
            dx_out.copy_(acc)
        x_R = self.x_rows(rs)
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


def forward(x, W, b_V, cw_V, y_N, opts, weight_layout, plan: BlockPlan, grads_now=(False, False, False),
            check: TargetCheck | None = None, active=None, split: VocabSplit | None = None):
    """Loss (reduced, or [N] for "none"), lse (fp32, [N], or [A] over `active`) and, if any of
    grads_now = (x, W, b) is set, those gradients for an upstream gradient of 1 (else None):
    (loss, lse, dx, dW, db). x: the rows [N, D] (with a split's sequence parallel, this rank's
    part of them). check: the call's TargetCheck over all of y (launched here, after the first
    logits product), or None to check y here. active: int64 [A], the only rows computed
    (HeadBlocks), or None. split: this rank's place in a head split over the vocabulary."""
    x_ND = x if split is None else split.whole_rows(x)
    blocks = _Blocks(x_ND, W, b_V, cw_V, y_N, opts, weight_layout, plan, check, active, split)
    n, dev = blocks.n_rows, x_ND.device
    lse, loss = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(2))
    in_forward = any(grads_now)
    assert not in_forward or blocks.whole_rows, "gradients in the forward pass need whole rows"
    dx, _, dW, db = blocks.gradient_buffers(*grads_now, wide_dx=split is not None)
    # statistics, losses and dz per block of whole rows; a split's ranks take the same branch
    # (the plan's, not their own slice's: a narrow slice can be whole in a plan of tiles)
    if blocks.whole_rows if split is None else plan.layout == "rows":
        for rs in blocks.row_blocks():
            z = blocks.logits(rs, 0, blocks.vocab)
            f = blocks.tile_filter(rs) if in_forward else None
            blocks.row_terms_(z, b_V, rs, lse[rs], loss[rs], grad=in_forward, tile_filter=f)
            dx_R = None if dx is None else blocks.dx_rows(dx, rs)
            if f is not None:
                blocks.add_filtered_grads(z, rs, f, dx_R, dW, db)
            elif in_forward:
                blocks.add_grads(z, rs, 0, blocks.vocab, dx_R, dW, db)
            if dx_R is not None:
                blocks.scatter_dx_rows(dx, rs, dx_R)
        if dx is not None:
            blocks.zero_skipped_dx_rows(dx)
    else:
        m = torch.full((n,), -math.inf, dtype=torch.float32, device=dev)
        l, sy, ws = (torch.zeros(n, dtype=torch.float32, device=dev) for _ in range(3))
        for rs in blocks.row_blocks():
            for v0, cols in blocks.col_blocks():
                block_stats_(blocks.logits(rs, v0, cols), v0, b_V, blocks.cw_cols, blocks.y_cols[rs], m[rs], l[rs],
                             sy[rs], ws[rs], opts.softcap, opts.label_smoothing > 0)
            if split is None:  # (the first launches the target check, behind the first product)
                blocks.losses_(m[rs], l[rs], sy[rs], ws[rs], rs, lse[rs], loss[rs])
        if split is not None:  # one combine of every row's statistics
            blocks.losses_(m, l, sy, ws, slice(0, n), lse, loss)
    loss = blocks.rows.reduce(blocks.all_rows(loss) if opts.reduction == "none" else loss)
    z = blocks = None  # the logits buffer goes before dW's conversion allocates its result
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return loss, lse, dx, final_grad(dW, W), final_grad(db, b_V)


def backward(grad_loss, grad_lse, x, W, b_V, cw_V, y_N, lse, opts, weight_layout, plan: BlockPlan, need=(True, True, True),
             check: TargetCheck | None = None, active=None, split: VocabSplit | None = None):
    """(dx, dW, db) by recomputing the logits block by block; None for what is not needed.
    grad_loss: 0-d, or [N] for "none"; grad_lse [N] or None; lse as `forward` gave it; the
    other arguments as `forward`'s."""
    x_ND = x if split is None else split.whole_rows(x)
    blocks = _Blocks(x_ND, W, b_V, cw_V, y_N, opts, weight_layout, plan, check, active, split)
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=torch.float32, device=x_ND.device)
    elif grad_loss.ndim:
        grad_loss = blocks.active_rows(grad_loss)
    if grad_lse is not None:
        grad_lse = blocks.active_rows(grad_lse)
    dx, dx_acc, dW, db = blocks.gradient_buffers(*need, wide_dx=split is not None)
    y, cw = blocks.y_cols, blocks.cw_cols
    for rs in blocks.row_blocks():
        p_R, t_R, s_R = blocks.rows.coefficients(lse[rs], grad_loss, None if grad_lse is None else grad_lse[rs], rs)
        f = blocks.tile_filter(rs)
        dx_R = None if dx is None or dx_acc is not None else blocks.dx_rows(dx, rs)
        if f is not None:
            dz = blocks.logits(rs, 0, blocks.vocab)
            block_grad_(dz, dz, 0, b_V, cw, y[rs], lse[rs], p_R, t_R, s_R, opts.softcap, tile_filter=f)
            blocks.add_filtered_grads(dz, rs, f, dx_R, dW, db)
        else:
            for v0, cols in blocks.col_blocks():
                dz = blocks.logits(rs, v0, cols)
                block_grad_(dz, dz, v0, b_V, cw, y[rs], lse[rs], p_R, t_R, s_R, opts.softcap)
                dx_out = dx_R if dx_acc is None else dx_acc[: rs.stop - rs.start]
                blocks.add_grads(dz, rs, v0, cols, dx_out, dW, db, dx_accumulate=dx_acc is not None)
            if dx_acc is not None:
                blocks.put_dx_rows(dx, rs, dx_acc[: rs.stop - rs.start])
                dx_acc.zero_()
        if dx_R is not None:
            blocks.scatter_dx_rows(dx, rs, dx_R)
    if dx is not None:
        blocks.zero_skipped_dx_rows(dx)
    dz = blocks = dx_acc = None  # the logits buffer goes before dW's conversion allocates its result
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return dx, final_grad(dW, W), final_grad(db, b_V)


def kept_columns(kept_tiles: list[int], vocab: int, device) -> torch.Tensor:
    """The classes [A] (int64, ascending) of the kept filter tiles (FILTER_COLS classes each,
    the last one cut at vocab)."""
    tiles = torch.tensor(kept_tiles, dtype=torch.int64).to(device, non_blocking=True)
    cols = (tiles[:, None] * FILTER_COLS + torch.arange(FILTER_COLS, device=device)).flatten()
    last = kept_tiles[-1] * FILTER_COLS + FILTER_COLS - vocab if kept_tiles else 0
    return cols[: cols.shape[0] - max(0, last)]
