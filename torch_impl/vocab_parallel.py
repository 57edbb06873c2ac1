"""Cross-entropy of a head split over the vocabulary across the ranks of a process group.

Rank r holds the classes [a_r, a_r + V_r) of the head (its rows of W in "VD", its columns in
"DV", its part of the bias), contiguous and in the group's rank order; the slices may be
uneven. Every rank has the same rows x and the same global targets. Per block of logits a
rank reduces its own columns to per-row statistics (running max m, sum of exponentials l,
the target's logit where the target is one of its classes, the class-weighted sum of the
logits for label smoothing); the ranks then combine them (one all-reduce MAX and one
all-reduce SUM of four floats per row: never logits) into the global lse, from which each
rank forms dz on its own columns in the backward pass, recomputing its logits. Each rank
gets its slice of grad_weight and grad_bias, and the full grad_input (one all-reduce SUM of
[N, D] in fp32). Class weights are the full [V] vector on every rank. Every rank makes the
same collectives in the same order whatever its arguments (`vocab_slice` checks them all
first), so a bad argument on one rank raises on every rank instead of leaving the others
waiting.

The blocks and block steps are those of the other paths: `torch_impl.blocked.HeadBlocks`
and `torch_impl.distill_ops` (Triton kernels where they run, PyTorch ops elsewhere). As
Megatron's and PyTorch's `loss_parallel`, the forward pass only computes statistics and the
backward pass recomputes the logits (8 N D V / P flops per rank).

A DTensor head sharded on its vocabulary dimension over a 1-D mesh (what ColwiseParallel
makes), with an input replicated on that mesh, runs here too: its local slice and the mesh's
process group, the gradients returned as DTensors of the same placements. A DTensor head
with a plain input (FSDP2's sharded parameter used outside its module's forward, the rows
split across ranks) is gathered once per call (`local_operands`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from interop.options import CrossEntropyOptions
from torch_impl.blocked import BlockPlan, HeadBlocks, final_grad
from torch_impl.distill_ops import TorchOps, plan_steps as plan
from torch_impl.function import first_order_only
from torch_impl.rows import TargetRows, compute_dtype, reduce_loss, row_coefficients, row_loss

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # torch < 2.5: the same classes under their former module
    from torch.distributed._tensor import DTensor, Partial, Replicate, Shard

SECOND_ORDER_MESSAGE = "logitless: a head split over the vocabulary gives first-order gradients only"


def vocab_slice(group, local_vocab: int, hidden: int, n_rows: int, device, problem: Exception | None) -> tuple[int, int]:
    """(first class of this rank's slice, V of the whole head), from the ranks' slice sizes
    gathered over `group` with what every rank must share (D, N) and whether its own
    arguments passed their checks (`problem`: None, or the error this rank raises). Every
    rank raises when any rank's arguments are wrong, so none waits in a later collective."""
    facts = torch.tensor([local_vocab, hidden, n_rows, problem is not None], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(facts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, facts, group=group)
    table = torch.stack(gathered).tolist()
    if problem is not None:
        raise problem
    failed = [r for r, row in enumerate(table) if row[3]]
    if failed:
        raise ValueError(f"vocab_parallel: the arguments of rank(s) {failed} of the group failed their checks")
    if any(row[1:3] != table[0][1:3] for row in table):
        raise ValueError(f"vocab_parallel: every rank needs the same rows and hidden size; (D, N) by rank: "
                         f"{[tuple(row[1:3]) for row in table]}")
    if any(row[0] < 1 for row in table):
        raise ValueError(f"vocab_parallel: every rank must hold at least one class; classes by rank: "
                         f"{[row[0] for row in table]}")
    rank = dist.get_rank(group)
    return sum(row[0] for row in table[:rank]), sum(row[0] for row in table)


def _local_targets(y_N, first: int, local_vocab: int):
    """Targets as this rank's column indices: y - first where y is one of its classes, else
    -1 (no column: the target terms of other ranks' classes are theirs)."""
    mine = (y_N >= first) & (y_N < first + local_vocab)
    return torch.where(mine, y_N - first, torch.full_like(y_N, -1))


def _combine(m, l, sy, ws, group):
    """(lse, s_y, ws) [N] over all ranks' classes from each rank's running (m, l), target
    logit and class-weighted sum: one all-reduce MAX of m, one SUM of the rest. lse is NaN
    where any rank saw a NaN logit (a MAX all-reduce need not keep NaN)."""
    m_all = m.clone()
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
    finite = torch.isfinite(m_all)
    shift = torch.where(finite, m_all, torch.zeros_like(m_all))
    scaled = torch.where(m == -torch.inf, torch.zeros_like(l), l * torch.exp(m - shift))
    sums = torch.stack([scaled, torch.isnan(m).to(l.dtype), sy, ws])
    dist.all_reduce(sums, group=group)
    lse = torch.where(finite, shift + torch.log(sums[0]), m_all)
    return torch.where(sums[1] > 0, torch.full_like(lse, torch.nan), lse), sums[2], sums[3]


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Over flattened rows x [N, D], this rank's slice of the head W, its bias slice, the
    full class weights cw [V] and the global targets y [N]; returns (reduced loss, lse [N]),
    the same on every rank of `group`."""

    @staticmethod
    def forward(ctx, x_ND, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, plan: BlockPlan, ops,
                group, first: int, vocab: int):
        wide = compute_dtype(x_ND.dtype)
        blocks = HeadBlocks(x_ND, W, b_V, weight_layout, plan, logits_dtype=wide if ops is TorchOps else None)
        local_vocab, n, dev = blocks.vocab, x_ND.shape[0], x_ND.device
        cw = None if cw_V is None else cw_V.to(wide)
        cw_local = None if cw is None else cw[first : first + local_vocab]
        y_local = _local_targets(y_N, first, local_vocab)
        m = torch.full((n,), -torch.inf, dtype=wide, device=dev)
        l, sy, ws = (torch.zeros(n, dtype=wide, device=dev) for _ in range(3))
        need_ws = opts.label_smoothing > 0
        for rs in blocks.row_blocks():
            for v0, cols in blocks.col_blocks():
                ops.stats_(blocks.logits(rs, v0, cols), v0, b_V, y_local[rs], m[rs], l[rs], sy[rs], opts.softcap, 1.0,
                           cw_local, ws[rs] if need_ws else None)
        blocks = None
        lse, sy, ws = _combine(m, l, sy, ws, group)
        rows = TargetRows(y_N, cw, vocab, opts.ignore_index, wide)
        cw_sum = vocab if cw is None else cw.sum()
        loss = reduce_loss(row_loss(lse, sy, ws, rows, opts, cw_sum, vocab), rows, opts.reduction)
        ctx.save_for_backward(x_ND, W, b_V, cw, y_N, lse)
        ctx.args = (opts, weight_layout, plan, ops, group, first, vocab)
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        return first_order_only(ctx, VocabParallelLinearCrossEntropy._backward, grad_loss, grad_lse,
                                message=SECOND_ORDER_MESSAGE)

    @staticmethod
    def _backward(ctx, grad_loss, grad_lse):
        none = (None,) * 9
        if grad_loss is None and grad_lse is None:
            return (None, None, None) + none
        x_ND, W, b_V, cw, y_N, lse = ctx.saved_tensors
        opts, layout, plan, ops, group, first, vocab = ctx.args
        wide = lse.dtype
        blocks = HeadBlocks(x_ND, W, b_V, layout, plan, logits_dtype=wide if ops is TorchOps else None)
        cw_local = None if cw is None else cw[first : first + blocks.vocab]
        y_local = _local_targets(y_N, first, blocks.vocab)
        rows = TargetRows(y_N, cw, vocab, opts.ignore_index, wide)
        if grad_loss is None:
            grad_loss = torch.zeros((), dtype=wide, device=lse.device)
        cw_sum = vocab if cw is None else cw.sum()
        p, t, s = row_coefficients(grad_loss, grad_lse, lse, rows, cw_sum, opts, vocab)
        need_x, need_W, need_b = ctx.needs_input_grad[:3]  # the same on every rank
        _, _, dW, db = blocks.gradient_buffers(False, need_W, need_b)
        # grad_input summed over the ranks in fp32 and rounded once: one rank's share can be
        # much larger than the sum (the target's -W_y on one rank, p W on the others)
        dx = torch.zeros(x_ND.shape, dtype=wide, device=x_ND.device) if need_x else None
        for rs in blocks.row_blocks():
            for v0, cols in blocks.col_blocks():
                dz = ops.grad(blocks.logits(rs, v0, cols), v0, b_V, y_local[rs], opts.softcap, 1.0, lse[rs], p[rs],
                              t[rs], None, cw_local, s[rs])
                blocks.add_grads(dz, rs, v0, cols, None if dx is None else dx[rs], dW, db, dx_accumulate=True)
        dz = blocks = None
        if dx is not None:
            dist.all_reduce(dx, group=group)  # every rank's classes' share of each row's gradient
            dx = dx.to(x_ND.dtype)
        return (dx, final_grad(dW, W), final_grad(db, b_V)) + none


def _gathered(t):
    """A DTensor's whole value as a plain tensor, differentiably: its gradient, different on
    every rank (their own rows), is averaged over the mesh and scattered back to the
    DTensor's placements, as FSDP2 reduces the gradients of the parameters it shards."""
    if not isinstance(t, DTensor):
        return t
    return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)


def local_operands(linear_weight, input, linear_bias, weight_layout: str):
    """Plain tensors for DTensor arguments: (input, head, bias, process group or None).

    A head sharded on its vocabulary dimension over a 1-D mesh, with the input a DTensor
    replicated on that mesh (tensor parallel, as `loss_parallel`): the local slices and the
    mesh's group, each differentiable back to its DTensor (the head's and the bias' gradients
    keep their Shard placement, the input's its Replicate). A DTensor head with a plain input
    (FSDP2, rows split across ranks): the head and bias gathered (`_gathered`), no group.
    None when no argument is a DTensor."""
    if not any(isinstance(t, DTensor) for t in (linear_weight, input, linear_bias)):
        return None
    if not isinstance(input, DTensor):
        return input, _gathered(linear_weight), _gathered(linear_bias), None
    if not isinstance(linear_weight, DTensor) or linear_weight.device_mesh != input.device_mesh \
            or input.device_mesh.ndim != 1:
        raise ValueError("a DTensor input needs a DTensor linear_weight on the same 1-D mesh")
    if tuple(input.placements) != (Replicate(),):
        raise ValueError(f"a DTensor input must be replicated on its mesh (the rows the same on every rank), got "
                         f"placements {tuple(input.placements)}")
    vocab_dim = 0 if weight_layout == "VD" else 1
    placements = tuple(linear_weight.placements)
    if placements not in ((Shard(vocab_dim),), (Replicate(),)):
        raise ValueError(f"linear_weight with a DTensor input must be Shard({vocab_dim}) (its vocabulary, weight_layout="
                         f"{weight_layout!r}) or Replicate(), got {placements}")
    bias = linear_bias
    if isinstance(bias, DTensor):
        if tuple(bias.placements) != ((Shard(0),) if placements != (Replicate(),) else (Replicate(),)):
            raise ValueError(f"linear_bias must be placed as the head's vocabulary, got {tuple(bias.placements)}")
        bias = bias.to_local()
    group = None if placements == (Replicate(),) else input.device_mesh.get_group()
    return input.to_local(), linear_weight.to_local(), bias, group
