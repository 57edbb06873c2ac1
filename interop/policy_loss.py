"""The clipped policy-gradient loss of `linear_policy_loss` (PPO, GRPO and their variants),
shared by both frameworks and the float64 reference (interop/SPEC.md, "Policy loss"): its
options, and the per-token terms written once over an array namespace (numpy, torch or
jax.numpy), from the policy's log-probabilities and entropy to the loss of each token and
its gradients with respect to both.

Because each token's loss and gradients depend only on that token's log-probability and
entropy (and on per-token data known before the call), the kernel paths evaluate them block
by block and form dz in the forward pass, where `linear_log_probs` cannot.
"""

from __future__ import annotations

import dataclasses
import numbers

from interop.options import check_flags, nonnegative

# The per-token values `token_stats` gives (return_stats): names, in order.
STATS = ("log_probs", "entropy", "ratio", "kl", "clipped_low", "clipped_high", "dual_clipped")
# The per-token arguments, in the order `token_terms` takes them.
TOKEN_ARGUMENTS = ("advantages", "old_log_probs", "ref_log_probs", "token_weight", "policy_weight", "kl_weight",
                   "entropy_weight")


def check_token_argument(name: str, value, array_types: tuple) -> None:
    """A per-token argument is a tensor or array (`array_types`) or a number, or None where
    optional (all but advantages); TypeError naming it else (a bool or a string is no
    per-token value)."""
    if value is None:
        if name == "advantages":
            raise TypeError("advantages is required: a number or a tensor / array that broadcasts to the target's shape")
        return
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (number or isinstance(value, array_types)):
        raise TypeError(f"{name} must be a number or a tensor / array that broadcasts to the target's shape, "
                        f"got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class PolicyLossOptions:
    """Options of the per-token loss, validated on construction (the head's options are
    `interop.log_probs.LogProbsOptions`).

    epsilon_low, epsilon_high: the importance ratio is clipped to [1 - epsilon_low,
        1 + epsilon_high] (PPO's epsilon both; DAPO's "clip higher" raises epsilon_high).
    beta: weight of the k3 estimate of the KL divergence to a reference policy (GRPO); 0: none.
    entropy_coef: weight of the entropy bonus (subtracted from the loss); 0: none.
    clip_ratio_c: dual-clip (verl's clip_ratio_c): a token of negative advantage loses at
        most -clip_ratio_c A; None: no bound. Greater than 1.
    kl_bias_correction: the KL term multiplied by the ratio r (TRL's use_bias_correction_kl:
        an unbiased estimate off-policy), its gradient through r included.
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    entropy_coef: float = 0.0
    clip_ratio_c: float | None = None
    kl_bias_correction: bool = False

    def __post_init__(self):
        for name in ("epsilon_low", "epsilon_high", "beta", "entropy_coef"):
            object.__setattr__(self, name, nonnegative(name, getattr(self, name)))
        if self.epsilon_low >= 1.0:
            raise ValueError(f"epsilon_low must be < 1 (the ratio's lower clip 1 - epsilon_low > 0), got {self.epsilon_low}")
        if self.clip_ratio_c is not None:
            c = nonnegative("clip_ratio_c", self.clip_ratio_c)
            if c <= 1.0:
                raise ValueError(f"clip_ratio_c must be > 1 (a bound above the clipped ratio), got {self.clip_ratio_c!r}")
            object.__setattr__(self, "clip_ratio_c", c)
        check_flags(kl_bias_correction=self.kl_bias_correction)
        object.__setattr__(self, "kl_bias_correction", bool(self.kl_bias_correction))

    def check_references(self, ref_log_probs) -> None:
        """ValueError where the KL term has no reference policy."""
        if self.beta and ref_log_probs is None:
            raise ValueError(f"beta={self.beta} needs ref_log_probs (the reference policy's log-probabilities)")


def mean_weight(xp, valid, like):
    """The default token_weight: 1 / (the valid tokens, at least 1) on each valid token, 0
    elsewhere (a mean over the tokens), in like's dtype; valid: bool [N] over all the rows."""
    zero = 0.0 * like
    return xp.where(valid, zero + 1.0, zero) / xp.clip(valid.sum(), 1, None)


def token_stats(xp, o: PolicyLossOptions, log_probs, entropy, valid, advantages, old_log_probs, ref_log_probs):
    """The per-token values trainers log (their clip fractions, KL and entropy means), [N]
    each, 0 or False where `valid` is False: log_probs, entropy, ratio r; kl (K of
    `token_terms`) when ref_log_probs is given; clipped_low (r < 1 - eps_low where A < 0)
    and clipped_high (r > 1 + eps_high where A > 0), the tokens whose clip took the
    gradient away, as TRL counts them; dual_clipped (the bound -clip_ratio_c A held) when
    clip_ratio_c is set."""
    zero = 0.0 * log_probs
    r, _, _, bounded = _policy_term(xp, o, log_probs, advantages, old_log_probs)
    a = advantages + zero
    stats = dict(log_probs=log_probs, entropy=entropy, ratio=r)
    if ref_log_probs is not None:
        stats["kl"] = _kl_term(xp, o, r, log_probs, ref_log_probs)[0]
    stats = {k: xp.where(valid, v, zero) for k, v in stats.items()}
    stats["clipped_low"] = valid & (r < 1.0 - o.epsilon_low) & (a < 0)
    stats["clipped_high"] = valid & (r > 1.0 + o.epsilon_high) & (a > 0)
    if bounded is not None:
        stats["dual_clipped"] = valid & bounded
    return stats


def _policy_term(xp, o: PolicyLossOptions, log_probs, advantages, old_log_probs):
    """(r, P, dP / d log_probs, where dual-clip's bound held (None without one)) per token,
    as `token_terms` defines them."""
    zero = 0.0 * log_probs
    r = zero + 1.0 if old_log_probs is None else xp.exp(log_probs - old_log_probs)
    clipped = xp.clip(r, 1.0 - o.epsilon_low, 1.0 + o.epsilon_high)
    unclipped_obj, clipped_obj = r * advantages, clipped * advantages
    loss = -xp.minimum(unclipped_obj, clipped_obj)
    # the unclipped branch unless the clipped one is the smaller: a NaN ratio or advantage
    # takes it, so its gradient is NaN too, as the loss is
    g = xp.where(unclipped_obj > clipped_obj, zero, -unclipped_obj)
    bounded = None
    if o.clip_ratio_c is not None:
        bound = -o.clip_ratio_c * advantages
        bounded = (advantages < 0) & (loss > bound)
        loss, g = xp.where(bounded, bound, loss), xp.where(bounded, zero, g)
    return r, loss, g, bounded


def _kl_term(xp, o: PolicyLossOptions, r, log_probs, ref_log_probs):
    """(K, dK / d log_probs) per token, as `token_terms` defines them."""
    d = ref_log_probs - log_probs
    kl, g_kl = xp.exp(d) - d - 1.0, 1.0 - xp.exp(d)
    if o.kl_bias_correction:  # d(r k) / d logp = r k + r dk / d logp
        kl, g_kl = r * kl, r * (kl + g_kl)
    return kl, g_kl


def token_terms(xp, o: PolicyLossOptions, log_probs, entropy, valid, advantages, old_log_probs, ref_log_probs,
                token_weight, policy_weight=None, kl_weight=None, entropy_weight=None):
    """(loss, d loss / d log_probs, d loss / d entropy) per token, [N] each, in xp's arrays.

    With r = exp(logp - old) (1 where old_log_probs is None: on-policy), A the advantage and
    k = exp(ref - logp) - (ref - logp) - 1 (the k3 estimate of the KL):

        loss = w v P + w_kl beta K - w_h entropy_coef H,   P = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

    with P at most -clip_ratio_c A where A < 0 (dual-clip, when set), v the policy term's
    weight (policy_weight: importance-sampling ratios, masks; None: 1), K = r k with
    kl_bias_correction, else k; w = token_weight, w_kl = kl_weight and w_h = entropy_weight
    (each None: w); 0 where `valid` is False (ignored tokens). A clipped or bounded branch
    has no gradient; where two branches are equal the gradient is the unclipped one's. The
    entropy's gradient is None when entropy_coef is 0."""
    zero = 0.0 * log_probs
    r, loss, g, _ = _policy_term(xp, o, log_probs, advantages, old_log_probs)
    if policy_weight is not None:
        loss, g = policy_weight * loss, policy_weight * g
    # where(valid, ...): an ignored token's terms may be inf or NaN (its old log-probability
    # is anything), and 0 * NaN is NaN
    w = xp.where(valid, token_weight, zero)
    weight = lambda own: w if own is None else xp.where(valid, own, zero)
    loss, g = w * loss, w * g
    if o.beta:
        kl, g_kl = _kl_term(xp, o, r, log_probs, ref_log_probs)
        w_kl = weight(kl_weight)
        loss, g = loss + o.beta * w_kl * kl, g + o.beta * w_kl * g_kl
    g_h = None
    if o.entropy_coef:
        g_h = -o.entropy_coef * weight(entropy_weight)
        loss = loss + g_h * entropy
    return xp.where(valid, loss, zero), xp.where(valid, g, zero), g_h
