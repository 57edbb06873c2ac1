"""JAX cross-entropy "speed" under jit with the rows and an FSDP head (the head's classes
sharded as the rows) over every local device: where grad_input's product runs against
grad_weight's slabs (`jax_impl.head.Head.summed_row_shares`). "library": its product first
(an optimization barrier, the library's order); "free": no barrier, XLA's scheduler places
it (after the slabs, to overlap the last slab's sum); "between": after the first slab.
(NVIDIA H200 x 2, 2026-11-30; bench/NOTES.md has the entry,
bench/results/jax_mesh_2gpu_fsdp_order.json the numbers.)

  variants SHAPES: per order, fwd+bwd ms (4 interleaved rounds of 5, medians; wall time of
    the jitted call), temporaries per device, results bit-equal to the library order's.
    ("after", grad_input's product after the sum, is `jax_rows_ring.py`'s variant.)
  bound SHAPES: per order, temporaries per device against 1.1x one device's local problem's
    (N / P rows, the whole head) plus the gathered bf16 head and one fp32 [V, D] partial.

Run on GPUs from the repository root:
  OUT=/tmp PYTHONPATH=. python bench/experiments/jax_fsdp_order.py variants 16384x4096x128256,8192x2304x256000
"""
import json, os, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_impl
from jax_impl import head as H
from interop.tuning import ROWS_SUM_SLABS

LIBRARY = H.Head.summed_row_shares


def reordered(order):
    """Head.summed_row_shares with grad_input's product unordered ("free"), between the
    first slab and the others ("between"), or after grad_weight's sum ("after": no
    collective of the sum can run beside it)."""
    def summed_row_shares(self, dz, x_R, dx_dtype):
        wide, hidden = H._wide(dz), x_R.shape[1]
        edges = [hidden * k // ROWS_SUM_SLABS for k in range(ROWS_SUM_SLABS + 1)]
        dx = lambda dz: self.grad_input_share(dz, self.head_cols(0, self.vocab), dx_dtype)
        parts = []
        if order == "between":
            parts.append(self.grad_weight_share(dz, x_R[:, edges[0]:edges[1]], wide))
            dz, parts[0] = jax.lax.optimization_barrier((dz, parts[0]))
            dx_R = dx(dz)
            dz, dx_R = jax.lax.optimization_barrier((dz, dx_R))
        elif order == "free":
            dx_R = dx(dz)
        parts += [self.grad_weight_share(dz, x_R[:, a:e], wide) for a, e in zip(edges[len(parts):], edges[len(parts) + 1:])]
        dW = self.split_rows.summed_slabs(parts, self.W.dtype, 0 if self.vd else 1)
        db = None if self.b is None else self.split_rows.summed(dz.astype(wide).sum(0), self.b.dtype, 0)
        if order == "after":
            dz, dW = jax.lax.optimization_barrier((dz, dW))
            dx_R = dx(dz)
        return dW, db, dx_R
    return summed_row_shares


ORDERS = {"library": LIBRARY, "free": reordered("free"), "between": reordered("between")}


def compiled(order, *args):
    return compiled_with(ORDERS[order], *args)


def compiled_with(summed_row_shares, *args):
    """The compiled fwd+bwd of cross-entropy "speed" on args with Head.summed_row_shares
    replaced by the given function."""
    H.Head.summed_row_shares = summed_row_shares
    try:
        f = jax.jit(jax.value_and_grad(lambda x, W, y: jax_impl.linear_cross_entropy(x, W, y, strategy="speed"),
                                       argnums=(0, 1)))
        return f.lower(*args).compile()
    finally:
        H.Head.summed_row_shares = LIBRARY


def call_ms(c, args, calls: int = 5, warmup: int = 2) -> list[float]:
    """ms of each of `calls` lone calls of c(*args), each waited for, after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(c(*args))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(c(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return times


def bit_equal(a, b) -> bool:
    """Whether two pytrees of arrays are equal bit for bit."""
    return all(bool(jnp.array_equal(p, q)) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def inputs(shape: str, fsdp: bool = True):
    """(n, d, v), the whole bf16 (x, W, y) of an NxDxV shape (a tenth of the targets ignored),
    and the same put on a mesh of every local device: the rows over "dp", W's classes over
    "dp" too (FSDP) or replicated."""
    n, d, v = (int(s) for s in shape.split("x"))
    mesh = jax.make_mesh((jax.device_count(),), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    W = jnp.asarray(rng.standard_normal((v, d)) * d**-0.5, jnp.bfloat16)
    y = jnp.asarray(np.where(rng.random(n) < 0.1, -100, rng.integers(0, v, n)), jnp.int32)
    return (n, d, v), (x, W, y), (put(x, P("dp", None)), put(W, P("dp", None) if fsdp else P()), put(y, P("dp")))


def main(mode, shapes):
    devices = jax.device_count()
    res = {"device": jax.devices()[0].device_kind, "devices": devices, "jax": jax.__version__, "mode": mode}
    for shape in shapes.split(","):
        (n, d, v), (x, W, y), args = inputs(shape)
        fns = {order: compiled(order, *args) for order in ORDERS}
        temps = {k: c.memory_analysis().temp_size_in_bytes for k, c in fns.items()}
        if mode == "bound":
            local = compiled("library", x[: n // devices], W, y[: n // devices]).memory_analysis().temp_size_in_bytes
            bound = 1.1 * local + 6 * v * d
            res[shape] = {"local_temp_bytes": local, "bound_bytes": bound,
                          **{f"{k} temp_bytes": t for k, t in temps.items()},
                          **{f"{k} / bound": round(t / bound, 3) for k, t in temps.items()}}
        else:
            out = {k: c(*args) for k, c in fns.items()}
            times = {k: [] for k in fns}
            for _ in range(4):
                for k, c in fns.items():
                    times[k] += call_ms(c, args)
            res[shape] = {k: {"ms": round(statistics.median(times[k]), 2), "ms_rounds": [round(t, 2) for t in times[k]],
                              "temp_GB": round(temps[k] / 1e9, 3), "bit_equal": bit_equal(out["library"], out[k])}
                          for k in fns}
        print(shape, json.dumps(res[shape]), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"jax_fsdp_order_{mode}.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
