"""Per-row pieces of the distillation losses (interop/SPEC-DISTILLATION.md) for PyTorch:
what is O(N) or O(N K), shared by the kernel path and the fallback."""

from __future__ import annotations

import copy

import torch

from interop.distillation import TopKDistillationOptions
from torch_impl.vocab_parallel import local_targets


def valid_rows(n_rows: int, target_N, row_mask_N, ignore_index: int, device) -> torch.Tensor:
    """bool [N]: row_mask (if given) and target != ignore_index (if given)."""
    valid = torch.ones(n_rows, dtype=torch.bool, device=device)
    if row_mask_N is not None:
        valid &= row_mask_N
    if target_N is not None:
        valid &= target_N != ignore_index
    return valid


def row_weights(valid_N, reduction: str, grad_loss, num_items, dtype) -> torch.Tensor:
    """r [N]: the upstream gradient of each row's loss (0 for invalid rows). grad_loss is
    0-d, or [N] for "none"; "mean" divides by num_items (or the valid-row count)."""
    g = grad_loss.to(dtype)
    if reduction == "mean":
        g = g / (valid_N.sum().to(dtype) if num_items is None else num_items)
    return torch.where(valid_N, g.expand(valid_N.shape), torch.zeros((), dtype=dtype, device=valid_N.device))


def reduce_rows(loss_N, valid_N, reduction: str, num_items):
    loss_N = torch.where(valid_N, loss_N, torch.zeros_like(loss_N))
    if reduction == "none":
        return loss_N
    if reduction == "sum":
        return loss_N.sum()
    return loss_N.sum() / (valid_N.sum().to(loss_N.dtype) if num_items is None else num_items)


class TopKTeacher:
    """The teacher's top-K entries, all [N, K]: ids (int64, -1 for padding), entry (bool),
    P and log P (compute dtype; 0 for padding), and slot (int64: equal ids of a row share
    a slot, so per-id sums of the gradient's sparse part can be formed)."""

    def __init__(self, ids_NK, logprobs_NK, renormalize: bool, dtype):
        lp = logprobs_NK.to(dtype)
        self.entry = (ids_NK >= 0) & (lp != -torch.inf)  # NaN is an entry: a corrupted teacher shows
        lp = lp.masked_fill(~self.entry, -torch.inf)
        if renormalize:
            has = self.entry.any(dim=1, keepdim=True)
            lp = lp - torch.where(has, torch.logsumexp(lp, dim=1, keepdim=True), torch.zeros_like(lp[:, :1]))
        zero = torch.zeros((), dtype=dtype, device=lp.device)
        self.P = torch.where(self.entry, lp.exp(), zero)
        self.logP = torch.where(self.entry, lp, zero)
        self.ids = torch.where(self.entry, ids_NK.to(torch.int64), -1)
        sorted_ids, perm = torch.sort(self.ids, dim=1, stable=True)
        new_run = torch.ones_like(sorted_ids, dtype=torch.bool)
        new_run[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
        self.slot = torch.empty_like(perm).scatter_(1, perm, torch.cumsum(new_run, dim=1) - 1)

    def columns_of(self, first: int, local_vocab: int) -> "TopKTeacher":
        """The same teacher with ids as the columns of a head's slice [first, first +
        local_vocab) of the classes, -1 for ids outside it (a head split over the
        vocabulary: each rank gathers and writes only its own classes)."""
        local = copy.copy(self)
        local.ids = local_targets(self.ids, first, local_vocab)
        return local


def gather_entries(z_RC, v0: int, ids_RK, b_V, softcap, dtype):
    """The soft-capped logits s at the ids that fall in the block's columns [v0, v0+C), 0
    elsewhere: [R, K] in `dtype` (z holds logits without bias)."""
    C = z_RC.shape[1]
    col = ids_RK - v0
    inside = (col >= 0) & (col < C)
    s = z_RC.gather(1, col.clamp(0, C - 1)).to(dtype)
    if b_V is not None:
        s = s + b_V[(ids_RK.clamp(min=0)).clamp(max=b_V.shape[0] - 1)].to(dtype)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return torch.where(inside, s, torch.zeros_like(s))


def topk_row_terms(s_ids, lse_T, lse_1, s_y, teacher: TopKTeacher, sl, o: TopKDistillationOptions):
    """For rows `sl`: (loss [R] before masking, A [R], C [R, K]) where
    d KD / d (s / T)_j = A q_j + sum_k C_k [j = id_k]. s_ids [R, K]: s at the ids; s_y: s at
    the target (read when weight_hard > 0)."""
    P, logP, entry = teacher.P[sl], teacher.logP[sl], teacher.entry[sl]
    zero = torch.zeros((), dtype=P.dtype, device=P.device)
    lq = s_ids / o.temperature - lse_T[:, None]
    kd = torch.where(entry, P * (logP - lq), zero).sum(1)
    A, C = P.sum(1), -P
    if o.tail_bucket:
        R = (1 - P.sum(1)).clamp(min=0)
        Q = torch.where(entry, lq.exp(), zero).sum(1)
        log_R = torch.log(torch.where(R > 0, R, torch.ones_like(R)))
        kd = kd + torch.where(R > 0, R * (log_R - torch.log1p(-Q)), zero)
        A = A - R * Q / (1 - Q)
        C = C + torch.where(entry, (R / (1 - Q))[:, None] * lq.exp(), zero)
    loss = o.kd_scale * kd
    if o.weight_hard:
        loss = loss + o.weight_hard * (lse_1 - s_y)
    return loss, A, C


class TopKGradRows:
    """The gradient's per-row coefficients for rows `sl` with upstream row weights r [R]:
    ds_j = P1 q_j [+ P2 p_j] - Ty [j = y] + (sparse part at the teacher ids), and `at_ids`
    [R, K], the exact dz at the teacher ids (every term, softcap included)."""

    def __init__(self, r, A, C, s_ids, lse_T, lse_1, teacher: TopKTeacher, y_R, sl, o: TopKDistillationOptions):
        a = r * (o.kd_scale / o.temperature)
        self.p1, c = a * A, a[:, None] * C
        self.ty = r * o.weight_hard
        two = o.weight_hard > 0 and o.temperature != 1.0
        if o.weight_hard and not two:
            self.p1 = self.p1 + self.ty
        self.second = (self.ty, lse_1) if two else None
        ids = teacher.ids[sl]
        slot = teacher.slot[sl]
        c_per_id = torch.zeros_like(c).scatter_add_(1, slot, c).gather(1, slot)
        at_ids = self.p1[:, None] * (s_ids / o.temperature - lse_T[:, None]).exp() + c_per_id
        if two:
            at_ids = at_ids + self.ty[:, None] * (s_ids - lse_1[:, None]).exp()
        if o.weight_hard:
            at_ids = at_ids - torch.where(ids == y_R[:, None], self.ty[:, None], torch.zeros_like(at_ids))
        if o.softcap is not None:
            at_ids = at_ids * (1 - (s_ids / o.softcap) ** 2)
        self.at_ids = at_ids
