"""`memory`'s choice between whole-row blocks and rows x columns tiles at small heads
(NVIDIA H100; bench/NOTES.md has the entry): fwd+bwd time and memory over the floor of
cross-entropy at S and neighbouring shapes, with `Tuning.min_whole_rows` at its default (S
then runs in 1024 x 4096 tiles) and lowered so that whole rows are taken (S: first block of
about 230 rows), beside Liger's time in the same process where it imports.

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/memory_whole_rows_small.py
"""
import dataclasses
import json

import torch

from bench import measure, torch_methods
from interop.planning import plan
from interop.tuning import Tuning
from torch_impl import linear_cross_entropy

SHAPES = {"S": (4096, 1024, 32000), "S2": (4096, 2048, 32000), "GPT2": (8192, 768, 50257),
          "Q": (4096, 4096, 128256), "QQ": (2048, 4096, 151936), "G4": (4096, 2304, 256000)}


def main():
    dev = torch.device("cuda")
    liger, _ = torch_methods.load(["liger"])
    for name, (n, d, v) in SHAPES.items():
        x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
        floor = x.numel() * 2 + W.numel() * 2
        for label, t in (("default", Tuning()), ("whole", dataclasses.replace(Tuning(), min_whole_rows=32)),
                         ("liger", None)):
            if t is None and not liger:
                continue

            def step():
                xx, WW = x.detach().requires_grad_(), W.detach().requires_grad_()
                if t is None:
                    liger["liger"](xx, WW, y).backward()
                else:
                    linear_cross_entropy(xx, WW, y, strategy="memory", tuning=t).backward()

            row = dict(shape=name, N=n, D=d, V=v, tuning=label)
            if t is not None:
                p = plan(t, "torch", "cross_entropy", "memory", n, d, v, 2, False, gathered_rows=True, n_all=n)
                row["plan"] = f"{p.layout} {p.rows}x{p.cols}"
            row.update(ms=round(measure.time_ms(step, dev), 3), floor_x=round(measure.peak_extra_bytes(step, dev) / floor, 3))
            torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
