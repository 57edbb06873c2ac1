"""JAX "speed" at Q (4096 x 4096 x 128256, bf16) with 10% and 50% of the targets ignored: one
block of all rows (the default, which computes the ignored rows too: a traced count of kept
rows can't size a block) against blocks of the kept rows (`one_speed_block_share=0`), and
PyTorch's "speed" (which plans on the count of kept rows) beside. fwd+bwd ms (median of 10).

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/jax_one_block_ignored.py
"""
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bench import measure
from interop.tuning import Tuning
import jax_impl
from torch_impl import linear_cross_entropy

N, D, V = 4096, 4096, 128256


def jax_ms(x, W, y, tuning) -> float:
    grad = jax.jit(jax.value_and_grad(lambda a, b: jax_impl.linear_cross_entropy(a, b, y, strategy="speed", tuning=tuning),
                                      argnums=(0, 1)))
    times = []
    for i in range(13):
        t0 = time.perf_counter()
        jax.block_until_ready(grad(x, W))
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    dev = torch.device("cuda")
    for frac in (0.1, 0.5):
        x, W, y = measure.make_inputs(N, D, V, torch.bfloat16, dev, ignore_frac=frac)

        def step():
            xx, WW = x.detach().requires_grad_(), W.detach().requires_grad_()
            linear_cross_entropy(xx, WW, y, strategy="speed").backward()

        row = dict(ignored=frac, torch_speed=round(measure.time_ms(step, dev), 2))
        jx, jW = (jnp.asarray(np.asarray(t.float().cpu())).astype(jnp.bfloat16) for t in (x, W))
        jy = jnp.asarray(y.cpu().numpy().astype(np.int32))
        row["jax_one_block"] = round(jax_ms(jx, jW, jy, Tuning()), 2)
        row["jax_blocks"] = round(jax_ms(jx, jW, jy, dataclasses.replace(Tuning(), one_speed_block_share=0)), 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
