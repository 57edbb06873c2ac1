"""Cross-entropy for JAX in blocks of logits from XLA's matrix products, turned into
statistics and dz by the block steps of `jax_impl.steps`: the Pallas kernels for "speed" and
"memory" (the strategies and blocks of interop.blocking, as `torch_impl.blocked`), jax.numpy
for "chunked", the fallback wherever the kernels do not run (fp32 logits, fp64 for fp64
inputs; blocks of whole rows, chunk_rows each, recomputed in the backward rule; plain XLA,
so twice differentiable).

- "speed": blocks of whole rows. When the loss is reduced and no lse is returned, the
  custom_vjp's forward rule (`jax_impl.function`, which runs only under differentiation)
  forms the gradients block by block (6 N D V flops) and the backward rule scales them; grad_weight is
  accumulated in fp32 (or the input dtype with accumulate_in_input_dtype).
- "memory": the forward rule takes the statistics from `jax_impl.fused_stats`, which
  forms no logits block; blocks of rows and vocabulary columns in the backward rule,
  which recomputes the logits (8 N D V flops); grad_input of a row block is accumulated
  in fp32 over its column blocks, grad_weight in the input dtype. Where enough whole rows
  fit (`plan`), "memory" runs as "speed" in those blocks with grad_weight in the input
  dtype; on a head too small for XLA's products within the memory-first bound (their GEMM
  workspace), the blocks of rows and columns are multiplied by `jax_impl.row_products`'
  kernels.
A large call without a returned lse (interop.blocking.skipping_pays) computes only the row
blocks that hold rows whose target is not ignored, those rows first (`jax_impl.rows.row_loop`
with `keep`): as PyTorch's kernels, the other rows get no logits and a zero grad_input.
A call that takes no gradient runs the primal, which only computes the statistics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from interop.blocking import (block_shape, chunk_rows, kernel_memory_block_shape, skipping_pays,
                              whole_row_memory_block_rows, xla_memory_block_shape)
from interop.options import CrossEntropyOptions
from interop.tuning import Tuning
from jax_impl.fused_stats import row_stats
from jax_impl import row_products
from jax_impl.matmul import contract
from jax_impl.rows import (TargetRows, compute_dtype, kept_first, reduce_loss, row_coefficients, row_loop, row_loss,
                           unfolded_count)
from jax_impl.sharding import vary_like
from jax_impl.steps import steps_of
from jax_impl.vocab_parallel import global_lse, local_columns, summed_grad_input

@dataclasses.dataclass(frozen=True)
class BlockedConfig:
    """Static configuration of one call (hashable: a nondiff argument of the custom_vjp)."""

    options: CrossEntropyOptions
    weight_layout: str
    strategy: str  # the caller's: "speed", "memory" or "chunked"
    layout: str  # "rows": blocks of whole rows (gradients can be formed in the forward pass); "tiles": rows x columns
    block_rows: int
    block_cols: int
    accumulate_in_input_dtype: bool
    return_lse: bool
    interpret: bool  # Pallas interpret mode (the arrays are not on a GPU)
    skip_ignored: bool  # compute only the row blocks holding rows whose target is not ignored
    fused_stats: bool  # a forward pass without gradients takes its statistics from `fused_stats.row_stats`
    tuning: Tuning
    kernel_products: bool = False  # "memory" blocks multiplied by `row_products`' kernels, not XLA

    @property
    def tail_split(self) -> int:
        """row_loop's tail_split when skipping ignored rows."""
        return self.tuning.speed_tail_split if self.layout == "rows" else 1

    @property
    def grads_in_forward(self) -> bool:
        """Whole-row blocks form the gradients in the forward rule; "chunked" recomputes them,
        holding no gradient between the rules (its role: the least memory, anywhere)."""
        return (self.layout == "rows" and self.options.reduction != "none" and not self.return_lse
                and self.strategy != "chunked")

    @property
    def ops(self):
        return steps_of(self.strategy, self.interpret)


def plan(t: Tuning, options, weight_layout, strategy, n_rows, hidden, vocab, dtype, accumulate_in_input_dtype,
         return_lse, platform) -> BlockedConfig:
    """The call's configuration. "memory" takes blocks of whole rows with a 16-bit
    grad_weight where PyTorch's does (interop.blocking.whole_row_memory_block_rows: XLA owns
    grad_input's buffer, so the blocks do not grow into it as PyTorch's do), else blocks of
    rows and columns sized for XLA's temporaries (interop.blocking.xla_memory_block_shape),
    unless fewer than t.min_block of those rows fit: then such blocks multiplied by
    `row_products`' kernels, which hold no GEMM workspace and no copy of W's slices
    (interop.blocking.kernel_memory_block_shape: small heads). Either way a "memory" forward
    pass that forms no gradients takes its statistics from `fused_stats.row_stats`, which
    writes no logits. "chunked": blocks of whole rows, chunk_rows of them."""
    if strategy == "chunked":
        return BlockedConfig(options, weight_layout, strategy, "rows", chunk_rows(t, n_rows, hidden, vocab), vocab,
                             accumulate_in_input_dtype, return_lse, interpret=platform != "gpu", skip_ignored=False,
                             fused_stats=False, tuning=t)
    skip = not return_lse and skipping_pays(t, n_rows, hidden, vocab)
    itemsize = jnp.dtype(dtype).itemsize
    interpret = platform != "gpu"
    fused = strategy == "memory"
    config = functools.partial(BlockedConfig, options, weight_layout, strategy, return_lse=return_lse,
                               interpret=interpret, skip_ignored=skip, fused_stats=fused, tuning=t)
    whole_rows = whole_row_memory_block_rows(t, n_rows, hidden, vocab, itemsize, skip) if fused else None
    if whole_rows:
        return config("rows", whole_rows, vocab, True)
    kernel_shape = kernel_memory_block_shape(t, n_rows, hidden, vocab, itemsize) if fused and itemsize <= 4 else None
    if kernel_shape:
        return config("tiles", *kernel_shape, accumulate_in_input_dtype, kernel_products=True)
    if strategy == "memory":
        return config("tiles", *xla_memory_block_shape(t, n_rows, hidden, vocab, itemsize), accumulate_in_input_dtype)
    return config("rows", *block_shape(t, strategy, n_rows, hidden, vocab, itemsize, gathered_rows=skip),
                  accumulate_in_input_dtype)


class Head:
    """One linear head's operands in blocks: x [N, D], W ([V, D] "VD" or [D, V] "DV"), bias;
    `vocab` may be smaller than W's (its first classes); logits in `logits_dtype` (the
    input's dtype unless given: the fallback's fp32)."""

    def __init__(self, x_ND, W, b_V, weight_layout: str, block_cols: int, vocab: int | None = None, logits_dtype=None):
        self.x, self.W, self.b = x_ND, W, b_V
        self.vd = weight_layout == "VD"
        self.vocab = (W.shape[0] if self.vd else W.shape[1]) if vocab is None else vocab
        self.block_cols = block_cols
        self.logits_dtype = x_ND.dtype if logits_dtype is None else logits_dtype

    def head_cols(self, v0, cols: int):
        """W's vocabulary columns v0..v0+cols ([cols, D] for "VD", [D, cols] for "DV")."""
        axis = 0 if self.vd else 1
        if isinstance(v0, int):
            return jax.lax.slice_in_dim(self.W, v0, v0 + cols, axis=axis)
        return jax.lax.dynamic_slice_in_dim(self.W, v0, cols, axis=axis)

    def logits(self, x_RD, W_c):
        """z [R, cols] = x W_c^T (no bias) in logits_dtype, accumulated in fp32 (or fp64) by
        the product itself (asking XLA for fp32 and converting kept an fp32 block)."""
        return contract(x_RD, W_c, 1, 1 if self.vd else 0, self.logits_dtype)

    def grad_input_share(self, dz, W_c, out_dtype=None):
        """dz W_c: [R, D] with dz in W's dtype (fp32 dz of the fallback rounded to a 16-bit W,
        as a linear layer's backward takes it, rather than W copied to fp32), accumulated in
        fp32 (fp64 for fp64) and returned in out_dtype (that accumulator's unless given)."""
        return contract(dz.astype(W_c.dtype), W_c, 1, 0 if self.vd else 1, out_dtype or _wide(dz))

    def grad_weight_share(self, dz, x_RD, out_dtype):
        """dz^T x ([cols, D]) or x^T dz ([D, cols]), accumulated in fp32 (fp64 for fp64 dz)
        and returned in out_dtype (the accumulator's: a 16-bit one gets no fp32 copy)."""
        x_RD = x_RD.astype(dz.dtype)
        return contract(dz, x_RD, 0, 0, out_dtype) if self.vd else contract(x_RD, dz, 0, 0, out_dtype)

    def col_logits(self, x_RD, v0, cols: int):
        """The logits of W's columns v0..v0+cols: [R, cols] (`logits`)."""
        return self.logits(x_RD, self.head_cols(v0, cols))

    def add_grad_input_share(self, dx_acc, dz, v0, cols: int):
        """dx_acc (fp32 [R, D]) plus dz [R, cols] times W's columns v0..v0+cols."""
        return dx_acc + self.grad_input_share(dz, self.head_cols(v0, cols))

    def add_weight_share(self, dW, dz, x_R, v0, cols: int):
        """dW with dz^T x [cols, D] (x^T dz for "DV") added to its columns v0..v0+cols."""
        axis = 0 if self.vd else 1
        dW_c = jax.lax.dynamic_slice_in_dim(dW, v0, cols, axis=axis)
        return jax.lax.dynamic_update_slice_in_dim(dW, dW_c + self.grad_weight_share(dz, x_R, dW.dtype), v0, axis=axis)

    def add_shares(self, dz, x_R, v0, cols: int, dW, db, dx_acc):
        """(dW, db, dx_acc) plus dz [R, cols]'s shares (columns v0..v0+cols; db may be None)."""
        dx_acc = self.add_grad_input_share(dx_acc, dz, v0, cols)
        dW = self.add_weight_share(dW, dz, x_R, v0, cols)
        if db is not None:
            db_c = jax.lax.dynamic_slice_in_dim(db, v0, cols) + dz.astype(db.dtype).sum(0)
            db = jax.lax.dynamic_update_slice_in_dim(db, db_c, v0, axis=0)
        return dW, db, dx_acc

    def col_loop(self, body, carry):
        """carry = body(v0, cols, carry) over the column blocks: a loop over the full blocks
        (v0 traced) and a loop of one trip for the remainder (`rest` columns, static), so
        that it shares the first loop's buffers (`jax_impl.rows.unfolded_count`)."""
        cols = self.block_cols
        n_full, rest = divmod(self.vocab, cols)
        if n_full == 1 and not rest:
            return body(0, cols, carry)
        carry = vary_like(carry, self.x, self.W)  # shard_map: the carry's type as body's
        carry = jax.lax.fori_loop(0, n_full, lambda i, c: body(i * cols, cols, c), carry)
        if not rest:
            return carry
        return jax.lax.fori_loop(0, unfolded_count(1), lambda i, c: body(n_full * cols, rest, c), carry)


def _wide(a):
    return jnp.float64 if a.dtype == jnp.float64 else jnp.float32


class Problem(Head):
    """A cross-entropy call: the head in cfg's column blocks plus the options, target facts
    and block steps; per-row values in `wide` (fp32, fp64 for fp64 inputs), the logits too
    for steps that compute on them (XlaOps); its column blocks' products are `row_products`'
    kernels with cfg.kernel_products."""

    def __init__(self, x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig):
        self.ops = cfg.ops
        self.wide = compute_dtype(x_ND.dtype)
        super().__init__(x_ND, W, b_V, cfg.weight_layout, cfg.block_cols,
                         logits_dtype=self.wide if self.ops.compute_logits else None)
        self.cfg = cfg
        self.cw = None if cw_V is None else cw_V.astype(self.wide)
        self.cw_sum = self.vocab if self.cw is None else self.cw.sum()
        self.rows = TargetRows.build(y_N, self.cw, self.vocab, cfg.options.ignore_index, self.wide)
        self.keep = self.rows.valid if cfg.skip_ignored else None  # the rows row_loop must compute

    def col_logits(self, x_RD, v0, cols: int):
        if not self.cfg.kernel_products:
            return super().col_logits(x_RD, v0, cols)
        return row_products.logits(x_RD, self.W, v0, cols, self.vd, self.cfg.interpret)

    def add_grad_input_share(self, dx_acc, dz, v0, cols: int):
        if not self.cfg.kernel_products:
            return super().add_grad_input_share(dx_acc, dz, v0, cols)
        return row_products.add_grad_input(dx_acc, dz, self.W, v0, self.vd, self.cfg.interpret)

    def add_weight_share(self, dW, dz, x_R, v0, cols: int):
        if not self.cfg.kernel_products:
            return super().add_weight_share(dW, dz, x_R, v0, cols)
        return row_products.add_grad_weight(dW, dz, x_R, v0, self.vd, self.cfg.interpret)


def _bias_grad_buffer(prob: Problem, b_V):
    """The [V] accumulator of grad_bias (prob.wide), or None without a bias (no column sums of dz)."""
    return None if b_V is None else jnp.zeros((prob.vocab,), prob.wide)


def _stats_of_block(prob: Problem, z, v0, y_R, stats):
    opts = prob.cfg.options
    return prob.ops.stats(z, v0, prob.b, y_R, stats, opts.softcap, 1.0, prob.cw, opts.label_smoothing > 0)


def _grad_of_block(prob: Problem, z, v0, y_R, lse_R, p_R, t_R, s_R):
    return prob.ops.grad(z, v0, prob.b, y_R, prob.cfg.options.softcap, 1.0, lse_R, p_R, t_R, None, prob.cw, s_R)


def _initial_stats(prob: Problem, R: int):
    """(m, l, s_y, ws) before any column: (-inf, 0, 0, 0), [R] each in prob.wide."""
    zeros = jnp.zeros(R, prob.wide)
    return jnp.full((R,), -jnp.inf, prob.wide), zeros, zeros, zeros


def _stats(prob: Problem, x_RD, y_R):
    """(lse, s_y, ws) [R] of a row block, over all its column blocks."""
    body = lambda v0, cols, stats: _stats_of_block(prob, prob.col_logits(x_RD, v0, cols), v0, y_R, stats)
    m, l, s_y, ws = prob.col_loop(body, _initial_stats(prob, x_RD.shape[0]))
    return m + jnp.log(l), s_y, ws


def _fused_row_stats(prob: Problem, x_ND, y_N):
    """(lse, s_y, ws) [N] from `fused_stats.row_stats`: of the rows to compute (`prob.keep`,
    gathered first), the others 0; y [N] int32 column indices (-1: none, s_y 0)."""
    opts = prob.cfg.options
    stats = functools.partial(row_stats, W=prob.W, b_V=prob.b, cw_V=prob.cw, weight_layout=prob.cfg.weight_layout,
                              softcap=opts.softcap, need_ws=opts.label_smoothing > 0, interpret=prob.cfg.interpret,
                              programs=prob.cfg.tuning.fused_stats_programs)
    if prob.keep is None:
        return stats(x_ND, y_N=y_N, n_rows=x_ND.shape[0])
    order = kept_first(prob.keep)
    kept = stats(x_ND[order], y_N=y_N[order], n_rows=prob.keep.sum(dtype=jnp.int32))
    return tuple(jnp.zeros_like(a).at[order].set(a, unique_indices=True) for a in kept)


def _call(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, axis: str | None):
    """(problem, the targets as its steps read them, the call's TargetRows, cw_sum, V). On a
    head split over `axis` (the vocabulary axis of a shard_map, or of `jax_impl.partitioned`)
    the problem is the device's classes: its targets are its columns (-1 where another device
    holds the class) and its class weights its slice, while the rows' facts, cw_sum and V are
    the whole head's."""
    if axis is None:
        prob = Problem(x_ND, W, b_V, cw_V, y_N, cfg)
        return prob, prob.rows.safe_y, prob.rows, prob.cw_sum, prob.vocab
    local_vocab = W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]
    first = jax.lax.axis_index(axis) * local_vocab
    y_cols = local_columns(y_N, local_vocab, axis).astype(jnp.int32)
    cw_local = None if cw_V is None else jax.lax.dynamic_slice_in_dim(cw_V, first, local_vocab)
    prob = Problem(x_ND, W, b_V, cw_local, y_cols, cfg)
    vocab = local_vocab * jax.lax.psum(1, axis)
    cw = None if cw_V is None else cw_V.astype(prob.wide)
    rows = TargetRows.build(y_N, cw, vocab, cfg.options.ignore_index, prob.wide)
    return prob, y_cols, rows, vocab if cw is None else cw.sum(), vocab


def _combined(stats, axis: str | None):
    """A row block's (lse, s_y, ws) over the whole head: the devices' combined over `axis`
    (a pmax and psums of a few floats per row, never logits)."""
    if axis is None:
        return stats
    lse, s_y, ws = stats
    return (global_lse(lse, axis), *jax.lax.psum((s_y, ws), axis))


def forward(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig, with_grads: bool, axis: str | None = None):
    """(loss, lse [N], grads) where grads = (dx, dW, db) for an upstream gradient of 1 if
    with_grads (whole-row blocks), else None. axis: a head split over the vocabulary (W and
    b this device's equal slice of the classes, cw_V and y_N whole; `split_config`): each
    row block's statistics are combined over it before its dz, so the gradients still come
    from one product per block (6 N D V / P flops per device); grad_input is summed over it."""
    prob, y_cols, rows, cw_sum, vocab = _call(x_ND, W, b_V, cw_V, y_N, cfg, axis)
    n, opts = x_ND.shape[0], cfg.options
    if cfg.fused_stats and not with_grads:
        lse, s_y, ws = _combined(_fused_row_stats(prob, x_ND, y_cols), axis)
        loss = reduce_loss(row_loss(lse, s_y, ws, rows, opts, cw_sum, vocab), rows, opts.reduction)
        return loss, lse, None
    # The gradient of each row for an upstream gradient of 1: "mean" is "sum" scaled by
    # 1 / (the valid rows' summed class weight), a global the row blocks can't see.
    scale = 1.0 / rows.cw_y.sum() if opts.reduction == "mean" else jnp.asarray(1.0, prob.wide)
    per_row_opts = dataclasses.replace(opts, reduction="sum")
    dx_dtype = None if axis is None else prob.wide  # a split's shares are summed before rounding

    def row_step(carry, xs):
        x_R, y_R, valid_R, bad_R, in_range_R, cw_y_R = xs
        y_R = local_columns(y_R, prob.vocab, axis)  # in the step: the rows' outputs stay the same on every device
        if not with_grads:
            return carry, _stats(prob, x_R, y_R)
        dW, db = carry  # whole rows: one block, its logits rewritten in place as dz
        z = prob.logits(x_R, W)
        m, l, s_y, ws = _stats_of_block(prob, z, 0, y_R, _initial_stats(prob, x_R.shape[0]))
        lse, s_y, ws = _combined((m + jnp.log(l), s_y, ws), axis)
        block_rows = TargetRows(y_R, valid_R, in_range_R, bad_R, cw_y_R)
        coefs = row_coefficients(scale, None, lse, block_rows, cw_sum, per_row_opts, vocab)
        dz = _grad_of_block(prob, z, 0, y_R, lse, *coefs)
        dx_R = prob.grad_input_share(dz, W, dx_dtype or x_R.dtype)
        dW = dW + prob.grad_weight_share(dz, x_R, dW.dtype)
        if db is not None:
            db = db + dz.astype(db.dtype).sum(0)
        return (dW, db), (lse, s_y, ws, dx_R)

    per_row = (x_ND, rows.safe_y if axis is None else y_N, rows.valid, rows.bad, rows.in_range, rows.cw_y)
    carry = None
    if with_grads:
        acc = W.dtype if cfg.accumulate_in_input_dtype else prob.wide
        carry = (jnp.zeros(W.shape, acc), _bias_grad_buffer(prob, b_V))
    carry, outs = row_loop(row_step, carry, per_row, n, cfg.block_rows, prob.keep, cfg.tail_split)
    lse, s_y, ws = outs[:3] if with_grads else _combined(outs[:3], axis)
    loss = reduce_loss(row_loss(lse, s_y, ws, rows, opts, cw_sum, vocab), rows, opts.reduction)
    if not with_grads:
        return loss, lse, None
    dW, db = carry
    return loss, lse, (summed_grad_input(outs[3], x_ND, axis), dW.astype(W.dtype),
                       None if b_V is None else db.astype(b_V.dtype))


def backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse_N, cfg: BlockedConfig, axis: str | None = None):
    """(dx, dW, db) recomputing the logits block by block; axis as for `forward`."""
    prob, y_cols, rows, cw_sum, vocab = _call(x_ND, W, b_V, cw_V, y_N, cfg, axis)
    coefs = row_coefficients(g_loss, g_lse, lse_N, rows, cw_sum, cfg.options, vocab)
    dx, dW, db = gradients(prob, x_ND, y_cols, lse_N, coefs, prob.keep, None if axis is None else prob.wide)
    return summed_grad_input(dx, x_ND, axis), dW, db


def split_config(cfg: BlockedConfig) -> BlockedConfig:
    """A plan's configuration for a head split over the vocabulary: every row computed (the
    rows to skip would differ between the devices' steps)."""
    return dataclasses.replace(cfg, skip_ignored=False)


def gradients(prob: Problem, x_ND, y_N, lse_N, coefs, keep=None, dx_dtype=None):
    """(dx, dW, db) for the per-row coefficients coefs = (P, T, S) of dz
    (interop/SPEC.md) and lse [N], recomputing the logits block by block; y [N] int32 column
    indices (T's one-hot lands on column y, none for any other value); keep: the rows to
    compute (`rows.row_loop`), or None for all; dx_dtype: grad_input's (x's unless given)."""
    cfg, b_V, W = prob.cfg, prob.b, prob.W

    def row_step(carry, xs):
        x_R, y_R, lse_R, p_R, t_R, s_R = xs

        def body(v0, cols, c):
            dz = _grad_of_block(prob, prob.col_logits(x_R, v0, cols), v0, y_R, lse_R, p_R, t_R, s_R)
            return prob.add_shares(dz, x_R, v0, cols, *c)

        dW, db = carry
        dW, db, dx_acc = prob.col_loop(body, (dW, db, jnp.zeros(x_R.shape, prob.wide)))
        return (dW, db), (dx_acc.astype(dx_dtype or x_R.dtype),)

    per_row = (x_ND, y_N, lse_N) + tuple(coefs)
    acc = W.dtype if (cfg.accumulate_in_input_dtype or cfg.strategy == "memory") else prob.wide
    init = (jnp.zeros(W.shape, acc), _bias_grad_buffer(prob, b_V))
    (dW, db), (dx,) = row_loop(row_step, init, per_row, x_ND.shape[0], cfg.block_rows, keep, cfg.tail_split)
    return dx, dW.astype(W.dtype), None if b_V is None else db.astype(b_V.dtype)
