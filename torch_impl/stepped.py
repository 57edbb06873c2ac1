"""Cross-entropy driven by block steps (`torch_impl.steps`): the fallback and the vocabulary split.

The loop of `torch_impl.distill_blocked`, for cross-entropy: each block of logits z [R, C]
is merged by a "stats" step into per-row running statistics (max m and sum of exponentials
l, the logit at the target, the class-weighted sum for label smoothing); the forward pass
keeps only the per-row lse, and the backward pass recomputes each block's logits and turns
them into dz with a "grad" step (interop/SPEC.md).

- With `TorchOps` in blocks of whole rows (strategy "chunked"), this is the fallback wherever
  the kernels do not run (CPU, fp64): logits in fp32 (fp64 for fp64 inputs), one chunk of
  rows at a time. Its backward pass is plain PyTorch, recorded by autograd under
  ``create_graph=True``: the fallback alone has second-order derivatives.
- With a process group, this rank holds the classes [first, first + V_r) of a head split
  over the vocabulary (`torch_impl.vocab_parallel`): the ranks combine their statistics in
  the forward pass (`combine_stats`) and sum grad_input in the backward pass, on either steps.
  With sequence parallel, each rank passes its part of the rows: they are gathered in each
  pass (`gather_rows`: the whole input is never saved) and grad_input
  is reduce-scattered back to the parts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from interop.options import CrossEntropyOptions
from torch_impl.blocks import BlockPlan, HeadBlocks, final_grad
from torch_impl.autograd import first_order_only
from torch_impl.rows import TargetRows, compute_dtype, reduce_loss, row_coefficients, row_loss
from torch_impl.steps import TorchOps

SECOND_ORDER_MESSAGE = "logitless: a head split over the vocabulary gives first-order gradients only"


def local_targets(y_N, first: int, local_vocab: int):
    """Targets (or teacher ids) as this rank's column indices: y - first where y is one of
    its classes, else -1 (no column: the terms of other ranks' classes are theirs)."""
    mine = (y_N >= first) & (y_N < first + local_vocab)
    return torch.where(mine, y_N - first, torch.full_like(y_N, -1))


def combine_stats(running, sums, group):
    """([lse [N] of each running (m, l) pair], [each tensor of `sums` summed]) over all
    ranks' classes: one all-reduce MAX of the m's, one SUM of the rest (nothing without a
    group). lse is NaN where any rank's running pair is NaN (a NaN logit, or +inf which
    makes l NaN), as one process gives: a MAX all-reduce need not keep NaN."""
    if group is None:
        return [m + torch.log(l) for m, l in running], list(sums)
    m = torch.stack([m for m, _ in running])
    l = torch.stack([l for _, l in running])
    m_all = m.clone()
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
    finite = torch.isfinite(m_all)
    shift = torch.where(finite, m_all, torch.zeros_like(m_all))
    scaled = torch.where(m == -torch.inf, torch.zeros_like(l), l * torch.exp(m - shift))
    flat = torch.cat([scaled.flatten(), (torch.isnan(m) | torch.isnan(l)).to(l.dtype).flatten(), *(t.flatten() for t in sums)])
    dist.all_reduce(flat, group=group)
    k = m.numel()
    lse = torch.where(finite, shift + torch.log(flat[:k].view_as(m)), m_all)
    lse = torch.where(flat[k : 2 * k].view_as(m) > 0, torch.full_like(lse, torch.nan), lse)
    parts, start = [], 2 * k
    for t in sums:
        parts.append(flat[start : start + t.numel()].view_as(t))
        start += t.numel()
    return list(lse.unbind(0)), parts


def gather_rows(x, group, dim: int) -> torch.Tensor:
    """Sequence parallel: every rank's part of the input (equal parts, split along `dim`),
    concatenated along `dim` in the group's rank order, as Megatron's sequence-parallel
    layers gather their input before the vocabulary-split head."""
    parts = x.movedim(dim, 0).contiguous()
    whole = parts.new_empty((dist.get_world_size(group) * parts.shape[0], *parts.shape[1:]))
    dist.all_gather_into_tensor(whole, parts, group=group)
    return whole.movedim(0, dim)


def reduce_scatter_rows(dx, group, dim: int) -> torch.Tensor:
    """The transpose of `gather_rows`: every rank's share of the whole input's gradient dx
    summed, and this rank's part along `dim` kept (one reduce-scatter: 1/P of an all-reduce's
    result, and the gathered input's gradient is never whole on any rank)."""
    shares = dx.movedim(dim, 0).contiguous()
    mine = shares.new_empty((shares.shape[0] // dist.get_world_size(group), *shares.shape[1:]))
    dist.reduce_scatter_tensor(mine, shares, group=group)
    return mine.movedim(0, dim)


def _whole_rows(x, group, rows_dim):
    """The flattened rows [N, D] of the input: x itself (already [N, D]) without sequence
    parallel, else every rank's part of x gathered along rows_dim."""
    return x if rows_dim is None else gather_rows(x, group, rows_dim).reshape(-1, x.shape[-1])


def forward(x, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, plan: BlockPlan, ops, group=None,
            first: int = 0, vocab: int | None = None, rows_dim: int | None = None):
    """(reduced loss, lse [N], cw [V] in the compute dtype or None) over flattened rows x
    [N, D] (with sequence parallel, rows_dim names the dimension of this rank's part [..., D]
    of the input that the ranks split), the head W (this rank's slice with a group), its
    bias, the full class weights cw [V] and the global targets y [N] (int64); loss and lse
    in the compute dtype, the same on every rank of `group`. first: the rank's first class
    (0 without a group); vocab: V of the whole head (default: W's)."""
    x_ND = _whole_rows(x, group, rows_dim)
    wide = compute_dtype(x_ND.dtype)
    blocks = HeadBlocks(x_ND, W, b_V, weight_layout, plan, logits_dtype=wide if ops is TorchOps else None)
    local_vocab, n, dev = blocks.vocab, x_ND.shape[0], x_ND.device
    vocab = local_vocab if vocab is None else vocab
    cw = None if cw_V is None else cw_V.to(wide)
    cw_local = None if cw is None else cw[first : first + local_vocab]
    y_local = local_targets(y_N, first, local_vocab)
    m = torch.full((n,), -torch.inf, dtype=wide, device=dev)
    l, sy, ws = (torch.zeros(n, dtype=wide, device=dev) for _ in range(3))
    need_ws = opts.label_smoothing > 0
    for rs in blocks.row_blocks():
        for v0, cols in blocks.col_blocks():
            ops.stats_(blocks.logits(rs, v0, cols), v0, b_V, y_local[rs], m[rs], l[rs], sy[rs], opts.softcap, 1.0,
                       cw_local, ws[rs] if need_ws else None)
    blocks = None
    (lse,), (sy, ws) = combine_stats([(m, l)], [sy, ws], group)
    rows = TargetRows(y_N, cw, vocab, opts.ignore_index, wide)
    cw_sum = vocab if cw is None else cw.sum()
    loss = reduce_loss(row_loss(lse, sy, ws, rows, opts, cw_sum, vocab), rows, opts.reduction)
    return loss, lse, cw


def backward(grad_loss, grad_lse, x, W, b_V, cw, y_N, lse, opts: CrossEntropyOptions, layout: str, plan: BlockPlan, ops,
             need=(True, True, True), group=None, first: int = 0, vocab: int | None = None, rows_dim: int | None = None):
    """(dx, dW, db) of `forward`'s outputs, None where `need` (x, W, b) is not set; cw is
    what `forward` returned; grad_loss 0-d (or [N] for "none") or None, grad_lse [N] or None."""
    x_ND = _whole_rows(x, group, rows_dim)
    wide = lse.dtype
    blocks = HeadBlocks(x_ND, W, b_V, layout, plan, logits_dtype=wide if ops is TorchOps else None)
    vocab = blocks.vocab if vocab is None else vocab
    cw_local = None if cw is None else cw[first : first + blocks.vocab]
    y_local = local_targets(y_N, first, blocks.vocab)
    rows = TargetRows(y_N, cw, vocab, opts.ignore_index, wide)
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=wide, device=lse.device)
    cw_sum = vocab if cw is None else cw.sum()
    p, t, s = row_coefficients(grad_loss, grad_lse, lse, rows, cw_sum, opts, vocab)
    need_x, need_W, need_b = need  # the same on every rank
    _, _, dW, db = blocks.gradient_buffers(False, need_W, need_b)
    # With a group, grad_input is summed over the ranks in fp32 and rounded once: one
    # rank's share can be much larger than the sum (the target's -W_y on one rank, p W on
    # the others). Without one, each block of whole rows writes its rows once (out of
    # place, so that autograd can record it).
    summed = group is not None or not blocks.whole_rows
    dx = None
    if need_x:
        dx = torch.zeros(x_ND.shape, dtype=wide, device=x_ND.device) if summed else torch.empty_like(x_ND)
    for rs in blocks.row_blocks():
        for v0, cols in blocks.col_blocks():
            dz = ops.grad(blocks.logits(rs, v0, cols), v0, b_V, y_local[rs], opts.softcap, 1.0, lse[rs], p[rs],
                          t[rs], None, cw_local, s[rs])
            blocks.add_grads(dz, rs, v0, cols, dx[rs] if summed and need_x else None, dW, db, dx_accumulate=True)
            if need_x and not summed:
                dx[rs] = dz.to(W.dtype) @ blocks.head_cols(v0, cols)
    dz = blocks = None
    if dx is not None and summed:  # every rank's classes' share of each row's gradient, summed
        if rows_dim is not None:
            dx = reduce_scatter_rows(dx.view(*x.shape[:rows_dim], -1, *x.shape[rows_dim + 1:]), group, rows_dim)
        elif group is not None:
            dist.all_reduce(dx, group=group)
        dx = dx.to(x.dtype)
    return dx, final_grad(dW, W), final_grad(db, b_V)


class SteppedLinearCrossEntropy(torch.autograd.Function):
    """`forward` and `backward` as an autograd Function (arguments as `forward`'s); returns
    (reduced loss, lse [N])."""

    @staticmethod
    def forward(ctx, x, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, plan: BlockPlan, ops,
                group, first: int, vocab: int, rows_dim: int | None = None):
        loss, lse, cw = forward(x, W, b_V, cw_V, y_N, opts, weight_layout, plan, ops, group, first, vocab, rows_dim)
        ctx.save_for_backward(x, W, b_V, cw, y_N, lse)
        ctx.args = (opts, weight_layout, plan, ops, group, first, vocab, rows_dim)
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        _, _, _, ops, group, _, _, _ = ctx.args
        if group is None and ops is TorchOps:  # plain PyTorch ops: autograd may record them (create_graph)
            return SteppedLinearCrossEntropy._backward(ctx, grad_loss, grad_lse)
        return first_order_only(ctx, SteppedLinearCrossEntropy._backward, grad_loss, grad_lse,
                                message=SECOND_ORDER_MESSAGE)

    @staticmethod
    def _backward(ctx, grad_loss, grad_lse):
        none = (None,) * 10
        if grad_loss is None and grad_lse is None:
            return (None, None, None) + none
        opts, layout, plan, ops, group, first, vocab, rows_dim = ctx.args
        grads = backward(grad_loss, grad_lse, *ctx.saved_tensors, opts, layout, plan, ops, ctx.needs_input_grad[:3], group,
                         first, vocab, rows_dim)
        return grads + none
