"""The benchmark is code too: on the CPU it produces the table, the JSON and the plots,
and reports a peer it can't import instead of dropping it."""

from __future__ import annotations

import json

from bench.__main__ import main
from bench.report import markdown_table

METHODS = ["ours-speed", "ours-chunked", "torch-eager", "liger", "cce", "jax-ours-speed", "jax-naive", "jax-cce"]


def test_bench_cpu_run_writes_table_json_and_plots(tmp_path, capsys):
    out_json, plot_dir = tmp_path / "results.json", tmp_path / "plots"
    report = main(["--shapes", "48x16x300", "--sweep-n", "24,48", "--methods", ",".join(METHODS), "--repeat", "1",
                   "--json", str(out_json), "--plot", str(plot_dir)])
    printed = capsys.readouterr().out
    saved = json.loads(out_json.read_text())
    assert saved["results"] == json.loads(json.dumps(report["results"]))
    ran = {r["method"] for r in saved["results"]}
    for method in METHODS:  # every method either ran on both sweep points or is reported skipped, with a reason
        assert (method in ran) != (method in saved["skipped"]), method
        assert method not in saved["skipped"] or saved["skipped"][method]
    for r in saved["results"]:
        assert "error" not in r, r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["method"] in printed
        if r["method"].startswith(("ours", "jax-ours")):  # ours are exact to fp32 here
            assert r["loss_err"] < 1e-5 and r["grad_x_err"] < 1e-5 and r["grad_W_err"] < 1e-5
    naive = [r for r in saved["results"] if r["method"] in ("torch-eager", "jax-naive")]
    assert all(r["peak_extra_mib"] is not None and r["peak_extra_mib"] >= 0 for r in naive)
    assert {r["shape"] for r in saved["results"]} == {"48x16x300:N=24", "48x16x300:N=48"}
    png = plot_dir / "sweep_N_48x16x300.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = markdown_table(saved["results"])
    assert table.count("\n") == 2 + len(saved["results"])
