"""`linear_log_probs` "memory" in forced rows x columns blocks at RL and L (NVIDIA H200,
2026-11-26, commit after 121c3d9; bench/NOTES.md has the entry): fwd+bwd time, memory over
the floor and gradient errors, through `bench.log_probs`' own measurement. A 16-bit
grad_weight is rounded once per row block, so fewer row blocks might err less; the rows'
fp32 grad_input accumulator takes the memory. Plans:

- `halves`: interop.blocking.block_shape, the budget split in half between the accumulator
  and the logits block (PyTorch's "memory"; JAX's distillation losses');
- `rows-first`: the fewest row blocks that leave 4096 columns, spread evenly, the columns after;
- `xla` (JAX): cross-entropy's `xla_memory_block_shape` (XLA's copies and workspace counted).

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/log_probs_memory_blocks.py [SHAPES]
"""
import dataclasses
import sys

import torch

import jax_impl.log_probs as jlp
import torch_impl.log_probs as tlp
from bench import log_probs as bench_lp
from interop import blocking


def rows_first(t, n, d, v, itemsize):
    budget = t.memory_fraction * (n + v) * d * itemsize
    min_rows, min_cols = (max(t.min_block, m) for m in t.min_memory_block)
    rows = blocking.even_rows(t, n, max(min_rows, int(budget // (d * 4 + min(v, min_cols) * itemsize))))
    return rows, min(v, max(min_cols, blocking._round_down(int((budget - rows * d * 4) // (rows * itemsize)), t.min_block)))


RULES = {"rows-first": rows_first, "halves": lambda t, n, d, v, i: blocking.block_shape(t, "memory", n, d, v, i),
         "xla": blocking.xla_memory_block_shape}


def torch_plan(rule):
    original = tlp.plan_steps

    def plan_steps(t, loss, strategy, n, d, v, dtype, *args, **kwargs):
        plan, ops = original(t, loss, strategy, n, d, v, dtype, *args, **kwargs)
        if strategy == "memory":
            rows, cols = RULES[rule](t, n, d, v, dtype.itemsize)
            plan = dataclasses.replace(plan, block_rows=rows, block_cols=cols)
        return plan, ops

    return plan_steps


def jax_plan(rule):
    original = jlp.plan_steps

    def plan(t, loss, o, layout, strategy, n, d, v, dtype, *args):
        cfg = original(t, loss, o, layout, strategy, n, d, v, dtype, *args)
        if strategy == "memory":
            import jax.numpy as jnp

            rows, cols = RULES[rule](t, n, d, v, jnp.dtype(dtype).itemsize)
            cfg = dataclasses.replace(cfg, block_rows=rows, block_cols=cols)
        return cfg

    return plan


def main(shapes):
    def log(r):
        print(f"{r['shape']} {r['framework']:>5} {r['plan']:>10} ", end="")
        print(r.get("error") or f"{r['fwd_bwd_ms']:8.2f} ms  {r['floor_ratio']:.3f}x floor  "
                                f"dx {r['grad_x_err']:.3e}  dW {r['grad_W_err']:.3e}", flush=True)

    rows = []
    for rule in ("rows-first", "halves"):
        tlp.plan_steps = torch_plan(rule)
        got, _ = bench_lp.run_torch(shapes, torch.device("cuda"), 5, lambda r: None, {"ours-memory"})
        rows += [dict(r, plan=rule) for r in got]
        for r in rows[-len(got):]:
            log(r)
    for rule in ("xla", "rows-first", "halves"):
        jlp.plan_steps = jax_plan(rule)
        got = bench_lp.run_jax(shapes, 5, lambda r: None, {"jax-ours-memory"})
        rows += [dict(r, plan=rule) for r in got]
        for r in rows[-len(got):]:
            log(r)
    return rows


if __name__ == "__main__":
    main((sys.argv[1] if len(sys.argv) > 1 else "RL,L").split(","))
