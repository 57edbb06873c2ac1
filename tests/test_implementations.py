"""Every implementation against the float64 reference, on the CPU.

torch-chunked and jax-chunked are the pure-framework paths; torch-speed and torch-memory
run the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1, set by conftest). The
implementations run with tests.frameworks.SMALL (several chunks / blocks at these small
sizes; the defaults would use one), the block planner's tests with the Tuning they name.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import dataclasses

from interop.tuning import DEFAULT
from tests.frameworks import (_NUMPY_DTYPE, CASES, DTYPES, SMALL, WHOLE_ROW_MEMORY, JaxAdapter, TorchAdapter,
                              check_against_reference, cpu_implementations, make_problem, reference, rel_err, round_to,
                              seed_of, tolerance, upstream_grads)

IMPLEMENTATIONS = cpu_implementations(SMALL)


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_matches_reference(impl, case, dtype, layout):
    options, problem_kwargs, with_lse = CASES[case]
    seed = seed_of(case, dtype, layout)
    p = make_problem(seed, dtype=dtype, weight_layout=layout, **problem_kwargs)
    g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
    result = IMPLEMENTATIONS[impl].run(p, options, g_out, g_lse)
    check_against_reference(result, reference(p, options, g_out, g_lse), dtype, p.logit_scale)
    assert {"grad_x", "grad_W"} <= result.keys() and ("grad_b" in result) == (p.b is not None)


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_classes_masked_by_minus_inf_bias(impl):
    """A bias of -inf masks classes (a common way to restrict the vocabulary): they add nothing
    to lse and get no gradient, also where a lane of the row statistics sees only masked
    classes for a while (the first classes) or after finite ones (every third class); V spans
    three column tiles of the row kernels' statistics."""
    options = dict(reduction="none", label_smoothing=0.0, z_loss=1e-3)
    p = make_problem(6, dtype="float32", bias=True, vocab=4500)
    masked = np.zeros(p.vocab, bool)
    masked[:7] = masked[::3] = True
    p.b[masked] = -np.inf
    p.y[np.isin(p.y, np.flatnonzero(masked))] = -100  # a masked class as the target has an infinite loss
    g_out, g_lse = upstream_grads(6, p, "none", True)
    result = IMPLEMENTATIONS[impl].run(p, options, g_out, g_lse)
    check_against_reference(result, reference(p, options, g_out, g_lse), "float32")
    assert np.all(result["grad_b"][masked] == 0)


@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_jax_kernels_with_x64_on(strategy):
    """With JAX's 64-bit mode on (common in scientific code) a loop over Python ints counts
    in int64; the kernels keep their indices in one integer type and match the reference."""
    import jax

    options = dict(label_smoothing=0.1, reduction="none")
    p = make_problem(5, dtype="float32", bias=True, class_weights=True)
    g_out, _ = upstream_grads(5, p, "none", False)
    with jax.enable_x64(True):
        result = IMPLEMENTATIONS[f"jax-{strategy}"].run(p, options, g_out, None)
    check_against_reference(result, reference(p, options, g_out, None), "float32")


@pytest.mark.parametrize("wrt", [("x",), ("W",), ("b",), ("x", "b")])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_only_some_inputs_require_grad(impl, wrt):
    p = make_problem(7, bias=True, class_weights=True)
    options = dict(label_smoothing=0.1)
    g_out, _ = upstream_grads(7, p, "mean", False)
    result = IMPLEMENTATIONS[impl].run(p, options, g_out, None, wrt=wrt)
    assert {k for k in result if k.startswith("grad_")} == {f"grad_{k}" for k in wrt}
    check_against_reference(result, reference(p, options, g_out, None), "float32")


@pytest.mark.parametrize("target_dtype", ["int32", "int64"])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_integer_target_dtypes(impl, target_dtype):
    """int64 labels reach JAX as int32 when x64 is off (its canonicalisation); both must work."""
    p = make_problem(11, vocab=53, dtype="bfloat16")
    g_out, _ = upstream_grads(11, p, "mean", False)
    result = IMPLEMENTATIONS[impl].run(p, {}, g_out, None, target_dtype=target_dtype)
    check_against_reference(result, reference(p, {}, g_out, None), "bfloat16")


def test_jax_without_jit_matches_reference():
    p = make_problem(5, lead=(3, 4), bias=True)
    options = dict(reduction="none", z_loss=1e-2)
    g_out, g_lse = upstream_grads(5, p, "none", True)
    result = IMPLEMENTATIONS["jax-chunked"].run(p, options, g_out, g_lse, jit=False)
    check_against_reference(result, reference(p, options, g_out, g_lse), "float32")


def test_torch_non_contiguous_inputs():
    import torch

    import torch_impl

    p = make_problem(3, lead=(6, 5), hidden=19, vocab=53, bias=True)
    x_big = torch.from_numpy(np.repeat(p.x, 2, axis=-1)).requires_grad_()  # [6, 5, 38]
    x = x_big[..., ::2]  # non-contiguous [6, 5, 19]
    W_DV = torch.from_numpy(p.W.T.copy()).requires_grad_()
    W = W_DV.T  # non-contiguous [V, D] view
    y = torch.from_numpy(np.stack([p.y, p.y], -1))[..., 0]  # non-contiguous targets
    b = torch.from_numpy(p.b).requires_grad_()
    assert not (x.is_contiguous() or W.is_contiguous() or y.is_contiguous())
    loss = torch_impl.linear_cross_entropy(x, W, y, linear_bias=b, label_smoothing=0.1, tuning=SMALL)
    loss.backward()
    ref = reference(p, dict(label_smoothing=0.1), 1.0, None)
    tol = tolerance("float32")
    assert rel_err(loss.detach().numpy(), ref.loss) <= tol
    assert rel_err(x_big.grad[..., ::2].numpy(), ref.grad_input) <= tol
    assert np.all(x_big.grad[..., 1::2].numpy() == 0)
    assert rel_err(W_DV.grad.T.numpy(), ref.grad_weight) <= tol
    assert rel_err(b.grad.numpy(), ref.grad_bias) <= tol


def test_torch_module_matches_function():
    import torch

    import torch_impl

    p = make_problem(4, class_weights=True)
    x, W, y = torch.from_numpy(p.x), torch.from_numpy(p.W), torch.from_numpy(p.y)
    cw = torch.from_numpy(p.cw)
    module = torch_impl.LinearCrossEntropyLoss(cw, reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=3.0,
                                               tuning=SMALL)
    expected = torch_impl.linear_cross_entropy(x, W, y, weight=cw, reduction="sum", label_smoothing=0.1, z_loss=1e-3,
                                               softcap=3.0, tuning=SMALL)
    assert torch.equal(module(x, W, y), expected)
    ref = reference(p, dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=3.0), 1.0, None)
    assert rel_err(module(x, W, y).numpy(), ref.loss) <= tolerance("float32")
    assert "softcap=3.0" in repr(module)


def test_torch_module_takes_every_option_of_the_function():
    import inspect

    import torch_impl

    function = set(inspect.signature(torch_impl.linear_cross_entropy).parameters) - {"input", "linear_weight", "target", "linear_bias"}
    module = set(inspect.signature(torch_impl.LinearCrossEntropyLoss).parameters)
    module |= set(inspect.signature(torch_impl.LinearCrossEntropyLoss.forward).parameters)  # per call: num_items_in_batch
    assert function <= module, f"missing from LinearCrossEntropyLoss: {sorted(function - module)}"
    assert "strategy='memory'" in repr(torch_impl.LinearCrossEntropyLoss(strategy="memory", filter_eps=2**-12))


def test_block_rules_split_these_problems():
    """The cases above run over several chunks / blocks (SMALL), the last ones partial."""
    import torch

    from interop.blocking import chunk_rows
    from torch_impl import head

    assert chunk_rows(SMALL, 13, 19, 53) == 5 and chunk_rows(SMALL, 14, 19, 53) == 6
    assert chunk_rows(SMALL, 0, 19, 53) == 1
    speed = head.plan(SMALL, "cross_entropy", "speed", 13, 19, 53, torch.float32, False)
    assert (speed.layout, speed.block_rows, speed.block_cols, speed.accumulate_dtype) == ("rows", 4, 53, torch.float32)
    memory = head.plan(SMALL, "cross_entropy", "memory", 13, 19, 53, torch.bfloat16, False)
    assert memory.layout == "tiles" and memory.block_rows == 4 and 4 <= memory.block_cols < 53 and 53 % memory.block_cols


def test_memory_takes_whole_rows_where_enough_fit():
    """interop.blocking.whole_row_memory_scratch (default tuning): L's "memory" in whole rows, its scratch plus
    the first block's row copies within 9.3% of the floor (the memory-first bound is
    10% + 16 bytes a row), blocks growing into grad_input's unwritten rows (800 rows first,
    352 near the end); G's in rows and columns; a call whose rows all fit in one block.
    JAX's fixed whole-row blocks: 250 rows at L, none at 8192 x 2048 x 128256 (60 would fit,
    thinner than Tuning.min_last_rows)."""
    import interop.blocking as blocking

    t = DEFAULT
    n_all, kept, D, V = 16384, 14746, 4096, 128256
    scratch = blocking.whole_row_memory_scratch(t, n_all, kept, D, V, 2, gathered_rows=True)
    sizes, left = [], kept
    while left:
        sizes.append(blocking.scratch_block_rows(t, left, D, V, scratch))
        assert sizes[-1] * V <= (left - sizes[-1]) * D + scratch, "a block's logits overflow the scratch"
        left -= sizes[-1]
    assert sizes[:2] == [800, 768] and min(sizes[:-1]) == 352 and len(sizes) == 27
    floor = (n_all + V) * D
    assert scratch + 2 * sizes[0] * D <= t.whole_row_fraction * floor < 0.1 * floor
    assert blocking.whole_row_memory_scratch(t, 8192, 8192, 2304, 256000, 2) is None
    assert blocking.jax_whole_row_block_rows(t, n_all, D, V, 2) == 250  # JAX: fixed blocks
    assert blocking.jax_whole_row_block_rows(t, 8192, 2048, V, 2) is None  # 60 rows: thinner than min_last_rows
    assert blocking.xla_memory_block_shape(t, 8192, 2304, 256000, 2) == (3712, 2048)  # JAX at G: 2 blocks of its kept rows
    assert blocking.whole_row_memory_scratch(t, 100, 100, 4096, V, 2) == 100 * V
    assert blocking.scratch_block_rows(t, 100, 4096, V, 100 * V) == 100


@pytest.mark.parametrize("n_rows, rows", [(8192, 227), (1000, 300), (16384, 250), (900, 300), (100, 100), (300, 120)])
def test_jax_whole_row_blocks_end_in_no_thin_block(n_rows, rows):
    """interop.blocking.without_a_thin_last_block: the most rows per block, at most `rows`,
    whose last block holds at least min(rows, Tuning.min_last_rows) rows (default tuning), or
    `rows` when none does."""
    from interop.blocking import without_a_thin_last_block

    r = without_a_thin_last_block(DEFAULT, n_rows, rows)
    fewest = min(rows, DEFAULT.min_last_rows)
    ends_well = lambda k: n_rows % k == 0 or n_rows % k >= fewest
    if not any(ends_well(k) for k in range(fewest, rows + 1)):
        assert r == rows  # (300, 120: no block of 120 rows ends well)
        return
    assert r <= rows and ends_well(r)
    assert not any(ends_well(k) for k in range(r + 1, rows + 1))


def test_whole_row_blocks_write_no_logits_over_grad_input_rows_still_needed():
    """HeadBlocks with a grad_input scratch (and `active` rows): each block's logits start
    after every row of grad_input that it or an earlier block writes and fit in the buffer;
    the first blocks are larger than the scratch alone holds."""
    import torch

    from torch_impl.head import BlockPlan, HeadBlocks

    n_all, D, V, scratch = 40, 7, 23, 3 * 23
    active = torch.tensor([0, 2, 3, 5, 8, 9, 13, 17, 18, 21, 22, 25, 30, 31, 33, 34, 38, 39])
    x, W = torch.zeros(n_all, D, dtype=torch.bfloat16), torch.zeros(V, D, dtype=torch.bfloat16)
    plan = BlockPlan("memory", "rows", 3, V, torch.bfloat16, grad_input_scratch=scratch)
    blocks = HeadBlocks(x, W, None, "VD", plan, active=active)
    dx, _, _, _ = blocks.gradient_buffers(True, False, False)
    base, end = dx.data_ptr(), dx.data_ptr() + (n_all * D + 64 + scratch) * 2
    sizes = []
    for rs in blocks.row_blocks():
        z = blocks.logits(rs, 0, V)
        written = int(active[: rs.stop].max()) + 1
        assert z.data_ptr() >= base + written * D * 2 and z.data_ptr() + z.numel() * 2 <= end
        sizes.append(rs.stop - rs.start)
    assert sum(sizes) == len(active) and sizes[0] > 3 and sizes[-1] <= 3


def test_memory_plans_in_whole_rows():
    """Both frameworks' "memory" plans where whole rows fit (tests.frameworks.WHOLE_ROW_MEMORY):
    blocks of whole rows (layout "rows") with grad_weight in the input dtype; PyTorch's with
    the scratch after grad_input, JAX's within the scratch."""
    import jax.numpy as jnp
    import torch

    from interop.options import CrossEntropyOptions
    from jax_impl.blocked import plan
    from torch_impl import head
    from torch_impl.head import BlockPlan

    t = WHOLE_ROW_MEMORY
    assert head.plan(t, "cross_entropy", "memory", 13, 19, 53, torch.float32, False) == BlockPlan("memory", "rows", 4, 53, torch.float32,
                                                                                   None, 238, t)
    cfg = plan(t, CrossEntropyOptions(), "VD", "memory", 13, 19, 53, jnp.bfloat16, False, False, "cpu")
    assert (cfg.strategy, cfg.layout, cfg.block_rows, cfg.block_cols, cfg.accumulate_in_input_dtype, cfg.tuning) == (
        "memory", "rows", 2, 53, True, t)
    fp32 = plan(t, CrossEntropyOptions(), "VD", "memory", 13, 19, 53, jnp.float32, False, False, "cpu")
    assert (fp32.layout, fp32.block_cols) == ("rows", 53)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("adapter", [TorchAdapter, JaxAdapter])
def test_memory_in_whole_rows_matches_reference(adapter, case, dtype):
    """"memory" where whole rows fit (WHOLE_ROW_MEMORY) runs blocks of whole rows with
    grad_weight in the input dtype (several row blocks here), against the float64 reference."""
    options, problem_kwargs, with_lse = CASES[case]
    seed = seed_of("whole-row-memory", case, dtype)
    p = make_problem(seed, dtype=dtype, **problem_kwargs)
    g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
    result = adapter("memory", tuning=WHOLE_ROW_MEMORY).run(p, options, g_out, g_lse)
    check_against_reference(result, reference(p, options, g_out, g_lse), dtype, p.logit_scale)


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_jax_memory_in_kernel_blocks_matches_reference(case, dtype, layout):
    """JAX "memory" for a head too small for XLA's products (SMALL, their GEMM workspace
    counted as 1 TiB here): blocks of 4 rows (13: 4, 4, 4, 1) x 8 columns (53: 6 x 8, then 5)
    through `row_products`' kernels, against the float64 reference."""
    import jax.numpy as jnp

    from interop.options import CrossEntropyOptions
    from jax_impl.blocked import plan

    itemsize = jnp.dtype(dtype).itemsize
    row_bytes = 8 * itemsize + 19 * (4 + itemsize)  # logits, fp32 grad_input accumulator, x
    t = dataclasses.replace(SMALL, xla_gemm_workspace=1 << 40,
                            whole_row_fraction=4.5 * row_bytes / ((13 + 53) * 19 * itemsize))
    cfg = plan(t, CrossEntropyOptions(), layout, "memory", 13, 19, 53, jnp.dtype(dtype), False, False, "cpu")
    assert (cfg.strategy, cfg.layout, cfg.kernel_products, cfg.block_rows, cfg.block_cols) == ("memory", "tiles", True, 4, 8)
    options, problem_kwargs, with_lse = CASES[case]
    seed = seed_of("kernel-blocks", case, dtype, layout)
    p = make_problem(seed, dtype=dtype, weight_layout=layout, **problem_kwargs)
    g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
    result = JaxAdapter("memory", t).run(p, options, g_out, g_lse)
    check_against_reference(result, reference(p, options, g_out, g_lse), dtype, p.logit_scale)


def test_jax_memory_plans_take_the_least_estimated_time():
    """interop.planning's JAX cross-entropy "memory" (default tuning): of whole rows, XLA's
    tiles and `row_products`' tiles within the budget, the plan of least
    `memory_plan_seconds`. S, GPT-2's and Llama-2-7B's heads (XLA's GEMM workspace alone is
    over a tenth of their gradients' bytes) and Llama-3.2-1B's head at 8192 and 16384 rows
    (XLA's tiles hold 256 and 384 rows, whole rows fewer than 128: on an H200 98.4 and 231
    ms against 38.7 and 77.9 through the kernels) take `row_products`' tiles; L and Q XLA's
    whole rows; G XLA's tiles; a head too small for even Tuning.min_block rows XLA's
    smallest blocks."""
    import jax.numpy as jnp

    from interop.options import CrossEntropyOptions
    from jax_impl.blocked import plan

    def planned(n, d, v):
        cfg = plan(DEFAULT, CrossEntropyOptions(), "VD", "memory", n, d, v, jnp.bfloat16, False, False, "gpu")
        assert cfg.strategy == "memory"
        return cfg.layout, cfg.kernel_products, cfg.block_rows, cfg.block_cols

    assert planned(4096, 1024, 32000) == ("tiles", True, 384, 2048)  # S
    assert planned(4096, 768, 50257) == ("tiles", True, 640, 2048)  # GPT-2
    assert planned(8192, 4096, 32000) == ("tiles", True, 896, 2048)  # Llama-2-7B
    assert planned(8192, 2048, 128256) == ("tiles", True, 2816, 2048)  # Llama-3.2-1B
    assert planned(16384, 2048, 128256) == ("tiles", True, 2816, 2048)
    assert planned(16384, 4096, 128256) == ("rows", False, 250, 128256)  # L: XLA's whole rows
    assert planned(4096, 4096, 128256) == ("rows", False, 233, 128256)  # Q
    assert planned(8192, 2304, 256000) == ("tiles", False, 3712, 2048)  # G
    assert planned(1024, 128, 16000) == ("tiles", False, 128, 2048)
    # whole rows recomputed in the backward pass (lse returned, or reduction "none") cost
    # 8 N D V as tiles do: XLA's tiles at L
    for options, lse in ((CrossEntropyOptions(), True), (CrossEntropyOptions(reduction="none"), False)):
        cfg = plan(DEFAULT, options, "VD", "memory", 16384, 4096, 128256, jnp.bfloat16, False, lse, "gpu")
        assert (cfg.layout, cfg.kernel_products, cfg.block_rows) == ("tiles", False, 1664)
    # fp32: the kernels' tiles (no tensor cores) only where XLA's do not fit
    cfg = plan(DEFAULT, CrossEntropyOptions(), "VD", "memory", 8192, 2048, 128256, jnp.float32, False, False, "gpu")
    assert not cfg.kernel_products


def test_jax_memory_plan_estimates():
    """interop.blocking.memory_plan_seconds (default tuning) orders the plans as measured on
    an H200 (bench/NOTES.md, 2026-11-28): at 8192 x 2048 x 128256 whole rows of 256 (30.4
    ms) < the kernels' tiles of 2816 (38.7) < whole rows of 128 (47.6) < XLA's tiles of 256
    (98.4); at G XLA's tiles of 3712 (65.7) < whole rows of 144 (93.9); and
    whole rows recomputed in the backward pass cost a third more products."""
    from interop.blocking import memory_plan_seconds

    def seconds(layout, kernel, rows, cols, n, d, v, forward=True):
        return memory_plan_seconds(DEFAULT, layout, kernel, rows, cols, n, d, v, 2, forward)

    h = (8192, 2048, 128256)
    order = [seconds("rows", False, 256, 128256, *h), seconds("tiles", True, 2816, 2048, *h),
             seconds("rows", False, 128, 128256, *h), seconds("tiles", False, 256, 2048, *h)]
    assert order == sorted(order)
    g = (8192, 2304, 256000)
    assert seconds("tiles", False, 3712, 2048, *g) < seconds("rows", False, 144, 256000, *g)
    assert seconds("rows", False, 256, 128256, *h, forward=False) > seconds("rows", False, 256, 128256, *h)


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_row_products_match_float64(dtype, layout):
    """`row_products`' kernels against float64 on the same (rounded) inputs: R = 37 rows, D =
    100, W's classes 300..813 of V = 1100 (C = 513), so every product has partial tiles and
    a partial last step, and reads or writes W's and grad_weight's classes at an offset
    (the other classes of grad_weight unchanged). Each output is fp32 products and sums
    (within 4 K eps32 sum_k |a_k b_k| of float64, K the contracted length) rounded once to
    the output dtype (eps of that dtype)."""
    import jax.numpy as jnp

    from jax_impl import row_products

    rng = np.random.default_rng(seed_of("row-products", dtype, layout))
    R, D, V, v0, C = 37, 100, 1100, 300, 513
    x = jnp.asarray(rng.standard_normal((R, D)), dtype)
    W = jnp.asarray(rng.standard_normal((V, D)) * 3 / D ** 0.5, dtype)
    dz = jnp.asarray(rng.standard_normal((R, C)) / C ** 0.5, dtype)
    dW = jnp.asarray(rng.standard_normal((V, D)), dtype)
    dx = jnp.asarray(rng.standard_normal((R, D)), jnp.float32)
    vd = layout == "VD"
    W_in, dW_in = (W, dW) if vd else (W.T, dW.T)
    x64, W64, dz64, dW64, dx64 = (np.asarray(a, np.float64) for a in (x, W, dz, dW, dx))
    W_c = W64[v0:v0 + C]
    eps32, eps = np.finfo(np.float32).eps, float(jnp.finfo(dtype).eps)
    added = row_products.add_grad_weight(dW_in, dz, x, jnp.int32(v0), vd, True)
    want_dW, tol_dW = dW64.copy(), np.zeros_like(dW64)
    want_dW[v0:v0 + C] += dz64.T @ x64
    tol_dW[v0:v0 + C] = 4 * R * eps32 * (np.abs(dW64[v0:v0 + C]) + np.abs(dz64).T @ np.abs(x64))
    checks = [
        ("logits", row_products.logits(x, W_in, v0, C, vd, True), x64 @ W_c.T,
         4 * D * eps32 * (np.abs(x64) @ np.abs(W_c).T), eps),
        ("add_grad_input", row_products.add_grad_input(dx, dz, W_in, v0, vd, True), dx64 + dz64 @ W_c,
         4 * C * eps32 * (np.abs(dx64) + np.abs(dz64) @ np.abs(W_c)), eps32),
        ("add_grad_weight", added if vd else added.T, want_dW, tol_dW, eps),
    ]
    for name, got, want, tol, out_eps in checks:
        assert got.shape == want.shape, name
        err = np.abs(np.asarray(got, np.float64) - want)
        bound = tol + out_eps * np.abs(want)
        assert np.all(err <= bound), f"{name}: max error over bound {(err / bound).max():.3g}"


@pytest.mark.parametrize("n_rows, block_rows", [(13, 4), (12, 4), (13, 13), (0, 1)])
def test_jax_row_loop_visits_each_row_once(n_rows, block_rows):
    """jax_impl.rows.row_loop: blocks of block_rows rows in order, the last one the
    remainder (no row twice, none padded), per-row outputs back in their rows."""
    import jax.numpy as jnp

    from jax_impl.rows import row_loop

    x = jnp.arange(n_rows * 3, dtype=jnp.float32).reshape(n_rows, 3)
    ids = jnp.arange(n_rows, dtype=jnp.int32)

    def row_step(carry, xs):
        x_R, ids_R = xs
        total, blocks = carry
        return (total + x_R.sum(), blocks + 1), (x_R * 2, ids_R + 100 * blocks)

    (total, blocks), (doubled, tagged) = row_loop(row_step, (jnp.float32(0), jnp.int32(0)), (x, ids), n_rows, block_rows)
    assert float(total) == float(x.sum()) and int(blocks) == -(-n_rows // block_rows)
    np.testing.assert_array_equal(np.asarray(doubled), 2 * np.asarray(x))
    np.testing.assert_array_equal(np.asarray(tagged), np.arange(n_rows) + 100 * (np.arange(n_rows) // block_rows))


def _jax_speed_temp_bytes(n: int, hidden: int, vocab: int, rows: int, return_lse: bool, skip: bool, y=None) -> int:
    """XLA's temporary bytes for a JAX fwd+bwd in whole-row blocks of `rows` (interpret mode),
    y: int32 [n] targets closed over as a constant, or None to pass them as an argument."""
    import jax
    import jax.numpy as jnp

    from interop.options import CrossEntropyOptions
    from jax_impl.blocked import BlockedConfig
    from jax_impl.cross_entropy_rule import blocked_linear_cross_entropy

    cfg = BlockedConfig(CrossEntropyOptions("mean", -100, 0.0, 0.0, None), "VD", "speed", "rows", rows, vocab, True,
                        return_lse, interpret=True, skip_ignored=skip, fused_stats=False, tuning=DEFAULT)
    args = [jax.ShapeDtypeStruct((n, hidden), jnp.bfloat16), jax.ShapeDtypeStruct((vocab, hidden), jnp.bfloat16)]
    if y is None:
        loss = lambda x, W, y: blocked_linear_cross_entropy(x, W, None, None, y, cfg)[0]
        args.append(jax.ShapeDtypeStruct((n,), jnp.int32))
    else:
        loss = lambda x, W: blocked_linear_cross_entropy(x, W, None, None, y, cfg)[0]
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("return_lse", [False, True])
def test_jax_remainder_block_shares_the_loops_buffers(return_lse):
    """A row loop's last, smaller block reuses the loop's temporaries: XLA's temporary bytes
    for 1000 rows in blocks of 300 (a remainder of 100) exceed those for 900 rows by less
    than half a logits block (as a call of its own, the remainder took a second block:
    on the H100, JAX "memory" with return_lse at L needed 1.99 x the floor)."""
    hidden, vocab, rows = 256, 8192, 300
    grown = (_jax_speed_temp_bytes(1000, hidden, vocab, rows, return_lse, skip=False)
             - _jax_speed_temp_bytes(900, hidden, vocab, rows, return_lse, skip=False))
    assert grown < rows * vocab * 2 / 2


def test_jax_constant_targets_need_no_more_memory():
    """Targets closed over as a constant (XLA then knows which rows are kept, and so each
    loop's trip count) take no more temporary bytes than targets passed as an argument:
    rows skipped, 990 of 1000 kept, blocks of 300, then 75, then the remainder of 25 (on the
    H100, JAX "memory" at L needed 1.97 x the floor with constant targets)."""
    import jax.numpy as jnp

    y = jnp.where(jnp.arange(1000) < 10, -100, jnp.arange(1000) * 37 % 8192).astype(jnp.int32)
    args = (1000, 256, 8192, 300, False, True)
    assert _jax_speed_temp_bytes(*args, y=y) <= _jax_speed_temp_bytes(*args) + 64 * 1000


def test_jax_rows_x_columns_blocks_take_the_most_rows_that_fit():
    """interop.blocking.xla_memory_block_shape (default tuning): as many rows as XLA's counted
    memory allows (rounded down to Tuning.min_block, then trimmed so the last block is not thin), not the rows
    spread evenly: G's 7395 rows not ignored (10% of 8192) take 2 row blocks, where 2816
    rows (even over 3 blocks) took 3; an empty call still gets a block of 1 row."""
    import math

    import interop.blocking as blocking

    t = DEFAULT
    for n, d in [(8192, 2304), (16384, 2304), (4096, 2304), (7500, 2304), (8192, 1536), (8192, 3072)]:
        fit, cols = blocking._xla_memory_rows(t, n, d, 256000, 2)
        rows, block_cols = blocking.xla_memory_block_shape(t, n, d, 256000, 2)
        assert block_cols == cols == 2048
        assert rows <= min(n, fit) and rows >= min(n, fit // 128 * 128) - t.min_last_rows, (n, d, fit, rows)
        assert n % rows == 0 or n % rows >= t.min_last_rows, (n, d, rows)
    rows = blocking.xla_memory_block_shape(t, 8192, 2304, 256000, 2)[0]
    assert math.ceil(7395 / rows) == 2 < math.ceil(7395 / blocking.even_rows(t, 8192, rows))
    assert blocking.xla_memory_block_shape(t, 0, 2304, 256000, 2)[0] == 1


def test_jax_memory_plan_and_fused_forward():
    """JAX "memory" at G in rows x columns: blocks of 3712 x 2048 (default tuning), and a
    forward pass from `fused_stats` (no column blocks of its own); "speed" takes whole rows
    and XLA's products in the forward pass too."""
    import jax.numpy as jnp

    from jax_impl.blocked import plan
    from interop.options import CrossEntropyOptions

    opts = CrossEntropyOptions("mean", -100, 0.0, 0.0, None)
    cfg = plan(DEFAULT, opts, "VD", "memory", 8192, 2304, 256000, jnp.bfloat16, False, False, "gpu")
    assert (cfg.strategy, cfg.layout, cfg.block_rows, cfg.block_cols, cfg.fused_stats) == ("memory", "tiles", 3712, 2048, True)
    speed = plan(DEFAULT, opts, "VD", "speed", 8192, 2304, 256000, jnp.bfloat16, False, False, "gpu")
    assert (speed.strategy, speed.layout, speed.block_cols, speed.fused_stats) == ("speed", "rows", 256000, False)


@pytest.mark.parametrize("case", ["mean", "everything-none-lse", "zloss-softcap-bias"])
def test_jax_memory_forward_forms_no_logits_block(case):
    """JAX "memory" (DV layout, rows x columns) gives the reference's loss, lse and
    gradients; its forward pass has no matrix product of XLA's (the fused kernel forms the
    logits tile by tile), its backward pass does."""
    import jax
    import jax.numpy as jnp

    import jax_impl

    options, problem_kwargs, with_lse = CASES[case]
    seed = seed_of(case, "float32", "DV")
    p = make_problem(seed, weight_layout="DV", **problem_kwargs)
    g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
    result = JaxAdapter("memory", SMALL).run(p, options, g_out, g_lse)
    check_against_reference(result, reference(p, options, g_out, g_lse), "float32", p.logit_scale)
    x, W, y = (jnp.asarray(a) for a in (p.x, p.W, p.y))
    loss = lambda x, W: jax_impl.linear_cross_entropy(x, W, y, weight_layout="DV", strategy="memory", tuning=SMALL).sum()
    products = lambda f: [e for e in _equations(jax.make_jaxpr(f)(x, W).jaxpr, into_kernels=False)
                          if e.primitive.name == "dot_general"]
    assert not products(loss)
    assert products(jax.grad(loss, argnums=(0, 1)))


_STATS_CASES = {"plain": (False, False, None, False), "bias-softcap": (True, False, 20.0, False),
                "smoothing-weights": (False, True, None, True), "everything": (True, True, 5.0, True)}


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("case", list(_STATS_CASES))
def test_fused_row_stats_match_float64(case, dtype, layout):
    """`fused_stats.row_stats` against float64 on the same (rounded) inputs: 300 rows (3 row
    tiles, the first 257 computed), D = 100 (a partial step of the product), V = 1100 in 2
    vocabulary splits of 3 and 2 tiles (about 4 programs), the last partial. It works in fp32 from exact
    inputs: each product is within 4 D eps32 sum_k |x_k w_k| of float64's, then rounded to
    the input dtype (one ulp of it where fp32's error moves the rounding), + 8 eps32 cap
    through the softcap; its sums over V add V eps32 of their terms' magnitude."""
    import jax.numpy as jnp

    import jax_impl.fused_stats as fused

    has_bias, has_cw, cap, need_ws = _STATS_CASES[case]
    rng = np.random.default_rng(seed_of("fused", case, dtype, layout))
    N, D, V, n = 300, 100, 1100, 257
    x = jnp.asarray(rng.standard_normal((N, D)), dtype)
    W = jnp.asarray(rng.standard_normal((V, D)) * 3 / D ** 0.5, dtype)
    b = jnp.asarray(rng.standard_normal(V), dtype) if has_bias else None
    cw = jnp.asarray(rng.random(V), jnp.float32) if has_cw else None
    y = rng.integers(0, V, N).astype(np.int32)
    stats = fused.row_stats(x, W if layout == "VD" else W.T, b, cw, jnp.asarray(y), n, layout, cap, need_ws, True,
                            programs=4)

    x64, W64 = np.asarray(x, np.float64), np.asarray(W, np.float64)
    eps = np.finfo(np.float32).eps
    z_tol = 4 * D * eps * (np.abs(x64) @ np.abs(W64).T + 1)
    z = x64 @ W64.T
    if dtype != "float32":  # the product is rounded to the input dtype, as the backward pass's logits
        z_tol = z_tol + float(ml_dtypes.finfo(_NUMPY_DTYPE[dtype]).eps) * np.abs(z)  # fp32's error may move one rounding
        z = round_to(z, dtype).astype(np.float64)
    z = z + (0 if b is None else np.asarray(b, np.float64))
    if cap is not None:
        z, z_tol = cap * np.tanh(z / cap), z_tol + 8 * eps * cap
    cw64 = np.ones(V) if cw is None else np.asarray(cw, np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    want = (lse, z[np.arange(N), y], (z * cw64).sum(1) if need_ws else np.zeros(N))
    tols = (z_tol.max(1) + V * eps, z_tol[np.arange(N), y], ((z_tol + V * eps * np.abs(z)) * cw64).sum(1))
    for name, got, ref, tol in zip(("lse", "s_y", "ws"), stats, want, tols):
        got = np.asarray(got, np.float64)
        assert np.all(got[n:] == 0), name
        err = np.abs(got[:n] - ref[:n])
        assert np.all(err <= tol[:n]), f"{name}: max error {err.max():.3g}, tolerance {tol[:n].min():.3g}"


def _equations(jaxpr, into_kernels: bool = True):
    """The equations of jaxpr and of its sub-jaxprs (loops, custom_vjp rules, pjit calls;
    Pallas kernels' bodies unless into_kernels is False)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name == "pallas_call" and not into_kernels:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner, into_kernels)


def _column_sums(jaxpr, n_rows: int) -> int:
    """reduce_sum equations over axis 0 of an [n_rows, C] operand in jaxpr."""
    return sum(e.primitive.name == "reduce_sum" and e.params["axes"] == (0,) and len(e.invars[0].aval.shape) == 2
               and e.invars[0].aval.shape[0] == n_rows for e in _equations(jaxpr))


@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
def test_jax_sums_dz_columns_only_for_a_bias(strategy):
    """grad_bias is dz's column sum: without a bias no path computes it (it cost JAX's "memory"
    a reduction of every block, 4 ms at G on an H100); with one, the same trace has it."""
    import jax
    import jax.numpy as jnp

    import jax_impl

    p = make_problem(5, lead=(12,), bias=True)
    x, W, b, y = (jnp.asarray(a) for a in (p.x, p.W, p.b, p.y))
    rows = 4  # SMALL's blocks (chunked: 5 rows)
    loss = lambda x, W, b: jax_impl.linear_cross_entropy(x, W, y, linear_bias=b, strategy=strategy, tuning=SMALL)
    n = 5 if strategy == "chunked" else rows
    with_bias = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, W, b).jaxpr
    without = jax.make_jaxpr(jax.grad(lambda x, W: loss(x, W, None), argnums=(0, 1)))(x, W).jaxpr
    assert _column_sums(with_bias, n) >= 1
    assert _column_sums(without, n) == 0


def test_speed_blocks_grow_with_a_16_bit_accumulator():
    """"speed" blocks take Tuning.narrow_speed_block_growth x the logits when grad_weight is
    accumulated in a 16-bit input dtype with one logits buffer and the head is large enough
    for the saved bytes to pay for it, and only then."""
    from interop.blocking import block_shape

    t = SMALL
    n, d, v = 10**6, 100, 5  # SMALL's block sizes: 265 logits, rows in multiples of 4
    rows = lambda elements: elements // v // t.min_block * t.min_block
    wide = rows(t.speed_block_elements)
    assert block_shape(t, "speed", n, d, v, 2)[0] == wide
    narrow = block_shape(t, "speed", n, d, v, 2, narrow_accumulator=True)[0]
    assert narrow == rows(int(t.speed_block_elements * t.narrow_speed_block_growth)) > wide
    assert block_shape(t, "speed", n, d, v, 4, narrow_accumulator=True)[0] == wide
    assert block_shape(t, "speed", n, d, v, 2, buffers=2, narrow_accumulator=True)[0] == wide
    small_head = 13  # 5 x 13 x 2 bytes saved < the 265 bytes the growth would take
    assert block_shape(t, "speed", n, small_head, v, 2, narrow_accumulator=True)[0] == wide


def test_speed_takes_one_block_where_it_holds_no_more_than_several():
    """"speed" takes all rows in one block (which needs no grad_weight accumulator) exactly
    where their logits take no more bytes than one block of several and the fp32 accumulator:
    8192 x 4096 x 128256 (2 GiB against 1 + 2), not L, G or RL. An accumulator in the
    input dtype (or fp32 inputs) is grad_weight itself: several blocks then hold one block
    only. one_speed_block_share=0 keeps several blocks."""
    import dataclasses

    from interop.blocking import block_shape, one_speed_block

    t = DEFAULT
    speed = lambda n, d, v, itemsize=2, **kw: block_shape(t, "speed", n, d, v, itemsize, **kw)[0]
    assert speed(4096, 4096, 128256) == 4096 and speed(8192, 4096, 128256) == 8192
    assert speed(16384, 4096, 128256) == 4096 and speed(8192, 2304, 256000) == 2048
    assert speed(32768, 4096, 151936) == 3456
    for n, d, v, itemsize in [(4096, 4096, 128256, 2), (16384, 4096, 128256, 2), (8192, 2304, 256000, 2),
                              (12000, 4096, 128256, 2), (4000, 1024, 32000, 4), (100000, 1024, 32000, 4)]:
        several = block_shape(dataclasses.replace(t, one_speed_block_share=0), "speed", n, d, v, itemsize)[0]
        held = several * v * itemsize + (v * d * 4 if itemsize < 4 else 0)
        assert one_speed_block(t, n, d, v, itemsize) == (n * v * itemsize <= held) == (speed(n, d, v, itemsize) == n)
    # 10240 rows of L: 2.6 GB of logits, within one block and an fp32 accumulator; with the
    # accumulator in bf16 (grad_weight itself) or fp32 inputs, several blocks hold one block only
    assert speed(10240, 4096, 128256) == 10240 and speed(10240, 4096, 128256, narrow_accumulator=True) < 10240
    assert speed(8192, 4096, 128256, narrow_accumulator=True, narrow_grows=False) == 4096
    assert speed(8192, 4096, 128256, 4) == 4096
    assert block_shape(dataclasses.replace(t, one_speed_block_share=0), "speed", 8192, 4096, 128256, 2)[0] == 4096
    # PyTorch's gradient filter adds grad_weight in parts into an accumulator: several blocks
    import torch

    from torch_impl import head

    q = lambda **kw: head.plan(t, "cross_entropy", "speed", 8192, 4096, 128256, torch.bfloat16, False, **kw).block_rows
    assert q() == 8192 and q(filter_eps=1e-6) == 4096


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["formed-in-forward", "recomputed"])
def test_jax_one_speed_block_makes_grad_weight_in_its_dtype(return_lse, layout):
    """JAX "speed" in one row block makes grad_weight by one product in W's dtype (bf16), with
    no fp32 [V, D] accumulator to convert, whether the forward pass forms the gradients or
    the backward pass recomputes (lse returned); in several row blocks it accumulates in fp32."""
    import jax
    import jax.numpy as jnp

    from interop.options import CrossEntropyOptions
    from jax_impl.blocked import BlockedConfig
    from jax_impl.cross_entropy_rule import blocked_linear_cross_entropy

    n, hidden, vocab = 64, 48, 256  # no other product is [D, V]

    def weight_products(rows):  # dtypes of the [V, D] products of a fwd+bwd in blocks of `rows`
        cfg = BlockedConfig(CrossEntropyOptions("mean", -100, 0.0, 0.0, None), layout, "speed", "rows", rows, vocab,
                            False, return_lse, interpret=True, skip_ignored=False, fused_stats=False, tuning=DEFAULT)
        loss = lambda x, W, y: sum(o.sum() for o in blocked_linear_cross_entropy(x, W, None, None, y, cfg)[:2] if o is not None)
        w_shape = (vocab, hidden) if layout == "VD" else (hidden, vocab)
        args = (jnp.zeros((n, hidden), jnp.bfloat16), jnp.zeros(w_shape, jnp.bfloat16), jnp.zeros(n, jnp.int32))
        found = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "dot_general" and eqn.outvars[0].aval.shape == w_shape:
                    found.append(eqn.outvars[0].aval.dtype)
                for param in eqn.params.values():
                    for sub in param if isinstance(param, (list, tuple)) else [param]:
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            walk(inner)

        walk(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args).jaxpr)
        return found

    assert weight_products(n) == [jnp.bfloat16]
    assert weight_products(32) == [jnp.float32]


def test_jax_partial_grad_weight_stays_in_its_accumulators_dtype():
    """A device's grad_weight over its share of rows split across devices (`Head.split_rows`)
    accumulates in fp32, in one row block too, so the sum over devices rounds once; a whole
    call's in one block is W's dtype (bf16)."""
    import jax.numpy as jnp

    from jax_impl import engine
    from jax_impl.head import Head
    from jax_impl.partitioned import Axes

    x, W = jnp.zeros((8, 4), jnp.bfloat16), jnp.zeros((16, 4), jnp.bfloat16)
    for rows, dtype in ((None, jnp.bfloat16), (Axes(("dp",)), jnp.float32)):
        dW, _ = engine._buffers(Head(x, W, None, "VD", 16, split_rows=rows), jnp.float32, False, 8)
        assert dW.dtype == dtype, (rows, dW.dtype)


def test_forward_only_speed_blocks_take_the_accumulators_bytes():
    """A call without gradients holds no grad_weight accumulator: "speed" blocks then take
    what "speed" holds beyond the gradients (fp32 grad_weight + one block), spread evenly
    over the fewest blocks, whole multiples of Tuning.min_block rows (the default tuning here)."""
    import torch

    import interop.blocking as blocking
    from torch_impl import head

    t = DEFAULT
    assert t.min_block == 128
    assert blocking.forward_only_rows(t, 7373, 2304, 256000, 2) == 3712  # G's rows not ignored: 2 blocks (of 2048 rows: 4)
    assert blocking.forward_only_rows(t, 14746, 4096, 128256, 2) == 7424  # L's: 2 blocks (of 4096 rows: 4)
    assert blocking.forward_only_rows(t, 100, 4096, 128256, 2) == 100
    for n, d, v, itemsize in [(7373, 2304, 256000, 2), (50000, 4096, 128256, 2), (50000, 1024, 32000, 4)]:
        rows = blocking.forward_only_rows(t, n, d, v, itemsize)
        assert rows % t.min_block == 0 and rows * v * itemsize <= blocking.speed_extra_bytes(t, n, d, v, itemsize)
        assert -(-n // rows) == -(-n * v * itemsize // blocking.speed_extra_bytes(t, n, d, v, itemsize))
        assert -(-n // rows) <= -(-n // blocking.block_shape(t, "speed", n, d, v, itemsize)[0])  # never more blocks
    for n, most in [(8192, 3156), (8192, 3000), (100, 3156), (5, 2), (0, 300)]:
        rows = blocking.even_rows(t, n, most)  # the fewest blocks of at most `most` (rounded down to 128) rows, even
        blocks = -(-n // rows) if n else 0
        assert rows <= max(n, 1) and (rows % 128 == 0 or rows == n or n == 0)
        assert blocks == (-(-n // max(128, most // 128 * 128)) if n else 0) and (not n or n - (blocks - 1) * rows > 0)
    assert blocking.even_rows(t, 8192, 3156) == 2816 and blocking.even_rows(t, 8192, 3000) == 2816
    speed = head.plan(t, "cross_entropy", "speed", 7373, 2304, 256000, torch.bfloat16, False, forward_only=True)
    assert (speed.block_rows, speed.block_cols) == (3712, 256000)
    memory = head.plan(t, "cross_entropy", "memory", 7373, 2304, 256000, torch.bfloat16, False, forward_only=True)
    assert memory == head.plan(t, "cross_entropy", "memory", 7373, 2304, 256000, torch.bfloat16, False)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("case", ["mean", "everything-none-lse", "custom-ignore-index"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_only_speed_in_larger_blocks_matches_reference(monkeypatch, dtype, case, skip):
    """Without gradients, "speed" runs the forward-only plan (several blocks here, fewer and
    larger than with gradients; SMALL), with and without skipping ignored rows; loss and lse
    match the float64 reference."""
    import torch

    from torch_impl import head

    t = dataclasses.replace(SMALL, skip_ignored_min_work=0) if skip else SMALL
    plans = []
    planner = head.plan
    monkeypatch.setattr(head, "plan", lambda *a, **k: plans.append(planner(*a, **k)) or plans[-1])
    options, problem_kwargs, with_lse = CASES[case]
    seed = seed_of(case, dtype, "VD")
    p = make_problem(seed, lead=(61,), dtype=dtype, **problem_kwargs)
    adapter = TorchAdapter("speed", tuning=t)
    with torch.no_grad():
        out = adapter.call(p.x, p.W, p.y, linear_bias=p.b, weight=p.cw, return_lse=with_lse, **options)
    loss, lse = out if with_lse else (out, None)
    n_rows = 61 if not skip or case == "everything-none-lse" else int((p.y != options.get("ignore_index", -100)).sum())
    with_grads = planner(t, "cross_entropy", "speed", n_rows, 19, 53, adapter.dtypes[dtype], False)
    assert 1 < -(-n_rows // plans[-1].block_rows) < -(-n_rows // with_grads.block_rows)
    ref = reference(p, options, upstream_grads(seed, p, options.get("reduction", "mean"), False)[0], None)
    check_against_reference({"loss": loss.double().numpy(), **({"lse": lse.double().numpy()} if with_lse else {})},
                            ref, dtype, p.logit_scale)


def test_forward_only_plan_when_no_input_needs_a_gradient(monkeypatch):
    """linear_cross_entropy plans forward-only blocks exactly when no input needs a gradient."""
    import torch

    import torch_impl
    from torch_impl import head

    flags = []
    planner = head.plan
    monkeypatch.setattr(head, "plan", lambda *a, **k: flags.append(k["forward_only"]) or planner(*a, **k))
    p = make_problem(3)
    x, W, y = (torch.from_numpy(a) for a in (p.x, p.W, p.y))
    torch_impl.linear_cross_entropy(x, W, y, strategy="speed")
    torch_impl.linear_cross_entropy(x, W.requires_grad_(), y, strategy="speed")
    with torch.no_grad():
        torch_impl.linear_cross_entropy(x, W, y, strategy="speed")
    assert flags == [True, False, True]


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_accumulate_in_input_dtype(impl):
    """Still within the dtype's tolerance here (few blocks), and the gradient keeps W's dtype."""
    p = make_problem(21, dtype="bfloat16", bias=True)
    g_out, _ = upstream_grads(21, p, "sum", False)
    adapter = IMPLEMENTATIONS[impl]
    result = adapter.run(p, dict(reduction="sum", accumulate_in_input_dtype=True), g_out, None)
    check_against_reference(result, reference(p, dict(reduction="sum"), g_out, None), "bfloat16")



@pytest.mark.parametrize("blocks", [
    [(0, 53), (3, 11), (14, 25), (40, 13), (52, 1)],  # a whole first block, then parts
    [(3, 11), (14, 25), (0, 53), (52, 1)],  # parts first
    [(0, 5), (2, 7)],  # the second slab never touched (VD)
], ids=["whole-first", "parts-first", "untouched"])
@pytest.mark.parametrize("layout", ["VD", "DV"])
def test_weight_grad_slabs_add_column_blocks_anywhere(layout, blocks):
    """An fp32 grad_weight accumulator of a bf16 W is two slabs along W's first dimension
    (allocated uninitialised; SMALL: VD classes 0..26 and 26..53, DV hidden rows 0..9 and
    9..19); column blocks that straddle the edge land in the right classes, and the result
    has W's dtype and layout, is the tensor whose storage held the first slab, and equals the
    float64 sum in every value to bf16's rounding (an fp32 sum rounded once; zeros where no
    block went)."""
    import torch

    from torch_impl.head import WeightGrad

    torch.manual_seed(3)
    V, D, R = 53, 19, 7
    acc = WeightGrad(torch.zeros((V, D) if layout == "VD" else (D, V), dtype=torch.bfloat16), layout, torch.float32, SMALL)
    assert len(acc.slabs) == 2 and acc.starts == ([0, 26, 53] if layout == "VD" else [0, 9, 19])
    storage = acc.slabs[0].untyped_storage().data_ptr()
    expected = torch.zeros(V, D, dtype=torch.float64)
    for v0, cols in blocks:
        dz, x = torch.randn(R, cols).bfloat16(), torch.randn(R, D).bfloat16()
        acc.add_(dz, x, v0)
        expected[v0 : v0 + cols] += dz.double().T @ x.double()
    got = acc.result()
    assert got.dtype == torch.bfloat16 and got.shape == ((V, D) if layout == "VD" else (D, V)) and acc.slabs == []
    assert got.untyped_storage().data_ptr() == storage and got.is_contiguous()
    got = got if layout == "VD" else got.T
    torch.testing.assert_close(got.double(), expected, rtol=2.0**-8, atol=1e-6 * expected.abs().max().item())
    assert torch.equal(got[expected.abs().sum(1) == 0], torch.zeros_like(got[expected.abs().sum(1) == 0]))


@pytest.mark.parametrize("n", [1, 2, 3, 63, 64, 65, 127, 1000, 4099])
def test_narrow_in_place_converts_every_value(n):
    """fp32 values converted to bf16 over their own storage's first half equal a plain
    conversion, at sizes where the first chunk and the doubling ones end anywhere."""
    import torch

    from torch_impl.head import narrow_in_place

    wide = torch.randn(n) * torch.logspace(-30, 30, n)
    expected = wide.to(torch.bfloat16)
    narrow = wide.view(torch.bfloat16)[:n]
    narrow_in_place(wide, narrow)
    assert torch.equal(narrow, expected)


def test_weight_grad_slab_edges():
    """Two slabs only for a wide accumulator whose halves take at least
    Tuning.weight_grad_slab_bytes each (the default tuning); the first holds at most half
    the rows (its storage takes grad_weight in W's dtype); the edge aligned."""
    from interop.blocking import weight_grad_slabs

    t = DEFAULT
    assert weight_grad_slabs(t, 128256, 4096 * 2, False) == [0, 128256]
    assert weight_grad_slabs(t, 128256, 4096 * 4, True) == [0, 64000, 128256]  # L: 2 GiB
    assert weight_grad_slabs(t, 256000, 2304 * 4, True) == [0, 128000, 256000]  # G
    assert weight_grad_slabs(t, 2304, 256000 * 4, True) == [0, 1024, 2304]  # G's [D, V] W
    assert weight_grad_slabs(t, 32000, 1024 * 4, True) == [0, 32000]  # S: one product
    assert weight_grad_slabs(t, 300, 1 << 30, True) == [0, 300]  # less than two aligned halves


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_speed_keeps_the_logits_where_the_backward_pass_would_recompute(monkeypatch, dtype):
    """Where "speed"'s logits take at most Tuning.keep_logits_share of the free memory and
    the backward pass would recompute them (lse returned, or a loss per row), JAX's forward
    pass keeps them and the backward pass turns them into dz in place
    (`jax_impl.engine.backward_kept`), in one block of every row where "speed" takes row
    blocks of 4 (SMALL) and one block: the float64 reference in every case. A reduced loss
    without lse forms its gradients in the forward pass and keeps nothing, nor does a call
    that nothing differentiates."""
    import jax
    import jax.numpy as jnp

    import jax_impl
    import jax_impl.engine as engine
    from jax_impl import partitioned
    from jax_impl.cross_entropy_rule import _CrossEntropyRule

    jax.clear_caches()  # the spies see traces: none cached by earlier calls
    partitioned._with_vmap.cache_clear()
    kept, spent = [], []
    forward, backward = engine.forward, engine.backward_kept
    monkeypatch.setattr(engine, "forward", lambda *a, **k: kept.append(a[9] if len(a) > 9 else k.get("keep_logits"))
                        or forward(*a, **k))
    monkeypatch.setattr(engine, "backward_kept", lambda *a, **k: spent.append(a[3].shape) or backward(*a, **k))
    monkeypatch.setattr(engine, "free_bytes", lambda platform: 1 << 40)
    blocks = []  # the logits blocks the rule's steps see
    for step in ("stats", "grad"):
        original = getattr(_CrossEntropyRule, step)
        monkeypatch.setattr(_CrossEntropyRule, step, lambda self, z, *a, _f=original: blocks.append(z.shape) or _f(self, z, *a))
    for tuning in (SMALL, dataclasses.replace(SMALL, speed_block_elements=1 << 20)):
        for case, (options, problem_kwargs, with_lse) in CASES.items():
            seed = seed_of("kept-logits", case, dtype)
            p = make_problem(seed, dtype=dtype, **problem_kwargs)
            g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
            spent.clear()
            blocks.clear()
            result = JaxAdapter("speed", tuning).run(p, options, g_out, g_lse)
            recomputes = with_lse or options.get("reduction") == "none"
            assert spent == ([(p.y.size, p.vocab)] if recomputes else []), (case, spent)
            if recomputes:
                assert set(blocks) == {(p.y.size, p.vocab)}, (case, blocks)
            check_against_reference(result, reference(p, options, g_out, g_lse), dtype, p.logit_scale)
    p = make_problem(3, dtype=dtype)
    kept.clear()
    jax.jit(lambda x, W: jax_impl.linear_cross_entropy(x, W, jnp.asarray(p.y.astype(np.int32)), reduction="none",
                                                       strategy="speed", tuning=SMALL))(jnp.asarray(p.x), jnp.asarray(p.W))
    assert kept and not any(kept), kept


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_whole_rows_take_the_fused_kernel_where_the_forward_pass_forms_the_gradients(monkeypatch, dtype):
    """Where JAX's forward pass forms the gradients in blocks of whole rows ("speed" and
    whole-row "memory" with a reduced loss and no lse), each block's statistics and dz come
    from one kernel (`kernels.rows_stats_grad`), not from the statistics and gradient
    steps, in row blocks of 4 (SMALL) and in one block: the float64 reference in every case
    (bias, class weights, label smoothing, z-loss, softcap, ignored and out-of-range rows)."""
    import jax

    from jax_impl import partitioned
    from jax_impl.cross_entropy_rule import _CrossEntropyRule
    from jax_impl.steps import KernelOps

    jax.clear_caches()  # the spies see traces: none cached by earlier calls
    partitioned._with_vmap.cache_clear()
    fused, steps = [], []
    original = KernelOps.rows_stats_grad
    monkeypatch.setattr(KernelOps, "rows_stats_grad", lambda self, z, *a: fused.append(z.shape) or original(self, z, *a))
    for step in ("stats", "grad"):
        f = getattr(_CrossEntropyRule, step)
        monkeypatch.setattr(_CrossEntropyRule, step, lambda self, z, *a, _f=f: steps.append(z.shape) or _f(self, z, *a))
    runs = [("speed", SMALL), ("speed", dataclasses.replace(SMALL, speed_block_elements=1 << 20)), ("memory", WHOLE_ROW_MEMORY)]
    for strategy, tuning in runs:
        for case, (options, problem_kwargs, with_lse) in CASES.items():
            if with_lse or options.get("reduction") == "none":
                continue
            seed = seed_of("fused-rows", strategy, case, dtype)
            p = make_problem(seed, dtype=dtype, **problem_kwargs)
            g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
            fused.clear()
            steps.clear()
            result = JaxAdapter(strategy, tuning).run(p, options, g_out, g_lse)
            assert fused and not steps, (strategy, case, fused, steps)
            assert all(shape[1] == p.vocab for shape in fused), (strategy, case, fused)
            check_against_reference(result, reference(p, options, g_out, g_lse), dtype, p.logit_scale)


def test_jax_fused_kernel_gives_the_steps_numbers_with_an_out_of_range_target(monkeypatch):
    """A reduced loss under jit with one target >= V (the loss NaN, that row's grad_input and
    every grad_weight entry NaN) beside ignored rows: the fused whole-row kernel gives the
    statistics and gradient steps' numbers, NaN where they are NaN."""
    import jax
    import jax.numpy as jnp

    import jax_impl
    from jax_impl.steps import KernelOps

    p = make_problem(11, dtype="float32")
    y = p.y.astype(np.int32)
    y[3] = p.vocab
    assert (y == -100).any()

    def run():
        jax.clear_caches()
        loss = lambda x, W: jax_impl.linear_cross_entropy(x, W, jnp.asarray(y), strategy="speed", tuning=SMALL)
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(jnp.asarray(p.x), jnp.asarray(p.W))
        return [np.asarray(a) for a in (value, *grads)]

    fused = run()
    monkeypatch.setattr(KernelOps, "rows_stats_grad", None)
    steps = run()
    loss, dx, dW = fused
    assert np.isnan(loss) and np.isnan(dx[3]).all() and np.isnan(dW).all()
    assert np.isfinite(np.delete(dx, 3, axis=0)).all()
    for a, b in zip(fused, steps):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)
