"""Log-probabilities (interop/SPEC.md, "Log-probabilities") as a rule of the block engine
(`jax_impl.engine`), with the "log_prob" steps of `jax_impl.steps`: Pallas kernels
("speed", "memory") or jax.numpy ("chunked"), differentiated by `engine.apply`. The forward pass
merges each block into per-row running statistics and keeps lse and the entropy; the
backward rule recomputes each block (or takes the logits "speed" kept, `engine.keeps_logits`)
and turns the upstream gradients into dz.
`forward_with_grads` serves a loss whose upstream gradients each row's own values decide
(`jax_impl.policy_loss`): it forms them in the forward pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_impl import engine, partitioned
from jax_impl.distill_rules import DistillConfig
from jax_impl.log_probs_kernels import NO_COLUMN
from jax_impl.partitioned import Axes, Layout
from jax_impl.rows import compute_dtype
from jax_impl.vocab_parallel import local_columns


def _running(R: int, wide):
    """Per-row statistics before any column: (m, l, a, largest u, its column, u at the target)."""
    ninf, zeros = jnp.full((R,), -jnp.inf, wide), jnp.zeros((R,), wide)
    return ninf, zeros, zeros, ninf, jnp.full((R,), NO_COLUMN, jnp.int32), zeros


def _combine(running, cfg: DistillConfig, axis: str | None):
    """Each row's statistics (`_running`) over the classes of every device along `axis` (a
    head split over the vocabulary inside shard_map, equal slices of cfg.vocab classes in the
    axis' order): (m, l, a) merged as two column blocks merge, the largest u (a NaN first)
    and its first global column, u at the target; a pmax, a psum and a pmin of a few
    numbers per row, never logits. A NaN or +inf logit on any device makes the row's m NaN,
    as on one device. Without an axis, the device's own."""
    if axis is None:
        return running
    m, l, a, best, idx, u_y = running
    broken = jnp.isnan(m) | jnp.isnan(l) | jnp.isnan(a)
    best_nan = jnp.isnan(best)
    m_all, best_all = jax.lax.pmax((jnp.where(broken, -jnp.inf, m), jnp.where(best_nan, -jnp.inf, best)), axis)
    shift = jnp.where(jnp.isfinite(m_all), m_all, 0)
    seen = (m != -jnp.inf) & ~broken
    d = jnp.where(seen, m - shift, 0)
    f = jnp.where(seen, jnp.exp(d), 0)
    l_all, a_all, broken_all, nan_all, u_y_all = jax.lax.psum(
        (f * l, f * (a + l * d), broken.astype(m.dtype), best_nan.astype(m.dtype), u_y), axis)
    m_all = jnp.where(broken_all > 0, jnp.nan, jnp.where(jnp.isfinite(m_all), shift, m_all))
    mine = jnp.where(nan_all > 0, best_nan, best == best_all)
    first = jax.lax.axis_index(axis) * cfg.vocab
    col = jax.lax.pmin(jnp.where(mine, idx + first, NO_COLUMN).astype(jnp.int32), axis)
    return m_all, l_all, a_all, jnp.where(nan_all > 0, jnp.nan, best_all), col, u_y_all


def _classes(cfg: DistillConfig, axis: str | None) -> int:
    """The whole head's classes: cfg.vocab, times the axis' size on a split head."""
    return cfg.vocab if axis is None else cfg.vocab * jax.lax.psum(1, axis)


def _outputs(combined, y_R, cfg: DistillConfig, axis: str | None = None):
    """(log_probs, entropy, argmax, lse) of rows' statistics combined over `axis` (`_combine`)."""
    m, l, a, _, argmax, u_y = combined
    o = cfg.options
    # lse = m + log l; H = lse - E[u] = log l - a / l: two small terms, where lse and
    # E[u] of a peaked row are large and nearly equal
    lse, entropy = m + jnp.log(l), jnp.log(l) - a / l
    valid, in_range = y_R != o.ignore_index, (y_R >= 0) & (y_R < _classes(cfg, axis))
    return jnp.where(valid, jnp.where(in_range, u_y - lse, jnp.nan), 0), entropy, argmax, lse


class _LogProbsRule(engine.Rule):
    """The per-row math of log-probabilities. A row block's operands: x, y (global); where the
    forward pass forms the gradients, the per-row operands of `upstream` (logp_R, entropy_R,
    rows) -> (g_R, g_h_R or None); in the backward pass lse, entropy and the upstream
    gradients (g, then g_h where the entropy has one)."""

    kept_whole = True  # per-row statistics and dz written over z: one block holds one [N, V]

    def __init__(self, cfg: DistillConfig, b_V, wide, axis: str | None, upstream=None):
        self.cfg, self.o, self.ops, self.b, self.wide, self.axis = cfg, cfg.options, cfg.ops, b_V, wide, axis
        self.upstream = upstream

    def _y(self, xs):
        return local_columns(xs[1], self.cfg.vocab, self.axis)

    def init(self, xs):
        return _running(xs[0].shape[0], self.wide)

    def stats(self, z, v0, xs, running, sweep):
        return self.ops.log_prob_stats(z, v0, self.b, self._y(xs), running, self.o.softcap, 1.0 / self.o.temperature)

    def done(self, xs, running, sweep):
        return _combine(running, self.cfg, self.axis)

    def outputs(self, xs, combined):
        return _outputs(combined, xs[1], self.cfg, self.axis)

    def coefficients(self, xs, combined):
        if combined is None:  # the backward pass: given by rows
            lse, entropy, g, *g_h = xs[2:]
            return lse, entropy, g, g_h[0] if g_h else None
        logp, entropy, _, lse = _outputs(combined, xs[1], self.cfg, self.axis)
        g, g_h = self.upstream(logp, entropy, tuple(xs[2:]))
        return lse, entropy, _upstream(g, xs[1], self.cfg, self.wide, self.axis), g_h

    def grad(self, z, v0, xs, coef):
        lse, entropy, g, g_h = coef
        return self.ops.log_prob_grad(z, v0, self.b, self._y(xs), lse, entropy, g, g_h, self.o.softcap,
                                      1.0 / self.o.temperature)


def _upstream(g, y_N, cfg: DistillConfig, wide, axis: str | None = None):
    """The log-probabilities' upstream gradient as the steps take it: 0 where ignored, NaN
    where the target is out of range."""
    valid, in_range = y_N != cfg.options.ignore_index, (y_N >= 0) & (y_N < _classes(cfg, axis))
    return jnp.where(valid, jnp.where(in_range, g.astype(wide), jnp.nan), 0)


def _layout(cfg: DistillConfig, operands: tuple, outputs: tuple) -> Layout:
    """x, W, b, y, then `operands`' factors; outputs named, "W" for W's factors."""
    w = "v d" if cfg.weight_layout == "VD" else "d v"
    return Layout(("n d", w, "v", "n") + operands, tuple(w if o == "W" else o for o in outputs))


def _local(cfg: DistillConfig, axes: Axes, x_ND, W) -> DistillConfig:
    return cfg.local(x_ND.shape[0], W.shape[0] if cfg.weight_layout == "VD" else W.shape[1], axes)


def _grads_factors(b_V) -> tuple:
    return ("n d", "W", None if b_V is None else "v")


def forward(x_ND, W, b_V, y_N, cfg: DistillConfig, keep=None, axis: str | None = None):
    """(log_probs, entropy, argmax, lse), per row, and with cfg.keep_logits the logits [N, V]
    (the device's classes on a split head) for `grads`; keep: bool [N], the only rows
    computed (`jax_impl.rows.row_loop`; the others' outputs are 0), or None. axis: the
    shard_map axis of a head split over the vocabulary (W and b this device's classes, y
    global), or None; under jit, split over sharded operands (`jax_impl.partitioned`)."""
    outputs = ("n",) * 4 + (("n v",) if cfg.keep_logits else ())
    return partitioned.run(_forward_pass, cfg, _layout(cfg, ("n",), outputs), x_ND, W, b_V, y_N, keep, axis=axis,
                           whole=cfg.unpartitioned)


def _forward_pass(cfg: DistillConfig, axes: Axes, x_ND, W, b_V, y_N, keep):
    cfg = _local(cfg, axes, x_ND, W)
    rule = _LogProbsRule(cfg, b_V, compute_dtype(x_ND.dtype), axes.vocab)
    return engine.forward(rule, cfg.head(x_ND, W, b_V), (x_ND, y_N), cfg.block_rows, keep=keep, axis=axes.vocab,
                          keep_logits=cfg.keep_logits)[0]


def forward_with_grads(x_ND, W, b_V, y_N, per_row, cfg: DistillConfig, upstream, keep=None, axis: str | None = None):
    """(log_probs [N], entropy [N], dx, dW, db) with the gradients formed in the forward pass,
    in blocks of whole rows (cfg.block_cols == V: one product per block, 6 N D V flops in
    all), for upstream gradients that each row's values decide: upstream(logp_R, entropy_R,
    per_row_R) -> (g_R, g_h_R or None) (hashable: a static of the pass), per_row a tuple of
    [N] arrays given by rows; keep and axis: as for `forward` (the other rows' dx is 0; on a
    split head, dx is summed over the axis)."""
    layout = _layout(cfg, ("n",) * (1 + len(per_row)), ("n", "n") + _grads_factors(b_V))
    return partitioned.run(_with_grads_pass, (cfg, upstream), layout, x_ND, W, b_V, y_N, keep, *per_row, axis=axis,
                           whole=cfg.unpartitioned)


def _with_grads_pass(static, axes: Axes, x_ND, W, b_V, y_N, keep, *per_row):
    (cfg, upstream), axis = static, axes.vocab
    cfg = _local(cfg, axes, x_ND, W)
    rule = _LogProbsRule(cfg, b_V, compute_dtype(x_ND.dtype), axis, upstream)
    (logp, entropy, _, _), grads = engine.forward(rule, cfg.head(x_ND, W, b_V), (x_ND, y_N) + tuple(per_row),
                                                  cfg.block_rows, True, cfg.accumulate_dtype(W.dtype), keep, axis)
    return (logp, entropy) + grads


@dataclasses.dataclass(frozen=True)
class _LogProbsCall(engine.Call):
    """(log_probs [N], entropy [N], argmax [N] int32) over arrays (x [N, D], W, b, int32
    targets y [N]); fp32 (fp64 for fp64 inputs). with_entropy: whether the entropy's
    upstream gradient is used; axis: as for `forward`."""

    cfg: DistillConfig
    with_entropy: bool
    axis: str | None = None
    grads_in_forward = False  # the upstream gradients are per-row arrays: they come in the backward pass

    def forward(self, arrays, with_grads):
        logp, entropy, argmax, lse, *kept = forward(*arrays, self.cfg, axis=self.axis)
        return (logp, entropy, argmax), (lse, entropy, *kept), None

    def backward(self, arrays, saved, cotangents):
        (g_lp, g_H, _), (lse, entropy, *kept) = cotangents, saved
        return grads(*arrays, lse, entropy, g_lp, g_H if self.with_entropy else None, self.cfg, axis=self.axis,
                     logits=kept[0] if kept else None)


def log_probs(x_ND, W, b_V, y_N, cfg: DistillConfig, with_entropy: bool, axis: str | None = None):
    """`_LogProbsCall`'s outputs through `engine.apply`."""
    return engine.apply(_LogProbsCall(cfg, with_entropy, axis), x_ND, W, b_V, y_N)


def grads(x_ND, W, b_V, y_N, lse, entropy, g_lp, g_H, cfg: DistillConfig, keep=None, axis: str | None = None,
          logits=None):
    """(dx, dW, db) for the upstream gradients of the log-probabilities and entropy ([N];
    g_H None when the entropy has none), recomputing the logits block by block, or from the
    forward pass's `logits` [N, V] where it kept them (`engine.backward_kept`); keep and
    axis: as for `forward_with_grads`."""
    layout = _layout(cfg, ("n",) * 5 + ("n v",), _grads_factors(b_V))
    return partitioned.run(_grads_pass, cfg, layout, x_ND, W, b_V, y_N, lse, entropy, g_lp, g_H, keep, logits,
                           axis=axis, whole=cfg.unpartitioned)


def _grads_pass(cfg: DistillConfig, axes: Axes, x_ND, W, b_V, y_N, lse, entropy, g_lp, g_H, keep, logits):
    cfg, axis, wide = _local(cfg, axes, x_ND, W), axes.vocab, lse.dtype
    per_row = (x_ND, y_N, lse, entropy, _upstream(g_lp, y_N, cfg, wide, axis))
    per_row += () if g_H is None else (g_H.astype(wide),)
    rule, head = _LogProbsRule(cfg, b_V, wide, axis), cfg.head(x_ND, W, b_V)
    if logits is not None:
        return engine.backward_kept(rule, head, per_row, logits, cfg.block_rows, axis)
    return engine.backward(rule, head, per_row, cfg.block_rows, cfg.accumulate_dtype(W.dtype), keep, axis)

