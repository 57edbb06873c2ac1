"""Pure-PyTorch linear cross-entropy over row chunks: the fallback wherever no kernel runs.

The N x V logits never exist at once: the forward pass keeps one chunk of C rows of
logits (C x V, fp32) at a time and saves only the per-row lse; the backward pass
recomputes each chunk's logits and turns them into the gradients (interop/SPEC.md).
"""

from __future__ import annotations

import torch

from interop.options import CrossEntropyOptions

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 32-bit inputs, fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _capped_logits(x_CD, W, b_V, weight_layout: str, softcap, dtype):
    """Soft-capped logits s [C, V] of one chunk, in `dtype`."""
    z_CV = (x_CD @ (W.T if weight_layout == "VD" else W)).to(dtype)
    if b_V is not None:
        z_CV = z_CV + b_V.to(dtype)
    if softcap is not None:
        z_CV = softcap * torch.tanh(z_CV / softcap)
    return z_CV


class TargetRows:
    """Per-row target facts: y [N] int64 with safe indices, valid and in-range masks, cw[y]."""

    def __init__(self, target_N: torch.Tensor, class_weight_V, vocab: int, ignore_index: int, dtype):
        y = target_N.to(torch.int64)
        self.valid = y != ignore_index
        self.in_range = (y >= 0) & (y < vocab)
        self.safe_y = torch.where(self.in_range, y, torch.zeros_like(y))
        cw_y = torch.ones_like(y, dtype=dtype) if class_weight_V is None else class_weight_V.to(dtype)[self.safe_y]
        self.cw_y = torch.where(self.valid, cw_y, torch.zeros_like(cw_y))
        self.bad = self.valid & ~self.in_range


def _row_loss(s_CV, lse_C, rows: TargetRows, sl: slice, cw_V, opts: CrossEntropyOptions):
    """Per-row loss [C] of one chunk (0 for ignored rows, NaN for out-of-range targets)."""
    eps, vocab = opts.label_smoothing, s_CV.shape[1]
    s_y = s_CV.gather(1, rows.safe_y[sl, None])[:, 0]
    loss = (1 - eps) * rows.cw_y[sl] * (lse_C - s_y)
    if eps:
        cw_sum = vocab if cw_V is None else cw_V.sum()
        weighted_s = s_CV.sum(1) if cw_V is None else s_CV @ cw_V
        loss = loss + eps * (cw_sum * lse_C - weighted_s) / vocab
    if opts.z_loss:
        loss = loss + opts.z_loss * lse_C * lse_C
    loss = torch.where(rows.bad[sl], torch.full_like(loss, float("nan")), loss)
    return torch.where(rows.valid[sl], loss, torch.zeros_like(loss))


def _reduce(loss_N, rows: TargetRows, reduction: str):
    if reduction == "none":
        return loss_N
    if reduction == "sum":
        return loss_N.sum()
    return loss_N.sum() / rows.cw_y.sum()


def _row_coefficients(grad_loss, grad_lse_N, lse_N, rows: TargetRows, cw_V, opts: CrossEntropyOptions, vocab: int):
    """(P, T, S) of interop/SPEC.md's gradient, each [N], in lse's dtype."""
    eps = opts.label_smoothing
    if opts.reduction == "mean":
        grad_loss = grad_loss / rows.cw_y.sum()
    r = torch.where(rows.valid, grad_loss.to(lse_N.dtype).expand_as(lse_N), torch.zeros_like(lse_N))
    cw_mean = 1.0 if cw_V is None else cw_V.sum() / vocab
    p_coef = r * ((1 - eps) * rows.cw_y + eps * cw_mean + 2 * opts.z_loss * lse_N)
    if grad_lse_N is not None:
        p_coef = p_coef + grad_lse_N.to(lse_N.dtype)
    p_coef = torch.where(rows.bad, torch.full_like(p_coef, float("nan")), p_coef)
    return p_coef, r * (1 - eps) * rows.cw_y, r * eps / vocab


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """autograd.Function over flattened rows; returns (reduced loss, lse [N]), fp32 or fp64."""

    @staticmethod
    def forward(ctx, x_ND, W, b_V, cw_V, y_N, opts: CrossEntropyOptions, weight_layout: str, chunk_rows: int):
        dtype = compute_dtype(x_ND.dtype)
        vocab = W.shape[0] if weight_layout == "VD" else W.shape[1]
        cw = None if cw_V is None else cw_V.to(dtype)
        rows = TargetRows(y_N, cw, vocab, opts.ignore_index, dtype)
        n_rows = x_ND.shape[0]
        lse_N = torch.empty(n_rows, dtype=dtype, device=x_ND.device)
        loss_N = torch.empty(n_rows, dtype=dtype, device=x_ND.device)
        for start in range(0, n_rows, chunk_rows):
            sl = slice(start, min(start + chunk_rows, n_rows))
            s_CV = _capped_logits(x_ND[sl], W, b_V, weight_layout, opts.softcap, dtype)
            lse_N[sl] = torch.logsumexp(s_CV, dim=1)
            loss_N[sl] = _row_loss(s_CV, lse_N[sl], rows, sl, cw, opts)
        ctx.save_for_backward(x_ND, W, b_V, cw, y_N, lse_N)
        ctx.opts, ctx.weight_layout, ctx.chunk_rows = opts, weight_layout, chunk_rows
        ctx.set_materialize_grads(False)
        return _reduce(loss_N, rows, opts.reduction), lse_N

    @staticmethod
    def backward(ctx, grad_loss, grad_lse_N):
        x_ND, W, b_V, cw, y_N, lse_N = ctx.saved_tensors
        opts, layout, chunk_rows = ctx.opts, ctx.weight_layout, ctx.chunk_rows
        need_x, need_W, need_b = ctx.needs_input_grad[:3]
        if grad_loss is None and grad_lse_N is None:
            return (None,) * 8
        dtype, vocab = lse_N.dtype, (W.shape[0] if layout == "VD" else W.shape[1])
        rows = TargetRows(y_N, cw, vocab, opts.ignore_index, dtype)
        if grad_loss is None:
            grad_loss = torch.zeros((), dtype=dtype, device=lse_N.device)
        p_coef, t_coef, s_coef = _row_coefficients(grad_loss, grad_lse_N, lse_N, rows, cw, opts, vocab)
        dx = torch.empty_like(x_ND) if need_x else None
        dW = torch.zeros(W.shape, dtype=dtype, device=W.device) if need_W else None
        db = torch.zeros(vocab, dtype=dtype, device=W.device) if need_b else None
        for start in range(0, x_ND.shape[0], chunk_rows):
            sl = slice(start, min(start + chunk_rows, x_ND.shape[0]))
            x_CD = x_ND[sl]
            s_CV = _capped_logits(x_CD, W, b_V, layout, opts.softcap, dtype)
            dz_CV = torch.exp(s_CV - lse_N[sl, None]) * p_coef[sl, None]
            dz_CV -= s_coef[sl, None] * (1.0 if cw is None else cw)
            dz_CV.scatter_add_(1, rows.safe_y[sl, None], -(t_coef[sl] * rows.in_range[sl])[:, None])
            if opts.softcap is not None:
                dz_CV *= 1 - (s_CV / opts.softcap) ** 2
            if need_x:
                dz_in = dz_CV.to(x_ND.dtype)
                dx[sl] = dz_in @ W if layout == "VD" else dz_in @ W.T
            if need_W:
                x_up = x_CD.to(dtype)
                dW += dz_CV.T @ x_up if layout == "VD" else x_up.T @ dz_CV
            if need_b:
                db += dz_CV.sum(0)
        return (
            dx,
            None if dW is None else dW.to(W.dtype),
            None if db is None else db.to(b_V.dtype),
            None, None, None, None, None,
        )
