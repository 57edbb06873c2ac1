"""`python -m bench`: the side-by-side benchmark of linear cross-entropy implementations.

On a GPU it runs the presets L, G, S, Q for every method it can import, PyTorch and JAX; on a
CPU it runs a small shape. Per method and shape: forward ms, fwd+bwd ms (median after
warm-up), peak extra memory and its ratio to the floor (the gradients' bytes), loss and
gradient errors against float64, achieved TFLOP/s (6 N D V / fwd+bwd time) next to a
matrix product measured in the same run.

With --out DIR (the committed one is bench/results) it writes DIR/cross_entropy_torch.json
and DIR/cross_entropy_jax.json and appends the rows to DIR/history.csv (bench.store), after
every shape, so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform

import torch

from bench import jax_methods, measure, store, torch_methods
from bench.report import format_row

TORCH_DEFAULT = ["ours-speed", "ours-memory", "ours-chunked", "torch-eager", "torch-compile", "torch-native", "liger", "liger-cute", "cce",
                 "cce-nofilter", "quack", "quack-logits"]
JAX_DEFAULT = ["jax-ours-speed", "jax-ours-memory", "jax-naive", "jax-cce"]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


PEERS = ("liger-kernel", "cut-cross-entropy", "quack-kernels", "nvidia-cutlass-dsl", "jax-cce")  # their versions go into the environment


def environment(device) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "jax"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            pass
    for name in PEERS:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return env


def parse_shapes(spec: str, sweep_n: str | None, sweep_v: str | None) -> list[tuple[str, tuple]]:
    """[(name, (N, D, V))]: presets or NxDxV; a sweep varies N or V of the first shape."""
    shapes = [(s, measure.PRESETS[s] if s in measure.PRESETS else tuple(int(k) for k in s.split("x"))) for s in spec.split(",")]
    base_name, (n, d, v) = shapes[0]
    if sweep_n:
        shapes = [(f"{base_name}:N={k}", (int(k), d, v)) for k in sweep_n.split(",")]
    if sweep_v:
        shapes = [(f"{base_name}:V={k}", (n, d, int(k))) for k in sweep_v.split(",")]
    return shapes


def _errors(row, loss, dx, dW, ref):
    ref_loss, ref_dx, ref_dW = ref
    row.update(loss_err=measure.rel_err(loss, ref_loss), grad_x_err=measure.rel_err(dx, ref_dx),
               grad_W_err=measure.rel_err(dW, ref_dW))


def torch_row(name, method, x, W, y, ref, device, repeat):
    row = {}
    with torch.no_grad():
        row["fwd_ms"] = measure.time_ms(lambda: method(x, W, y), device, repeat=repeat)
    row["fwd_bwd_ms"] = measure.time_ms(lambda: measure.fwd_bwd(method, x, W, y), device, repeat=repeat)
    if device.type == "cuda":
        row["peak_extra_bytes"] = measure.peak_extra_bytes(lambda: measure.fwd_bwd(method, x, W, y), device)
    else:  # a fresh process per method: this one's allocator already holds earlier methods' memory
        from bench.cpu_peak import measure_in_subprocess

        n, d, v = x.shape[0], x.shape[1], W.shape[0]
        row["peak_extra_bytes"] = measure_in_subprocess(name, n, d, v, str(x.dtype).removeprefix("torch."))
    _errors(row, *measure.fwd_bwd(method, x, W, y), ref)
    return row


def jax_row(name, method, x, W, y, ref, device, repeat):
    """JAX on the same buffers (DLPack); memory: what the compiled fwd+bwd needs beyond
    its arguments (temporaries + outputs)."""
    import jax

    from interop.dlpack import to_jax, to_torch

    xj, Wj = to_jax(x), to_jax(W)
    yj = to_jax((y if method.ignores else y.clamp(min=0)).int())
    fwd, fwd_bwd = jax_methods.compiled_pair(method.fn)
    row = {"fwd_ms": measure.time_ms(lambda: fwd(xj, Wj, yj).block_until_ready(), device, repeat=repeat, events=False),
           "fwd_bwd_ms": measure.time_ms(lambda: jax.block_until_ready(fwd_bwd(xj, Wj, yj)), device, repeat=repeat, events=False)}
    analysis = fwd_bwd.lower(xj, Wj, yj).compile().memory_analysis()
    row["peak_extra_bytes"] = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
    loss, (dx, dW) = fwd_bwd(xj, Wj, yj)
    if method.ignores:
        _errors(row, to_torch(loss), to_torch(dx), to_torch(dW), ref)
    return row


def run_shape(name, shape, torch_ms, jax_ms, dtype, device, data, repeat, log):
    n, d, v = shape
    x, W, y = measure.make_inputs(n, d, v, dtype, device, peaked=data == "peaked", zipf=data == "zipf")
    ref = measure.fwd_bwd(torch_methods.METHODS["ours-chunked"](), x.double(), W.double(), y)
    floor = x.numel() * x.element_size() + W.numel() * W.element_size()
    rows = []
    for framework, methods, run in (("torch", torch_ms, torch_row), ("jax", jax_ms, jax_row)):
        for mname, method in methods.items():
            def fill(row, run=run, mname=mname, method=method):
                row.update(run(mname, method, x, W, y, ref, device, repeat))
                peak = row.pop("peak_extra_bytes")
                row["peak_extra_mib"] = None if peak is None else peak / 2**20
                row["floor_ratio"] = None if peak is None else peak / floor
                row["tflops"] = 6 * n * d * v / row["fwd_bwd_ms"] / 1e9

            row = {"shape": name, "N": n, "D": d, "V": v, "framework": framework, "method": mname,
                   "dtype": str(dtype).removeprefix("torch.")}
            rows.append(measure.record(row, fill, lambda r: log(format_row(r))))
    return rows, floor


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None, help="comma-separated presets (L,G,S,Q,cpu) or NxDxV; default L,G,S,Q on a GPU, cpu otherwise")
    parser.add_argument("--methods", default=None, help=f"comma-separated; default {','.join(TORCH_DEFAULT + JAX_DEFAULT)}")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bfloat16 on a GPU, float32 on a CPU")
    parser.add_argument("--data", default="random", choices=["random", "peaked", "zipf"])
    parser.add_argument("--sweep-n", default=None, help="comma-separated N values: sweep N of the first shape")
    parser.add_argument("--sweep-v", default=None, help="comma-separated V values: sweep V of the first shape")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per measurement (default 10 on a GPU, 3 on a CPU)")
    parser.add_argument("--out", default=None, help="folder for cross_entropy_{torch,jax}.json (overwritten) and history.csv (appended)")
    parser.add_argument("--json", default=None, help="also write all results in one JSON file here")
    parser.add_argument("--plot", default=None, help="write PNG plots (time and memory against the swept N or V) to this folder")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bfloat16" if gpu else "float32")]
    repeat = args.repeat or (10 if gpu else 3)
    names = args.methods.split(",") if args.methods else TORCH_DEFAULT + JAX_DEFAULT
    unknown = [m for m in names if m not in torch_methods.METHODS and m not in jax_methods.METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {sorted(torch_methods.METHODS) + sorted(jax_methods.METHODS)}")
    torch_ms, skipped = torch_methods.load([m for m in names if m in torch_methods.METHODS])
    jax_ms, jax_skipped = jax_methods.load([m for m in names if m in jax_methods.METHODS])
    skipped.update(jax_skipped)
    shapes = parse_shapes(args.shapes or ("L,G,S,Q" if gpu else "cpu"), args.sweep_n, args.sweep_v)

    log = lambda s: print(s, flush=True)
    env = environment(device)
    env["matmul_tflops"] = measure.matmul_tflops(device, dtype)
    log(f"# {env}")
    for name, reason in skipped.items():
        log(f"# skipped {name}: {reason}")
    report = {"environment": env, "command": store.command("python -m bench", argv), "data": args.data, "skipped": skipped,
              "results": []}
    for i, (name, shape) in enumerate(shapes):
        log(f"# [{i + 1}/{len(shapes)}] {name} N={shape[0]} D={shape[1]} V={shape[2]} {str(dtype).removeprefix('torch.')} {args.data}")
        rows, floor = run_shape(name, shape, torch_ms, jax_ms, dtype, device, args.data, repeat, log)
        log(f"# {name} floor {floor / 2**20:.1f} MiB")
        report["results"].extend(rows)
        if args.out:
            store.write_json(report, args.out, "cross_entropy")
            store.append_history(rows, env, args.out, "cross_entropy")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    if args.plot:
        from bench import plots

        for path in plots.write_plots(report["results"], args.plot):
            log(f"# plot {path}")
    return report


if __name__ == "__main__":
    main()
