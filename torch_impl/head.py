"""A linear head's operands cut into blocks, for the block loop (`torch_impl.engine`): the
plan of one call, the reused logits buffer, the rows gathered and scattered when only some
are computed, and the gradient accumulators (grad_weight in slabs converted in place). No kernel here: the fallback runs
these blocks where Triton is not installed.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from interop import planning
from interop.blocking import scratch_block_rows, weight_grad_slabs
from interop.tuning import DEFAULT, Tuning
from torch_impl.rows import compute_dtype

SCRATCH_ALIGN = 64  # elements: a block's logits in grad_input's buffer start 128-byte aligned (16-bit)


@dataclasses.dataclass(frozen=True)


class BlockPlan:
    """How one call is blocked: the caller's `strategy`; `layout` "rows" (blocks of whole
    rows, whose gradients can be formed in the forward pass) or "tiles" (blocks of rows and
    vocabulary columns, recomputed in the backward pass); rows and columns per block; the
    grad_weight accumulation dtype; the gradient filter's threshold (None: no filtering);
    grad_input_scratch: elements of a logits scratch after grad_input (0: none; blocks of
    whole rows whose size then varies, `HeadBlocks.row_blocks`; block_rows serves loops
    without grad_input); the call's tuning; host_sync: the loop may wait for the GPU to
    gather the filter's kept tiles (False in compiled or captured code, where the dropped
    tiles are zeroed in place instead); kept: where one call's logits are kept from its
    forward pass for its backward pass (`KeptLogits`, set per call by `torch_impl.engine`;
    None: never kept)."""

    strategy: str
    layout: str
    block_rows: int
    block_cols: int
    accumulate_dtype: torch.dtype
    filter_eps: float | None = None
    grad_input_scratch: int = 0
    tuning: Tuning = DEFAULT
    host_sync: bool = True
    kept: KeptLogits | None = dataclasses.field(default=None, compare=False)


class KeptLogits:
    """One call's logits z [A, V] (the rows computed, the input's dtype), kept from its
    forward pass for its first backward pass: `z` is None until the forward pass keeps them,
    and again once that backward pass has spent them (written over by dz); `spent` then
    says a later backward pass (retain_graph) recomputes them."""

    def __init__(self):
        self.z: torch.Tensor | None = None
        self.spent = False


def plan(t: Tuning, loss: str, strategy: str, n_rows: int, hidden: int, vocab: int, dtype: torch.dtype,
         accumulate_in_input_dtype: bool, filter_eps: float | None = None, **facts) -> BlockPlan:
    """The call's BlockPlan: `interop.planning.plan` (loss, strategy and the facts it takes)
    with grad_weight accumulated in dtype or in `compute_dtype(dtype)`; filter_eps: the
    gradient filter's threshold (cross-entropy's kernels)."""
    p = planning.plan(t, "torch", loss, strategy, n_rows, hidden, vocab, dtype.itemsize, accumulate_in_input_dtype,
                      filtered=filter_eps is not None, **facts)
    acc = dtype if p.narrow_accumulator else compute_dtype(dtype)
    return BlockPlan(p.strategy, p.layout, p.rows, p.cols, acc, filter_eps, p.scratch, t)


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> None:
    """acc = beta * acc + a @ b in acc's dtype (fp32 acc with 16-bit a, b allowed); with
    beta 0, acc's old content is not read (it may be uninitialised)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.is_cuda and _mixedaddmm_supported():  # cuBLAS adds the 16-bit product in fp32, in place
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


def _mixedaddmm_supported() -> bool:
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
    """grad_weight accumulated in `dtype`, in slabs along W's first dimension (classes of a
    "VD" W, the hidden dimension of a "DV" one; interop.blocking.weight_grad_slabs). An fp32
    accumulator of a 16-bit W is two slabs where it is large: the first, of at most half the
    rows, is an fp32 view of the start of grad_weight's own tensor in W's dtype, so `result`
    converts it in place and the second (a tensor of its own) into the rest, then frees the
    second. The peak stays the accumulator's 2 W (plus the rows that the edge's alignment
    leaves in the second slab beyond half: none where half of W's first dimension is a
    multiple of Tuning.slab_align); one fp32 tensor would convert into a third W, and no
    concatenation copies grad_weight. A slab's first product overwrites it (no zero fill to
    read back); a slab that only gets parts of blocks is zeroed first, one that gets none at
    the end. `slabs` holds the accumulator until `result` spends it."""

    def __init__(self, W, layout: str, dtype: torch.dtype, t: Tuning):
        lead, row = W.shape
        self.layout, self.dtype = layout, W.dtype
        self.starts = weight_grad_slabs(t, lead, row * dtype.itemsize, dtype.itemsize == 2 * W.dtype.itemsize)
        if len(self.starts) == 2:
            self._out = None
            self.slabs = [torch.empty(W.shape, dtype=dtype, device=W.device)]
        else:  # the first slab inside grad_weight's tensor (16-bit values viewed as fp32)
            half = self.starts[1]
            self._out = torch.empty(W.shape, dtype=W.dtype, device=W.device)
            first = self._out.view(-1)[: half * row * dtype.itemsize // W.dtype.itemsize].view(dtype).view(half, row)
            self.slabs = [first, torch.empty(lead - half, row, dtype=dtype, device=W.device)]
        self.written = [False] * len(self.slabs)

    def add_(self, dz_RC, x_RD, v0: int) -> None:
        """Add dz [R, C]^T x [R, D] to the classes v0..v0+C."""
        v1 = v0 + dz_RC.shape[1]
        for i, (slab, a, b) in enumerate(zip(self.slabs, self.starts, self.starts[1:])):
            if self.layout == "VD":  # slab i holds classes a..b
                lo, hi = max(a, v0), min(b, v1)
                if lo >= hi:
                    continue
                part, whole = slab[lo - a : hi - a], (lo, hi) == (a, b)
                left, right = dz_RC[:, lo - v0 : hi - v0].T, x_RD
            else:  # slab i holds hidden rows a..b of every class
                part, whole = slab[:, v0:v1], (v0, v1) == (0, slab.shape[1])
                left, right = x_RD[:, a:b].T, dz_RC
            if not self.written[i] and not whole:
                slab.zero_()
                self.written[i] = True
            addmm_(part, left, right, 1.0 if self.written[i] else 0.0)
            self.written[i] = True

    def index_add_(self, classes_K: torch.Tensor, rows_KD: torch.Tensor) -> None:
        """Add rows [K, D] (fp32) to the classes classes_K [K] (int64 in [0, V), repeats
        allowed; CUDA adds them with atomics, in no fixed order)."""
        for i, (slab, a, b) in enumerate(zip(self.slabs, self.starts, self.starts[1:])):
            if not self.written[i]:
                slab.zero_()
                self.written[i] = True
            if self.layout == "VD":
                inside = (classes_K >= a) & (classes_K < b)
                part = (rows_KD * inside[:, None]).to(slab.dtype)
                slab.index_add_(0, torch.where(inside, classes_K - a, 0), part)
            else:
                slab.index_add_(1, classes_K, rows_KD[:, a:b].T.to(slab.dtype))

    def result(self) -> torch.Tensor:
        """grad_weight in W's dtype and layout; the accumulator is spent."""
        slabs, self.slabs = self.slabs, []
        out, self._out = self._out, None
        for i in range(len(slabs)):  # by index: a loop variable would keep the last slab alive
            if not self.written[i]:
                slabs[i].zero_()
        if out is None:
            return slabs[0].to(self.dtype)
        flat = out.view(-1)
        n = slabs[0].numel()
        narrow_in_place(slabs.pop(0).view(-1), flat[:n])
        flat[n:].copy_(slabs.pop().view(-1))
        return out


def narrow_in_place(wide: torch.Tensor, narrow: torch.Tensor) -> None:
    """narrow[i] = wide[i] (rounded) for flat tensors where narrow, of half the itemsize,
    starts at wide's first byte: values [a, b) are converted after every value before a,
    and with b <= 2 a their destination bytes lie below wide[a]'s, whose values are read
    already. The first chunk, whose destination overlaps its own source, goes through a
    copy of a 64th of the values; the chunks then double (six or seven more launches)."""
    n = wide.numel()
    done = min(n, -(-n // 64))
    narrow[:done].copy_(wide[:done].to(narrow.dtype))
    while done < n:
        end = min(n, 2 * done)
        narrow[done:end].copy_(wide[done:end])
        done = end


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
        self._buffer_rows = 0 if plan.grad_input_scratch else plan.block_rows
        self._buffer = None  # allocated by the first block that needs it (kept logits need none)

    @property
    def buffer(self) -> torch.Tensor:
        """The reused logits buffer (`_new_buffer`), allocated on first use."""
        if self._buffer is None:
            self._buffer = self._new_buffer(self._buffer_rows)
        return self._buffer

    def _new_buffer(self, rows: int) -> torch.Tensor:
        """A flat logits buffer for blocks of `rows` rows and plan.block_cols columns."""
        n = min(rows, self.n_rows) * min(self.plan.block_cols, self.vocab)
        return torch.empty(n if self.logits_dtype == self.x.dtype else 0, dtype=self.x.dtype, device=self.x.device)

    def release(self) -> None:
        """Drop the logits buffer and the gathered rows (the loop is done with them)."""
        self._buffer, self._buffer_rows, self._gathered = None, 0, (None, None)

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

    def logits(self, rs: slice, v0: int, cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """z [R, cols] = x[rs] @ W[v0:v0+cols].T (no bias), in `out` (contiguous, x's dtype)
        or the reused buffer; a new tensor in logits_dtype, or when autograd records (a
        backward pass that is itself differentiated: a product into a buffer can't be)."""
        x_R = self.x_rows(rs)
        W_c = self.head_cols(v0, cols)
        if out is None and (self.logits_dtype != x_R.dtype or
                            (torch.is_grad_enabled() and (x_R.requires_grad or W_c.requires_grad))):
            return (x_R @ W_c.T).to(self.logits_dtype)
        z = out if out is not None else self._logits_space(rs)[: x_R.shape[0] * cols].view(x_R.shape[0], cols)
        return torch.mm(x_R, W_c.T, out=z)

    def add_grads(self, dz, rs: slice, v0: int, cols: int, dx_out, dW, db, dx_accumulate: bool = False) -> None:
        """Add dz [R, cols]'s share to the gradients: dx_out [R, D] = dz W_c (+= if
        dx_accumulate: an accumulator over column blocks), dW (a WeightGrad) += dz^T x, db += .."""
        if dx_out is not None:
            W_c = self.head_cols(v0, cols)
            dz_in = dz.to(W_c.dtype)
            if torch.is_grad_enabled() and (dz_in.requires_grad or W_c.requires_grad):  # recorded: no out=
                dx_out.add_(dz_in @ W_c) if dx_accumulate else dx_out.copy_(dz_in @ W_c)
            elif dx_accumulate or dx_out.dtype != dz_in.dtype:  # an fp32 dx of a 16-bit head: cuBLAS adds in fp32
                addmm_(dx_out, dz_in, W_c, beta=1.0 if dx_accumulate else 0.0)
            else:
                torch.mm(dz_in, W_c, out=dx_out)
        if dW is not None:
            dW.add_(dz, self.x_rows(rs).to(dz.dtype), v0)
        if db is not None:
            db[v0 : v0 + cols] += dz.sum(0, dtype=db.dtype)

    def gradient_buffers(self, need_x: bool, need_W: bool, need_b: bool, wide_dx: bool = False,
                         one_block: bool = False):
        """(dx [N, D] in x's dtype (fp32 with wide_dx), fp32 [R, D] accumulator when rows
        span several column blocks, dW a WeightGrad in the plan's accumulation dtype, db fp32
        [V]; fp64 for fp64 inputs). Filtering adds dW in parts: it keeps the plan's
        accumulator. With the plan's scratch, dx heads the logits' buffer (without dx, a
        buffer of plan.block_rows rows). one_block: the gradients are added in one block of
        all rows (kept logits), whatever the plan's blocks."""
        x, W = self.x, self.W
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        if wide_dx and need_x:
            dx = (torch.empty if self.active is None else torch.zeros)(x.shape, dtype=wide, device=x.device)
        elif self.plan.grad_input_scratch and need_x:
            dx = self._grad_input_with_scratch()
        elif self.plan.grad_input_scratch:
            dx, self._buffer, self._buffer_rows = None, None, self.plan.block_rows
        else:
            dx = (torch.empty_like(x) if self.active is None else torch.zeros_like(x)) if need_x else None
        dx_acc = torch.zeros(min(self.plan.block_rows, self.n_rows), x.shape[1], dtype=wide, device=x.device) \
            if need_x and not self.whole_rows else None
        # One row block: each element of dW is one product, accumulated in fp32 by cuBLAS
        # and written once in W's dtype, as exact as a wider accumulator and without it.
        one_product = (one_block or self.n_rows <= self.plan.block_rows) and self.logits_dtype == W.dtype and self.plan.filter_eps is None
        dW = WeightGrad(W, self.layout, W.dtype if one_product else self.plan.accumulate_dtype, self.plan.tuning) if need_W else None
        db = torch.zeros(W.shape[0] if self.layout == "VD" else W.shape[1], dtype=wide, device=W.device) if need_b else None
        return dx, dx_acc, dW, db


def final_grad(acc, like):
    """An accumulated gradient (tensor or WeightGrad) in the dtype of `like`, or None."""
    if acc is None:
        return None
    return acc.result() if isinstance(acc, WeightGrad) else acc.to(like.dtype)
