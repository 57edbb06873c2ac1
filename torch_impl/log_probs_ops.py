"""`linear_log_probs` as a `torch.library` custom op: the call inside compiled code
(`torch_impl.custom_ops` says how and why). A target outside [0, V) that is not
ignore_index gives a NaN log-probability there instead of raising."""

from __future__ import annotations

import torch

from interop.log_probs import LogProbsOptions
from interop.options import DEFAULT_IGNORE_INDEX, check_inputs, check_strategy
from interop.tuning import Tuning
from torch_impl import log_probs_rule
from torch_impl.arguments import dense
from torch_impl.custom_ops import (block_steps, dtype_of, fake_grads, fused_autograd, grad_outputs, number, optional_shape,
                                   tuning_values)
from torch_impl.rows import compute_dtype


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


def _log_probs_operands(shape, input, target, linear_bias):
    n = shape.n_rows
    return input.reshape(n, shape.hidden), dense(target.reshape(n)).to(torch.int64), dense(linear_bias)


@torch.library.custom_op("logitless::linear_log_probs", mutates_args=())
def linear_log_probs_op(
    input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, linear_bias: torch.Tensor | None,
    temperature: float, softcap: float | None, ignore_index: int, weight_layout: str, strategy: str,
    accumulate_in_input_dtype: bool, tuning: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probabilities, entropy, lse, argmax), each shaped as target; the first three in
    the compute dtype, argmax int64. A bad target gives a NaN log-probability."""
    o, shape = log_probs_checked(input, linear_weight, target, linear_bias, temperature, softcap, ignore_index,
                                  weight_layout, strategy)
    x, y, b = _log_probs_operands(shape, input, target, linear_bias)
    plan, ops = block_steps(strategy, x, shape.vocab, input.dtype, accumulate_in_input_dtype, tuning, speed_pays=False)
    logp, entropy, argmax, lse = log_probs_rule.forward(x, linear_weight, b, y, o, weight_layout, plan, ops)
    return tuple(t.reshape(shape.lead_shape) for t in (logp, entropy, lse, argmax))


@linear_log_probs_op.register_fake
def _(input, linear_weight, target, linear_bias, temperature, softcap, ignore_index, weight_layout, strategy,
      accumulate_in_input_dtype, tuning):
    _, shape = log_probs_checked(input, linear_weight, target, linear_bias, temperature, softcap, ignore_index,
                                  weight_layout, strategy)
    wide = compute_dtype(input.dtype)
    return (*(input.new_empty(shape.lead_shape, dtype=wide) for _ in range(3)),
            input.new_empty(shape.lead_shape, dtype=torch.int64))


@torch.library.custom_op("logitless::linear_log_probs_backward", mutates_args=())
def linear_log_probs_backward_op(
    upstream: list[torch.Tensor | None], saved: list[torch.Tensor], input: torch.Tensor, linear_weight: torch.Tensor,
    target: torch.Tensor, linear_bias: torch.Tensor | None, temperature: float, softcap: float | None,
    ignore_index: int, weight_layout: str, strategy: str, accumulate_in_input_dtype: bool, tuning: list[float],
    need: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `linear_log_probs_op`'s log-probabilities and entropy (upstream)."""
    o, shape = log_probs_checked(input, linear_weight, target, linear_bias, temperature, softcap, ignore_index,
                                  weight_layout, strategy)
    x, y, b = _log_probs_operands(shape, input, target, linear_bias)
    plan, ops = block_steps(strategy, x, shape.vocab, input.dtype, accumulate_in_input_dtype, tuning, speed_pays=False)
    flat = [None if t is None else t.reshape(-1) for t in (*upstream, *saved)]
    grads = log_probs_rule.backward(flat[0], flat[1], x, linear_weight, b, y, flat[3], flat[2], o, weight_layout, plan, ops,
                               tuple(need))
    return grad_outputs(input, linear_weight, linear_bias, grads, tuple(need))


@linear_log_probs_backward_op.register_fake
def _(upstream, saved, input, linear_weight, target, linear_bias, *args):
    return fake_grads(input, linear_weight, linear_bias, args[-1])


fused_autograd(linear_log_probs_op, linear_log_probs_backward_op, values=2, saved=(1, 2), grads_of=(0, 1, 3))


def linear_log_probs(input, linear_weight, target, *, linear_bias, temperature, softcap, ignore_index, weight_layout,
                     strategy, accumulate_in_input_dtype, tuning: Tuning):
    """(log-probabilities, entropy, argmax) of the op."""
    logp, entropy, _, argmax = linear_log_probs_op(
        input, linear_weight, target, linear_bias, number("temperature", temperature),
        number("softcap", softcap, optional=True),
        DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index, weight_layout, strategy,
        accumulate_in_input_dtype, tuning_values(tuning))
    return logp, entropy, argmax
