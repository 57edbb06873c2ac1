"""The block steps of every loss, twice: on the Triton kernels (`KernelOps`, CUDA or
TRITON_INTERPRET=1) and in plain PyTorch (`TorchOps`, the fallback: fp32 logits, fp64 for fp64
inputs). The rules of `torch_impl.cross_entropy_rule` (cross-entropy's fallback),
`torch_impl.distill_rules` and `torch_impl.log_probs_rule` call either; cross-entropy on the
kernels (`torch_impl.blocked`) calls the kernels directly (its fused row kernels and
gradient filter).

Each step works on one logits block z [R, C] (columns v0..v0+C, no bias) and per-row fp32
(or fp64) vectors; "stats" merge the block into running (m, l) of scale * s, s at the
target and, given ws, the class-weighted sum of s; "grad" returns dz (the kernels write it
over z), with the class-weighted term S cw_j when given S. The "log_prob" steps do the same
for `linear_log_probs` (`torch_impl.log_probs_kernels` says what they hold).
"""

from __future__ import annotations

import os

import torch

from interop.blocking import speed_extra_bytes
from interop.tuning import Tuning
from torch_impl import head

try:
    from torch_impl import kernels, log_probs_kernels, pair_kernels
except ImportError:  # no Triton: TorchOps only ("chunked")
    kernels = log_probs_kernels = pair_kernels = None


class KernelOps:
    """The steps on the Triton kernels; the logits stay in the input dtype."""

    logits_dtype = None

    @staticmethod
    def stats_(z, v0, b_V, y_R, m_R, l_R, sy_R, softcap, scale: float, cw_V=None, ws_R=None) -> None:
        ws = torch.empty_like(m_R) if ws_R is None else ws_R
        kernels.block_stats_(z, v0, b_V, cw_V, y_R, m_R, l_R, sy_R, ws, softcap, ws_R is not None, scale)

    @staticmethod
    def grad(z, v0, b_V, y_R, softcap, scale: float, lse_R, p_R, ty_R, second, cw_V=None, s_R=None):
        s_R = torch.zeros_like(p_R) if s_R is None else s_R
        kernels.block_grad_(z, z, v0, b_V, cw_V, y_R, lse_R, p_R, ty_R, s_R, softcap, scale, second)
        return z

    @staticmethod
    def put_(dz, v0, ids_RK, values_RK) -> None:
        kernels.put_entries_(dz, v0, ids_RK, values_RK.float().contiguous())

    @staticmethod
    def pair_sums_(s, t, lse_s, lse_t, a_R, b_R, o) -> None:
        pair_kernels.pair_sums_(s, t, lse_s, lse_t, a_R, b_R, o.divergence, o.temperature, o.beta)

    @staticmethod
    def pair_grad(s, t, lse_s, lse_t, b_R, coef_R, o):
        pair_kernels.pair_grad_(s, t, s, lse_s, lse_t, b_R, coef_R, o.divergence, o.temperature, o.beta)
        return s

    @staticmethod
    def log_prob_stats_(z, v0, b_V, y_R, running, softcap, inv_t: float) -> None:
        log_probs_kernels.log_prob_stats_(z, v0, b_V, y_R, running, softcap, inv_t)

    @staticmethod
    def log_prob_grad(z, v0, b_V, y_R, lse_R, entropy_R, g_R, g_h_R, softcap, inv_t: float):
        log_probs_kernels.log_prob_grad_(z, z, v0, b_V, y_R, lse_R, entropy_R, g_R, g_h_R, softcap, inv_t)
        return z


def capped(z, v0, b_V, softcap):
    s = z if b_V is None else z + b_V[v0 : v0 + z.shape[1]].to(z.dtype)
    return s if softcap is None else softcap * torch.tanh(s / softcap)


def _log_probs(s, t, lse_s, lse_t, o):
    return s / o.temperature - lse_s[:, None], t / o.temperature - lse_t[:, None]


def _merge(m, l, a, m_new, l_new, a_new):
    """(m, l, a) of two sets of values as one set's (`torch_impl.log_probs_kernels`)."""
    big = torch.maximum(m, m_new)
    safe = torch.where(big == -torch.inf, 0.0, big)
    parts = []
    for mx, lx, ax in ((m, l, a), (m_new, l_new, a_new)):
        f = torch.exp(mx - safe)
        seen = mx != -torch.inf
        parts.append((torch.where(seen, lx * f, 0.0), torch.where(seen, f * (ax + lx * (mx - safe)), 0.0)))
    return big, parts[0][0] + parts[1][0], parts[0][1] + parts[1][1]


def _times_p(p, a):
    """p a, 0 where p is (a class masked by a -inf logit, whose log-probability is -inf:
    0 * -inf would be NaN)."""
    return torch.where(p == 0, torch.zeros_like(p), p * a)


def _log_mix(lq, lp, beta: float):
    return torch.logaddexp(lp + torch.log(torch.tensor(beta, dtype=lp.dtype)), lq + torch.log1p(torch.tensor(-beta, dtype=lq.dtype)))


def _log_prob_stats_(z, v0, b_V, y_R, running, softcap, inv_t: float) -> None:
    m, l, a, best, idx, u_y = running
    u = capped(z, v0, b_V, softcap) * inv_t
    m_blk, idx_blk = u.max(dim=1)  # NaN propagates; the first maximum (a NaN first)
    safe = torch.where(m_blk == -torch.inf, 0.0, m_blk)[:, None]
    e = torch.exp(u - safe)
    m_new, l_new, a_new = _merge(m, l, a, m_blk, e.sum(1), _times_p(e, u - safe).sum(1))
    take = (m_blk > best) | (torch.isnan(m_blk) & ~torch.isnan(best))  # earlier blocks win ties
    best.copy_(torch.where(take, m_blk, best))
    idx.copy_(torch.where(take, idx_blk + v0, idx))
    m.copy_(m_new), l.copy_(l_new), a.copy_(a_new)
    col = y_R - v0
    inside = (col >= 0) & (col < z.shape[1])
    u_y.add_(torch.where(inside, u.gather(1, col.clamp(0, z.shape[1] - 1)[:, None])[:, 0], torch.zeros_like(u_y)))


def _log_prob_grad(z, v0, b_V, y_R, lse_R, entropy_R, g_R, g_h_R, softcap, inv_t: float):
    s = capped(z, v0, b_V, softcap)
    log_p = s * inv_t - lse_R[:, None]
    p = torch.exp(log_p)
    du = -g_R[:, None] * p
    if g_h_R is not None:  # dH/du_j = -p_j (log p_j + H)
        du -= g_h_R[:, None] * _times_p(p, log_p + entropy_R[:, None])
    col = y_R - v0
    inside = (col >= 0) & (col < z.shape[1])
    du.scatter_add_(1, col.clamp(0, z.shape[1] - 1)[:, None], torch.where(inside, g_R, torch.zeros_like(g_R))[:, None])
    dz = du * inv_t
    return dz if softcap is None else dz * (1 - (s / softcap) ** 2)


class TorchOps:
    """The same steps in PyTorch ops, on logits in the compute dtype (fp32 or fp64)."""

    logits_dtype = "compute"

    @staticmethod
    def stats_(z, v0, b_V, y_R, m_R, l_R, sy_R, softcap, scale: float, cw_V=None, ws_R=None) -> None:
        s = capped(z, v0, b_V, softcap)
        if ws_R is not None:
            ws_R += s.sum(1) if cw_V is None else s @ cw_V[v0 : v0 + z.shape[1]].to(s.dtype)
        u = s * scale
        m_new = torch.maximum(m_R, u.max(dim=1).values)
        m_safe = torch.where(m_new == -torch.inf, 0.0, m_new)  # a row of -inf so far: l stays 0, not NaN
        l_R.mul_(torch.exp(m_R - m_safe)).add_(torch.exp(u - m_safe[:, None]).sum(1))
        m_R.copy_(m_new)
        col = y_R - v0
        inside = (col >= 0) & (col < z.shape[1])
        sy_R.add_(torch.where(inside, s.gather(1, col.clamp(0, z.shape[1] - 1)[:, None])[:, 0], torch.zeros_like(sy_R)))

    @staticmethod
    def grad(z, v0, b_V, y_R, softcap, scale: float, lse_R, p_R, ty_R, second, cw_V=None, s_R=None):
        s = capped(z, v0, b_V, softcap)
        dz = p_R[:, None] * torch.exp(s * scale - lse_R[:, None])
        if second is not None:
            dz += second[0][:, None] * torch.exp(s - second[1][:, None])
        if s_R is not None:
            dz -= s_R[:, None] * (1.0 if cw_V is None else cw_V[v0 : v0 + z.shape[1]].to(dz.dtype))
        col = y_R - v0
        inside = (col >= 0) & (col < z.shape[1])
        dz.scatter_add_(1, col.clamp(0, z.shape[1] - 1)[:, None], torch.where(inside, -ty_R, torch.zeros_like(ty_R))[:, None])
        return dz if softcap is None else dz * (1 - (s / softcap) ** 2)

    @staticmethod
    def put_(dz, v0, ids_RK, values_RK) -> None:
        col = ids_RK - v0
        inside = (col >= 0) & (col < dz.shape[1])
        rows = torch.arange(dz.shape[0], device=dz.device)[:, None].expand_as(col)
        dz[rows[inside], col[inside]] = values_RK[inside].to(dz.dtype)

    @staticmethod
    def pair_sums_(s, t, lse_s, lse_t, a_R, b_R, o) -> None:
        lq, lp = _log_probs(s, t, lse_s, lse_t, o)
        if o.divergence == "forward_kl":
            a_R += (lp.exp() * (lp - lq)).sum(1)
        elif o.divergence == "reverse_kl":
            b_R += (lq.exp() * (lq - lp)).sum(1)
        else:
            lm = _log_mix(lq, lp, o.beta)
            a_R += (lp.exp() * (lp - lm)).sum(1)
            b_R += (lq.exp() * (lq - lm)).sum(1)

    @staticmethod
    def pair_grad(s, t, lse_s, lse_t, b_R, coef_R, o):
        lq, lp = _log_probs(s, t, lse_s, lse_t, o)
        if o.divergence == "forward_kl":
            g = lq.exp() - lp.exp()
        elif o.divergence == "reverse_kl":
            g = lq.exp() * (lq - lp - b_R[:, None])
        else:
            g = (1 - o.beta) * lq.exp() * (lq - _log_mix(lq, lp, o.beta) - b_R[:, None])
        return coef_R[:, None] * g

    log_prob_stats_ = staticmethod(_log_prob_stats_)
    log_prob_grad = staticmethod(_log_prob_grad)


def kernels_can_run(x: torch.Tensor) -> bool:
    """Triton serves CUDA tensors, and CPU tensors under TRITON_INTERPRET=1; not fp64."""
    if kernels is None or x.dtype == torch.float64:
        return False
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def choose_strategy(strategy: str, x: torch.Tensor, n_rows: int, hidden: int, vocab: int, t: Tuning,
                    split=None) -> str:
    """`_resolve`'s strategy; with a head split over ranks (split: a VocabSplit), "auto" gives
    every rank the same one (`VocabSplit.common_strategy`): the strategies differ in their
    collectives."""
    chosen = _resolve(strategy, x, n_rows, hidden, vocab, t)
    return chosen if split is None or strategy != "auto" else split.common_strategy(chosen, x.device)


def _resolve(strategy: str, x: torch.Tensor, n_rows: int, hidden: int, vocab: int, t: Tuning) -> str:
    """Resolve "auto" and route to "chunked" where the kernels can't run. "auto" is "speed"
    where its blocks fit a quarter of the free memory, for every loss, as in JAX: where
    neither strategy forms the gradients in the forward pass (log-probabilities), "memory"'s
    smaller tiles cost it host time per tile at small hidden sizes (TRL's GRPO head, 8184 x
    2048 x 128256 on an H100: 55.4 ms against "speed"'s 31.4). While a CUDA graph is
    captured, "auto" is "memory": the free memory then says nothing of the graph's pool, and
    a replay cannot choose again."""
    if strategy == "chunked" or not kernels_can_run(x):
        return "chunked"
    if strategy != "auto":
        return strategy
    if not x.is_cuda:
        return "chunked"
    if torch.cuda.is_current_stream_capturing():
        return "memory"
    free, _ = torch.cuda.mem_get_info(x.device)
    extra = speed_extra_bytes(t, n_rows, hidden, vocab, x.element_size())
    return "speed" if extra <= 0.25 * free else "memory"


def plan_steps(t: Tuning, loss: str, strategy: str, n_rows: int, hidden: int, vocab: int, dtype,
               accumulate_in_input_dtype: bool, buffers: int = 1, gathered_rows: bool = False,
               whole_vocab: int | None = None):
    """(BlockPlan, ops) of the paths driven by block steps (distillation, log-probabilities,
    cross-entropy's fallback): the call's plan (`torch_impl.head.plan`) with the steps that
    run it, the Triton kernels (`KernelOps`) or, for "chunked", `TorchOps`; n_rows: the rows
    computed; buffers: 2 when a dense teacher's logits are blocked too; gathered_rows: the
    rows are gathered (HeadBlocks.active); whole_vocab: a split head's classes."""
    plan = head.plan(t, loss, strategy, n_rows, hidden, vocab, dtype, accumulate_in_input_dtype, buffers=buffers,
                     gathered_rows=gathered_rows, whole_vocab=whole_vocab)
    return plan, (TorchOps if strategy == "chunked" else KernelOps)
