"""The custom_vjp of JAX's cross-entropy (`jax_impl.blocked`), every strategy.

The primal computes the statistics only (a call that takes no gradient). Under
differentiation, a kernel plan of whole-row blocks with a reduced loss and no returned lse
forms the gradients in the forward rule (6 N D V flops) and the backward rule scales them by
the upstream gradient; every other plan saves its inputs and lse, and the backward rule
recomputes the logits block by block. On "chunked"'s jax.numpy steps both rules are plain
XLA, so the derivative can be differentiated again. The kernel plans' passes run through
`jax_impl.partitioned`, which splits them over the devices of sharded operands under jit:
a device plans its blocks for its rows and classes, a split head combines each row block's
statistics over its axis (`blocked.forward`), and with split rows "mean" is "sum" over the
global denominator. Inside shard_map, the `vocab_parallel` axis is the same split.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_impl import blocked, partitioned
from jax_impl.blocked import BlockedConfig
from jax_impl.partitioned import Axes, Layout
from jax_impl.rows import TargetRows, compute_dtype


def _layout(cfg: BlockedConfig, outputs: tuple) -> Layout:
    """x, W, b, the class weights (every class on every device: "c"), y; the outputs named,
    "W" for W's factors."""
    w = "v d" if cfg.weight_layout == "VD" else "d v"
    return Layout(("n d", w, "v", "c", "n"), tuple(w if o == "W" else o for o in outputs))


def _local(cfg: BlockedConfig, axes: Axes, x_ND, W, y_N, cw_V):
    """(configuration, scale): the plan for a device's rows and classes, with split rows
    "mean" as "sum" and scale the reciprocal of every device's valid rows' summed class
    weight (else None); on whole operands, the call's own."""
    if not axes.rows and axes.vocab is None:
        return cfg, None
    opts, scale = cfg.options, None
    vocab = W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]
    if axes.rows and opts.reduction == "mean":
        opts = dataclasses.replace(opts, reduction="sum")
        whole = vocab * (jax.lax.psum(1, axes.vocab) if axes.vocab else 1)
        wide = compute_dtype(x_ND.dtype)
        rows = TargetRows.build(y_N, None if cw_V is None else cw_V.astype(wide), whole, opts.ignore_index, wide)
        scale = 1.0 / jax.lax.psum(rows.cw_y.sum(), axes.rows)
    local = blocked.plan(cfg.tuning, opts, cfg.weight_layout, cfg.strategy, x_ND.shape[0], x_ND.shape[1], vocab,
                         x_ND.dtype, cfg.accumulate_in_input_dtype, cfg.return_lse, "cpu" if cfg.interpret else "gpu")
    return (blocked.split_config(local) if axes.vocab else local), scale


def _scaled(g, scale):
    return g if g is None or scale is None else (g.astype(scale.dtype) * scale).astype(g.dtype)


def _forward_pass(static, axes: Axes, x_ND, W, b_V, cw_V, y_N):
    """(loss, lse, dx, dW, db) of a device's rows and classes; the gradients (for an upstream
    gradient of 1) where static's with_grads is set, else None."""
    cfg, with_grads = static
    local, scale = _local(cfg, axes, x_ND, W, y_N, cw_V)
    loss, lse, grads = blocked.forward(x_ND, W, b_V, cw_V, y_N, local, with_grads, axes.vocab)
    grads = grads or (None,) * 3
    return (_scaled(loss, scale), lse) + tuple(_scaled(g, scale) for g in grads)


def _backward_pass(cfg: BlockedConfig, axes: Axes, g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N):
    """(dx, dW, db) of a device's rows and classes, recomputing its logits."""
    local, scale = _local(cfg, axes, x_ND, W, y_N, cw_V)
    g_loss = g_loss if scale is None else g_loss * scale
    return blocked.backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N, local, axes.vocab)


def _forward(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis, with_grads: bool):
    loss = "" if cfg.options.reduction != "none" else "n"
    grads = ("n d", "W", None if b_V is None else "v") if with_grads else (None,) * 3
    return partitioned.run(_forward_pass, (cfg, with_grads), _layout(cfg, (loss, "n") + grads), x_ND, W, b_V, cw_V, y_N,
                           axis=axis)


def _statistics(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis):
    """(loss, lse): the kernels' through `partitioned`; "chunked"'s directly (plain XLA, which
    the partitioner splits itself, and which stays differentiable)."""
    if cfg.strategy == "chunked":
        return blocked.forward(x_ND, W, b_V, cw_V, y_N, cfg, False, axis)[:2]
    return _forward(x_ND, W, b_V, cw_V, y_N, cfg, axis, False)[:2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def blocked_linear_cross_entropy(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis: str | None = None):
    """(loss, lse [N]) over flattened rows x [N, D], y [N] (int32); fp32 (fp64 for fp64 input).
    axis: inside shard_map, the axis splitting the head over the vocabulary (W and b the
    device's slice; cfg then `blocked.split_config`'s)."""
    return _statistics(x_ND, W, b_V, cw_V, y_N, cfg, axis)


def _fwd(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis):
    if cfg.grads_in_forward:  # kernel plans only
        loss, lse, *grads = _forward(x_ND, W, b_V, cw_V, y_N, cfg, axis, True)
        return (loss, lse), tuple(grads)
    loss, lse = _statistics(x_ND, W, b_V, cw_V, y_N, cfg, axis)
    return (loss, lse), (x_ND, W, b_V, cw_V, y_N, lse)


def _bwd(cfg: BlockedConfig, axis, res, cotangents):
    g_loss, g_lse = cotangents
    if cfg.grads_in_forward:  # lse is not returned to the caller: its cotangent is zero
        scale = lambda g: None if g is None else (g * g_loss.astype(jnp.float32)).astype(g.dtype)  # kernels: no fp64
        return tuple(map(scale, res)) + (None, None)
    x_ND, W, b_V, cw_V, y_N, lse = res
    if cfg.strategy == "chunked":
        return blocked.backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse, cfg, axis) + (None, None)
    grads = ("n d", "W", None if b_V is None else "v")
    layout = Layout(("" if cfg.options.reduction != "none" else "n", "n") + _layout(cfg, ()).operands + ("n",),
                    _layout(cfg, grads).outputs)
    return partitioned.run(_backward_pass, cfg, layout, g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse,
                           axis=axis) + (None, None)


blocked_linear_cross_entropy.defvjp(_fwd, _bwd)
