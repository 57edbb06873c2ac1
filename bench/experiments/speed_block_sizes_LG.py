"""`speed`'s row blocks at L and G, larger than the default (NVIDIA H100, 2026-11-28, commit
after c3340cf; bench/NOTES.md has the entry): fwd+bwd time and memory over the floor of
cross-entropy (gradients formed in the forward pass) and of log-probabilities + entropy (the
backward pass recomputes), with `Tuning.speed_block_elements` at 2^28 (the default then) to 2^31
(every row in one block: no fp32 grad_weight accumulator). Each row block reads and writes
that accumulator (V D 4 bytes) once.

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/speed_block_sizes_LG.py
"""
import dataclasses
import json

import torch

from bench import measure
from interop.tuning import Tuning
from torch_impl import linear_cross_entropy, linear_log_probs

SHAPES = {"L": (16384, 4096, 128256), "G": (8192, 2304, 256000)}


def main():
    dev = torch.device("cuda")
    for name, (n, d, v) in SHAPES.items():
        x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
        floor = x.numel() * 2 + W.numel() * 2
        g_lp, g_h = torch.randn(n, device=dev), torch.randn(n, device=dev)
        for e in (28, 29, 30, 31):
            t = dataclasses.replace(Tuning(), speed_block_elements=1 << e)

            def cross_entropy():
                xx, WW = x.detach().requires_grad_(), W.detach().requires_grad_()
                linear_cross_entropy(xx, WW, y, strategy="speed", tuning=t).backward()

            def log_probs():
                xx, WW = x.detach().requires_grad_(), W.detach().requires_grad_()
                logp, entropy = linear_log_probs(xx, WW, y, return_entropy=True, strategy="speed", tuning=t)
                ((logp * g_lp).sum() + (entropy * g_h).sum()).backward()

            for loss, step in (("cross_entropy", cross_entropy), ("log_probs", log_probs)):
                row = dict(shape=name, loss=loss, block=f"2^{e}", rows=min(n, (1 << e) // v))
                try:
                    row.update(ms=round(measure.time_ms(step, dev), 2),
                               floor_x=round(measure.peak_extra_bytes(step, dev) / floor, 2))
                except torch.OutOfMemoryError:
                    row["error"] = "OutOfMemoryError"
                torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
