"""Triton kernels of the dense-teacher distillation (interop/SPEC-DISTILLATION.md) over one
block of student logits s [R, C] and teacher logits t [R, C] (the same columns), once the
per-row lse of s / T and t / T are known (`torch_impl.kernels.block_stats_` gives them):

- `pair_sums_`: adds the block's share of the two per-row sums of the divergence,
  a = sum_j p_j (lp_j - lm_j) and b = sum_j q_j (lq_j - lm_j), where lp, lq are the
  teacher's and the student's log-probabilities and lm = lq ("forward_kl"), lp
  ("reverse_kl") or log(beta p + (1 - beta) q) ("jsd").
- `pair_grad_`: writes dz = coef * d divergence / d (s / T) over the student block.

One program per row, looping over its columns; the math is fp32.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from interop.tuning import BLOCK_COLS

DIVERGENCE_CODES = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


@triton.jit
def _log_probs(s_ptr, t_ptr, offs, mask, inv_t, lse_s, lse_t):
    lq = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_t - lse_s
    lp = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_t - lse_t
    return lq, lp


@triton.jit
def _log_mix(lq, lp, log_beta, log_1m_beta):
    # log(beta p + (1 - beta) q), stably
    a = lp + log_beta
    b = lq + log_1m_beta
    m = tl.maximum(a, b)
    return m + tl.log(tl.exp(a - m) + tl.exp(b - m))


@triton.jit
def _pair_sums_kernel(
    s_ptr, stride_s, t_ptr, stride_t,   # [R, C] student and teacher logits
    lse_s_ptr, lse_t_ptr,               # [R] fp32 lse of s / T and t / T
    a_ptr, b_ptr,                       # [R] fp32 running sums, updated in place
    C, inv_t, log_beta, log_1m_beta,
    DIVERGENCE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    a_vec = tl.zeros([BLOCK], tl.float32)
    b_vec = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        lq, lp = _log_probs(s_ptr + row * stride_s, t_ptr + row * stride_t, offs, mask, inv_t, lse_s, lse_t)
        if DIVERGENCE == 0:
            a_vec += tl.where(mask, tl.exp(lp) * (lp - lq), 0.0)
        elif DIVERGENCE == 1:
            b_vec += tl.where(mask, tl.exp(lq) * (lq - lp), 0.0)
        else:
            lm = _log_mix(lq, lp, log_beta, log_1m_beta)
            a_vec += tl.where(mask, tl.exp(lp) * (lp - lm), 0.0)
            b_vec += tl.where(mask, tl.exp(lq) * (lq - lm), 0.0)
    tl.store(a_ptr + row, tl.load(a_ptr + row) + tl.sum(a_vec, axis=0))
    tl.store(b_ptr + row, tl.load(b_ptr + row) + tl.sum(b_vec, axis=0))


@triton.jit
def _pair_grad_kernel(
    s_ptr, stride_s, t_ptr, stride_t,   # [R, C] student and teacher logits
    dz_ptr, stride_d,                   # [R, C] output (may be s itself)
    lse_s_ptr, lse_t_ptr, b_ptr,        # [R] fp32: lse of s / T and t / T, b = sum_j q_j (lq_j - lm_j)
    coef_ptr,                           # [R] fp32: dz = coef * d divergence / d (s / T)
    C, inv_t, log_beta, log_1m_beta, one_m_beta,
    DIVERGENCE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    kl_q = tl.load(b_ptr + row)
    coef = tl.load(coef_ptr + row)
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        lq, lp = _log_probs(s_ptr + row * stride_s, t_ptr + row * stride_t, offs, mask, inv_t, lse_s, lse_t)
        if DIVERGENCE == 0:
            g = tl.exp(lq) - tl.exp(lp)
        elif DIVERGENCE == 1:
            g = tl.exp(lq) * (lq - lp - kl_q)
        else:
            g = one_m_beta * tl.exp(lq) * (lq - _log_mix(lq, lp, log_beta, log_1m_beta) - kl_q)
        tl.store(dz_ptr + row * stride_d + offs, (coef * g).to(dz_ptr.dtype.element_ty), mask=mask)


def _constants(temperature: float, beta: float):
    return 1.0 / temperature, math.log(beta), math.log1p(-beta)


def pair_sums_(s_RC, t_RC, lse_s_R, lse_t_R, a_R, b_R, divergence: str, temperature: float, beta: float) -> None:
    """a_R, b_R (fp32, in place) += this block's share of the divergence's two row sums."""
    R, C = s_RC.shape
    if R == 0:
        return
    _pair_sums_kernel[(R,)](
        s_RC, s_RC.stride(0), t_RC, t_RC.stride(0), lse_s_R, lse_t_R, a_R, b_R, C, *_constants(temperature, beta),
        DIVERGENCE=DIVERGENCE_CODES[divergence], BLOCK=min(BLOCK_COLS, triton.next_power_of_2(C)), num_warps=8,
    )


def pair_grad_(s_RC, t_RC, dz_RC, lse_s_R, lse_t_R, b_R, coef_R, divergence: str, temperature: float, beta: float) -> None:
    """Write dz [R, C] (may be s itself) = coef * d divergence / d (s / T) for the block."""
    R, C = s_RC.shape
    if R == 0:
        return
    _pair_grad_kernel[(R,)](
        s_RC, s_RC.stride(0), t_RC, t_RC.stride(0), dz_RC, dz_RC.stride(0), lse_s_R, lse_t_R, b_R, coef_R, C,
        *_constants(temperature, beta), 1.0 - beta,
        DIVERGENCE=DIVERGENCE_CODES[divergence], BLOCK=min(BLOCK_COLS, triton.next_power_of_2(C)), num_warps=8,
    )
