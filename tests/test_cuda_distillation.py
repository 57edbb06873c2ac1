"""The distillation losses on a CUDA GPU (marked `cuda`): both frameworks' kernels, medium
odd shapes spanning several row and column blocks, against the float64 reference, and the
torch-JAX parity on the same inputs."""

from __future__ import annotations

import zlib

import pytest
import torch

from interop.tuning import Tuning
from tests.distill_frameworks import CASES, errors, make_problem, reference, run
from tests.frameworks import ALLOCATOR_SLACK, rel_err, tolerance

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind, name", list(CASES))
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_kernels_match_reference(strategy, kind, name, dtype, blocks):
    """Each Tuning of `blocks` (tests/conftest.py: the defaults, and small blocks)."""
    options, problem, *count = CASES[(kind, name)]
    count = count[0] if count else None
    seed = zlib.crc32(f"cuda{kind}{name}{dtype}".encode())
    problem = {k: v for k, v in problem.items() if k not in ("lead", "teacher_vocab")}
    if kind == "dense" and "teacher" in name:
        problem["teacher_vocab"] = 5003 + (40 if "bigger" in name else -40)
    p = make_problem(kind, seed, lead=(1000,), hidden=160, vocab=5003, k=32, dtype=dtype, **problem)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(seed)).numpy() if options.get("reduction") == "none" else 1.3
    ref = reference(p, options, g, count)
    scale = (1.5 if kind == "dense" else 1.0) / min(1.0, options.get("temperature", 1.0))
    tol = tolerance(dtype, scale)
    results = {fw: run(fw, strategy, p, options, g, count, device="cuda", tuning=blocks) for fw in ("torch", "jax")}
    for fw, result in results.items():
        for key, err in errors(result, ref).items():
            assert err <= tol, f"{fw} {key}: relative error {err:.3g} > {tol:.3g}"
    for key in results["torch"]:
        assert rel_err(results["torch"][key], results["jax"][key]) <= 2 * tol, f"torch vs jax {key}"


def test_dense_speed_peak_is_two_weights_plus_two_blocks():
    """The dense loss holds the teacher's logits block beside the student's, and the fp32
    grad_weight is converted into its first slab's storage: the fwd+bwd peak of "speed"
    stays below 2 W + two blocks + dx + O(N); 3 W (one fp32 accumulator converted at once)
    would exceed it at this shape."""
    import torch_impl
    from interop.blocking import block_shape, weight_grad_slabs

    n, d, v = 1024, 8192, 50000  # W 781 MiB; two row blocks, each two buffers of 49 MiB
    tuning = Tuning(speed_block_elements=512 * v, speed_min_rows=1, one_speed_block_share=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, xt = (torch.randn(n, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    W, Wt = ((torch.randn(v, d, device="cuda", generator=gen) / d**0.5).bfloat16() for _ in range(2))
    x.requires_grad_()
    W.requires_grad_()
    rows, cols = block_shape(tuning, "speed", n, d, v, 2, buffers=2)
    assert rows < n
    assert len(weight_grad_slabs(tuning, v, d * 4, True)) == 3
    w_bytes = W.numel() * 2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch_impl.linear_distillation(x, W, xt, Wt, strategy="speed", tuning=tuning).backward()
    peak = torch.cuda.max_memory_allocated() - base
    bound = 2 * w_bytes + 2 * rows * cols * 2 + x.numel() * 2 + 64 * n + ALLOCATOR_SLACK
    assert peak <= bound < 3 * w_bytes, f"peak {peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
    assert W.grad.dtype == torch.bfloat16 and torch.isfinite(W.grad.float()).all()
