"""One linear head's operands in blocks of logits from XLA's matrix products (`Head`): what
the block loop of every loss (`jax_impl.engine`) computes on."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from interop.tuning import ROWS_SUM_SLABS
from jax_impl import row_products
from jax_impl.matmul import contract
from jax_impl.rows import unfolded_count
from jax_impl.sharding import vary_like


class Head:
    """One linear head's operands in blocks: x [N, D], W ([V, D] "VD" or [D, V] "DV"), bias;
    `vocab` may be smaller than W's (its first classes); logits in `logits_dtype` (the
    input's dtype unless given: the fallback's fp32); split_rows: under jit, the
    `jax_impl.partitioned.Axes` of rows split across devices, over which grad_weight and
    grad_bias, this device's partial sums, are summed (`Axes.summed`) in fp32 (fp64 for
    fp64) before they are rounded to W's and b's, or None; kernel_products: a column
    block's three products are `jax_impl.row_products`' kernels (Pallas interpret mode with
    interpret), which read W's and write grad_weight's columns in place, else XLA's."""

    def __init__(self, x_ND, W, b_V, weight_layout: str, block_cols: int, vocab: int | None = None, logits_dtype=None,
                 split_rows=None, kernel_products: bool = False, interpret: bool = False):
        self.x, self.W, self.b = x_ND, W, b_V
        self.split_rows = split_rows
        self.kernel_products, self.interpret = kernel_products, interpret
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
        if self.kernel_products:
            return row_products.logits(x_RD, self.W, v0, cols, self.vd, self.interpret)
        return self.logits(x_RD, self.head_cols(v0, cols))

    def add_grad_input_share(self, dx_acc, dz, v0, cols: int):
        """dx_acc (fp32 [R, D]) plus dz [R, cols] times W's columns v0..v0+cols."""
        if self.kernel_products:
            return row_products.add_grad_input(dx_acc, dz, self.W, v0, self.vd, self.interpret)
        return dx_acc + self.grad_input_share(dz, self.head_cols(v0, cols))

    def add_weight_share(self, dW, dz, x_R, v0, cols: int):
        """dW with dz^T x [cols, D] (x^T dz for "DV") added to its columns v0..v0+cols."""
        if self.kernel_products:
            return row_products.add_grad_weight(dW, dz, x_R, v0, self.vd, self.interpret)
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

    def add_row_shares(self, dz, x_R, dW, db, dx_dtype):
        """(dW, db, dx_R) for dz over whole rows [R, vocab]: its shares added to dW and db, and
        grad_input's rows dz W in dx_dtype straight from the product (no fp32 copy of them)."""
        dx_R = self.grad_input_share(dz, self.head_cols(0, self.vocab), dx_dtype)
        if self.vocab < dW.shape[0 if self.vd else 1]:  # the head's first classes (a dense teacher's shared ones)
            dW = self.add_weight_share(dW, dz, x_R, 0, self.vocab)
        else:
            dW = dW + self.grad_weight_share(dz, x_R, dW.dtype)
        if db is not None:
            db = jax.lax.dynamic_update_slice_in_dim(db, db[: self.vocab] + dz.astype(db.dtype).sum(0), 0, axis=0)
        return dW, db, dx_R

    def summed_row_shares(self, dz, x_R, dx_dtype):
        """(dW, db, dx_R) of dz [R, V] over every row this device holds and every class of
        the head, its rows split over `split_rows`: grad_input's rows as `add_row_shares`
        gives them; grad_weight formed in slabs of the hidden dimension
        (`interop.tuning.ROWS_SUM_SLABS`), each reduce-scattered over the devices in fp32 as
        soon as it is formed, then rounded to W's dtype and gathered once
        (`partitioned.Axes.summed_slabs`), so that one slab's sum overlaps the next slab's
        product (the last one's, grad_input's, except under an FSDP head: below) and no whole
        fp32 partial is held; grad_bias summed whole. (Slabs all-reduced instead would be
        combined by XLA into one all-reduce of the whole partial.) A head whose classes are
        split as the rows (FSDP) is gathered for this pass, and grad_input's product is the
        gathered head's last use: it runs before the slabs' products, so that the gathered
        head is freed before they are formed, where XLA would otherwise keep it beside them
        to overlap the last slab's sum with grad_input's product. An FSDP head's grad_weight
        shard is too small to hold a slab, so without this the head, both fp32 slabs and a
        summed slice would be held at once."""
        dx_R = self.grad_input_share(dz, self.head_cols(0, self.vocab), dx_dtype)
        if self.split_rows.classes_on_rows:
            dz, dx_R = jax.lax.optimization_barrier((dz, dx_R))
        wide, hidden = _wide(dz), x_R.shape[1]
        slabs = max(1, min(ROWS_SUM_SLABS, hidden))
        edges = [hidden * k // slabs for k in range(slabs + 1)]
        dW = self.split_rows.summed_slabs([self.grad_weight_share(dz, x_R[:, a:e], wide) for a, e in zip(edges, edges[1:])],
                                          self.W.dtype, 0 if self.vd else 1)
        db = None if self.b is None else self.split_rows.summed(dz.astype(wide).sum(0), self.b.dtype, 0)
        return dW, db, dx_R

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
