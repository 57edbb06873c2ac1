"""The float64 references of `linear_log_probs` and `linear_policy_loss` (interop/SPEC.md,
"Log-probabilities", "Policy loss"), in numpy: materialise the logits, for small shapes only;
tested against float64 autograd."""

from __future__ import annotations

import dataclasses

import numpy as np

from interop.log_probs import LogProbsOptions
from interop.policy_loss import PolicyLossOptions, mean_weight, token_stats, token_terms


@dataclasses.dataclass
class LogProbsResult:
    """float64 outputs (argmax int64): log_probs, entropy, argmax [...]; grad_input [..., D];
    grad_weight shaped as the given weight; grad_bias [V] or None."""

    log_probs: np.ndarray
    entropy: np.ndarray
    argmax: np.ndarray
    grad_input: np.ndarray
    grad_weight: np.ndarray
    grad_bias: np.ndarray | None


def linear_log_probs_reference(input, linear_weight, target, *, linear_bias=None, temperature=1.0, softcap=None,
                               ignore_index=-100, weight_layout="VD", grad_log_probs=None,
                               grad_entropy=None) -> LogProbsResult:
    """Outputs and the gradients of sum(grad_log_probs * log_probs + grad_entropy *
    entropy) (either upstream gradient [...] or None for zeros). A target out of [0, V)
    that is not ignore_index gives a NaN log-probability (and NaN gradients)."""
    o = LogProbsOptions(temperature, softcap, ignore_index)
    x = np.asarray(input, np.float64)
    lead = x.shape[:-1]
    x_ND = x.reshape(int(np.prod(lead)), x.shape[-1])
    W = np.asarray(linear_weight, np.float64)
    W_VD = W if weight_layout == "VD" else W.T
    V = W_VD.shape[0]
    y = np.asarray(target).reshape(-1).astype(np.int64)
    b = None if linear_bias is None else np.asarray(linear_bias, np.float64)
    z = x_ND @ W_VD.T + (0.0 if b is None else b)
    s = z if o.softcap is None else o.softcap * np.tanh(z / o.softcap)
    u = s / o.temperature
    m = u.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(u - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(u - lse[:, None])
    with np.errstate(invalid="ignore"):  # p u is 0 where p is (a class masked by a -inf logit)
        pu = np.where(p == 0, 0.0, p * u)
    mean_u = pu.sum(axis=1)
    valid, in_range = y != o.ignore_index, (y >= 0) & (y < V)
    rows = np.arange(len(y))
    safe_y = np.where(in_range, y, 0)
    logp = np.where(valid, np.where(in_range, u[rows, safe_y] - lse, np.nan), 0.0)
    g_lp = np.zeros(len(y)) if grad_log_probs is None else np.asarray(grad_log_probs, np.float64).reshape(-1)
    g_H = np.zeros(len(y)) if grad_entropy is None else np.asarray(grad_entropy, np.float64).reshape(-1)
    g_lp = np.where(valid, np.where(in_range, g_lp, np.nan), 0.0)
    du = -p * g_lp[:, None] - g_H[:, None] * (pu - p * mean_u[:, None])
    du[rows, safe_y] += np.where(in_range, g_lp, 0.0)
    dz = du / o.temperature
    if o.softcap is not None:
        dz = dz * (1 - (s / o.softcap) ** 2)
    return LogProbsResult(
        log_probs=logp.reshape(lead), entropy=(lse - mean_u).reshape(lead), argmax=u.argmax(axis=1).reshape(lead),
        grad_input=(dz @ W_VD).reshape(x.shape), grad_weight=dz.T @ x_ND if weight_layout == "VD" else x_ND.T @ dz,
        grad_bias=None if b is None else dz.sum(axis=0))


@dataclasses.dataclass
class PolicyLossResult:
    """float64: the loss (0-d), grad_input [..., D], grad_weight as the given weight, grad_bias [V] or None;
    stats: `interop.policy_loss.token_stats`, each of the target's shape."""

    loss: np.ndarray
    grad_input: np.ndarray
    grad_weight: np.ndarray
    grad_bias: np.ndarray | None
    stats: dict


def linear_policy_loss_reference(input, linear_weight, target, advantages, *, old_log_probs=None, ref_log_probs=None,
                                 token_weight=None, policy_weight=None, kl_weight=None, entropy_weight=None,
                                 epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                                 entropy_coef=0.0, clip_ratio_c=None, kl_bias_correction=False, linear_bias=None,
                                 temperature=1.0, softcap=None, ignore_index=-100, weight_layout="VD") -> PolicyLossResult:
    """The loss of `linear_policy_loss` and its gradients: the per-token terms
    (`interop.policy_loss.token_terms`) of this reference's log-probabilities and entropy,
    their gradients through `linear_log_probs_reference`. Per-token arrays broadcast to the
    target's shape; token_weight None is 1 / (the valid tokens, at least 1)."""
    head = dict(linear_bias=linear_bias, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
                weight_layout=weight_layout)
    o = PolicyLossOptions(epsilon_low, epsilon_high, beta, entropy_coef, clip_ratio_c, kl_bias_correction)
    shape = np.shape(target)
    per_token = lambda a: None if a is None else np.broadcast_to(np.asarray(a, np.float64), shape).reshape(-1)
    out = linear_log_probs_reference(input, linear_weight, target, **head)
    valid = np.asarray(target).reshape(-1) != LogProbsOptions(ignore_index=ignore_index).ignore_index
    logp = out.log_probs.reshape(-1)
    w = per_token(token_weight) if token_weight is not None else mean_weight(np, valid, logp)
    loss, g, g_h = token_terms(np, o, logp, out.entropy.reshape(-1), valid, per_token(advantages),
                               per_token(old_log_probs), per_token(ref_log_probs), w, per_token(policy_weight),
                               per_token(kl_weight), per_token(entropy_weight))
    grads = linear_log_probs_reference(input, linear_weight, target, grad_log_probs=g.reshape(shape),
                                       grad_entropy=None if g_h is None else g_h.reshape(shape), **head)
    stats = token_stats(np, o, logp, out.entropy.reshape(-1), valid, per_token(advantages), per_token(old_log_probs),
                        per_token(ref_log_probs))
    return PolicyLossResult(loss.sum(), grads.grad_input, grads.grad_weight, grads.grad_bias,
                            {k: v.reshape(shape) for k, v in stats.items()})
