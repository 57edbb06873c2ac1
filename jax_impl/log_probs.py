"""`linear_log_probs` for JAX, with the arguments, defaults and semantics of
`logitless.torch.linear_log_probs` (interop/SPEC.md, "Log-probabilities"): per-token log p(target)
at a temperature, the entropy and the argmax, without the N x V logits. The call's checks
and plan; the work is the block engine's with `jax_impl.log_probs_rule`.
"""

from __future__ import annotations

import dataclasses


from interop.log_probs import LogProbsOptions
from interop.options import check_flags, check_inputs, check_strategy, check_tuning
from interop.tuning import Tuning
from jax_impl.distill_rules import plan_steps
from jax_impl.functional import (as_array, check_target_range, choose_strategy, dtype_name, maybe_array, platform_of,
                                 shape_of, whole_vocab)
from jax_impl.log_probs_rule import log_probs
from jax_impl.rows import narrow_targets
from jax_impl.sharding import on_mesh, row_spec, with_rows_axes


def checked_call(input, linear_weight, target, linear_bias, o: LogProbsOptions, weight_layout, strategy, tuning,
                 vocab_parallel: str | None = None):
    """(input, linear_weight, target, linear_bias as arrays, their ProblemShape, the Tuning) of
    a call on the policy head, or the error naming what is wrong (a target out of range too).
    With vocab_parallel (a shard_map axis splitting the head), the shape's vocab is the whole
    head's."""
    check_strategy(strategy)
    tuning = check_tuning(tuning)
    input, linear_weight = as_array("input", input), as_array("linear_weight", linear_weight)
    target, linear_bias = as_array("target", target), maybe_array("linear_bias", linear_bias)
    shape = check_inputs(
        input_shape=input.shape, input_dtype=dtype_name(input), weight_shape=linear_weight.shape,
        weight_dtype=dtype_name(linear_weight), target_shape=target.shape, target_dtype=dtype_name(target),
        bias_shape=shape_of(linear_bias), bias_dtype=dtype_name(linear_bias), weight_layout=weight_layout,
        classes=None if vocab_parallel is None else whole_vocab(linear_weight, weight_layout, vocab_parallel))
    check_target_range(target, shape.vocab, o.ignore_index)
    return input, linear_weight, target, linear_bias, shape, tuning


def linear_log_probs(input, linear_weight, target, *, linear_bias=None, temperature: float = 1.0,
                     softcap: float | None = None, ignore_index: int | None = -100, return_entropy: bool = False,
                     return_argmax: bool = False, weight_layout: str = "VD", strategy: str = "auto",
                     accumulate_in_input_dtype: bool = False, tuning: Tuning | None = None,
                     vocab_parallel: str | None = None):
    """Per-token log p(target) at a temperature, and on request the entropy and argmax.

    The arguments of `logitless.torch.linear_log_probs`: input [..., D], linear_weight [V, D]
    ("VD") or [D, V] ("DV", Flax nnx.Linear's kernel), target [...] integer ids, optional
    linear_bias [V]; u = softcap(input @ W^T + b) / temperature. Differentiable in input,
    linear_weight and linear_bias (`jax.custom_vjp`); usable under `jax.jit`, where a
    target out of [0, V) that is not ignore_index gives a NaN log-probability instead of
    the eager call's ValueError. strategy: as for `logitless.jax.linear_cross_entropy`.
    vocab_parallel: inside `jax.shard_map`, the name of the mesh axis over which the head is
    split by vocabulary (equal slices in the axis' order, input and targets the same on
    every device), as for `logitless.jax.linear_cross_entropy`: the devices exchange a few
    statistics per row, never logits; every output is global, grad_weight the device's
    slice, grad_input the full gradient (summed over the axis).

    Returns:
        log-probabilities [...] in fp32 (fp64 for fp64 input), 0 where ignored; with
        return_entropy and/or return_argmax, the tuple (log_probs, entropy, argmax) of those
        asked for: the entropy of every row, argmax int32 (the first of equal maxima).
    """
    check_flags(return_entropy=return_entropy, return_argmax=return_argmax, accumulate_in_input_dtype=accumulate_in_input_dtype)
    o = LogProbsOptions(temperature, softcap, ignore_index)
    input, linear_weight, target, linear_bias, shape, tuning = checked_call(
        input, linear_weight, target, linear_bias, o, weight_layout, strategy, tuning, vocab_parallel)
    n = shape.n_rows
    y, ignore32 = narrow_targets(target.reshape(n), shape.vocab, o.ignore_index)
    platform = platform_of(input)
    local_vocab = linear_weight.shape[0 if weight_layout == "VD" else 1]
    strategy = choose_strategy(strategy, input.dtype, n, shape.hidden, local_vocab, platform, tuning)
    cfg = plan_steps(tuning, "log_probs", dataclasses.replace(o, ignore_index=ignore32), weight_layout, strategy, n,
                     shape.hidden, local_vocab, input.dtype, accumulate_in_input_dtype, platform,
                     None if vocab_parallel is None else shape.vocab, recomputes=True)

    def rows(x, W, b, y):
        outs = log_probs(x.reshape(n, shape.hidden), W, b, y, cfg, return_entropy, vocab_parallel)
        return tuple(a.reshape(shape.lead_shape) for a in outs)

    if vocab_parallel is not None:  # inside shard_map: the device's own operands
        logp, entropy, argmax = rows(input, *with_rows_axes((linear_weight, linear_bias), input), y)
    else:
        logp, entropy, argmax = on_mesh(rows, (input, linear_weight, linear_bias, y), lambda: (row_spec(input),) * 3)
    outs = (logp,) + ((entropy,) if return_entropy else ()) + ((argmax,) if return_argmax else ())
    return outs[0] if len(outs) == 1 else outs
