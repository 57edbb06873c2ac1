"""`linear_cross_entropy` for JAX: checks the call, then runs the best path available."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from interop.blocking import speed_extra_bytes
from interop.options import CrossEntropyOptions, check_filter_eps, check_inputs, check_strategy, default_chunk_rows, target_out_of_range_message
from jax_impl.chunked import ChunkedConfig, chunked_linear_cross_entropy
from jax_impl.rows import narrow_targets
from jax_impl.sharding import on_mesh, row_spec

try:
    from jax_impl import blocked, kernels
except ImportError:  # no Pallas: the chunked path serves every call
    blocked = kernels = None


def dtype_name(a) -> str | None:
    """The dtype's name as interop's checks take it ("bfloat16", "int64"); None for None."""
    return None if a is None else jnp.dtype(a.dtype).name


def shape_of(a) -> tuple | None:
    """The shape as a tuple; None for None (an argument not given)."""
    return None if a is None else tuple(a.shape)


def as_array(name: str, value):
    """`value` as a JAX array, where it is a JAX or NumPy array (or NumPy scalar) of
    numbers; anything else (a list, a string, a Python number, whose dtype would be a
    guess) raises TypeError naming the argument."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        try:
            return jnp.asarray(value)
        except TypeError:  # not numbers (strings, objects)
            pass
    dtype = getattr(value, "dtype", None)
    got = type(value).__name__ + ("" if dtype is None else f" of dtype {dtype}")
    raise TypeError(f"{name} must be a JAX or NumPy array of numbers, got {got}")


def maybe_array(name: str, value):
    """`as_array` for an optional argument (None stays None)."""
    return None if value is None else as_array(name, value)


def _check_target_range(y_N, vocab: int, ignore_index: int) -> None:
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


def platform_of(x) -> str:
    """Where a call on `x` runs: its device's platform for a concrete array; under a trace
    (jit), JAX's default backend (arrays committed to another device are not seen there)."""
    if isinstance(x, jax.core.Tracer):
        return jax.default_backend()
    return next(iter(x.devices())).platform


def choose_strategy(strategy: str, dtype, n_rows: int, hidden: int, vocab: int, platform: str) -> str:
    """Resolve "auto" and route to "chunked" where the Pallas kernels can't run (not on a
    GPU unless LOGITLESS_PALLAS_INTERPRET=1, fp64, or a hidden size of 0: the kernels' blocks
    of x and W would have no columns; XLA's products of [N, 0] by [0, V] are zeros)."""
    if (strategy == "chunked" or kernels is None or not kernels.kernels_can_run(platform)
            or jnp.dtype(dtype) == jnp.float64 or hidden == 0):
        return "chunked"
    if strategy != "auto":
        return strategy
    if platform != "gpu":
        return "chunked"
    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    extra = speed_extra_bytes(n_rows, hidden, vocab, jnp.dtype(dtype).itemsize)
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
):
    """Cross-entropy of ``input @ W.T + linear_bias`` without the N x V logits.

    The same options, defaults and semantics as `torch_impl.linear_cross_entropy`
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

    Returns:
        The loss, fp32 (fp64 for fp64 input): a scalar, or [...] for reduction="none";
        with ``return_lse``, the tuple (loss, lse [...]).
    """
    opts = CrossEntropyOptions(reduction, ignore_index, label_smoothing, z_loss, softcap)
    check_strategy(strategy)
    check_filter_eps(filter_eps)
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
    )
    n, lead = shape.n_rows, shape.lead_shape
    _check_target_range(target, shape.vocab, opts.ignore_index)
    y, ignore32 = narrow_targets(target, shape.vocab, opts.ignore_index)
    opts = dataclasses.replace(opts, ignore_index=ignore32)
    platform = platform_of(input)
    strategy = choose_strategy(strategy, input.dtype, n, shape.hidden, shape.vocab, platform)
    if strategy == "chunked":
        cfg = ChunkedConfig(opts, weight_layout, default_chunk_rows(n, shape.hidden, shape.vocab), accumulate_in_input_dtype)
        run = chunked_linear_cross_entropy
    else:
        cfg = blocked.plan(opts, weight_layout, strategy, n, shape.hidden, shape.vocab, input.dtype,
                           accumulate_in_input_dtype, return_lse, platform)
        run = blocked.blocked_linear_cross_entropy

    def rows(x, W, y, b, cw):
        loss, lse_N = run(x.reshape(n, shape.hidden), W, b, cw, y.reshape(n), cfg)
        return (loss.reshape(lead) if opts.reduction == "none" else loss), lse_N.reshape(lead)

    out_specs = lambda: (row_spec(input) if opts.reduction == "none" else P(), row_spec(input))
    loss, lse = on_mesh(rows, (input, linear_weight, y, linear_bias, weight), out_specs)
    return (loss, lse) if return_lse else loss
