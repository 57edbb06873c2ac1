"""interop.planning.plan, the one planner of both frameworks: what it guarantees for every
framework, loss and strategy (the block shapes themselves are interop.blocking's, tested in
test_implementations)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from interop import blocking, planning
from interop.tuning import DEFAULT
from tests.frameworks import SMALL

SHAPES = {"L": (16384, 4096, 128256), "G": (8192, 2304, 256000), "S": (4096, 1024, 32000), "odd": (13, 19, 53)}
CASES = list(itertools.product(planning.FRAMEWORKS, planning.LOSSES, ("speed", "memory", "chunked")))


def test_unknown_framework_or_loss_is_refused():
    with pytest.raises(ValueError, match=r"framework .* 'flax'"):
        planning.plan(DEFAULT, "flax", "cross_entropy", "speed", 13, 19, 53, 2, False)
    with pytest.raises(ValueError, match=r"loss .* 'dpo'"):
        planning.plan(DEFAULT, "torch", "dpo", "speed", 13, 19, 53, 2, False)


@pytest.mark.parametrize("t", [DEFAULT, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_plan_covers_the_head_and_accumulates_as_documented(shape, t):
    """For every framework, loss and strategy: blocks of at least one row, at most N rows
    and V columns; "speed" and "chunked" in whole rows; grad_weight in the input dtype
    exactly with accumulate_in_input_dtype or under "memory"; "chunked" the same plan
    everywhere (chunk_rows whole rows)."""
    n, d, v = SHAPES[shape]
    for (framework, loss, strategy), accumulate in itertools.product(CASES, (False, True)):
        p = planning.plan(t, framework, loss, strategy, n, d, v, 2, accumulate)
        what = (framework, loss, strategy, accumulate)
        assert 1 <= p.rows <= n and 1 <= p.cols <= v and p.strategy == strategy, (what, p)
        assert p.narrow_accumulator == (accumulate or strategy == "memory"), (what, p)
        if strategy != "memory":
            assert p.layout == "rows" and p.cols == v, (what, p)
        if p.layout == "rows":
            assert p.cols == v, (what, p)
        if strategy == "chunked":
            assert p == planning.Plan("chunked", "rows", blocking.chunk_rows(t, n, d, v), v, accumulate), (what, p)


@pytest.mark.parametrize("shape", ["L", "G", "S"])
def test_both_frameworks_take_whole_rows_for_memory_alike(shape):
    """Cross-entropy's "memory" runs in whole rows at L in both frameworks and in tiles at G
    (XLA owns grad_input's buffer, so JAX's blocks may be smaller; at S, whose head is small
    enough for PyTorch's whole rows, they leave JAX no row)."""
    n, d, v = SHAPES[shape]
    torch_plan = planning.plan(DEFAULT, "torch", "cross_entropy", "memory", n, d, v, 2, False)
    jax_plan = planning.plan(DEFAULT, "jax", "cross_entropy", "memory", n, d, v, 2, False)
    assert (torch_plan.layout == "rows") == (torch_plan.scratch > 0)
    assert (jax_plan.layout == "rows") == (torch_plan.layout == "rows") or shape == "S"
    if jax_plan.layout == "rows":
        assert torch_plan.layout == "rows" and jax_plan.rows <= torch_plan.rows


@pytest.mark.parametrize("shape", ["L", "G", "odd"])
def test_a_split_head_keeps_one_devices_memory_block(shape):
    """On a head split over P devices, "memory" takes one device's logits block over the
    device's classes (the same tiles, or as many more whole rows), never fewer rows; the
    other strategies plan the device's classes as they are."""
    n, d, v = SHAPES[shape]
    t = SMALL if shape == "odd" else DEFAULT
    for (framework, loss, strategy), P in itertools.product(CASES, (2, 4, 32)):  # 32: tiles wider than a device's classes
        local = -(-v // P)
        one = planning.plan(t, framework, loss, strategy, n, d, v, 2, False, whole_vocab=v)
        split = planning.plan(t, framework, loss, strategy, n, d, local, 2, False, whole_vocab=v)
        what = (framework, loss, strategy, P, one, split)
        if strategy != "memory":
            assert split == planning.plan(t, framework, loss, strategy, n, d, local, 2, False), what
            continue
        assert split.layout == one.layout and split.rows >= one.rows and split.scratch == 0, what
        assert split.rows * split.cols <= one.rows * one.cols, what
        assert split.cols == (min(one.cols, local) if one.layout == "tiles" else local), what


def test_a_split_head_at_l_takes_one_devices_rows_and_tiles():
    """At L on 2 devices: JAX's whole rows of 64128 classes, twice one device's 250 rows
    (without the whole head's budget its whole rows would be 128, so the kernels' tiles are
    the plan); PyTorch's tiles of one device (2816 x 8320); at 32 devices PyTorch's tiles
    are cut to a device's 4008 classes."""
    n, d, v = SHAPES["L"]
    jax = planning.plan(DEFAULT, "jax", "cross_entropy", "memory", n, d, v // 2, 2, False, whole_vocab=v)
    assert (jax.layout, jax.rows, jax.cols) == ("rows", 500, 64128)
    assert blocking.jax_whole_row_block_rows(DEFAULT, n, d, v // 2, 2) == 128
    local = planning.plan(DEFAULT, "jax", "cross_entropy", "memory", n, d, v // 2, 2, False)
    assert (local.layout, local.kernel_products, local.rows, local.cols) == ("tiles", True, 1792, 2048)
    torch_plan = planning.plan(DEFAULT, "torch", "cross_entropy", "memory", n, d, v // 2, 2, False, whole_vocab=v)
    assert (torch_plan.layout, torch_plan.rows, torch_plan.cols, torch_plan.scratch) == ("tiles", 2816, 8320, 0)
    narrow = planning.plan(DEFAULT, "torch", "cross_entropy", "memory", n, d, -(-v // 32), 2, False, whole_vocab=v)
    assert (narrow.rows, narrow.cols) == (2816, 4008)


def test_speed_takes_at_least_2048_rows_or_d():
    """Each "speed" row block reads and writes the fp32 grad_weight accumulator: with a
    vocabulary of 512000 its 2^29 logits would be 1024 rows, and it takes 2048; at most D rows
    (a small D with a large vocabulary keeps the logits block within half of the
    accumulator). G's and L's blocks are their 2^29 logits: 2048 and 4096 rows."""
    n, d, v = 8192, 2304, 512000
    for framework in ("torch", "jax"):
        assert planning.plan(DEFAULT, framework, "cross_entropy", "speed", n, d, v, 2, False).rows == 2048
        assert planning.plan(DEFAULT, framework, "log_probs", "speed", n, d, v, 2, False).rows == 2048
    assert planning.plan(DEFAULT, "torch", "cross_entropy", "speed", 8192, 1024, 1_000_000, 2, False).rows == 1024
    assert planning.plan(DEFAULT, "torch", "cross_entropy", "speed", *SHAPES["G"], 2, False).rows == 2048
    assert planning.plan(DEFAULT, "torch", "cross_entropy", "speed", *SHAPES["L"], 2, False).rows == 4096


def test_memory_takes_whole_rows_on_a_small_head():
    """PyTorch's cross-entropy "memory" takes whole rows where W has at most 128 MiB and the first
    block holds at least 192 rows (S: 65 MB, 231 rows, under min_whole_rows), not on a 1.2 GB head
    of as few rows, nor on a small head of thin blocks."""
    s = planning.plan(DEFAULT, "torch", "cross_entropy", "memory", *SHAPES["S"], 2, False)
    assert s.layout == "rows" and s.scratch > 0 and s.cols == SHAPES["S"][2]
    assert planning.plan(DEFAULT, "torch", "cross_entropy", "memory", 4096, 2304, 256000, 2, False).layout == "tiles"
    thin = planning.plan(DEFAULT, "torch", "cross_entropy", "memory", 4096, 256, 32000, 2, False)
    assert thin.layout == "tiles"  # its first whole-row block would hold 32 rows, under min_small_head_rows
    big_head = dataclasses.replace(DEFAULT, whole_row_head_bytes=0)
    assert planning.plan(big_head, "torch", "cross_entropy", "memory", *SHAPES["S"], 2, False).layout == "tiles"
