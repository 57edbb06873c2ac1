"""`linear_cross_entropy` for JAX: checks the call, then runs the best path available."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from interop.blocking import speed_extra_bytes
from interop.options import CrossEntropyOptions, check_filter_eps, check_inputs, check_strategy, default_chunk_rows, target_out_of_range_message
from jax_impl.chunked import ChunkedConfig, chunked_linear_cross_entropy

try:
    from jax_impl import blocked, kernels
except ImportError:  # no Pallas: the chunked path serves every call
    blocked = kernels = None


def _dtype_name(a) -> str:
    return jnp.dtype(a.dtype).name


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
    GPU unless LOGITLESS_PALLAS_INTERPRET=1, or fp64)."""
    if strategy == "chunked" or kernels is None or not kernels.kernels_can_run(platform) or jnp.dtype(dtype) == jnp.float64:
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
    `jax.custom_vjp`), usable under `jax.jit`.

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
    input, linear_weight, target = jnp.asarray(input), jnp.asarray(linear_weight), jnp.asarray(target)
    shape = check_inputs(
        input_shape=input.shape,
        input_dtype=_dtype_name(input),
        weight_shape=linear_weight.shape,
        weight_dtype=_dtype_name(linear_weight),
        target_shape=target.shape,
        target_dtype=_dtype_name(target),
        bias_shape=None if linear_bias is None else jnp.shape(linear_bias),
        bias_dtype=None if linear_bias is None else _dtype_name(jnp.asarray(linear_bias)),
        class_weight_shape=None if weight is None else jnp.shape(weight),
        class_weight_dtype=None if weight is None else _dtype_name(jnp.asarray(weight)),
        weight_layout=weight_layout,
    )
    x_ND = input.reshape(shape.n_rows, shape.hidden)
    y_N = target.reshape(shape.n_rows)
    _check_target_range(y_N, shape.vocab, opts.ignore_index)
    platform = platform_of(x_ND)
    strategy = choose_strategy(strategy, x_ND.dtype, shape.n_rows, shape.hidden, shape.vocab, platform)
    if strategy == "chunked":
        cfg = ChunkedConfig(
            opts, weight_layout, default_chunk_rows(shape.n_rows, shape.hidden, shape.vocab), accumulate_in_input_dtype
        )
        loss, lse_N = chunked_linear_cross_entropy(x_ND, linear_weight, linear_bias, weight, y_N, cfg)
    else:
        cfg = blocked.plan(opts, weight_layout, strategy, shape.n_rows, shape.hidden, shape.vocab, x_ND.dtype,
                           accumulate_in_input_dtype, return_lse, platform)
        loss, lse_N = blocked.blocked_linear_cross_entropy(
            x_ND, linear_weight, linear_bias, weight, y_N.astype(jnp.int32), cfg
        )
    if opts.reduction == "none":
        loss = loss.reshape(shape.lead_shape)
    if return_lse:
        return loss, lse_N.reshape(shape.lead_shape)
    return loss
