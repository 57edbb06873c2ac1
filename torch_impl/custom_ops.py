"""The losses as `torch.library` custom ops: the calls inside compiled code, one layer for
every loss (`define`).

torch.compile traces through a custom op by its fake implementation (shapes and dtypes
only) and its autograd rule, so a model that calls a loss compiles whole
(``fullgraph=True``) and a varying number of rows compiles once (dynamic shapes): the
block plan is made when the op runs, not when it is traced. Each op builds the loss's
`engine.Call` with the eager call's checks, strategies and kernels, with two differences,
because compiled code (and a CUDA graph replaying it) must not wait for the GPU:

- a target outside [0, V) that is not ignore_index gives a NaN row (and a NaN mean)
  instead of a ValueError, as under `jax.jit`;
- rows whose target is ignore_index are computed and masked, not gathered out first.

Where the eager call forms the gradients in the forward pass (a reduced loss and, for
cross-entropy, no lse returned; the kernels' "speed" or "auto": `formed_now`), the op forms them for an upstream gradient of 1 and the
backward pass scales them; otherwise the backward op recomputes them from the per-row
values the op saved. Gradients are first-order only. An op's options travel as numbers,
strings and flags (a Tuning as `tuning_values`), which is what an op's schema carries;
num_items_in_batch divides outside the ops (`divided`), so that a new count is no new
graph, and the outputs take the input's leading shape outside them too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
from typing import Callable

import torch

import interop
from interop.options import check_reduction
from interop.tuning import Tuning
from torch_impl.arguments import autocast_inputs, check_tensors, denominator
from torch_impl.steps import choose_strategy, kernels_can_run, plan_steps

_TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tuning))


def source_digest(roots) -> str:
    """8 hex digits of the Python sources under `roots` (folders as `importlib.resources`
    Traversables or paths, which a zip import gives too): names and bytes, sorted."""
    h = hashlib.sha1()
    for root in roots:
        for entry in sorted(root.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".py"):
                h.update(entry.name.encode() + b"\0" + entry.read_bytes())
    return h.hexdigest()[:8]


# Each op's name ends in the digest of the library's sources (torch_impl, interop):
# torch.compile's caches (Inductor's FX-graph cache on disk, which outlives an upgrade) key a
# graph by its ops' names and schemas, not by their fake implementations, so a changed library
# under an unchanged name could replay a graph traced with the old output shapes. (A graph
# exported with torch.export names the op too: it loads with the library that exported it.)
OP_SUFFIX = source_digest((importlib.resources.files(__package__), importlib.resources.files(interop)))


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


def optional_shape(t):
    return None if t is None else tuple(t.shape)


def block_steps(loss, strategy, x, vocab, dtype, accumulate, tuning, buffers=1):
    """(plan, ops) of the block steps for the rows x [N, D] (`torch_impl.steps.plan_steps`)."""
    n, d = x.shape
    t = tuning_from_values(tuning)
    strategy = choose_strategy(strategy, x, n, d, vocab, t)
    return plan_steps(t, loss, strategy, n, d, vocab, dtype, accumulate, buffers)


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


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """What a loss gives the op layer.

    name: the op's name (``logitless::<name>_<OP_SUFFIX>``, and ``..._backward``).
    arguments: the schema of its arguments, as "Tensor input, Tensor linear_weight, ...".
    build(*arguments, grads) -> (Call, tensors): the eager call's checks and the loss's
        `engine.Call` over its flattened tensors, in each pass. grads: the Call's gradients
        that the pass forms (its `need`).
    fake(*arguments) -> (outputs, saved): the eager call's checks (ValueError / TypeError
        naming the argument, when the op is traced), then empty tensors shaped as the Call's
        forward pass gives its outputs and what it saves.
    outputs: how many outputs the Call gives; the first `values` take a gradient.
    grads_of: the positions of the arguments that the Call's n_grads gradients belong to.
    """

    name: str
    arguments: str
    build: Callable
    fake: Callable
    outputs: int
    values: int
    grads_of: tuple


def _gradients(args, spec: OpSpec, grads, need) -> list:
    """The gradients as op outputs: each shaped as its argument, an empty tensor where not
    needed (an op returns tensors)."""
    return [g.reshape(args[i].shape) if want and g is not None else args[0].new_empty(0)
            for i, g, want in zip(spec.grads_of, grads, need)]


def _like(args, spec: OpSpec) -> list:
    """Empty tensors shaped as the `grads_of` arguments (None for an absent one)."""
    return [None if args[i] is None else args[i].new_empty(args[i].shape) for i in spec.grads_of]


def _stored(saved, outputs) -> list:
    """What the forward pass saved, as op outputs (one that is an output is copied: an op's
    outputs never alias each other)."""
    return [s.clone() if any(s is o for o in outputs) else s for s in saved]


def define(spec: OpSpec):
    """Register spec's op pair and autograd rule; returns the forward op.

    ``logitless::<name>_<OP_SUFFIX>(arguments, bool[] grads_now) -> Tensor[]``: the Call's outputs, what
    its backward pass reads, then the gradients of the `grads_of` arguments for an upstream
    gradient of 1 where grads_now is set (empty tensors elsewhere).
    ``<name>_<OP_SUFFIX>_backward(Tensor?[] upstream, Tensor[] saved, arguments, bool[] need)``: the
    gradients, recomputed from the saved values (empty where `need` is not set)."""

    def forward(*args):
        *args, grads_now = args
        need = tuple(grads_now)
        call, tensors = spec.build(*args, need)
        outputs, saved, formed = call.forward(tensors, need)
        if any(need) and formed is None:  # the plan formed none in its forward pass: the backward pass now
            one = torch.ones((), dtype=outputs[0].dtype, device=outputs[0].device)
            formed = call.backward(tensors, saved, (one,) + (None,) * (len(outputs) - 1), need)
        return [*outputs, *_stored(saved, outputs), *_gradients(args, spec, formed or (None,) * len(need), need)]

    def forward_fake(*args):
        *args, grads_now = args
        outputs, saved = spec.fake(*args)
        grads = _like(args, spec)
        return [*(t.new_empty(t.shape) for t in (*outputs, *saved)), *_gradients(args, spec, grads, grads_now)]

    def backward(*args):
        upstream, saved, *args, need = args
        call, tensors = spec.build(*args, tuple(need))
        upstream = tuple(None if u is None else u.contiguous() for u in upstream)  # an expanded one has stride 0
        return _gradients(args, spec, call.backward(tensors, tuple(saved), upstream, tuple(need)), need)

    def backward_fake(upstream, saved, *args):
        *args, need = args
        return _gradients(args, spec, _like(args, spec), need)

    name = f"logitless::{spec.name}_{OP_SUFFIX}"
    op = torch.library.custom_op(name, forward, mutates_args=(),
                                 schema=f"({spec.arguments}, bool[] grads_now) -> Tensor[]")
    op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(
        name + "_backward", backward, mutates_args=(),
        schema=f"(Tensor?[] upstream, Tensor[] saved, {spec.arguments}, bool[] need) -> Tensor[]")
    backward_op.register_fake(backward_fake)
    n_grads = len(spec.grads_of)

    def setup_context(ctx, inputs, output):
        ctx.tensors = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.others = {i: a for i, a in enumerate(inputs) if not isinstance(a, torch.Tensor)}
        ctx.n_inputs = len(inputs)
        ctx.formed = any(inputs[-1])
        ctx.need = [bool(ctx.needs_input_grad[i]) and inputs[i] is not None for i in spec.grads_of]
        kept = output[len(output) - n_grads:] if ctx.formed else output[spec.outputs: len(output) - n_grads]
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensors), *kept)

    def backward_rule(ctx, grads):
        tensors = ctx.saved_tensors
        args = [None] * ctx.n_inputs
        for i, a in ctx.others.items():
            args[i] = a
        for i, t in zip(ctx.tensors, tensors):
            args[i] = t
        kept = tensors[len(ctx.tensors):]
        if ctx.formed:  # in fp32: rounding the upstream gradient to a 16-bit gradient's dtype would scale it wrongly
            out = [(g.float() * grads[0]).to(g.dtype) if need else None for g, need in zip(kept, ctx.need)]
        else:
            out = backward_op(list(grads[: spec.values]), list(kept), *args[:-1], ctx.need)
            out = [g if need else None for g, need in zip(out, ctx.need)]
        result = [None] * ctx.n_inputs
        for i, g in zip(spec.grads_of, out):
            result[i] = g
        return tuple(result)

    op.register_autograd(backward_rule, setup_context=setup_context)
    return op
