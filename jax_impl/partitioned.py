"""Cross-entropy under `jax.jit` with sharded operands, through `custom_partitioning`.

XLA's partitioner cannot split a Pallas kernel (a custom call) by itself: left alone it
would gather every operand of the loss onto every device. The two rules of the custom_vjp
(`jax_impl.function`) therefore run as `custom_partitioning` functions, which tell it how:

- rows: each device computes the rows it holds (the input's sharding of its rows, when the
  number of rows divides evenly); targets and per-row outputs (lse, a per-row loss,
  grad_input) keep that sharding. The mean's denominator, the reduced loss, grad_weight and
  grad_bias are summed over those axes (in fp32).
- classes: a head sharded on its vocabulary dimension over one mesh axis that the rows do
  not use (and that divides V evenly) is split there as `jax_impl.vocab_parallel` splits it:
  per-row statistics combined over that axis, never logits; grad_weight and grad_bias keep
  the head's sharding, grad_input is summed over the axis.
- anything else is gathered as XLA gathers a matrix product's operand: the head's hidden
  dimension, a head sharded over the rows' axes (FSDP), class weights. Activations never.

On one device, and inside `jax.shard_map`, JAX runs the functions' bodies (the single-device
code) unchanged; under `jax.vmap`, the bodies are batched (`custom_vmap`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_impl import blocked, vocab_parallel
from jax_impl.blocked import BlockedConfig
from jax_impl.kernels import no_derivative
from jax_impl.rows import TargetRows, compute_dtype


@dataclasses.dataclass(frozen=True)
class Call:
    """The static part of one partitioned call: the configuration and which optional
    operands are real (absent ones travel as zeros, so that every call has the same operands)."""

    cfg: BlockedConfig
    has_bias: bool
    has_class_weights: bool

    def optional(self, b_V, cw_V):
        return b_V if self.has_bias else None, cw_V if self.has_class_weights else None


def _axes(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _split(mesh, x_sharding, w_sharding, n_rows: int, vocab: int, call: Call):
    """(row axes, vocabulary axis or None) of a call, from its operands' shardings."""
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    x_spec = tuple(getattr(x_sharding, "spec", ()) or ())
    rows = _axes(x_spec[0]) if x_spec else ()
    if rows and n_rows % size(rows):
        rows = ()  # uneven rows would be padded: compute every row everywhere instead
    w_spec = tuple(getattr(w_sharding, "spec", ()) or ())
    v_dim = 0 if call.cfg.weight_layout == "VD" else 1
    v_axes = _axes(w_spec[v_dim]) if len(w_spec) > v_dim else ()
    vocab_axis = None
    if len(v_axes) == 1 and v_axes[0] not in rows and vocab % size(v_axes) == 0 and size(v_axes) > 1:
        vocab_axis = v_axes[0]
    return rows, vocab_axis


def _specs(rows: tuple, vocab_axis, call: Call):
    """PartitionSpecs of x [N, D], W, a [V] vector, a replicated [V] vector, and per-row [N] values (y, lse)."""
    r = rows if len(rows) != 1 else rows[0]
    r = r or None
    w = P(vocab_axis, None) if call.cfg.weight_layout == "VD" else P(None, vocab_axis)
    return P(r, None), w, P(vocab_axis), P(), P(r)


def _local_config(cfg: BlockedConfig, rows: tuple, vocab_axis, x_ND, W) -> BlockedConfig:
    """The configuration each device runs, planned for its rows and classes: "mean" as
    "sum" when the rows are split (the denominator is global), the vocabulary split's own
    when the classes are."""
    opts = cfg.options
    if rows and opts.reduction == "mean":
        opts = dataclasses.replace(opts, reduction="sum")
    local = blocked.plan(cfg.tuning, opts, cfg.weight_layout, cfg.strategy, x_ND.shape[0], x_ND.shape[1], _vocab(W, cfg),
                         x_ND.dtype, cfg.accumulate_in_input_dtype, cfg.return_lse, "cpu" if cfg.interpret else "gpu")
    return vocab_parallel.config(local) if vocab_axis else local


def _denominator(y_N, cw_V, cfg: BlockedConfig, vocab: int, rows: tuple, dtype):
    """The mean's denominator over every device's rows: the valid rows' summed class weight."""
    cw = None if cw_V is None else cw_V.astype(dtype)
    total = TargetRows.build(y_N, cw, vocab, cfg.options.ignore_index, dtype).cw_y.sum()
    return jax.lax.psum(total, rows)


def _sum_over(g, rows: tuple, scale=None):
    """A gradient summed over the row axes in fp32 (fp64 for fp64) and scaled, back in its dtype."""
    if g is None:
        return None
    wide = g.astype(compute_dtype(g.dtype))
    if rows:
        wide = jax.lax.psum(wide, rows)
    if scale is not None:
        wide = wide * scale
    return wide.astype(g.dtype)


def _vocab(W, cfg: BlockedConfig) -> int:
    return W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]


def _zeros_for_absent(g, like):
    return jnp.zeros(like.shape, like.dtype) if g is None else g


REPLICATED_HIDDEN = {"need_replication_factors": ("d",)}  # the hidden dimension is gathered, never split


def _rule(call: Call, *parts: str) -> str:
    w = "v d" if call.cfg.weight_layout == "VD" else "d v"
    return f"n d, {w}, v, v, n" + "".join(parts)


# ----------------------------------------------------------------------------- forward


def _batched(body, axis_size, in_batched, *args):
    """A custom_vmap rule: the single-device body under jax.vmap (custom_partitioning has no
    batching rule of its own)."""
    outs = jax.vmap(body, in_axes=tuple(0 if b else None for b in in_batched))(*args)
    return outs, jax.tree.map(lambda _: True, outs)


@functools.cache
def _with_vmap(partitioned_fn, body, *static):
    """partitioned_fn(*args, *static), batched by jax.vmap as body(*args, *static) is, and
    refusing derivatives as the kernels inside it do (`kernels.no_derivative`); one function
    per configuration (cached), so that JAX's caches of traced functions hit across calls."""
    fn = custom_vmap(lambda *args: partitioned_fn(*args, *static))
    fn.def_vmap(functools.partial(_batched, lambda *args: body(*args, *static)))
    fn = jax.custom_jvp(fn)
    fn.defjvp(no_derivative)
    return fn


def forward(x_ND, W, b_V, cw_V, y_N, call: Call, with_grads: bool):
    """`blocked.forward` over the whole operands: (loss, lse) or, with_grads, (loss, lse,
    dx, dW, db) for an upstream gradient of 1 (db zeros without a bias); partitioned over
    sharded operands under jit."""
    return _with_vmap(_partitioned_forward, _forward_body, call, with_grads)(x_ND, W, b_V, cw_V, y_N)


def _forward_body(x_ND, W, b_V, cw_V, y_N, call: Call, with_grads: bool):
    b, cw = call.optional(b_V, cw_V)
    loss, lse, grads = blocked.forward(x_ND, W, b, cw, y_N, call.cfg, with_grads)
    if not with_grads:
        return loss, lse
    dx, dW, db = grads
    return loss, lse, dx, dW, _zeros_for_absent(db, b_V)


def _forward_partition(call: Call, with_grads: bool, mesh, arg_shapes, result_shape):
    x, W = arg_shapes[0], arg_shapes[1]
    cfg = call.cfg
    rows, vocab_axis = _split(mesh, x.sharding, W.sharding, x.shape[0], _vocab(W, cfg), call)
    x_spec, w_spec, v_spec, rep, row_spec = _specs(rows, vocab_axis, call)
    reduced = cfg.options.reduction != "none"
    mean = rows and cfg.options.reduction == "mean"

    def lower(x_ND, W, b_V, cw_V, y_N):
        b, cw = call.optional(b_V, cw_V)
        local = _local_config(cfg, rows, vocab_axis, x_ND, W)
        if vocab_axis:
            loss, lse = vocab_parallel.forward(x_ND, W, b, cw, y_N, local, vocab_axis)
            grads = None
            if with_grads:
                one = jnp.ones((), jnp.float32)
                grads = vocab_parallel.backward(one, jnp.zeros_like(lse), x_ND, W, b, cw, y_N, lse, local, vocab_axis)
        else:
            loss, lse, grads = blocked.forward(x_ND, W, b, cw, y_N, local, with_grads)
        scale = None
        if reduced and rows:
            loss = jax.lax.psum(loss, rows)
        if mean:
            vocab = _vocab(W, cfg) * (mesh.shape[vocab_axis] if vocab_axis else 1)
            scale = 1.0 / _denominator(y_N, cw, cfg, vocab, rows, loss.dtype)
            loss = loss * scale
        if not with_grads:
            return loss, lse
        dx, dW, db = grads
        dx = dx if scale is None else (dx.astype(scale.dtype) * scale).astype(dx.dtype)
        return loss, lse, dx, _sum_over(dW, rows, scale), _zeros_for_absent(_sum_over(db, rows, scale), b_V)

    named = lambda spec: NamedSharding(mesh, spec)
    args = tuple(map(named, (x_spec, w_spec, v_spec, rep, row_spec)))
    outs = (named(rep if reduced else row_spec), named(row_spec))
    if with_grads:
        outs += (named(x_spec), named(w_spec), named(v_spec))
    return mesh, lower, outs, args


def _forward_rule(call: Call, with_grads: bool, *_):
    loss = "" if call.cfg.options.reduction != "none" else "n"
    w = "v d" if call.cfg.weight_layout == "VD" else "d v"
    return _rule(call, f" -> {loss}, n" + (f", n d, {w}, v" if with_grads else "")), REPLICATED_HIDDEN


def _forward_infer(call: Call, with_grads: bool, mesh, arg_shapes, result_shape):
    return _forward_partition(call, with_grads, mesh, arg_shapes, result_shape)[2]


_partitioned_forward = custom_partitioning(_forward_body, static_argnums=(5, 6))
_partitioned_forward.def_partition(partition=_forward_partition, infer_sharding_from_operands=_forward_infer,
                      sharding_rule=_forward_rule)


# ----------------------------------------------------------------------------- backward


def backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N, call: Call):
    """`blocked.backward` over the whole operands: (dx, dW, db), db zeros without a bias;
    partitioned over sharded operands under jit."""
    return _with_vmap(_partitioned_backward, _backward_body, call)(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N)


def _backward_body(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N, call: Call):
    b, cw = call.optional(b_V, cw_V)
    dx, dW, db = blocked.backward(g_loss, g_lse, x_ND, W, b, cw, y_N, lse_N, call.cfg)
    return dx, dW, _zeros_for_absent(db, b_V)


def _backward_partition(call: Call, mesh, arg_shapes, result_shape):
    x, W = arg_shapes[2], arg_shapes[3]
    cfg = call.cfg
    rows, vocab_axis = _split(mesh, x.sharding, W.sharding, x.shape[0], _vocab(W, cfg), call)
    x_spec, w_spec, v_spec, rep, row_spec = _specs(rows, vocab_axis, call)
    reduced = cfg.options.reduction != "none"

    def lower(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N):
        b, cw = call.optional(b_V, cw_V)
        local = _local_config(cfg, rows, vocab_axis, x_ND, W)
        if rows and cfg.options.reduction == "mean":
            vocab = _vocab(W, cfg) * (mesh.shape[vocab_axis] if vocab_axis else 1)
            g_loss = g_loss / _denominator(y_N, cw, cfg, vocab, rows, g_loss.dtype)
        if vocab_axis:
            dx, dW, db = vocab_parallel.backward(g_loss, g_lse, x_ND, W, b, cw, y_N, lse_N, local, vocab_axis)
        else:
            dx, dW, db = blocked.backward(g_loss, g_lse, x_ND, W, b, cw, y_N, lse_N, local)
        return dx, _sum_over(dW, rows), _zeros_for_absent(_sum_over(db, rows), b_V)

    named = lambda spec: NamedSharding(mesh, spec)
    args = tuple(map(named, (rep if reduced else row_spec, row_spec, x_spec, w_spec, v_spec, rep, row_spec, row_spec)))
    return mesh, lower, (named(x_spec), named(w_spec), named(v_spec)), args


def _backward_rule(call: Call, *_):
    g = "" if call.cfg.options.reduction != "none" else "n"
    w = "v d" if call.cfg.weight_layout == "VD" else "d v"
    return f"{g}, n, " + _rule(call, f", n -> n d, {w}, v"), REPLICATED_HIDDEN


def _backward_infer(call: Call, mesh, arg_shapes, result_shape):
    return _backward_partition(call, mesh, arg_shapes, result_shape)[2]


_partitioned_backward = custom_partitioning(_backward_body, static_argnums=(8,))
_partitioned_backward.def_partition(partition=_backward_partition, infer_sharding_from_operands=_backward_infer,
                       sharding_rule=_backward_rule)
