"""JAX "speed" with the logits kept for the backward pass (`Tuning.keep_logits_share`, the
default) against the same call recomputing them (share 0), under `jax.jit` in one process:
per-token log-probabilities + entropy, cross-entropy per row with lse, top-K distillation per
row (K 32), fwd+bwd with random upstream gradients per row, bf16, 10% of targets ignored; ms, XLA's temporaries over the floor (grad_input + grad_weight
bytes), and how far the kept call's gradients are from the recomputing call's (relative,
max over the array / max of the array) (H200, 2026-11-29; bench/NOTES.md has the entry).
Writes $OUT/jax_kept_logits.json.

Run on a GPU from the repository root:
OUT=/tmp PYTHONPATH=. python bench/experiments/jax_kept_logits.py [SHAPE ...] [--losses log_probs,cross_entropy,topk]
(RL, L, G)"""
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


def objective(loss, x, W, y, g, g_h, ids, teacher, tuning):
    if loss == "log_probs":
        lp, h = jax_impl.linear_log_probs(x, W, y, return_entropy=True, strategy="speed", tuning=tuning)
        return (lp * g).sum() + (h * g_h).sum()
    if loss == "cross_entropy":
        per_row, lse = jax_impl.linear_cross_entropy(x, W, y, reduction="none", return_lse=True, strategy="speed",
                                                     tuning=tuning)
        return (per_row * g).sum() + (lse * g_h).sum()
    per_row = jax_impl.linear_topk_distillation(x, W, ids, teacher, reduction="none", strategy="speed", tuning=tuning)
    return (per_row * g).sum()


def ms(f, *args, repeat=10):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


args = [a for a in sys.argv[1:] if not a.startswith("--losses")]
losses = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--losses=")), ["log_probs"])
for shape in args or ["RL", "L", "G"]:
    n, d, v = SHAPES[shape]
    k = jax.random.split(jax.random.key(0), 5)
    x = (jax.random.normal(k[0], (n, d), jnp.float32)).astype(jnp.bfloat16)
    W = (jax.random.normal(k[1], (v, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
    y = jnp.where(jax.random.uniform(k[2], (n,)) < 0.1, -100, jax.random.randint(k[3], (n,), 0, v)).astype(jnp.int32)
    g, g_h = (jnp.where(y != -100, jax.random.normal(kk, (n,)), 0.0) for kk in jax.random.split(k[4]))
    ids = jax.random.randint(k[3], (n, 32), 0, v).astype(jnp.int32)
    teacher = jax.nn.log_softmax(jax.random.normal(k[2], (n, 32)))
    floor = (x.size + W.size) * 2
    for loss in losses:
        grads = {}
        for name, tuning in (("kept", KEEP), ("recomputed", RECOMPUTE)):
            f = jax.jit(jax.grad(objective, (1, 2)), static_argnums=(0, 8))
            a = (loss, x, W, y, g, g_h, ids, teacher, tuning)
            row = {"shape": shape, "N": n, "D": d, "V": v, "loss": loss, "method": name}
            try:
                temp = f.lower(*a).compile().memory_analysis().temp_size_in_bytes
                row.update(fwd_bwd_ms=ms(f, *a), temp_mib=temp / 2**20, floor_ratio=temp / floor)
                grads[name] = f(*a)
            except Exception as e:  # out of memory: recorded, the run goes on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
        if len(grads) == 2:
            diff = {f"grad_{a}_diff": float(jnp.abs(p.astype(jnp.float32) - q.astype(jnp.float32)).max()
                                             / jnp.abs(q.astype(jnp.float32)).max())
                    for a, p, q in zip(("x", "W"), grads["kept"], grads["recomputed"])}
            out["rows"][-2].update(diff)
            print(json.dumps({"shape": shape, "loss": loss, **diff}), flush=True)
        del grads
    del x, W, y
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
