"""GRPO and DPO losses on a policy's hidden states and head, without the [B, T, V] logits.

    python examples/rl_losses_torch.py

The policy's per-token log-probabilities (and entropy, for GRPO's bonus) come from
`logitless.torch.linear_log_probs`, fused with the head; the losses themselves are per-token
formulas. GRPO's loss is also one call (`grpo_in_one_call`: `logitless.torch.linear_policy_loss`),
which forms the gradients in the forward pass (a quarter fewer flops than recomputing the logits). Shapes: hidden [B, T, D] at the positions that predict the completion's tokens,
head [V, D], completion ids and mask [B, T]. As a script it computes both losses and their
gradients twice, fused and from materialised logits, and prints the largest differences.
"""

from __future__ import annotations

import torch

import logitless.torch as lt


def policy_log_probs(hidden, head, ids, mask, temperature=1.0):
    """(log p(ids) [B, T], entropy [B, T]) at `temperature`, fused; 0 log-probability outside mask."""
    return lt.linear_log_probs(hidden, head, ids.masked_fill(~mask, -100), temperature=temperature,
                               return_entropy=True)


def naive_policy_log_probs(hidden, head, ids, mask, temperature=1.0):
    """What `policy_log_probs` computes, from the [B, T, V] logits (fp32)."""
    logp_all = torch.log_softmax(hidden.float() @ head.float().T / temperature, -1)
    logp = logp_all.gather(-1, ids[..., None])[..., 0]
    return torch.where(mask, logp, 0.0), -(logp_all.exp() * logp_all).sum(-1)


def grpo_loss(logp, entropy, mask, old_log_probs, ref_log_probs, advantages, *, epsilon=0.2, beta=0.04,
              entropy_coef=0.0):
    """GRPO (DeepSeekMath; TRL's GRPOTrainer): per token the clipped importance-ratio objective
    minus beta times the KL to the reference policy (the k3 estimator), averaged over each
    sequence's completion tokens, then over the sequences; minus entropy_coef times the
    entropy. old_log_probs, ref_log_probs: [B, T] of the sampling and reference policies;
    advantages [B], one per sequence."""
    ratio = torch.exp(logp - old_log_probs)
    a = advantages[:, None]
    objective = torch.minimum(ratio * a, ratio.clamp(1 - epsilon, 1 + epsilon) * a)
    kl = torch.exp(ref_log_probs - logp) - (ref_log_probs - logp) - 1
    per_token = -(objective - beta * kl) - entropy_coef * entropy
    return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def dpo_loss(chosen_log_probs, rejected_log_probs, ref_chosen, ref_rejected, *, beta=0.1):
    """DPO (Rafailov et al.): -log sigmoid(beta * margin), the margin being the chosen
    completion's summed log-probability ratio to the reference minus the rejected one's.
    *_log_probs: [B, T] (0 outside the completion); ref_*: [B], the reference's sums."""
    margin = (chosen_log_probs.sum(1) - ref_chosen) - (rejected_log_probs.sum(1) - ref_rejected)
    return -torch.nn.functional.logsigmoid(beta * margin).mean()


def both_losses(log_probs_fn, hidden, head, batch):
    """(GRPO loss, DPO loss) with the policy's log-probabilities from `log_probs_fn`."""
    ids, mask, old, ref, adv = batch
    logp, entropy = log_probs_fn(hidden, head, ids, mask, 0.9)
    grpo = grpo_loss(logp, entropy, mask, old, ref, adv, entropy_coef=0.01)
    half = ids.shape[0] // 2  # the first half of the sequences chosen, the second rejected
    dpo = dpo_loss(logp[:half], logp[half:], ref[:half].sum(1), ref[half:].sum(1))
    return grpo, dpo


def grpo_in_one_call(hidden, head, batch):
    """`grpo_loss` as one call: each sequence's tokens weighted 1 / (its length x B) for the
    mean over each sequence and then over sequences; the gradients formed in the forward pass."""
    ids, mask, old, ref, adv = batch
    weight = mask / mask.sum(1, keepdim=True).clamp(min=1) / ids.shape[0]
    return lt.linear_policy_loss(hidden, head, ids.masked_fill(~mask, -100), adv[:, None], old_log_probs=old,
                                 ref_log_probs=ref, token_weight=weight, beta=0.04, entropy_coef=0.01,
                                 temperature=0.9)


def differences(seed: int = 0, B: int = 4, T: int = 16, D: int = 32, V: int = 1000) -> dict:
    """The largest absolute differences between the fused and the materialised recipes: each
    loss and its gradients with respect to the hidden states and the head."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(V, D, generator=gen) / D**0.5
    hidden = torch.randn(B, T, D, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=gen)[:, None]
    with torch.no_grad():
        old = naive_policy_log_probs(hidden, head, ids, mask, 0.9)[0] + 0.05 * torch.randn(B, T, generator=gen)
    batch = (ids, mask, old, old + 0.1 * torch.randn(B, T, generator=gen), torch.randn(B, generator=gen))
    out = {}
    for fused, naive, name in zip(both_losses(policy_log_probs, hidden.requires_grad_(), head.requires_grad_(), batch),
                                  both_losses(naive_policy_log_probs, hidden, head, batch), ("grpo", "dpo")):
        # both losses read one call's log-probabilities: keep its graph for the second
        got = torch.autograd.grad(fused, (hidden, head), retain_graph=True)
        want = torch.autograd.grad(naive, (hidden, head), retain_graph=True)
        out[name] = float((fused - naive).abs().detach())
        out[f"{name} grad hidden"] = float((got[0] - want[0]).abs().max())
        out[f"{name} grad head"] = float((got[1] - want[1]).abs().max())
    fused = grpo_in_one_call(hidden, head, batch)
    naive = both_losses(naive_policy_log_probs, hidden, head, batch)[0]
    got, want = torch.autograd.grad(fused, (hidden, head)), torch.autograd.grad(naive, (hidden, head))
    out["grpo in one call"] = float((fused - naive).abs().detach())
    out["grpo in one call grad hidden"] = float((got[0] - want[0]).abs().max())
    out["grpo in one call grad head"] = float((got[1] - want[1]).abs().max())
    return out


if __name__ == "__main__":
    for name, diff in differences().items():
        print(f"{name}: {diff:.2e}")
