"""The distillation losses as `torch.library` custom ops: the calls inside compiled code
(`torch_impl.custom_ops` says how and why). A teacher id >= V, or a hard target outside
[0, V) that is not ignore_index, gives a NaN row there instead of raising (the id reads
nothing)."""

from __future__ import annotations

import torch

from interop.distillation import (DenseDistillationOptions, TopKDistillationOptions, check_dense_inputs,
                                  check_topk_inputs)
from interop.options import DEFAULT_IGNORE_INDEX, check_strategy
from interop.tuning import Tuning
from torch_impl.arguments import dense
from torch_impl.custom_ops import (block_steps, divided, dtype_of, fake_grads, formed_now, fused_autograd, grad_outputs,
                                   number, optional_shape, tuning_values)
from torch_impl.distill_rows import TopKTeacher, valid_rows
from torch_impl.distill_rules import dense_backward, dense_forward, topk_backward, topk_forward
from torch_impl.rows import compute_dtype


def topk_checked(input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask, temperature,
                  renormalize_teacher, tail_bucket, temperature_squared, weight_soft, weight_hard, reduction,
                  ignore_index, softcap, weight_layout, strategy):
    """(options, shape) of a top-K call: the eager call's checks."""
    o = TopKDistillationOptions(temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft,
                                weight_hard, reduction, ignore_index, softcap)
    check_strategy(strategy)
    shape = check_topk_inputs(
        input_shape=tuple(input.shape), input_dtype=dtype_of(input), weight_shape=tuple(linear_weight.shape),
        weight_dtype=dtype_of(linear_weight), ids_shape=tuple(teacher_ids.shape), ids_dtype=dtype_of(teacher_ids),
        logprobs_shape=tuple(teacher_logprobs.shape), logprobs_dtype=dtype_of(teacher_logprobs),
        target_shape=optional_shape(target), target_dtype=dtype_of(target), bias_shape=optional_shape(linear_bias),
        bias_dtype=dtype_of(linear_bias), row_mask_shape=optional_shape(row_mask), row_mask_dtype=dtype_of(row_mask),
        weight_layout=weight_layout, weight_hard=o.weight_hard)
    return o, shape


def _topk_operands(o, shape, input, teacher_ids, teacher_logprobs, target, row_mask):
    """(x [N, D], teacher, y [N] int64 (-1: none), valid [N]) as the eager call prepares them,
    except that a row with a teacher id >= V, or with a bad hard target, gets NaN teacher
    log-probabilities (a NaN loss and gradient) instead of raising; the bad id reads nothing."""
    n, V, dev, wide = shape.n_rows, shape.vocab, input.device, compute_dtype(input.dtype)
    ids = teacher_ids.reshape(n, shape.k).to(torch.int64)
    bad = (ids >= V).any(1)
    ids = torch.where(ids >= V, -1, ids).contiguous()
    y = None if target is None else target.reshape(n).to(torch.int64)
    valid = valid_rows(n, y, None if row_mask is None else dense(row_mask.reshape(n)), o.ignore_index, dev)
    y_kernel = torch.full((n,), -1, dtype=torch.int64, device=dev)
    if y is not None and o.weight_hard:
        in_range = (y >= 0) & (y < V)
        bad = bad | (valid & ~in_range)
        y_kernel = torch.where(valid & in_range, y, y_kernel)
    lp = teacher_logprobs.reshape(n, shape.k).to(wide)
    lp = torch.where(bad[:, None], torch.full_like(lp, torch.nan), lp).contiguous()
    return input.reshape(n, shape.hidden), TopKTeacher(ids, lp, o.renormalize_teacher, wide), y_kernel, valid


@torch.library.custom_op("logitless::linear_topk_distillation", mutates_args=())
def linear_topk_distillation_op(
    input: torch.Tensor, linear_weight: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
    target: torch.Tensor | None, linear_bias: torch.Tensor | None, row_mask: torch.Tensor | None,
    temperature: float, renormalize_teacher: bool, tail_bucket: bool,
    temperature_squared: bool, weight_soft: float, weight_hard: float, reduction: str, ignore_index: int,
    softcap: float | None, weight_layout: str, strategy: str, accumulate_in_input_dtype: bool, tuning: list[float],
    grads_now: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """(loss; lse_T, lse_1 [N], s_ids [N, K], s_y [N]: the per-row values its backward pass
    reads; the gradients of input, linear_weight and linear_bias for an upstream gradient of
    1 where grads_now is set, else empty tensors)."""
    o, shape = topk_checked(input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask,
                             temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft,
                             weight_hard, reduction, ignore_index, softcap, weight_layout, strategy)
    x, teacher, y, valid = _topk_operands(o, shape, input, teacher_ids, teacher_logprobs, target, row_mask)
    plan, ops = block_steps(strategy, x, shape.vocab, input.dtype, accumulate_in_input_dtype, tuning)
    want, b = tuple(grads_now), dense(linear_bias)
    in_forward = any(want) and plan.block_cols >= shape.vocab
    loss, saved, grads = topk_forward(x, linear_weight, b, teacher, y, valid, o, weight_layout, plan, ops, None,
                                      want if in_forward else (False,) * 3)
    if any(want) and not in_forward:
        one = torch.ones((), dtype=saved[0].dtype, device=x.device)
        grads = topk_backward(one, x, linear_weight, b, teacher, y, valid, saved, o, weight_layout, plan, ops, None, want)
    loss = loss.reshape(shape.lead_shape) if o.reduction == "none" else loss
    return (loss, *saved, *grad_outputs(input, linear_weight, linear_bias, grads, want))


@linear_topk_distillation_op.register_fake
def _(input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask, temperature,
      renormalize_teacher, tail_bucket, temperature_squared, weight_soft, weight_hard, reduction, ignore_index, softcap,
      weight_layout, strategy, accumulate_in_input_dtype, tuning, grads_now):
    o, shape = topk_checked(input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask,
                             temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft,
                             weight_hard, reduction, ignore_index, softcap, weight_layout, strategy)
    rows = lambda *s: input.new_empty(s, dtype=compute_dtype(input.dtype))
    return (rows(*shape.lead_shape) if o.reduction == "none" else rows(), rows(shape.n_rows), rows(shape.n_rows),
            rows(shape.n_rows, shape.k), rows(shape.n_rows), *fake_grads(input, linear_weight, linear_bias, grads_now))


@torch.library.custom_op("logitless::linear_topk_distillation_backward", mutates_args=())
def linear_topk_distillation_backward_op(
    upstream: list[torch.Tensor | None], saved: list[torch.Tensor], input: torch.Tensor, linear_weight: torch.Tensor,
    teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, target: torch.Tensor | None,
    linear_bias: torch.Tensor | None, row_mask: torch.Tensor | None,
    temperature: float, renormalize_teacher: bool, tail_bucket: bool, temperature_squared: bool, weight_soft: float,
    weight_hard: float, reduction: str, ignore_index: int, softcap: float | None, weight_layout: str, strategy: str,
    accumulate_in_input_dtype: bool, tuning: list[float], need: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `linear_topk_distillation_op`'s loss from its saved per-row values."""
    o, shape = topk_checked(input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask,
                             temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft,
                             weight_hard, reduction, ignore_index, softcap, weight_layout, strategy)
    x, teacher, y, valid = _topk_operands(o, shape, input, teacher_ids, teacher_logprobs, target, row_mask)
    plan, ops = block_steps(strategy, x, shape.vocab, input.dtype, accumulate_in_input_dtype, tuning)
    (grad_loss,) = upstream
    g = grad_loss.reshape(-1) if o.reduction == "none" else grad_loss.reshape(())
    grads = topk_backward(g.contiguous(), x, linear_weight, dense(linear_bias), teacher, y, valid, saved, o, weight_layout,
                          plan, ops, None, tuple(need))
    return grad_outputs(input, linear_weight, linear_bias, grads, tuple(need))


@linear_topk_distillation_backward_op.register_fake
def _(upstream, saved, input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, *args):
    return fake_grads(input, linear_weight, linear_bias, args[-1])


fused_autograd(linear_topk_distillation_op, linear_topk_distillation_backward_op, values=1, saved=(1, 2, 3, 4),
               formed=(5, 6, 7), grads_of=(0, 1, 5))


def dense_checked(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta, temperature,
                   temperature_squared, reduction, ignore_index, weight_layout, strategy):
    """(options, shape) of a dense-teacher call: the eager call's checks."""
    o = DenseDistillationOptions(divergence, beta, temperature, temperature_squared, reduction, ignore_index)
    check_strategy(strategy)
    shape = check_dense_inputs(
        input_shape=tuple(input.shape), input_dtype=dtype_of(input), weight_shape=tuple(linear_weight.shape),
        weight_dtype=dtype_of(linear_weight), teacher_input_shape=tuple(teacher_input.shape),
        teacher_input_dtype=dtype_of(teacher_input), teacher_weight_shape=tuple(teacher_weight.shape),
        teacher_weight_dtype=dtype_of(teacher_weight), target_shape=optional_shape(target), target_dtype=dtype_of(target),
        row_mask_shape=optional_shape(row_mask), row_mask_dtype=dtype_of(row_mask), weight_layout=weight_layout)
    return o, shape


def _dense_operands(o, shape, input, teacher_input, target, row_mask):
    """(x [N, D], teacher x [N, Dt], valid [N], vocab: the classes both heads cover)."""
    n = shape.n_rows
    y = None if target is None else target.reshape(n)
    valid = valid_rows(n, y, None if row_mask is None else dense(row_mask.reshape(n)), o.ignore_index, input.device)
    return (input.reshape(n, shape.hidden), teacher_input.reshape(n, shape.teacher_hidden), valid,
            min(shape.vocab, shape.teacher_vocab))


@torch.library.custom_op("logitless::linear_distillation", mutates_args=())
def linear_distillation_op(
    input: torch.Tensor, linear_weight: torch.Tensor, teacher_input: torch.Tensor, teacher_weight: torch.Tensor,
    target: torch.Tensor | None, row_mask: torch.Tensor | None, divergence: str,
    beta: float, temperature: float, temperature_squared: bool, reduction: str, ignore_index: int, weight_layout: str,
    strategy: str, accumulate_in_input_dtype: bool, tuning: list[float], grads_now: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss; lse_s, lse_t, kl_q [N]: what its backward pass reads; the gradients of input
    and linear_weight for an upstream gradient of 1 where grads_now is set, else empty)."""
    o, shape = dense_checked(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta,
                              temperature, temperature_squared, reduction, ignore_index, weight_layout, strategy)
    x, xt, valid, vocab = _dense_operands(o, shape, input, teacher_input, target, row_mask)
    plan, ops = block_steps(strategy, x, vocab, input.dtype, accumulate_in_input_dtype, tuning, buffers=2)
    want = tuple(grads_now)
    in_forward = any(want) and plan.block_cols >= vocab
    loss, saved, grads = dense_forward(x, linear_weight, xt, teacher_weight, valid, o, weight_layout, vocab, plan, ops,
                                       None, want if in_forward else (False, False))
    if any(want) and not in_forward:
        one = torch.ones((), dtype=saved[0].dtype, device=x.device)
        grads = dense_backward(one, x, linear_weight, xt, teacher_weight, valid, saved, o, weight_layout, vocab, plan,
                               ops, None, want)
    loss = loss.reshape(shape.lead_shape) if o.reduction == "none" else loss
    return (loss, *saved, *grad_outputs(input, linear_weight, None, (*grads, None), (*want, False))[:2])


@linear_distillation_op.register_fake
def _(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta, temperature,
      temperature_squared, reduction, ignore_index, weight_layout, strategy, accumulate_in_input_dtype, tuning,
      grads_now):
    o, shape = dense_checked(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta,
                              temperature, temperature_squared, reduction, ignore_index, weight_layout, strategy)
    rows = lambda *s: input.new_empty(s, dtype=compute_dtype(input.dtype))
    return (rows(*shape.lead_shape) if o.reduction == "none" else rows(), rows(shape.n_rows), rows(shape.n_rows),
            rows(shape.n_rows), *fake_grads(input, linear_weight, None, (*grads_now, False))[:2])


@torch.library.custom_op("logitless::linear_distillation_backward", mutates_args=())
def linear_distillation_backward_op(
    upstream: list[torch.Tensor | None], saved: list[torch.Tensor], input: torch.Tensor, linear_weight: torch.Tensor,
    teacher_input: torch.Tensor, teacher_weight: torch.Tensor, target: torch.Tensor | None,
    row_mask: torch.Tensor | None, divergence: str, beta: float, temperature: float,
    temperature_squared: bool, reduction: str, ignore_index: int, weight_layout: str, strategy: str,
    accumulate_in_input_dtype: bool, tuning: list[float], need: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of `linear_distillation_op`'s loss from its saved per-row values."""
    o, shape = dense_checked(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta,
                              temperature, temperature_squared, reduction, ignore_index, weight_layout, strategy)
    x, xt, valid, vocab = _dense_operands(o, shape, input, teacher_input, target, row_mask)
    plan, ops = block_steps(strategy, x, vocab, input.dtype, accumulate_in_input_dtype, tuning, buffers=2)
    (grad_loss,) = upstream
    g = grad_loss.reshape(-1).contiguous() if o.reduction == "none" else grad_loss.reshape(())
    grads = dense_backward(g, x, linear_weight, xt, teacher_weight, valid, saved, o, weight_layout, vocab, plan, ops,
                           None, tuple(need))
    return grad_outputs(input, linear_weight, None, (*grads, None), (*need, False))[:2]


@linear_distillation_backward_op.register_fake
def _(upstream, saved, input, linear_weight, *args):
    return fake_grads(input, linear_weight, None, (*args[-1], False))[:2]


fused_autograd(linear_distillation_op, linear_distillation_backward_op, values=1, saved=(1, 2, 3), formed=(4, 5),
               grads_of=(0, 1))


def linear_topk_distillation(input, linear_weight, teacher_ids, teacher_logprobs, *, target, linear_bias, row_mask,
                             temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft,
                             weight_hard, reduction, num_items_in_batch, ignore_index, softcap, weight_layout, strategy,
                             accumulate_in_input_dtype, tuning: Tuning):
    """The op as `torch_impl.distillation.linear_topk_distillation` returns it: the loss."""
    out = linear_topk_distillation_op(
        input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask,
        number("temperature", temperature), renormalize_teacher, tail_bucket, temperature_squared,
        number("weight_soft", weight_soft), number("weight_hard", weight_hard),
        "sum" if num_items_in_batch is not None else reduction,
        DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index, number("softcap", softcap, optional=True),
        weight_layout, strategy, accumulate_in_input_dtype, tuning_values(tuning),
        formed_now(reduction != "none", strategy, input, linear_weight, linear_bias))
    return divided(out[0], num_items_in_batch)


def linear_distillation(input, linear_weight, teacher_input, teacher_weight, *, target, row_mask, divergence, beta,
                        temperature, temperature_squared, reduction, num_items_in_batch, ignore_index, weight_layout,
                        strategy, accumulate_in_input_dtype, tuning: Tuning):
    """The op as `torch_impl.distillation.linear_distillation` returns it: the loss."""
    out = linear_distillation_op(
        input, linear_weight, teacher_input.detach(), teacher_weight.detach(), target, row_mask, divergence,
        number("beta", beta), number("temperature", temperature), temperature_squared,
        "sum" if num_items_in_batch is not None else reduction,
        DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index, weight_layout, strategy,
        accumulate_in_input_dtype, tuning_values(tuning), formed_now(reduction != "none", strategy, input, linear_weight))
    return divided(out[0], num_items_in_batch)
