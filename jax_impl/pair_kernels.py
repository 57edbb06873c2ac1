"""Pallas kernels of the dense-teacher distillation (interop/SPEC-DISTILLATION.md) over one
block of student logits s [R, C] and teacher logits t [R, C], once the per-row lse of s / T
and t / T are known (`jax_impl.kernels.block_stats` gives them); as `torch_impl.pair_kernels`:

- `pair_sums`: the block's share of the divergence's two row sums
  a = sum_j p_j (lp_j - lm_j) and b = sum_j q_j (lq_j - lm_j), added to the running ones;
- `pair_grad`: dz = coef * d divergence / d (s / T) over the student block (written over s).

One program per row, looping over its columns (Triton lowering, as `jax_impl.kernels`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from interop.tuning import JAX_ROW_KERNEL_PARAMS
from jax_impl.kernels import _block, _load_scalar, _store_scalar, column_loop, max_keep_nan, pallas


def _log_probs(s_ref, t_ref, row, start, block, mask, inv_t, lse_s, lse_t):
    s = plt.load(s_ref.at[row, pl.ds(start, block)], mask=mask, other=0.0).astype(jnp.float32)
    t = plt.load(t_ref.at[row, pl.ds(start, block)], mask=mask, other=0.0).astype(jnp.float32)
    return s * inv_t - lse_s, t * inv_t - lse_t


def _log_mix(lq, lp, beta):
    a, b = lp + math.log(beta), lq + math.log1p(-beta)
    m = max_keep_nan(a, b)
    return m + jnp.log(jnp.exp(a - m) + jnp.exp(b - m))


def _sums_kernel(s_ref, t_ref, lse_s_ref, lse_t_ref, a_in, b_in, a_out, b_out, *, C, inv_t, beta, divergence, block):
    row = pl.program_id(0)
    lse_s, lse_t = _load_scalar(lse_s_ref, row), _load_scalar(lse_t_ref, row)

    def body(i, carry):
        a_vec, b_vec = carry
        start = i * block
        mask = start + jnp.arange(block) < C
        lq, lp = _log_probs(s_ref, t_ref, row, start, block, mask, inv_t, lse_s, lse_t)
        if divergence == "forward_kl":
            a_vec = a_vec + jnp.where(mask, jnp.exp(lp) * (lp - lq), 0.0)
        elif divergence == "reverse_kl":
            b_vec = b_vec + jnp.where(mask, jnp.exp(lq) * (lq - lp), 0.0)
        else:
            lm = _log_mix(lq, lp, beta)
            a_vec = a_vec + jnp.where(mask, jnp.exp(lp) * (lp - lm), 0.0)
            b_vec = b_vec + jnp.where(mask, jnp.exp(lq) * (lq - lm), 0.0)
        return a_vec, b_vec

    zeros = jnp.zeros((block,), jnp.float32)
    a_vec, b_vec = column_loop(C, block, body, (zeros, zeros))
    _store_scalar(a_out, row, _load_scalar(a_in, row) + jnp.sum(a_vec))
    _store_scalar(b_out, row, _load_scalar(b_in, row) + jnp.sum(b_vec))


def _grad_kernel(s_ref, t_ref, lse_s_ref, lse_t_ref, b_ref, coef_ref, dz_ref, *, C, inv_t, beta, divergence, block):
    row = pl.program_id(0)
    lse_s, lse_t = _load_scalar(lse_s_ref, row), _load_scalar(lse_t_ref, row)
    kl_q, coef = _load_scalar(b_ref, row), _load_scalar(coef_ref, row)

    def body(i, carry):
        start = i * block
        mask = start + jnp.arange(block) < C
        lq, lp = _log_probs(s_ref, t_ref, row, start, block, mask, inv_t, lse_s, lse_t)
        if divergence == "forward_kl":
            g = jnp.exp(lq) - jnp.exp(lp)
        elif divergence == "reverse_kl":
            g = jnp.exp(lq) * (lq - lp - kl_q)
        else:
            g = (1.0 - beta) * jnp.exp(lq) * (lq - _log_mix(lq, lp, beta) - kl_q)
        plt.store(dz_ref.at[row, pl.ds(start, block)], (coef * g).astype(dz_ref.dtype), mask=mask)
        return carry

    column_loop(C, block, body, 0)


def pair_sums(s_RC, t_RC, lse_s_R, lse_t_R, sums, divergence: str, temperature: float, beta: float, interpret: bool):
    """sums = (a, b), fp32 [R] each, plus this block's share; returns the new pair."""
    R, C = s_RC.shape
    kernel = functools.partial(_sums_kernel, C=C, inv_t=1.0 / temperature, beta=beta, divergence=divergence,
                               block=_block(C))
    return pallas(
        kernel, out_shape=[jax.ShapeDtypeStruct((R,), jnp.float32)] * 2, grid=(R,),
        input_output_aliases={4: 0, 5: 1}, interpret=interpret, compiler_params=plt.CompilerParams(**JAX_ROW_KERNEL_PARAMS),
    )(s_RC, t_RC, lse_s_R, lse_t_R, *sums)


def pair_grad(s_RC, t_RC, lse_s_R, lse_t_R, b_R, coef_R, divergence: str, temperature: float, beta: float, interpret: bool):
    """dz [R, C] in s's dtype (written over s) = coef * d divergence / d (s / T)."""
    R, C = s_RC.shape
    kernel = functools.partial(_grad_kernel, C=C, inv_t=1.0 / temperature, beta=beta, divergence=divergence,
                               block=_block(C))
    return pallas(
        kernel, out_shape=jax.ShapeDtypeStruct((R, C), s_RC.dtype), grid=(R,),
        input_output_aliases={0: 0}, interpret=interpret, compiler_params=plt.CompilerParams(**JAX_ROW_KERNEL_PARAMS),
    )(s_RC, t_RC, lse_s_R, lse_t_R, b_R, coef_R)
