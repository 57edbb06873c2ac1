"""Cross-entropy of a head split over the vocabulary across the ranks of a process group.

Rank r holds the classes [a_r, a_r + V_r) of the head (its rows of W in "VD", its columns in
"DV", its part of the bias), contiguous and in the group's rank order; the slices may be
uneven. Every rank has the same rows x and the same global targets. Per block of logits a
rank reduces its own columns to per-row statistics (running max m, sum of exponentials l,
the target's logit where the target is one of its classes, the class-weighted sum of the
logits for label smoothing); the ranks then combine them (one all-reduce MAX and one
all-reduce SUM of four floats per row: never logits) into the global lse, from which each
rank forms dz on its own columns in the backward pass, recomputing its logits. Each rank
gets its slice of grad_weight and grad_bias, and the full grad_input (one all-reduce SUM of
[N, D] in fp32, or with sequence parallel a reduce-scatter of it over the rows: see
`torch_impl.stepped.gather_rows`). Class weights are the full [V] vector on every rank. Every rank makes the
same collectives in the same order whatever its arguments (`vocab_slice` checks them all
first), so a bad argument on one rank raises on every rank instead of leaving the others
waiting.

The loss runs as cross-entropy's fallback does (`torch_impl.stepped`: the blocks of
`torch_impl.blocks.HeadBlocks`, the steps of `torch_impl.steps`, Triton kernels where they
run, PyTorch ops elsewhere), with the ranks' statistics combined. As Megatron's and
PyTorch's `loss_parallel`, the forward pass only computes statistics and the backward pass
recomputes the logits (8 N D V / P flops per rank).

A DTensor head sharded on its vocabulary dimension over a 1-D mesh (what ColwiseParallel
makes), with an input replicated on that mesh, runs here too: its local slice and the mesh's
process group, the gradients returned as DTensors of the same placements. A DTensor head
with a plain input (FSDP2's sharded parameter used outside its module's forward, the rows
split across ranks) is gathered once per call (`local_operands`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # torch < 2.5: the same classes under their former module
    from torch.distributed._tensor import DTensor, Partial, Replicate, Shard

def vocab_slice(group, local_vocab: int, hidden: int, n_rows: int, device, problem: Exception | None) -> tuple[int, int]:
    """(first class of this rank's slice, V of the whole head), from the ranks' slice sizes
    gathered over `group` with what every rank must share (D, N) and whether its own
    arguments passed their checks (`problem`: None, or the error this rank raises). Every
    rank raises when any rank's arguments are wrong, so none waits in a later collective."""
    facts = torch.tensor([local_vocab, hidden, n_rows, problem is not None], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(facts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, facts, group=group)
    table = torch.stack(gathered).tolist()
    if problem is not None:
        raise problem
    failed = [r for r, row in enumerate(table) if row[3]]
    if failed:
        raise ValueError(f"vocab_parallel: the arguments of rank(s) {failed} of the group failed their checks")
    if any(row[1:3] != table[0][1:3] for row in table):
        raise ValueError(f"vocab_parallel: every rank needs the same rows and hidden size; (D, N) by rank: "
                         f"{[tuple(row[1:3]) for row in table]}")
    if any(row[0] < 1 for row in table):
        raise ValueError(f"vocab_parallel: every rank must hold at least one class; classes by rank: "
                         f"{[row[0] for row in table]}")
    rank = dist.get_rank(group)
    return sum(row[0] for row in table[:rank]), sum(row[0] for row in table)


def _gathered(t):
    """A DTensor's whole value as a plain tensor, differentiably: its gradient, different on
    every rank (their own rows), is averaged over the mesh and scattered back to the
    DTensor's placements, as FSDP2 reduces the gradients of the parameters it shards."""
    if not isinstance(t, DTensor):
        return t
    return t.full_tensor(grad_placements=[Partial("avg")] * t.device_mesh.ndim)


def any_dtensor(*tensors) -> bool:
    """Whether any argument is a DTensor."""
    return any(isinstance(t, DTensor) for t in tensors)


def local_operands(linear_weight, input, linear_bias, weight_layout: str):
    """Plain tensors for DTensor arguments: (input, head, bias, process group or None, the
    input's dimension split over the group or None).

    A head sharded on its vocabulary dimension over a 1-D mesh, with the input a DTensor
    on that mesh, replicated (tensor parallel, as `loss_parallel`) or sharded on a dimension
    other than its last (sequence parallel, as torchtitan's Shard(1) hidden states): the local
    slices and the mesh's group, each differentiable back to its DTensor (the head's and the
    bias' gradients keep their Shard placement, the input's its own). A DTensor head with a
    plain input (FSDP2, rows split across ranks): the head and bias gathered (`_gathered`),
    no group. None when no argument is a DTensor."""
    if not any_dtensor(linear_weight, input, linear_bias):
        return None
    if not isinstance(input, DTensor):
        return input, _gathered(linear_weight), _gathered(linear_bias), None, None
    if not isinstance(linear_weight, DTensor) or linear_weight.device_mesh != input.device_mesh \
            or input.device_mesh.ndim != 1:
        raise ValueError("a DTensor input needs a DTensor linear_weight on the same 1-D mesh")
    (placement,) = input.placements
    rows_dim = None
    if isinstance(placement, Shard) and placement.dim % input.ndim < input.ndim - 1:
        rows_dim = placement.dim % input.ndim
    elif placement != Replicate():
        raise ValueError(f"a DTensor input must be replicated on its mesh or sharded on a dimension of its rows (not "
                         f"the last, the hidden size), got placements {tuple(input.placements)}")
    vocab_dim = 0 if weight_layout == "VD" else 1
    placements = tuple(linear_weight.placements)
    if placements not in ((Shard(vocab_dim),), (Replicate(),)):
        raise ValueError(f"linear_weight with a DTensor input must be Shard({vocab_dim}) (its vocabulary, weight_layout="
                         f"{weight_layout!r}) or Replicate(), got {placements}")
    bias = linear_bias
    if isinstance(bias, DTensor):
        if tuple(bias.placements) != ((Shard(0),) if placements != (Replicate(),) else (Replicate(),)):
            raise ValueError(f"linear_bias must be placed as the head's vocabulary, got {tuple(bias.placements)}")
        bias = bias.to_local()
    if placements == (Replicate(),) and rows_dim is not None:
        raise ValueError("a DTensor input sharded on its rows needs a head sharded on its vocabulary")
    if rows_dim is not None and input.shape[rows_dim] % input.device_mesh.size() != 0:
        raise ValueError(f"a DTensor input sharded on dimension {rows_dim} needs equal parts: its size "
                         f"{input.shape[rows_dim]} does not divide over the mesh's {input.device_mesh.size()} ranks")
    group = None if placements == (Replicate(),) else input.device_mesh.get_group()
    return input.to_local(), linear_weight.to_local(), bias, group, rows_dim
