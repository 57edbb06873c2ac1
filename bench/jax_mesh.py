"""`python -m bench.jax_mesh`: JAX's losses under `jax.jit` on a mesh of every local device.

The mesh is (dp, tp) = (devices / tp, tp): the rows are sharded over "dp", the head over its
vocabulary on "tp" (`--tp 1`: rows only, the head replicated; `--fsdp`: the head sharded
over "dp" instead, gathered as for a matrix product). The same jitted call as on one
device; `jax_impl.partitioned` splits the work. Per shape and method: fwd+bwd ms (median
of single calls, and per call of calls dispatched back to back, `ms_back_to_back`),
the compiled program's temporaries per device (XLA's memory analysis), and the loss (the
same for every method). "naive" materialises the logits (XLA partitions it itself;
cross-entropy only). `--loss` picks the loss: cross-entropy (default), top-K distillation
(32 teacher entries per row), the dense teacher (a teacher head of the student's shape,
whole on every device), the log-probabilities with the entropy, or the policy loss. On
CPUs, run with XLA_FLAGS=--xla_force_host_platform_device_count=P and
LOGITLESS_PALLAS_INTERPRET=1 (a check, not a measurement). `--json` writes the records.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

METHODS = ("ours-speed", "ours-memory", "naive")


LOSSES = ("cross_entropy", "topk", "dense", "log_probs", "policy")


def _loss(method: str, loss: str):
    """fn(x, W, y, *extras) -> the scalar to differentiate, and extras(rng, n, d, v, dtype):
    the per-row arrays (sharded as the rows) and whole arrays it takes besides."""
    import jax_impl

    strategy = method.removeprefix("ours-")
    if method == "naive":
        def fn(x, W, y):
            logits = jnp.einsum("nd,vd->nv", x, W, preferred_element_type=jnp.float32)
            valid = y != -100
            lse = jax.nn.logsumexp(logits, axis=1)
            picked = jnp.take_along_axis(logits, jnp.where(valid, y, 0)[:, None], axis=1)[:, 0]
            return jnp.where(valid, lse - picked, 0).sum() / valid.sum()
        return fn, lambda *_: ((), ())
    if loss == "cross_entropy":
        return lambda x, W, y: jax_impl.linear_cross_entropy(x, W, y, strategy=strategy), lambda *_: ((), ())
    if loss == "topk":
        def extras(rng, n, d, v, dtype):
            ids = jnp.asarray(rng.integers(0, v, (n, 32)), jnp.int32)
            lp = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((n, 32)), jnp.float32), axis=1)
            return (ids, lp), ()
        return (lambda x, W, y, ids, lp: jax_impl.linear_topk_distillation(x, W, ids, lp, target=y, strategy=strategy),
                extras)
    if loss == "dense":
        def extras(rng, n, d, v, dtype):
            xt = jnp.asarray(rng.standard_normal((n, d)), dtype)
            return (xt,), (jnp.asarray(rng.standard_normal((v, d)) * d**-0.5, dtype),)
        return (lambda x, W, y, xt, Wt: jax_impl.linear_distillation(x, W, xt, Wt, target=y, strategy=strategy),
                extras)
    if loss == "log_probs":
        def fn(x, W, y):
            logp, entropy = jax_impl.linear_log_probs(x, W, y, return_entropy=True, strategy=strategy)
            return logp.sum() + 0.01 * entropy.sum()
        return fn, lambda *_: ((), ())
    return (lambda x, W, y, a: jax_impl.linear_policy_loss(x, W, y, a, strategy=strategy),
            lambda rng, n, d, v, dtype: ((jnp.asarray(rng.standard_normal(n), jnp.float32),), ()))


def back_to_back_ms(step, args, batches: int, calls: int = 10) -> list[float]:
    """ms per call of `calls` calls of step(*args) dispatched back to back, waited for once
    (on its last result: a device runs its programs in order), for each of `batches`
    batches: each device's time per step as a training loop's asynchronous dispatch sees
    it. Lone calls of a program on several GPUs spread widely (bimodal on 2 GPUs,
    bench/NOTES.md); these spread far less."""
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls - 1):
            step(*args)
        jax.block_until_ready(step(*args))
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return times


def run(shapes, methods, dtype: str, tp: int, fsdp: bool, repeat: int, loss_name: str = "cross_entropy") -> list[dict]:
    devices = jax.device_count()
    mesh = jax.make_mesh((devices // tp, tp), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    head = P("dp", None) if fsdp else P("tp" if tp > 1 else None, None)
    records = []
    for n, d, v in shapes:
        rng = np.random.default_rng(0)
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
        x = put(jnp.asarray(rng.standard_normal((n, d)), dtype), P("dp", None))
        W = put(jnp.asarray(rng.standard_normal((v, d)) * d**-0.5, dtype), head)
        y = put(jnp.asarray(np.where(rng.random(n) < 0.1, -100, rng.integers(0, v, n)), jnp.int32), P("dp"))
        for method in methods:
            fn, extras = _loss(method, loss_name)
            rows, whole = extras(np.random.default_rng(1), n, d, v, dtype)
            args = (x, W, y) + tuple(put(a, P("dp", *(None,) * (a.ndim - 1))) for a in rows) + tuple(
                put(a, P()) for a in whole)
            step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
            compiled = step.lower(*args).compile()
            times = []
            for _ in range(repeat + 2):
                start = time.perf_counter()
                loss, grads = step(*args)
                jax.block_until_ready(grads)
                times.append((time.perf_counter() - start) * 1e3)
            records.append(dict(
                shape=f"{n}x{d}x{v}", loss_name=loss_name, method=method, dtype=dtype, devices=devices, tp=tp, fsdp=fsdp,
                ms=statistics.median(times[2:]), ms_back_to_back=statistics.median(back_to_back_ms(step, args, max(repeat // 2, 3))),
                temp_bytes_per_device=compiled.memory_analysis().temp_size_in_bytes,
                loss=float(loss), device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat()))
            print(json.dumps(records[-1]), flush=True)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.jax_mesh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["16384x4096x128256", "8192x2304x256000"], help="NxDxV")
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS,
                        help="default: every method the loss has")
    parser.add_argument("--loss", default="cross_entropy", choices=LOSSES)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, default=None, help="size of the vocabulary axis (default: every device)")
    parser.add_argument("--fsdp", action="store_true", help="the head sharded over the rows' axis instead")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    shapes = [tuple(int(s) for s in shape.split("x")) for shape in args.shapes]
    if args.loss != "cross_entropy" and "naive" in (args.methods or ()):
        parser.error(f"--methods naive is cross-entropy's only (--loss {args.loss})")
    methods = args.methods or [m for m in METHODS if m != "naive" or args.loss == "cross_entropy"]
    records = run(shapes, methods, args.dtype, args.tp or jax.device_count(), args.fsdp, args.repeat, args.loss)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
