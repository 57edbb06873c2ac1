"""The losses as `torch.library` custom ops: the calls inside compiled code.

torch.compile traces through a custom op by its fake implementation (shapes and dtypes
only) and its autograd rule, so a model that calls a loss compiles whole
(``fullgraph=True``) and a varying number of rows compiles once (dynamic shapes): the
block plan is made when the op runs, not when it is traced. Each op runs the eager call's
checks, strategies and kernels, with two differences, because compiled code (and a CUDA
graph replaying it) must not wait for the GPU:

- a target outside [0, V) that is not ignore_index gives a NaN row (and a NaN mean)
  instead of a ValueError, as under `jax.jit`;
- rows whose target is ignore_index are computed and masked, not gathered out first.

Where the eager call forms the gradients in the forward pass (a reduced loss, no lse, the
kernels' "speed" or "auto": `formed_now`), the op forms them for an upstream gradient of 1
and the backward pass scales them; otherwise a backward op recomputes them from the per-row
values the op saved (`fused_autograd`). Gradients are first-order only. An op's options
travel as numbers, strings and flags (a Tuning as `tuning_values`), which is what an op's
schema carries; num_items_in_batch divides outside the ops (`divided`), so that a new count
is no new graph.

This module holds the shared parts and cross-entropy's op; `torch_impl.distill_ops` and
`torch_impl.log_probs_ops` hold the others.
"""

from __future__ import annotations

import dataclasses

import torch

from interop.options import (DEFAULT_IGNORE_INDEX, CrossEntropyOptions, check_filter_eps, check_inputs, check_reduction,
                             check_strategy)
from interop.tuning import Tuning
from torch_impl import cross_entropy_rule
from torch_impl.arguments import autocast_inputs, check_tensors, dense, denominator
from torch_impl.rows import compute_dtype
from torch_impl.steps import choose_strategy, kernels_can_run, plan_steps

try:
    from torch_impl import blocked
    from torch_impl.kernels import TargetCheck
except ImportError:  # no Triton: "chunked" serves every call
    blocked = None

_TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tuning))


def tuning_values(t: Tuning) -> list[float]:
    """A Tuning as the flat list of numbers a custom op's schema can carry (tuples spread)."""
    values = []
    for name in _TUNING_FIELDS:
        v = getattr(t, name)
        if isinstance(v, tuple):
            values.extend(v)
        else:
            values.append(v)
    return values


def tuning_from_values(values) -> Tuning:
    """The inverse of `tuning_values`: each field in its default's type."""
    fields, it = {}, iter(values)
    for name in _TUNING_FIELDS:
        default = getattr(Tuning, name)
        if isinstance(default, tuple):
            fields[name] = tuple(type(d)(next(it)) for d in default)
        else:
            fields[name] = type(default)(next(it))
    return Tuning(**fields)


def dtype_of(t):
    return None if t is None else str(t.dtype).removeprefix("torch.")


def grad_outputs(input, linear_weight, linear_bias, grads, want):
    """Gradients shaped as their inputs, an empty tensor where not wanted (an op returns tensors)."""
    dx, dW, db = grads
    return (dx.reshape(input.shape) if want[0] else input.new_empty(0),
            dW if want[1] else linear_weight.new_empty(0),
            db if want[2] and linear_bias is not None else linear_weight.new_empty(0))


def fake_grads(input, linear_weight, linear_bias, need):
    """What a backward op gives, as fake tensors: `grad_outputs` of contiguous gradients (the
    real ones are; a compiler checks the strides against these)."""
    grads = (input.new_empty(input.shape), linear_weight.new_empty(linear_weight.shape),
             None if linear_bias is None else linear_bias.new_empty(linear_bias.shape))
    return grad_outputs(input, linear_weight, linear_bias, grads, tuple(need))


def _scaled(g, grad_loss):
    """A gradient formed for an upstream gradient of 1, times the real one (in fp32)."""
    return (g.float() * grad_loss).to(g.dtype)


def fused_autograd(op, backward_op, *, values: int, saved: tuple, formed: tuple = (), grads_of: tuple) -> None:
    """Register op's autograd rule. op's first `values` outputs are differentiable; the
    outputs at `saved` are what backward_op reads; with `formed` (the positions of gradients
    formed for an upstream gradient of 1 when op's last argument, grads_now, says so), the
    backward pass scales those, else it calls backward_op(upstream, saved, *op's arguments
    (without grads_now), need) for the gradients of op's arguments at `grads_of`."""

    def setup_context(ctx, inputs, output):
        ctx.tensors = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.others = {i: a for i, a in enumerate(inputs) if not isinstance(a, torch.Tensor)}
        ctx.n_inputs = len(inputs)
        ctx.formed = bool(formed) and any(inputs[-1])
        ctx.need = [bool(ctx.needs_input_grad[i]) and inputs[i] is not None for i in grads_of]
        kept = formed if ctx.formed else saved
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensors), *(output[i] for i in kept))

    def backward(ctx, *upstream):
        tensors = ctx.saved_tensors
        args = [None] * ctx.n_inputs
        for i, a in ctx.others.items():
            args[i] = a
        for i, t in zip(ctx.tensors, tensors):
            args[i] = t
        kept = tensors[len(ctx.tensors):]
        if ctx.formed:
            grads = [_scaled(g, upstream[0]) if need else None for g, need in zip(kept, ctx.need)]
        else:
            out = backward_op(list(upstream[:values]), list(kept), *args[: len(args) - bool(formed)], ctx.need)
            grads = [g if need else None for g, need in zip(out, ctx.need)]
        result = [None] * ctx.n_inputs
        for i, g in zip(grads_of, grads):
            result[i] = g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)


def optional_shape(t):
    return None if t is None else tuple(t.shape)


def block_steps(strategy, x, vocab, dtype, accumulate, tuning, buffers=1, speed_pays=True):
    """(plan, ops) of the block steps for the rows x [N, D] (`torch_impl.steps.plan_steps`;
    speed_pays as for `choose_strategy`)."""
    n, d = x.shape
    t = tuning_from_values(tuning)
    strategy = choose_strategy(strategy, x, n, d, vocab, t, speed_pays)
    return plan_steps(t, strategy, n, d, vocab, dtype, accumulate, buffers)


def formed_now(reduced: bool, strategy: str, input: torch.Tensor, *tensors) -> list[bool]:
    """Which of input and `tensors` (None allowed) get gradients formed when the op runs, for an
    upstream gradient of 1: those that need one, when autograd records, the loss is reduced
    (its upstream gradient is then one number) and the kernels' blocks of whole rows can
    form them in the forward pass, as the eager call does: "speed", or "auto" (whose plan,
    made when the op runs, may still be "memory": its backward pass then runs right after).
    Not for fp16 under "auto": a gradient formed at scale 1 in fp16 would underflow what a
    loss scale keeps; "chunked" and "memory" leave them to the backward op."""
    now = (reduced and torch.is_grad_enabled() and kernels_can_run(input)
           and (strategy == "speed" or (strategy == "auto" and input.dtype != torch.float16)))
    return [now and t is not None and t.requires_grad for t in (input, *tensors)]


def number(name: str, value, optional: bool = False) -> float | None:
    """An option that a custom op's schema carries as a float: a Python int or float, else
    ValueError naming it (a bool is not a number, as for the eager call; Dynamo traces a
    NumPy number as a tensor, whose value the schema can't take)."""
    if value is None and optional:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a Python number inside torch.compile (not a tensor or a NumPy number)")
    return float(value)


def compiled_call(input, required: dict, optional: dict, reduction: str, num_items_in_batch, *cast):
    """The checks a compiled call makes before its op (which checks the rest when traced):
    tensor arguments by name, reduction with num_items_in_batch; returns `cast` (input
    first) cast to the autocast dtype where autocast is on."""
    check_tensors(input, required, optional)
    check_reduction(reduction, num_items_in_batch)
    return autocast_inputs(input, *cast)


def divided(loss, num_items_in_batch):
    """A summed loss divided by num_items_in_batch (None: unchanged), outside the op: a
    number inside it would be compiled in as a constant."""
    if num_items_in_batch is None:
        return loss
    return loss / denominator(num_items_in_batch, loss.dtype, loss.device)


# ----------------------------------------------------------------------------- cross-entropy


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call's checked arguments: options, sizes, tuning and the tensors the kernels read
    (x [N, D], y int64 [N], bias and class weights dense)."""

    opts: CrossEntropyOptions
    lead_shape: tuple
    vocab: int
    tuning: Tuning
    x: torch.Tensor
    y: torch.Tensor
    b: torch.Tensor | None
    cw: torch.Tensor | None


def _call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
          weight_layout, strategy, filter_eps, tuning) -> _Call:
    """The eager call's checks (ValueError / TypeError naming the argument) and the flattened
    operands; runs when the op is traced (on fake tensors) and when it runs."""
    opts = CrossEntropyOptions(reduction, ignore_index, label_smoothing, z_loss, softcap)
    check_strategy(strategy)
    check_filter_eps(filter_eps)
    shape = check_inputs(
        input_shape=tuple(input.shape), input_dtype=dtype_of(input),
        weight_shape=tuple(linear_weight.shape), weight_dtype=dtype_of(linear_weight),
        target_shape=tuple(target.shape), target_dtype=dtype_of(target),
        bias_shape=None if linear_bias is None else tuple(linear_bias.shape), bias_dtype=dtype_of(linear_bias),
        class_weight_shape=None if weight is None else tuple(weight.shape), class_weight_dtype=dtype_of(weight),
        weight_layout=weight_layout,
    )
    x = input.reshape(shape.n_rows, shape.hidden)
    y = dense(target.reshape(shape.n_rows)).to(torch.int64)
    return _Call(opts, shape.lead_shape, shape.vocab, tuning_from_values(tuning), x, y, dense(linear_bias), dense(weight))


def _plan(c: _Call, strategy: str, accumulate: bool, filter_eps, grads_now):
    """(plan, ops): the block steps' where the strategy resolves to "chunked", else the
    kernels' plan that never waits for the GPU and None."""
    n, d = c.x.shape
    strategy = choose_strategy(strategy, c.x, n, d, c.vocab, c.tuning)
    if strategy == "chunked":
        return plan_steps(c.tuning, strategy, n, d, c.vocab, c.x.dtype, accumulate)
    plan = blocked.plan_blocks(c.tuning, strategy, n, d, c.vocab, c.x.dtype, accumulate, filter_eps,
                               forward_only=not any(grads_now))
    return dataclasses.replace(plan, host_sync=False), None


def _backward_grads(c: _Call, grad_loss, grad_lse, lse, linear_weight, weight_layout, plan, ops, need):
    """(dx [N, D], dW, db) of the flattened call, recomputed block by block."""
    grad_loss = grad_loss.reshape(-1) if c.opts.reduction == "none" else grad_loss.reshape(())
    grad_lse = None if grad_lse is None else dense(grad_lse.reshape(-1))
    if ops is not None:
        cw = None if c.cw is None else c.cw.to(lse.dtype)
        return cross_entropy_rule.backward(grad_loss, grad_lse, c.x, linear_weight, c.b, cw, c.y, lse.reshape(-1), c.opts,
                                weight_layout, plan, ops, need)
    check = TargetCheck(c.y, c.cw, c.opts.ignore_index, c.vocab, watch=False)
    return blocked.backward(dense(grad_loss.float()), grad_lse, c.x, linear_weight, c.b, c.cw, c.y, lse.reshape(-1).float(),
                            c.opts, weight_layout, plan, need, check)


@torch.library.custom_op("logitless::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    input: torch.Tensor, linear_weight: torch.Tensor, target: torch.Tensor, linear_bias: torch.Tensor | None,
    weight: torch.Tensor | None, reduction: str, ignore_index: int, label_smoothing: float, z_loss: float,
    softcap: float | None, weight_layout: str, strategy: str, accumulate_in_input_dtype: bool, filter_eps: float | None,
    tuning: list[float], grads_now: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss: 0-d, or the input's leading shape for "none"; lse [...]; and, where grads_now
    (input, linear_weight, linear_bias) is set, the gradients for an upstream gradient of 1,
    else empty tensors). The loss and lse are fp32 (fp64 for fp64 input)."""
    c = _call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
              weight_layout, strategy, filter_eps, tuning)
    plan, ops = _plan(c, strategy, accumulate_in_input_dtype, filter_eps, grads_now)
    want = tuple(grads_now)
    if ops is not None:
        loss, lse, _ = cross_entropy_rule.forward(c.x, linear_weight, c.b, c.cw, c.y, c.opts, weight_layout, plan, ops)
        grads = (None,) * 3
    else:
        check = TargetCheck(c.y, c.cw, c.opts.ignore_index, c.vocab, watch=False)
        in_forward = any(want) and plan.layout == "rows"
        loss, lse, *grads = blocked.forward(c.x, linear_weight, c.b, c.cw, c.y, c.opts, weight_layout, plan,
                                            want if in_forward else (False,) * 3, check)
    if any(want) and all(g is None for g in grads):  # blocks of whole rows formed none: the backward pass now
        one = torch.ones((), dtype=lse.dtype, device=lse.device)
        grads = _backward_grads(c, one, None, lse, linear_weight, weight_layout, plan, ops, want)
    loss = loss.reshape(c.lead_shape) if c.opts.reduction == "none" else loss
    return (loss, lse.reshape(c.lead_shape), *grad_outputs(input, linear_weight, linear_bias, grads, want))


@linear_cross_entropy_op.register_fake
def _(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
      weight_layout, strategy, accumulate_in_input_dtype, filter_eps, tuning, grads_now):
    c = _call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
              weight_layout, strategy, filter_eps, tuning)
    wide = compute_dtype(input.dtype)
    loss = input.new_empty(c.lead_shape if c.opts.reduction == "none" else (), dtype=wide)
    return (loss, input.new_empty(c.lead_shape, dtype=wide), *fake_grads(input, linear_weight, linear_bias, grads_now))


@torch.library.custom_op("logitless::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(
    upstream: list[torch.Tensor | None], saved: list[torch.Tensor], input: torch.Tensor, linear_weight: torch.Tensor,
    target: torch.Tensor, linear_bias: torch.Tensor | None, weight: torch.Tensor | None, reduction: str,
    ignore_index: int, label_smoothing: float, z_loss: float, softcap: float | None, weight_layout: str, strategy: str,
    accumulate_in_input_dtype: bool, filter_eps: float | None, tuning: list[float], need: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_input, grad_linear_weight, grad_linear_bias) of `linear_cross_entropy_op`'s loss
    and lse (upstream), recomputed from its saved lse; an empty tensor where `need` is not set."""
    c = _call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
              weight_layout, strategy, filter_eps, tuning)
    plan, ops = _plan(c, strategy, accumulate_in_input_dtype, filter_eps, need)
    (grad_loss, grad_lse), (lse,) = upstream, saved
    grads = _backward_grads(c, grad_loss, grad_lse, lse, linear_weight, weight_layout, plan, ops, tuple(need))
    return grad_outputs(input, linear_weight, linear_bias, grads, tuple(need))


@linear_cross_entropy_backward_op.register_fake
def _(upstream, saved, input, linear_weight, target, linear_bias, *args):
    return fake_grads(input, linear_weight, linear_bias, args[-1])


fused_autograd(linear_cross_entropy_op, linear_cross_entropy_backward_op, values=2, saved=(1,), formed=(2, 3, 4),
               grads_of=(0, 1, 3))


def linear_cross_entropy(input, linear_weight, target, *, linear_bias, weight, reduction, ignore_index, label_smoothing,
                         z_loss, softcap, return_lse, weight_layout, strategy, accumulate_in_input_dtype, filter_eps,
                         tuning: Tuning):
    """The op as `torch_impl.functional.linear_cross_entropy` returns it: loss, or (loss, lse)."""
    loss, lse, *_ = linear_cross_entropy_op(
        input, linear_weight, target, linear_bias, weight, reduction,
        DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index, number("label_smoothing", label_smoothing),
        number("z_loss", z_loss), number("softcap", softcap, optional=True), weight_layout, strategy,
        accumulate_in_input_dtype, number("filter_eps", filter_eps, optional=True), tuning_values(tuning),
        formed_now(reduction != "none" and not return_lse, strategy, input, linear_weight, linear_bias))
    return (loss, lse) if return_lse else loss
