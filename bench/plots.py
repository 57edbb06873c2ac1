"""PNG plots of benchmark results: the README's grouped bars (fwd+bwd time and memory over
the floor per method at each shape, one row per framework), and sweeps (time and memory
against a swept N or V, one line per method; ours solid, peers dashed)."""

from __future__ import annotations

import os

from bench import store
from bench.measure import PRESETS

FRAMEWORKS = {"torch": "PyTorch", "jax": "JAX"}


def by_shape(results: list[dict]) -> dict[str, list[dict]]:
    """{shape: rows}, the presets in the order L, G, S, then other shapes as they ran."""
    order = list(PRESETS)
    shapes = sorted(dict.fromkeys(r["shape"] for r in results), key=lambda s: order.index(s) if s in order else len(order))
    return {s: [r for r in results if r["shape"] == s] for s in shapes}


def _pyplot():
    """pyplot on the Agg backend: files only, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_summary_plot(datasets: dict[str, dict], path: str) -> str:
    """One row per framework ({framework: JSON data}): fwd+bwd ms and peak extra memory / floor,
    bars grouped by shape, one bar per method (peers hatched), log scales (L's times are 50x
    S's; memory spans 1x to 20x the floor). Returns `path`."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(datasets), 2, figsize=(15, 4.2 * len(datasets)), squeeze=False)
    for (fw, data), (ax_t, ax_m) in zip(datasets.items(), axes):
        shapes = by_shape([r for r in data["results"] if "error" not in r])
        methods = list(dict.fromkeys(r["method"] for rows in shapes.values() for r in rows))
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            xs, times, ratios = [], [], []
            for k, rows in enumerate(shapes.values()):
                for r in rows:
                    if r["method"] == method:
                        xs.append(k + (i - (len(methods) - 1) / 2) * width)
                        times.append(r["fwd_bwd_ms"])
                        ratios.append(r["floor_ratio"] or float("nan"))
            hatch = None if store.is_ours(method) else "//"
            ax_t.bar(xs, times, width, label=method, hatch=hatch, color=f"C{i}", edgecolor="white")
            ax_m.bar(xs, ratios, width, label=method, hatch=hatch, color=f"C{i}", edgecolor="white")
        env = data["environment"]
        for ax, label in ((ax_t, "fwd+bwd ms"), (ax_m, "peak extra memory / floor")):
            ax.set_xticks(range(len(shapes)), list(shapes))
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.grid(True, axis="y", which="both", alpha=0.3)
        ax_t.set_title(f"{FRAMEWORKS[fw]}: fwd+bwd time ({env['device']}, {env['date'][:10]})")
        ax_m.set_title(f"{FRAMEWORKS[fw]}: peak extra memory over the floor")
        ax_m.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: list[dict], folder: str) -> list[str]:
    """Sweeps: write one PNG per swept variable found in `results` (shape names "X:N=..." or
    "X:V=..."); returns the paths written."""
    plt = _pyplot()
    os.makedirs(folder, exist_ok=True)
    paths = []
    for var in ("N", "V"):
        rows = [r for r in results if f":{var}=" in r["shape"] and "error" not in r]
        if not rows:
            continue
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r[var], r["fwd_bwd_ms"], r["peak_extra_mib"]) for r in rows if r["method"] == method)
            style = "-" if "ours" in method else "--"
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=method)
            if all(p[2] is not None for p in pts):
                ax_m.plot([p[0] for p in pts], [p[2] for p in pts], style, marker="o", label=method)
        base = rows[0]["shape"].split(":")[0]
        fixed = ", ".join(f"{k}={rows[0][k]}" for k in ("N", "D", "V") if k != var)
        for ax, label in ((ax_t, "fwd+bwd ms"), (ax_m, "peak extra MiB")):
            ax.set_xlabel(var)
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_title(f"time against {var} ({base}: {fixed}, {rows[0]['dtype']})")
        ax_m.set_title(f"memory against {var}")
        ax_m.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(folder, f"sweep_{var}_{base}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
