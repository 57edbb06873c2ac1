"""Render benchmark results (the JSON `python -m bench --json` writes) as a markdown table.

python -m bench.report bench/results/FILE.json
"""

from __future__ import annotations

import json
import sys


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
            f"{r['loss_err']:.1e} | {r['grad_x_err']:.1e} | {r['grad_W_err']:.1e} |"
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
