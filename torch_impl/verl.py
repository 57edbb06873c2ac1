"""verl's fused head on the library: `linear_cross_entropy` with the signature and outputs of
`verl.utils.kernel.linear_cross_entropy.linear_cross_entropy` (what verl's actors call with
`use_fused_kernels`), and `patch_verl`, which makes verl call it.

verl's kernel returns per-token log p(label) and the entropy at a temperature, for a head
that Megatron may split over a tensor-parallel group (`dist_process_group`: the weight is the
rank's equal slice of the classes, the labels global ids). Here that is `linear_log_probs`
with `return_entropy`, the group its `vocab_parallel`: never the N x V logits, grad_weight
accumulated in fp32, and the split head's few floats per row instead of verl's per-rank
logits tiles.
"""

from __future__ import annotations

import importlib
import sys

import torch

from torch_impl.log_probs import linear_log_probs

VERL_MODULE = "verl.utils.kernel.linear_cross_entropy"
REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         reduction: str = "none", dist_process_group=None):
    """(log_probs, entropy) as verl's kernel gives them: [N] (flattened) each, fp32.

    Args:
        hidden: [..., H] hidden states (bf16/fp16/fp32), flattened to [N, H] (verl's
            Megatron forwards pass [T, 1, H]). weight: [V, H], or this rank's [V / P, H]
            slice of the classes with dist_process_group.
        labels: [...] int64 class ids, N of them, flattened (global ones with a split head); one outside [0, V)
            raises ValueError, except -100 (the library's ignore_index: log-probability 0,
            no gradient; verl passes the next token of every position, never -100).
        temperature: T > 0; the logits are divided by it.
        reduction: "none" ([N] log-probabilities), "sum" or "mean" (their sum or mean over
            the N tokens, 0-d); the entropy is [N] either way, as verl's.
        dist_process_group: a process group splitting the head over the vocabulary, or None.
            As from verl's kernel, each rank's gradient of hidden is then its share, which
            the caller sums over the group: the backward of Megatron's sequence-parallel
            gather does (verl's default with tensor parallelism); without sequence
            parallelism nothing sums them, with verl's kernel as with this one.

    Returns:
        (log_probs, entropy), fp32, differentiable with respect to hidden and weight.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if dist_process_group is not None and hidden.requires_grad:
        # linear_log_probs gives every rank the whole grad_input; the caller sums the ranks'
        hidden = _Share.apply(hidden, torch.distributed.get_world_size(dist_process_group))
    log_probs, entropy = linear_log_probs(hidden, weight, labels, temperature=temperature, return_entropy=True,
                                          vocab_parallel=dist_process_group)
    if reduction == "sum":
        log_probs = log_probs.sum()
    elif reduction == "mean":
        log_probs = log_probs.mean()
    return log_probs, entropy


class _Share(torch.autograd.Function):
    """The identity, whose backward pass divides the gradient by the ranks: one rank's share
    of a gradient every rank holds whole, for a caller that sums the ranks' shares."""

    @staticmethod
    def forward(ctx, hidden, ranks: int):
        ctx.ranks = ranks
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.ranks, None


def patch_verl() -> None:
    """Make verl's fused-kernel path (`use_fused_kernels=True`) call `linear_cross_entropy`:
    the attribute of verl's kernel module (which its Hugging Face forwards import when they
    run) and every verl module already imported that took the kernel at its top (its Megatron
    forwards). Call it in each process that runs the actor (Ray workers too), before it
    runs; a second call changes nothing. Raises ImportError naming verl when verl is not
    installed, RuntimeError when its kernel module has no `linear_cross_entropy`."""
    try:
        module = importlib.import_module(VERL_MODULE)
    except ImportError as error:
        raise ImportError(f"patch_verl needs verl ({VERL_MODULE} did not import: {error})") from error
    original = getattr(module, "linear_cross_entropy", None)
    if original is None:
        raise RuntimeError(f"{VERL_MODULE} has no linear_cross_entropy: this verl version is not supported")
    for name, loaded in list(sys.modules.items()):
        if (name == "verl" or name.startswith("verl.")) and getattr(loaded, "linear_cross_entropy", None) is original:
            loaded.linear_cross_entropy = linear_cross_entropy
