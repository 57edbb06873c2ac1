"""The float64 reference of the distillation losses (interop/SPEC-DISTILLATION.md), in numpy.

The oracle of the distillation tests, itself tested against float64 autograd of the naive
formulas in PyTorch. Gradients come from the spec's closed forms, not from autograd.
Materialises the logits: small shapes only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from interop.distillation import DenseDistillationOptions, TopKDistillationOptions


@dataclasses.dataclass
class DistillReferenceResult:
    """float64 outputs: loss (scalar, or the input's leading shape for "none"),
    grad_input [..., D], grad_weight (the weight's layout), grad_bias [V] or None."""

    loss: np.ndarray
    grad_input: np.ndarray
    grad_weight: np.ndarray
    grad_bias: np.ndarray | None


def _logsumexp(a_NV):
    m = a_NV.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(a_NV - m).sum(axis=1, keepdims=True)))[:, 0]


def _rows_VD(x, W, weight_layout):
    x = np.asarray(x, np.float64)
    W = np.asarray(W, np.float64)
    return x.reshape(-1, x.shape[-1]), (W if weight_layout == "VD" else W.T), x.shape


def valid_rows(n_rows: int, target, row_mask, ignore_index: int):
    """valid_i = row_mask_i (if given) and target_i != ignore_index (if given): bool [N]."""
    valid = np.ones(n_rows, bool)
    if row_mask is not None:
        valid &= np.asarray(row_mask, bool).reshape(-1)
    if target is not None:
        valid &= np.asarray(target).reshape(-1) != ignore_index
    return valid


def row_weights(valid_N, reduction: str, grad_output, num_items_in_batch):
    """r_i: the upstream gradient of row i's loss (0 for invalid rows)."""
    g = np.asarray(grad_output, np.float64)
    if reduction == "none":
        r = np.broadcast_to(g.reshape(-1), valid_N.shape)
    elif reduction == "sum":
        r = np.full(valid_N.shape, float(g))
    else:
        denom = valid_N.sum() if num_items_in_batch is None else float(num_items_in_batch)
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.full(valid_N.shape, float(g) / denom)
    return np.where(valid_N, r, 0.0)


def reduce_rows(row_N, valid_N, reduction: str, lead, num_items_in_batch):
    row_N = np.where(valid_N, row_N, 0.0)
    if reduction == "none":
        return row_N.reshape(lead)
    if reduction == "sum":
        return np.asarray(row_N.sum())
    denom = valid_N.sum() if num_items_in_batch is None else float(num_items_in_batch)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(row_N.sum() / denom)


def teacher_distribution(ids_NK, logprobs_NK, renormalize: bool):
    """(P [N, K], log P [N, K], entry mask [N, K]) of the teacher's top-K entries; padding
    entries (id < 0 or logprob -inf) have P = 0. A row without entries has P = 0."""
    entry = (ids_NK >= 0) & (logprobs_NK > -np.inf)
    lp = np.where(entry, logprobs_NK, -np.inf)
    if renormalize:
        m = np.where(entry.any(axis=1), lp.max(axis=1), 0.0)
        with np.errstate(divide="ignore"):
            lse = m + np.log(np.exp(lp - m[:, None]).sum(axis=1))
        lp = lp - np.where(entry.any(axis=1), lse, 0.0)[:, None]
    P = np.where(entry, np.exp(lp), 0.0)
    return P, np.where(entry, lp, 0.0), entry


def linear_topk_distillation_reference(input, linear_weight, teacher_ids, teacher_logprobs, *, target=None,
                                       linear_bias=None, row_mask=None, options=TopKDistillationOptions(),
                                       weight_layout="VD", num_items_in_batch=None, grad_output=1.0):
    """Top-K sparse-teacher distillation loss and gradients in float64.

    input [..., D], linear_weight [V, D] / [D, V], teacher_ids [..., K] int (< 0: padding),
    teacher_logprobs [..., K] (-inf: padding), target [...] or None, linear_bias [V] or None,
    row_mask [...] bool or None. Teacher ids >= V, and (with weight_hard > 0) targets outside
    [0, V) that are not ignore_index, give their row a NaN loss and NaN gradients.
    """
    o = options
    x_ND, W_VD, x_shape = _rows_VD(input, linear_weight, weight_layout)
    N, V, T = x_ND.shape[0], W_VD.shape[0], o.temperature
    ids = np.asarray(teacher_ids).reshape(N, -1).astype(np.int64)
    lp_in = np.asarray(teacher_logprobs, np.float64).reshape(N, -1)
    z = x_ND @ W_VD.T + (0.0 if linear_bias is None else np.asarray(linear_bias, np.float64))
    s = z if o.softcap is None else o.softcap * np.tanh(z / o.softcap)
    u = s / T
    lse_T, lse_1 = _logsumexp(u), _logsumexp(s)
    q, p = np.exp(u - lse_T[:, None]), np.exp(s - lse_1[:, None])

    bad = (ids >= V).any(axis=1)
    P, logP, entry = teacher_distribution(ids, lp_in, o.renormalize_teacher)
    safe_ids = np.where(entry & (ids < V), ids, 0)
    rows = np.arange(N)[:, None]
    lq = u[rows, safe_ids] - lse_T[:, None]
    kd = np.where(entry, P * (logP - lq), 0.0).sum(axis=1)
    A = P.sum(axis=1)
    C = -P
    if o.tail_bucket:
        R = np.maximum(0.0, 1.0 - P.sum(axis=1))
        Q = np.where(entry, np.exp(lq), 0.0).sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            kd += np.where(R > 0, R * (np.log(np.where(R > 0, R, 1.0)) - np.log1p(-Q)), 0.0)
            A = A - R * Q / (1 - Q)
            C = C + np.where(entry, (R / (1 - Q))[:, None] * np.exp(lq), 0.0)
    row = o.kd_scale * kd
    valid = valid_rows(N, target, row_mask, o.ignore_index)
    safe_y = np.zeros(N, np.int64)
    if target is not None:
        y = np.asarray(target).reshape(-1).astype(np.int64)
        in_range = (y >= 0) & (y < V)
        if o.weight_hard:
            bad |= (y != o.ignore_index) & ~in_range
        safe_y = np.where(in_range, y, 0)
        if o.weight_hard:
            row = row + o.weight_hard * (lse_1 - s[np.arange(N), safe_y])
    row = np.where(bad, np.nan, row)
    loss = reduce_rows(row, valid, o.reduction, x_shape[:-1], num_items_in_batch)

    r = row_weights(valid, o.reduction, grad_output, num_items_in_batch)
    a = r * o.kd_scale / T
    ds = (a * A)[:, None] * q
    np.add.at(ds, (np.broadcast_to(rows, ids.shape)[entry], safe_ids[entry]), (a[:, None] * C)[entry])
    if o.weight_hard and target is not None:
        ds += (r * o.weight_hard)[:, None] * p
        ds[np.arange(N), safe_y] -= r * o.weight_hard
    ds = np.where(bad[:, None] & valid[:, None], np.nan, ds)
    dz = ds if o.softcap is None else ds * (1 - (s / o.softcap) ** 2)
    grad_W_VD = dz.T @ x_ND
    return DistillReferenceResult(
        loss=loss,
        grad_input=(dz @ W_VD).reshape(x_shape),
        grad_weight=grad_W_VD if weight_layout == "VD" else grad_W_VD.T,
        grad_bias=None if linear_bias is None else dz.sum(axis=0),
    )


def dense_divergence_rows(s_NV, t_NV, options: DenseDistillationOptions):
    """(divergence [N], d divergence / d s [N, V]) of student logits s and teacher logits t
    over the same V columns, at the options' temperature (without the T**2 factor)."""
    o, T = options, options.temperature
    lq = s_NV / T - _logsumexp(s_NV / T)[:, None]
    lp = t_NV / T - _logsumexp(t_NV / T)[:, None]
    q, p = np.exp(lq), np.exp(lp)
    if o.divergence == "forward_kl":
        return (p * (lp - lq)).sum(axis=1), (q - p) / T
    if o.divergence == "reverse_kl":
        kl = (q * (lq - lp)).sum(axis=1)
        return kl, q * (lq - lp - kl[:, None]) / T
    lm = np.logaddexp(np.log(o.beta) + lp, np.log1p(-o.beta) + lq)
    kl_pm = (p * (lp - lm)).sum(axis=1)
    kl_qm = (q * (lq - lm)).sum(axis=1)
    return o.beta * kl_pm + (1 - o.beta) * kl_qm, (1 - o.beta) * q * (lq - lm - kl_qm[:, None]) / T


def linear_distillation_reference(input, linear_weight, teacher_input, teacher_weight, *, target=None, row_mask=None,
                                  options=DenseDistillationOptions(), weight_layout="VD", num_items_in_batch=None,
                                  grad_output=1.0):
    """Dense-teacher distillation loss and the student's gradients in float64.

    input [..., D], linear_weight [V, D] / [D, V]; teacher_input [..., Dt], teacher_weight
    [Vt, Dt] / [Dt, Vt] (same layout). Both distributions cover the first min(V, Vt) classes;
    the student's columns beyond get a zero gradient. grad_bias is always None.
    """
    o = options
    x_ND, W_VD, x_shape = _rows_VD(input, linear_weight, weight_layout)
    xt_ND, Wt_VD, _ = _rows_VD(teacher_input, teacher_weight, weight_layout)
    N, V = x_ND.shape[0], W_VD.shape[0]
    Vm = min(V, Wt_VD.shape[0])
    s = x_ND @ W_VD[:Vm].T
    t = xt_ND @ Wt_VD[:Vm].T
    div, ddiv_ds = dense_divergence_rows(s, t, o)
    valid = valid_rows(N, target, row_mask, o.ignore_index)
    loss = reduce_rows(o.scale * div, valid, o.reduction, x_shape[:-1], num_items_in_batch)
    r = row_weights(valid, o.reduction, grad_output, num_items_in_batch)
    dz = np.zeros((N, V))
    dz[:, :Vm] = (r * o.scale)[:, None] * ddiv_ds
    grad_W_VD = dz.T @ x_ND
    return DistillReferenceResult(
        loss=loss,
        grad_input=(dz @ W_VD).reshape(x_shape),
        grad_weight=grad_W_VD if weight_layout == "VD" else grad_W_VD.T,
        grad_bias=None,
    )
