"""Pure-XLA linear cross-entropy over row chunks: the fallback wherever no kernel runs.

A `jax.custom_vjp` whose forward pass scans over chunks of C rows, keeping one C x V
block of fp32 logits at a time and saving only the per-row lse; the backward pass scans
again, recomputing each chunk's logits and turning them into the gradients
(interop/SPEC.md). The head weight is used in the layout it is given ([V, D] or
[D, V]) and never copied.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from interop.options import CrossEntropyOptions
from jax_impl.matmul import contract
from jax_impl.rows import TargetRows, compute_dtype, reduce_loss, row_coefficients, row_loop, row_loss

@dataclasses.dataclass(frozen=True)
class ChunkedConfig:
    """Static configuration of one call (hashable: it is a nondiff argument)."""

    options: CrossEntropyOptions
    weight_layout: str
    chunk_rows: int
    accumulate_in_input_dtype: bool = False


def _capped_logits(x_CD, W, b_V, cfg: ChunkedConfig, dtype):
    """Soft-capped logits s [C, V] of one chunk, accumulated in `dtype`."""
    contract_w = 1 if cfg.weight_layout == "VD" else 0
    z_CV = contract(x_CD, W, 1, contract_w, dtype)
    if b_V is not None:
        z_CV = z_CV + b_V.astype(dtype)
    cap = cfg.options.softcap
    return z_CV if cap is None else cap * jnp.tanh(z_CV / cap)


def _row_stats(s_CV, safe_y_C, cw_V, smoothing: bool):
    """(lse, s_y, ws) [C] of one chunk of soft-capped logits (ws is 0 without smoothing)."""
    lse = jax.nn.logsumexp(s_CV, axis=1)
    s_y = jnp.take_along_axis(s_CV, safe_y_C[:, None], axis=1)[:, 0]
    if not smoothing:
        return lse, s_y, jnp.zeros_like(lse)
    return lse, s_y, s_CV.sum(1) if cw_V is None else s_CV @ cw_V


def _forward(x_ND, W, b_V, cw_V, y_N, cfg: ChunkedConfig):
    """(reduced loss, lse [N], TargetRows) in the compute dtype."""
    opts, n_rows = cfg.options, x_ND.shape[0]
    dtype = compute_dtype(x_ND.dtype)
    vocab = W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]
    cw = None if cw_V is None else cw_V.astype(dtype)
    rows = TargetRows.build(y_N, cw, vocab, opts.ignore_index, dtype)
    cw_sum = vocab if cw is None else cw.sum()

    def chunk(_, xs):
        x_CD, safe_y = xs
        s_CV = _capped_logits(x_CD, W, b_V, cfg, dtype)
        return None, _row_stats(s_CV, safe_y, cw, opts.label_smoothing > 0)

    _, (lse_N, s_y, ws) = row_loop(chunk, None, (x_ND, rows.safe_y), n_rows, cfg.chunk_rows)
    loss = reduce_loss(row_loss(lse_N, s_y, ws, rows, opts, cw_sum, vocab), rows, opts.reduction)
    return loss, lse_N, rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def chunked_linear_cross_entropy(x_ND, W, b_V, cw_V, y_N, cfg: ChunkedConfig):
    """(loss, lse [N]) over flattened rows x [N, D], y [N]; fp32 (fp64 for fp64 input)."""
    loss, lse_N, _ = _forward(x_ND, W, b_V, cw_V, y_N, cfg)
    return loss, lse_N


def _fwd(x_ND, W, b_V, cw_V, y_N, cfg):
    loss, lse_N, _ = _forward(x_ND, W, b_V, cw_V, y_N, cfg)
    return (loss, lse_N), (x_ND, W, b_V, cw_V, y_N, lse_N)


def _bwd(cfg: ChunkedConfig, res, cotangents):
    x_ND, W, b_V, cw_V, y_N, lse_N = res
    g_loss, g_lse = cotangents
    opts, n_rows, dtype = cfg.options, x_ND.shape[0], lse_N.dtype
    vocab = W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]
    cw = None if cw_V is None else cw_V.astype(dtype)
    rows = TargetRows.build(y_N, cw, vocab, opts.ignore_index, dtype)
    cw_sum = vocab if cw is None else cw.sum()
    p_coef, t_coef, s_coef = row_coefficients(g_loss, g_lse, lse_N, rows, cw_sum, opts, vocab)
    contract_w = 0 if cfg.weight_layout == "VD" else 1
    cap = opts.softcap

    def chunk(carry, xs):
        dW, db = carry
        x_CD, lse_C, p_C, t_C, s_C, safe_y = xs
        s_CV = _capped_logits(x_CD, W, b_V, cfg, dtype)
        dz_CV = jnp.exp(s_CV - lse_C[:, None]) * p_C[:, None] - s_C[:, None] * (1.0 if cw is None else cw)
        dz_CV = dz_CV - t_C[:, None] * jax.nn.one_hot(safe_y, vocab, dtype=dtype)
        if cap is not None:
            dz_CV = dz_CV * (1 - (s_CV / cap) ** 2)
        dz_in = dz_CV.astype(x_CD.dtype)
        dx_CD = contract(dz_in, W, 1, contract_w, dtype)
        dW_C = contract(dz_in, x_CD, 0, 0, dtype) if cfg.weight_layout == "VD" else contract(x_CD, dz_in, 0, 0, dtype)
        dW = dW + dW_C.astype(dW.dtype)
        if db is not None:
            db = db + dz_CV.sum(0)
        return (dW, db), (dx_CD.astype(x_CD.dtype),)

    per_row = (x_ND, lse_N, p_coef, t_coef, s_coef, rows.safe_y)
    init = (jnp.zeros(W.shape, W.dtype if cfg.accumulate_in_input_dtype else dtype),
            None if b_V is None else jnp.zeros((vocab,), dtype))
    (dW, db), (dx_ND,) = row_loop(chunk, init, per_row, n_rows, cfg.chunk_rows)
    return (dx_ND, dW.astype(W.dtype), None if b_V is None else db.astype(b_V.dtype), None, None)


chunked_linear_cross_entropy.defvjp(_fwd, _bwd)
