"""`linear_policy_loss` for PyTorch: the clipped policy-gradient loss of PPO and GRPO (with a
KL to a reference policy and an entropy bonus) on a linear head, without the N x V logits
(interop/SPEC.md, "Policy loss").

The loss of each token is a function of its log-probability and entropy
(`interop.policy_loss.token_terms`), so, unlike `linear_log_probs`, its upstream gradients
are known as soon as a row block's statistics are: "speed" forms the gradients in the
forward pass from one product per block of whole rows (`log_probs_rule.forward_with_grads`, 6 N D V
flops, as cross-entropy's "speed"), and the backward pass only scales them. "memory" and
"chunked" keep the forward pass's log-probabilities and entropy and recompute the logits in the
backward pass (`log_probs_rule.backward`, 8 N D V flops), holding no gradient between the passes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from interop.log_probs import LogProbsOptions
from interop.options import check_flags, check_inputs, check_strategy, check_tuning
from interop.policy_loss import (TOKEN_ARGUMENTS, PolicyLossOptions, check_token_argument, mean_weight, token_stats,
                                 token_terms)
from interop.tuning import Tuning
from torch_impl import custom_ops, engine, log_probs, log_probs_rule
from torch_impl.arguments import autocast_inputs, check_tensors, dense, indices
from torch_impl.head import BlockPlan
from torch_impl.custom_ops import dtype_of, optional_shape
from torch_impl.functional import (check_target_range, head_slice, runs_compiled, split_operands,
                                  valid_rows_only, whole_input)
from torch_impl.rows import compute_dtype
from torch_impl.steps import choose_strategy, plan_steps
from torch_impl.vocab_parallel import call_fingerprint

SECOND_ORDER_MESSAGE = "logitless: linear_policy_loss gives first-order gradients only"


def _terms(o: PolicyLossOptions, tokens, rs, logp, entropy, valid):
    """token_terms over rows rs of the per-token tensors ([N] each, or None; TOKEN_ARGUMENTS' order)."""
    return token_terms(torch, o, logp, entropy, valid[rs], *(None if v is None else v[rs] for v in tokens))


@dataclasses.dataclass
class PolicyCall(engine.Call):
    """The loss on tensors (x [N, D], W, bias, targets y [N] (int64), then the per-token
    tensors in TOKEN_ARGUMENTS' order, [N] in the compute dtype, or None); outputs the loss
    (0-d, fp32, fp64 for fp64 inputs), and the rows' log-probabilities and entropy (no
    gradient). With `active` (int64 [A]: the tokens not ignored)
    only those rows are computed, and y and the per-token tensors are [A]. "speed" forms the
    gradients in the forward pass; a later backward pass (retain_graph) recomputes. The
    per-token tensors are saved as the inputs are (changed in place before the backward
    pass, they raise)."""

    o: PolicyLossOptions
    head: LogProbsOptions
    layout: str
    plan: BlockPlan
    ops: type
    active: torch.Tensor | None
    split: object
    non_differentiable = (1, 2)
    message = SECOND_ORDER_MESSAGE

    def _logp(self, x, W, b, y):
        """(log-probabilities, entropy, lse) of the rows, the statistics only."""
        logp, entropy, _, lse = log_probs_rule.forward(x, W, b, y, self.head, self.layout, self.plan, self.ops,
                                                       self.active, self.split)
        return logp, entropy, lse

    def forward(self, tensors, need):
        (x, W, b, y), tokens = tensors[:4], tensors[4:]
        valid = y != self.head.ignore_index
        grads = lse = None
        if any(need) and self.plan.strategy == "speed":
            upstream = lambda rs, logp, entropy: _terms(self.o, tokens, rs, logp, entropy, valid)[1:]
            logp, entropy, *grads = log_probs_rule.forward_with_grads(x, W, b, y, self.head, self.layout, self.plan,
                                                                      self.ops, upstream, need, self.active, self.split)
        else:
            logp, entropy, lse = self._logp(x, W, b, y)
        loss = _terms(self.o, tokens, slice(None), logp, entropy, valid)[0].sum()
        return (loss, logp, entropy), (logp, entropy, lse), grads

    def backward(self, tensors, saved, grad_outputs, need):
        (x, W, b, y), tokens = tensors[:4], tensors[4:]
        (logp, entropy, lse), grad_loss = saved, grad_outputs[0]
        _, g, g_h = _terms(self.o, tokens, slice(None), logp, entropy, y != self.head.ignore_index)
        g, g_h = g * grad_loss, None if g_h is None else g_h * grad_loss
        if lse is None:  # a later backward of "speed": the statistics again
            _, entropy, lse = self._logp(x, W, b, y)
        return log_probs_rule.backward(g, g_h, x, W, b, y, lse, entropy, self.head, self.layout, self.plan, self.ops,
                                       need, self.active, self.split)


def _per_token(name: str, t, shape, input, wide):
    """A per-token argument as [N] in the compute dtype: a tensor, a NumPy array or a number
    that broadcasts to the target's shape (`check_token_argument`'s TypeError for other
    types; ValueError naming it for another shape or an integer dtype)."""
    check_token_argument(name, t, (torch.Tensor, np.ndarray))
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t, dtype=wide, device=input.device)
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    try:
        return dense(torch.broadcast_to(t.detach().to(wide), shape).reshape(-1))
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to the target's shape {tuple(shape)} "
                         "(a per-sequence advantage [B] of targets [B, T] is advantages[:, None])") from None


def linear_policy_loss(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    advantages,
    *,
    old_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    token_weight: torch.Tensor | None = None,
    policy_weight: torch.Tensor | None = None,
    kl_weight: torch.Tensor | None = None,
    entropy_weight: torch.Tensor | None = None,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    clip_ratio_c: float | None = None,
    kl_bias_correction: bool = False,
    linear_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int | None = -100,
    weight_layout: str = "VD",
    strategy: str = "auto",
    accumulate_in_input_dtype: bool = False,
    tuning: Tuning | None = None,
    vocab_parallel=None,
    sequence_parallel: bool = False,
    return_stats: bool = False,
):
    """The clipped policy-gradient loss (PPO, GRPO) of the policy softmax(u), u = softcap(input
    @ W^T + b) / temperature, over the tokens `target`, without the N x V logits.

    Per token, with logp its log-probability, H the entropy, r = exp(logp - old_log_probs):

        w v P + w_kl beta K - w_h entropy_coef H,   P = -min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A),
        K = exp(ref - logp) - (ref - logp) - 1 (times r with kl_bias_correction),

    P at most -clip_ratio_c A where A < 0 (dual-clip, when set), summed over the tokens
    whose target is not ignore_index (TRL's GRPOTrainer and verl compute these terms).

    Args:
        input: [..., D] hidden states (bf16/fp16/fp32/fp64); linear_weight: [V, D] ("VD") or
            [D, V] ("DV"); target: [...] the sampled token ids (ignore_index for prompt and
            padding positions).
        advantages: A, broadcast to the target's shape (a number, per sequence [B, 1] for
            targets [B, T], or per token).
        old_log_probs: the sampling policy's log-probabilities (target's shape); None: the
            policy itself, detached (on-policy: r = 1).
        ref_log_probs: the reference policy's, needed when beta > 0.
        token_weight: w (target's shape), e.g. a mask over each sequence's length for GRPO's
            per-sequence mean; None: 1 / (the tokens not ignored, at least 1), a mean over
            the call's tokens (DAPO, TRL's "bnpo"). Rows split over ranks or devices
            (data parallel, shard_map) average their own tokens: for a mean over the global
            batch pass 1 / its token count (as num_items_in_batch does for cross-entropy).
        policy_weight: v (target's shape, floating), a factor of the policy term only:
            TRL's importance-sampling correction of vLLM's rollouts, an entropy or
            off-policy mask as 0.0 / 1.0 (their product); None: 1. Unlike verl, the log
            ratio is not clamped to [-20, 20].
        kl_weight, entropy_weight: w_kl and w_h (target's shape, floating), the KL's and the
            entropy's own token weights, for a trainer that averages those terms otherwise
            than the policy term; None: w.
        epsilon_low, epsilon_high, beta, entropy_coef: as in the formula (each >= 0,
            epsilon_low < 1).
        clip_ratio_c: dual-clip's bound (verl's clip_ratio_c, > 1); None: none.
        kl_bias_correction: the KL term times r (TRL's use_bias_correction_kl).
        linear_bias, temperature, softcap, ignore_index, weight_layout, strategy,
        accumulate_in_input_dtype, tuning, vocab_parallel, sequence_parallel: as for
        linear_log_probs (the per-token tensors hold the whole rows); "speed"
        forms the gradients in the forward pass (6 N D V flops, as a loss on materialised
        logits; with vocab_parallel 6 N D V / P on each of the P ranks).
        return_stats: also return the per-token values trainers log, at no extra pass.

    Returns:
        the loss, 0-d, fp32 (fp64 for fp64 input), differentiable in input, linear_weight and
        linear_bias (not in the per-token tensors, as RL trainers treat them); with
        return_stats, (loss, stats): a dict of tensors of the target's shape, without
        gradient, 0 / False where ignored: "log_probs", "entropy", "ratio" (r), "kl" (K,
        when ref_log_probs is given), "clipped_low" / "clipped_high" (bool: the tokens whose
        clip removed the gradient, r < 1 - epsilon_low where A < 0 / r > 1 + epsilon_high
        where A > 0), "dual_clipped" (bool, when clip_ratio_c is set).

    Inside torch.compile the call is linear_log_probs' custom op followed by the token
    terms as traced tensor operations, their gradients those of the eager call (the model
    compiles whole, ``fullgraph=True``): "speed" there recomputes the logits in the backward
    pass as "memory" does (8 N D V flops); a bad target gives a NaN loss instead of raising.
    With vocab_parallel it runs as one eager step (a graph break).
    """
    check_flags(return_stats=return_stats, accumulate_in_input_dtype=accumulate_in_input_dtype, sequence_parallel=sequence_parallel)
    kwargs = dict(old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, token_weight=token_weight,
                  policy_weight=policy_weight, kl_weight=kl_weight, entropy_weight=entropy_weight,
                  epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
                  entropy_coef=entropy_coef, clip_ratio_c=clip_ratio_c, kl_bias_correction=kl_bias_correction,
                  linear_bias=linear_bias, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
                  weight_layout=weight_layout, strategy=strategy, accumulate_in_input_dtype=accumulate_in_input_dtype,
                  tuning=tuning, return_stats=return_stats)
    if runs_compiled(vocab_parallel, sequence_parallel, input, linear_weight, linear_bias):
        return _compiled(input, linear_weight, target, advantages, **kwargs)
    return _eager(input, linear_weight, target, advantages, **kwargs, vocab_parallel=vocab_parallel,
                  sequence_parallel=sequence_parallel)


def _tensor_arguments(linear_bias, given: dict) -> dict:
    """The optional tensor arguments by name, for check_tensors (a number advantage is none)."""
    return dict(linear_bias=linear_bias, **{k: v for k, v in given.items() if isinstance(v, torch.Tensor)})


def _with_gradients(total, pairs):
    """total (the loss, a value) with the gradients d total / d t = g for each (g, t) of
    pairs (g None: none): the token terms' own derivatives, which autograd of their formula
    would not give (on-policy, r is 1 with derivative r). Each adds g (t - t) (0, or NaN
    where g is, as the loss then is); at an infinite t (a target of probability 0) none."""
    for g, t in pairs:
        if g is not None:
            total = total + (g.detach() * torch.where(torch.isfinite(t.detach()), t - t.detach(), 0)).sum()
    return total


def _compiled(input, linear_weight, target, advantages, *, old_log_probs, ref_log_probs, token_weight, policy_weight,
              kl_weight, entropy_weight, epsilon_low, epsilon_high, beta, entropy_coef, clip_ratio_c, kl_bias_correction,
              linear_bias, temperature, softcap, ignore_index, weight_layout, strategy, accumulate_in_input_dtype, tuning,
              return_stats):
    """The call inside torch.compile: `log_probs.compiled`'s op (which checks the head's arguments when
    traced), then `token_terms`."""
    o = PolicyLossOptions(epsilon_low, epsilon_high, beta, entropy_coef, clip_ratio_c, kl_bias_correction)
    o.check_references(ref_log_probs)
    given = dict(advantages=advantages, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                 token_weight=token_weight, policy_weight=policy_weight, kl_weight=kl_weight,
                 entropy_weight=entropy_weight)
    input, linear_weight, linear_bias = custom_ops.compiled_call(
        input, dict(linear_weight=linear_weight, target=target), _tensor_arguments(linear_bias, given), "none", None, linear_weight, linear_bias)
    ignore_index = LogProbsOptions(temperature, softcap, ignore_index).ignore_index
    logp, entropy, _ = log_probs.compiled(
        input, linear_weight, target, linear_bias=linear_bias, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, weight_layout=weight_layout, strategy=strategy,
        accumulate_in_input_dtype=accumulate_in_input_dtype, tuning=tuning)
    logp, entropy = logp.reshape(-1), entropy.reshape(-1)
    tokens = {k: _per_token(k, given[k], target.shape, input, logp.dtype) for k in TOKEN_ARGUMENTS}
    valid = indices(target.reshape(-1)) != ignore_index
    if tokens["token_weight"] is None:
        tokens["token_weight"] = mean_weight(torch, valid, torch.zeros_like(logp))
    loss, g, g_h = token_terms(torch, o, logp.detach(), entropy.detach(), valid, *(tokens[k] for k in TOKEN_ARGUMENTS))
    loss = _with_gradients(loss.sum(), ((g, logp), (g_h, entropy)))
    return (loss, _stats(o, logp, entropy, valid, tokens, target.shape)) if return_stats else loss


def _stats(o: PolicyLossOptions, logp, entropy, valid, tokens: dict, shape) -> dict:
    """`token_stats` of the rows ([N] each; the per-token tensors by name), each of shape
    `shape`, without gradient."""
    stats = token_stats(torch, o, logp.detach(), entropy.detach(), valid, tokens["advantages"],
                        tokens["old_log_probs"], tokens["ref_log_probs"])
    return {k: v.reshape(shape) for k, v in stats.items()}


@torch.compiler.disable
def _eager(input, linear_weight, target, advantages, *, old_log_probs, ref_log_probs, token_weight, policy_weight,
           kl_weight, entropy_weight, epsilon_low, epsilon_high, beta, entropy_coef, clip_ratio_c, kl_bias_correction,
           linear_bias, temperature, softcap, ignore_index, weight_layout, strategy, accumulate_in_input_dtype, tuning,
           return_stats, vocab_parallel, sequence_parallel):
    """The eager call (and a split head's step in compiled code)."""
    ((input, linear_weight, linear_bias),), vocab_parallel, rows_dim = split_operands(
        vocab_parallel, sequence_parallel, weight_layout, (input, linear_weight, linear_bias))
    given = dict(advantages=advantages, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                 token_weight=token_weight, policy_weight=policy_weight, kl_weight=kl_weight,
                 entropy_weight=entropy_weight)
    check_tensors(input, dict(linear_weight=linear_weight, target=target), _tensor_arguments(linear_bias, given))
    input, linear_weight, linear_bias = autocast_inputs(input, linear_weight, linear_bias)
    tuning = check_tuning(tuning)
    wide = compute_dtype(input.dtype)
    tokens = {}

    def checked():
        """The call's (options, head options, shape), and the per-token tensors into `tokens`;
        ValueError where any is wrong (with a split, every rank learns of it)."""
        check_strategy(strategy)
        head = LogProbsOptions(temperature, softcap, ignore_index)
        o = PolicyLossOptions(epsilon_low, epsilon_high, beta, entropy_coef, clip_ratio_c, kl_bias_correction)
        o.check_references(ref_log_probs)
        shape = check_inputs(
            input_shape=tuple(whole_input(input, rows_dim, vocab_parallel).shape), input_dtype=dtype_of(input),
            weight_shape=tuple(linear_weight.shape), weight_dtype=dtype_of(linear_weight),
            target_shape=tuple(target.shape), target_dtype=dtype_of(target), bias_shape=optional_shape(linear_bias),
            bias_dtype=dtype_of(linear_bias), weight_layout=weight_layout)
        tokens.update({k: _per_token(k, given[k], target.shape, input, wide) for k in TOKEN_ARGUMENTS})
        return o, head, shape

    split = None
    if vocab_parallel is not None:
        # what decides the ranks' blocks and collectives, the same on every rank or an error on all
        fingerprint = call_fingerprint(epsilon_low, epsilon_high, beta, entropy_coef, clip_ratio_c, kl_bias_correction,
                                       temperature, softcap, ignore_index,
                                       weight_layout, strategy, accumulate_in_input_dtype, tuning, input.dtype,
                                       linear_bias is None, torch.is_grad_enabled(),
                                       *(t is not None and t.requires_grad for t in (input, linear_weight, linear_bias)),
                                       *(v is None for v in given.values()))
        split = head_slice(vocab_parallel, lambda: checked()[2], input.device, fingerprint,
                           lambda: target.ne(checked()[1].ignore_index).sum(), rows_dim)
    o, head, shape = checked()
    vocab = shape.vocab if split is None else split.vocab
    plan_vocab = shape.vocab if split is None else split.largest  # every rank plans the same blocks
    y_N = indices(dense(target.reshape(shape.n_rows)))
    check_target_range(y_N, vocab, head.ignore_index)
    valid = y_N != head.ignore_index
    if tokens["token_weight"] is None:
        tokens["token_weight"] = mean_weight(torch, valid, torch.zeros(valid.shape, dtype=wide, device=valid.device))
    x_ND = input.reshape(shape.n_rows, shape.hidden) if rows_dim is None else input  # a part: the loops gather
    choose = lambda x: choose_strategy(strategy, x, shape.n_rows, shape.hidden, plan_vocab, tuning, split)
    chosen = choose(x_ND)
    rows = valid_rows_only(tuning, chosen, valid, shape.hidden, plan_vocab)
    every_row = tokens
    if rows is not None:  # an ignored token adds nothing: the kernels compute only the others
        y_N, tokens = y_N[rows], {k: None if v is None else v[rows] for k, v in tokens.items()}
    n_kept, gathered, dtype = y_N.shape[0], rows is not None, x_ND.dtype  # values: the replan holds no tensor
    fields = lambda s: dict(zip(("plan", "ops"), plan_steps(
        tuning, "log_probs", s, n_kept, shape.hidden, plan_vocab, dtype, accumulate_in_input_dtype,
        gathered_rows=gathered, whole_vocab=None if split is None else split.vocab)))
    call = PolicyCall(o, head, weight_layout, **fields(chosen), active=rows, split=split)
    if strategy == "auto":
        engine.choose_again(call, lambda x: fields(choose(x)))
    loss, logp, entropy = engine.apply(call, x_ND, linear_weight, dense(linear_bias), y_N,
                                       *(tokens[k] for k in TOKEN_ARGUMENTS))
    if not return_stats:
        return loss
    if rows is not None:  # the rows computed, put back among all
        logp, entropy = (torch.zeros(valid.shape, dtype=t.dtype, device=t.device).index_copy_(0, rows, t)
                         for t in (logp, entropy))
    return loss, _stats(o, logp, entropy, valid, every_row, target.shape)
