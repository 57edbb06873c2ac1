"""The benchmark is code too: on the CPU it produces the table, the JSON (one per framework
with --out), the history rows and the plots, reports a peer it can't import instead of
dropping it, and regenerates the README's tables between their markers."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
from pathlib import Path

import pytest

from bench import report, store
from bench.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
METHODS = ["ours-speed", "ours-chunked", "torch-eager", "liger", "cce", "jax-ours-speed", "jax-naive", "jax-cce"]
COMMITTED_HISTORY = ROOT / "bench" / "results" / store.HISTORY


def _read(path: Path):
    return path.read_bytes() if path.exists() else None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CPU run of every method over a two-point sweep, into a scratch folder:
    (returned report, console output, folder, the committed history's bytes before the run)."""
    folder = tmp_path_factory.mktemp("bench")
    history_before = _read(COMMITTED_HISTORY)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = main(["--shapes", "48x16x300", "--sweep-n", "24,48", "--methods", ",".join(METHODS), "--repeat", "1",
                       "--json", str(folder / "all.json"), "--out", str(folder / "results"), "--plot", str(folder / "plots")])
    return result, printed.getvalue(), folder, history_before


def test_bench_cpu_run_writes_table_json_and_plots(run):
    result, printed, folder, _ = run
    saved = json.loads((folder / "all.json").read_text())
    assert saved["results"] == json.loads(json.dumps(result["results"]))
    ran = {r["method"] for r in saved["results"]}
    for method in METHODS:  # every method either ran on both sweep points or is reported skipped, with a reason
        assert (method in ran) != (method in saved["skipped"]), method
        assert method not in saved["skipped"] or saved["skipped"][method]
    for r in saved["results"]:
        assert "error" not in r, r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["method"] in printed
        if store.is_ours(r["method"]):  # ours are exact to fp32 here
            assert r["loss_err"] < 1e-5 and r["grad_x_err"] < 1e-5 and r["grad_W_err"] < 1e-5
    naive = [r for r in saved["results"] if r["method"] in ("torch-eager", "jax-naive")]
    assert all(r["peak_extra_mib"] is not None and r["peak_extra_mib"] >= 0 for r in naive)
    assert {r["shape"] for r in saved["results"]} == {"48x16x300:N=24", "48x16x300:N=48"}
    png = folder / "plots" / "sweep_N_48x16x300.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = report.markdown_table(saved["results"])
    assert table.count("\n") == 2 + len(saved["results"])


def test_out_writes_one_json_per_framework_and_appends_history(run):
    result, _, folder, history_before = run
    out = folder / "results"
    for fw in ("torch", "jax"):
        data = json.loads((out / f"cross_entropy_{fw}.json").read_text())
        assert data["loss"] == "cross_entropy" and data["framework"] == fw
        assert data["environment"]["date"] and data["environment"]["device"] and data["command"].startswith("python -m bench")
        assert data["results"] == [r for r in json.loads(json.dumps(result["results"])) if r["framework"] == fw]
        assert all(store.framework_of(m) == fw for m in data["skipped"])
    with open(out / store.HISTORY, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == store.HISTORY_COLUMNS
    assert len(rows) == len(result["results"])  # every row ran (none is an error)
    assert {(r["framework"], r["method"], r["shape"]) for r in rows} == \
        {(r["framework"], r["method"], r["shape"]) for r in result["results"]}
    assert all(r["loss"] == "cross_entropy" and float(r["fwd_bwd_ms"]) > 0 for r in rows)
    store.append_history(result["results"][:1], result["environment"], str(out), "cross_entropy")
    lines = (out / store.HISTORY).read_text().splitlines()
    assert len(lines) == 2 + len(rows) and lines.count(lines[0]) == 1  # appended, one header
    assert _read(COMMITTED_HISTORY) == history_before  # a run elsewhere leaves the committed history alone


def _readme_copy(tmp_path: Path) -> Path:
    """A copy of README.md, which holds the markers of both frameworks."""
    text = (ROOT / "README.md").read_text()
    assert all(f"<!-- bench.report {fw} -->" in text for fw in report.FRAMEWORKS)
    path = tmp_path / "README.md"
    path.write_text(text)
    return path


def test_report_rewrites_readme_between_markers_and_checks(run, tmp_path):
    results = str(run[2] / "results")
    readme = _readme_copy(tmp_path)
    before = readme.read_text()
    assert report.main(["--results", results, "--readme", str(readme), "--plot", str(tmp_path / "ce.png")]) == 0
    after = readme.read_text()
    assert (tmp_path / "ce.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for fw, (path, data) in report.load(results).items():
        start, end = f"<!-- bench.report {fw} -->\n", f"<!-- /bench.report {fw} -->"
        inside = after.split(start)[1].split(end)[0]
        assert inside == report.section(path, data)
        methods = {r["method"] for r in data["results"]}
        assert inside.count("\n| ") == 1 + len(methods) and data["environment"]["device"] in inside
    outside = lambda text: [part.split("<!-- /bench.report")[-1] for part in text.split("<!-- bench.report ")]
    assert outside(after) == outside(before)  # nothing but the sections changed
    assert report.main(["--results", results, "--readme", str(readme), "--check"]) == 0
    readme.write_text(after.replace("| jax-naive |", "| jax-naive | 0.01 |", 1))
    assert report.main(["--results", results, "--readme", str(readme), "--check"]) == 1
    readme.write_text(after.replace("<!-- bench.report jax -->", ""))
    assert report.main(["--results", results, "--readme", str(readme), "--check"]) == 1


def test_summary_table_ratios():
    rows = [{"shape": "S", "method": m, "fwd_ms": ms / 2, "fwd_bwd_ms": ms, "peak_extra_mib": 1.0, "floor_ratio": 2.0}
            for m, ms in (("ours-speed", 1.0), ("torch-eager", 4.0), ("liger", 2.0))]
    rows.insert(0, {"shape": "L", "method": "liger", "error": "OutOfMemoryError: ..."})
    table = report.summary_table(rows).splitlines()
    assert table[0].startswith("| method | L: fwd+bwd ms")  # presets in the order L, G, S
    assert table[2] == "| liger | OutOfMemoryError | - | - | 2.00 (1.00x) | 2.00x | - / - |"
    assert table[3] == "| ours-speed | - | - | - | 1.00 (0.50x) | 2.00x | - / - |"  # against liger, the fastest peer


def test_committed_results_render_and_readme_matches(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the captions name bench/results/..., as the README's command writes them
    assert report.main(["--plot", str(tmp_path / "ce.png")]) == 0
    printed = capsys.readouterr().out
    found = report.load("bench/results")
    assert set(found) == {"torch", "jax"}
    for _, data in found.values():
        assert {r["shape"] for r in data["results"]} == {"L", "G", "S", "Q"} and data["environment"]["device"] in printed
    sections = re.findall(r"<!-- bench\.report \w+ -->\n(.*?)<!-- /bench\.report", Path("README.md").read_text(), re.DOTALL)
    assert len(sections) == 7 and all(sections), "README.md lacks its tables: python -m bench.report --readme README.md"
    assert report.main(["--readme", "README.md", "--check"]) == 0, "run python -m bench.report --readme README.md"


def test_rl_section_has_both_losses_of_every_method():
    """The RL outputs' table (bench.log_probs' JSON): a row per framework's method, a column
    per shape, each cell the log-probabilities' then GRPO's time and memory ("-" where a
    method did not run that loss)."""
    runs = {fw: (f"{fw}.json", json.loads((ROOT / f"bench/results/log_probs_{fw}.json").read_text()))
            for fw in ("torch", "jax")}
    table = report.rl_section(runs).split("\n\n")[1].splitlines()
    methods = [m for _, data in runs.values() for m in dict.fromkeys(r["method"] for r in data["results"])]
    assert [line.split(" |")[0][2:] for line in table[2:]] == methods
    row = {r["loss"]: r for r in runs["torch"][1]["results"] if r["method"] == "ours-speed" and r["shape"] == "RL"}
    cell = table[2].split(" | ")[1]
    assert cell.startswith(f"{row['log_probs']['fwd_bwd_ms']:.1f} / {row['grpo']['fwd_bwd_ms']:.1f} (")
    assert "| liger-grpo | - / " in "\n".join(table)


def test_distributed_section_compares_each_method_with_one_gpu(tmp_path):
    """The multi-GPU table: per split-head shape and method, the 1-GPU and P-GPU times, the
    speed-up over one GPU's unsplit call, the weak run's efficiency and the per-GPU peak over
    the rank's floor; the model steps and the JAX meshes after them; none without the runs."""
    import shutil

    from bench.distributed_report import distributed_section

    for name in ("distributed_1gpu.json", "distributed_2gpu.json", "distributed_2gpu_weak.json", "fsdp_model_2gpu.json",
                 "jax_mesh_1gpu.json", "jax_mesh_2gpu_vocab.json"):  # runs on one and two GPUs only
        shutil.copy(ROOT / "bench/results" / name, tmp_path / name)
    section = distributed_section(str(tmp_path))
    load = lambda name: json.loads((tmp_path / name).read_text())["results"]
    one, two, weak = load("distributed_1gpu.json"), load("distributed_2gpu.json"), load("distributed_2gpu_weak.json")
    pick = lambda rows, method: next(r for r in rows if r["shape"] == "L" and r["method"] == method)
    base, r1, r2, rw = pick(one, "one-gpu-speed"), pick(one, "ours-speed"), pick(two, "ours-speed"), pick(weak, "ours-speed")
    row = next(line for line in section.splitlines() if line.startswith("| L ") and "| ours-speed |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == [f"{r1['fwd_bwd_ms']:.1f}", f"{r2['fwd_bwd_ms']:.1f}",
                          f"{base['fwd_bwd_ms'] / r2['fwd_bwd_ms']:.2f}x"]
    assert cells[5] == f"{rw['fwd_bwd_ms']:.1f} ({100 * r1['fwd_bwd_ms'] / rw['fwd_bwd_ms']:.0f}%)"
    top = max(r2["peak_extra_mib_per_rank"])
    assert cells[6] == f"{top / 1024:.2f} ({top / r2['local_floor_mib']:.2f}x)"
    assert "2 x NVIDIA" in section and "Llama-like model, FSDP2" in section and "JAX L 16384x4096x128256" in section
    for name in ("distributed_2gpu.json", "distributed_2gpu_weak.json"):
        (tmp_path / name).unlink()
    assert distributed_section(str(tmp_path)) is None  # no run of several GPUs


def test_distributed_section_scales_over_every_rank_count(tmp_path):
    """With runs on 2 and 4 GPUs: a scaling table of the split head (ms on 1 GPU, then on each
    P with its speed-up, the weak runs' efficiency, the peaks), then a table for each P."""
    import shutil

    from bench.distributed_report import distributed_section

    results = ROOT / "bench/results"
    for name in ("distributed_1gpu.json", "distributed_2gpu.json", "distributed_2gpu_weak.json"):
        shutil.copy(results / name, tmp_path / name)
    for name in ("distributed_2gpu.json", "distributed_2gpu_weak.json"):  # a 4-GPU run: twice as fast
        data = json.loads((results / name).read_text())
        for r in data["results"]:
            r["P"], r["fwd_bwd_ms"] = 4, r["fwd_bwd_ms"] / 2
        (tmp_path / name.replace("2gpu", "4gpu")).write_text(json.dumps(data))
    section = distributed_section(str(tmp_path))
    assert "Split-head scaling" in section and "On 2 x NVIDIA" in section and "On 4 x NVIDIA" in section
    load = lambda name: json.loads((tmp_path / name).read_text())["results"]
    pick = lambda name, method: next(r for r in load(name) if r["shape"] == "L" and r["method"] == method)
    base, r1 = pick("distributed_1gpu.json", "one-gpu-speed"), pick("distributed_1gpu.json", "ours-speed")
    row = next(line for line in section.splitlines() if line.startswith("| L ") and "| ours-speed |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    r2, r4 = pick("distributed_2gpu.json", "ours-speed"), pick("distributed_4gpu.json", "ours-speed")
    w4 = pick("distributed_4gpu_weak.json", "ours-speed")
    assert cells[2:5] == [f"{r1['fwd_bwd_ms']:.1f}", f"{r2['fwd_bwd_ms']:.1f} ({base['fwd_bwd_ms'] / r2['fwd_bwd_ms']:.2f}x)",
                          f"{r4['fwd_bwd_ms']:.1f} ({base['fwd_bwd_ms'] / r4['fwd_bwd_ms']:.2f}x)"]
    assert cells[6] == f"{w4['fwd_bwd_ms']:.1f} ({100 * r1['fwd_bwd_ms'] / w4['fwd_bwd_ms']:.0f}%)"
    assert not any(" split head |" in line for line in section.splitlines())  # not repeated in each P's table


def test_compiled_model_section_is_generated_and_optional(tmp_path):
    """The compiled model's table: one column per method; its markers keep their text when the
    results folder has no compiled_model.json (another command writes it), and a JSON without
    markers is an error."""
    data = json.loads((ROOT / "bench/results/compiled_model.json").read_text())
    section = report.compiled_section("c.json", data)
    table = section.split("\n\n")[1].splitlines()
    assert table[0] == "| | " + " | ".join(r["method"] for r in data["results"]) + " |"
    assert [line.split(" |")[0] for line in table[2:]] == ["| step ms", "| peak GiB", "| graphs"]
    assert data["environment"]["device"] in section and "c.json" in section
    text = "a\n<!-- bench.report compiled_model -->\nold\n<!-- /bench.report compiled_model -->\n"
    assert report.rewrite(text, {}) == text
    assert report.rewrite(text, {"compiled_model": "new\n"}) == text.replace("old\n", "new\n")
    with pytest.raises(ValueError, match="markers"):
        report.rewrite("a\n", {"compiled_model": "new\n"})


def test_a_method_that_raises_is_recorded_and_the_run_goes_on():
    from bench import measure

    logged = []
    ok = measure.record({"method": "a"}, lambda row: row.update(ms=1.0), logged.append)
    failed = measure.record({"method": "b"}, lambda row: [][0], logged.append)
    assert ok == {"method": "a", "ms": 1.0} and failed["error"].startswith("IndexError: ")
    assert logged == [ok, failed]


def test_rl_peers_trl_head_is_trls_function():
    """bench.rl_peers' TRL peer: TRL's function at temperature 1, the library's numbers in fp32."""
    import torch

    from bench import rl_peers
    from torch_impl import linear_log_probs

    try:
        head = rl_peers.trl_head()
    except ImportError:
        pytest.skip("this TRL has no fused LM head (TRL < 1.15)")
    gen = torch.Generator().manual_seed(0)
    x, W, y = torch.randn(9, 8, generator=gen), torch.randn(31, 8, generator=gen), torch.randint(0, 31, (9,))
    for got, want in zip(head(x, W, y), linear_log_probs(x, W, y, return_entropy=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rl_peers_load_verls_kernel_modules_without_its_package(tmp_path, monkeypatch):
    """bench.rl_peers' verl peer: the kernel modules of an installed verl whose package can't
    import (its own imports Ray) load under stand-ins of verl.utils.device; none installed
    is an ImportError naming verl, which the benchmark reports as skipped."""
    import sys

    from bench import rl_peers

    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p) / "verl").exists()])
    with pytest.raises(ImportError, match="verl"):
        rl_peers.verl_head()
    kernel = tmp_path / "verl" / "utils" / "kernel"
    kernel.mkdir(parents=True)
    for package in (tmp_path / "verl", tmp_path / "verl" / "utils"):
        (package / "__init__.py").write_text("raise ImportError('needs Ray')\n")
    (kernel / "kernels.py").write_text("from verl.utils.device import get_torch_device\nDEVICE = get_torch_device()\n")
    (kernel / "linear_cross_entropy.py").write_text(
        "def linear_cross_entropy(hidden, weight, labels, temperature, reduction, group):\n"
        "    from . import kernels\n"
        "    return kernels.DEVICE, (temperature, reduction, group)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("verl", "verl.utils", "verl.utils.device", "verl.utils.kernel", "verl.utils.kernel.kernels",
                 "verl.utils.kernel.linear_cross_entropy"):
        monkeypatch.setitem(sys.modules, name, None)  # restored (removed) after the test
        del sys.modules[name]
    import torch

    assert rl_peers.verl_head()(None, None, None) == (torch.cuda, (1.0, "none", None))


def test_trl_step_runs_both_heads_on_cpu(tmp_path, monkeypatch):
    """bench.trl_step on a tiny fp32 model: a row per method, the same GRPO loss from TRL's
    head and the library's, the JSON written."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from torch_impl import trl as adapter

    if not hasattr(trl_utils, adapter.TRL_HOOK):
        pytest.skip("this TRL has no fused LM head (TRL < 1.15)")
    monkeypatch.setattr(trl_utils, adapter.TRL_HOOK, getattr(trl_utils, adapter.TRL_HOOK))  # restored after
    from bench import trl_step

    calls, fused = [], adapter.fused_head_outputs
    monkeypatch.setattr(adapter, "fused_head_outputs", lambda *a: calls.append(1) or fused(*a))
    with contextlib.redirect_stdout(io.StringIO()):
        rows = trl_step.main(["--tiny", "--rows", "2", "--seq", "16", "--repeat", "1", "--json", str(tmp_path / "s.json")])
    assert [r["method"] for r in rows] == list(trl_step.METHODS)
    assert abs(rows[0]["loss"] - rows[1]["loss"]) <= 1e-5 * abs(rows[0]["loss"]) and calls  # "ours": the library's
    assert json.loads((tmp_path / "s.json").read_text())["results"] == rows
