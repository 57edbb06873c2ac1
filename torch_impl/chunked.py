"""Pure-PyTorch linear cross-entropy over row chunks: the fallback wherever no kernel runs.

The N x V logits never exist at once: the forward pass keeps one chunk of C rows of
logits (C x V, fp32) at a time and saves only the per-row lse; the backward pass
recomputes each chunk's logits and turns them into the gradients (interop/SPEC.md).
"""

from __future__ import annotations

import torch

from interop.options import CrossEntropyOptions
from torch_impl.rows import TargetRows, compute_dtype, reduce_loss, row_coefficients, row_loss

def _capped_logits(x_CD, W, b_V, weight_layout: str, softcap, dtype):
    """Soft-capped logits s [C, V] of one chunk, in `dtype`."""
    z_CV = (x_CD @ (W.T if weight_layout == "VD" else W)).to(dtype)
    if b_V is not None:
        z_CV = z_CV + b_V.to(dtype)
    if softcap is not None:
        z_CV = softcap * torch.tanh(z_CV / softcap)
    return z_CV


def _row_stats(s_CV, safe_y_C, cw_V, smoothing: bool):
    """(lse, s_y, ws) [C] of one chunk of soft-capped logits."""
    lse = torch.logsumexp(s_CV, dim=1)
    s_y = s_CV.gather(1, safe_y_C[:, None])[:, 0]
    ws = None
    if smoothing:
        ws = s_CV.sum(1) if cw_V is None else s_CV @ cw_V
    return lse, s_y, ws


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """autograd.Function over flattened rows; returns (reduced loss, lse [N]), fp32 or fp64."""

    @staticmethod
    def forward(ctx, x_ND, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, chunk_rows: int,
                accumulate_in_input_dtype: bool = False):
        dtype = compute_dtype(x_ND.dtype)
        vocab = W.shape[0] if weight_layout == "VD" else W.shape[1]
        cw = None if cw_V is None else cw_V.to(dtype)
        cw_sum = vocab if cw is None else cw.sum()
        rows = TargetRows(y_N, cw, vocab, opts.ignore_index, dtype)
        n_rows = x_ND.shape[0]
        lse_N = torch.empty(n_rows, dtype=dtype, device=x_ND.device)
        loss_N = torch.empty(n_rows, dtype=dtype, device=x_ND.device)
        for start in range(0, n_rows, chunk_rows):
            sl = slice(start, min(start + chunk_rows, n_rows))
            s_CV = _capped_logits(x_ND[sl], W, b_V, weight_layout, opts.softcap, dtype)
            lse_N[sl], s_y, ws = _row_stats(s_CV, rows.safe_y[sl], cw, opts.label_smoothing > 0)
            loss_N[sl] = row_loss(lse_N[sl], s_y, ws, rows, opts, cw_sum, vocab, sl)
        ctx.save_for_backward(x_ND, W, b_V, cw, y_N, lse_N)
        ctx.opts, ctx.weight_layout, ctx.chunk_rows = opts, weight_layout, chunk_rows
        ctx.accumulate_dtype = W.dtype if accumulate_in_input_dtype else dtype
        ctx.set_materialize_grads(False)
        return reduce_loss(loss_N, rows, opts.reduction), lse_N

    @staticmethod
    def backward(ctx, grad_loss, grad_lse_N):
        x_ND, W, b_V, cw, y_N, lse_N = ctx.saved_tensors
        opts, layout, chunk_rows = ctx.opts, ctx.weight_layout, ctx.chunk_rows
        need_x, need_W, need_b = ctx.needs_input_grad[:3]
        if grad_loss is None and grad_lse_N is None:
            return (None,) * 9
        dtype, vocab = lse_N.dtype, (W.shape[0] if layout == "VD" else W.shape[1])
        rows = TargetRows(y_N, cw, vocab, opts.ignore_index, dtype)
        if grad_loss is None:
            grad_loss = torch.zeros((), dtype=dtype, device=lse_N.device)
        cw_sum = vocab if cw is None else cw.sum()
        p_coef, t_coef, s_coef = row_coefficients(grad_loss, grad_lse_N, lse_N, rows, cw_sum, opts, vocab)
        dx = torch.empty_like(x_ND) if need_x else None
        dW = torch.zeros(W.shape, dtype=ctx.accumulate_dtype, device=W.device) if need_W else None
        db = torch.zeros(vocab, dtype=dtype, device=W.device) if need_b else None
        for start in range(0, x_ND.shape[0], chunk_rows):
            sl = slice(start, min(start + chunk_rows, x_ND.shape[0]))
            x_CD = x_ND[sl]
            s_CV = _capped_logits(x_CD, W, b_V, layout, opts.softcap, dtype)
            dz_CV = torch.exp(s_CV - lse_N[sl, None]) * p_coef[sl, None]
            dz_CV -= s_coef[sl, None] * (1.0 if cw is None else cw)
            dz_CV.scatter_add_(1, rows.safe_y[sl, None], -t_coef[sl, None])
            if opts.softcap is not None:
                dz_CV *= 1 - (s_CV / opts.softcap) ** 2
            if need_x:
                dz_in = dz_CV.to(x_ND.dtype)
                dx[sl] = dz_in @ W if layout == "VD" else dz_in @ W.T
            if need_W:
                x_up = x_CD.to(dtype)
                dW += (dz_CV.T @ x_up if layout == "VD" else x_up.T @ dz_CV).to(dW.dtype)
            if need_b:
                db += dz_CV.sum(0)
        return (
            dx,
            None if dW is None else dW.to(W.dtype),
            None if db is None else db.to(b_V.dtype),
            None, None, None, None, None, None,
        )
