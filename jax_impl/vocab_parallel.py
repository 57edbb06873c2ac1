"""A head split over the vocabulary across a mesh axis (a `jax.shard_map` axis, or the one
`jax_impl.partitioned` finds under jit): what every loss's row loop shares.

Each device along the axis holds an equal, contiguous slice of the head's classes (its rows
of W in "VD", its columns in "DV", its part of the bias), in the axis' index order, and the
same rows x and global targets. As in `torch_impl.vocab_parallel`, each device reduces its
classes to per-row statistics, the devices combine them (`global_lse`: a pmax and psums of a
few floats per row, never logits), and each device's dz gives its slice of grad_weight and
grad_bias and, summed over the axis, the full grad_input (`summed_grad_input`). The losses'
loops (`jax_impl.blocked`, and `jax_impl.engine` for the other losses) take the axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def global_lse(lse_local, axis: str):
    """logsumexp over the axis of each device's lse; NaN where any device's is NaN."""
    m = jax.lax.pmax(lse_local, axis)
    shift = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jax.lax.psum(jnp.exp(lse_local - shift), axis)
    lse = jnp.where(jnp.isfinite(m), shift + jnp.log(total), m)
    return jnp.where(jax.lax.psum(jnp.isnan(lse_local).astype(jnp.int32), axis) > 0, jnp.nan, lse)
