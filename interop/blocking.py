"""The rules by which the kernel paths of both frameworks cut a problem into blocks of
logits; `interop.planning.plan` chooses among them for a call.

A block is [rows, cols] of the N x V logits, computed by one matrix product into a reused
buffer. "speed" uses blocks of whole rows (cols = V) so the gradient can be formed in the
forward pass; "memory" sizes rows and cols so that the block plus an fp32 grad_input
accumulator of one row block stay near `Tuning.memory_fraction` of the gradients' bytes, or
takes blocks of whole rows where enough of them fit. Every rule reads its numbers from a
`Tuning` (interop.tuning), the call's.
"""

from __future__ import annotations

from interop.tuning import Tuning


def skipping_pays(t: Tuning, n_rows: int, hidden: int, vocab: int) -> bool:
    """Whether a call is large enough (N D V >= t.skip_ignored_min_work) for the kernels to
    compute only some of its rows."""
    return n_rows * hidden * vocab >= t.skip_ignored_min_work


def chunk_rows(t: Tuning, n_rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk of the chunked paths: a chunk's logits about as large as the input.

    ceil(N D / V) rows (so the C x V block holds about N x D values: the extra memory stays
    of the order of the hidden states), at least t.min_chunk_rows, at most N.
    """
    rows = -(-n_rows * hidden // max(vocab, 1))
    return max(1, min(n_rows, max(t.min_chunk_rows, rows)))


def _round_down(n: int, multiple: int) -> int:
    return max(multiple, n // multiple * multiple)


def block_shape(t: Tuning, strategy: str, n_rows: int, hidden: int, vocab: int, itemsize: int, buffers: int = 1,
                gathered_rows: bool = False, narrow_accumulator: bool = False, narrow_grows: bool = True,
                one_block: bool = True) -> tuple[int, int]:
    """(rows, cols) per block for "speed" or "memory"; itemsize: bytes of the input dtype;
    buffers: logits buffers of that shape held at once (2 for a dense teacher's and the
    student's), which share "memory"'s budget; gathered_rows: each row block's inputs are
    a copy (rows gathered from a larger input), which shares it too; narrow_accumulator:
    grad_weight accumulates in the input dtype, with narrow_grows (PyTorch, whose cuBLAS adds
    into it in place) "speed"'s blocks growing by t.narrow_speed_block_growth for a 16-bit one
    when the bytes it saves over fp32 cover the growth; one_block: "speed" may take one block
    of all rows (`one_speed_block`; not where grad_weight is added in parts, as PyTorch's
    gradient filter adds it, into an accumulator that one block would hold too).
    "speed" keeps its rows for two buffers: halving them for a dense teacher saves less
    memory than it costs time. Its blocks hold at least min(t.speed_min_rows, D) rows (rounded
    down to t.min_block), or all rows where they fit in the bytes of such a block and the
    grad_weight accumulator that one block does without (`one_speed_block`)."""
    if strategy == "speed":
        rows = _speed_rows(t, hidden, vocab, itemsize, buffers, narrow_accumulator and narrow_grows)
        if one_block and one_speed_block(t, n_rows, hidden, vocab, itemsize, buffers, narrow_accumulator, narrow_grows):
            rows = n_rows
        return max(1, min(n_rows, rows)), vocab
    budget = t.memory_fraction * (n_rows + vocab) * hidden * itemsize
    min_rows, min_cols = (max(t.min_block, m) for m in t.min_memory_block)
    # the fp32 grad_input accumulator (+ the copy); at D = 0 a row costs nothing: the least rows
    row_bytes = max(hidden, 1) * (4 + (itemsize if gathered_rows else 0))
    rows = max(min_rows, _round_down(int(budget / 2 / row_bytes), t.min_block))
    rows = max(1, min(n_rows, rows))
    cols = min(vocab, max(min_cols, _round_down(int(budget / 2 / (rows * itemsize * buffers)), t.min_block)))
    return rows, cols


def _speed_rows(t: Tuning, hidden: int, vocab: int, itemsize: int, buffers: int, narrow_grows: bool) -> int:
    """Rows per "speed" block of a call in several row blocks (`block_shape`), before N
    bounds them."""
    growth_bytes = t.speed_block_elements * (t.narrow_speed_block_growth - 1) * itemsize
    grows = narrow_grows and itemsize == 2 and buffers == 1 and vocab * hidden * 2 >= growth_bytes
    growth = t.narrow_speed_block_growth if grows else 1
    rows = _round_down(int(t.speed_block_elements * growth) // vocab, t.min_block)
    return max(rows, _round_down(min(t.speed_min_rows, hidden), t.min_block))


def one_speed_block(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int, buffers: int = 1,
                    narrow_accumulator: bool = False, narrow_grows: bool = True) -> bool:
    """Whether "speed" takes all rows in one block: each element of grad_weight is then one
    product, written once in W's dtype, with no accumulator. Several blocks of a 16-bit
    input hold, beyond the gradients, one block and an fp32 accumulator (V D 4 bytes; an
    accumulator in the input dtype, narrow_accumulator or fp32 inputs, is grad_weight
    itself); one block holds the N x V logits (x buffers). It is taken where those take at
    most t.one_speed_block_share of the former (8192 x 4096 x 128256: 2 GiB against
    1 + 2 GiB): fewer blocks are faster, as each reads and writes the accumulator.
    A JAX device's share of rows split across devices sums its grad_weight over the devices
    slab by slab as one block forms it (`jax_impl.head.Head.summed_row_shares`): a slab of
    fp32 partial at a time, whose sums overlap the next slabs' products."""
    rows = _speed_rows(t, hidden, vocab, itemsize, buffers, narrow_accumulator and narrow_grows)
    accumulator = vocab * hidden * 4 if itemsize < 4 and not narrow_accumulator else 0
    return n_rows * vocab * itemsize * buffers <= t.one_speed_block_share * (rows * vocab * itemsize * buffers + accumulator)


def _xla_block_budget(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int, gemm_workspace: bool = True,
                      xla_blocks: bool = False) -> float:
    """Bytes left to a JAX "memory" block after XLA's per-row temporaries and, when XLA's
    products run in the loop, their GEMM workspace: within t.whole_row_fraction of the
    gradients' bytes with t.xla_row_bytes a row of N (whole rows, the kernels' blocks), or
    with xla_blocks (XLA's products in rows x columns blocks) within t.xla_blocks_fraction
    with t.xla_blocks_row_bytes a row."""
    if xla_blocks:
        fraction, row_bytes = t.xla_blocks_fraction, t.xla_blocks_row_bytes
    else:
        fraction, row_bytes = t.whole_row_fraction, t.xla_row_bytes
    workspace = t.xla_gemm_workspace if gemm_workspace else 0
    return fraction * (n_rows + vocab) * hidden * itemsize - workspace - row_bytes * n_rows


def _most_rows(t: Tuning, n_rows: int, rows: int) -> int:
    """Rows per block of a rows x columns plan: `rows` rounded down to t.min_block (at least
    1, at most n_rows), then `without_a_thin_last_block`. Each row block reads W twice and
    updates all of grad_weight, so the fewest row blocks pay."""
    return without_a_thin_last_block(t, n_rows, max(1, min(n_rows, _round_down(rows, t.min_block))))


def _xla_memory_rows(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int) -> tuple[int, int]:
    """(rows, cols): the most rows of t.xla_memory_cols columns (may be 0) for which what XLA
    holds beyond the gradients stays within t.xla_blocks_fraction of their bytes: its GEMM
    workspace, a copy of W's column slice and the block's grad_weight share (cols x D each),
    t.xla_blocks_row_bytes a row of N, and per row of a block its logits, the copy of its x
    (gathered or sliced) and one fp32 grad_input accumulator (the product adds into it:
    cuBLAS's beta 1)."""
    cols = min(vocab, t.xla_memory_cols)
    budget = _xla_block_budget(t, n_rows, hidden, vocab, itemsize, xla_blocks=True) - 2 * cols * hidden * itemsize
    return int(max(budget, 0) // (cols * itemsize + hidden * (4 + itemsize))), cols


def xla_memory_block_shape(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int) -> tuple[int, int]:
    """JAX's (rows, cols) for "memory" in blocks of rows and columns: the most rows that fit
    (`_xla_memory_rows`, `_most_rows`; G: 3712 x 2048)."""
    rows, cols = _xla_memory_rows(t, n_rows, hidden, vocab, itemsize)
    return _most_rows(t, n_rows, rows), cols


def xla_memory_blocks_fit(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int) -> bool:
    """Whether at least min(n_rows, t.min_block) rows of `xla_memory_block_shape`'s blocks
    fit its budget (not at small heads, where XLA's GEMM workspace alone is more)."""
    return _xla_memory_rows(t, n_rows, hidden, vocab, itemsize)[0] >= min(n_rows, t.min_block)


def kernel_memory_block_shape(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int) -> tuple[int, int] | None:
    """JAX's (rows, cols) for "memory" in blocks of rows and columns whose three products are
    its own kernels (`jax_impl.row_products`), else None where fewer than
    min(n_rows, t.min_block) rows fit. The kernels hold no GEMM workspace and read W's and
    write grad_weight's column slices in place, so their blocks are larger than XLA's: per
    row of a block its logits, its fp32 grad_input accumulator and the copy of its x, with
    XLA's per-row temporaries within t.whole_row_fraction of the gradients' bytes, as many
    rows as fit (`_most_rows`). At S XLA's workspace alone is more than a tenth of the
    gradients' bytes; at 8192 x 2048 x 128256 XLA's blocks hold 256 rows and these 2816."""
    cols = min(vocab, t.xla_memory_cols)
    budget = _xla_block_budget(t, n_rows, hidden, vocab, itemsize, gemm_workspace=False)
    rows = int(max(budget, 0) // (cols * itemsize + hidden * (4 + itemsize)))
    return (_most_rows(t, n_rows, rows), cols) if rows >= min(n_rows, t.min_block) else None


def jax_whole_row_block_rows(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int) -> int | None:
    """JAX's rows per block of "memory" in whole rows, else None where fewer than
    min(n_rows, t.min_last_rows) fit (XLA splits a thinner block's grad_input product over
    the vocabulary and pads a copy of W for it: 64 rows at 8192 x 2048 x 128256 held 1.97x
    the floor), or where every block size leaves so thin a last block. XLA owns
    grad_input's buffer, so the blocks are fixed: their logits, 2 D 16-bit values a row (the
    rows' x and grad_input copies, or about what XLA's grad_input product keeps of partial
    sums), XLA's GEMM workspace and its per-row temporaries stay within
    t.whole_row_fraction of the gradients' bytes."""
    rows = int(max(_xla_block_budget(t, n_rows, hidden, vocab, itemsize), 0) // ((vocab + 2 * hidden) * itemsize))
    if rows < min(n_rows, t.min_last_rows) or n_rows <= 0:
        return None
    rows = without_a_thin_last_block(t, n_rows, min(n_rows, rows))
    return None if 0 < n_rows % rows < min(rows, t.min_last_rows) else rows  # no block count ends full


def memory_plan_seconds(t: Tuning, layout: str, kernel_products: bool, rows: int, cols: int, n_rows: int,
                        hidden: int, vocab: int, itemsize: int, grads_in_forward: bool) -> float:
    """Estimated fwd+bwd seconds of a JAX "memory" plan, from the rates of `Tuning`'s plan_*
    fields: its products (6 N D V with gradients formed in the forward pass over whole
    rows, else 8 N D V: a statistics pass, then the logits again), `row_products`' at
    t.plan_kernel_product_share of XLA's rate; a fixed cost per step of the block loop; and
    per row block, grad_weight read and written in the input dtype (tiles: W read twice
    more). Fitted on an H200 at D 2048 to 4096, V 32000 to 256000 (bench/NOTES.md); only
    the order of the plans it compares matters."""
    n_blocks = -(-n_rows // max(rows, 1))
    steps = n_blocks * -(-vocab // max(cols, 1))
    flops = (6 if layout == "rows" and grads_in_forward else 8) * n_rows * hidden * vocab
    rate = t.plan_product_flops * (t.plan_kernel_product_share if kernel_products else 1)
    weight_passes = 2 if layout == "rows" else 4
    step = t.plan_row_block_seconds if layout == "rows" else t.plan_step_seconds
    return (flops / rate + steps * step
            + n_blocks * weight_passes * vocab * hidden * itemsize / t.plan_update_bytes_per_second)


def whole_row_memory_scratch(t: Tuning, n_all: int, n_rows: int, hidden: int, vocab: int, itemsize: int,
                             gathered_rows: bool = False) -> int | None:
    """Elements of the logits scratch beyond grad_input [n_all, D] with which PyTorch's
    cross-entropy "memory" strategy runs in blocks of whole rows (the gradients formed in the
    forward pass, 6 N D V flops, grad_weight accumulated in the input dtype: liger's layout),
    else None (blocks of rows and columns, 8 N D V flops).

    grad_input and the scratch are one buffer, and a block's logits (rewritten as dz) lie in
    the scratch and in the rows of grad_input that no block has written yet, so the first
    blocks are the largest (`scratch_block_rows`: L 800 rows first, 352 near the end). The
    scratch plus, with gathered_rows (n_rows of n_all computed), the first block's copies
    of its x and grad_input rows stay within t.whole_row_fraction of the gradients' bytes;
    whole rows are taken when the first block holds at least t.min_whole_rows rows, or
    t.min_small_head_rows where W has at most t.whole_row_head_bytes."""
    if n_rows <= 0:
        return None
    budget = t.whole_row_fraction * (n_all + vocab) * hidden
    copies, row_cost = (2 if gathered_rows else 0), vocab + hidden
    scratch = int((budget - copies * n_rows * hidden * hidden / row_cost) / (1 + copies * hidden / row_cost))
    scratch = min(scratch, n_rows * vocab)  # one block of all the rows needs no more
    if scratch < vocab:
        return None
    first = scratch_block_rows(t, n_rows, hidden, vocab, scratch)
    small_head = vocab * hidden * itemsize <= t.whole_row_head_bytes
    least = t.min_small_head_rows if small_head else t.min_whole_rows
    return scratch if first >= min(n_rows, least) else None


def without_a_thin_last_block(t: Tuning, n_rows: int, rows: int) -> int:
    """The most rows per block, at most `rows`, for which n_rows rows end in a full block or
    in one of at least min(rows, t.min_last_rows) rows; `rows` if none does."""
    fewest = min(rows, t.min_last_rows)
    for r in range(rows, fewest - 1, -1):
        if n_rows % r == 0 or n_rows % r >= fewest:
            return r
    return rows


def scratch_block_rows(t: Tuning, rows_left: int, hidden: int, vocab: int, scratch: int) -> int:
    """Rows of the next whole-row block when rows_left rows are still to compute and its
    logits [R, V] may fill `scratch` elements plus grad_input's rows not yet written
    (R rows of grad_input are written by this block: R V <= (rows_left - R) D + scratch);
    a multiple of t.whole_row_align unless it is the last block or fewer rows fit."""
    rows = int((rows_left * hidden + scratch) // (vocab + hidden))
    if rows >= rows_left:
        return rows_left
    return max(1, rows // t.whole_row_align * t.whole_row_align or rows)


def speed_extra_bytes(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int) -> int:
    """Bytes "speed" needs beyond the gradients, at most: the fp32 dW accumulator and one
    block of several (one block of all rows takes no more, `one_speed_block`)."""
    rows = min(n_rows, _speed_rows(t, hidden, vocab, itemsize, 1, False))
    return vocab * hidden * 4 + rows * vocab * itemsize


def forward_only_rows(t: Tuning, n_rows: int, hidden: int, vocab: int, itemsize: int) -> int:
    """Rows per block of "speed" for a call that takes no gradient: it holds no grad_weight
    accumulator, so its logits block may take those bytes too (all that "speed" holds beyond
    the gradients, `speed_extra_bytes`), the rows spread evenly over the fewest blocks
    (`even_rows`): the products of fewer, larger blocks run faster."""
    return even_rows(t, n_rows, speed_extra_bytes(t, n_rows, hidden, vocab, itemsize) // (vocab * itemsize))


def even_rows(t: Tuning, n_rows: int, most: int) -> int:
    """Rows per block for n_rows rows in the fewest blocks of at most `most` rows (rounded
    down to t.min_block, at least t.min_block), spread evenly: a multiple of t.min_block
    (or all the rows)."""
    most = _round_down(most, t.min_block)
    blocks = max(1, -(-n_rows // most))
    rows = -(-n_rows // blocks)
    return max(1, min(n_rows, most, -(-rows // t.min_block) * t.min_block))


def weight_grad_slabs(t: Tuning, lead: int, lead_bytes: int, twice_as_wide: bool) -> list[int]:
    """Edges [0, .., lead] of the slabs, along W's first dimension (lead: classes of a [V, D]
    W, the hidden dimension of a [D, V] one), of a grad_weight accumulator whose row along it
    takes lead_bytes: one slab, or two where its values take twice W's bytes (fp32 for a
    16-bit W) and each slab takes at least t.weight_grad_slab_bytes. The first then holds at most
    half the rows, so its storage has room for all of grad_weight in W's dtype: the
    conversion writes there and frees the second (peak 2 W, the accumulator's, not 3 W).
    Edges are multiples of t.slab_align."""
    half = lead // 2 // t.slab_align * t.slab_align
    if not twice_as_wide or half == 0 or half * lead_bytes < t.weight_grad_slab_bytes:
        return [0, lead]
    return [0, half, lead]
