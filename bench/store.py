"""Where a benchmark run's numbers go: one JSON per loss and framework, overwritten by each
run (`cross_entropy_torch.json`, ...), and rows appended to `history.csv` in the same folder.

The JSON holds the latest run, which the README's tables are generated from; the CSV is
append-only so that trends survive the overwrites (as Liger keeps its benchmark data). The
CSV sits beside the JSON it was written with, so a run into a scratch folder (a test) never
touches the committed history.
"""

from __future__ import annotations

import csv
import json
import os
import sys

HISTORY = "history.csv"
HISTORY_COLUMNS = ["date", "loss", "framework", "method", "shape", "N", "D", "V", "dtype", "GPU", "torch", "jax",
                   "triton", "fwd_ms", "fwd_bwd_ms", "peak_extra_mib", "floor_ratio", "loss_err", "grad_x_err",
                   "grad_W_err"]


def command(prog: str, argv: list[str] | None) -> str:
    """The command line that ran (argv, or the process's own), recorded in the JSON."""
    return " ".join([prog, *(sys.argv[1:] if argv is None else argv)])


def framework_of(method: str) -> str:
    """The JAX methods are named jax-*; every other method is PyTorch."""
    return "jax" if method.startswith("jax-") else "torch"


def is_ours(method: str) -> bool:
    """ours-* and jax-ours-*; every other method is a peer."""
    return method.startswith(("ours", "jax-ours"))


def json_path(folder: str, loss: str, framework: str) -> str:
    return os.path.join(folder, f"{loss}_{framework}.json")


def write_json(report: dict, folder: str, loss: str) -> list[str]:
    """Split `report` ({"environment", "skipped", "results", ...}) by framework and write
    one JSON each, for every framework with a result or a skipped method; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    frameworks = dict.fromkeys([r["framework"] for r in report["results"]] + [framework_of(m) for m in report["skipped"]])
    paths = []
    for fw in frameworks:
        part = {**report, "loss": loss, "framework": fw,
                "skipped": {m: why for m, why in report["skipped"].items() if framework_of(m) == fw},
                "results": [r for r in report["results"] if r["framework"] == fw]}
        path = json_path(folder, loss, fw)
        with open(path, "w") as f:
            json.dump(part, f, indent=1)
        paths.append(path)
    return paths


def append_history(rows: list[dict], env: dict, folder: str, loss: str) -> str:
    """Append the rows that ran (an error row has no numbers) to folder/history.csv, with the
    header when the file is new; a row's own "loss" (distillation's "topk K=32") wins over `loss`."""
    path = os.path.join(folder, HISTORY)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, HISTORY_COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for r in rows:
            if "error" not in r:
                numbers = {k: f"{v:.6g}" if isinstance(v, float) else v for k, v in r.items()}
                writer.writerow({"date": env["date"], "loss": loss, "GPU": env["device"], "torch": env.get("torch"),
                                 "jax": env.get("jax"), "triton": env.get("triton"), **numbers})
    return path
