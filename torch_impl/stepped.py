"""Cross-entropy driven by block steps (`torch_impl.steps`): the fallback ("chunked").

The loop of `torch_impl.distill_blocked`, for cross-entropy: each block of logits z [R, C]
is merged by a "stats" step into per-row running statistics (max m and sum of exponentials
l, the logit at the target, the class-weighted sum for label smoothing); the forward pass
keeps only the per-row lse, and the backward pass recomputes each block's logits and turns
them into dz with a "grad" step (interop/SPEC.md).

- With `TorchOps` in blocks of whole rows (strategy "chunked"), this is the fallback wherever
  the kernels do not run (CPU, fp64): logits in fp32 (fp64 for fp64 inputs), one chunk of
  rows at a time. Its backward pass is plain PyTorch, recorded by autograd under
  ``create_graph=True``: the fallback alone has second-order derivatives.
- With a `VocabSplit` (strategy "chunked" with a head split over the vocabulary,
  `torch_impl.vocab_parallel`), this rank holds the classes [first, first + V_r): the ranks
  combine their statistics in the forward pass and sum grad_input in the backward pass. With
  sequence parallel, each rank passes its part of the rows: they are gathered in each pass
  (the whole input is never saved) and grad_input is reduce-scattered back to the parts.
"""

from __future__ import annotations

import torch

from interop.options import CrossEntropyOptions
from torch_impl.blocks import BlockPlan, HeadBlocks, final_grad
from torch_impl.autograd import first_order_only
from torch_impl.rows import TargetRows, compute_dtype, reduce_loss, row_coefficients, row_loss
from torch_impl.steps import TorchOps
from torch_impl.vocab_parallel import VocabSplit, combine_stats

SECOND_ORDER_MESSAGE = "logitless: a head split over the vocabulary gives first-order gradients only"


def forward(x, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, plan: BlockPlan, ops,
            split: VocabSplit | None = None):
    """(reduced loss, lse [N], cw [V] in the compute dtype or None) over flattened rows x
    [N, D] (with sequence parallel, split.rows_dim names the dimension of this rank's part
    [..., D] of the input that the ranks split), the head W (this rank's slice with a split),
    its bias, the full class weights cw [V] and the global targets y [N] (int64); loss and lse
    in the compute dtype, the same on every rank of the split's group."""
    x_ND = x if split is None else split.whole_rows(x)
    wide = compute_dtype(x_ND.dtype)
    blocks = HeadBlocks(x_ND, W, b_V, weight_layout, plan, logits_dtype=wide if ops is TorchOps else None)
    local_vocab, n, dev = blocks.vocab, x_ND.shape[0], x_ND.device
    vocab = local_vocab if split is None else split.vocab
    cw = None if cw_V is None else cw_V.to(wide)
    y_local, cw_local = (y_N, cw) if split is None else split.columns(y_N, cw, local_vocab)
    m = torch.full((n,), -torch.inf, dtype=wide, device=dev)
    l, sy, ws = (torch.zeros(n, dtype=wide, device=dev) for _ in range(3))
    need_ws = opts.label_smoothing > 0
    for rs in blocks.row_blocks():
        for v0, cols in blocks.col_blocks():
            ops.stats_(blocks.logits(rs, v0, cols), v0, b_V, y_local[rs], m[rs], l[rs], sy[rs], opts.softcap, 1.0,
                       cw_local, ws[rs] if need_ws else None)
    blocks = None
    (lse,) = combine_stats([(m, l)], [sy, ws], None if split is None else split.group)
    rows = TargetRows(y_N, cw, vocab, opts.ignore_index, wide)
    cw_sum = vocab if cw is None else cw.sum()
    loss = reduce_loss(row_loss(lse, sy, ws, rows, opts, cw_sum, vocab), rows, opts.reduction)
    return loss, lse, cw


def backward(grad_loss, grad_lse, x, W, b_V, cw, y_N, lse, opts: CrossEntropyOptions, layout: str, plan: BlockPlan, ops,
             need=(True, True, True), split: VocabSplit | None = None):
    """(dx, dW, db) of `forward`'s outputs, None where `need` (x, W, b) is not set; cw is
    what `forward` returned; grad_loss 0-d (or [N] for "none") or None, grad_lse [N] or None."""
    x_ND = x if split is None else split.whole_rows(x)
    wide = lse.dtype
    blocks = HeadBlocks(x_ND, W, b_V, layout, plan, logits_dtype=wide if ops is TorchOps else None)
    vocab = blocks.vocab if split is None else split.vocab
    y_local, cw_local = (y_N, cw) if split is None else split.columns(y_N, cw, blocks.vocab)
    rows = TargetRows(y_N, cw, vocab, opts.ignore_index, wide)
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=wide, device=lse.device)
    cw_sum = vocab if cw is None else cw.sum()
    p, t, s = row_coefficients(grad_loss, grad_lse, lse, rows, cw_sum, opts, vocab)
    need_x, need_W, need_b = need  # the same on every rank
    _, _, dW, db = blocks.gradient_buffers(False, need_W, need_b)
    # With a split, grad_input is summed over the ranks in fp32 and rounded once
    # (`VocabSplit.sum_grad_input`). Without one, each block of whole rows writes its rows
    # once (out of place, so that autograd can record it).
    summed = split is not None or not blocks.whole_rows
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
    if dx is not None and summed:
        dx = dx.to(x.dtype) if split is None else split.sum_grad_input(dx, x)
    return dx, final_grad(dW, W), final_grad(db, b_V)


class SteppedLinearCrossEntropy(torch.autograd.Function):
    """`forward` and `backward` as an autograd Function (arguments as `forward`'s); returns
    (reduced loss, lse [N])."""

    @staticmethod
    def forward(ctx, x, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, plan: BlockPlan, ops,
                split: VocabSplit | None = None):
        loss, lse, cw = forward(x, W, b_V, cw_V, y_N, opts, weight_layout, plan, ops, split)
        ctx.save_for_backward(x, W, b_V, cw, y_N, lse)
        ctx.args = (opts, weight_layout, plan, ops, split)
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        _, _, _, ops, split = ctx.args
        if split is None and ops is TorchOps:  # plain PyTorch ops: autograd may record them (create_graph)
            return SteppedLinearCrossEntropy._backward(ctx, grad_loss, grad_lse)
        return first_order_only(ctx, SteppedLinearCrossEntropy._backward, grad_loss, grad_lse,
                                message=SECOND_ORDER_MESSAGE)

    @staticmethod
    def _backward(ctx, grad_loss, grad_lse):
        none = (None,) * 7
        if grad_loss is None and grad_lse is None:
            return (None, None, None) + none
        opts, layout, plan, ops, split = ctx.args
        grads = backward(grad_loss, grad_lse, *ctx.saved_tensors, opts, layout, plan, ops, ctx.needs_input_grad[:3], split)
        return grads + none
