"""The block steps of every JAX loss, twice: on the Pallas kernels (`KernelOps`) and in
jax.numpy (`XlaOps`, the fallback: fp32 logits, fp64 for fp64 inputs). `jax_impl.blocked`
(cross-entropy, the vocabulary split) and the rules of the block engine (`jax_impl.engine`:
`jax_impl.distill_rules`, `jax_impl.log_probs_rule`) call either, as `torch_impl.steps`
serves PyTorch's.

Each step takes one logits block z [R, C] (columns v0..v0+C, no bias) and per-row vectors;
"stats" return the running (m, l of scale * s, s at the target, ws) with the block merged in,
where ws is the class-weighted sum of s (cw [V] or ones), accumulated only with need_ws;
"grad" returns dz, with the class-weighted term S cw_j when given S. The "log_prob" steps
do the same for `linear_log_probs` (`jax_impl.log_probs_kernels`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_impl import kernels, log_probs_kernels, pair_kernels


class KernelOps:
    """The steps on the Pallas kernels (interpret mode off a GPU); logits in the input dtype."""

    compute_logits = False

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def stats(self, z, v0, b_V, y_R, running, softcap, scale: float = 1.0, cw_V=None, need_ws: bool = False):
        return tuple(kernels.block_stats(z, kernels.v0_array(v0), b_V, cw_V, y_R, running, softcap, need_ws,
                                         self.interpret, scale))

    def grad(self, z, v0, b_V, y_R, softcap, scale: float, lse_R, p_R, ty_R, second=None, cw_V=None, s_R=None):
        s_R = jnp.zeros_like(p_R) if s_R is None else s_R
        return kernels.block_grad(z, kernels.v0_array(v0), b_V, cw_V, y_R, lse_R, p_R, ty_R, s_R, softcap,
                                  self.interpret, scale, second)

    def rows_stats_grad(self, z, b_V, y_R, coefs, softcap, cw_V, need_ws: bool, z_loss: float):
        """(lse, s_y, ws, dz) of whole-row logits z [R, V] in one kernel, coefs = (G, A, T, S)
        of `rows.lse_coefficients` (`kernels.rows_stats_grad`)."""
        return tuple(kernels.rows_stats_grad(z, b_V, cw_V, y_R, *coefs, softcap, need_ws, z_loss, self.interpret))

    def pair_sums(self, s, t, lse_s, lse_t, sums, o):
        return tuple(pair_kernels.pair_sums(s, t, lse_s, lse_t, sums, o.divergence, o.temperature, o.beta, self.interpret))

    def pair_grad(self, s, t, lse_s, lse_t, b_R, coef_R, o):
        return pair_kernels.pair_grad(s, t, lse_s, lse_t, b_R, coef_R, o.divergence, o.temperature, o.beta, self.interpret)

    def log_prob_stats(self, z, v0, b_V, y_R, running, softcap, inv_t: float):
        return log_probs_kernels.log_prob_stats(z, kernels.v0_array(v0), b_V, y_R, running, softcap, inv_t, self.interpret)

    def log_prob_grad(self, z, v0, b_V, y_R, lse_R, entropy_R, g_R, g_h_R, softcap, inv_t: float):
        return log_probs_kernels.log_prob_grad(z, kernels.v0_array(v0), b_V, y_R, lse_R, entropy_R, g_R, g_h_R, softcap,
                                               inv_t, self.interpret)


def _cols(a_V, v0, z):
    """a [V]'s entries of z's columns (v0..v0+C), in z's dtype."""
    return jax.lax.dynamic_slice_in_dim(a_V, v0, z.shape[1]).astype(z.dtype)


def _capped(z, v0, b_V, softcap):
    if b_V is not None:
        z = z + _cols(b_V, v0, z)
    return z if softcap is None else softcap * jnp.tanh(z / softcap)


def _at_target(s, v0, y_R):
    col = y_R - v0
    inside = (col >= 0) & (col < s.shape[1])
    return inside, jnp.take_along_axis(s, jnp.clip(col, 0, s.shape[1] - 1)[:, None], axis=1)[:, 0], col


def _log_mix(lq, lp, beta: float):
    return jnp.logaddexp(lp + math.log(beta), lq + math.log1p(-beta))


class XlaOps:
    """The same steps in jax.numpy, on logits in the compute dtype (fp32 or fp64)."""

    compute_logits = True
    rows_stats_grad = None  # no fused whole-row step: the rules take stats, then grad

    def stats(self, z, v0, b_V, y_R, running, softcap, scale: float = 1.0, cw_V=None, need_ws: bool = False):
        m, l, sy, ws = running
        s = _capped(z, v0, b_V, softcap)
        if need_ws:
            ws = ws + (s.sum(1) if cw_V is None else s @ _cols(cw_V, v0, s))
        u = s * scale
        m_new = jnp.maximum(m, u.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row of -inf so far: l stays 0, not NaN
        l = l * jnp.exp(m - m_safe) + jnp.exp(u - m_safe[:, None]).sum(1)
        inside, s_y, _ = _at_target(s, v0, y_R)
        return m_new, l, sy + jnp.where(inside, s_y, 0), ws

    def grad(self, z, v0, b_V, y_R, softcap, scale: float, lse_R, p_R, ty_R, second=None, cw_V=None, s_R=None):
        s = _capped(z, v0, b_V, softcap)
        dz = p_R[:, None] * jnp.exp(s * scale - lse_R[:, None])
        if second is not None:
            dz = dz + second[0][:, None] * jnp.exp(s - second[1][:, None])
        if s_R is not None:
            dz = dz - s_R[:, None] * (1.0 if cw_V is None else _cols(cw_V, v0, dz))
        inside, _, col = _at_target(s, v0, y_R)
        dz = dz - jnp.where(inside[:, None] & (jnp.arange(s.shape[1])[None, :] == col[:, None]), ty_R[:, None], 0)
        return dz if softcap is None else dz * (1 - (s / softcap) ** 2)

    def pair_sums(self, s, t, lse_s, lse_t, sums, o):
        a, b = sums
        lq, lp = s / o.temperature - lse_s[:, None], t / o.temperature - lse_t[:, None]
        if o.divergence == "forward_kl":
            return a + (jnp.exp(lp) * (lp - lq)).sum(1), b
        if o.divergence == "reverse_kl":
            return a, b + (jnp.exp(lq) * (lq - lp)).sum(1)
        lm = _log_mix(lq, lp, o.beta)
        return a + (jnp.exp(lp) * (lp - lm)).sum(1), b + (jnp.exp(lq) * (lq - lm)).sum(1)

    def pair_grad(self, s, t, lse_s, lse_t, b_R, coef_R, o):
        lq, lp = s / o.temperature - lse_s[:, None], t / o.temperature - lse_t[:, None]
        if o.divergence == "forward_kl":
            g = jnp.exp(lq) - jnp.exp(lp)
        elif o.divergence == "reverse_kl":
            g = jnp.exp(lq) * (lq - lp - b_R[:, None])
        else:
            g = (1 - o.beta) * jnp.exp(lq) * (lq - _log_mix(lq, lp, o.beta) - b_R[:, None])
        return coef_R[:, None] * g

    def log_prob_stats(self, z, v0, b_V, y_R, running, softcap, inv_t: float):
        m, l, a, best, idx, u_y = running
        u = _capped(z, v0, b_V, softcap) * inv_t
        m_blk = u.max(axis=1)  # NaN propagates
        safe = jnp.where(m_blk == -jnp.inf, 0.0, m_blk)[:, None]
        e = jnp.exp(u - safe)
        m, l, a = log_probs_kernels.merge_running(m, l, a, m_blk, e.sum(1), jnp.where(e == 0, 0, e * (u - safe)).sum(1))
        # argmax: the first maximum, a NaN first; earlier blocks keep ties
        best, idx = log_probs_kernels.larger_first(best, idx, m_blk, (jnp.argmax(u, axis=1) + v0).astype(idx.dtype))
        inside, u_at_y, _ = _at_target(u, v0, y_R)
        return m, l, a, best, idx, u_y + jnp.where(inside, u_at_y, 0)

    def log_prob_grad(self, z, v0, b_V, y_R, lse_R, entropy_R, g_R, g_h_R, softcap, inv_t: float):
        s = _capped(z, v0, b_V, softcap)
        log_p = s * inv_t - lse_R[:, None]
        p = jnp.exp(log_p)
        du = -g_R[:, None] * p
        if g_h_R is not None:  # dH/du_j = -p_j (log p_j + H)
            du = du - g_h_R[:, None] * jnp.where(p == 0, 0, p * (log_p + entropy_R[:, None]))
        inside, _, col = _at_target(s, v0, y_R)
        du = du + jnp.where(inside[:, None] & (jnp.arange(s.shape[1])[None, :] == col[:, None]), g_R[:, None], 0)
        dz = du * inv_t
        return dz if softcap is None else dz * (1 - (s / softcap) ** 2)


def steps_of(strategy: str, interpret: bool):
    """The steps of a strategy: jax.numpy for "chunked" (the fallback), else the Pallas kernels."""
    return XlaOps() if strategy == "chunked" else KernelOps(interpret)
