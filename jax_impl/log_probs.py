"""`linear_log_probs` for JAX, with the arguments, defaults and semantics of
`torch_impl.linear_log_probs` (interop/SPEC.md, "Log-probabilities"): per-token log p(target)
at a temperature, the entropy and the argmax, without the N x V logits.

Over blocks of whole rows (`jax_impl.rows.row_loop`, `jax_impl.blocked.Head`) each block's
logits are made in fp32 (fp64 for fp64 inputs) by XLA's product and reduced to the per-row
outputs; the backward rule of the `jax.custom_vjp` recomputes them and turns the upstream
gradients of the log-probabilities and the entropy into dz, whose products give grad_input
and an fp32 grad_weight.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from interop.blocking import chunk_rows
from interop.log_probs import LogProbsOptions, check_log_probs_strategy
from interop.options import check_inputs, check_tuning
from interop.tuning import Tuning
from jax_impl.blocked import Head
from jax_impl.functional import _check_target_range, as_array, dtype_name, maybe_array, shape_of
from jax_impl.rows import compute_dtype, narrow_targets, row_loop
from jax_impl.sharding import on_mesh, row_spec


@dataclasses.dataclass(frozen=True)
class LogProbsConfig:
    """The static part of one call (a nondiff argument of the custom_vjp)."""

    options: LogProbsOptions
    weight_layout: str
    block_rows: int
    vocab: int
    with_entropy: bool
    accumulate_in_input_dtype: bool

    def head(self, x, W, b):
        return Head(x, W, b, self.weight_layout, self.vocab, self.vocab, compute_dtype(x.dtype))


def _scaled(head: Head, x_R, b_V, o: LogProbsOptions):
    """(s, u) of a block of rows: the soft-capped logits with the bias, and u = s / T."""
    s = head.col_logits(x_R, 0, head.vocab)
    if b_V is not None:
        s = s + b_V.astype(s.dtype)
    if o.softcap is not None:
        s = o.softcap * jnp.tanh(s / o.softcap)
    return s, s / o.temperature


def _times_p(p, a):
    """p a, 0 where p is (a class masked by a -inf logit, whose log-probability is -inf:
    0 * -inf would be NaN)."""
    return jnp.where(p == 0, 0, p * a)


def _target_rows(y_R, vocab: int, o: LogProbsOptions):
    """(valid, in_range, safe_y) of a block's targets."""
    valid, in_range = y_R != o.ignore_index, (y_R >= 0) & (y_R < vocab)
    return valid, in_range, jnp.where(in_range, y_R, 0)


def _forward(x_ND, W, b_V, y_N, cfg: LogProbsConfig):
    """(log_probs, entropy, argmax, lse), per row."""
    o, head = cfg.options, cfg.head(x_ND, W, b_V)

    def row_step(carry, xs):
        x_R, y_R = xs
        _, u = _scaled(head, x_R, b_V, o)
        lse = jax.nn.logsumexp(u, axis=1)
        valid, in_range, safe_y = _target_rows(y_R, cfg.vocab, o)
        logp = jnp.take_along_axis(u, safe_y[:, None], axis=1)[:, 0] - lse
        logp = jnp.where(valid, jnp.where(in_range, logp, jnp.nan), 0)
        log_p = u - lse[:, None]  # H = -sum p log p: no cancellation of lse against E[u]
        entropy = -_times_p(jnp.exp(log_p), log_p).sum(1) if cfg.with_entropy else jnp.zeros_like(lse)
        return carry, (logp, entropy, jnp.argmax(u, axis=1).astype(jnp.int32), lse)

    return row_loop(row_step, (), (x_ND, y_N), x_ND.shape[0], cfg.block_rows)[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def log_probs(x_ND, W, b_V, y_N, cfg: LogProbsConfig):
    """(log_probs [N], entropy [N] (zeros unless cfg.with_entropy), argmax [N] int32) over
    flattened rows x [N, D] and int32 targets y [N]; fp32 (fp64 for fp64 inputs)."""
    return _forward(x_ND, W, b_V, y_N, cfg)[:3]


def _fwd(x_ND, W, b_V, y_N, cfg):
    logp, entropy, argmax, lse = _forward(x_ND, W, b_V, y_N, cfg)
    return (logp, entropy, argmax), (x_ND, W, b_V, y_N, lse)


def _bwd(cfg, res, cotangents):
    x_ND, W, b_V, y_N, lse = res
    g_lp, g_H, _ = cotangents
    o, head, wide = cfg.options, cfg.head(x_ND, W, b_V), lse.dtype

    def row_step(carry, xs):
        x_R, y_R, lse_R, g_lp_R, g_H_R = xs
        s, u = _scaled(head, x_R, b_V, o)
        valid, in_range, safe_y = _target_rows(y_R, cfg.vocab, o)
        g_lp_R = jnp.where(valid, jnp.where(in_range, g_lp_R.astype(wide), jnp.nan), 0)
        log_p = u - lse_R[:, None]
        p = jnp.exp(log_p)
        du = -g_lp_R[:, None] * p
        if cfg.with_entropy:  # dH/du_j = -p_j (u_j - sum_k p_k u_k) = -p_j (log p_j + H)
            neg_H = _times_p(p, log_p).sum(1, keepdims=True)
            du = du - g_H_R.astype(wide)[:, None] * _times_p(p, log_p - neg_H)
        one_hot = jnp.arange(cfg.vocab)[None, :] == safe_y[:, None]
        du = du + jnp.where(one_hot & in_range[:, None], g_lp_R[:, None], 0)
        dz = du / o.temperature
        if o.softcap is not None:
            dz = dz * (1 - (s / o.softcap) ** 2)
        dW, db, dx_R = head.add_shares(dz, x_R, 0, cfg.vocab, *carry, jnp.zeros(x_R.shape, wide))
        return (dW, db), (dx_R.astype(x_R.dtype),)

    acc = W.dtype if cfg.accumulate_in_input_dtype else compute_dtype(W.dtype)
    db = None if b_V is None else jnp.zeros(b_V.shape, compute_dtype(b_V.dtype))
    (dW, db), (dx,) = row_loop(row_step, (jnp.zeros(W.shape, acc), db), (x_ND, y_N, lse, g_lp, g_H), x_ND.shape[0],
                               cfg.block_rows)
    return dx, dW.astype(W.dtype), None if db is None else db.astype(b_V.dtype), None


log_probs.defvjp(_fwd, _bwd)


def linear_log_probs(input, linear_weight, target, *, linear_bias=None, temperature: float = 1.0,
                     softcap: float | None = None, ignore_index: int | None = -100, return_entropy: bool = False,
                     return_argmax: bool = False, weight_layout: str = "VD", strategy: str = "auto",
                     accumulate_in_input_dtype: bool = False, tuning: Tuning | None = None):
    """Per-token log p(target) at a temperature, and on request the entropy and argmax.

    The arguments of `torch_impl.linear_log_probs`: input [..., D], linear_weight [V, D]
    ("VD") or [D, V] ("DV", Flax nnx.Linear's kernel), target [...] integer ids, optional
    linear_bias [V]; u = softcap(input @ W^T + b) / temperature. Differentiable in input,
    linear_weight and linear_bias (`jax.custom_vjp`); usable under `jax.jit`, where a
    target out of [0, V) that is not ignore_index gives a NaN log-probability instead of
    the eager call's ValueError. strategy: "auto" or "chunked" (blocks of whole rows in
    jax.numpy).

    Returns:
        log-probabilities [...] in fp32 (fp64 for fp64 input), 0 where ignored; with
        return_entropy and/or return_argmax, the tuple (log_probs, entropy, argmax) of those
        asked for: the entropy of every row, argmax int32 (the first of equal maxima).
    """
    o = LogProbsOptions(temperature, softcap, ignore_index)
    check_log_probs_strategy(strategy)
    tuning = check_tuning(tuning)
    input, linear_weight = as_array("input", input), as_array("linear_weight", linear_weight)
    target, linear_bias = as_array("target", target), maybe_array("linear_bias", linear_bias)
    shape = check_inputs(
        input_shape=input.shape, input_dtype=dtype_name(input), weight_shape=linear_weight.shape,
        weight_dtype=dtype_name(linear_weight), target_shape=target.shape, target_dtype=dtype_name(target),
        bias_shape=shape_of(linear_bias), bias_dtype=dtype_name(linear_bias), weight_layout=weight_layout)
    _check_target_range(target, shape.vocab, o.ignore_index)
    n = shape.n_rows
    y, ignore32 = narrow_targets(target.reshape(n), shape.vocab, o.ignore_index)
    cfg = LogProbsConfig(dataclasses.replace(o, ignore_index=ignore32), weight_layout,
                         chunk_rows(tuning, n, shape.hidden, shape.vocab), shape.vocab, return_entropy,
                         accumulate_in_input_dtype)

    def rows(x, W, b, y):
        outs = log_probs(x.reshape(n, shape.hidden), W, b, y, cfg)
        return tuple(a.reshape(shape.lead_shape) for a in outs)

    logp, entropy, argmax = on_mesh(rows, (input, linear_weight, linear_bias, y), lambda: (row_spec(input),) * 3)
    outs = (logp,) + ((entropy,) if return_entropy else ()) + ((argmax,) if return_argmax else ())
    return outs[0] if len(outs) == 1 else outs
