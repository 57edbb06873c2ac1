"""GRPO and DPO losses on a policy's hidden states and head, without the [B, T, V] logits (JAX).

    python examples/rl_losses_jax.py

The twin of examples/rl_losses_torch.py: the policy's per-token log-probabilities and
entropy from `logitless.jax.linear_log_probs`, fused with the head ([V, D] here; pass
weight_layout="DV" for an nnx.Linear kernel), then per-token formulas; GRPO also as one
call, `logitless.jax.linear_policy_loss` (`grpo_in_one_call`). As a script it
computes both losses and their gradients twice, fused and from materialised logits, and
prints the largest differences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import logitless.jax as lj


def policy_log_probs(hidden, head, ids, mask, temperature=1.0):
    """(log p(ids) [B, T], entropy [B, T]) at `temperature`, fused; 0 log-probability outside mask."""
    return lj.linear_log_probs(hidden, head, jnp.where(mask, ids, -100), temperature=temperature,
                               return_entropy=True)


def naive_policy_log_probs(hidden, head, ids, mask, temperature=1.0):
    """What `policy_log_probs` computes, from the [B, T, V] logits (fp32: on a GPU, XLA's default
    precision would multiply fp32 matrices in TF32)."""
    logits = jnp.matmul(hidden.astype(jnp.float32), head.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    logp_all = jax.nn.log_softmax(logits / temperature, -1)
    logp = jnp.take_along_axis(logp_all, ids[..., None], -1)[..., 0]
    return jnp.where(mask, logp, 0.0), -(jnp.exp(logp_all) * logp_all).sum(-1)


def grpo_loss(logp, entropy, mask, old_log_probs, ref_log_probs, advantages, *, epsilon=0.2, beta=0.04,
              entropy_coef=0.0):
    """GRPO: per token the clipped importance-ratio objective minus beta times the k3 KL to the
    reference policy, averaged over each sequence's completion tokens, then over sequences;
    minus entropy_coef times the entropy (as examples/rl_losses_torch.py)."""
    ratio = jnp.exp(logp - old_log_probs)
    a = advantages[:, None]
    objective = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * a)
    kl = jnp.exp(ref_log_probs - logp) - (ref_log_probs - logp) - 1
    per_token = -(objective - beta * kl) - entropy_coef * entropy
    return ((per_token * mask).sum(1) / jnp.maximum(mask.sum(1), 1)).mean()


def dpo_loss(chosen_log_probs, rejected_log_probs, ref_chosen, ref_rejected, *, beta=0.1):
    """DPO: -log sigmoid(beta * margin) of the summed log-probability ratios (chosen minus rejected)."""
    margin = (chosen_log_probs.sum(1) - ref_chosen) - (rejected_log_probs.sum(1) - ref_rejected)
    return -jax.nn.log_sigmoid(beta * margin).mean()


def both_losses(log_probs_fn, hidden, head, batch):
    """(GRPO loss, DPO loss) with the policy's log-probabilities from `log_probs_fn`."""
    ids, mask, old, ref, adv = batch
    logp, entropy = log_probs_fn(hidden, head, ids, mask, 0.9)
    half = ids.shape[0] // 2  # the first half of the sequences chosen, the second rejected
    return (grpo_loss(logp, entropy, mask, old, ref, adv, entropy_coef=0.01),
            dpo_loss(logp[:half], logp[half:], ref[:half].sum(1), ref[half:].sum(1)))


def grpo_in_one_call(hidden, head, batch):
    """`grpo_loss` as one call: each sequence's tokens weighted 1 / (its length x B) for the
    mean over each sequence and then over sequences; the gradients formed in the forward pass."""
    ids, mask, old, ref, adv = batch
    weight = mask / jnp.maximum(mask.sum(1, keepdims=True), 1) / ids.shape[0]
    return lj.linear_policy_loss(hidden, head, jnp.where(mask, ids, -100), adv[:, None], old_log_probs=old,
                                 ref_log_probs=ref, token_weight=weight, beta=0.04, entropy_coef=0.01,
                                 temperature=0.9)


def differences(seed: int = 0, B: int = 4, T: int = 16, D: int = 32, V: int = 1000) -> dict:
    """The largest absolute differences between the fused and the materialised recipes: each
    loss and its gradients with respect to the hidden states and the head."""
    k = jax.random.split(jax.random.key(seed), 7)
    head = jax.random.normal(k[0], (V, D)) / D**0.5
    hidden = jax.random.normal(k[1], (B, T, D))
    ids = jax.random.randint(k[2], (B, T), 0, V)
    mask = jnp.arange(T)[None, :] < jax.random.randint(k[3], (B,), 1, T + 1)[:, None]
    old = naive_policy_log_probs(hidden, head, ids, mask, 0.9)[0] + 0.05 * jax.random.normal(k[4], (B, T))
    batch = (ids, mask, old, old + 0.1 * jax.random.normal(k[5], (B, T)), jax.random.normal(k[6], (B,)))
    out = {}
    for i, name in enumerate(("grpo", "dpo")):
        runs = [jax.value_and_grad(lambda h, w: both_losses(fn, h, w, batch)[i], argnums=(0, 1))(hidden, head)
                for fn in (policy_log_probs, naive_policy_log_probs)]
        (fused, got), (naive, want) = runs
        out[name] = float(jnp.abs(fused - naive))
        out[f"{name} grad hidden"] = float(jnp.abs(got[0] - want[0]).max())
        out[f"{name} grad head"] = float(jnp.abs(got[1] - want[1]).max())
    fused, got = jax.value_and_grad(grpo_in_one_call, argnums=(0, 1))(hidden, head, batch)
    naive, want = jax.value_and_grad(lambda h, w: both_losses(naive_policy_log_probs, h, w, batch)[0],
                                     argnums=(0, 1))(hidden, head)
    out["grpo in one call"] = float(jnp.abs(fused - naive))
    out["grpo in one call grad hidden"] = float(jnp.abs(got[0] - want[0]).max())
    out["grpo in one call grad head"] = float(jnp.abs(got[1] - want[1]).max())
    return out


if __name__ == "__main__":
    for name, diff in differences().items():
        print(f"{name}: {diff:.2e}")
