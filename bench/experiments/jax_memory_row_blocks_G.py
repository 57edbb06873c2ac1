"""JAX "memory" at G in fewer row blocks (2 trips over the 7395 kept rows instead of 3) and
narrower column blocks, against PyTorch "memory" in the same call (H100, 2026-11-25; results
in git history at 9e19130, bench/NOTES.md has the entry). Blocks as "RxC" arguments
("default" for the plan), else the list below; writes $OUT/jax_memory_row_blocks_G.json.

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/jax_memory_row_blocks_G.py"""
import json, os, sys, time
import torch
import jax
from bench import measure, torch_methods, jax_methods
from bench.__main__ import torch_row, jax_row
import jax_impl.blocked as blocked

dev = torch.device("cuda")
n, d, v = 8192, 2304, 256000
x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
ref = measure.fwd_bwd(torch_methods.METHODS["ours-chunked"](), x.double(), W.double(), y)
floor = x.numel() * x.element_size() + W.numel() * W.element_size()
print("kept rows", int((y != -100).sum()), "floor MiB", floor / 2**20, flush=True)
out = {"gpu": torch.cuda.get_device_name(), "jax": jax.__version__, "torch": torch.__version__,
       "date": time.strftime("%Y-%m-%d"), "shape": [n, d, v], "rows": []}
default = blocked.xla_memory_block_shape


def record(name, row):
    peak = row.pop("peak_extra_bytes")
    row.update(name=name, mem_x=peak / floor, mib=peak / 2**20)
    out["rows"].append(row)
    print(f"{name:28s} fwd {row['fwd_ms']:7.2f} fwd+bwd {row['fwd_bwd_ms']:7.2f} ms  {row['mem_x']:.4f}x ({row['mib']:.0f} MiB)"
          f"  err loss {row.get('loss_err', 0):.1e} dx {row.get('grad_x_err', 0):.1e} dW {row.get('grad_W_err', 0):.1e}", flush=True)
    torch.cuda.empty_cache()


record("torch memory", torch_row("ours-memory", torch_methods.METHODS["ours-memory"](), x, W, y, ref, dev, 10))
shapes = [None, (3712, 2048), (3840, 2048), (4096, 1024), (4096, 1536), (3712, 1536), (2816, 1024), None]
shapes = [tuple(map(int, s.split("x"))) if s != "default" else None for s in sys.argv[1:]] or shapes
for shape in shapes:
    blocked.xla_memory_block_shape = default if shape is None else (lambda *a, s=shape: s)
    name = f"jax memory {shape or default(n, d, v, 2)}" + ("" if shape else " (default)")
    try:
        record(name, jax_row(name, jax_methods.Method(jax_methods._ours("memory")), x, W, y, ref, dev, 10))
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:300], flush=True)
blocked.xla_memory_block_shape = default
record("torch memory (again)", torch_row("ours-memory", torch_methods.METHODS["ours-memory"](), x, W, y, ref, dev, 10))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "jax_memory_row_blocks_G.json"), "w"), indent=1)
