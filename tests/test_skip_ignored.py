"""The PyTorch kernels computing only the rows whose target is not ignored (cross-entropy)
or that are valid (distillation), `torch_impl.functional.rows_to_compute`, against the
float64 reference.

At the sizes of these tests the threshold (Tuning.skip_ignored_min_work) is lowered to 0
(SKIPPING) so that every call with some ignored rows takes that path; a spy on
`blocked.forward` asserts that it did, with exactly the rows not ignored. The CPU tests run
the Triton kernels in the interpreter with small blocks (tests.frameworks.SMALL: several row
blocks, column blocks and two grad_weight slabs).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import torch_impl.functional as functional
from interop.blocking import skipping_pays
from tests import distill_frameworks
from tests.frameworks import (CASES, DTYPES, MEDIUM_BLOCK_FIELDS, SMALL, WHOLE_ROW_MEMORY, JaxAdapter, TorchAdapter,
                              check_against_reference, make_problem, reference, seed_of, tolerance, upstream_grads)
from torch_impl import blocked

# SMALL, and WHOLE_ROW_MEMORY ("memory" in blocks of whole rows), skipping ignored rows at any size.
SKIPPING = dataclasses.replace(SMALL, skip_ignored_min_work=0)
WHOLE_ROW_SKIPPING = dataclasses.replace(WHOLE_ROW_MEMORY, skip_ignored_min_work=0)
# SKIPPING with the GPU tests' medium shapes (1000 x 257 x 5003) in several row and column blocks.
MEDIUM_SKIPPING = dataclasses.replace(SKIPPING, **MEDIUM_BLOCK_FIELDS)

# The cases without a returned lse: a returned lse covers every row, so all rows are computed.
ROW_CASES = [case for case, (_, kwargs, with_lse) in CASES.items() if not with_lse]


@pytest.fixture
def skipping(monkeypatch):
    """The list of `active` arguments that blocked.forward receives (a spy on it)."""
    seen = []
    forward = blocked.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("active", args[10] if len(args) > 10 else None))
        return forward(*args, **kwargs)

    monkeypatch.setattr(blocked, "forward", spy)
    return seen


def assert_skipped_ignored(seen, p, ignore_index: int = -100) -> None:
    assert seen and seen[-1] is not None, "the call computed every row"
    expected = np.flatnonzero(p.y.reshape(-1) != ignore_index)
    np.testing.assert_array_equal(seen[-1].cpu().numpy(), expected)


def check_case_with_ignored_rows(adapter, case: str, dtype: str, layout: str):
    """Run a CASES case with 40% of its rows ignored through `adapter` against the float64
    reference, and check that the ignored rows got a zero grad_input; returns (problem, options)."""
    options, problem_kwargs, _ = CASES[case]
    seed = seed_of("skip", adapter.name, case, dtype, layout)
    p = make_problem(seed, dtype=dtype, weight_layout=layout, ignore_frac=0.4, **problem_kwargs)
    g_out, _ = upstream_grads(seed, p, options.get("reduction", "mean"), False)
    result = adapter.run(p, options, g_out, None)
    check_against_reference(result, reference(p, options, g_out, None), dtype, p.logit_scale)
    ignored = (p.y == options.get("ignore_index", -100)).reshape(-1)
    assert not result["grad_x"].reshape(-1, p.x.shape[-1])[ignored].any(), "ignored rows got a grad_input"
    return p, options


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROW_CASES)
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_skipping_ignored_rows_matches_reference(skipping, strategy, case, dtype, layout):
    p, options = check_case_with_ignored_rows(TorchAdapter(strategy, tuning=SKIPPING), case, dtype, layout)
    assert_skipped_ignored(skipping, p, options.get("ignore_index", -100))


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROW_CASES)
def test_skipping_in_whole_row_memory_matches_reference(skipping, case, dtype, layout):
    """"memory" in whole rows whose logits lie in grad_input's unwritten rows: the rows
    skipped there held logits, and must end as zeros."""
    p, options = check_case_with_ignored_rows(TorchAdapter("memory", tuning=WHOLE_ROW_SKIPPING), case, dtype, layout)
    assert_skipped_ignored(skipping, p, options.get("ignore_index", -100))


@pytest.fixture
def jax_skipping(monkeypatch):
    """As `skipping` for JAX: the list of `keep` arguments that the block engine's row loops
    (jax_impl.engine) receive (at trace time)."""
    import jax_impl.engine

    seen = []
    row_loop = jax_impl.engine.row_loop

    def spy(*args):
        seen.append(args[5] if len(args) > 5 else None)
        return row_loop(*args)

    monkeypatch.setattr(jax_impl.engine, "row_loop", spy)
    return seen


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", ROW_CASES)
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_jax_skipping_ignored_rows_matches_reference(jax_skipping, strategy, case, dtype, layout):
    check_case_with_ignored_rows(JaxAdapter(strategy, SKIPPING), case, dtype, layout)
    assert jax_skipping and all(keep is not None for keep in jax_skipping), "the call computed every row"


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", ROW_CASES)
def test_jax_skipping_in_whole_row_memory_matches_reference(jax_skipping, case, dtype, layout):
    """JAX's "memory" in blocks of whole rows (a 16-bit grad_weight), skipping ignored rows."""
    check_case_with_ignored_rows(JaxAdapter("memory", WHOLE_ROW_SKIPPING), case, dtype, layout)
    assert jax_skipping and all(keep is not None for keep in jax_skipping), "the call computed every row"


def test_jax_returned_lse_computes_every_row(jax_skipping):
    p = make_problem(6, ignore_frac=0.5)
    g_out, g_lse = upstream_grads(6, p, "mean", True)
    result = JaxAdapter("speed", SKIPPING).run(p, {}, g_out, g_lse)
    check_against_reference(result, reference(p, {}, g_out, g_lse), "float32")
    assert jax_skipping and all(keep is None for keep in jax_skipping)


@pytest.mark.parametrize("n_rows, kept, sizes", [
    (21, [1, 5, 6, 12, 20], [2, 2, 2]),  # no full block of kept rows: blocks of 8 / tail_split
    (21, range(9), [8, 2]),
    (21, range(21), [8, 8, 2, 2, 1]),  # the remainder of the smaller blocks holds a kept row
    (21, range(20), [8, 8, 2, 2]),
    (21, [], []),
    (24, range(0, 24, 2)[:9], [8, 2]),
])
def test_jax_row_loop_visits_only_the_blocks_of_kept_rows(n_rows, kept, sizes):
    """jax_impl.rows.row_loop with `keep` (blocks of 8 rows, tail_split 4): the kept rows
    first (ascending), then the others (ascending), in the blocks `sizes`; outputs land in
    their rows, zeros in the rows never visited."""
    import jax.numpy as jnp

    from jax_impl.rows import row_loop

    keep = np.zeros(n_rows, bool)
    keep[list(kept)] = True
    order = np.concatenate([np.flatnonzero(keep), np.flatnonzero(~keep)])
    visited = order[:sum(sizes)]
    x = jnp.arange(1, n_rows + 1, dtype=jnp.float32)

    def row_step(carry, xs):
        (x_R,) = xs
        total, blocks = carry
        return (total + x_R.sum(), blocks + 1), (x_R * 2, x_R * 0 + x_R.shape[0])

    (total, blocks), (doubled, size_of) = row_loop(row_step, (jnp.float32(0), jnp.int32(0)), (x,), n_rows, 8,
                                                   jnp.asarray(keep), tail_split=4)
    assert int(blocks) == len(sizes)
    assert float(total) == float(np.asarray(x)[visited].sum())
    want = np.zeros(n_rows)
    want[visited] = 2 * np.asarray(x)[visited]
    np.testing.assert_array_equal(np.asarray(doubled), want)
    want_size = np.zeros(n_rows)
    want_size[visited] = np.repeat(sizes, sizes)
    np.testing.assert_array_equal(np.asarray(size_of), want_size)


@pytest.mark.parametrize("ignore_frac", [0.0, 1.0])
def test_all_or_no_rows_ignored_compute_every_row(skipping, ignore_frac):
    p = make_problem(5, ignore_frac=ignore_frac, bias=True)
    g_out, _ = upstream_grads(5, p, "sum", False)
    result = TorchAdapter("speed", tuning=SKIPPING).run(p, dict(reduction="sum"), g_out, None)
    check_against_reference(result, reference(p, dict(reduction="sum"), g_out, None), "float32")
    assert skipping == [None]


def test_returned_lse_computes_every_row(skipping):
    p = make_problem(6, ignore_frac=0.5)
    g_out, g_lse = upstream_grads(6, p, "mean", True)
    result = TorchAdapter("memory", tuning=SKIPPING).run(p, {}, g_out, g_lse)
    check_against_reference(result, reference(p, {}, g_out, g_lse), "float32")
    assert skipping == [None]


def test_small_calls_compute_every_row(monkeypatch):
    """Below Tuning.skip_ignored_min_work the rows are not looked up (no host wait, no extra launch)."""
    below = dataclasses.replace(SMALL, skip_ignored_min_work=13 * 19 * 53 + 1)
    assert not skipping_pays(below, 13, 19, 53)
    monkeypatch.setattr(functional, "rows_to_compute", lambda keep: pytest.fail("looked up the rows"))
    p = make_problem(8, ignore_frac=0.5)
    g_out, _ = upstream_grads(8, p, "mean", False)
    result = TorchAdapter("speed", tuning=below).run(p, {}, g_out, None)
    check_against_reference(result, reference(p, {}, g_out, None), "float32")
    assert skipping_pays(dataclasses.replace(SMALL, skip_ignored_min_work=13 * 19 * 53), 13, 19, 53)


def test_rows_to_compute_only_when_some_are_left_out():
    assert functional.rows_to_compute(torch.tensor([True, False, True])).tolist() == [0, 2]
    assert functional.rows_to_compute(torch.tensor([True, True])) is None
    assert functional.rows_to_compute(torch.tensor([False, False])) is None


def test_bad_target_still_raises(skipping):
    x, W = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8)
    y = torch.tensor([0, -100, 11, 3, -100, 2])
    with pytest.raises(ValueError, match="11"):
        functional.linear_cross_entropy(x, W, y, strategy="speed", tuning=SKIPPING)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["mean", "none-classweights", "zloss-softcap-bias"])
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_cuda_skipping_ignored_rows_matches_reference(skipping, strategy, case, dtype):
    """Medium odd shapes in several row and column blocks on the GPU (MEDIUM_SKIPPING)."""
    options, problem_kwargs, _ = CASES[case]
    seed = seed_of("cuda-skip", strategy, case, dtype)
    p = make_problem(seed, lead=(1000,), hidden=257, vocab=5003, dtype=dtype, ignore_frac=0.3, **problem_kwargs)
    g_out, _ = upstream_grads(seed, p, options.get("reduction", "mean"), False)
    result = TorchAdapter(strategy, "cuda", MEDIUM_SKIPPING).run(p, options, g_out, None)
    check_against_reference(result, reference(p, options, g_out, None), dtype, p.logit_scale)
    assert_skipped_ignored(skipping, p)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["mean", "none-classweights", "zloss-softcap-bias"])
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_cuda_jax_skipping_ignored_rows_matches_reference(jax_skipping, strategy, case):
    """JAX on the GPU: medium odd shapes in several row and column blocks (MEDIUM_SKIPPING), bf16
    (a call that skips rows keeps no logits: kept logits would hold every row)."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX with a CUDA GPU")
    options, problem_kwargs, _ = CASES[case]
    seed = seed_of("cuda-jax-skip", strategy, case)
    p = make_problem(seed, lead=(1000,), hidden=257, vocab=5003, dtype="bfloat16", ignore_frac=0.3, **problem_kwargs)
    g_out, _ = upstream_grads(seed, p, options.get("reduction", "mean"), False)
    result = JaxAdapter(strategy, MEDIUM_SKIPPING).run(p, options, g_out, None)
    check_against_reference(result, reference(p, options, g_out, None), "bfloat16", p.logit_scale)
    assert jax_skipping and all(keep is not None for keep in jax_skipping), "the call computed every row"


# Distillation: the cases whose rows are not all valid (a target with ignored rows, or a mask).
DISTILL_CASES = [key for key, (_, problem, *_) in distill_frameworks.CASES.items() if problem.get("target") or problem.get("mask")]


def check_distillation_skipping(monkeypatch, strategy, kind, name, dtype, device):
    import torch_impl.functional

    found, rows_to_compute = [], torch_impl.functional.rows_to_compute

    def spy(*args):
        found.append(rows_to_compute(*args))
        return found[-1]

    monkeypatch.setattr(torch_impl.functional, "rows_to_compute", spy)
    p, options, g, count, scale = distill_frameworks.case_inputs(kind, name, dtype)
    result = distill_frameworks.run("torch", strategy, p, options, g, count, device=device, tuning=SKIPPING)
    tol = tolerance(dtype, scale)
    for key, err in distill_frameworks.errors(result, distill_frameworks.reference(p, options, g, count)).items():
        assert err <= tol, f"{key}: relative error {err:.3g} > {tol:.3g}"
    assert len(found) == 1 and found[0] is not None and 0 < found[0].shape[0] < p.x.reshape(-1, p.x.shape[-1]).shape[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind, name", DISTILL_CASES)
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_distillation_skipping_invalid_rows_matches_reference(monkeypatch, strategy, kind, name, dtype):
    check_distillation_skipping(monkeypatch, strategy, kind, name, dtype, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind, name", DISTILL_CASES)
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_cuda_distillation_skipping_invalid_rows_matches_reference(monkeypatch, strategy, kind, name):
    check_distillation_skipping(monkeypatch, strategy, kind, name, "bfloat16", "cuda")
