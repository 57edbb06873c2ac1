"""Per-row pieces of the distillation losses (interop/SPEC-DISTILLATION.md) for JAX: what is
O(N) or O(N K), shared by the kernel path and the fallback (as `torch_impl.distill_rows`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from interop.distillation import TopKDistillationOptions


def valid_rows(n_rows: int, target_N, row_mask_N, ignore_index: int):
    """bool [N]: row_mask (if given) and target != ignore_index (if given)."""
    valid = jnp.ones((n_rows,), bool)
    if row_mask_N is not None:
        valid = valid & row_mask_N
    if target_N is not None:
        valid = valid & (target_N != ignore_index)
    return valid


def row_weights(valid_N, reduction: str, grad_loss, num_items, dtype):
    """r [N]: the upstream gradient of each row's loss (0 for invalid rows)."""
    g = jnp.asarray(grad_loss, dtype)
    if reduction == "mean":
        g = g / (valid_N.sum().astype(dtype) if num_items is None else num_items.astype(dtype))
    return jnp.where(valid_N, jnp.broadcast_to(g, valid_N.shape), 0)


def global_denominator(valid_N, num_items, reduction: str, dtype):
    """A mean's denominator as an operand of the passes: num_items, or the count of valid
    rows (taken before the rows are split over devices); None for other reductions without
    num_items."""
    if num_items is None and reduction == "mean":
        return valid_N.sum().astype(dtype)
    return num_items


def reduce_rows(loss_N, valid_N, reduction: str, num_items):
    loss_N = jnp.where(valid_N, loss_N, 0)
    if reduction == "none":
        return loss_N
    if reduction == "sum":
        return loss_N.sum()
    return loss_N.sum() / (valid_N.sum().astype(loss_N.dtype) if num_items is None else num_items.astype(loss_N.dtype))


class TopKTeacher(NamedTuple):
    """The teacher's entries, all [N, K]: ids (int32, -1 for padding), entry (bool: an id
    >= 0 whose log-probability is not -inf; a NaN one is an entry, whose NaN reaches its
    row's loss and gradients as PyTorch's would), P and
    log P (compute dtype, 0 for padding), slot (equal ids of a row share a slot); and bad
    [N], the valid rows whose loss is NaN (an id >= V, or a hard target out of range: what
    an eager call refuses, a traced one can't)."""

    ids: jax.Array
    entry: jax.Array
    P: jax.Array
    logP: jax.Array
    slot: jax.Array
    bad: jax.Array

    @classmethod
    def build(cls, ids_NK, logprobs_NK, renormalize: bool, dtype, bad_N) -> "TopKTeacher":
        lp = logprobs_NK.astype(dtype)
        entry = (ids_NK >= 0) & (lp != -jnp.inf)  # a NaN is an entry: its row's loss is NaN, not hidden
        lp = jnp.where(entry, lp, -jnp.inf)
        if renormalize:
            has = entry.any(axis=1, keepdims=True)
            lse = jax.nn.logsumexp(jnp.where(has, lp, 0), axis=1, keepdims=True)
            lp = lp - jnp.where(has, lse, 0)
        ids = jnp.where(entry, ids_NK, -1).astype(jnp.int32)
        perm = jnp.argsort(ids, axis=1, stable=True)
        sorted_ids = jnp.take_along_axis(ids, perm, axis=1)
        new_run = jnp.concatenate([jnp.ones_like(sorted_ids[:, :1], bool), sorted_ids[:, 1:] != sorted_ids[:, :-1]], axis=1)
        run = jnp.cumsum(new_run, axis=1) - 1
        slot = jnp.take_along_axis(run, jnp.argsort(perm, axis=1), axis=1)
        return cls(ids, entry, jnp.where(entry, jnp.exp(lp), 0), jnp.where(entry, lp, 0), slot, bad_N)


def gather_entries(z_RC, v0, ids_RK, b_V, softcap, dtype):
    """s at the ids inside the block's columns [v0, v0+C), 0 elsewhere: [R, K] in `dtype`."""
    C = z_RC.shape[1]
    col = ids_RK - v0
    inside = (col >= 0) & (col < C)
    s = jnp.take_along_axis(z_RC, jnp.clip(col, 0, C - 1), axis=1).astype(dtype)
    if b_V is not None:
        s = s + b_V[jnp.clip(ids_RK, 0, b_V.shape[0] - 1)].astype(dtype)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return jnp.where(inside, s, 0)


def put_entries(dz_RC, v0, ids_RK, values_RK):
    """dz with dz[r, ids[r, k] - v0] = values[r, k] where that column lies in the block."""
    R, C = dz_RC.shape
    col = ids_RK - v0
    col = jnp.where((col >= 0) & (col < C), col, C)  # out of bounds: dropped
    rows = jnp.broadcast_to(jnp.arange(R)[:, None], col.shape)
    return dz_RC.at[rows, col].set(values_RK.astype(dz_RC.dtype), mode="drop")


def topk_row_terms(s_ids, lse_T, lse_1, s_y, P, logP, entry, bad, o: TopKDistillationOptions):
    """(loss [R] before masking, A [R], C [R, K]): d KD / d (s / T)_j = A q_j + sum_k C_k [j = id_k];
    NaN loss and A for the `bad` rows."""
    lq = s_ids / o.temperature - lse_T[:, None]
    kd = jnp.where(entry, P * (logP - lq), 0).sum(1)
    A, C = P.sum(1), -P
    if o.tail_bucket:
        R = jnp.maximum(1 - P.sum(1), 0)
        Q = jnp.where(entry, jnp.exp(lq), 0).sum(1)
        kd = kd + jnp.where(R > 0, R * (jnp.log(jnp.where(R > 0, R, 1)) - jnp.log1p(-Q)), 0)
        A = A - R * Q / (1 - Q)
        C = C + jnp.where(entry, (R / (1 - Q))[:, None] * jnp.exp(lq), 0)
    loss = o.kd_scale * kd
    if o.weight_hard:
        loss = loss + o.weight_hard * (lse_1 - s_y)
    return jnp.where(bad, jnp.nan, loss), jnp.where(bad, jnp.nan, A), C


class TopKGradRows(NamedTuple):
    """ds_j = p1 q_j [+ P2 p_j] - ty [j = y] + (sparse part); at_ids [R, K] the exact dz
    at the teacher ids; second = (P2, lse_1) or None."""

    p1: jax.Array
    ty: jax.Array
    second: tuple | None
    at_ids: jax.Array

    @classmethod
    def build(cls, r, A, C, s_ids, lse_T, lse_1, ids, slot, y_R, o: TopKDistillationOptions) -> "TopKGradRows":
        a = r * (o.kd_scale / o.temperature)
        p1, c = a * A, a[:, None] * C
        ty = r * o.weight_hard
        two = o.weight_hard > 0 and o.temperature != 1.0
        if o.weight_hard and not two:
            p1 = p1 + ty
        c_per_id = jax.vmap(lambda c_k, s_k: jnp.zeros_like(c_k).at[s_k].add(c_k)[s_k])(c, slot)
        at_ids = p1[:, None] * jnp.exp(s_ids / o.temperature - lse_T[:, None]) + c_per_id
        if two:
            at_ids = at_ids + ty[:, None] * jnp.exp(s_ids - lse_1[:, None])
        if o.weight_hard:
            at_ids = at_ids - jnp.where(ids == y_R[:, None], ty[:, None], 0)
        if o.softcap is not None:
            at_ids = at_ids * (1 - (s_ids / o.softcap) ** 2)
        return cls(p1, ty, (ty, lse_1) if two else None, at_ids)
