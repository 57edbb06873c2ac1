"""How the kernel paths of both frameworks cut a problem into blocks of logits.

A block is [rows, cols] of the N x V logits, computed by one matrix product into a reused
buffer. "speed" uses blocks of whole rows (cols = V) so the gradient can be formed in the
forward pass; "memory" sizes rows and cols so that the block plus an fp32 grad_input
accumulator of one row block stay near MEMORY_FRACTION of the gradients' bytes.
"""

from __future__ import annotations

SPEED_BLOCK_ELEMENTS = 1 << 28  # logits per "speed" block (512 MiB in bf16): few passes over an fp32 dW
MEMORY_FRACTION = 0.08  # "memory": logits block + grad_input accumulator, as a share of the gradients' bytes
MIN_BLOCK = 128  # rows or columns of a block, at the least
MIN_MEMORY_BLOCK = (1024, 4096)  # "memory": rows, columns at the least (smaller blocks waste the GPU)


def _round_down(n: int, multiple: int) -> int:
    return max(multiple, n // multiple * multiple)


def block_shape(strategy: str, n_rows: int, hidden: int, vocab: int, itemsize: int) -> tuple[int, int]:
    """(rows, cols) per block for "speed" or "memory"; itemsize: bytes of the input dtype."""
    if strategy == "speed":
        rows = _round_down(SPEED_BLOCK_ELEMENTS // vocab, MIN_BLOCK)
        return max(1, min(n_rows, rows)), vocab
    budget = MEMORY_FRACTION * (n_rows + vocab) * hidden * itemsize
    min_rows, min_cols = (max(MIN_BLOCK, m) for m in MIN_MEMORY_BLOCK)
    rows = max(min_rows, _round_down(int(budget / 2 / (hidden * 4)), MIN_BLOCK))
    rows = max(1, min(n_rows, rows))
    cols = min(vocab, max(min_cols, _round_down(int(budget / 2 / (rows * itemsize)), MIN_BLOCK)))
    return rows, cols


def speed_extra_bytes(n_rows: int, hidden: int, vocab: int, itemsize: int) -> int:
    """Bytes "speed" needs beyond the gradients: the fp32 dW accumulator and one block."""
    rows, cols = block_shape("speed", n_rows, hidden, vocab, itemsize)
    return vocab * hidden * 4 + rows * cols * itemsize
