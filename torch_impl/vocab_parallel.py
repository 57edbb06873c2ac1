"""A linear head split over the vocabulary across the ranks of a process group.

Rank r holds the classes [a_r, a_r + V_r) of the head (its rows of W in "VD", its columns in
"DV", its part of the bias), contiguous and in the group's rank order; the slices may be
uneven. Every rank has the same rows x and the same global targets. A rank reduces its own
columns of each block of logits to per-row statistics (running max m, sum of exponentials l,
the target's logit where the target is one of its classes, the class-weighted sum of the
logits for label smoothing); the ranks then combine them (`combine_stats`: one all-reduce
MAX and one all-reduce SUM of four floats per row, never logits) into the global lse, from
which each rank forms dz on its own columns. Each rank gets its slice of grad_weight and
grad_bias, and the full grad_input (one all-reduce SUM of [N, D] in fp32, or with sequence
parallel a reduce-scatter of it over the rows: `VocabSplit.sum_grad_input`). Class weights
are the full [V] vector on every rank. Every rank makes the same collectives in the same
order whatever its arguments (`vocab_slice` checks them all first), so a bad argument on
one rank raises on every rank instead of leaving the others waiting. The ranks' calls must be
the same (options, dtypes, which inputs need a gradient, the targets) and so must their
upstream gradients: "speed" forms the summed gradients in the forward pass, and each rank
scales them by its own.

Every loss runs this as a mode of the block loop (`torch_impl.engine`): the rows gathered
into its blocks, each rule's statistics combined over the ranks (`combine_stats`, or the log-probabilities'
own combine, which adds the entropy's and the argmax's), grad_input summed. Where "speed"
forms the gradients in the forward pass it still does (6 N D V / P flops per rank), each
block of whole rows combined before its dz. `VocabSplit` is what the loop needs of the split.

A DTensor head sharded on its vocabulary dimension over a 1-D mesh (what ColwiseParallel
makes), with an input replicated on that mesh or sharded on its rows, runs here too: its local slice and the mesh's
process group, the gradients returned as DTensors of the same placements. A DTensor head
with a plain input (FSDP2's sharded parameter used outside its module's forward, the rows
split across ranks) is gathered once per call (`local_operands`).
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed as dist


try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # torch < 2.5: the same classes under their former module
    from torch.distributed._tensor import DTensor, Partial, Replicate, Shard


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """This rank's place in a head split over `group`: its first class, V of the whole head,
    the largest rank's class count (every rank plans its blocks for that many classes, so
    that all make the same collectives), and with sequence parallel the input's dimension
    that the ranks split (rows_dim; None: every rank has all rows)."""

    group: dist.ProcessGroup
    first: int
    vocab: int
    largest: int
    rows_dim: int | None = None

    def with_rows_dim(self, rows_dim: int | None) -> "VocabSplit":
        return dataclasses.replace(self, rows_dim=rows_dim)

    def common_strategy(self, strategy: str, device) -> str:
        """The kernel strategy every rank runs: "memory" where any rank's "auto" chose it (a
        rank's free memory is its own; the strategies differ in their collectives)."""
        if strategy not in ("speed", "memory"):
            return strategy
        flag = torch.tensor([strategy == "memory"], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return "memory" if flag.item() else "speed"

    def whole_rows(self, x) -> torch.Tensor:
        """The flattened rows [N, D]: x itself (already [N, D]) without sequence parallel,
        else every rank's part of x gathered along rows_dim (`gather_rows`)."""
        if self.rows_dim is None:
            return x
        return gather_rows(x, self.group, self.rows_dim).reshape(-1, x.shape[-1])

    def columns(self, y_N, cw_V, local_vocab: int):
        """(targets as this rank's columns, `local_targets`; its class weights [V_r] or None)."""
        cw = None if cw_V is None else cw_V[self.first : self.first + local_vocab]
        return local_targets(y_N, self.first, local_vocab), cw

    def sum_(self, tensors) -> None:
        """Each of `tensors` (one dtype) summed over the ranks in place, in one all-reduce."""
        flat = torch.cat([t.flatten() for t in tensors])
        dist.all_reduce(flat, group=self.group)
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))

    def sum_grad_input(self, dx_ND, x) -> torch.Tensor:
        """grad_input of x (this rank's input: all rows, or its part with sequence parallel)
        from every rank's share dx [N, D] (fp32), in x's dtype: summed over the ranks (one
        all-reduce), or with sequence parallel reduce-scattered to the parts. The sum is
        taken before rounding: one rank's share can be much larger than the sum (the
        target's -W_y on one rank, p W on the others)."""
        if self.rows_dim is not None:
            dx_ND = reduce_scatter_rows(dx_ND.view(*x.shape[: self.rows_dim], -1, *x.shape[self.rows_dim + 1 :]),
                                        self.group, self.rows_dim)
        else:
            dist.all_reduce(dx_ND, group=self.group)
        return dx_ND.to(x.dtype, memory_format=torch.contiguous_format)  # a part along dim 1 is a strided view


def local_targets(y_N, first: int, local_vocab: int):
    """Targets (or teacher ids) as this rank's column indices: y - first where y is one of
    its classes, else -1 (no column: the terms of other ranks' classes are theirs)."""
    mine = (y_N >= first) & (y_N < first + local_vocab)
    return torch.where(mine, y_N - first, torch.full_like(y_N, -1))


def combine_stats(running, sums, group):
    """[lse [N] of each running (m, l) pair] over all ranks' classes, and each tensor of
    `sums` summed over the ranks in place: one all-reduce MAX of the m's, one SUM of the
    rest (without a group, this rank's lse and nothing else). lse is NaN where any rank's
    running pair is NaN (a NaN logit, or +inf which makes l NaN), as one process gives: a
    MAX all-reduce need not keep NaN."""
    if group is None:
        return [m + torch.log(l) for m, l in running]
    m = torch.stack([m for m, _ in running])
    l = torch.stack([l for _, l in running])
    m_all = m.clone()
    dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
    finite = torch.isfinite(m_all)
    shift = torch.where(finite, m_all, torch.zeros_like(m_all))
    scaled = torch.where(m == -torch.inf, torch.zeros_like(l), l * torch.exp(m - shift))
    flat = torch.cat([scaled.flatten(), (torch.isnan(m) | torch.isnan(l)).to(l.dtype).flatten(), *(t.flatten() for t in sums)])
    dist.all_reduce(flat, group=group)
    k = m.numel()
    lse = torch.where(finite, shift + torch.log(flat[:k].view_as(m)), m_all)
    lse = torch.where(flat[k : 2 * k].view_as(m) > 0, torch.full_like(lse, torch.nan), lse)
    start = 2 * k
    for t in sums:
        t.copy_(flat[start : start + t.numel()].view_as(t))
        start += t.numel()
    return list(lse.unbind(0))


def gather_rows(x, group, dim: int) -> torch.Tensor:
    """Sequence parallel: every rank's part of the input (equal parts, split along `dim`),
    concatenated along `dim` in the group's rank order, as Megatron's sequence-parallel
    layers gather their input before the vocabulary-split head."""
    parts = x.movedim(dim, 0).contiguous()
    whole = parts.new_empty((dist.get_world_size(group) * parts.shape[0], *parts.shape[1:]))
    dist.all_gather_into_tensor(whole, parts, group=group)
    return whole.movedim(0, dim)


def reduce_scatter_rows(dx, group, dim: int) -> torch.Tensor:
    """The transpose of `gather_rows`: every rank's share of the whole input's gradient dx
    summed, and this rank's part along `dim` kept (one reduce-scatter: 1/P of an all-reduce's
    result, and the gathered input's gradient is never whole on any rank)."""
    shares = dx.movedim(dim, 0).contiguous()
    mine = shares.new_empty((shares.shape[0] // dist.get_world_size(group), *shares.shape[1:]))
    dist.reduce_scatter_tensor(mine, shares, group=group)
    return mine.movedim(0, dim)


def call_fingerprint(*facts) -> int:
    """A number that is the same on every rank whose call has the same `facts` (options,
    dtypes, grad flags: reprs that do not vary between processes, unlike Python's hash)."""
    return zlib.crc32(repr(facts).encode()) & 0x7FFFFFFF


def vocab_slice(group, local_vocab: int, hidden: int, n_rows: int, device, problem: Exception | None,
                fingerprint: int = 0, kept=None) -> VocabSplit:
    """This rank's `VocabSplit` (no rows_dim), from the ranks' slice sizes
    gathered over `group` with what every rank must share (D, N, the call's `fingerprint`,
    and `kept`: a 0-d device tensor, the count of rows not ignored) and whether its own
    arguments passed their checks (`problem`: None, or the error this rank raises). Every
    rank raises when any rank's arguments are wrong or differ, so none waits in a later
    collective: the block loops' collectives follow from what these facts hold."""
    facts = torch.tensor([local_vocab, hidden, n_rows, problem is not None, fingerprint, 0], dtype=torch.int64,
                         device=device)
    if kept is not None and problem is None:
        facts[5] = kept
    gathered = [torch.empty_like(facts) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, facts, group=group)
    table = torch.stack(gathered).tolist()
    if problem is not None:
        raise problem
    failed = [r for r, row in enumerate(table) if row[3]]
    if failed:
        raise ValueError(f"vocab_parallel: the arguments of rank(s) {failed} of the group failed their checks")
    if any(row[4:] != table[0][4:] for row in table):
        raise ValueError("vocab_parallel: every rank must make the same call (options, dtypes, which inputs need a "
                         "gradient, the same global targets); the ranks' calls differ")
    if any(row[1:3] != table[0][1:3] for row in table):
        raise ValueError(f"vocab_parallel: every rank needs the same rows and hidden size; (D, N) by rank: "
                         f"{[tuple(row[1:3]) for row in table]}")
    if any(row[0] < 1 for row in table):
        raise ValueError(f"vocab_parallel: every rank must hold at least one class; classes by rank: "
                         f"{[row[0] for row in table]}")
    rank = dist.get_rank(group)
    return VocabSplit(group, sum(row[0] for row in table[:rank]), sum(row[0] for row in table),
                      max(row[0] for row in table))


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
