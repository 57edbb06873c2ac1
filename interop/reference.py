"""The float64 reference of linear cross-entropy (interop/SPEC.md), in numpy.

It is the oracle every implementation is tested against, and is itself tested against
float64 autograd of the naive formula in PyTorch and JAX. It materialises the logits:
use it only on small shapes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from interop.options import CrossEntropyOptions


@dataclasses.dataclass
class ReferenceResult:
    """Outputs of `linear_cross_entropy_reference`, all float64.

    loss: scalar for "sum"/"mean", the input's leading shape for "none".
    lse: [...] per-row logsumexp of the (soft-capped) logits, every row.
    grad_input: [..., D]; grad_weight: shaped as the given weight ([V, D] or [D, V]);
    grad_bias: [V] or None.
    """

    loss: np.ndarray
    lse: np.ndarray
    grad_input: np.ndarray
    grad_weight: np.ndarray
    grad_bias: np.ndarray | None


def row_gradient_coefficients(
    lse_N, target_N, class_weight_V, grad_output, grad_lse_N, options: CrossEntropyOptions, vocab: int
):
    """Per-row factors of ds (the gradient with respect to the soft-capped logits).

    ds_ij = p_coef_i * p_ij - target_coef_i * [j == y_i] - smooth_coef_i * cw_j, where
    p_ij = exp(s_ij - lse_i). Returns (p_coef_N, target_coef_N, smooth_coef_N, valid_N,
    in_range_N) as float64 arrays (the last two boolean). Rows whose target is out of
    range get NaN factors.
    """
    eps, zl = options.label_smoothing, options.z_loss
    valid = target_N != options.ignore_index
    in_range = (target_N >= 0) & (target_N < vocab)
    safe_y = np.where(in_range, target_N, 0)
    cw = np.ones(vocab) if class_weight_V is None else class_weight_V
    cw_y = np.where(valid, cw[safe_y], 0.0)
    if options.reduction == "none":
        r = np.broadcast_to(np.asarray(grad_output, np.float64), target_N.shape)
    elif options.reduction == "sum":
        r = np.full(target_N.shape, float(grad_output))
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.full(target_N.shape, float(grad_output) / cw_y.sum())
    r = np.where(valid, r, 0.0)
    p_coef = r * (cw_y * (1 - eps) + eps * cw.sum() / vocab + 2 * zl * lse_N)
    if grad_lse_N is not None:
        p_coef = p_coef + grad_lse_N
    target_coef = r * (1 - eps) * cw_y
    smooth_coef = r * eps / vocab
    bad = valid & ~in_range
    p_coef = np.where(bad, np.nan, p_coef)
    return p_coef, target_coef, smooth_coef, valid, in_range


def linear_cross_entropy_reference(
    input,
    linear_weight,
    target,
    *,
    linear_bias=None,
    weight=None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    weight_layout: str = "VD",
    grad_output=1.0,
    grad_lse=None,
) -> ReferenceResult:
    """Loss, per-row lse and gradients, all in float64.

    input [..., D], linear_weight [V, D] ("VD") or [D, V] ("DV"), target [...] integer,
    linear_bias [V], weight [V] class weights. grad_output is the upstream gradient of the
    loss (a scalar, or [...] for reduction="none"); grad_lse the upstream gradient of the
    per-row lse ([...] or None). Rows whose target is out of [0, V) and is not
    ignore_index get a NaN loss (and NaN gradients), as the traced kernels do.
    """
    opts = CrossEntropyOptions(reduction, ignore_index, label_smoothing, z_loss, softcap)
    x = np.asarray(input, np.float64)
    lead = x.shape[:-1]
    x_ND = x.reshape(int(np.prod(lead)), x.shape[-1])  # -1 is ambiguous when D = 0
    W = np.asarray(linear_weight, np.float64)
    W_VD = W if weight_layout == "VD" else W.T
    V = W_VD.shape[0]
    y_N = np.asarray(target).reshape(-1).astype(np.int64)
    b_V = None if linear_bias is None else np.asarray(linear_bias, np.float64)
    cw_V = None if weight is None else np.asarray(weight, np.float64)

    z_NV = x_ND @ W_VD.T + (0.0 if b_V is None else b_V)
    s_NV = z_NV if softcap is None else softcap * np.tanh(z_NV / softcap)
    m_N = s_NV.max(axis=1, keepdims=True) if V else np.zeros((x_ND.shape[0], 1))
    lse_N = (m_N + np.log(np.exp(s_NV - m_N).sum(axis=1, keepdims=True)))[:, 0]

    eps = opts.label_smoothing
    valid = y_N != opts.ignore_index
    in_range = (y_N >= 0) & (y_N < V)
    safe_y = np.where(in_range, y_N, 0)
    cw = np.ones(V) if cw_V is None else cw_V
    s_y = s_NV[np.arange(len(y_N)), safe_y]
    nll = cw[safe_y] * (lse_N - s_y)
    row = (1 - eps) * nll + z_loss * lse_N**2
    if eps > 0:  # absent at eps = 0, as in PyTorch: a class masked by a -inf logit leaves the loss finite
        row = row + eps * (cw[None, :] * (lse_N[:, None] - s_NV)).sum(axis=1) / V
    row = np.where(valid & ~in_range, np.nan, row)
    row = np.where(valid, row, 0.0)
    if reduction == "none":
        loss = row.reshape(lead)
    elif reduction == "sum":
        loss = np.asarray(row.sum())
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            loss = np.asarray(row.sum() / np.where(valid, cw[safe_y], 0.0).sum())

    g_out = np.asarray(grad_output, np.float64)
    g_out = g_out.reshape(-1) if reduction == "none" else g_out
    g_lse = None if grad_lse is None else np.asarray(grad_lse, np.float64).reshape(-1)
    p_coef, t_coef, s_coef, _, _ = row_gradient_coefficients(lse_N, y_N, cw_V, g_out, g_lse, opts, V)
    p_NV = np.exp(s_NV - lse_N[:, None])
    ds_NV = p_coef[:, None] * p_NV - s_coef[:, None] * cw[None, :]
    ds_NV[np.arange(len(y_N)), safe_y] -= np.where(in_range, t_coef, 0.0)
    dz_NV = ds_NV if softcap is None else ds_NV * (1 - (s_NV / softcap) ** 2)
    grad_x = (dz_NV @ W_VD).reshape(x.shape)
    grad_W_VD = dz_NV.T @ x_ND
    return ReferenceResult(
        loss=loss,
        lse=lse_N.reshape(lead),
        grad_input=grad_x,
        grad_weight=grad_W_VD if weight_layout == "VD" else grad_W_VD.T,
        grad_bias=None if b_V is None else dz_NV.sum(axis=0),
    )
