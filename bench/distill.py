"""Benchmark of the distillation losses (PyTorch, one GPU): `python -m bench.distill`.

Top-K teacher (K = 32 and 128): ours ("speed", "speed" with grad_weight accumulated in the
input dtype ("ours-speed-acc16"), "memory") against the naive PyTorch top-K
KD (full student logits, log_softmax, gather) eager and under torch.compile. Dense teacher
(generalised JSD, beta 0.5): ours against liger-kernel's LigerFusedLinearJSD and the naive
formula, eager and compiled. Per method: fwd+bwd time (CUDA events, median), peak memory
beyond the inputs as a multiple of the floor (the bytes of grad_input + grad_weight), and the
errors of loss, grad_input and grad_weight against our fp64 path. Prints a table; with
--out DIR writes DIR/distillation_torch.json and appends the rows to DIR/history.csv
(bench.store), as `python -m bench` does for cross-entropy.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench import measure, store
from bench.__main__ import environment
from torch_impl import linear_distillation, linear_topk_distillation


def naive_topk(x, W, y, ids, lp):
    """The usual top-K KD: full student log_softmax, gathered at the teacher's ids, against
    the teacher's log-probabilities renormalised over its K entries (ours' default)."""
    logq = F.log_softmax((x @ W.T).float(), dim=-1)
    lp = F.log_softmax(lp.float(), dim=-1)
    kd = (lp.exp() * (lp - logq.gather(-1, ids))).sum(-1)
    valid = y != -100
    return (kd * valid).sum() / valid.sum()


def naive_jsd(x, W, xt, Wt, y, beta=0.5):
    lq = F.log_softmax((x @ W.T).float(), dim=-1)
    lp = F.log_softmax((xt @ Wt.T).float(), dim=-1)
    lm = torch.logsumexp(torch.stack([lp + torch.log(torch.tensor(beta)), lq + torch.log(torch.tensor(1 - beta))]), 0)
    jsd = beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)
    valid = y != -100
    return (jsd * valid).sum() / valid.sum()


def topk_methods():
    ours = lambda s, acc=False: lambda x, W, y, ids, lp: linear_topk_distillation(
        x, W, ids, lp, target=y, strategy=s, accumulate_in_input_dtype=acc)
    return {"ours-speed": ours("speed"), "ours-speed-acc16": ours("speed", True), "ours-memory": ours("memory"),
            "naive-eager": naive_topk, "naive-compile": torch.compile(naive_topk)}, ours("chunked")


def dense_methods():
    ours = lambda s, acc=False: lambda x, W, xt, Wt, y: linear_distillation(
        x, W, xt, Wt, target=y, divergence="jsd", beta=0.5, strategy=s, accumulate_in_input_dtype=acc)
    methods = {"ours-speed": ours("speed"), "ours-speed-acc16": ours("speed", True), "ours-memory": ours("memory"),
               "naive-eager": naive_jsd, "naive-compile": torch.compile(naive_jsd)}
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=0.5, ignore_index=-100, temperature=1.0)
        methods["liger"] = lambda x, W, xt, Wt, y: jsd(x, W, xt, Wt, y)
    except ImportError as e:
        print(f"liger skipped: {e}")
    return methods, ours("chunked")


def teacher_topk(x, W, k, chunk=2048):
    """The top-k ids and log-probabilities of a teacher whose head is W plus noise."""
    gen = torch.Generator(device=x.device).manual_seed(1)
    Wt = (W.float() + 0.5 * torch.randn(W.shape, device=x.device, generator=gen) / W.shape[1] ** 0.5).to(W.dtype)
    ids, lps = [], []
    for i in range(0, x.shape[0], chunk):
        lp = F.log_softmax((x[i : i + chunk] @ Wt.T).float(), dim=-1)
        v, j = lp.topk(k, dim=-1)
        ids.append(j)
        lps.append(v)
    return torch.cat(ids), torch.cat(lps)


def measure_method(fn, diff, rest, ref, device, repeat):
    def fwd_bwd():
        a = [t.detach().requires_grad_() for t in diff]
        loss = fn(*a, *rest)
        loss.backward()
        return loss.detach(), a[0].grad, a[1].grad

    row = {"fwd_bwd_ms": measure.time_ms(fwd_bwd, device, repeat=repeat)}
    with torch.no_grad():
        row["fwd_ms"] = measure.time_ms(lambda: fn(*diff, *rest), device, repeat=repeat)
    row["peak_extra_bytes"] = measure.peak_extra_bytes(fwd_bwd, device)
    loss, dx, dW = fwd_bwd()
    row.update(loss_err=measure.rel_err(loss, ref[0]), grad_x_err=measure.rel_err(dx, ref[1]),
               grad_W_err=measure.rel_err(dW, ref[2]))
    return row


def run(shapes, ks, dtype, device, repeat, log, only=None, dense=True):
    """Rows of results; `only`: the method names to run (all when None); dense: also the
    dense-teacher loss."""
    rows = []
    for shape in shapes:
        n, d, v = measure.PRESETS[shape]
        x, W, y = measure.make_inputs(n, d, v, dtype, device)
        floor = x.numel() * x.element_size() + W.numel() * W.element_size()
        problems = []
        for k in ks:
            ids, lp = teacher_topk(x, W, k)
            problems.append((f"topk K={k}", topk_methods, (y, ids, lp)))
        if dense:
            gen = torch.Generator(device=device).manual_seed(2)
            xt = torch.randn(n, d, device=device, generator=gen).to(dtype)
            Wt = (torch.randn(v, d, device=device, generator=gen) / d**0.5).to(dtype)
            problems.append(("dense jsd", dense_methods, (xt, Wt, y)))
        for loss_name, make, rest in problems:
            methods, ref_method = make()
            dbl = [r.double() if r.is_floating_point() and r.dim() > 1 and r.shape[1] == d else r for r in rest]
            a = [t.double().requires_grad_() for t in (x, W)]
            ref_loss = ref_method(*a, *dbl)
            ref_loss.backward()
            ref = (ref_loss.detach(), a[0].grad, a[1].grad)
            del a
            for name, fn in methods.items():
                if only is not None and name not in only:
                    continue
                def fill(row, fn=fn, rest=rest, ref=ref):
                    row.update(measure_method(fn, (x, W), rest, ref, device, repeat))
                    peak = row.pop("peak_extra_bytes")
                    row.update(peak_extra_mib=peak / 2**20, floor_ratio=peak / floor)

                row = {"shape": shape, "N": n, "D": d, "V": v, "loss": loss_name, "framework": "torch", "method": name,
                       "dtype": str(dtype).removeprefix("torch.")}
                rows.append(measure.record(row, fill, log))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.distill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="L,G")
    parser.add_argument("--k", default="32,128", help='comma-separated K of the top-K losses ("" for none)')
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default=None, help="folder for distillation_torch.json (overwritten) and history.csv (appended)")
    parser.add_argument("--json", default=None, help="also write the rows in one JSON file here")
    parser.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    parser.add_argument("--no-dense", action="store_true", help="only the top-K losses")
    args = parser.parse_args(argv)
    device = torch.device("cuda")

    def log(r):
        if "error" in r:
            print(f"{r['shape']} {r['loss']:>11} {r['method']:>14}  {r['error']}", flush=True)
            return
        print(f"{r['shape']} {r['loss']:>11} {r['method']:>14}  fwd {r['fwd_ms']:7.1f} ms  fwd+bwd {r['fwd_bwd_ms']:7.1f} ms"
              f"  mem {r['floor_ratio']:5.2f}x floor  err loss {r['loss_err']:.1e} dx {r['grad_x_err']:.1e}"
              f" dW {r['grad_W_err']:.1e}", flush=True)

    only = None if args.methods is None else set(args.methods.split(","))
    rows = run(args.shapes.split(","), [int(k) for k in args.k.split(",") if k], torch.bfloat16, device, args.repeat, log, only,
               dense=not args.no_dense)
    env = environment(device)
    if args.out:
        report = {"environment": env, "command": store.command("python -m bench.distill", argv), "skipped": {}, "results": rows}
        store.write_json(report, args.out, "distillation")
        store.append_history(rows, env, args.out, "distillation")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
