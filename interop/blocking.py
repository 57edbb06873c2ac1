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
WHOLE_ROW_FRACTION = 0.095  # "memory" in whole rows: logits block (+ x rows), as a share of the gradients' bytes
MIN_WHOLE_ROWS = 384  # ... when that is at least this many rows (fewer lose to the blocks of rows and columns)
WHOLE_ROW_ALIGN = 32  # ... a multiple of this many rows
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
    row_bytes = hidden * (4 + (itemsize if gathered_rows else 0))  # the fp32 grad_input accumulator (+ the copy)
    rows = max(min_rows, _round_down(int(budget / 2 / row_bytes), MIN_BLOCK))
    rows = max(1, min(n_rows, rows))
    cols = min(vocab, max(min_cols, _round_down(int(budget / 2 / (rows * itemsize * buffers)), MIN_BLOCK)))
    return rows, cols


def whole_row_memory_rows(n_rows: int, hidden: int, vocab: int, itemsize: int, gathered_rows: bool = False) -> int | None:
    """Rows per block when PyTorch's cross-entropy "memory" strategy can take blocks of whole rows
    (the gradients formed in the forward pass, 6 N D V flops, grad_weight accumulated in the
    input dtype: liger's layout), else None (blocks of rows and columns, 8 N D V flops).

    A block's logits (rewritten as dz) and, with gathered_rows, its copy of x stay within
    WHOLE_ROW_FRACTION of the gradients' bytes; whole rows are taken when that holds at
    least MIN_WHOLE_ROWS rows (or all of them). H100, bf16, L with 10% of rows ignored: 384
    rows 94.0 ms at 1.09 x the floor, 448 rows 90.6 ms at 1.11 x, the column blocks 101 ms
    (liger 92.5 ms at 1.11 x); the 416 rows taken there: 92.5 ms at 1.10 x, liger 91.7 in
    that run; at G the whole rows that fit (192) take 90 ms, the column blocks 63 ms."""
    budget = WHOLE_ROW_FRACTION * (n_rows + vocab) * hidden * itemsize
    rows = int(budget // ((vocab + (hidden if gathered_rows else 0)) * itemsize))
    if rows >= n_rows > 0:
        return n_rows
    rows = rows // WHOLE_ROW_ALIGN * WHOLE_ROW_ALIGN
    return rows if rows >= MIN_WHOLE_ROWS else None


def speed_extra_bytes(n_rows: int, hidden: int, vocab: int, itemsize: int) -> int:
    """Bytes "speed" needs beyond the gradients: the fp32 dW accumulator and one block."""
    rows, cols = block_shape("speed", n_rows, hidden, vocab, itemsize)
    return vocab * hidden * 4 + rows * cols * itemsize


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
