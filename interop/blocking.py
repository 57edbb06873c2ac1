"""How the kernel paths of both frameworks cut a problem into blocks of logits.

A block is [rows, cols] of the N x V logits, computed by one matrix product into a reused
buffer. "speed" uses blocks of whole rows (cols = V) so the gradient can be formed in the
forward pass; "memory" sizes rows and cols so that the block plus an fp32 grad_input
accumulator of one row block stay near MEMORY_FRACTION of the gradients' bytes.
"""

from __future__ import annotations

SPEED_BLOCK_ELEMENTS = 1 << 28  # logits per "speed" block (512 MiB in bf16): few passes over an fp32 dW
NARROW_SPEED_BLOCK_GROWTH = 1.5  # "speed" with a 16-bit grad_weight accumulator and one logits buffer:
# the block grows by this factor when the V x D x 2 bytes that an fp32 accumulator would have held
# beyond it pay for the growth; the accumulator is then read and written in fewer passes
MEMORY_FRACTION = 0.08  # "memory": logits block + grad_input accumulator, as a share of the gradients' bytes
WHOLE_ROW_FRACTION = 0.093  # "memory" in whole rows: logits scratch (+ row copies), as a share of the gradients' bytes
MIN_WHOLE_ROWS = 384  # ... when its first block has at least this many rows (fewer lose to rows and columns)
WHOLE_ROW_ALIGN = 32  # ... blocks a multiple of this many rows
MIN_LAST_ROWS = 128  # JAX's fixed row blocks: the last one at least this many rows (`without_a_thin_last_block`)
XLA_GEMM_WORKSPACE = 32 << 20  # bytes: the cuBLAS workspace that XLA's products keep among the temporaries
XLA_ROW_BYTES = 512  # bytes a row of XLA's per-row temporaries in JAX whole rows or kernel blocks (H100, L: ~8.4 MiB)
XLA_MEMORY_COLS = 2048  # JAX "memory" in rows x columns: vocabulary columns per block
XLA_BLOCKS_FRACTION = 0.098  # ... all that XLA holds beyond the gradients for those blocks, as a share of
# the gradients' bytes: `_xla_memory_rows` counts it to 0.2 MiB (H100), so 2 MiB of the 0.10 bound are left at G
XLA_BLOCKS_ROW_BYTES = 16  # ... bytes a row of N of XLA's per-row temporaries there (H100, G: ~13)
MIN_BLOCK = 128  # rows or columns of a block, at the least
MIN_MEMORY_BLOCK = (1024, 4096)  # "memory": rows, columns at the least (smaller blocks waste the GPU)
WEIGHT_GRAD_SLABS = 2  # a grad_weight accumulator wider than W: at most this many vocabulary slabs,
WEIGHT_GRAD_SLAB_BYTES = 256 << 20  # each at least this big (a small head is one slab: one product)
SLAB_ALIGN = 256  # slab edges at multiples of this many classes


# N * D * V from which the kernel paths compute only the rows whose target is not ignored
# (when no lse is returned): finding them costs PyTorch one host wait for the GPU and JAX a
# sort of the rows, and each row block's rows are gathered and its grad_input scattered,
# which pays when 6 N D V flops take milliseconds (2**40: ~9 ms on an H100).
SKIP_IGNORED_MIN_WORK = 2**40


def skipping_pays(n_rows: int, hidden: int, vocab: int) -> bool:
    """Whether a call is large enough (N * D * V >= SKIP_IGNORED_MIN_WORK) for the kernels to
    compute only some of its rows."""
    return n_rows * hidden * vocab >= SKIP_IGNORED_MIN_WORK


def _round_down(n: int, multiple: int) -> int:
    return max(multiple, n // multiple * multiple)


def block_shape(strategy: str, n_rows: int, hidden: int, vocab: int, itemsize: int, buffers: int = 1,
                gathered_rows: bool = False, narrow_accumulator: bool = False) -> tuple[int, int]:
    """(rows, cols) per block for "speed" or "memory"; itemsize: bytes of the input dtype;
    buffers: logits buffers of that shape held at once (2 for a dense teacher's and the
    student's), which share "memory"'s budget; gathered_rows: each row block's inputs are
    a copy (rows gathered from a larger input), which shares it too; narrow_accumulator:
    "speed" accumulates grad_weight in a 16-bit input dtype (NARROW_SPEED_BLOCK_GROWTH, when
    the bytes it saves over fp32 cover the growth).
    "speed" keeps its rows for two buffers: halving them for the dense teacher saved
    0.4-0.5 x the floor but cost 7% (L) to 23% (G) of the time (H100)."""
    if strategy == "speed":
        growth_bytes = SPEED_BLOCK_ELEMENTS * (NARROW_SPEED_BLOCK_GROWTH - 1) * itemsize
        grows = narrow_accumulator and itemsize == 2 and buffers == 1 and vocab * hidden * 2 >= growth_bytes
        growth = NARROW_SPEED_BLOCK_GROWTH if grows else 1
        rows = _round_down(int(SPEED_BLOCK_ELEMENTS * growth) // vocab, MIN_BLOCK)
        return max(1, min(n_rows, rows)), vocab
    budget = MEMORY_FRACTION * (n_rows + vocab) * hidden * itemsize
    min_rows, min_cols = (max(MIN_BLOCK, m) for m in MIN_MEMORY_BLOCK)
    # the fp32 grad_input accumulator (+ the copy); at D = 0 a row costs nothing: the least rows
    row_bytes = max(hidden, 1) * (4 + (itemsize if gathered_rows else 0))
    rows = max(min_rows, _round_down(int(budget / 2 / row_bytes), MIN_BLOCK))
    rows = max(1, min(n_rows, rows))
    cols = min(vocab, max(min_cols, _round_down(int(budget / 2 / (rows * itemsize * buffers)), MIN_BLOCK)))
    return rows, cols


def _xla_block_budget(n_rows: int, hidden: int, vocab: int, itemsize: int, gemm_workspace: bool = True,
                      xla_blocks: bool = False) -> float:
    """Bytes left to a JAX "memory" block after XLA's per-row temporaries and, when XLA's
    products run in the loop, their GEMM workspace: within WHOLE_ROW_FRACTION of the
    gradients' bytes with XLA_ROW_BYTES a row of N (whole rows, the kernels' blocks), or with
    xla_blocks (XLA's products in rows x columns blocks) within XLA_BLOCKS_FRACTION with
    XLA_BLOCKS_ROW_BYTES a row."""
    if xla_blocks:
        fraction, row_bytes = XLA_BLOCKS_FRACTION, XLA_BLOCKS_ROW_BYTES
    else:
        fraction, row_bytes = WHOLE_ROW_FRACTION, XLA_ROW_BYTES
    workspace = XLA_GEMM_WORKSPACE if gemm_workspace else 0
    return fraction * (n_rows + vocab) * hidden * itemsize - workspace - row_bytes * n_rows


def _most_rows(n_rows: int, rows: int) -> int:
    """Rows per block of a rows x columns plan: `rows` rounded down to MIN_BLOCK (at least 1,
    at most n_rows), then `without_a_thin_last_block`. Each row block reads W twice and
    updates all of grad_weight, so the fewest blocks over the rows to compute pay: H100, G
    (7395 of 8192 rows kept), fwd+bwd: 2816 rows (the rows spread evenly over 3 blocks, the
    plan until session 25) 73.9-74.4 ms at 1.085 x the floor, 3712 rows (2 blocks of kept
    rows) 67.2 at 1.098 x."""
    return without_a_thin_last_block(n_rows, max(1, min(n_rows, _round_down(rows, MIN_BLOCK))))


def _xla_memory_rows(n_rows: int, hidden: int, vocab: int, itemsize: int) -> tuple[int, int]:
    """(rows, cols): the most rows of XLA_MEMORY_COLS columns (may be 0) for which what XLA
    holds beyond the gradients stays within XLA_BLOCKS_FRACTION of their bytes: its GEMM
    workspace, a copy of W's column slice and the block's grad_weight share (cols x D each),
    XLA_BLOCKS_ROW_BYTES a row of N, and per row of a block its logits, the copy of its x
    (gathered or sliced) and one fp32 grad_input accumulator (the product adds into it:
    cuBLAS's beta 1). H100, V = 256000, D from 1536 to 3072, N from 4096 to 16384, blocks of
    2816 to 3840 rows x 1536 or 2048 columns: XLA's memory within 0.2 MiB of this count (at
    V = 128000, 50 MiB under it)."""
    cols = min(vocab, XLA_MEMORY_COLS)
    budget = _xla_block_budget(n_rows, hidden, vocab, itemsize, xla_blocks=True) - 2 * cols * hidden * itemsize
    return int(max(budget, 0) // (cols * itemsize + hidden * (4 + itemsize))), cols


def xla_memory_block_shape(n_rows: int, hidden: int, vocab: int, itemsize: int) -> tuple[int, int]:
    """JAX's (rows, cols) for "memory" in blocks of rows and columns: the most rows that fit
    (`_xla_memory_rows`, `_most_rows`; G: 3712 x 2048). Narrower columns were slower (H100,
    G, fwd+bwd: 3712 x 1536 71.6 ms, 4096 x 1024 84.3, against 67.2 for 3712 x 2048)."""
    rows, cols = _xla_memory_rows(n_rows, hidden, vocab, itemsize)
    return _most_rows(n_rows, rows), cols


def kernel_memory_block_shape(n_rows: int, hidden: int, vocab: int, itemsize: int) -> tuple[int, int] | None:
    """JAX's (rows, cols) for "memory" in blocks of rows and columns whose three products are
    its own kernels (`jax_impl.row_products`), for a small head, where fewer than
    min(n_rows, MIN_BLOCK) rows of XLA's blocks fit (`xla_memory_block_shape`: its GEMM
    workspace alone is more than a tenth of the gradients' bytes, S's half, GPT-2's 15%),
    else None. The kernels hold no workspace and read W's and write grad_weight's column
    slices in place: per row of a block its logits, its fp32 grad_input accumulator and the
    copy of its x, with XLA's per-row temporaries within WHOLE_ROW_FRACTION of the
    gradients' bytes, as many rows as fit (`_most_rows`); None too if fewer than
    min(n_rows, MIN_BLOCK) rows fit. On larger heads XLA's products stay: they are faster
    (H100, bf16, whole rows at L: 373 rows a block through these kernels 123 ms, XLA's 250
    rows 121 ms)."""
    if _xla_memory_rows(n_rows, hidden, vocab, itemsize)[0] >= min(n_rows, MIN_BLOCK):
        return None
    cols = min(vocab, XLA_MEMORY_COLS)
    budget = _xla_block_budget(n_rows, hidden, vocab, itemsize, gemm_workspace=False)
    rows = int(max(budget, 0) // (cols * itemsize + hidden * (4 + itemsize)))
    return (_most_rows(n_rows, rows), cols) if rows >= min(n_rows, MIN_BLOCK) else None


def whole_row_memory_scratch(n_all: int, n_rows: int, hidden: int, vocab: int, itemsize: int,
                             gathered_rows: bool = False) -> int | None:
    """Elements of the logits scratch beyond grad_input [n_all, D] with which PyTorch's
    cross-entropy "memory" strategy runs in blocks of whole rows (the gradients formed in the
    forward pass, 6 N D V flops, grad_weight accumulated in the input dtype: liger's layout),
    else None (blocks of rows and columns, 8 N D V flops).

    grad_input and the scratch are one buffer, and a block's logits (rewritten as dz) lie in
    the scratch and in the rows of grad_input that no block has written yet, so the first
    blocks are the largest (`scratch_block_rows`: L 800 rows first, 352 near the end). The
    scratch plus, with gathered_rows (n_rows of n_all computed), the first block's copies
    of its x and grad_input rows stay within WHOLE_ROW_FRACTION of the gradients' bytes
    (the issue's bound is 10% + 16 bytes a row: 9.5% measured 1243.5 MiB at L, 0.25 MiB
    over it, from the per-row tensors and the allocator's rounding); whole rows are taken
    when the first block holds at least MIN_WHOLE_ROWS rows (fewer lose to rows and
    columns: H100, bf16, L with 10% of rows ignored, fixed blocks of 384 rows took 94.0 ms,
    448 rows 90.6 ms, rows and columns 101 ms; G's 256 rows 70 ms against 63 ms)."""
    if n_rows <= 0:
        return None
    budget = WHOLE_ROW_FRACTION * (n_all + vocab) * hidden
    copies, row_cost = (2 if gathered_rows else 0), vocab + hidden
    scratch = int((budget - copies * n_rows * hidden * hidden / row_cost) / (1 + copies * hidden / row_cost))
    scratch = min(scratch, n_rows * vocab)  # one block of all the rows needs no more
    if scratch < vocab:
        return None
    first = scratch_block_rows(n_rows, hidden, vocab, scratch)
    return scratch if first >= min(n_rows, MIN_WHOLE_ROWS) else None


def whole_row_memory_block_rows(n_rows: int, hidden: int, vocab: int, itemsize: int,
                                gathered_rows: bool = False) -> int | None:
    """JAX's rows per block of "memory" in whole rows, where PyTorch's takes them
    (`whole_row_memory_scratch`), else None. XLA owns grad_input's buffer, so the blocks
    are fixed: their logits, 2 D 16-bit values a row (with gathered_rows their x and
    grad_input rows; without, about what XLA's grad_input product split over the
    vocabulary keeps of partial sums: H100, 8192 x 3584 x 151936 with return_lse, 224 rows
    counting none took 1.101 x the floor), XLA's GEMM workspace and its per-row temporaries
    stay within WHOLE_ROW_FRACTION of the gradients' bytes (H100, L: 377 rows counting
    neither those rows nor the temporaries took 1.12 x)."""
    if whole_row_memory_scratch(n_rows, n_rows, hidden, vocab, itemsize, gathered_rows) is None:
        return None
    budget = _xla_block_budget(n_rows, hidden, vocab, itemsize)
    rows = int(budget // ((vocab + 2 * hidden) * itemsize))
    return without_a_thin_last_block(n_rows, min(n_rows, rows)) if rows >= 1 else None


def without_a_thin_last_block(n_rows: int, rows: int) -> int:
    """The most rows per block, at most `rows`, for which n_rows rows end in a full block or
    in one of at least min(rows, MIN_LAST_ROWS) rows; `rows` if none does. XLA splits a thin
    block's grad_input product dz W over the vocabulary it contracts (split-K) and padded a
    copy of W for that: H100, N, D, V = 8192, 3584, 151936 in blocks of 227 whole rows, the
    last of 20 rows: 1.97 x the floor (224 rows, the last of 128: 1.10 x)."""
    fewest = min(rows, MIN_LAST_ROWS)
    for r in range(rows, fewest - 1, -1):
        if n_rows % r == 0 or n_rows % r >= fewest:
            return r
    return rows


def scratch_block_rows(rows_left: int, hidden: int, vocab: int, scratch: int) -> int:
    """Rows of the next whole-row block when rows_left rows are still to compute and its
    logits [R, V] may fill `scratch` elements plus grad_input's rows not yet written
    (R rows of grad_input are written by this block: R V <= (rows_left - R) D + scratch);
    a multiple of WHOLE_ROW_ALIGN unless it is the last block or fewer rows fit."""
    rows = int((rows_left * hidden + scratch) // (vocab + hidden))
    if rows >= rows_left:
        return rows_left
    return max(1, rows // WHOLE_ROW_ALIGN * WHOLE_ROW_ALIGN or rows)


def speed_extra_bytes(n_rows: int, hidden: int, vocab: int, itemsize: int) -> int:
    """Bytes "speed" needs beyond the gradients: the fp32 dW accumulator and one block."""
    rows, cols = block_shape("speed", n_rows, hidden, vocab, itemsize)
    return vocab * hidden * 4 + rows * cols * itemsize


def forward_only_rows(n_rows: int, hidden: int, vocab: int, itemsize: int) -> int:
    """Rows per block of "speed" for a call that takes no gradient: it holds no grad_weight
    accumulator, so its logits block may take those bytes too (all that "speed" holds beyond
    the gradients, `speed_extra_bytes`), the rows spread evenly over the fewest blocks
    (`even_rows`). The products of fewer, larger blocks run faster (H100, bf16, the logits
    of the rows not ignored, 10% ignored: G's 7373 rows in blocks of 1024 rows took 12.07
    ms, of 4096 11.38 ms, in one product 11.25 ms; L's 14746 rows in blocks of 2048 20.23
    ms, of 4096 20.14 ms, in one product 19.35 ms)."""
    return even_rows(n_rows, speed_extra_bytes(n_rows, hidden, vocab, itemsize) // (vocab * itemsize))


def even_rows(n_rows: int, most: int) -> int:
    """Rows per block for n_rows rows in the fewest blocks of at most `most` rows (rounded
    down to MIN_BLOCK, at least MIN_BLOCK), spread evenly: a multiple of MIN_BLOCK (or all
    the rows)."""
    most = _round_down(most, MIN_BLOCK)
    blocks = max(1, -(-n_rows // most))
    rows = -(-n_rows // blocks)
    return max(1, min(n_rows, most, -(-rows // MIN_BLOCK) * MIN_BLOCK))


def weight_grad_slabs(vocab: int, class_bytes: int, wider_than_weight: bool) -> list[int]:
    """Edges [0, .., vocab] of the vocabulary slabs of a grad_weight accumulator whose class
    (one row of W) takes class_bytes: one slab when it has W's dtype; when it is wider (fp32
    for a 16-bit W), up to WEIGHT_GRAD_SLABS slabs of at least WEIGHT_GRAD_SLAB_BYTES, so its
    conversion can free each slab in turn (peak 2 W + W / slabs instead of 3 W; with two,
    the W / 2 is about the logits block the loop held before). More slabs cost more than
    they save (H100, `speed`, L / G: 1 slab 84 / 60 ms, 2 slabs 85 / 65 ms, 4: 92 / 62 ms,
    8: 93 / 65 ms). Edges are multiples of SLAB_ALIGN classes: cuBLAS picks slow kernels
    for a dz column slice whose start is less aligned (8 slabs of 16032 classes at L took
    149 ms)."""
    slabs = min(WEIGHT_GRAD_SLABS, max(1, vocab * class_bytes // WEIGHT_GRAD_SLAB_BYTES)) if wider_than_weight else 1
    step = -(-vocab // slabs)
    if slabs > 1:
        step = -(-step // SLAB_ALIGN) * SLAB_ALIGN
    return list(range(0, vocab, step)) + [vocab]
