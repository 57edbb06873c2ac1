"""The kernels on a CUDA GPU (marked `cuda`; run on the GPU machine with `pytest -m cuda`).

Medium odd shapes against the numpy float64 reference; large shapes (up to the L preset,
and one with N * V > 2**31) against the chunked path run in float64 on the GPU (itself
checked against the numpy reference by the CPU tests) and against torch eager in the
input dtype: the kernels' error must stay within 1.25x (speed) and 2x (memory) of eager's.
"""

from __future__ import annotations

import pytest
import torch

from interop.tuning import DEFAULT, Tuning
from tests.frameworks import (ALLOCATOR_SLACK, CASES, DTYPES, TorchAdapter, check_against_reference, make_problem,
                              reference, seed_of, tolerance, upstream_grads)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STRATEGIES = ("speed", "memory")


def _name(blocks) -> str:
    """The id of a Tuning of the `blocks` fixture (tests/conftest.py: the defaults, and small
    blocks so that the medium shapes span several row and column blocks), for seeds."""
    return "default-blocks" if blocks == DEFAULT else "small-blocks"


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kernels_match_reference(strategy, case, dtype, layout, blocks):
    """Medium odd shapes, each Tuning of `blocks`, against the float64 reference."""
    options, problem_kwargs, with_lse = CASES[case]
    lead = (3, 333) if problem_kwargs.get("lead") else (1000,)
    kwargs = {k: v for k, v in problem_kwargs.items() if k != "lead"}
    seed = seed_of(strategy, case, dtype, layout, _name(blocks))
    p = make_problem(seed, lead=lead, hidden=257, vocab=5003, dtype=dtype, weight_layout=layout, **kwargs)
    g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
    result = TorchAdapter(strategy, "cuda", blocks).run(p, options, g_out, g_lse)
    check_against_reference(result, reference(p, options, g_out, g_lse), dtype, p.logit_scale)


def _large_problem(n, d, v, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=gen).to(dtype)
    W = (torch.randn(v, d, device="cuda", generator=gen) / d**0.5).to(dtype)
    y = torch.randint(0, v, (n,), device="cuda", generator=gen)
    y[torch.rand(n, device="cuda", generator=gen) < 0.1] = -100
    return x, W, y


def _loss_and_grads(fn, x, W, y):
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    loss = fn(x, W, y)
    loss.backward()
    return loss.detach(), x.grad, W.grad


def _eager(x, W, y):
    return torch.nn.functional.cross_entropy(x @ W.T, y)


def _fp64_spec(x, W, y):
    import torch_impl

    return _loss_and_grads(lambda x, W, y: torch_impl.linear_cross_entropy(x, W, y, strategy="chunked"), x.double(), W.double(), y)


def _err(a, ref):
    return float((a.double() - ref).norm() / ref.norm())


@pytest.mark.alone
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", [(16384, 4096, 128256), (20000, 64, 128256)], ids=["L", "NV-over-2^31"])
def test_large_shapes_against_fp64_and_eager(strategy, shape):
    """L preset and N*V > 2**31 in bf16: the loss and both gradients against the fp64 spec,
    and no worse than torch eager bf16 beyond 1.25x (speed) and 2x (memory)."""
    import torch_impl

    n, d, v = shape
    x, W, y = _large_problem(n, d, v, torch.bfloat16)
    ref_loss, ref_dx, ref_dW = _fp64_spec(x, W, y)
    loss, dx, dW = _loss_and_grads(lambda x, W, y: torch_impl.linear_cross_entropy(x, W, y, strategy=strategy), x, W, y)
    assert dx.dtype == dW.dtype == torch.bfloat16
    tol = tolerance("bfloat16")
    assert _err(loss, ref_loss) <= 1e-4
    bound = {"speed": 1.25, "memory": 2.0}[strategy]
    if n * v <= 2**31:  # eager's logits fit: compare with it
        _, e_dx, e_dW = _loss_and_grads(_eager, x, W, y)
        assert _err(dx, ref_dx) <= bound * _err(e_dx, ref_dx), (_err(dx, ref_dx), _err(e_dx, ref_dx))
        assert _err(dW, ref_dW) <= bound * _err(e_dW, ref_dW), (_err(dW, ref_dW), _err(e_dW, ref_dW))
    assert _err(dx, ref_dx) <= tol and _err(dW, ref_dW) <= tol


@pytest.mark.parametrize("skip_ignored", [False, True], ids=["all-rows", "rows-not-ignored"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_target_raises(strategy, skip_ignored):
    """On the GPU the bad-target count reaches the host through pinned memory after the
    call's work is queued: the call still raises, naming the target, and a good call after
    it is right (nothing left behind)."""
    import torch_impl

    tuning = Tuning(skip_ignored_min_work=0) if skip_ignored else DEFAULT
    x, W, y = _large_problem(1000, 64, 5003, torch.bfloat16)
    bad = y.clone()
    bad[517] = 5003
    with pytest.raises(ValueError, match="target holds 5003"):
        torch_impl.linear_cross_entropy(x, W, bad, strategy=strategy, tuning=tuning)
    loss = torch_impl.linear_cross_entropy(x, W, y, strategy=strategy, tuning=tuning)
    assert _err(loss, _fp64_spec(x, W, y)[0]) <= 1e-4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_forward_only_does_no_gradient_work(strategy):
    """Without grad the call allocates no gradient buffers: its peak is the logits block of
    the forward-only plan and O(N) statistics, far below one grad_weight (V x D) here."""
    import torch_impl
    from torch_impl import head

    n, d, v = 4096, 1024, 32000
    x, W, y = _large_problem(n, d, v, torch.bfloat16)
    plan = head.plan(DEFAULT, "cross_entropy", strategy, n, d, v, torch.bfloat16, False, forward_only=True)
    block_bytes = plan.block_rows * plan.block_cols * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        loss = torch_impl.linear_cross_entropy(x, W, y, strategy=strategy)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < block_bytes + 64 * n + W.numel() * W.element_size() / 4, f"forward-only peak {peak / 2**20:.0f} MiB"
    assert _err(loss, _fp64_spec(x, W, y)[0]) <= 1e-4


@pytest.mark.alone
@pytest.mark.parametrize("shape", [(8192, 4096, 128256), (20000, 64, 128256)], ids=["8192x4096xL", "NV-over-2^31"])
def test_kept_logits_at_large_shapes_against_fp64_and_eager(monkeypatch, shape):
    """"speed" log-probabilities and entropy with the logits kept for the backward pass (one
    dz of every row, one product per gradient), in bf16: both gradients against the fp64
    spec, and no worse than eager bf16 logits (fp32 softmax) beyond 1.25x where those fit."""
    import torch.nn.functional as F

    import torch_impl
    import torch_impl.engine as engine

    n, d, v = shape
    x, W, y = _large_problem(n, d, v, torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    g_lp, g_h = torch.randn(2, n, device="cuda", generator=gen, dtype=torch.float64)
    kept, original = [], engine._backward_kept
    monkeypatch.setattr(engine, "_backward_kept", lambda *a: kept.append(tuple(a[2].z.shape)) or original(*a))

    def grads(fn, x, W):
        x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
        lp, h = fn(x, W)
        ((lp.double() * g_lp).sum() + (h.double() * g_h).sum()).backward()
        return x.grad, W.grad

    ours = grads(lambda x, W: torch_impl.linear_log_probs(x, W, y, return_entropy=True, strategy="speed"), x, W)
    assert kept == [(n, v)], kept
    ref = grads(lambda x, W: torch_impl.linear_log_probs(x, W, y, return_entropy=True, strategy="chunked"),
                x.double(), W.double())
    tol = tolerance("bfloat16")
    assert all(_err(a, r) <= tol for a, r in zip(ours, ref)), [_err(a, r) for a, r in zip(ours, ref)]
    if n * v <= 2**31:
        def eager(x, W):
            logp = F.log_softmax((x @ W.T).float(), dim=-1)
            return torch.where(y >= 0, logp.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0), -(logp.exp() * logp).sum(-1)

        naive = grads(eager, x, W)
        for a, e, r in zip(ours, naive, ref):
            assert _err(a, r) <= 1.25 * _err(e, r), (_err(a, r), _err(e, r))


def test_speed_peak_is_two_weights_plus_one_block():
    """"speed" holds an fp32 grad_weight (2 W for a bf16 W) and one logits block; its
    conversion to bf16 writes into the first slab's storage, so the fwd+bwd peak stays
    below 2 W + block + dx + O(N) (one fp32 tensor would need 3 W + dx)."""
    import torch_impl
    from interop.blocking import weight_grad_slabs
    from torch_impl import head

    n, d, v = 1024, 4096, 50000  # two row blocks (49 MiB each) well below W (400 MiB): 3 W would fail
    tuning = Tuning(speed_block_elements=512 * v, speed_min_rows=1, one_speed_block_share=0)
    x, W, y = _large_problem(n, d, v, torch.bfloat16)
    x.requires_grad_()
    W.requires_grad_()
    plan = head.plan(tuning, "cross_entropy", "speed", n, d, v, torch.bfloat16, False)
    edges = weight_grad_slabs(tuning, v, d * 4, True)
    w_bytes, slabs = W.numel() * 2, len(edges) - 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch_impl.linear_cross_entropy(x, W, y, strategy="speed", tuning=tuning).backward()
    peak = torch.cuda.max_memory_allocated() - base
    bound = 2 * w_bytes + plan.block_rows * plan.block_cols * 2 + x.numel() * 2 + 64 * n + ALLOCATOR_SLACK
    assert plan.block_rows < n and slabs > 1 and peak <= bound, f"peak {peak / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB ({slabs} slabs)"
    assert peak < 3 * w_bytes


def test_frozen_head_computes_no_weight_gradient():
    import torch_impl

    x, W, y = _large_problem(2048, 512, 32000, torch.bfloat16)
    x.requires_grad_()
    for strategy in STRATEGIES:
        torch_impl.linear_cross_entropy(x, W, y, strategy=strategy).backward()
        assert W.grad is None and x.grad is not None
        x.grad = None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jax_kernels_match_reference(strategy, case, dtype, blocks):
    from tests.frameworks import JaxAdapter

    options, problem_kwargs, with_lse = CASES[case]
    lead = (3, 333) if problem_kwargs.get("lead") else (1000,)
    kwargs = {k: v for k, v in problem_kwargs.items() if k != "lead"}
    seed = seed_of("jax", strategy, case, dtype, _name(blocks))
    p = make_problem(seed, lead=lead, hidden=257, vocab=5003, dtype=dtype, **kwargs)
    g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
    result = JaxAdapter(strategy, blocks).run(p, options, g_out, g_lse)
    check_against_reference(result, reference(p, options, g_out, g_lse), dtype, p.logit_scale)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", list(CASES))
def test_jax_kernel_blocks_match_reference(case, dtype):
    """JAX "memory" in blocks of rows and columns through `row_products`' kernels (the plan
    of heads too small for XLA's products, forced here with XLA's GEMM workspace counted as
    1 TiB): 1000 x 257 x 5003 in blocks of 64 or 128 rows x 512 columns (the last 395),
    against the float64 reference."""
    from tests.frameworks import JaxAdapter

    tuning = Tuning(xla_gemm_workspace=1 << 40, xla_row_bytes=0, min_block=64, xla_memory_cols=512)
    options, problem_kwargs, with_lse = CASES[case]
    lead = (3, 333) if problem_kwargs.get("lead") else (1000,)
    kwargs = {k: v for k, v in problem_kwargs.items() if k != "lead"}
    seed = seed_of("jax-kernel-blocks", case, dtype)
    p = make_problem(seed, lead=lead, hidden=257, vocab=5003, dtype=dtype, **kwargs)
    g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
    result = JaxAdapter("memory", tuning).run(p, options, g_out, g_lse)
    check_against_reference(result, reference(p, options, g_out, g_lse), dtype, p.logit_scale)


@pytest.mark.alone
@pytest.mark.parametrize("shape", [(16384, 4096, 128256), (8192, 2304, 256000), (4096, 1024, 32000),
                                   (16384, 2048, 128256)], ids=["L", "G", "S", "Llama-3.2-1B"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jax_large_shape_against_fp64_and_xla(strategy, shape):
    """L, G, S and Llama-3.2-1B's head in bf16 through jax_impl ("memory": L in XLA's whole
    rows, G in XLA's rows x columns, S and Llama-3.2-1B's head through `row_products`'
    kernels), on the same buffers as the torch fp64
    spec (DLPack); gradient errors within 1.25x (speed) and 2x (memory) of naive XLA's in bf16."""
    import jax
    import jax.numpy as jnp

    import jax_impl
    from interop.dlpack import to_jax, to_torch

    x, W, y = _large_problem(*shape, torch.bfloat16)
    ref_loss, ref_dx, ref_dW = _fp64_spec(x, W, y)
    xj, Wj, yj = to_jax(x), to_jax(W), to_jax(y.int())

    def naive(x, W, y):
        logp = jax.nn.log_softmax((x @ W.T).astype(jnp.float32), axis=-1)
        valid = y != -100
        return -jnp.where(valid, jnp.take_along_axis(logp, jnp.where(valid, y, 0)[:, None], 1)[:, 0], 0).sum() / valid.sum()

    ours = lambda x, W, y: jax_impl.linear_cross_entropy(x, W, y, strategy=strategy)
    errs = {}
    for name, fn in (("ours", ours), ("xla", naive)):
        loss, (dx, dW) = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(xj, Wj, yj)
        assert dx.dtype == dW.dtype == jnp.bfloat16
        errs[name] = (_err(to_torch(loss), ref_loss), _err(to_torch(dx), ref_dx), _err(to_torch(dW), ref_dW))
    bound = {"speed": 1.25, "memory": 2.0}[strategy]
    assert errs["ours"][0] <= 1e-4, errs
    assert errs["ours"][1] <= bound * errs["xla"][1] and errs["ours"][2] <= bound * errs["xla"][2], errs


def _jax_fwd_bwd_bytes(loss, *shapes) -> int:
    """What XLA's compiled jit(value_and_grad(loss)) over its first two arguments needs beyond
    its arguments (temporaries + outputs), compiled for arguments of these (shape, dtype)."""
    import jax

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    analysis = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes + analysis.output_size_in_bytes


@pytest.mark.alone
@pytest.mark.parametrize("return_lse", [False, True], ids=["loss", "loss-and-lse"])
@pytest.mark.parametrize("shape", [(16384, 4096, 128256), (8192, 2304, 256000), (8192, 3584, 151936),
                                   (4096, 1024, 32000), (4096, 768, 50257), (8192, 4096, 32000),
                                   (8192, 2048, 128256)],
                         ids=["L", "G", "Qwen2-7B", "S", "GPT-2", "Llama-2-7B", "Llama-3.2-1B"])
def test_jax_memory_strategy_within_its_bound(shape, return_lse):
    """JAX "memory" in bf16 with 10% of the targets ignored: what XLA's compiled fwd+bwd needs
    beyond its arguments (temporaries + outputs) stays within the memory-first bound, 1.10 x
    the gradients' bytes + 16 bytes a row, also when lse is returned (no rows skipped: the
    row loop ends in a smaller block, which XLA must not give a call of its own, nor a thin
    block a padded copy of W), and where blocks through `row_products`' kernels are the
    plan (S, GPT-2, Llama-2-7B: XLA's GEMM workspace is over a tenth of the gradients'
    bytes; Llama-3.2-1B's head: XLA's blocks would be thin)."""
    import jax.numpy as jnp

    import jax_impl

    n, d, v = shape
    y = jnp.where(jnp.arange(n) % 10 == 0, -100, jnp.arange(n) * 7919 % v).astype(jnp.int32)

    def loss(x, W):
        out = jax_impl.linear_cross_entropy(x, W, y, strategy="memory", return_lse=return_lse)
        return (out[0] + 0 * out[1].sum()) if return_lse else out

    needed = _jax_fwd_bwd_bytes(loss, ((n, d), jnp.bfloat16), ((v, d), jnp.bfloat16))
    floor = (n + v) * d * 2
    assert needed <= 1.10 * floor + 16 * n, f"{needed / floor:.3f} x the floor"


def test_jax_column_remainder_shares_the_loops_buffers():
    """JAX "memory" in blocks of 2816 rows x 2048 columns at G's N and D: a vocabulary that
    ends in a block of 1024 columns (254976 classes) needs no more of XLA's memory
    (temporaries + outputs) than one of 125 full blocks (256000 classes): the last column
    block runs in a loop of its own and shares the first loop's buffers (as a call of its
    own it held its own logits block, W slice and grad_weight share)."""
    import jax.numpy as jnp

    from interop.options import CrossEntropyOptions
    from jax_impl.blocked import BlockedConfig
    from jax_impl.cross_entropy_rule import blocked_linear_cross_entropy

    n, d = 8192, 2304
    cfg = BlockedConfig(CrossEntropyOptions("mean", -100, 0.0, 0.0, None), "VD", "memory", "tiles", 2816, 2048, True, True,
                        interpret=False, skip_ignored=False, fused_stats=True, tuning=DEFAULT)

    loss = lambda x, W, y: blocked_linear_cross_entropy(x, W, None, None, y, cfg)[0]
    needed = lambda v: _jax_fwd_bwd_bytes(loss, ((n, d), jnp.bfloat16), ((v, d), jnp.bfloat16), ((n,), jnp.int32))
    assert needed(254976) <= needed(256000)
