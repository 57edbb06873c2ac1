"""The distillation losses on a CUDA GPU (marked `cuda`): both frameworks' kernels, medium
odd shapes spanning several row and column blocks, against the float64 reference, and the
torch-JAX parity on the same inputs."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.distill_frameworks import make_problem, reference, run
from tests.frameworks import rel_err, tolerance
from tests.test_cuda import blocks  # noqa: F401 (the fixture: default and small blocks)
from tests.test_distillation import CASES, errors

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind, name", list(CASES))
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_kernels_match_reference(strategy, kind, name, dtype, blocks):
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
    results = {fw: run(fw, strategy, p, options, g, count, device="cuda") for fw in ("torch", "jax")}
    for fw, result in results.items():
        for key, err in errors(result, ref).items():
            assert err <= tol, f"{fw} {key}: relative error {err:.3g} > {tol:.3g}"
    for key in results["torch"]:
        assert rel_err(results["torch"][key], results["jax"][key]) <= 2 * tol, f"torch vs jax {key}"
