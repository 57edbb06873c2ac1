"""`linear_log_probs` for PyTorch: per-token log-probabilities of the targets, the entropy and
the argmax of the softmax at a temperature, without the N x V logits (interop/SPEC.md,
"Log-probabilities"): what RL and preference losses (GRPO, PPO, DPO) read from a policy.
The call's checks and plan; the work is the block engine's with `torch_impl.log_probs_rule`.
"""

from __future__ import annotations

import torch

from interop.log_probs import LogProbsOptions
from interop.options import DEFAULT_IGNORE_INDEX, check_flags, check_inputs, check_strategy, check_tuning
from interop.tuning import Tuning
from torch_impl import custom_ops
from torch_impl.arguments import autocast_inputs, check_tensors, dense, indices
from torch_impl.custom_ops import dtype_of, optional_shape
from torch_impl import engine
from torch_impl.functional import (check_target_range, head_slice, runs_compiled, split_operands,
                                  whole_input)
from torch_impl.log_probs_rule import LogProbsCall
from torch_impl.rows import compute_dtype
from torch_impl.steps import choose_strategy, plan_steps
from torch_impl.vocab_parallel import call_fingerprint


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
            (its backward pass recomputes the logits, 8 N D V flops, except where "speed"
            keeps them from the forward pass: `Tuning.keep_logits_share`).
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

    Inside torch.compile the call is the custom op ``logitless::linear_log_probs_<digest>`` (as
    linear_cross_entropy's): a bad target there gives a NaN log-probability instead of
    raising; a split head (vocab_parallel, sequence_parallel, DTensors) runs as one eager step
    there (a graph break).
    """
    check_flags(return_entropy=return_entropy, return_argmax=return_argmax, accumulate_in_input_dtype=accumulate_in_input_dtype, sequence_parallel=sequence_parallel)
    kwargs = dict(linear_bias=linear_bias, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
                  weight_layout=weight_layout, strategy=strategy, accumulate_in_input_dtype=accumulate_in_input_dtype)
    if runs_compiled(vocab_parallel, sequence_parallel, input, linear_weight, linear_bias):
        input, linear_weight, linear_bias = custom_ops.compiled_call(
            input, dict(linear_weight=linear_weight, target=target), dict(linear_bias=linear_bias), "none", None,
            linear_weight, linear_bias)
        outs = compiled(input, linear_weight, target, **{**kwargs, "linear_bias": linear_bias}, tuning=tuning)
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
    checked = lambda: log_probs_checked(whole_input(input, rows_dim, vocab_parallel), linear_weight, target, linear_bias,
                                        temperature, softcap, ignore_index, weight_layout, strategy)
    split = None if vocab_parallel is None else head_slice(vocab_parallel, lambda: checked()[1], input.device, call_fingerprint(
        temperature, softcap, ignore_index, weight_layout, strategy, accumulate_in_input_dtype, tuning, input.dtype,
        linear_bias is None, torch.is_grad_enabled(), input.requires_grad, linear_weight.requires_grad,
        linear_bias is not None and linear_bias.requires_grad), rows_dim=rows_dim)
    o, shape = checked()
    y_N = indices(dense(target.reshape(shape.n_rows)))
    check_target_range(y_N, shape.vocab if split is None else split.vocab, o.ignore_index)
    x_ND = input.reshape(shape.n_rows, shape.hidden) if rows_dim is None else input  # a part: the loops gather
    plan_vocab = shape.vocab if split is None else split.largest  # every rank plans the same blocks

    def plan_for(x):
        """The plan of `strategy` for the rows x; "auto" by the free memory now, the same on
        every rank of a split."""
        chosen = choose_strategy(strategy, x, shape.n_rows, shape.hidden, plan_vocab, tuning, split)
        return plan_steps(tuning, "log_probs", chosen, shape.n_rows, shape.hidden, plan_vocab, x.dtype,
                          accumulate_in_input_dtype, whole_vocab=None if split is None else split.vocab)

    call = LogProbsCall(o, weight_layout, *plan_for(x_ND), split)
    if strategy == "auto":
        engine.choose_again(call, lambda x: dict(zip(("plan", "ops"), plan_for(x))))
    logp, entropy, argmax = engine.apply(call, x_ND, linear_weight, dense(linear_bias), y_N)
    return tuple(t.reshape(shape.lead_shape) for t in (logp, entropy, argmax))


# ----------------------------------------------------------------------------- the custom op


def log_probs_checked(input, linear_weight, target, linear_bias, temperature, softcap, ignore_index, weight_layout,
                       strategy):
    """(options, shape) of a `linear_log_probs` call: the eager call's checks."""
    o = LogProbsOptions(temperature, softcap, ignore_index)
    check_strategy(strategy)
    shape = check_inputs(
        input_shape=tuple(input.shape), input_dtype=dtype_of(input), weight_shape=tuple(linear_weight.shape),
        weight_dtype=dtype_of(linear_weight), target_shape=tuple(target.shape), target_dtype=dtype_of(target),
        bias_shape=optional_shape(linear_bias), bias_dtype=dtype_of(linear_bias), weight_layout=weight_layout)
    return o, shape


def _op_build(input, linear_weight, target, linear_bias, temperature, softcap, ignore_index, weight_layout, strategy,
              accumulate_in_input_dtype, tuning, grads):
    """The op's Call (`custom_ops.OpSpec`); a bad target reads nothing (a NaN log-probability)."""
    o, shape = log_probs_checked(input, linear_weight, target, linear_bias, temperature, softcap, ignore_index,
                                 weight_layout, strategy)
    x, y = input.reshape(shape.n_rows, shape.hidden), indices(dense(target.reshape(shape.n_rows)))
    plan, ops = custom_ops.block_steps("log_probs", strategy, x, shape.vocab, input.dtype, accumulate_in_input_dtype, tuning)
    return LogProbsCall(o, weight_layout, plan, ops, None), (x, linear_weight, dense(linear_bias), y)


def _op_fake(*args):
    """(log-probabilities, entropy, argmax), (lse, entropy): [N], argmax int64, the others in
    the compute dtype."""
    _, shape = log_probs_checked(*args[:9])
    n, wide = shape.n_rows, compute_dtype(args[0].dtype)
    rows = lambda: args[0].new_empty(n, dtype=wide)
    return (rows(), rows(), args[0].new_empty(n, dtype=torch.int64)), (rows(), rows())


_op = custom_ops.define(custom_ops.OpSpec(
    "linear_log_probs",
    "Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, float temperature, float? softcap, "
    "int ignore_index, str weight_layout, str strategy, bool accumulate_in_input_dtype, float[] tuning",
    _op_build, _op_fake, outputs=3, values=2, grads_of=(0, 1, 3)))


def compiled(input, linear_weight, target, *, linear_bias, temperature, softcap, ignore_index, weight_layout, strategy,
             accumulate_in_input_dtype, tuning):
    """(log-probabilities, entropy, argmax) of the op, each shaped as target."""
    outs = _op(input, linear_weight, target, linear_bias, custom_ops.number("temperature", temperature),
               custom_ops.number("softcap", softcap, optional=True),
               DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index, weight_layout, strategy,
               accumulate_in_input_dtype, custom_ops.tuning_values(check_tuning(tuning)), [False] * 3)
    return tuple(t.reshape(target.shape) for t in outs[:3])
