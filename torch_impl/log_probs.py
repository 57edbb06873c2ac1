"""`linear_log_probs` for PyTorch: per-token log-probabilities of the targets, the entropy and
the argmax of the softmax at a temperature, without the N x V logits (interop/SPEC.md,
"Log-probabilities"): what RL and preference losses (GRPO, PPO, DPO) read from a policy.

Over blocks of whole rows (`torch_impl.blocks.HeadBlocks`, the "chunked" plan) each block's
logits are made in fp32 (fp64 for fp64 inputs), reduced to the per-row outputs and dropped;
the backward pass recomputes them and turns the upstream gradients of the log-probabilities
and of the entropy into dz (the same "multiple of p, multiple of p*u, one-hot" shape as
cross-entropy's), whose products give grad_input and an fp32 grad_weight.
"""

from __future__ import annotations

import torch

from interop.log_probs import LogProbsOptions, check_log_probs_strategy
from interop.options import check_inputs, check_tuning, target_out_of_range_message
from interop.tuning import Tuning
from torch_impl.arguments import check_tensors, dense
from torch_impl.autograd import first_order_only
from torch_impl.blocks import HeadBlocks, final_grad
from torch_impl.distillation import _autocast
from torch_impl.functional import dtype_name
from torch_impl.rows import compute_dtype
from torch_impl.steps import plan_steps

SECOND_ORDER_MESSAGE = "logitless: linear_log_probs gives first-order gradients only"


def _scaled(z, b_V, o: LogProbsOptions):
    """(s, u): the soft-capped logits with the bias, and u = s / T."""
    s = z if b_V is None else z + b_V.to(z.dtype)
    if o.softcap is not None:
        s = o.softcap * torch.tanh(s / o.softcap)
    return s, s / o.temperature


def _times_p(p, a):
    """p a, 0 where p is (a class masked by a -inf logit, whose log-probability is -inf:
    0 * -inf would be NaN)."""
    return torch.where(p == 0, torch.zeros_like(p), p * a)


class LinearLogProbs(torch.autograd.Function):
    """Over flattened rows x [N, D], the head W, its bias and targets y [N] (int64); returns
    (log-probabilities [N], entropy [N] or an empty tensor, argmax [N] int64) in the compute
    dtype (fp32, fp64 for fp64)."""

    @staticmethod
    def forward(ctx, x_ND, W, b_V, y_N, o: LogProbsOptions, layout: str, plan, with_entropy: bool):
        wide = compute_dtype(x_ND.dtype)
        blocks = HeadBlocks(x_ND, W, b_V, layout, plan, logits_dtype=wide)
        n, vocab = x_ND.shape[0], blocks.vocab
        valid, in_range = y_N != o.ignore_index, (y_N >= 0) & (y_N < vocab)
        safe_y = torch.where(in_range, y_N, torch.zeros_like(y_N))
        lse = torch.empty(n, dtype=wide, device=x_ND.device)
        logp, argmax = torch.empty_like(lse), torch.empty(n, dtype=torch.int64, device=x_ND.device)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        for rs in blocks.row_blocks():
            _, u = _scaled(blocks.logits(rs, 0, vocab), b_V, o)
            lse[rs] = torch.logsumexp(u, dim=1)
            argmax[rs] = u.argmax(dim=1)
            logp[rs] = u.gather(1, safe_y[rs, None])[:, 0] - lse[rs]
            if with_entropy:
                log_p = u - lse[rs, None]  # H = -sum p log p: no cancellation of lse against E[u]
                entropy[rs] = -_times_p(torch.exp(log_p), log_p).sum(1)
        logp = torch.where(valid, torch.where(in_range, logp, torch.full_like(logp, torch.nan)), torch.zeros_like(logp))
        ctx.save_for_backward(x_ND, W, b_V, y_N, lse)
        ctx.args = (o, layout, plan)
        ctx.mark_non_differentiable(argmax)
        ctx.set_materialize_grads(False)
        return logp, entropy, argmax

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _):
        return first_order_only(ctx, LinearLogProbs._backward, grad_logp, grad_entropy, message=SECOND_ORDER_MESSAGE)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        none = (None,) * 5
        if grad_logp is None and (grad_entropy is None or grad_entropy.numel() == 0):
            return (None, None, None) + none
        x_ND, W, b_V, y_N, lse = ctx.saved_tensors
        o, layout, plan = ctx.args
        wide = lse.dtype
        blocks = HeadBlocks(x_ND, W, b_V, layout, plan, logits_dtype=wide)
        vocab = blocks.vocab
        valid, in_range = y_N != o.ignore_index, (y_N >= 0) & (y_N < vocab)
        g_lp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(wide)
        g_lp = torch.where(valid, torch.where(in_range, g_lp, torch.full_like(g_lp, torch.nan)), torch.zeros_like(g_lp))
        g_H = None if grad_entropy is None or grad_entropy.numel() == 0 else grad_entropy.to(wide)
        safe_y = torch.where(in_range, y_N, torch.zeros_like(y_N))[:, None]
        need_x, need_W, need_b = ctx.needs_input_grad[:3]
        _, _, dW, db = blocks.gradient_buffers(False, need_W, need_b)
        dx = torch.empty_like(x_ND) if need_x else None
        for rs in blocks.row_blocks():
            s, u = _scaled(blocks.logits(rs, 0, vocab), b_V, o)
            log_p = u - lse[rs, None]
            p = torch.exp(log_p)
            du = -g_lp[rs, None] * p
            if g_H is not None:  # dH/du_j = -p_j (u_j - sum_k p_k u_k) = -p_j (log p_j + H)
                neg_H = _times_p(p, log_p).sum(1, keepdim=True)
                du -= g_H[rs, None] * _times_p(p, log_p - neg_H)
            du.scatter_add_(1, safe_y[rs], torch.where(in_range[rs], g_lp[rs], torch.zeros_like(g_lp[rs]))[:, None])
            dz = du / o.temperature
            if o.softcap is not None:
                dz = dz * (1 - (s / o.softcap) ** 2)
            blocks.add_grads(dz, rs, 0, vocab, None, dW, db)
            if need_x:
                dx[rs] = dz.to(W.dtype) @ blocks.head_cols(0, vocab)
        return (dx, final_grad(dW, W), final_grad(db, b_V)) + none


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
        strategy: "auto" or "chunked": blocks of whole rows in PyTorch ops.

    Returns:
        log-probabilities [...] in fp32 (fp64 for fp64 input); with return_entropy and/or
        return_argmax, the tuple (log_probs, entropy, argmax) of those asked for. Gradients
        of any function of log-probabilities and entropy flow to input, linear_weight and
        linear_bias (grad_weight accumulated in fp32 by default).
    """
    check_tensors(input, dict(linear_weight=linear_weight, target=target), dict(linear_bias=linear_bias))
    input, linear_weight, linear_bias = _autocast(input, linear_weight, linear_bias)
    o = LogProbsOptions(temperature, softcap, ignore_index)
    check_log_probs_strategy(strategy)
    tuning = check_tuning(tuning)
    shape = check_inputs(
        input_shape=tuple(input.shape), input_dtype=dtype_name(input.dtype), weight_shape=tuple(linear_weight.shape),
        weight_dtype=dtype_name(linear_weight.dtype), target_shape=tuple(target.shape),
        target_dtype=dtype_name(target.dtype), bias_shape=None if linear_bias is None else tuple(linear_bias.shape),
        bias_dtype=None if linear_bias is None else dtype_name(linear_bias.dtype), weight_layout=weight_layout)
    y_N = dense(target.reshape(shape.n_rows)).to(torch.int64)
    bad = (y_N != o.ignore_index) & ((y_N < 0) | (y_N >= shape.vocab))
    if bool(bad.any()):
        raise ValueError(target_out_of_range_message(int(y_N[bad][0]), shape.vocab, o.ignore_index))
    x_ND = input.reshape(shape.n_rows, shape.hidden)
    plan, _ = plan_steps(tuning, "chunked", shape.n_rows, shape.hidden, shape.vocab, x_ND.dtype, accumulate_in_input_dtype)
    logp, entropy, argmax = LinearLogProbs.apply(x_ND, linear_weight, dense(linear_bias), y_N, o, weight_layout, plan,
                                                 return_entropy)
    outs = [logp.reshape(shape.lead_shape)]
    if return_entropy:
        outs.append(entropy.reshape(shape.lead_shape))
    if return_argmax:
        outs.append(argmax.reshape(shape.lead_shape))
    return outs[0] if len(outs) == 1 else tuple(outs)
