"""`linear_log_probs` for PyTorch: per-token log-probabilities of the targets, the entropy and
the argmax of the softmax at a temperature, without the N x V logits (interop/SPEC.md,
"Log-probabilities"): what RL and preference losses (GRPO, PPO, DPO) read from a policy.

The block loop of cross-entropy's fallback (`torch_impl.stepped`) with the "log_prob" steps
of `torch_impl.steps`: on the Triton kernels (`speed`: blocks of whole rows; `memory`: blocks
of rows and vocabulary columns) or in PyTorch ops (`chunked`). The forward pass merges each
block of logits into per-row running statistics (max, sum of exponentials, their u-weighted
sum, the largest logit and its column, the target's logit) and keeps lse and the entropy; the
backward pass recomputes each block and turns the upstream gradients of the log-probabilities
and of the entropy into dz, whose products give grad_input and grad_weight (accumulated as
cross-entropy's strategies accumulate it). Nothing is computed in the forward pass for the
backward: the upstream gradients are not known then. `forward_with_grads` serves a loss whose
upstream gradients each row's own values decide (`torch_impl.policy_loss`): it forms them in
the forward pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from interop.log_probs import LogProbsOptions
from interop.options import check_tuning
from interop.tuning import Tuning
from torch_impl import custom_ops, log_probs_ops
from torch_impl.arguments import autocast_inputs, check_tensors, dense
from torch_impl.autograd import first_order_only
from torch_impl.blocks import BlockPlan, HeadBlocks, final_grad
from torch_impl.distill_blocked import dx_rows, store_dx_rows
from torch_impl.functional import (check_target_range, choose_strategy, head_slice, runs_compiled, split_operands,
                                  whole_input)
from torch_impl.rows import compute_dtype
from torch_impl.steps import TorchOps, plan_steps
from torch_impl.vocab_parallel import VocabSplit, call_fingerprint, local_targets

SECOND_ORDER_MESSAGE = "logitless: linear_log_probs gives first-order gradients only"


def _blocks(x_ND, W, b_V, layout: str, plan: BlockPlan, ops, active=None) -> HeadBlocks:
    return HeadBlocks(x_ND, W, b_V, layout, plan, logits_dtype=compute_dtype(x_ND.dtype) if ops is TorchOps else None,
                      active=active)


def _target_rows(y_N, o: LogProbsOptions, vocab: int):
    """(valid, in_range), bool [N]: the target is not ignore_index; it is a class."""
    return y_N != o.ignore_index, (y_N >= 0) & (y_N < vocab)


def _running(n: int, wide, dev):
    """Per-row statistics before any column: (m, l, a, largest u, its column, u at the target)."""
    m, best = (torch.full((n,), -torch.inf, dtype=wide, device=dev) for _ in range(2))
    l, a, u_y = (torch.zeros(n, dtype=wide, device=dev) for _ in range(3))
    return m, l, a, best, torch.zeros(n, dtype=torch.int64, device=dev), u_y


def _outputs(running, valid, in_range):
    """(log-probabilities, entropy, lse) of rows' merged statistics."""
    m, l, a, _, _, u_y = running
    # lse = m + log l; with E[u] = m + a / l, H = lse - E[u] = log l - a / l: two small
    # terms, where lse and E[u] of a peaked row are large and nearly equal.
    lse, entropy = m + torch.log(l), torch.log(l) - a / l
    logp = torch.where(valid, torch.where(in_range, u_y - lse, torch.full_like(lse, torch.nan)), torch.zeros_like(lse))
    return logp, entropy, lse


def _upstream(g, valid, in_range):
    """The log-probabilities' upstream gradient as the steps take it: 0 where ignored, NaN
    where the target is out of range."""
    return torch.where(valid, torch.where(in_range, g, torch.full_like(g, torch.nan)), torch.zeros_like(g)).contiguous()


def _combine(running, split: VocabSplit | None, last_class: int):
    """Each row's statistics (`_running`) over every rank's classes: this rank's own without
    a split; else (m, l, a) merged as `steps._merge` merges two column blocks, the largest u
    (a NaN first) and its first global column, and u at the target, in three collectives of
    a few numbers per row (never logits). A NaN or +inf logit on any rank makes the row's m
    NaN, as on one device. last_class: the global class count, above any column (some rank
    always holds the row's largest u; a row all -inf has column 0 on every rank, as on one
    device)."""
    if split is None:
        return running
    m, l, a, best, idx, u_y = running
    broken = torch.isnan(m) | torch.isnan(l) | torch.isnan(a)
    best_nan = torch.isnan(best)
    top = torch.stack([torch.where(broken, -torch.inf, m), torch.where(best_nan, -torch.inf, best)])
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=split.group)
    m_all, best_all = top.unbind(0)
    shift = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    seen = (m != -torch.inf) & ~broken
    f = torch.where(seen, torch.exp(torch.where(seen, m - shift, 0.0)), 0.0)
    sums = torch.stack([f * l, f * (a + l * torch.where(seen, m - shift, 0.0)), broken.to(m.dtype),
                        best_nan.to(m.dtype), u_y])
    dist.all_reduce(sums, group=split.group)
    l_all, a_all, broken_all, nan_all, u_y_all = sums.unbind(0)
    m_all = torch.where(broken_all > 0, torch.nan, torch.where(torch.isfinite(m_all), shift, m_all))
    mine = torch.where(nan_all > 0, best_nan, best == best_all)
    col = torch.where(mine, idx + split.first, last_class)
    dist.all_reduce(col, op=dist.ReduceOp.MIN, group=split.group)
    best_all = torch.where(nan_all > 0, torch.nan, best_all)
    return m_all, l_all, a_all, best_all, col, u_y_all


def _columns(y_N, split: VocabSplit | None, local_vocab: int):
    """The targets as the kernels read them: y itself, or with a split this rank's columns."""
    return y_N if split is None else local_targets(y_N, split.first, local_vocab)


def forward(x, W, b_V, y_N, o: LogProbsOptions, layout: str, plan: BlockPlan, ops, active=None,
            split: VocabSplit | None = None):
    """(log-probabilities [N], entropy [N], argmax [N] int64, lse [N]) over flattened rows x
    [N, D], the head W, its bias and targets y [N] (int64); log-probabilities, entropy and
    lse in the compute dtype (fp32, fp64 for fp64). A target outside [0, V) that is not
    ignore_index gives NaN. active: as for `forward_with_grads` (every output over [A]).
    split: a head split over the vocabulary (W, b this rank's classes; y global): the rows'
    statistics are combined over the ranks (`_combine`)."""
    x_ND = x if split is None else split.whole_rows(x)
    blocks = _blocks(x_ND, W, b_V, layout, plan, ops, active)
    vocab = blocks.vocab if split is None else split.vocab
    y_cols = _columns(y_N, split, blocks.vocab)
    running = _running(blocks.n_rows, compute_dtype(x_ND.dtype), x_ND.device)
    for rs in blocks.row_blocks():
        for v0, cols in blocks.col_blocks():
            ops.log_prob_stats_(blocks.logits(rs, v0, cols), v0, b_V, y_cols[rs], tuple(r[rs] for r in running),
                                o.softcap, 1.0 / o.temperature)
    running = _combine(running, split, vocab)
    logp, entropy, lse = _outputs(running, *_target_rows(y_N, o, vocab))
    return logp, entropy, running[4], lse


def forward_with_grads(x, W, b_V, y_N, o: LogProbsOptions, layout: str, plan: BlockPlan, ops, upstream,
                       need=(True, True, True), active=None, split: VocabSplit | None = None):
    """(log-probabilities, entropy, dx, dW, db) with the gradients formed in the forward pass,
    for upstream gradients that each row's log-probability and entropy decide:
    upstream(rs, logp_R, entropy_R) -> (g_R, g_h_R or None) for the rows rs. Each row block's
    statistics come first (with a split, combined over the ranks), then its dz from the same
    logits: blocks of whole rows, one product each (6 N D V flops in all). active: int64 [A],
    the only rows of x computed (y_N, the outputs and rs are then over those [A]; the other
    rows of dx are 0), or None."""
    x_ND = x if split is None else split.whole_rows(x)
    wide = compute_dtype(x_ND.dtype)
    blocks = _blocks(x_ND, W, b_V, layout, plan, ops, active)
    assert blocks.whole_rows, "gradients in the forward pass need whole rows"
    vocab = blocks.vocab if split is None else split.vocab
    valid, in_range = _target_rows(y_N, o, vocab)
    y_cols = _columns(y_N, split, blocks.vocab)
    logp, entropy = (torch.empty(blocks.n_rows, dtype=wide, device=x_ND.device) for _ in range(2))
    dx, dx_acc, dW, db = blocks.gradient_buffers(*need, wide_dx=split is not None)
    for rs in blocks.row_blocks():
        running = _running(rs.stop - rs.start, wide, x_ND.device)
        z = blocks.logits(rs, 0, blocks.vocab)
        ops.log_prob_stats_(z, 0, b_V, y_cols[rs], running, o.softcap, 1.0 / o.temperature)
        logp[rs], entropy[rs], lse = _outputs(_combine(running, split, vocab), valid[rs], in_range[rs])
        g, g_h = upstream(rs, logp[rs], entropy[rs])
        g, g_h = _upstream(g.to(wide), valid[rs], in_range[rs]), None if g_h is None else g_h.to(wide).contiguous()
        dx_out = dx_rows(blocks, dx, dx_acc, rs)
        dz = ops.log_prob_grad(z, 0, b_V, y_cols[rs], lse, entropy[rs], g, g_h, o.softcap, 1.0 / o.temperature)
        blocks.add_grads(dz, rs, 0, blocks.vocab, dx_out, dW, db)
        store_dx_rows(blocks, dx, dx_acc, dx_out, rs)
    z = dz = blocks = dx_acc = None
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return logp, entropy, dx, final_grad(dW, W), final_grad(db, b_V)


def backward(grad_logp, grad_entropy, x, W, b_V, y_N, lse, entropy, o: LogProbsOptions, layout: str, plan: BlockPlan,
             ops, need=(True, True, True), active=None, split: VocabSplit | None = None):
    """(dx, dW, db) for the upstream gradients of `forward`'s log-probabilities and entropy
    ([N] each, or None), recomputing the logits block by block; None where `need` (x, W, b)
    is not set. active and split: as for `forward_with_grads` (with a split, grad_input is
    summed over the ranks in fp32)."""
    x_ND = x if split is None else split.whole_rows(x)
    wide = lse.dtype
    blocks = _blocks(x_ND, W, b_V, layout, plan, ops, active)
    valid, in_range = _target_rows(y_N, o, blocks.vocab if split is None else split.vocab)
    y_cols = _columns(y_N, split, blocks.vocab)
    g = _upstream(torch.zeros_like(lse) if grad_logp is None else grad_logp.to(wide), valid, in_range)
    g_h = None if grad_entropy is None else grad_entropy.to(wide).contiguous()
    # grad_input as the distillation losses form it: a row block's rows written once, or
    # with partial rows summed over the column blocks in an fp32 accumulator of one row block
    dx, dx_acc, dW, db = blocks.gradient_buffers(*need, wide_dx=split is not None)
    for rs in blocks.row_blocks():
        dx_out = dx_rows(blocks, dx, dx_acc, rs)
        for v0, cols in blocks.col_blocks():
            dz = ops.log_prob_grad(blocks.logits(rs, v0, cols), v0, b_V, y_cols[rs], lse[rs], entropy[rs], g[rs],
                                   None if g_h is None else g_h[rs], o.softcap, 1.0 / o.temperature)
            blocks.add_grads(dz, rs, v0, cols, dx_out, dW, db, dx_accumulate=dx_acc is not None)
        store_dx_rows(blocks, dx, dx_acc, dx_out, rs)
    dz = blocks = dx_acc = None
    if dx is not None and split is not None:
        dx = split.sum_grad_input(dx, x)
    return dx, final_grad(dW, W), final_grad(db, b_V)


class LinearLogProbs(torch.autograd.Function):
    """`forward` and `backward` as an autograd Function; returns (log-probabilities,
    entropy, argmax)."""

    @staticmethod
    def forward(ctx, x_ND, W, b_V, y_N, o: LogProbsOptions, layout: str, plan: BlockPlan, ops, split):
        logp, entropy, argmax, lse = forward(x_ND, W, b_V, y_N, o, layout, plan, ops, split=split)
        ctx.save_for_backward(x_ND, W, b_V, y_N, lse, entropy)
        ctx.args = (o, layout, plan, ops)
        ctx.split = split
        ctx.mark_non_differentiable(argmax)
        ctx.set_materialize_grads(False)
        return logp, entropy, argmax

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _):
        return first_order_only(ctx, LinearLogProbs._backward, grad_logp, grad_entropy, message=SECOND_ORDER_MESSAGE)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        none = (None,) * 6
        if grad_logp is None and grad_entropy is None:
            return (None, None, None) + none
        return backward(grad_logp, grad_entropy, *ctx.saved_tensors, *ctx.args, ctx.needs_input_grad[:3],
                        split=ctx.split) + none


def linear_log_probs(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int | None = -100,
    return_entropy: bool = False,
    return_argmax: bool = False,
    weight_layout: str = "VD",
    strategy: str = "auto",
    accumulate_in_input_dtype: bool = False,
    tuning: Tuning | None = None,
    vocab_parallel=None,
    sequence_parallel: bool = False,
):
    """Per-token log p(target) at a temperature, and on request the entropy and argmax.

    With s = softcap(input @ W^T + b) and u = s / temperature: log_softmax(u) at the target,
    the entropy of softmax(u), argmax_j u_j; never the N x V logits.

    Args:
        input: [..., D] hidden states (bf16/fp16/fp32/fp64).
        linear_weight: [V, D] ("VD") or [D, V] ("DV"), the input's dtype.
        target: [...] integer token ids; rows with ignore_index get log-probability 0
            (and no gradient from it); another id outside [0, V) raises ValueError.
        linear_bias: optional [V]. softcap: c > 0 for c * tanh(z / c), before the temperature.
        temperature: T > 0 (the sampling temperature of the rollouts, as TRL and verl divide
            the logits by it).
        return_entropy: also return the entropy [...] of every row (ignored rows too: it
            does not depend on the target), differentiable.
        return_argmax: also return argmax [...] (int64; the first of equal maxima; a row
            holding NaN gives a NaN's index), e.g. for token accuracy.
        weight_layout, accumulate_in_input_dtype, tuning: as for linear_cross_entropy.
        strategy: "auto", "speed", "memory" or "chunked", as for linear_cross_entropy
            (its backward pass recomputes the logits: 8 N D V flops).
        vocab_parallel: a process group over which the head is split by vocabulary, as for
            linear_cross_entropy (this rank's linear_weight and linear_bias hold its slice of
            the classes; input and the global targets are the same on every rank). The ranks
            exchange a few statistics per row, never logits; every output is global,
            grad_weight this rank's slice, grad_input the full gradient (all-reduced). A
            DTensor head sharded on its vocabulary, with a DTensor input, is split the same way.
        sequence_parallel: with vocab_parallel, input holds this rank's part of the rows, as
            for linear_cross_entropy (target the whole rows; every output the whole rows').

    Returns:
        log-probabilities [...] in fp32 (fp64 for fp64 input); with return_entropy and/or
        return_argmax, the tuple (log_probs, entropy, argmax) of those asked for. Gradients
        of any function of log-probabilities and entropy flow to input, linear_weight and
        linear_bias (grad_weight accumulated as by linear_cross_entropy's strategy).

    Inside torch.compile the call is the custom op ``logitless::linear_log_probs`` (as
    linear_cross_entropy's): a bad target there gives a NaN log-probability instead of
    raising; a split head (vocab_parallel, sequence_parallel, DTensors) runs as one eager step
    there (a graph break).
    """
    kwargs = dict(linear_bias=linear_bias, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
                  weight_layout=weight_layout, strategy=strategy, accumulate_in_input_dtype=accumulate_in_input_dtype)
    if runs_compiled(vocab_parallel, sequence_parallel, input, linear_weight, linear_bias):
        input, linear_weight, linear_bias = custom_ops.compiled_call(
            input, dict(linear_weight=linear_weight, target=target), dict(linear_bias=linear_bias), "none", None,
            linear_weight, linear_bias)
        outs = log_probs_ops.linear_log_probs(input, linear_weight, target, **{**kwargs, "linear_bias": linear_bias},
                                           tuning=check_tuning(tuning))
    else:
        outs = _eager(input, linear_weight, target, **kwargs, tuning=tuning, vocab_parallel=vocab_parallel,
                      sequence_parallel=sequence_parallel)
    asked = [outs[0]] + [t for t, want in zip(outs[1:], (return_entropy, return_argmax)) if want]
    return asked[0] if len(asked) == 1 else tuple(asked)


@torch.compiler.disable
def _eager(input, linear_weight, target, *, linear_bias, temperature, softcap, ignore_index, weight_layout, strategy,
           accumulate_in_input_dtype, tuning, vocab_parallel, sequence_parallel):
    """(log-probabilities, entropy, argmax), each shaped as target, of an eager call."""
    ((input, linear_weight, linear_bias),), vocab_parallel, rows_dim = split_operands(
        vocab_parallel, sequence_parallel, weight_layout, (input, linear_weight, linear_bias))
    check_tensors(input, dict(linear_weight=linear_weight, target=target), dict(linear_bias=linear_bias))
    input, linear_weight, linear_bias = autocast_inputs(input, linear_weight, linear_bias)
    tuning = check_tuning(tuning)
    checked = lambda: log_probs_ops.log_probs_checked(whole_input(input, rows_dim, vocab_parallel), linear_weight, target,
                                                      linear_bias, temperature, softcap, ignore_index, weight_layout,
                                                      strategy)
    split = None if vocab_parallel is None else head_slice(vocab_parallel, lambda: checked()[1], input.device, call_fingerprint(
        temperature, softcap, ignore_index, weight_layout, strategy, accumulate_in_input_dtype, tuning, input.dtype,
        linear_bias is None, torch.is_grad_enabled(), input.requires_grad, linear_weight.requires_grad,
        linear_bias is not None and linear_bias.requires_grad), rows_dim=rows_dim)
    o, shape = checked()
    y_N = dense(target.reshape(shape.n_rows)).to(torch.int64)
    check_target_range(y_N, shape.vocab if split is None else split.vocab, o.ignore_index)
    x_ND = input.reshape(shape.n_rows, shape.hidden) if rows_dim is None else input  # a part: the loops gather
    plan_vocab = shape.vocab if split is None else split.largest  # every rank plans the same blocks
    strategy = choose_strategy(strategy, x_ND, shape.n_rows, shape.hidden, plan_vocab, tuning, speed_pays=False)
    plan, ops = plan_steps(tuning, strategy, shape.n_rows, shape.hidden, plan_vocab, x_ND.dtype,
                           accumulate_in_input_dtype)
    logp, entropy, argmax = LinearLogProbs.apply(x_ND, linear_weight, dense(linear_bias), y_N, o, weight_layout, plan,
                                                 ops, split)
    return tuple(t.reshape(shape.lead_shape) for t in (logp, entropy, argmax))
