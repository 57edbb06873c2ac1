"""PNG plots of benchmark results: fwd+bwd time and peak extra memory against the swept
N or V, one line per method (ours solid, peers dashed)."""

from __future__ import annotations

import os


def write_plots(results: list[dict], folder: str) -> list[str]:
    """Write one PNG per swept variable found in `results` (shape names "X:N=..." or
    "X:V=..."); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
