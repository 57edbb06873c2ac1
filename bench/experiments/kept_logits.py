"""PyTorch "speed" with the logits kept for the backward pass (`Tuning.keep_logits_share`,
the default) against the same call recomputing them (share 0), in one process: per-token
log-probabilities + entropy, and cross-entropy with reduction "none", fwd+bwd with random
upstream gradients per row, bf16, 10% of targets ignored; ms, peak memory beyond the inputs
over the floor (grad_input + grad_weight bytes), and the gradients' errors against float64
(log-probabilities) (H200, 2026-11-28; results at ac23b9b in bench/results/kept_logits.json, bench/NOTES.md
has the entry). Writes $OUT/kept_logits.json.

Run on a GPU from the repository root:
OUT=/tmp PYTHONPATH=. python bench/experiments/kept_logits.py [SHAPE ...]  (RL, L, G, S, Q)"""
import dataclasses, json, os, sys, time

import torch

from bench import measure
from bench.log_probs import SHAPES
from interop.tuning import DEFAULT
from torch_impl import linear_cross_entropy, linear_log_probs

KEEP, RECOMPUTE = DEFAULT, dataclasses.replace(DEFAULT, keep_logits_share=0.0)
dev = torch.device("cuda")
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": []}
path = os.path.join(os.environ.get("OUT", "/tmp"), "kept_logits.json")


def step(loss, x, W, y, g, tuning, strategy="speed"):
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    if loss == "log_probs":
        lp, h = linear_log_probs(x, W, y, return_entropy=True, strategy=strategy, tuning=tuning)
        total = (lp * g[0]).sum() + (h * g[1]).sum()
    else:
        total = (linear_cross_entropy(x, W, y, reduction="none", strategy=strategy, tuning=tuning) * g[0]).sum()
    total.backward()
    return x.grad, W.grad


for shape in sys.argv[1:] or ["RL", "L", "G"]:
    n, d, v = SHAPES[shape]
    x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
    floor = x.numel() * 2 + W.numel() * 2
    gen = torch.Generator(device=dev).manual_seed(3)
    g = [torch.where(y != -100, torch.randn(n, device=dev, generator=gen), 0.0) for _ in range(2)]
    for loss in ("log_probs", "cross_entropy_none"):
        ref = step(loss, x.double(), W.double(), y, [t.double() for t in g], KEEP, "chunked") if loss == "log_probs" else None
        for name, tuning in (("kept", KEEP), ("recomputed", RECOMPUTE)):
            def fill(row, tuning=tuning):
                run = lambda: step(loss, x, W, y, g, tuning)
                row["fwd_bwd_ms"] = measure.time_ms(run, dev, repeat=10)
                peak = measure.peak_extra_bytes(run, dev)
                row.update(peak_extra_mib=peak / 2**20, floor_ratio=peak / floor)
                if ref is not None:
                    dx, dW = run()
                    row.update(grad_x_err=measure.rel_err(dx, ref[0]), grad_W_err=measure.rel_err(dW, ref[1]))
            row = {"shape": shape, "N": n, "D": d, "V": v, "loss": loss, "method": name}
            out["rows"].append(measure.record(row, fill, lambda r: print(json.dumps(r), flush=True)))
        ref = None
        torch.cuda.empty_cache()
    del x, W, y
    torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
