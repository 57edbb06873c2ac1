"""JAX cross-entropy "memory" in forced block plans against its default plan, naive XLA and
"speed" (fwd+bwd time, XLA's memory over the floor, errors against float64), at shapes of
D 2048 where the default plan is XLA's tiles or whole rows of a few dozen rows, and at L, G
and S (H200, 2026-11-28; results at a8c0a43 in bench/results/jax_memory_plans.json,
bench/NOTES.md has the entry). Writes $OUT/jax_memory_plans.json.

Plans: "default"; "rows:R" (whole rows of R, gradients formed in the forward pass);
"tiles:R:C" (XLA's products in R x C blocks); "ktiles:R:C" (the same through
`jax_impl.row_products`' kernels). It patches `interop.planning._jax_cross_entropy`.

Run on a GPU from the repository root:
OUT=/tmp PYTHONPATH=. python bench/experiments/jax_memory_plans.py [NAME[=PLAN,...] ...]"""
import dataclasses, json, os, sys, time
import torch
import jax
from bench import measure, torch_methods, jax_methods
from bench.__main__ import jax_row
from interop import planning
from interop.tuning import DEFAULT

CASES = {
    "H": ((8192, 2048, 128256), ["default", "rows:64", "rows:128", "rows:256", "ktiles:2816:2048", "ktiles:1536:4096"]),
    "M": ((16384, 2048, 128256), ["default", "rows:128", "rows:256", "tiles:512:2048", "ktiles:2816:2048"]),
    "G": ((8192, 2304, 256000), ["default", "rows:144", "rows:256"]),
    "S": ((4096, 1024, 32000), ["default", "rows:64", "rows:128", "ktiles:1024:4096"]),
    "L": ((16384, 4096, 128256), ["default", "rows:512"]),
}
default_plan = planning._jax_cross_entropy


def forced(spec):
    if spec == "default":
        return default_plan
    kind, *n = spec.split(":")
    n = [int(k) for k in n]

    def plan(t, strategy, n_rows, hidden, vocab, itemsize, *rest):
        p = default_plan(t, strategy, n_rows, hidden, vocab, itemsize, *rest)
        if strategy != "memory":
            return p
        if kind == "rows":
            return dataclasses.replace(p, layout="rows", rows=n[0], cols=vocab, kernel_products=False)
        return dataclasses.replace(p, layout="tiles", rows=n[0], cols=n[1], kernel_products=kind == "ktiles")
    return plan


dev = torch.device("cuda")
out = {"gpu": torch.cuda.get_device_name(), "jax": jax.__version__, "torch": torch.__version__,
       "date": time.strftime("%Y-%m-%d"), "rows": []}
path = os.path.join(os.environ.get("OUT", "/tmp"), "jax_memory_plans.json")
for arg in sys.argv[1:] or list(CASES):
    name, _, only = arg.partition("=")
    (n, d, v), specs = CASES[name]
    specs = only.split(",") if only else specs
    x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
    ref = measure.fwd_bwd(torch_methods.METHODS["ours-chunked"](), x.double(), W.double(), y)
    floor = x.numel() * x.element_size() + W.numel() * W.element_size()
    default = default_plan(DEFAULT, "memory", n, d, v, 2, True, False, False)
    print(f"{name} {n}x{d}x{v} default plan {default}", flush=True)
    for label in ["naive", "speed"] + specs:
        planning._jax_cross_entropy = forced("default" if label in ("naive", "speed") else label)
        fn = jax_methods._naive if label == "naive" else jax_methods._ours("speed" if label == "speed" else "memory")
        try:
            row = jax_row(label, jax_methods.Method(fn), x, W, y, ref, dev, 5)
        except Exception as e:
            print(name, label, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            continue
        peak = row.pop("peak_extra_bytes")
        row.update(shape=name, n=n, d=d, v=v, plan=label, x_floor=peak / floor)
        out["rows"].append(row)
        print(f"{name} {label:18s} fwd {row['fwd_ms']:7.2f} fwd+bwd {row['fwd_bwd_ms']:7.2f} ms {row['x_floor']:.3f}x"
              f" err dx {row.get('grad_x_err', 0):.1e} dW {row.get('grad_W_err', 0):.1e}", flush=True)
        json.dump(out, open(path, "w"), indent=1)
    planning._jax_cross_entropy = default_plan
    del x, W, y, ref
    torch.cuda.empty_cache()
