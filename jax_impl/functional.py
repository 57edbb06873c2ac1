"""`linear_cross_entropy` for JAX: checks the call, then runs the best path available."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from interop.blocking import speed_extra_bytes
from interop.options import (CrossEntropyOptions, check_filter_eps, check_flags, check_inputs, check_num_items, check_reduction, check_strategy, check_tuning,
                             target_out_of_range_message)
from interop.tuning import Tuning
from jax_impl import blocked, kernels
from jax_impl.cross_entropy_rule import blocked_linear_cross_entropy
from jax_impl.engine import keeps_logits
from jax_impl.rows import narrow_targets
from jax_impl.sharding import on_mesh, row_spec, varying_axes, with_rows_axes


def dtype_name(a) -> str | None:
    """The dtype's name as interop's checks take it ("bfloat16", "int64"); None for None."""
    return None if a is None else jnp.dtype(a.dtype).name


def shape_of(a) -> tuple | None:
    """The shape as a tuple; None for None (an argument not given)."""
    return None if a is None else tuple(a.shape)


def as_array(name: str, value):
    """`value` as a JAX array, where it is a JAX or NumPy array (or NumPy scalar) of
    numbers; anything else (a list, a string, a Python number, whose dtype would be a
    guess) raises TypeError naming the argument. NumPy integers wider than JAX holds them
    (64-bit types off) must fit the narrower type, else ValueError: JAX would wrap them,
    a target 2**32 + 5 into class 5."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        _check_narrowing(name, value)
        try:
            return jnp.asarray(value)
        except TypeError:  # not numbers (strings, objects)
            pass
    dtype = getattr(value, "dtype", None)
    got = type(value).__name__ + ("" if dtype is None else f" of dtype {dtype}")
    raise TypeError(f"{name} must be a JAX or NumPy array of numbers, got {got}")


def _check_narrowing(name: str, value) -> None:
    """ValueError where `value`, a NumPy integer array, holds a number that the integer type
    JAX would convert it to cannot hold."""
    if not isinstance(value, (np.ndarray, np.generic)) or not np.issubdtype(value.dtype, np.integer):
        return
    narrow = np.dtype(jax.dtypes.canonicalize_dtype(value.dtype))
    if narrow == value.dtype:
        return
    v, info = np.asarray(value), np.iinfo(narrow)
    bad = v > info.max if np.issubdtype(v.dtype, np.unsignedinteger) else (v < info.min) | (v > info.max)
    if bad.any():
        raise ValueError(f"{name} holds {v[bad].flat[0]}, which JAX would wrap: without 64-bit types "
                         f"(jax_enable_x64) it converts {v.dtype} to {narrow}, whose range is [{info.min}, {info.max}]")


def maybe_array(name: str, value):
    """`as_array` for an optional argument (None stays None)."""
    return None if value is None else as_array(name, value)


def check_target_range(y_N, vocab: int, ignore_index: int) -> None:
    """Raise ValueError for a target outside [0, V) that is not ignore_index.

    Only for concrete arrays: under jit the target is a tracer, raising is impossible, and
    such rows get a NaN loss instead (interop/SPEC.md).
    """
    if isinstance(y_N, jax.core.Tracer):
        return
    y = np.asarray(y_N)
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
    if bad.any():
        raise ValueError(target_out_of_range_message(int(y[bad][0]), vocab, ignore_index))


def denominator(num_items_in_batch, dtype):
    """num_items_in_batch (None, a number > 0, or an array of one element) as the
    denominator of a mean, a 0-d array in `dtype` (`check_num_items`'s errors else)."""
    if num_items_in_batch is None:
        return None
    check_num_items(num_items_in_batch)
    return jnp.asarray(num_items_in_batch, dtype).reshape(())


def whole_vocab(linear_weight, weight_layout: str, axis) -> int | None:
    """V of a head split over the mesh axis `axis` (inside shard_map): the local classes
    times the axis' size."""
    if not isinstance(axis, str):
        raise TypeError(f"vocab_parallel must be the name of a mesh axis (a str), got {type(axis).__name__}")
    if linear_weight.ndim != 2 or weight_layout not in ("VD", "DV"):
        return None  # check_inputs names the problem
    try:
        size = jax.lax.psum(1, axis)
    except NameError as e:
        raise ValueError(f"vocab_parallel={axis!r} names no mesh axis of an enclosing jax.shard_map") from e
    if axis not in varying_axes(linear_weight):
        # without the type, JAX's transpose can't sum the gradients over the mesh right
        raise ValueError(f"vocab_parallel={axis!r}: linear_weight must be the device's slice of the head, varying over "
                         f"the axis inside jax.shard_map with check_vma=True (the default); got one that does not vary "
                         f"over it (a replicated head, or check_vma=False)")
    return linear_weight.shape[0 if weight_layout == "VD" else 1] * size


def platform_of(x) -> str:
    """Where a call on `x` runs: its device's platform for a concrete array; under a trace
    (jit), JAX's default backend (arrays committed to another device are not seen there)."""
    if isinstance(x, jax.core.Tracer):
        return jax.default_backend()
    return next(iter(x.devices())).platform


def choose_strategy(strategy: str, dtype, n_rows: int, hidden: int, vocab: int, platform: str, t: Tuning) -> str:
    """Resolve "auto" and route to "chunked" where the Pallas kernels can't run (not on a
    GPU unless LOGITLESS_PALLAS_INTERPRET=1, fp64, or a hidden size of 0: the kernels' blocks
    of x and W would have no columns; XLA's products of [N, 0] by [0, V] are zeros)."""
    if (strategy == "chunked" or not kernels.kernels_can_run(platform)
            or jnp.dtype(dtype) == jnp.float64 or hidden == 0):
        return "chunked"
    if strategy != "auto":
        return strategy
    if platform != "gpu":
        return "chunked"
    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    extra = speed_extra_bytes(t, n_rows, hidden, vocab, jnp.dtype(dtype).itemsize)
    return "speed" if extra <= 0.25 * free else "memory"


def linear_cross_entropy(
    input,
    linear_weight,
    target,
    *,
    linear_bias=None,
    weight=None,
    reduction: str = "mean",
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    weight_layout: str = "VD",
    strategy: str = "auto",
    accumulate_in_input_dtype: bool = False,
    filter_eps: float | None = None,
    tuning: Tuning | None = None,
    num_items_in_batch=None,
    vocab_parallel: str | None = None,
):
    """Cross-entropy of ``input @ W.T + linear_bias`` without the N x V logits.

    The same options, defaults and semantics as `logitless.torch.linear_cross_entropy`
    (interop/SPEC.md). Differentiable with `jax.grad` / `jax.value_and_grad` (a
    `jax.custom_vjp`; twice, e.g. `jax.hessian`, with strategy="chunked" only: the
    kernels' strategies raise NotImplementedError), usable under `jax.jit`, under a mesh
    of Explicit axes and inside `jax.shard_map` (`jax_impl.sharding`). The array
    arguments are JAX or NumPy arrays; anything else raises TypeError naming it.

    Args:
        input: [..., D] bf16/fp16/fp32(/fp64 with x64) hidden states.
        linear_weight: [V, D] (``weight_layout="VD"``: tied embeddings, ``nnx.Embed``) or
            [D, V] (``"DV"``: the kernel of Flax ``nnx.Linear``, used as is, never
            transposed into a copy); the input's dtype.
        target: [...] integer class indices (or ``ignore_index``).
        linear_bias: optional [V], the input's dtype.
        weight: optional [V] class weights.
        reduction, ignore_index, label_smoothing, z_loss, softcap: see interop/SPEC.md.
        return_lse: also return the per-row logsumexp [...] (differentiable).
        strategy: "auto", "speed", "memory" or "chunked" (interop.options.check_strategy).
        accumulate_in_input_dtype: accumulate grad_weight in the input dtype rather than fp32.
        filter_eps: gradient filtering (interop.options.check_filter_eps), validated and
            accepted for the same call as PyTorch's; XLA's shapes are fixed when a function
            is traced, so no matrix product can be skipped and JAX computes every entry.
        tuning: the block planner's numbers (interop.tuning.Tuning); None for the defaults.
        num_items_in_batch: with reduction="mean", the denominator in place of the valid
            rows' summed class weight (a number > 0 or an array), as in PyTorch.
        vocab_parallel: inside `jax.shard_map`, the name of the mesh axis over which the head
            is split by vocabulary: each device's linear_weight (and linear_bias) hold an
            equal, contiguous slice of the classes in the axis' order; input, target and the
            class weights (all V classes) are the same along the axis
            (`jax_impl.vocab_parallel`). The loss and lse are global; grad_weight is the
            device's slice, grad_input the full gradient. Every strategy.

    Returns:
        The loss, fp32 (fp64 for fp64 input): a scalar, or [...] for reduction="none";
        with ``return_lse``, the tuple (loss, lse [...]).
    """
    check_flags(return_lse=return_lse, accumulate_in_input_dtype=accumulate_in_input_dtype)
    check_reduction(reduction, num_items_in_batch)
    opts = CrossEntropyOptions("sum" if num_items_in_batch is not None else reduction, ignore_index, label_smoothing,
                               z_loss, softcap)
    check_strategy(strategy)
    check_filter_eps(filter_eps)
    tuning = check_tuning(tuning)
    input, linear_weight, target = as_array("input", input), as_array("linear_weight", linear_weight), as_array("target", target)
    linear_bias, weight = maybe_array("linear_bias", linear_bias), maybe_array("weight", weight)
    shape = check_inputs(
        input_shape=input.shape,
        input_dtype=dtype_name(input),
        weight_shape=linear_weight.shape,
        weight_dtype=dtype_name(linear_weight),
        target_shape=target.shape,
        target_dtype=dtype_name(target),
        bias_shape=shape_of(linear_bias),
        bias_dtype=dtype_name(linear_bias),
        class_weight_shape=shape_of(weight),
        class_weight_dtype=dtype_name(weight),
        weight_layout=weight_layout,
        classes=None if vocab_parallel is None else whole_vocab(linear_weight, weight_layout, vocab_parallel),
    )
    n, lead = shape.n_rows, shape.lead_shape
    check_target_range(target, shape.vocab, opts.ignore_index)
    y, ignore32 = narrow_targets(target, shape.vocab, opts.ignore_index)
    opts = dataclasses.replace(opts, ignore_index=ignore32)
    platform = platform_of(input)
    local_vocab = linear_weight.shape[0 if weight_layout == "VD" else 1]
    strategy = choose_strategy(strategy, input.dtype, n, shape.hidden, local_vocab, platform, tuning)
    cfg = blocked.plan(tuning, opts, weight_layout, strategy, n, shape.hidden, local_vocab, input.dtype,
                       accumulate_in_input_dtype, return_lse, platform, None if vocab_parallel is None else shape.vocab)
    # gradients in the backward pass of every row (kept logits hold every row: skipping the
    # ignored ones there, 8 A D V, is cheaper than 6 N D V where a quarter of them are ignored)
    recomputes = not cfg.grads_in_forward and not cfg.fused_stats and not cfg.skip_ignored
    keep = recomputes and keeps_logits(tuning, cfg.strategy, cfg.layout == "rows", n, local_vocab, input.dtype, platform)
    cfg = dataclasses.replace(cfg, keep_logits=keep)
    if vocab_parallel is not None:
        linear_weight, linear_bias = with_rows_axes((linear_weight, linear_bias), input)
        loss, lse = blocked_linear_cross_entropy(input.reshape(n, shape.hidden), linear_weight, linear_bias, weight,
                                                 y.reshape(n), blocked.split_config(cfg), vocab_parallel)
        return _result(loss.reshape(lead) if opts.reduction == "none" else loss, lse.reshape(lead), return_lse,
                       num_items_in_batch)

    def rows(x, W, y, b, cw):
        loss, lse_N = blocked_linear_cross_entropy(x.reshape(n, shape.hidden), W, b, cw, y.reshape(n), cfg)
        return (loss.reshape(lead) if opts.reduction == "none" else loss), lse_N.reshape(lead)

    out_specs = lambda: (row_spec(input) if opts.reduction == "none" else P(), row_spec(input))
    loss, lse = on_mesh(rows, (input, linear_weight, y, linear_bias, weight), out_specs)
    return _result(loss, lse, return_lse, num_items_in_batch)


def _result(loss, lse, return_lse: bool, num_items_in_batch):
    """The call's return value: the loss (divided by num_items_in_batch when given), with lse."""
    if num_items_in_batch is not None:
        loss = loss / denominator(num_items_in_batch, loss.dtype)
    return (loss, lse) if return_lse else loss
