"""Render benchmark results (the JSON `python -m bench --json` writes) as a markdown table.

python -m bench.report bench/results/FILE.json
"""

from __future__ import annotations

import json
import sys


def _err(r, key) -> str:
    return "-" if r.get(key) is None else f"{r[key]:.1e}"


def format_row(r) -> str:
    """One console line of a result row."""
    if "error" in r:
        return f"{r['shape']:>10} {r['method']:<16} ERROR {r['error']}"
    mem = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:8.1f} ({r['floor_ratio']:.2f}x)"
    return (f"{r['shape']:>10} {r['method']:<16} fwd {r['fwd_ms']:8.2f} ms  fwd+bwd {r['fwd_bwd_ms']:8.2f} ms  "
            f"{r['tflops']:6.1f} TF/s  mem MiB {mem:>18}  loss {_err(r, 'loss_err')}  dx {_err(r, 'grad_x_err')}  "
            f"dW {_err(r, 'grad_W_err')}")


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| shape | method | fwd ms | fwd+bwd ms | peak extra MiB (x floor) | loss err | grad_x err | grad_W err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['method']} | {r['error']} | | | | | |")
            continue
        mem = "-" if r.get("peak_extra_mib") is None else f"{r['peak_extra_mib']:.0f} ({r['floor_ratio']:.2f}x)"
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {mem} | "
            f"{_err(r, 'loss_err')} | {_err(r, 'grad_x_err')} | {_err(r, 'grad_W_err')} |"
        )
    return "\n".join(lines) + "\n"


def main(path: str) -> None:
    data = json.load(open(path))
    env = data["environment"]
    print(f"{env['device']}, torch {env['torch']}, triton {env.get('triton')}, {env['date']}; "
          f"bf16 matmul {env['matmul_tflops']:.0f} TFLOP/s; skipped: {data['skipped'] or 'none'}\n")
    print(markdown_table(data["results"]))


if __name__ == "__main__":
    main(sys.argv[1])
