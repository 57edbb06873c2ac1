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
"""

from __future__ import annotations

import math

import torch

from interop.blocking import block_shape, forward_only_rows, whole_row_memory_scratch
from interop.options import CrossEntropyOptions
from interop.tuning import Tuning
from torch_impl.blocks import BlockPlan, HeadBlocks, addmm_, final_grad
from torch_impl.kernels import FILTER_COLS, RowMath, TargetCheck, TileFilter, block_grad_, block_stats_


def plan_blocks(t: Tuning, strategy: str, n_rows: int, hidden: int, vocab: int, dtype: torch.dtype,
                accumulate_in_input_dtype: bool, filter_eps: float | None = None, gathered_rows: bool = False,
                n_all: int | None = None, forward_only: bool = False) -> BlockPlan:
    """The blocks (interop.blocking) and dW accumulation dtype of "speed" or "memory";
    n_rows: the rows computed, of n_all (default n_rows); gathered_rows: they are gathered
    from x (HeadBlocks.active); forward_only: the call takes no gradient ("speed" then
    takes larger blocks: interop.blocking.forward_only_rows). "memory" in blocks of whole
    rows (interop.blocking.whole_row_memory_scratch) accumulates grad_weight in the input
    dtype and keeps the logits in a scratch after grad_input."""
    itemsize = dtype.itemsize
    n_all = n_rows if n_all is None else n_all
    scratch = whole_row_memory_scratch(t, n_all, n_rows, hidden, vocab, itemsize, gathered_rows) if strategy == "memory" else None
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
    """A cross-entropy call: the head's blocks plus the per-row math of its targets and options."""

    def __init__(self, x_ND, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, plan: BlockPlan,
                 check: TargetCheck | None = None, active=None):
        super().__init__(x_ND, W, b_V, weight_layout, plan, active=active)
        self.opts = opts
        self.cw = None if cw_V is None else cw_V.float()
        self.y = self.active_rows(y_N.to(torch.int64))
        self.rows = RowMath(self.y, self.cw, opts, self.vocab, check)

    def tile_filter(self, rs: slice) -> TileFilter | None:
        """A fresh TileFilter for the whole rows rs when the plan filters, else None."""
        if self.plan.filter_eps is None or not self.whole_rows:
            return None
        return TileFilter(self.plan.filter_eps, rs.stop - rs.start, self.vocab, self.x.device)

    def add_filtered_grads(self, dz, rs: slice, f: TileFilter, dx_out, dW, db) -> None:
        """Add a filtered block of whole rows to the gradients: dz [R, V] on the tiles that
        f.tiles keeps (gathered when few are, else the others zeroed in place) plus the
        target terms f.target, sparse. Asks the GPU once which tiles are kept (unless the
        plan may not wait for it: then zeroed in place)."""
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


def forward(x_ND, W, b_V, cw_V, y_N, opts, weight_layout, plan: BlockPlan, grads_now=(False, False, False),
            check: TargetCheck | None = None, active=None):
    """Loss (reduced, or [N] for "none"), lse (fp32, [N], or [A] over `active`) and, if any of
    grads_now = (x, W, b) is set, those gradients for an upstream gradient of 1 (else None):
    (loss, lse, dx, dW, db). check: the call's TargetCheck over all of y (launched here, after
    the first logits product), or None to check y here. active: int64 [A], the only rows
    computed (HeadBlocks), or None."""
    blocks = _Blocks(x_ND, W, b_V, cw_V, y_N, opts, weight_layout, plan, check, active)
    n, dev = blocks.n_rows, x_ND.device
    lse, loss = (torch.empty(n, dtype=torch.float32, device=dev) for _ in range(2))
    in_forward = any(grads_now)
    assert not in_forward or blocks.whole_rows, "gradients in the forward pass need whole rows"
    dx, _, dW, db = blocks.gradient_buffers(*grads_now)
    if blocks.whole_rows:  # statistics, losses and dz in one kernel per row block
        for rs in blocks.row_blocks():
            z = blocks.logits(rs, 0, blocks.vocab)
            f = blocks.tile_filter(rs) if in_forward else None
            blocks.rows.rows_(z, b_V, rs, lse[rs], loss[rs], grad=in_forward, tile_filter=f)
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
                block_stats_(blocks.logits(rs, v0, cols), v0, b_V, blocks.cw, blocks.y[rs], m[rs], l[rs], sy[rs], ws[rs],
                             opts.softcap, opts.label_smoothing > 0)
            blocks.rows.losses_(m[rs], l[rs], sy[rs], ws[rs], rs, lse[rs], loss[rs])
    loss = blocks.rows.reduce(blocks.all_rows(loss) if opts.reduction == "none" else loss)
    z = blocks = None  # the logits buffer goes before dW's conversion allocates its result
    return loss, lse, dx, final_grad(dW, W), final_grad(db, b_V)


def backward(grad_loss, grad_lse, x_ND, W, b_V, cw_V, y_N, lse, opts, weight_layout, plan: BlockPlan, need=(True, True, True),
             check: TargetCheck | None = None, active=None):
    """(dx, dW, db) by recomputing the logits block by block; None for what is not needed.
    grad_loss: 0-d, or [N] for "none"; grad_lse [N] or None; lse as `forward` gave it."""
    blocks = _Blocks(x_ND, W, b_V, cw_V, y_N, opts, weight_layout, plan, check, active)
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=torch.float32, device=x_ND.device)
    elif grad_loss.ndim:
        grad_loss = blocks.active_rows(grad_loss)
    if grad_lse is not None:
        grad_lse = blocks.active_rows(grad_lse)
    dx, dx_acc, dW, db = blocks.gradient_buffers(*need)
    for rs in blocks.row_blocks():
        p_R, t_R, s_R = blocks.rows.coefficients(lse[rs], grad_loss, None if grad_lse is None else grad_lse[rs], rs)
        f = blocks.tile_filter(rs)
        dx_R = None if dx is None or dx_acc is not None else blocks.dx_rows(dx, rs)
        if f is not None:
            dz = blocks.logits(rs, 0, blocks.vocab)
            block_grad_(dz, dz, 0, b_V, blocks.cw, blocks.y[rs], lse[rs], p_R, t_R, s_R, opts.softcap, tile_filter=f)
            blocks.add_filtered_grads(dz, rs, f, dx_R, dW, db)
        else:
            for v0, cols in blocks.col_blocks():
                dz = blocks.logits(rs, v0, cols)
                block_grad_(dz, dz, v0, b_V, blocks.cw, blocks.y[rs], lse[rs], p_R, t_R, s_R, opts.softcap)
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
    return dx, final_grad(dW, W), final_grad(db, b_V)


def kept_columns(kept_tiles: list[int], vocab: int, device) -> torch.Tensor:
    """The classes [A] (int64, ascending) of the kept filter tiles (FILTER_COLS classes each,
    the last one cut at vocab)."""
    tiles = torch.tensor(kept_tiles, dtype=torch.int64).to(device, non_blocking=True)
    cols = (tiles[:, None] * FILTER_COLS + torch.arange(FILTER_COLS, device=device)).flatten()
    last = kept_tiles[-1] * FILTER_COLS + FILTER_COLS - vocab if kept_tiles else 0
    return cols[: cols.shape[0] - max(0, last)]
