"""The parity suite on the CPU (tests/parity.py): small shapes, kernels in their interpreters,
several blocks per problem (tests.frameworks.SMALL_BLOCKS)."""

from __future__ import annotations

import pytest

from tests.frameworks import SMALL_BLOCKS
from tests.parity import LOG_PROBS_CASES, STRATEGIES, run_case

CPU_CASES = ["sum-bias", "everything-none-lse", "custom-ignore-index", *LOG_PROBS_CASES]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", CPU_CASES)
def test_torch_and_jax_agree_on_shared_buffers(case, dtype, strategy):
    result = run_case(case, dtype, strategy, "cpu", tuning=SMALL_BLOCKS)
    assert not result["failed"], result
    outputs = {"log_probs", "entropy"} if case in LOG_PROBS_CASES else {"loss", "lse"}
    assert outputs | {"grad_x", "grad_W"} <= result["errors"].keys()


def test_report_resumes_a_cut_run(tmp_path):
    """`--resume` keeps the finished cases of parity.json and runs only the missing one; the
    report is written with every case."""
    import json

    from tests.frameworks import CASES
    from tests.parity import LOG_PROBS_CASES, environment, main

    shape = ["--rows", "13", "--hidden", "19", "--vocab", "53"]
    keys = [(c, d, s) for c in [*CASES, *LOG_PROBS_CASES] for d in ("bfloat16", "float16", "float32") for s in STRATEGIES]
    kept = [{"case": c, "dtype": d, "strategy": s, "errors": {"loss": {"torch": 0.0, "jax": 0.0, "torch_vs_jax": 0.0}},
             "tolerance": 1.0, "failed": []} for c, d, s in keys[1:]]
    (tmp_path / "parity.json").write_text(json.dumps({"environment": environment("cpu"), "shape": [13, 19, 53],
                                                      "results": kept}))
    assert main(["--device", "cpu", "--out", str(tmp_path), "--resume", *shape]) == 0
    results = json.loads((tmp_path / "parity.json").read_text())["results"]
    assert sorted((r["case"], r["dtype"], r["strategy"]) for r in results) == sorted(keys)
    assert "grad_x" in results[-1]["errors"] and (results[-1]["case"], results[-1]["dtype"]) == keys[0][:2]
    assert (tmp_path / "parity.md").read_text().count("\n| ") == len(keys) + 1
