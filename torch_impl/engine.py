"""The block loop of every loss, and their one autograd Function: each loss is a `Rule`
(its per-row math) that `forward` and `backward` call, and a `Call` (its passes and what
they save) that `RuleFunction` runs under autograd.

A rule holds one call's per-row state over the rows `HeadBlocks` computes. The loop walks
row blocks of logits z [R, C] (`HeadBlocks.logits`, no bias):

- forward: `stats_` merges each column block of a row block into the rule's running
  statistics, `sweeps` times (a dense teacher's divergence needs lse first: two sweeps);
  `rows_done` then combines them over a split head's ranks and forms the rows' outputs.
  With `grads_now` (blocks of whole rows), `coefficients` and `grad` turn the same logits
  into dz, whose products give the gradients for an upstream gradient of 1: 6 N D V flops.
- backward: `coefficients` from what the forward pass saved and the upstream gradients,
  then `grad` on each recomputed block: 8 N D V flops in all. Where "speed"'s logits fit
  a share of the free memory (`Tuning.keep_logits_share`), the forward pass keeps them
  (`head.KeptLogits`, the plan's), and the first backward pass turns them into dz in place
  and takes each gradient in one product over all rows: 6 N D V flops, no fp32 grad_weight
  accumulator, for every loss whose upstream gradients the forward pass does not know.

The loop owns everything else once for every loss: the gradient buffers (grad_weight in
slabs converted in place, grad_input rows written once or summed over column blocks in fp32), the
rows computed (`HeadBlocks.active`), and the order of a head split over the vocabulary
(`torch_impl.vocab_parallel.VocabSplit`; its blocks hold the gathered rows): the rule's
`rows_done` combines each row block's statistics before its dz, or, when no gradient is
formed and the rule has one sweep, every row's at once after the loop (one collective);
grad_input is summed over the ranks in fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_impl.autograd import first_order_only, scale_formed
from torch_impl.head import HeadBlocks, KeptLogits, final_grad
from torch_impl.vocab_parallel import VocabSplit


class Rule:
    """A loss's per-row math on its `blocks` (HeadBlocks; the defaults: one sweep, gradients
    added by the blocks, nothing to release)."""

    blocks: HeadBlocks

    sweeps = 1

    def stats_(self, z, v0: int, rs: slice, sweep: int) -> None:
        """Merge logits block z [R, C] (columns v0..v0+C of row block rs) into the statistics."""
        raise NotImplementedError

    def rows_done(self, rs: slice, sweep: int) -> None:
        """The statistics of rows rs are complete for this sweep: combine them over the
        split's ranks and form those rows' outputs."""
        raise NotImplementedError

    def coefficients(self, rs: slice) -> None:
        """Prepare dz's per-row coefficients of row block rs (for `grad`)."""
        raise NotImplementedError

    def grad(self, z, v0: int, rs: slice):
        """dz of logits block z (written over z by the kernels)."""
        raise NotImplementedError

    def add_grads(self, dz, rs: slice, v0: int, cols: int, dx_out, dW, db, accumulate: bool) -> None:
        """Add dz's share to the gradients (`HeadBlocks.add_grads`; a rule may add its own way)."""
        self.blocks.add_grads(dz, rs, v0, cols, dx_out, dW, db, dx_accumulate=accumulate)

    def release(self) -> None:
        """Drop the rule's own logits buffers (before grad_weight's conversion allocates)."""


def forward(rule: Rule, blocks: HeadBlocks, grads_now=(False, False, False), split: VocabSplit | None = None, x=None):
    """Run `rule` over the blocks; (dx, dW, db) for an upstream gradient of 1 where grads_now
    (x, W, b) is set (blocks of whole rows only), else (None, None, None). x: this rank's input (with a
    split's sequence parallel, its part of blocks.x's rows)."""
    in_forward = any(grads_now)
    assert not in_forward or blocks.whole_rows, "gradients in the forward pass need whole rows"
    dx, _, dW, db = blocks.gradient_buffers(*grads_now, wide_dx=split is not None)
    at_once = split is not None and not in_forward and rule.sweeps == 1  # one combine of every row's statistics
    # a split head's ranks recompute: each would decide from its own free memory, and their
    # backward passes' collectives (an "auto" call's re-plan) must stay the same
    kept = None if in_forward or split is not None else _kept_logits(blocks)
    z = None
    for rs in blocks.row_blocks():
        for sweep in range(rule.sweeps):
            for v0, cols in blocks.col_blocks():
                if sweep == 0 or not blocks.whole_rows:  # whole rows: one block, kept for every sweep
                    z = blocks.logits(rs, v0, cols, out=None if kept is None else kept[rs])
                rule.stats_(z, v0, rs, sweep)
            if not at_once:
                rule.rows_done(rs, sweep)
        if in_forward:
            rule.coefficients(rs)
            dz = rule.grad(z, 0, rs)
            dx_R = None if dx is None else blocks.dx_rows(dx, rs)
            rule.add_grads(dz, rs, 0, blocks.vocab, dx_R, dW, db, False)
            if dx_R is not None:
                blocks.scatter_dx_rows(dx, rs, dx_R)
    if at_once:
        rule.rows_done(slice(0, blocks.n_rows), 0)
    z = dz = None
    return _gradients(rule, blocks, dx, dW, db, split, x) if in_forward else (None, None, None)


def backward(rule: Rule, blocks: HeadBlocks, need=(True, True, True), split: VocabSplit | None = None, x=None):
    """(dx, dW, db) recomputing the logits block by block (or from the logits the forward
    pass kept), None where `need` (x, W, b) is not set; x as for `forward`."""
    kept = blocks.plan.kept
    if kept is not None and kept.z is not None:
        return _backward_kept(rule, blocks, kept, need, split, x)
    dx, dx_acc, dW, db = blocks.gradient_buffers(*need, wide_dx=split is not None)
    for rs in blocks.row_blocks():
        rule.coefficients(rs)
        dx_out = None
        if dx is not None:  # rows spanning several column blocks sum their shares in fp32
            dx_out = blocks.dx_rows(dx, rs) if dx_acc is None else dx_acc[: rs.stop - rs.start]
        for v0, cols in blocks.col_blocks():
            dz = rule.grad(blocks.logits(rs, v0, cols), v0, rs)
            rule.add_grads(dz, rs, v0, cols, dx_out, dW, db, dx_acc is not None)
        if dx is not None and dx_acc is None:
            blocks.scatter_dx_rows(dx, rs, dx_out)
        elif dx is not None:
            blocks.put_dx_rows(dx, rs, dx_out)
            dx_acc.zero_()
    dz = dx_acc = None
    return _gradients(rule, blocks, dx, dW, db, split, x)


def free_bytes(x: torch.Tensor) -> int:
    """Bytes free on x's device for logits kept between the passes: CUDA's free memory, 0
    off CUDA (host memory is not weighed) and while a CUDA graph is captured (a replay
    cannot choose again)."""
    if not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return 0
    return torch.cuda.mem_get_info(x.device)[0]


def _kept_logits(blocks: HeadBlocks) -> torch.Tensor | None:
    """The plan's KeptLogits' new z [A, V] when this forward pass keeps its logits: a
    recording call (the plan holds a KeptLogits not yet used) of "speed" in whole rows
    whose logits the kernels read in x's dtype and no gradient filter changes, taking at
    most Tuning.keep_logits_share of the free memory."""
    p, x = blocks.plan, blocks.x
    if p.kept is None or p.kept.z is not None or p.kept.spent or p.strategy != "speed" or not blocks.whole_rows:
        return None
    if p.filter_eps is not None or blocks.logits_dtype != x.dtype or blocks.n_rows == 0:
        return None
    if blocks.n_rows * blocks.vocab * x.element_size() > p.tuning.keep_logits_share * free_bytes(x):
        return None
    p.kept.z = x.new_empty(blocks.n_rows, blocks.vocab)
    return p.kept.z


def _backward_kept(rule: Rule, blocks: HeadBlocks, kept: KeptLogits, need, split, x):
    """`backward` from the kept logits z [A, V] (spent here, and freed before the gradients'
    conversions): each row block's dz written over its logits, then each gradient in one
    product over all rows (grad_weight formed once in W's dtype, accumulated in fp32 by
    cuBLAS)."""
    z_AV, kept.z, kept.spent = kept.z, None, True
    dx, _, dW, db = blocks.gradient_buffers(*need, wide_dx=split is not None, one_block=True)
    for rs in blocks.row_blocks():
        rule.coefficients(rs)
        z = z_AV[rs]
        dz = rule.grad(z, 0, rs)
        if dz.data_ptr() != z.data_ptr():
            z.copy_(dz)
    every = slice(0, blocks.n_rows)
    dx_A = None if dx is None else blocks.dx_rows(dx, every)
    rule.add_grads(z_AV, every, 0, blocks.vocab, dx_A, dW, db, False)
    if dx_A is not None:
        blocks.scatter_dx_rows(dx, every, dx_A)
    z_AV = z = dz = None
    return _gradients(rule, blocks, dx, dW, db, split, x)


def _gradients(rule, blocks, dx, dW, db, split, x):
    """The accumulated gradients in their inputs' dtypes; the logits buffers go first."""
    W, b = blocks.W, blocks.b
    if dx is not None:
        blocks.zero_skipped_dx_rows(dx)
    blocks.release()
    rule.release()
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return dx, final_grad(dW, W), final_grad(db, b)


class Call:
    """One call of a loss as `RuleFunction` runs it: its non-tensor arguments, and its passes
    over tensors (x, W, ... : the first `n_grads` may take gradients; every one is saved).

    `forward(tensors, need)` -> (outputs, saved, formed): the outputs (a tuple), the tensors
    the backward pass reads, and the gradients for an upstream gradient of 1 where the call
    formed them in the forward pass (else None). `backward(tensors, saved, grad_outputs,
    need)` -> the n_grads gradients (None where not needed). `plan`: the call's BlockPlan,
    which both passes block by (`RuleFunction` gives each recorded call its own
    `head.KeptLogits` there)."""

    n_grads = 3
    non_differentiable: tuple = ()  # indices of outputs without a gradient
    second_order = False  # the backward pass is plain PyTorch that autograd may record
    kernels = True  # the kernels formed the gradients (scaled by the fp32 kernel)
    message = "logitless: this loss gives first-order gradients only"
    recording = True  # autograd records the call (`apply` sets it)
    replan = None  # (x) -> the fields of the backward pass's own plan (`choose_again`)

    def forward(self, tensors, need):
        raise NotImplementedError

    def backward(self, tensors, saved, grad_outputs, need):
        raise NotImplementedError


def choose_again(call: Call, plan_fields) -> Call:
    """Make an "auto" call choose its strategy again in a backward pass that recomputes: the
    gradient buffers are allocated there, and the memory free then is what they must fit
    (other forward passes may have run in between). plan_fields(x) -> the fields of the
    (dataclass) call that the choice sets, e.g. {"plan": ..., "ops": ...}, for the saved
    input x. Gradients formed in the forward pass are not recomputed. plan_fields must hold no
    tensor of the call (it lives as long as the graph) and not the call itself (a cycle)."""
    call.replan = plan_fields
    return call


def apply(call: Call, *tensors):
    """`RuleFunction.apply`; where autograd does not record (torch.no_grad), the call forms
    no gradient (a Function's forward pass is told which inputs require one, not whether
    anything records)."""
    call.recording = torch.is_grad_enabled()
    return RuleFunction.apply(call, *tensors)


class RuleFunction(torch.autograd.Function):
    """apply(call, *tensors): every loss's autograd Function. Gradients formed in the forward
    pass are scaled by the upstream gradient (in fp32) in the first backward pass; a later
    one (retain_graph) recomputes. The backward pass is first-order unless the call says
    otherwise (under create_graph its gradients then carry `SecondOrderUnsupported`)."""

    @staticmethod
    def forward(ctx, call: Call, *tensors):
        need = ctx.needs_input_grad[1 : 1 + call.n_grads] if call.recording else (False,) * call.n_grads
        if any(need):  # where the engine may keep the logits for the backward pass
            call.plan = dataclasses.replace(call.plan, kept=KeptLogits())
        outputs, saved, formed = call.forward(tensors, need)
        ctx.call, ctx.formed, ctx.n_tensors = call, formed, len(tensors)
        ctx.save_for_backward(*tensors, *saved)
        ctx.mark_non_differentiable(*(outputs[i] for i in call.non_differentiable))
        ctx.set_materialize_grads(False)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, *grad_outputs):
        call = ctx.call
        if call.second_order:
            grads = RuleFunction._backward(ctx, *grad_outputs)
        else:
            grads = first_order_only(ctx, RuleFunction._backward, *grad_outputs, message=call.message)
        return (None, *grads) + (None,) * (ctx.n_tensors - call.n_grads)

    @staticmethod
    def _backward(ctx, *grad_outputs):
        call = ctx.call
        if all(g is None for g in grad_outputs):
            return (None,) * call.n_grads
        if ctx.formed is not None:  # the first backward of gradients formed in the forward pass
            grads, ctx.formed = ctx.formed, None
            return scale_formed(grads, grad_outputs[0], kernels=call.kernels)
        saved = ctx.saved_tensors
        kept = call.plan.kept
        if kept is not None and kept.z is None:  # nothing kept: no pass of this backward keeps any
            kept.spent = True
        if call.replan is not None and (kept is None or kept.z is None):  # the copy's replan is the class's None
            call = dataclasses.replace(call, **call.replan(saved[0]))
        return tuple(call.backward(saved[: ctx.n_tensors], saved[ctx.n_tensors :], grad_outputs,
                                   ctx.needs_input_grad[1 : 1 + call.n_grads]))
