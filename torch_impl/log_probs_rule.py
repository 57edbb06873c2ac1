"""Log-probabilities (interop/SPEC.md, "Log-probabilities") as a rule of the block engine
(`torch_impl.engine`), with the "log_prob" steps of `torch_impl.steps`: on the Triton
kernels (`speed`: blocks of whole rows; `memory`: blocks of rows and vocabulary columns) or
in PyTorch ops (`chunked`).

The forward pass merges each block of logits into per-row running statistics (max, sum of
exponentials, their u-weighted sum, the largest logit and its column, the target's logit)
and keeps lse and the entropy; the backward pass recomputes each block (or reads the
logits the engine kept) and turns the upstream gradients of the log-probabilities and of the
entropy into dz. No dz is formed in the forward pass: the upstream gradients are not known then.
`forward_with_grads` serves a loss whose upstream gradients each row's own values decide
(`torch_impl.policy_loss`): it forms them in the forward pass. `mean_logits` is the rows'
mean logit, which trainers log.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from interop.log_probs import LogProbsOptions
from torch_impl import engine
from torch_impl.head import BlockPlan, HeadBlocks
from torch_impl.rows import compute_dtype
from torch_impl.steps import TorchOps, capped
from torch_impl.vocab_parallel import VocabSplit, local_targets

SECOND_ORDER_MESSAGE = "logitless: linear_log_probs gives first-order gradients only"


def _target_rows(y_N, o: LogProbsOptions, vocab: int):
    """(valid, in_range), bool [N]: the target is not ignore_index; it is a class."""
    return y_N != o.ignore_index, (y_N >= 0) & (y_N < vocab)


def _running(n: int, wide, dev):
    """Per-row statistics before any column: (m, l, a, largest u, its column, u at the target)."""
    m, best = (torch.full((n,), -torch.inf, dtype=wide, device=dev) for _ in range(2))
    l, a, u_y = (torch.zeros(n, dtype=wide, device=dev) for _ in range(3))
    return m, l, a, best, torch.zeros(n, dtype=torch.int64, device=dev), u_y


def _outputs(running, valid, in_range):
    """(log-probabilities, entropy, lse) of rows' merged statistics."""
    m, l, a, _, _, u_y = running
    # lse = m + log l; with E[u] = m + a / l, H = lse - E[u] = log l - a / l: two small
    # terms, where lse and E[u] of a peaked row are large and nearly equal.
    lse, entropy = m + torch.log(l), torch.log(l) - a / l
    logp = torch.where(valid, torch.where(in_range, u_y - lse, torch.full_like(lse, torch.nan)), torch.zeros_like(lse))
    return logp, entropy, lse


def _upstream(g, valid, in_range):
    """The log-probabilities' upstream gradient as the steps take it: 0 where ignored, NaN
    where the target is out of range."""
    return torch.where(valid, torch.where(in_range, g, torch.full_like(g, torch.nan)), torch.zeros_like(g)).contiguous()


def _combine(running, split: VocabSplit | None, last_class: int):
    """Each row's statistics (`_running`) over every rank's classes: this rank's own without
    a split; else (m, l, a) merged as `steps._merge` merges two column blocks, the largest u
    (a NaN first) and its first global column, and u at the target, in three collectives of
    a few numbers per row (never logits). A NaN or +inf logit on any rank makes the row's m
    NaN, as on one device. last_class: the global class count, above any column (some rank
    always holds the row's largest u; a row all -inf has column 0 on every rank, as on one
    device)."""
    if split is None:
        return running
    m, l, a, best, idx, u_y = running
    broken = torch.isnan(m) | torch.isnan(l) | torch.isnan(a)
    best_nan = torch.isnan(best)
    top = torch.stack([torch.where(broken, -torch.inf, m), torch.where(best_nan, -torch.inf, best)])
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=split.group)
    m_all, best_all = top.unbind(0)
    shift = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    seen = (m != -torch.inf) & ~broken
    f = torch.where(seen, torch.exp(torch.where(seen, m - shift, 0.0)), 0.0)
    sums = torch.stack([f * l, f * (a + l * torch.where(seen, m - shift, 0.0)), broken.to(m.dtype),
                        best_nan.to(m.dtype), u_y])
    dist.all_reduce(sums, group=split.group)
    l_all, a_all, broken_all, nan_all, u_y_all = sums.unbind(0)
    m_all = torch.where(broken_all > 0, torch.nan, torch.where(torch.isfinite(m_all), shift, m_all))
    mine = torch.where(nan_all > 0, best_nan, best == best_all)
    col = torch.where(mine, idx + split.first, last_class)
    dist.all_reduce(col, op=dist.ReduceOp.MIN, group=split.group)
    best_all = torch.where(nan_all > 0, torch.nan, best_all)
    return m_all, l_all, a_all, best_all, col, u_y_all


def _columns(y_N, split: VocabSplit | None, local_vocab: int):
    """The targets as the kernels read them: y itself, or with a split this rank's columns."""
    return y_N if split is None else local_targets(y_N, split.first, local_vocab)



class LogProbsRule(engine.Rule):
    """The per-row math of log-probabilities over the rows `blocks` computes (y [N] int64,
    global). The forward pass fills logp, entropy, lse and argmax [N]; `upstream` (rs,
    logp_R, entropy_R) -> (g_R, g_h_R or None) gives a row block's upstream gradients where
    the forward pass forms the gradients. For the backward pass: saved (lse, entropy) and
    the upstream gradients g, g_h ([N] or None)."""

    def __init__(self, blocks: HeadBlocks, y_N, o: LogProbsOptions, ops, split: VocabSplit | None, upstream=None,
                 saved=None, g=None, g_h=None):
        self.blocks, self.o, self.ops, self.split, self.upstream = blocks, o, ops, split, upstream
        n, dev = blocks.n_rows, blocks.x.device
        wide = compute_dtype(blocks.x.dtype)
        self.vocab = blocks.vocab if split is None else split.vocab
        self.valid, self.in_range = _target_rows(y_N, o, self.vocab)
        self.y_cols = _columns(y_N, split, blocks.vocab)
        if saved is None:
            self.running = _running(n, wide, dev)
            self.logp, self.entropy, self.lse = (torch.empty(n, dtype=wide, device=dev) for _ in range(3))
            self.argmax = torch.empty(n, dtype=torch.int64, device=dev)
        else:
            self.lse, self.entropy = saved
            self.g = _upstream(torch.zeros_like(self.lse) if g is None else g.to(wide), self.valid, self.in_range)
            self.g_h = None if g_h is None else g_h.to(wide).contiguous()

    def stats_(self, z, v0, rs, sweep):
        self.ops.log_prob_stats_(z, v0, self.blocks.b, self.y_cols[rs], tuple(r[rs] for r in self.running),
                                 self.o.softcap, 1.0 / self.o.temperature)

    def rows_done(self, rs, sweep):
        running = _combine(tuple(r[rs] for r in self.running), self.split, self.vocab)
        self.logp[rs], self.entropy[rs], self.lse[rs] = _outputs(running, self.valid[rs], self.in_range[rs])
        self.argmax[rs] = running[4]

    def coefficients(self, rs):
        if self.upstream is None:
            self.g_R, self.g_h_R = self.g[rs], None if self.g_h is None else self.g_h[rs]
            return
        g, g_h = self.upstream(rs, self.logp[rs], self.entropy[rs])
        wide = self.lse.dtype
        self.g_R = _upstream(g.to(wide), self.valid[rs], self.in_range[rs])
        self.g_h_R = None if g_h is None else g_h.to(wide).contiguous()

    def grad(self, z, v0, rs):
        return self.ops.log_prob_grad(z, v0, self.blocks.b, self.y_cols[rs], self.lse[rs], self.entropy[rs], self.g_R,
                                      self.g_h_R, self.o.softcap, 1.0 / self.o.temperature)


def _blocks(x, W, b_V, layout: str, plan: BlockPlan, ops, active, split) -> HeadBlocks:
    x_ND = x if split is None else split.whole_rows(x)
    return HeadBlocks(x_ND, W, b_V, layout, plan, logits_dtype=compute_dtype(x_ND.dtype) if ops is TorchOps else None,
                      active=active)


def forward(x, W, b_V, y_N, o: LogProbsOptions, layout: str, plan: BlockPlan, ops, active=None,
            split: VocabSplit | None = None):
    """(log-probabilities [N], entropy [N], argmax [N] int64, lse [N]) over flattened rows x
    [N, D], the head W, its bias and targets y [N] (int64); log-probabilities, entropy and
    lse in the compute dtype (fp32, fp64 for fp64). A target outside [0, V) that is not
    ignore_index gives NaN. active: as for `forward_with_grads` (every output over [A]).
    split: a head split over the vocabulary (W, b this rank's classes; y global): the rows'
    statistics are combined over the ranks (`_combine`)."""
    blocks = _blocks(x, W, b_V, layout, plan, ops, active, split)
    rule = LogProbsRule(blocks, y_N, o, ops, split)
    engine.forward(rule, blocks, split=split, x=x)
    return rule.logp, rule.entropy, rule.argmax, rule.lse


def forward_with_grads(x, W, b_V, y_N, o: LogProbsOptions, layout: str, plan: BlockPlan, ops, upstream,
                       need=(True, True, True), active=None, split: VocabSplit | None = None):
    """(log-probabilities, entropy, dx, dW, db) with the gradients formed in the forward pass,
    for upstream gradients that each row's log-probability and entropy decide:
    upstream(rs, logp_R, entropy_R) -> (g_R, g_h_R or None) for the rows rs. Each row block's
    statistics come first (with a split, combined over the ranks), then its dz from the same
    logits: blocks of whole rows, one product each (6 N D V flops in all). active: int64 [A],
    the only rows of x computed (y_N, the outputs and rs are then over those [A]; the other
    rows of dx are 0), or None."""
    blocks = _blocks(x, W, b_V, layout, plan, ops, active, split)
    rule = LogProbsRule(blocks, y_N, o, ops, split, upstream)
    grads = engine.forward(rule, blocks, need, split, x)
    return (rule.logp, rule.entropy, *grads)


def backward(grad_logp, grad_entropy, x, W, b_V, y_N, lse, entropy, o: LogProbsOptions, layout: str, plan: BlockPlan,
             ops, need=(True, True, True), active=None, split: VocabSplit | None = None):
    """(dx, dW, db) for the upstream gradients of `forward`'s log-probabilities and entropy
    ([N] each, or None), recomputing the logits block by block (or reading those the engine
    kept); None where `need` (x, W, b)
    is not set. active and split: as for `forward_with_grads`."""
    blocks = _blocks(x, W, b_V, layout, plan, ops, active, split)
    rule = LogProbsRule(blocks, y_N, o, ops, split, saved=(lse, entropy), g=grad_logp, g_h=grad_entropy)
    return engine.backward(rule, blocks, need, split, x)


class MeanLogitsRule(engine.Rule):
    """The sum over the classes of u = softcap(z + b) (no gradient), per row: `total` [N] in
    the compute dtype."""

    def __init__(self, blocks: HeadBlocks, o: LogProbsOptions):
        self.blocks, self.o = blocks, o
        self.total = torch.zeros(blocks.n_rows, dtype=compute_dtype(blocks.x.dtype), device=blocks.x.device)

    def stats_(self, z, v0, rs, sweep):
        self.total[rs] += capped(z.to(self.total.dtype), v0, self.blocks.b, self.o.softcap).sum(1)

    def rows_done(self, rs, sweep):
        pass


def mean_logits(x, W, b_V, o: LogProbsOptions, layout: str, plan: BlockPlan):
    """The mean over the V classes of u = softcap(x W^T + b) / T for each row of x [N, D]:
    [N] in the compute dtype, no gradient. Without a softcap the mean is linear in the logits,
    x . mean(W) + mean(b): one [N, D] x [D] product; with one, the plan's blocks (`TorchOps`:
    plan one for "chunked") sum the capped logits."""
    wide = compute_dtype(x.dtype)
    with torch.no_grad():
        if o.softcap is None:
            w_D = W.mean(dim=0 if layout == "VD" else 1, dtype=wide)
            total = x.to(wide) @ w_D + (0.0 if b_V is None else b_V.mean(dtype=wide))
            return total / o.temperature
        blocks = HeadBlocks(x, W, b_V, layout, plan, logits_dtype=wide)
        rule = MeanLogitsRule(blocks, o)
        engine.forward(rule, blocks)
        return rule.total / (blocks.vocab * o.temperature)


@dataclasses.dataclass
class LogProbsCall(engine.Call):
    """`forward` and `backward` on tensors (x [N, D], W, b, y [N] int64); outputs
    (log-probabilities, entropy, argmax)."""

    o: LogProbsOptions
    layout: str
    plan: BlockPlan
    ops: type
    split: VocabSplit | None
    non_differentiable = (2,)
    message = SECOND_ORDER_MESSAGE

    def __post_init__(self):
        self.kernels = self.ops is not TorchOps

    def forward(self, tensors, need):
        logp, entropy, argmax, lse = forward(*tensors, self.o, self.layout, self.plan, self.ops, split=self.split)
        return (logp, entropy, argmax), (lse, entropy), None

    def backward(self, tensors, saved, grad_outputs, need):
        return backward(*grad_outputs[:2], *tensors, *saved, self.o, self.layout, self.plan, self.ops, need,
                        split=self.split)
