"""The parity suite on the CPU (tests/parity.py): small shapes, kernels in their interpreters,
several blocks per problem (tests.frameworks.SMALL_BLOCKS)."""

from __future__ import annotations

import pytest

from tests.frameworks import SMALL_BLOCKS
from tests.parity import STRATEGIES, run_case

CPU_CASES = ["sum-bias", "everything-none-lse", "custom-ignore-index"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", CPU_CASES)
def test_torch_and_jax_agree_on_shared_buffers(case, dtype, strategy):
    result = run_case(case, dtype, strategy, "cpu", tuning=SMALL_BLOCKS)
    assert not result["failed"], result
    assert {"loss", "lse", "grad_x", "grad_W"} <= result["errors"].keys()
