"""JAX "memory" at L and Qwen2-7B's head in XLA's rows x columns blocks (whole rows switched
off) against the default whole rows; PyTorch "memory" in the same call (H100, 2026-11-25;
results in git history at 0e46bcf, bench/NOTES.md has the entry). Writes
$OUT/jax_memory_rows_cols_LQ.json.

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/jax_memory_rows_cols_LQ.py"""
import json, os, time
import torch
import jax
from bench import measure, torch_methods, jax_methods
from bench.__main__ import torch_row, jax_row
import jax_impl.blocked as blocked

dev = torch.device("cuda")
default_shape, default_whole = blocked.xla_memory_block_shape, blocked.whole_row_memory_block_rows
out = {"gpu": torch.cuda.get_device_name(), "jax": jax.__version__, "torch": torch.__version__,
       "date": time.strftime("%Y-%m-%d"), "rows": []}
cases = {"L": ((16384, 4096, 128256), [None, 1664, 2304, 2944, 3712]),
         "Qwen2-7B": ((8192, 3584, 151936), [None, 1920, 2560, 3200])}
for name, ((n, d, v), plans) in cases.items():
    x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
    ref = measure.fwd_bwd(torch_methods.METHODS["ours-chunked"](), x.double(), W.double(), y)
    floor = x.numel() * x.element_size() + W.numel() * W.element_size()

    def record(label, row):
        peak = row.pop("peak_extra_bytes")
        row.update(shape=name, name=label, mem_x=peak / floor, mib=peak / 2**20, bound_margin_mib=(1.10 * floor + 16 * n - peak) / 2**20)
        out["rows"].append(row)
        print(f"{name} {label:34s} fwd {row['fwd_ms']:7.2f} fwd+bwd {row['fwd_bwd_ms']:7.2f} ms  {row['mem_x']:.4f}x"
              f" (margin {row['bound_margin_mib']:6.1f} MiB)  err dx {row.get('grad_x_err', 0):.1e} dW {row.get('grad_W_err', 0):.1e}", flush=True)
        torch.cuda.empty_cache()

    record("torch memory", torch_row("ours-memory", torch_methods.METHODS["ours-memory"](), x, W, y, ref, dev, 7))
    for rows in plans:
        blocked.whole_row_memory_block_rows = default_whole if rows is None else (lambda *a, **k: None)
        blocked.xla_memory_block_shape = default_shape if rows is None else (lambda *a, r=rows: (r, 2048))
        label = "jax memory default" if rows is None else f"jax memory {rows} x 2048"
        try:
            record(label, jax_row(label, jax_methods.Method(jax_methods._ours("memory")), x, W, y, ref, dev, 7))
        except Exception as e:
            print(name, label, "FAILED", type(e).__name__, str(e)[:300], flush=True)
    blocked.xla_memory_block_shape, blocked.whole_row_memory_block_rows = default_shape, default_whole
    del x, W, y, ref
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "jax_memory_rows_cols_LQ.json"), "w"), indent=1)
