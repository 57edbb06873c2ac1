"""JAX "speed" with the logits kept for the backward pass (`Tuning.keep_logits_share`, the
default) against the same call recomputing them (share 0), under `jax.jit` in one process:
per-token log-probabilities + entropy, fwd+bwd with random upstream gradients per row, bf16,
10% of targets ignored; ms, XLA's temporaries over the floor (grad_input + grad_weight
bytes), and how far the kept call's gradients are from the recomputing call's (relative,
max over the array / max of the array) (H200, 2026-11-29; bench/NOTES.md has the entry).
Writes $OUT/jax_kept_logits.json.

Run on a GPU from the repository root:
OUT=/tmp PYTHONPATH=. python bench/experiments/jax_kept_logits.py [SHAPE ...]  (RL, L, G)"""
import dataclasses, json, os, sys, time

import jax
import jax.numpy as jnp
import numpy as np

import jax_impl
from bench.log_probs import SHAPES
from interop.tuning import DEFAULT

KEEP, RECOMPUTE = DEFAULT, dataclasses.replace(DEFAULT, keep_logits_share=0.0)
out = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "rows": []}
path = os.path.join(os.environ.get("OUT", "/tmp"), "jax_kept_logits.json")


def objective(x, W, y, g, g_h, tuning):
    lp, h = jax_impl.linear_log_probs(x, W, y, return_entropy=True, strategy="speed", tuning=tuning)
    return (lp * g).sum() + (h * g_h).sum()


def ms(f, *args, repeat=10):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


for shape in sys.argv[1:] or ["RL", "L", "G"]:
    n, d, v = SHAPES[shape]
    k = jax.random.split(jax.random.key(0), 5)
    x = (jax.random.normal(k[0], (n, d), jnp.float32)).astype(jnp.bfloat16)
    W = (jax.random.normal(k[1], (v, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
    y = jnp.where(jax.random.uniform(k[2], (n,)) < 0.1, -100, jax.random.randint(k[3], (n,), 0, v)).astype(jnp.int32)
    g, g_h = (jnp.where(y != -100, jax.random.normal(kk, (n,)), 0.0) for kk in jax.random.split(k[4]))
    floor = (x.size + W.size) * 2
    grads = {}
    for name, tuning in (("kept", KEEP), ("recomputed", RECOMPUTE)):
        f = jax.jit(jax.grad(objective, (0, 1)), static_argnums=5)
        row = {"shape": shape, "N": n, "D": d, "V": v, "loss": "log_probs", "method": name}
        try:
            temp = f.lower(x, W, y, g, g_h, tuning).compile().memory_analysis().temp_size_in_bytes
            row.update(fwd_bwd_ms=ms(f, x, W, y, g, g_h, tuning), temp_mib=temp / 2**20, floor_ratio=temp / floor)
            grads[name] = f(x, W, y, g, g_h, tuning)
        except Exception as e:  # out of memory: recorded, the run goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    if len(grads) == 2:
        diff = {f"grad_{a}_diff": float(jnp.abs(p.astype(jnp.float32) - q.astype(jnp.float32)).max()
                                         / jnp.abs(q.astype(jnp.float32)).max())
                for a, p, q in zip(("x", "W"), grads["kept"], grads["recomputed"])}
        out["rows"][-2].update(diff)
        print(json.dumps({"shape": shape, **diff}), flush=True)
    del x, W, y, grads
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
