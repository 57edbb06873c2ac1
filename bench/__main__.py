"""`python -m bench`: the side-by-side benchmark of linear cross-entropy implementations.

On a GPU it runs the presets L, G, S for every method it can import; on a CPU it runs a
small shape. Per method and shape: forward ms, fwd+bwd ms (median after warm-up), peak
extra memory (and its ratio to the floor: the gradients' bytes), loss and gradient errors
against float64, achieved TFLOP/s against a matrix product measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

from bench import measure, torch_methods

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_METHODS = ["ours-speed", "ours-memory", "torch-eager", "torch-compile", "torch-native", "liger", "cce", "cce-nofilter"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def environment(device) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return env


def run_shape(name, shape, methods, dtype, device, data, repeat, log):
    n, d, v = shape
    x, W, y = measure.make_inputs(n, d, v, dtype, device, peaked=data == "peaked")
    ref_loss, ref_dx, ref_dW = measure.fwd_bwd(torch_methods.METHODS["ours-chunked"](), x.double(), W.double(), y)
    floor = x.numel() * x.element_size() + W.numel() * W.element_size()
    flops = 6 * n * d * v
    rows = []
    for mname, method in methods.items():
        row = {"shape": name, "N": n, "D": d, "V": v, "method": mname, "dtype": str(dtype).removeprefix("torch.")}
        try:
            with torch.no_grad():
                row["fwd_ms"] = measure.time_ms(lambda: method(x, W, y), device, repeat=repeat)
            row["fwd_bwd_ms"] = measure.time_ms(lambda: measure.fwd_bwd(method, x, W, y), device, repeat=repeat)
            peak = measure.peak_extra_bytes(lambda: measure.fwd_bwd(method, x, W, y), device)
            loss, dx, dW = measure.fwd_bwd(method, x, W, y)
            row.update(
                peak_extra_mib=None if peak is None else peak / 2**20,
                floor_ratio=None if peak is None else peak / floor,
                loss_err=measure.rel_err(loss, ref_loss),
                grad_x_err=measure.rel_err(dx, ref_dx),
                grad_W_err=measure.rel_err(dW, ref_dW),
                tflops=flops / row["fwd_bwd_ms"] / 1e9,
            )
            del loss, dx, dW
        except Exception as e:  # e.g. out of memory: recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        torch.cuda.empty_cache() if device.type == "cuda" else None
        rows.append(row)
        log(format_row(row))
    return rows, floor


def format_row(r) -> str:
    if "error" in r:
        return f"{r['shape']:>3} {r['method']:<14} ERROR {r['error']}"
    mem = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:8.0f} ({r['floor_ratio']:.2f}x)"
    return (f"{r['shape']:>3} {r['method']:<14} fwd {r['fwd_ms']:8.2f} ms  fwd+bwd {r['fwd_bwd_ms']:8.2f} ms  "
            f"{r['tflops']:6.0f} TF/s  mem {mem:>18}  loss {r['loss_err']:.1e}  dx {r['grad_x_err']:.1e}  dW {r['grad_W_err']:.1e}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None, help="comma-separated presets (L,G,S,cpu) or NxDxV; default L,G,S on a GPU, cpu otherwise")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--data", default="random", choices=["random", "peaked"])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = args.shapes or ("L,G,S" if device.type == "cuda" else "cpu")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    methods, skipped = torch_methods.load(args.methods.split(","))
    log = lambda s: print(s, flush=True)
    env = environment(device)
    env["matmul_tflops"] = measure.matmul_tflops(device, dtype)
    log(f"# {env}")
    for name, reason in skipped.items():
        log(f"# skipped {name}: {reason}")
    results = []
    for spec in shapes.split(","):
        shape = measure.PRESETS[spec] if spec in measure.PRESETS else tuple(int(s) for s in spec.split("x"))
        rows, floor = run_shape(spec, shape, methods, dtype, device, args.data, args.repeat, log)
        log(f"{spec:>3} floor {floor / 2**20:.0f} MiB")
        results.extend(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "data": args.data, "skipped": skipped, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
