"""The measured numbers of both frameworks' kernel paths, in one place.

`Tuning` holds what the block planner (`interop.planning`, with the rules of
`interop.blocking`) and the block loops read per call; a call takes another through its
``tuning`` argument, as JAX's Pallas attention takes its block sizes (tests pass tiny
blocks to run many blocks on small problems). The module constants below it are the
kernels' compile-time launch parameters. Each value says what it
bounds and why it is what it is; the defaults were measured in bf16 on NVIDIA H100 and H200
GPUs, and bench/NOTES.md holds the runs behind them.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The planner's numbers (frozen and hashable: JAX keeps it in a custom_vjp's static
    configuration). Fractions are shares of the floor, the gradients' bytes (N + V) D."""

    # "speed": logits per block of whole rows (1 GiB in bf16). Each row block reads and writes
    # an fp32 grad_weight accumulator: at the Llama-3 head (L) blocks of 4096 rows, half of
    # 2^28's 8 blocks, took 74.2 ms against 76.5 (H200, same process) at 2.86x the floor
    # against 2.37 (torch.compile: 4.55x); at G (V 256000) both sizes give 2048 rows.
    speed_block_elements: int = 1 << 29
    # ... and at least this many rows, or D (rounded down to min_block): each row block reads
    # and writes that fp32 accumulator (8 V D bytes), which below 2048 rows costs over a
    # seventh of the block's products (H100, G: 1024-row blocks 54.8 ms, 2048 rows 47.0); at
    # most D rows keep one 16-bit logits block within half of the accumulator.
    speed_min_rows: int = 2048
    # "speed" in one block of all rows, which needs no grad_weight accumulator, where its
    # logits take at most this share of one block and that accumulator (`one_speed_block`;
    # 1: no more logits and accumulator bytes than several blocks, which `speed_extra_bytes`
    # then bounds for "auto"; 0: never, for tests of many blocks).
    one_speed_block_share: float = 1.0
    # "speed" with a 16-bit grad_weight accumulator: the block grows by this factor when the
    # V D 2 bytes an fp32 accumulator would have held pay for the growth (fewer passes).
    narrow_speed_block_growth: float = 1.5
    # "speed" keeps a call's logits [A, V] (its rows computed) from its forward pass for its
    # backward pass, where that pass would recompute them (the upstream gradients unknown in
    # the forward pass: log-probabilities, lse or per-row losses returned, distillation per
    # row), when they take at most this share of the device's free memory: the backward
    # pass then makes 4 N D V flops instead of 6, in one product per gradient over all rows
    # (no fp32 grad_weight accumulator). 0: never; the remedy where a jitted JAX step runs
    # out of memory (JAX weighs one call's logits when it is traced, not what the rest of
    # the step or a jax.vmap batch holds). bench/NOTES.md, 2026-11-28 and 2026-11-29.
    keep_logits_share: float = 0.25
    # "memory" in rows x columns: one logits block plus the fp32 grad_input accumulator of
    # its row block, as a share of the floor (the memory-first bound is a tenth).
    memory_fraction: float = 0.08
    # "memory" in whole rows: the logits scratch plus the first block's row copies, as a
    # share of the floor; 0.095 would go over the tenth by the allocator's rounding.
    whole_row_fraction: float = 0.093
    # ... taken by PyTorch when its first block holds at least this many rows: fewer lose to
    # rows x columns (each row block reads all of W). (JAX weighs its plans' estimates.)
    min_whole_rows: int = 384
    # ... or when W has at most this many bytes, whose re-reads cost less than the tiles'
    # host time per tile at small N (H100, S: tiles 12.8 ms, whole rows 7.2; 8192 x 768 x
    # 50257: 32.3 and 31.5; a 1.2 GB head, 4096 x 2304 x 256000: tiles 32.1, whole 42.9).
    whole_row_head_bytes: int = 1 << 27
    # ... if its first block still holds this many rows (S: 231; thinner blocks re-read W more
    # often than the tiles they replace, and were not measured).
    min_small_head_rows: int = 192
    # ... its blocks a multiple of this many rows (aligned products).
    whole_row_align: int = 32
    # JAX's fixed row blocks end in a block of at least this many rows, and its whole-row
    # "memory" blocks hold at least this many: XLA splits a thin block's grad_input product
    # over the vocabulary and pads a copy of W for it.
    min_last_rows: int = 128
    # Bytes of the cuBLAS workspace XLA keeps among a loop's temporaries.
    xla_gemm_workspace: int = 32 << 20
    # Bytes a row of N of XLA's per-row temporaries in JAX's whole-row or kernel blocks.
    xla_row_bytes: int = 512
    # JAX "memory" in rows x columns through XLA's products: vocabulary columns per block
    # (narrower blocks ran slower at the Gemma-2 head).
    xla_memory_cols: int = 2048
    # ... all XLA holds beyond the gradients for those blocks, as a share of the floor: its
    # memory was within 0.2 MiB of the planner's count over the shapes measured.
    xla_blocks_fraction: float = 0.098
    # ... bytes a row of N of XLA's per-row temporaries there.
    xla_blocks_row_bytes: int = 16
    # JAX "memory" takes, of its plans within the budget (whole rows, XLA's tiles, tiles of
    # `jax_impl.row_products`), the one of least estimated time (`interop.blocking.
    # memory_plan_seconds`), from these rates fitted on an H200 (bench/NOTES.md,
    # 2026-11-28): XLA's bf16 products in the loops, flop/s; `row_products`' rate as a share
    # of it; the cost of one step of a block loop (XLA's tiles at 8192 x 2048 x 128256:
    # 2016 steps took 74 ms beyond their products) and of one block of whole rows (its row
    # gathers, row kernel and copies: blocks of 128 rows there cost 0.45 ms each, 0.3 ms of
    # it the grad_weight pass counted apart); grad_weight read and written per row block,
    # bytes/s. Only the order of the plans matters.
    plan_product_flops: float = 700e12
    plan_kernel_product_share: float = 0.78
    plan_step_seconds: float = 37e-6
    plan_row_block_seconds: float = 150e-6
    plan_update_bytes_per_second: float = 3.5e12
    # Rows or columns of a block, at the least.
    min_block: int = 128
    # "memory": rows and columns of a block at the least (smaller blocks leave the GPU idle).
    min_memory_block: tuple[int, int] = (1024, 4096)
    # An fp32 grad_weight of a 16-bit W is two slabs (`interop.blocking.weight_grad_slabs`)
    # where each takes at least this many bytes (a small head is one slab: one product).
    weight_grad_slab_bytes: int = 256 << 20
    # ... the slab edge at a multiple of this many rows of W: cuBLAS picks slow kernels for a
    # dz column slice (x's, for a [D, V] W) whose start is less aligned.
    slab_align: int = 256
    # N D V from which the kernel paths compute only the rows not ignored (PyTorch waits for
    # the GPU once to find them, JAX sorts the rows): it pays once 6 N D V flops take
    # milliseconds.
    skip_ignored_min_work: int = 2**40
    # JAX "speed" skipping ignored rows: the kept rows after its last full block run in
    # blocks this many times smaller ("memory" keeps its blocks: each reads all of W).
    speed_tail_split: int = 4
    # PyTorch's gradient filtering gathers the kept tiles' columns when at most this share
    # of a block's tiles is kept (else it masks the dropped tiles).
    gather_share: float = 0.25
    # "chunked": rows per chunk at the least, for matrix-product efficiency.
    min_chunk_rows: int = 64
    # JAX's fused row statistics split the vocabulary so that about this many programs run:
    # 8 per SM of an H100, so the last, partial wave costs little.
    fused_stats_programs: int = 1056

    def __post_init__(self):
        """Each field a number of its type, within what the planner can use: counts of rows,
        columns, steps or programs at least 1 (a 0 would divide by zero), bytes and work at
        least 0, shares and factors finite and at least 0 (rates > 0); ValueError naming
        the field else."""
        for f in dataclasses.fields(self):
            value, name = getattr(self, f.name), f"Tuning.{f.name}"
            if f.name == "min_memory_block":
                if not (isinstance(value, tuple) and len(value) == 2 and all(_count(v) for v in value)):
                    raise ValueError(f"{name} must be a pair of ints >= 1 (rows, columns), got {value!r}")
            elif type(f.default) is int and not (_count(value) if f.name in _COUNTS else _count(value, least=0)):
                raise ValueError(f"{name} must be an int >= {1 if f.name in _COUNTS else 0}, got {value!r}")
            elif type(f.default) is float and not _share(value, positive=f.name in _RATES):
                raise ValueError(f"{name} must be a finite number {'> 0' if f.name in _RATES else '>= 0'}, got {value!r}")


# Tuning's int fields that count rows, columns, steps or programs (the others are bytes or
# work, which may be 0), and its float fields that are rates (divisors).
_COUNTS = frozenset({"speed_block_elements", "speed_min_rows", "min_whole_rows", "min_small_head_rows",
                     "whole_row_align", "min_last_rows", "xla_memory_cols", "min_block", "slab_align",
                     "speed_tail_split", "min_chunk_rows", "fused_stats_programs"})
_RATES = frozenset({"plan_product_flops", "plan_kernel_product_share", "plan_update_bytes_per_second"})


def _count(value, least: int = 1) -> bool:
    """Whether value is an int (not a bool) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _share(value, positive: bool) -> bool:
    """Whether value is a finite int or float (not a bool), > 0 with `positive`, else >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value > 0 if positive else value >= 0


DEFAULT = Tuning()

# Kernel launch parameters (compile-time constants).

# Classes per step of the Triton and Pallas row kernels' loop over a block of logits.
BLOCK_COLS = 2048
# PyTorch: rows per program of the per-row kernels (losses, coefficients, target check).
ROW_KERNEL_ROWS = 1024
# PyTorch: the whole-row statistics pass, columns per step and warps (a little faster than
# BLOCK_COLS with 8 warps; the same with gradients).
WHOLE_ROW_STATS_COLS, WHOLE_ROW_STATS_WARPS = 4096, 16
# JAX, rows split across devices under jit: a device's grad_weight of one row block is
# formed in this many slabs of the hidden dimension, each reduce-scattered over the devices
# as soon as it is formed, so that its sum overlaps the next slab's product and no whole
# fp32 partial is held. On 2 x H200 at L, 2 slabs hold 3.7 GB of temporaries per device
# against 4.2 GB in one slab; 4 and 8 slabs ran 2.5 ms slower at L and 1-1.3 ms at G
# (bench/NOTES.md).
ROWS_SUM_SLABS = 2
# JAX: the row kernels' launch parameters.
JAX_ROW_KERNEL_PARAMS = dict(num_warps=8, num_stages=1)
# JAX fused row statistics: a tile of logits [rows, classes], bytes of the hidden dimension
# per step of the product (64 16-bit values, 32 fp32), launch parameters.
FUSED_STATS_TILE = (128, 256)
FUSED_STATS_K_BYTES = 128
FUSED_STATS_PARAMS = dict(num_warps=8, num_stages=4)
# JAX's product kernels of "memory"'s tiles (`jax_impl.row_products`): (output tile rows,
# output tile columns, K step in bytes of one operand row, warps, stages).
LOGITS_TILE = (128, 256, 128, 8, 4)  # [rows, classes]
GRAD_INPUT_TILE = (64, 256, 128, 4, 4)  # [rows, hidden]
GRAD_WEIGHT_TILE = (256, 128, 64, 8, 4)  # [classes, hidden] ([hidden, classes] for "DV")
