"""The parity suite on the CPU (tests/parity.py): small shapes, kernels in their interpreters,
several blocks per problem."""

from __future__ import annotations

import pytest

from tests.parity import STRATEGIES, run_case

CPU_CASES = ["sum-bias", "everything-none-lse", "custom-ignore-index"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    import interop.blocking
    import interop.options

    monkeypatch.setattr(interop.options, "MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(interop.blocking, "MIN_BLOCK", 4)
    monkeypatch.setattr(interop.blocking, "MIN_MEMORY_BLOCK", (4, 4))
    monkeypatch.setattr(interop.blocking, "SPEED_BLOCK_ELEMENTS", 5 * 53)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", CPU_CASES)
def test_torch_and_jax_agree_on_shared_buffers(case, dtype, strategy):
    result = run_case(case, dtype, strategy, "cpu")
    assert not result["failed"], result
    assert {"loss", "lse", "grad_x", "grad_W"} <= result["errors"].keys()
