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

import dataclasses
import functools
import math

import torch

from interop.blocking import (block_shape, forward_only_rows, scratch_block_rows, weight_grad_slabs,
                              whole_row_memory_scratch)
from interop.options import CrossEntropyOptions
from interop.tuning import DEFAULT, Tuning
from torch_impl.kernels import FILTER_COLS, RowMath, TargetCheck, TileFilter, block_grad_, block_stats_

SCRATCH_ALIGN = 64  # elements: a block's logits in grad_input's buffer start 128-byte aligned (16-bit)

@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """How one call is blocked: the caller's `strategy`; `layout` "rows" (blocks of whole
    rows, whose gradients can be formed in the forward pass) or "tiles" (blocks of rows and
    vocabulary columns, recomputed in the backward pass); rows and columns per block; the
    grad_weight accumulation dtype; the gradient filter's threshold (None: no filtering);
    grad_input_scratch: elements of a logits scratch after grad_input (0: none; blocks of
    whole rows whose size then varies, `HeadBlocks.row_blocks`; block_rows serves loops
    without grad_input); the call's tuning."""

    strategy: str
    layout: str
    block_rows: int
    block_cols: int
    accumulate_dtype: torch.dtype
    filter_eps: float | None = None
    grad_input_scratch: int = 0
    tuning: Tuning = DEFAULT


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


def _addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> None:
    """acc = beta * acc + a @ b in acc's dtype (fp32 acc with 16-bit a, b allowed); with
    beta 0, acc's old content is not read (it may be uninitialised)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda and _mixed_addmm_supported():  # cuBLAS adds the 16-bit product in fp32, in place
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:  # products in acc's dtype, 4096 rows of acc at a time (bounded temporaries)
        b = b.to(acc.dtype)
        for i in range(0, acc.shape[0], 4096):
            product = a[i : i + 4096].to(acc.dtype) @ b
            if beta:
                acc[i : i + 4096] += product
            else:
                acc[i : i + 4096] = product


@functools.cache
def _mixed_addmm_supported() -> bool:
    """Whether this torch has addmm with out_dtype (16-bit inputs into fp32), probed once on a
    tiny CUDA problem; errors of real calls propagate (an out-of-memory is not "unsupported")."""
    try:
        acc = torch.zeros(1, 1, device="cuda")
        one = torch.ones(1, 1, device="cuda", dtype=torch.bfloat16)
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
        return True
    except (RuntimeError, TypeError):
        return False


class WeightGrad:
    """grad_weight accumulated in `dtype` as vocabulary slabs (interop.blocking.
    weight_grad_slabs), each its own tensor, so that the conversion to W's dtype frees each
    slab as it goes: an fp32 accumulator of a 16-bit W peaks at 2 W + W / slabs, not 3 W.
    A slab's first product overwrites it (no zero fill to read back); a slab that only
    gets parts of blocks is zeroed first, one that gets none at the end. `slabs` holds the
    accumulator's tensors until `result` spends them."""

    def __init__(self, W, layout: str, dtype: torch.dtype, t: Tuning):
        vocab, hidden = (W.shape[0], W.shape[1]) if layout == "VD" else (W.shape[1], W.shape[0])
        self.layout, self.dtype = layout, W.dtype
        self.starts = weight_grad_slabs(t, vocab, hidden * dtype.itemsize, dtype != W.dtype)
        shape = (lambda n: (n, W.shape[1])) if layout == "VD" else (lambda n: (W.shape[0], n))
        self.slabs = [torch.empty(shape(b - a), dtype=dtype, device=W.device) for a, b in zip(self.starts, self.starts[1:])]
        self.written = [False] * len(self.slabs)

    def add_(self, dz_RC, x_RD, v0: int) -> None:
        """Add dz [R, C]^T x [R, D] to the rows (classes) v0..v0+C."""
        v1 = v0 + dz_RC.shape[1]
        for i, (slab, a, b) in enumerate(zip(self.slabs, self.starts, self.starts[1:])):
            lo, hi = max(a, v0), min(b, v1)
            if lo >= hi:
                continue
            if not self.written[i] and (lo, hi) != (a, b):
                slab.zero_()
                self.written[i] = True
            beta = 1.0 if self.written[i] else 0.0
            dz = dz_RC[:, lo - v0 : hi - v0]
            if self.layout == "VD":
                _addmm_(slab[lo - a : hi - a], dz.T, x_RD, beta)
            else:
                _addmm_(slab[:, lo - a : hi - a], x_RD.T, dz, beta)
            self.written[i] = True

    def index_add_(self, classes_K: torch.Tensor, rows_KD: torch.Tensor) -> None:
        """Add rows [K, D] (fp32) to the classes classes_K [K] (int64 in [0, V), repeats
        allowed; CUDA adds them with atomics, in no fixed order)."""
        for i, (slab, a, b) in enumerate(zip(self.slabs, self.starts, self.starts[1:])):
            if not self.written[i]:
                slab.zero_()
                self.written[i] = True
            inside = (classes_K >= a) & (classes_K < b)
            part = (rows_KD * inside[:, None]).to(slab.dtype)
            index = torch.where(inside, classes_K - a, 0)
            if self.layout == "VD":
                slab.index_add_(0, index, part)
            else:
                slab.index_add_(1, index, part.T)

    def result(self) -> torch.Tensor:
        """grad_weight in W's dtype and layout; the accumulator is spent."""
        slabs, self.slabs = self.slabs, []
        for i in range(len(slabs)):  # by index: a loop variable would keep the last slab alive
            if not self.written[i]:
                slabs[i].zero_()
        if len(slabs) == 1:
            return slabs[0].to(self.dtype)
        parts = []
        while slabs:
            parts.append(slabs.pop(0).to(self.dtype))
        return torch.cat(parts, dim=0 if self.layout == "VD" else 1)


class HeadBlocks:
    """One linear head's operands cut into blocks: x [N, D], W ([V, D] "VD" or [D, V] "DV"),
    bias [V] or None, the plan, and one reused logits buffer. `vocab` may be smaller than
    W's (the first `vocab` classes); `logits_dtype` other than x's (the fallback's fp32)
    computes each block in x's dtype and converts it.

    `active` (int64 [A], ascending) restricts the work to those rows of x (the others get
    no logits and a zero grad_input): row blocks are then slices of `active`, whose x rows
    are gathered block by block and whose grad_input rows are scattered back.

    With plan.grad_input_scratch, `gradient_buffers` makes grad_input the head of one buffer
    whose tail is the logits scratch: each row block's logits lie after the rows of
    grad_input that it and the blocks before it may write, so blocks are larger while
    grad_input still has unwritten rows (`row_blocks`). The returned grad_input keeps that
    buffer (the scratch's bytes live as long as it)."""

    def __init__(self, x_ND, W, b_V, weight_layout: str, plan: BlockPlan, vocab: int | None = None, logits_dtype=None,
                 active=None):
        self.x, self.W, self.b, self.layout, self.plan = x_ND, W, b_V, weight_layout, plan
        self.vocab = (W.shape[0] if weight_layout == "VD" else W.shape[1]) if vocab is None else vocab
        self.logits_dtype = x_ND.dtype if logits_dtype is None else logits_dtype
        self.active = active
        self.n_rows = x_ND.shape[0] if active is None else active.shape[0]
        self._gathered = (None, None)  # (row block, its gathered x rows): logits and dW use the same block
        self._storage = None  # with the scratch: grad_input [N, D] then the logits scratch, flat
        self.buffer = self._new_buffer(0 if plan.grad_input_scratch else plan.block_rows)

    def _new_buffer(self, rows: int) -> torch.Tensor:
        """A flat logits buffer for blocks of `rows` rows and plan.block_cols columns."""
        n = min(rows, self.n_rows) * min(self.plan.block_cols, self.vocab)
        return torch.empty(n if self.logits_dtype == self.x.dtype else 0, dtype=self.x.dtype, device=self.x.device)

    def row_blocks(self):
        """Slices of the computed rows (of x's rows, or of `active`): plan.block_rows each, or
        with the scratch as many as fit (interop.blocking.scratch_block_rows)."""
        if self._storage is None:
            for r0 in range(0, self.n_rows, self.plan.block_rows):
                yield slice(r0, min(r0 + self.plan.block_rows, self.n_rows))
            return
        r0 = 0
        while r0 < self.n_rows:
            r1 = r0 + scratch_block_rows(self.plan.tuning, self.n_rows - r0, self.x.shape[1], self.vocab, self.plan.grad_input_scratch)
            yield slice(r0, r1)
            r0 = r1

    def _logits_space(self, rs: slice) -> torch.Tensor:
        """The flat space for row block rs's logits: the buffer, or the part of grad_input's
        buffer after every row that blocks up to rs may write (with `active`, ascending, the
        i-th computed row is at most row N - A + i of x)."""
        if self._storage is None:
            return self.buffer
        n_all, hidden = self.x.shape
        start = -(-(n_all - self.n_rows + rs.stop) * hidden // SCRATCH_ALIGN) * SCRATCH_ALIGN
        return self._storage[start:]

    def _grad_input_with_scratch(self) -> torch.Tensor:
        """grad_input [N, D] in x's dtype, uninitialised: the head of a buffer that ends in the
        plan's scratch."""
        n_all, hidden = self.x.shape
        self._storage = torch.empty(n_all * hidden + SCRATCH_ALIGN + self.plan.grad_input_scratch, dtype=self.x.dtype,
                                    device=self.x.device)
        return self._storage[: n_all * hidden].view(n_all, hidden)

    def zero_skipped_dx_rows(self, dx_ND: torch.Tensor) -> None:
        """With the scratch and `active`, zero grad_input's rows not computed (they held logits)."""
        if self._storage is not None and self.active is not None:
            skipped = torch.ones(dx_ND.shape[0], dtype=torch.bool, device=dx_ND.device).index_fill_(0, self.active, False)
            dx_ND.masked_fill_(skipped[:, None], 0)

    def x_rows(self, rs: slice) -> torch.Tensor:
        """x's rows of row block rs, [R, D] (a view, or gathered from `active`)."""
        if self.active is None:
            return self.x[rs]
        if self._gathered[0] != rs:
            self._gathered = (None, None)  # the previous block's rows go first: one gathered block at a time
            self._gathered = (rs, self.x.index_select(0, self.active[rs]))
        return self._gathered[1]

    def dx_rows(self, dx_ND: torch.Tensor, rs: slice) -> torch.Tensor:
        """Where row block rs's grad_input [R, D] is written: a view of dx, or (with `active`)
        a new block for `scatter_dx_rows`."""
        if self.active is None:
            return dx_ND[rs]
        return torch.empty(rs.stop - rs.start, dx_ND.shape[1], dtype=dx_ND.dtype, device=dx_ND.device)

    def scatter_dx_rows(self, dx_ND: torch.Tensor, rs: slice, dx_RD: torch.Tensor) -> None:
        """Store the block `dx_rows` gave for rs in dx (nothing to do for a view)."""
        if self.active is not None:
            dx_ND.index_copy_(0, self.active[rs], dx_RD)

    def put_dx_rows(self, dx_ND: torch.Tensor, rs: slice, src_RD: torch.Tensor) -> None:
        """dx's rows of row block rs = src_RD [R, D] (an accumulator of any float dtype). With
        `active`, the conversion to dx's dtype goes through the logits buffer when it is
        large enough: call this between blocks, when the buffer is free."""
        if self.active is None:
            dx_ND[rs] = src_RD
            return
        R, D = src_RD.shape
        if self.buffer.dtype == dx_ND.dtype and self.buffer.numel() >= R * D:
            block = self.buffer[: R * D].view(R, D).copy_(src_RD)
        else:
            block = src_RD.to(dx_ND.dtype)
        dx_ND.index_copy_(0, self.active[rs], block)

    def all_rows(self, t_A: torch.Tensor) -> torch.Tensor:
        """A per-row tensor over the computed rows [A] as one over all rows [N] (0 elsewhere)."""
        if self.active is None:
            return t_A
        return t_A.new_zeros(self.x.shape[0]).index_copy_(0, self.active, t_A)

    def active_rows(self, t_N: torch.Tensor) -> torch.Tensor:
        """A per-row tensor over all rows [N] restricted to the computed rows [A]."""
        return t_N if self.active is None else t_N.index_select(0, self.active)

    def col_blocks(self):
        for v0 in range(0, self.vocab, self.plan.block_cols):
            yield v0, min(self.plan.block_cols, self.vocab - v0)

    @property
    def whole_rows(self) -> bool:
        return self.plan.block_cols >= self.vocab

    def head_cols(self, v0: int, cols: int) -> torch.Tensor:
        """W's columns v0..v0+cols as a [cols, D] view."""
        return self.W[v0 : v0 + cols] if self.layout == "VD" else self.W[:, v0 : v0 + cols].T

    def head_rows(self, classes_K: torch.Tensor) -> torch.Tensor:
        """W's classes classes_K [K] (int64) gathered into [K, D]."""
        return self.W.index_select(0, classes_K) if self.layout == "VD" else self.W.index_select(1, classes_K).T

    def logits(self, rs: slice, v0: int, cols: int) -> torch.Tensor:
        """z [R, cols] = x[rs] @ W[v0:v0+cols].T (no bias), in the reused buffer."""
        x_R = self.x_rows(rs)
        if self.logits_dtype != x_R.dtype:
            return (x_R @ self.head_cols(v0, cols).T).to(self.logits_dtype)
        z = self._logits_space(rs)[: x_R.shape[0] * cols].view(x_R.shape[0], cols)
        return torch.mm(x_R, self.head_cols(v0, cols).T, out=z)

    def add_grads(self, dz, rs: slice, v0: int, cols: int, dx_out, dW, db, dx_accumulate: bool = False) -> None:
        """Add dz [R, cols]'s share to the gradients: dx_out [R, D] = dz W_c (+= if
        dx_accumulate: an accumulator over column blocks), dW (a WeightGrad) += dz^T x, db += .."""
        if dx_out is not None:
            W_c = self.head_cols(v0, cols)
            dz_in = dz.to(W_c.dtype)
            if dx_accumulate:
                _addmm_(dx_out, dz_in, W_c)
            else:
                torch.mm(dz_in, W_c, out=dx_out)
        if dW is not None:
            dW.add_(dz, self.x_rows(rs).to(dz.dtype), v0)
        if db is not None:
            db[v0 : v0 + cols] += dz.sum(0, dtype=db.dtype)

    def gradient_buffers(self, need_x: bool, need_W: bool, need_b: bool):
        """(dx [N, D] in x's dtype, fp32 [R, D] accumulator when rows span several column
        blocks, dW a WeightGrad in the plan's accumulation dtype, db fp32 [V]; fp64 for fp64
        inputs). Filtering adds dW in parts: it keeps the plan's accumulator. With the plan's
        scratch, dx heads the logits' buffer (without dx, a buffer of plan.block_rows rows)."""
        x, W = self.x, self.W
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        if self.plan.grad_input_scratch and need_x:
            dx = self._grad_input_with_scratch()
        elif self.plan.grad_input_scratch:
            dx, self.buffer = None, self._new_buffer(self.plan.block_rows)
        else:
            dx = (torch.empty_like(x) if self.active is None else torch.zeros_like(x)) if need_x else None
        dx_acc = torch.zeros(min(self.plan.block_rows, self.n_rows), x.shape[1], dtype=wide, device=x.device) \
            if need_x and not self.whole_rows else None
        # One row block: each element of dW is one product, accumulated in fp32 by cuBLAS
        # and written once in W's dtype, as exact as a wider accumulator and without it.
        one_product = self.n_rows <= self.plan.block_rows and self.logits_dtype == W.dtype and self.plan.filter_eps is None
        dW = WeightGrad(W, self.layout, W.dtype if one_product else self.plan.accumulate_dtype, self.plan.tuning) if need_W else None
        db = torch.zeros(W.shape[0] if self.layout == "VD" else W.shape[1], dtype=wide, device=W.device) if need_b else None
        return dx, dx_acc, dW, db


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
        target terms f.target, sparse. Asks the GPU once which tiles are kept."""
        vocab = self.vocab
        kept = f.tiles.nonzero().squeeze(1).tolist()
        if len(kept) > self.plan.tuning.gather_share * f.tiles.shape[0]:
            if len(kept) < f.tiles.shape[0]:
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
            _addmm_(acc, dz, W_A, beta=0.0)
            acc.addcmul_(target[:, None], self.head_rows(y).to(acc.dtype))
            dx_out.copy_(acc)
        x_R = self.x_rows(rs)
        if dW is not None:
            if cols is None:
                dW.add_(dz, x_R, 0)
            else:
                part = torch.empty(cols.shape[0], x_R.shape[1], dtype=target.dtype, device=dz.device)
                _addmm_(part, dz.T, x_R, beta=0.0)
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


def final_grad(acc, like):
    """An accumulated gradient (tensor or WeightGrad) in the dtype of `like`, or None."""
    if acc is None:
        return None
    return acc.result() if isinstance(acc, WeightGrad) else acc.to(like.dtype)
