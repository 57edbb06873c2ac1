"""Cross-entropy as a rule of the block engine (`torch_impl.engine`), on block steps
(`torch_impl.steps`): the fallback ("chunked") and a head split's "chunked".

Each block of logits z [R, C] is merged by a "stats" step into per-row running statistics
(max m and sum of exponentials l, the logit at the target, the class-weighted sum for label
smoothing); the forward pass keeps only the per-row lse, and the backward pass recomputes
each block's logits and turns them into dz with a "grad" step (interop/SPEC.md).

- With `TorchOps` in blocks of whole rows (strategy "chunked"), this is the fallback wherever
  the kernels do not run (CPU, fp64): logits in fp32 (fp64 for fp64 inputs), one chunk of
  rows at a time. Its backward pass is plain PyTorch, recorded by autograd under
  ``create_graph=True``: the fallback alone has second-order derivatives.
- With a `VocabSplit` (a head split over the vocabulary, `torch_impl.vocab_parallel`), this
  rank holds the classes [first, first + V_r); the rule combines the ranks' statistics and
  the engine sums grad_input. With sequence parallel, each rank passes its part of the rows: they are
  gathered in each pass (the whole input is never saved) and grad_input is reduce-scattered
  back to the parts.
"""

from __future__ import annotations

import dataclasses

import torch

from interop.options import CrossEntropyOptions
from torch_impl import engine
from torch_impl.head import BlockPlan, HeadBlocks
from torch_impl.rows import TargetRows, compute_dtype, reduce_loss, row_coefficients, row_loss
from torch_impl.steps import TorchOps
from torch_impl.vocab_parallel import VocabSplit, combine_stats


class CrossEntropyRule(engine.Rule):
    """Cross-entropy's per-row math over `blocks` (this rank's classes with a split): y [N]
    global int64 targets, cw [V] the full class weights in the compute dtype or None. For
    the backward pass, lse [N] and the upstream gradients (grad_loss 0-d or [N], grad_lse
    [N] or None)."""

    def __init__(self, blocks: HeadBlocks, cw, y_N, opts: CrossEntropyOptions, ops, split: VocabSplit | None,
                 lse=None, grad_loss=None, grad_lse=None):
        self.blocks, self.opts, self.ops, self.split = blocks, opts, ops, split
        n, dev = y_N.shape[0], y_N.device
        wide = compute_dtype(blocks.x.dtype) if lse is None else lse.dtype
        self.vocab = blocks.vocab if split is None else split.vocab
        self.y_cols, self.cw_cols = (y_N, cw) if split is None else split.columns(y_N, cw, blocks.vocab)
        self.rows = TargetRows(y_N, cw, self.vocab, opts.ignore_index, wide)
        self.cw_sum = self.vocab if cw is None else cw.sum()
        if lse is None:
            self.m = torch.full((n,), -torch.inf, dtype=wide, device=dev)
            self.l, self.sy, self.ws, self.lse = (torch.zeros(n, dtype=wide, device=dev) for _ in range(4))
        else:
            grad_loss = torch.zeros((), dtype=wide, device=dev) if grad_loss is None else grad_loss
            self.lse = lse
            self.p, self.t, self.s = row_coefficients(grad_loss, grad_lse, lse, self.rows, self.cw_sum, opts, self.vocab)

    def stats_(self, z, v0, rs, sweep):
        ws = self.ws[rs] if self.opts.label_smoothing > 0 else None
        self.ops.stats_(z, v0, self.blocks.b, self.y_cols[rs], self.m[rs], self.l[rs], self.sy[rs], self.opts.softcap,
                        1.0, self.cw_cols, ws)

    def rows_done(self, rs, sweep):
        (self.lse[rs],) = combine_stats([(self.m[rs], self.l[rs])], [self.sy[rs], self.ws[rs]],
                                        None if self.split is None else self.split.group)

    def loss(self):
        """The reduced loss (or [N] for "none") of the forward pass."""
        losses = row_loss(self.lse, self.sy, self.ws, self.rows, self.opts, self.cw_sum, self.vocab)
        return reduce_loss(losses, self.rows, self.opts.reduction)

    def coefficients(self, rs):
        pass  # every row's (P, T, S) are formed at once

    def grad(self, z, v0, rs):
        return self.ops.grad(z, v0, self.blocks.b, self.y_cols[rs], self.opts.softcap, 1.0, self.lse[rs], self.p[rs],
                             self.t[rs], None, self.cw_cols, self.s[rs])


@dataclasses.dataclass
class CrossEntropyCall(engine.Call):
    """`CrossEntropyRule` on tensors (flattened rows x [N, D] (with sequence parallel,
    split.rows_dim names the dimension of this rank's part [..., D] of the input that the
    ranks split), the head W (this rank's slice with a split), its bias, the full class
    weights cw [V] or None, the global targets y [N] int64); outputs (reduced loss, lse [N])
    in the compute dtype, the same on every rank of the split's group; saved (lse,)."""

    opts: CrossEntropyOptions
    layout: str
    plan: BlockPlan
    ops: type
    split: VocabSplit | None = None
    message = "logitless: a head split over the vocabulary gives first-order gradients only"

    def __post_init__(self):
        self.second_order = self.split is None and self.ops is TorchOps  # plain PyTorch ops: recorded
        self.kernels = self.ops is not TorchOps

    def _rule(self, x, W, b, cw, y, *saved):
        x_ND = x if self.split is None else self.split.whole_rows(x)
        blocks = HeadBlocks(x_ND, W, b, self.layout, self.plan,
                            logits_dtype=compute_dtype(x_ND.dtype) if self.ops is TorchOps else None)
        cw = None if cw is None else cw.to(compute_dtype(x_ND.dtype))
        return CrossEntropyRule(blocks, cw, y, self.opts, self.ops, self.split, *saved), blocks

    def forward(self, tensors, need):
        rule, blocks = self._rule(*tensors)
        engine.forward(rule, blocks, split=self.split, x=tensors[0])
        return (rule.loss(), rule.lse), (rule.lse,), None

    def backward(self, tensors, saved, grad_outputs, need):
        rule, blocks = self._rule(*tensors, *saved, *grad_outputs)
        return engine.backward(rule, blocks, need, self.split, tensors[0])
