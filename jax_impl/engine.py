"""The block loop of the losses driven by block steps (JAX): each loss is a `Rule` (its
per-row math, functional) that `forward` and `backward` trace into one row loop
(`jax_impl.rows.row_loop`) over column loops (`jax_impl.head.Head.col_loop`).

A rule works on a row block's per-row operands `xs` (a tuple of [R, ...] arrays whose first
is x's rows; which others is the rule's), and on logits blocks z [R, C] (no bias):

- forward: `init` gives the running statistics, `stats` merges each column block into them,
  `sweeps` times (a dense teacher's divergence needs lse first: two sweeps), `done` combines
  them over a split head's axis after each sweep (without gradients and with one sweep,
  once for every row after the loop), `outputs` gives the row block's per-row
  outputs. With `with_grads` (blocks of whole rows), `coefficients` and `grad` turn the same
  logits into dz, whose products give the gradients for an upstream gradient of 1: 6 N D V
  flops; a rule's `stats_grad` may do both in one fused kernel where no split head
  combines the statistics between them.
- backward: `coefficients` from the saved per-row values and upstream gradients in xs, then
  `grad` on each recomputed block: 8 N D V flops in all. Where "speed"'s logits fit a share
  of the free memory (`keeps_logits`), the forward pass returns them ([N, V], `keep_logits`)
  for the backward pass to keep as a residual, and `backward_kept` turns them into dz in
  place and takes each gradient in one product over all rows: 6 N D V flops, no fp32
  grad_weight accumulator, for every loss whose upstream gradients the forward pass does
  not know.

`apply` is every loss's `jax.custom_vjp`, over a `Call` (the loss's passes).

The loop owns the rest once for every loss: grad_weight (and the bias') accumulators, the
row block's fp32 grad_input summed over column blocks, the rows computed (`keep`), a head
split over the vocabulary along a shard_map axis (grad_input summed over it), and rows
split across devices under jit (`Head.split_rows`: grad_weight and grad_bias summed over
them, slab by slab as they are formed where one block holds every row).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_impl.head import Head
from jax_impl.rows import compute_dtype, row_loop
from jax_impl.vocab_parallel import summed_grad_input


class Rule:
    """A loss's per-row math (the defaults: one sweep)."""

    sweeps = 1
    # whether "speed"'s kept logits (`keeps_logits`) may be one block of every row: a rule
    # says so where it forms nothing else of a block's size [R, V] (a dense teacher's logits
    # are such an array; in one block XLA held a second [N, V] around top-K's entries
    # scattered into dz); else they are kept in blocks of block_rows
    kept_whole = False

    def init(self, xs):
        """The running statistics of a row block before any column."""
        raise NotImplementedError

    def stats(self, z, v0, xs, state, sweep: int):
        """state with logits block z [R, C] (columns v0..v0+C) merged in."""
        raise NotImplementedError

    def done(self, xs, state, sweep: int):
        """state once a sweep saw every column (combined over the split's axis)."""
        return state

    def outputs(self, xs, state) -> tuple:
        """The row block's per-row outputs ([R, ...] each)."""
        raise NotImplementedError

    def coefficients(self, xs, state):
        """dz's per-row coefficients (state: the forward pass's, or None in the backward)."""
        raise NotImplementedError

    def grad(self, z, v0, xs, coef):
        """dz of logits block z."""
        raise NotImplementedError

    def stats_grad(self, z, xs):
        """(state after `done`, dz) of whole-row logits z [R, V] in one fused step, or None
        where the rule has none (the engine then runs stats, done, coefficients and grad).
        Asked only with gradients formed in the forward pass, one sweep and no split head."""
        return None


def _buffers(head: Head, accumulate_dtype, bias: bool, block_rows: int):
    """(dW, db) accumulators. In one row block of logits in W's dtype each element of dW is
    one product, which accumulates in fp32 and is written once in W's dtype: no wider
    accumulator to convert (unless dW is a partial sum over devices, `Head.split_rows`)."""
    W, wide = head.W, compute_dtype(head.x.dtype)
    one_product = block_rows >= head.x.shape[0] and head.logits_dtype == W.dtype and head.split_rows is None
    dtype = W.dtype if one_product else accumulate_dtype
    return jnp.zeros(W.shape, dtype), jnp.zeros((head.W.shape[0 if head.vd else 1],), wide) if bias else None


def _grads(head: Head, dx, carry, axis, summed: bool = False):
    """(dx, dW, db) in W's and b's dtypes; dW and db summed over the devices splitting the
    rows (`Head.split_rows`) from their accumulators, unless `summed` already."""
    dW, db = carry
    dx = summed_grad_input(dx, head.x, axis)
    if summed:
        return dx, dW, db
    if head.split_rows is None:
        return dx, dW.astype(head.W.dtype), None if db is None else db.astype(head.b.dtype)
    total = head.split_rows.summed
    return dx, total(dW, head.W.dtype, 0 if head.vd else 1), None if db is None else total(db, head.b.dtype, 0)


def _dx_rows(dx_R, x_R, axis):
    """A row block's grad_input: fp32 on a split head (summed over the axis first)."""
    return dx_R if axis is not None else dx_R.astype(x_R.dtype)


def forward(rule: Rule, head: Head, per_row: tuple, block_rows: int, with_grads: bool = False, accumulate_dtype=None,
            keep=None, axis: str | None = None, tail_split: int = 1, keep_logits: bool = False):
    """(outputs, grads): the rule's per-row outputs over all rows ([N, ...] each; rows not
    in `keep` (bool [N]) get zeros), and with `with_grads` (dx, dW, db) for an upstream
    gradient of 1 (grad_weight accumulated in accumulate_dtype, or in fp32 slabs where a
    device's split rows are one block, `Head.summed_row_shares`), else None. per_row: [N,
    ...] arrays, x first; axis: a split head's shard_map axis; tail_split: `row_loop`'s.
    keep_logits (blocks of whole rows, no gradients, every row): the outputs end with the
    logits [N, vocab] (the input's dtype) for `backward_kept`, in one block of every row
    where the rule allows it (`Rule.kept_whole`; block_rows is then not read)."""
    assert not keep_logits or (not with_grads and keep is None), "kept logits are every row's, for the backward pass"
    if keep_logits and rule.kept_whole:
        # one block: the product writes the kept array itself, with no zero-filled [N, V] to
        # copy row blocks into (the row kernels index it with 64-bit offsets past 2**32 bytes)
        block_rows = head.x.shape[0]
    wide = compute_dtype(head.x.dtype)
    # a device's share of rows split across devices in one block of every row and class:
    # grad_weight summed over the devices slab by slab as it is formed
    slabs = (with_grads and head.split_rows is not None and block_rows >= head.x.shape[0]
             and head.vocab == head.W.shape[0 if head.vd else 1])
    # without gradients, a one-sweep rule's statistics are combined over the axis once, for every row
    at_once = axis is not None and not with_grads and rule.sweeps == 1 and keep is None and not keep_logits
    structure = []  # of the statistics, which the loop then returns as a flat tuple

    def row_step(carry, xs):
        x_R, state = xs[0], rule.init(xs)
        if with_grads and axis is None and rule.sweeps == 1:  # no combine between statistics and dz: one fused step?
            z = head.col_logits(x_R, 0, head.vocab)
            fused = rule.stats_grad(z, xs)
            if fused is not None:
                state, dz = fused
                return grads_step(carry, xs, state, dz)
        for sweep in range(rule.sweeps):
            if with_grads or keep_logits:  # whole rows: one block for every sweep and dz (one product: XLA merges the same dot)
                z = head.col_logits(x_R, 0, head.vocab)
                state = rule.stats(z, 0, xs, state, sweep)
            else:
                body = lambda v0, cols, st: rule.stats(head.col_logits(x_R, v0, cols), v0, xs, st, sweep)
                state = head.col_loop(body, state)
            if at_once:
                leaves, tree = jax.tree.flatten(state)
                structure.append(tree)
                return carry, tuple(leaves)
            state = rule.done(xs, state, sweep)
        if not with_grads:
            return carry, rule.outputs(xs, state) + ((z,) if keep_logits else ())
        return grads_step(carry, xs, state, rule.grad(z, 0, xs, rule.coefficients(xs, state)))

    def grads_step(carry, xs, state, dz):
        """The row block's outputs and its dz's shares of the gradients."""
        x_R = xs[0]
        dx_dtype = wide if axis is not None else x_R.dtype
        shares = head.summed_row_shares(dz, x_R, dx_dtype) if slabs else head.add_row_shares(dz, x_R, *carry, dx_dtype)
        return shares[:2], rule.outputs(xs, state) + (shares[2],)

    carry = _buffers(head, accumulate_dtype, head.b is not None, block_rows) if with_grads else ()
    carry, outs = row_loop(row_step, carry, per_row, head.x.shape[0], block_rows, keep, tail_split)
    if at_once:
        state = jax.tree.unflatten(structure[0], outs)
        return rule.outputs(per_row, rule.done(per_row, state, 0)), None
    if not with_grads:
        return outs, None
    return outs[:-1], _grads(head, outs[-1], carry, axis, slabs)


def backward(rule: Rule, head: Head, per_row: tuple, block_rows: int, accumulate_dtype, keep=None,
             axis: str | None = None, tail_split: int = 1):
    """(dx, dW, db) recomputing the logits block by block; per_row as for `forward`, with
    the saved values and upstream gradients the rule's coefficients read."""
    wide = compute_dtype(head.x.dtype)

    def row_step(carry, xs):
        x_R, coef = xs[0], rule.coefficients(xs, None)

        def body(v0, cols, c):
            dz = rule.grad(head.col_logits(x_R, v0, cols), v0, xs, coef)
            return head.add_shares(dz, x_R, v0, cols, *c)

        dW, db, dx_R = head.col_loop(body, carry + (jnp.zeros(x_R.shape, wide),))
        return (dW, db), (_dx_rows(dx_R, x_R, axis),)

    carry, (dx,) = row_loop(row_step, _buffers(head, accumulate_dtype, head.b is not None, block_rows), per_row, head.x.shape[0],
                            block_rows, keep, tail_split)
    return _grads(head, dx, carry, axis)


def backward_kept(rule: Rule, head: Head, per_row: tuple, z, block_rows: int, axis: str | None = None):
    """(dx, dW, db) from the forward pass's logits z [N, vocab] (`forward`'s keep_logits),
    per_row as for `backward`: z becomes dz in place, in one pass over every row where the
    rule allows (`Rule.kept_whole`; else in the forward pass's row blocks, a loop carrying
    z; XLA writes over z where it lies once nothing else reads it), then grad_input
    and grad_weight are one product each over all rows, grad_weight written in W's dtype with
    no wider accumulator (rows split across devices: summed over them slab by slab in fp32,
    `Head.summed_row_shares`; a dense teacher's shared first classes of such a head: an fp32
    partial summed after)."""
    n = z.shape[0]

    def row_step(z, xs):
        start, block = xs[-1][0], xs[:-1]
        z_R = jax.lax.dynamic_slice_in_dim(z, start, xs[0].shape[0])
        dz_R = rule.grad(z_R, 0, block, rule.coefficients(block, None))
        return jax.lax.dynamic_update_slice_in_dim(z, dz_R.astype(z.dtype), start, 0), ()

    rows = n if rule.kept_whole else min(block_rows, n)
    dz, _ = row_loop(row_step, z, tuple(per_row) + (jnp.arange(n, dtype=jnp.int32),), n, rows)
    x, wide = head.x, compute_dtype(head.x.dtype)
    dx_dtype = wide if axis is not None else x.dtype
    if head.split_rows is not None and head.vocab == head.W.shape[0 if head.vd else 1]:
        dW, db, dx = head.summed_row_shares(dz, x, dx_dtype)
        return _grads(head, dx, (dW, db), axis, summed=True)
    # one product in W's dtype (a partial sum over split rows in fp32)
    dW, db = _buffers(head, wide, head.b is not None, n)
    dW, db, dx = head.add_row_shares(dz, x, dW, db, dx_dtype)
    return _grads(head, dx, (dW, db), axis)


def free_bytes(platform: str) -> int:
    """Bytes free on the default device for logits kept between the passes: a GPU's limit
    less what its allocator holds in use, 0 elsewhere (host memory is not weighed)."""
    if platform != "gpu":
        return 0
    stats = jax.local_devices()[0].memory_stats() or {}
    return max(0, stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0))


def keeps_logits(t, strategy: str, whole_rows: bool, n_rows: int, vocab: int, dtype, platform: str) -> bool:
    """Whether a call's forward pass keeps its logits for the backward pass: "speed" in blocks
    of whole rows, whose N x V logits (the input's dtype) take at most
    Tuning.keep_logits_share of the free memory (`free_bytes`, weighed when the call is
    traced: a jitted function keeps its choice; under jax.vmap each example's logits are
    weighed, not the batch's). Several processes never keep: each would weigh its own
    device and might compile another program."""
    if strategy != "speed" or not whole_rows or n_rows == 0 or t.keep_logits_share <= 0 or jax.process_count() > 1:
        return False
    return n_rows * vocab * jnp.dtype(dtype).itemsize <= t.keep_logits_share * free_bytes(platform)


class Call:
    """One call of a loss as `apply` differentiates it: its configuration (hashable, a static
    argument) and its passes over arrays (pytrees; the first `n_grads` take gradients).

    `forward(arrays, with_grads)` -> (outputs, saved, grads): the outputs (an array or a
    tuple; the first is a reduced loss where gradients are formed), what the backward rule
    reads, and with `with_grads` the gradients for an upstream gradient of 1 (else None).
    `backward(arrays, saved, cotangents)` -> the n_grads gradients. `cfg`: the call's plan,
    whose `grads_in_forward` says whether the forward rule forms them (a plan of whole rows
    and a reduced loss); a Call may decide otherwise."""

    n_grads = 3

    @property
    def grads_in_forward(self) -> bool:
        return self.cfg.grads_in_forward

    def primal(self) -> "Call":
        """This call where nothing differentiates it: one that keeps no logits for a backward
        pass (its cfg's keep_logits off, `keeps_logits`)."""
        if not getattr(self.cfg, "keep_logits", False):
            return self
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, keep_logits=False))

    def forward(self, arrays, with_grads: bool):
        raise NotImplementedError

    def backward(self, arrays, saved, cotangents):
        raise NotImplementedError


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def apply(call: Call, *arrays):
    """call's outputs. Under differentiation, gradients formed in the forward rule are scaled
    by the upstream gradient in fp32, fp64 for fp64 ones (rounding it to a 16-bit gradient's
    dtype first would scale it wrongly); otherwise the backward rule runs `call.backward`."""
    return call.primal().forward(arrays, False)[0]


def _apply_fwd(call: Call, *arrays):
    if call.grads_in_forward:
        outputs, _, grads = call.forward(arrays, True)
        return outputs, (grads, (None,) * len(arrays), None)
    outputs, saved, _ = call.forward(arrays, False)
    return outputs, (None, arrays, saved)


def _apply_bwd(call: Call, res, cotangents):
    grads, arrays, saved = res
    if grads is None:
        grads = call.backward(arrays, saved, cotangents)
    else:
        g = cotangents[0] if isinstance(cotangents, tuple) else cotangents
        grads = tuple(None if a is None else (a * g.astype(jnp.promote_types(a.dtype, jnp.float32))).astype(a.dtype)
                      for a in grads)
    return tuple(grads) + (None,) * (len(arrays) - len(grads))


apply.defvjp(_apply_fwd, _apply_bwd)
