"""`linear_policy_loss` for JAX, with the arguments, defaults and semantics of
`logitless.torch.linear_policy_loss` (interop/SPEC.md, "Policy loss"): the clipped policy-gradient
loss of PPO and GRPO on a linear head, without the N x V logits.

One `engine.Call`: "speed" forms the gradients in the forward rule from one product per
block of whole rows (`log_probs_rule.forward_with_grads`, 6 N D V flops) and the backward rule
scales them (in fp32); "memory" and "chunked" keep the log-probabilities and entropy and recompute the
logits in the backward rule (`log_probs_rule.grads`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from interop.blocking import skipping_pays
from interop.log_probs import LogProbsOptions
from interop.options import check_flags
from interop.policy_loss import (TOKEN_ARGUMENTS, PolicyLossOptions, check_token_argument, mean_weight, token_stats,
                                 token_terms)
from interop.tuning import Tuning
from jax_impl import engine
from jax_impl.distill_rules import DistillConfig
from jax_impl.functional import as_array, choose_strategy, platform_of
from jax_impl.distill_rules import plan_steps
from jax_impl.log_probs import checked_call
from jax_impl.log_probs_rule import forward, forward_with_grads, grads
from jax_impl.rows import compute_dtype, narrow_targets
from jax_impl.sharding import on_mesh, row_spec, with_rows_axes


def _terms(o: PolicyLossOptions, cfg: DistillConfig, y, logp, entropy, tokens: dict):
    valid = y != cfg.options.ignore_index
    return token_terms(jnp, o, logp, entropy, valid, *(tokens.get(k) for k in TOKEN_ARGUMENTS))


@dataclasses.dataclass(frozen=True)
class _Upstream:
    """The upstream gradients of a block's log-probabilities and entropy, from its rows'
    targets and per-token arrays (named by keys): `log_probs_rule.forward_with_grads`' upstream."""

    o: PolicyLossOptions
    cfg: DistillConfig
    keys: tuple

    def __call__(self, logp_R, entropy_R, rows):
        y_R, *values = rows
        return _terms(self.o, self.cfg, y_R, logp_R, entropy_R, dict(zip(self.keys, values)))[1:]


def _keep(cfg: DistillConfig, skip: bool, y_N):
    """The rows to compute: those not ignored where `skip` (an ignored token adds nothing),
    else None (all)."""
    return (y_N != cfg.options.ignore_index) if skip else None


@dataclasses.dataclass(frozen=True)
class _PolicyCall(engine.Call):
    """The loss (0-d, fp32; fp64 for fp64 inputs) and the rows' log-probabilities and entropy
    ([N], their cotangents unread) over arrays (x [N, D], W, b, int32 targets y [N], the
    per-token arrays: a dict of [N] in the compute dtype, absent keys None; they get no
    gradient). skip: compute only the rows not ignored; axis: the
    shard_map axis of a head split over the vocabulary (`log_probs_rule.forward`), or None."""

    cfg: DistillConfig
    o: PolicyLossOptions
    skip: bool
    axis: str | None = None

    @property
    def grads_in_forward(self):
        return self.cfg.strategy == "speed"

    def forward(self, arrays, with_grads):
        x_ND, W, b_V, y_N, tokens = arrays
        keep, cfg = _keep(self.cfg, self.skip, y_N), self.cfg
        if with_grads:
            logp, entropy, *grads = forward_with_grads(x_ND, W, b_V, y_N, (y_N,) + tuple(tokens.values()), cfg,
                                                       _Upstream(self.o, cfg, tuple(tokens)), keep, self.axis)
            return (_terms(self.o, cfg, y_N, logp, entropy, tokens)[0].sum(), logp, entropy), None, tuple(grads)
        logp, entropy, _, lse = forward(x_ND, W, b_V, y_N, cfg, keep, self.axis)
        return (_terms(self.o, cfg, y_N, logp, entropy, tokens)[0].sum(), logp, entropy), (logp, entropy, lse), None

    def backward(self, arrays, saved, cotangents):
        (x_ND, W, b_V, y_N, tokens), (logp, entropy, lse), g_loss = arrays, saved, cotangents[0]
        _, g, g_h = _terms(self.o, self.cfg, y_N, logp, entropy, tokens)
        return grads(x_ND, W, b_V, y_N, lse, entropy, g * g_loss, None if g_h is None else g_h * g_loss, self.cfg,
                     _keep(self.cfg, self.skip, y_N), self.axis)


def policy_loss(x_ND, W, b_V, y_N, tokens: dict, cfg: DistillConfig, o: PolicyLossOptions, skip: bool,
                axis: str | None = None):
    """`_PolicyCall`'s (loss, log-probabilities, entropy) through `engine.apply`."""
    return engine.apply(_PolicyCall(cfg, o, skip, axis), x_ND, W, b_V, y_N, tokens)


def _per_token(name: str, value, shape, wide):
    """A per-token argument as [N] in the compute dtype: an array or a number that
    broadcasts to the target's shape (`check_token_argument`'s TypeError for other types;
    ValueError naming it for another shape or an integer dtype)."""
    check_token_argument(name, value, (jax.Array, np.ndarray, np.generic))
    if value is None:
        return None
    a = jnp.asarray(value, wide) if isinstance(value, (int, float, np.number)) else as_array(name, value)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got {a.dtype}")
    try:
        return jnp.broadcast_to(a.astype(wide), shape).reshape(-1)
    except ValueError:
        raise ValueError(f"{name} of shape {a.shape} does not broadcast to the target's shape {tuple(shape)} "
                         "(a per-sequence advantage [B] of targets [B, T] is advantages[:, None])") from None


def linear_policy_loss(input, linear_weight, target, advantages, *, old_log_probs=None, ref_log_probs=None,
                       token_weight=None, policy_weight=None, kl_weight=None, entropy_weight=None,
                       epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                       beta: float = 0.0, entropy_coef: float = 0.0, clip_ratio_c: float | None = None,
                       kl_bias_correction: bool = False, linear_bias=None, temperature: float = 1.0,
                       softcap: float | None = None, ignore_index: int | None = -100, weight_layout: str = "VD",
                       strategy: str = "auto", accumulate_in_input_dtype: bool = False, tuning: Tuning | None = None,
                       vocab_parallel: str | None = None, return_stats: bool = False):
    """The clipped policy-gradient loss (PPO, GRPO): the arguments and formula of
    `logitless.torch.linear_policy_loss` (input [..., D], linear_weight [V, D] "VD" or [D, V]
    "DV", target [...] token ids; advantages, old_log_probs, ref_log_probs, token_weight,
    policy_weight, kl_weight and entropy_weight broadcast to the target's shape; the
    default token_weight averages the call's tokens: inside shard_map, each shard's).
    Differentiable in input, linear_weight and linear_bias
    (`jax.custom_vjp`; the per-token arrays get zero cotangents); usable under `jax.jit`,
    where a target out of [0, V) that is not ignore_index gives a NaN loss instead of the
    eager call's ValueError. vocab_parallel: as for `logitless.jax.linear_log_probs` (inside
    shard_map, the mesh axis splitting the head by vocabulary).

    Returns:
        the loss, 0-d, fp32 (fp64 for fp64 input); with return_stats, (loss, stats), stats
        the dict of per-token arrays of the target's shape that PyTorch's return_stats gives
        (`interop.policy_loss.token_stats`; under `jax.lax.stop_gradient`).
    """
    check_flags(return_stats=return_stats, accumulate_in_input_dtype=accumulate_in_input_dtype)
    head = LogProbsOptions(temperature, softcap, ignore_index)
    o = PolicyLossOptions(epsilon_low, epsilon_high, beta, entropy_coef, clip_ratio_c, kl_bias_correction)
    o.check_references(ref_log_probs)
    input, linear_weight, target, linear_bias, shape, tuning = checked_call(input, linear_weight, target, linear_bias,
                                                                            head, weight_layout, strategy, tuning,
                                                                            vocab_parallel)
    n, wide = shape.n_rows, compute_dtype(input.dtype)
    given = dict(advantages=advantages, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                 token_weight=token_weight, policy_weight=policy_weight, kl_weight=kl_weight,
                 entropy_weight=entropy_weight)
    tokens = {k: _per_token(k, given[k], target.shape, wide) for k in TOKEN_ARGUMENTS
              if given[k] is not None or k == "advantages"}  # (advantages None raises)
    y, ignore32 = narrow_targets(target.reshape(n), shape.vocab, head.ignore_index)
    if "token_weight" not in tokens:
        tokens["token_weight"] = mean_weight(jnp, y != ignore32, jnp.zeros(y.shape, wide))
    platform = platform_of(input)
    local_vocab = linear_weight.shape[0 if weight_layout == "VD" else 1]
    strategy = choose_strategy(strategy, input.dtype, n, shape.hidden, local_vocab, platform, tuning)
    cfg = plan_steps(tuning, "log_probs", dataclasses.replace(head, ignore_index=ignore32), weight_layout, strategy,
                     n, shape.hidden, local_vocab, input.dtype, accumulate_in_input_dtype, platform,
                     None if vocab_parallel is None else shape.vocab)

    keys = tuple(tokens)
    skip = strategy != "chunked" and skipping_pays(tuning, n, shape.hidden, local_vocab)

    def loss(x, W, b, y, *values):
        total, logp, entropy = policy_loss(x.reshape(n, shape.hidden), W, b, y, dict(zip(keys, values)), cfg, o, skip,
                                           vocab_parallel)
        return total, logp.reshape(shape.lead_shape), entropy.reshape(shape.lead_shape)

    if vocab_parallel is not None:  # inside shard_map: the device's own operands
        total, logp, entropy = loss(input, *with_rows_axes((linear_weight, linear_bias), input), y, *tokens.values())
    else:
        total, logp, entropy = on_mesh(loss, (input, linear_weight, linear_bias, y, *tokens.values()),
                                       lambda: (P(), row_spec(input), row_spec(input)))
    if not return_stats:
        return total
    stats = token_stats(jnp, o, logp.reshape(n), entropy.reshape(n), y != ignore32, tokens["advantages"],
                        tokens.get("old_log_probs"), tokens.get("ref_log_probs"))
    return total, {k: jax.lax.stop_gradient(v.reshape(target.shape)) for k, v in stats.items()}
