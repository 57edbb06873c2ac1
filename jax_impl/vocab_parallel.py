"""Cross-entropy of a head split over the vocabulary across a mesh axis, inside `jax.shard_map`.

Each device along the axis holds an equal, contiguous slice of the head's classes (its rows
of W in "VD", its columns in "DV", its part of the bias), in the axis' index order, and the
same rows x and global targets. As in `torch_impl.vocab_parallel`: each device reduces its
classes to per-row statistics (`blocked.row_statistics`), the devices combine them with one
pmax and psums of a few floats per row (never logits) into the global lse, the target's
logit and the class-weighted sum, and the backward pass recomputes each device's logits into
its dz (`blocked.gradients`: the kernels' steps, or jax.numpy's for "chunked"), giving its
slice of grad_weight and grad_bias and, summed over the axis, the full grad_input. The forward pass computes statistics only, the backward pass
recomputes the logits (8 N D V / P flops per device). The other losses split their heads in
their own row loops (`jax_impl.distill_blocked`, `jax_impl.log_probs`), with `global_lse`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_impl import blocked
from jax_impl.blocked import BlockedConfig
from jax_impl.rows import TargetRows, reduce_loss, row_coefficients, row_loss


def local_columns(c, local_vocab: int, axis: str | None):
    """Class ids (targets, teacher ids; -1: none) as a split head's row steps read them:
    this device's columns, -1 where another device holds the class; themselves without an
    axis. Taken inside a row loop's step, the loop's per-row outputs stay the same on every
    device (`jax_impl.rows.row_loop` types them from its operands)."""
    if axis is None:
        return c
    first = jax.lax.axis_index(axis) * local_vocab
    return jnp.where((c >= first) & (c < first + local_vocab), c - first, -1).astype(c.dtype)


def summed_grad_input(dx, x_ND, axis: str | None):
    """grad_input in x's dtype: on a split head, every device's share (in the compute dtype)
    summed over the axis first, then rounded once (one share can be much larger than the
    sum)."""
    return (dx if axis is None else jax.lax.psum(dx, axis)).astype(x_ND.dtype)


def _split(y_N, cw_V, local_vocab: int, axis: str):
    """(targets as this device's column indices, -1 where another device holds the class;
    this device's class weights or None; the whole head's V)."""
    first = jax.lax.axis_index(axis) * local_vocab
    y_local = local_columns(y_N, local_vocab, axis).astype(jnp.int32)
    cw_local = None if cw_V is None else jax.lax.dynamic_slice_in_dim(cw_V, first, local_vocab)
    return y_local, cw_local, local_vocab * jax.lax.psum(1, axis)


def global_lse(lse_local, axis: str):
    """logsumexp over the axis of each device's lse; NaN where any device's is NaN."""
    m = jax.lax.pmax(lse_local, axis)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jax.lax.psum(jnp.exp(lse_local - shift), axis)
    lse = jnp.where(jnp.isfinite(m), shift + jnp.log(total), m)
    return jnp.where(jax.lax.psum(jnp.isnan(lse_local).astype(jnp.int32), axis) > 0, jnp.nan, lse)


def _problem(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis: str):
    local_vocab = W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]
    y_local, cw_local, vocab = _split(y_N, cw_V, local_vocab, axis)
    prob = blocked.Problem(x_ND, W, b_V, cw_local, y_local, cfg)
    cw = None if cw_V is None else cw_V.astype(prob.wide)
    rows = TargetRows.build(y_N, cw, vocab, cfg.options.ignore_index, prob.wide)
    return prob, y_local, rows, vocab if cw is None else cw.sum(), vocab


def forward(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis: str):
    """(loss, lse [N]) of this device's slice of the head, combined over `axis`."""
    prob, y_local, rows, cw_sum, vocab = _problem(x_ND, W, b_V, cw_V, y_N, cfg, axis)
    lse_local, s_y, ws = blocked.row_statistics(prob, x_ND, y_local)
    lse = global_lse(lse_local, axis)
    s_y, ws = jax.lax.psum((s_y, ws), axis)
    opts = cfg.options
    return reduce_loss(row_loss(lse, s_y, ws, rows, opts, cw_sum, vocab), rows, opts.reduction), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def vocab_parallel_cross_entropy(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis: str):
    """(loss, lse [N]) over flattened rows x [N, D] and this device's slice of the head;
    fp32 (fp64 for fp64 input), the same on every device of `axis`."""
    return forward(x_ND, W, b_V, cw_V, y_N, cfg, axis)


def _fwd(x_ND, W, b_V, cw_V, y_N, cfg, axis):
    loss, lse = forward(x_ND, W, b_V, cw_V, y_N, cfg, axis)
    return (loss, lse), (x_ND, W, b_V, cw_V, y_N, lse)


def _bwd(cfg, axis, res, cotangents):
    return backward(*cotangents, *res, cfg, axis) + (None, None)


def backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse, cfg: BlockedConfig, axis: str):
    """(dx summed over `axis`, this device's dW and db) for the upstream gradients of
    (loss, lse), recomputing the device's logits."""
    prob, y_local, rows, cw_sum, vocab = _problem(x_ND, W, b_V, cw_V, y_N, cfg, axis)
    coefs = row_coefficients(g_loss, g_lse, lse, rows, cw_sum, cfg.options, vocab)
    # grad_input summed over the axis in fp32 and rounded once: one device's share can be much
    # larger than the sum (the target's -W_y on one device, p W on the others)
    dx, dW, db = blocked.gradients(prob, x_ND, y_local, lse, coefs, dx_dtype=prob.wide)
    return summed_grad_input(dx, x_ND, axis), dW, db


vocab_parallel_cross_entropy.defvjp(_fwd, _bwd)


def config(cfg: BlockedConfig) -> BlockedConfig:
    """A plan's configuration for this path: every row computed, statistics from the blocks."""
    return dataclasses.replace(cfg, skip_ignored=False, fused_stats=False)
