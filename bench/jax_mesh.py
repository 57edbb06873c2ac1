"""`python -m bench.jax_mesh`: JAX's cross-entropy under `jax.jit` on a mesh of every local device.

The mesh is (dp, tp) = (devices / tp, tp): the rows are sharded over "dp", the head over its
vocabulary on "tp" (`--tp 1`: rows only, the head replicated; `--fsdp`: the head sharded
over "dp" instead, gathered as for a matrix product). The same jitted call as on one
device; `jax_impl.partitioned` splits the work. Per shape and method: fwd+bwd ms (median),
the compiled program's temporaries per device (XLA's memory analysis), and the loss (the
same for every method). "naive" materialises the logits (XLA partitions it itself). On
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


def _loss(method: str):
    import jax_impl

    if method == "naive":
        def loss(x, W, y):
            logits = jnp.einsum("nd,vd->nv", x, W, preferred_element_type=jnp.float32)
            valid = y != -100
            lse = jax.nn.logsumexp(logits, axis=1)
            picked = jnp.take_along_axis(logits, jnp.where(valid, y, 0)[:, None], axis=1)[:, 0]
            return jnp.where(valid, lse - picked, 0).sum() / valid.sum()
        return loss
    return lambda x, W, y: jax_impl.linear_cross_entropy(x, W, y, strategy=method.removeprefix("ours-"))


def run(shapes, methods, dtype: str, tp: int, fsdp: bool, repeat: int) -> list[dict]:
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
            step = jax.jit(jax.value_and_grad(_loss(method), argnums=(0, 1)))
            compiled = step.lower(x, W, y).compile()
            times = []
            for _ in range(repeat + 2):
                start = time.perf_counter()
                loss, grads = step(x, W, y)
                jax.block_until_ready(grads)
                times.append((time.perf_counter() - start) * 1e3)
            records.append(dict(
                shape=f"{n}x{d}x{v}", method=method, dtype=dtype, devices=devices, tp=tp, fsdp=fsdp,
                ms=statistics.median(times[2:]), temp_bytes_per_device=compiled.memory_analysis().temp_size_in_bytes,
                loss=float(loss), device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
                date=datetime.date.today().isoformat()))
            print(json.dumps(records[-1]), flush=True)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.jax_mesh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["16384x4096x128256", "8192x2304x256000"], help="NxDxV")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, default=None, help="size of the vocabulary axis (default: every device)")
    parser.add_argument("--fsdp", action="store_true", help="the head sharded over the rows' axis instead")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    shapes = [tuple(int(s) for s in shape.split("x")) for shape in args.shapes]
    records = run(shapes, args.methods, args.dtype, args.tp or jax.device_count(), args.fsdp, args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
