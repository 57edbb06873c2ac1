"""JAX cross-entropy under jax.jit with the rows sharded over every GPU and W replicated (2 x
NVIDIA H200, 2026-11-29; bench/results/jax_rows_sum.json, bench/NOTES.md "JAX under a mesh:
every loss on 2 GPUs"): the sum of each device's fp32 grad_weight partial as
`partitioned.Axes.summed_slabs` does it ("new": slabs reduce-scattered, the device's slices
joined, one all-gather), as it did before ("old": each slab reduce-scattered and gathered, the
gathered slabs joined), and not at all ("nosum": wrong numbers, timing only); "sSpP": the new
sum with S slabs of grad_weight and grad_input's product in P row pieces (so that the
scheduler can overlap the last slab's reduce-scatter and the all-gather with a product each);
fwd+bwd ms over 5
interleaved rounds, temporaries per device; then an fp32 reduce-scatter and a bf16 all-gather of
[V, D] alone. (An earlier run's slabs x pieces variants used the per-slab gather and a constant
since removed; their numbers are in the same file.)

Run on 2 GPUs from the repository root:
  OUT=/tmp PYTHONPATH=. python bench/experiments/jax_rows_sum.py 16384x4096x128256,8192x2304x256000 new,old,nosum speed
  OUT=/tmp PYTHONPATH=. python bench/experiments/jax_rows_sum.py 16384x4096x128256,8192x2304x256000 new,s4p1,s8p1,s2p2,s4p2 speed
"""
import os, sys, json, time, statistics
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_impl
from jax_impl import head, partitioned

shapes = [tuple(int(s) for s in a.split("x")) for a in sys.argv[1].split(",")]
variants = sys.argv[2].split(",")  # new, old, nosum, sSpP
strategy = sys.argv[3] if len(sys.argv) > 3 else "speed"
devs = jax.device_count()
mesh = jax.make_mesh((devs,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
orig, orig_slabs = partitioned.Axes.summed, partitioned.Axes.summed_slabs
orig_shares, orig_count = head.Head.summed_row_shares, head.ROWS_SUM_SLABS


def in_pieces(pieces):
    """Head.summed_row_shares with grad_input's product in `pieces` row pieces."""
    def shares(self, dz, x_R, dx_dtype):
        edges = [dz.shape[0] * k // pieces for k in range(pieces + 1)]
        W_c = self.head_cols(0, self.vocab)
        dx = jnp.concatenate([self.grad_input_share(dz[a:e], W_c, dx_dtype) for a, e in zip(edges, edges[1:])])
        dW, db, _ = orig_shares(self, dz, x_R, dx_dtype)  # its own whole product is dead code
        return dW, db, dx
    return shares
out = {}
for n, d, v in shapes:
    rng = np.random.default_rng(0)
    x = put(jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16), P("dp", None))
    W = put(jnp.asarray(rng.standard_normal((v, d)) * d**-0.5, jnp.bfloat16), P())
    y = put(jnp.asarray(np.where(rng.random(n) < 0.1, -100, rng.integers(0, v, n)), jnp.int32), P("dp"))
    comp = {}
    for var in variants:
        jax.clear_caches()
        partitioned.Axes.summed, partitioned.Axes.summed_slabs = orig, orig_slabs
        head.Head.summed_row_shares, head.ROWS_SUM_SLABS = orig_shares, orig_count
        if var[0] == "s" and "p" in var:
            slabs, pieces = (int(a) for a in var[1:].split("p"))
            head.ROWS_SUM_SLABS = slabs
            if pieces > 1:
                head.Head.summed_row_shares = in_pieces(pieces)
        elif var == "nosum":
            partitioned.Axes.summed = lambda self, g, dtype, classes=None: g.astype(dtype)
            partitioned.Axes.summed_slabs = lambda self, slabs, dtype, classes: jnp.concatenate([g.astype(dtype) for g in slabs], axis=1 - classes)
        elif var == "old":
            partitioned.Axes.summed_slabs = lambda self, slabs, dtype, classes: jnp.concatenate([self.summed(g, dtype, classes) for g in slabs], axis=1 - classes)
        f = jax.jit(jax.value_and_grad(lambda x, W, y: jax_impl.linear_cross_entropy(x, W, y, strategy=strategy), argnums=(0, 1)))
        t0 = time.perf_counter()
        c = f.lower(x, W, y).compile()
        comp[var] = c
        print(f"compiled {var} in {time.perf_counter()-t0:.1f}s temp {c.memory_analysis().temp_size_in_bytes/1e9:.2f} GB", flush=True)
    partitioned.Axes.summed, partitioned.Axes.summed_slabs = orig, orig_slabs
    head.Head.summed_row_shares, head.ROWS_SUM_SLABS = orig_shares, orig_count
    ref = comp[variants[0]](x, W, y)
    for var, c in comp.items():
        o = c(x, W, y)
        if var != "nosum":
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(o), jax.tree.leaves(ref)))
            print(var, "same as first:", same, flush=True)
    res = {k: [] for k in comp}
    for r in range(5):
        for k, c in comp.items():
            ts = []
            for i in range(6):
                t0 = time.perf_counter(); jax.block_until_ready(c(x, W, y)); ts.append((time.perf_counter() - t0) * 1e3)
            res[k].append(statistics.median(ts[1:]))
    for k in res:
        print(f"{strategy} {n}x{d}x{v} {k}: {statistics.median(res[k]):.2f} ms rounds {[round(t,2) for t in res[k]]} temp {comp[k].memory_analysis().temp_size_in_bytes/1e9:.2f} GB", flush=True)
    out[f"{n}x{d}x{v}"] = {k: dict(median_ms=statistics.median(v_), rounds=v_, temp_gb=comp[k].memory_analysis().temp_size_in_bytes/1e9) for k, v_ in res.items()}
    # raw collectives: fp32 [V, D] reduce-scatter then bf16 all-gather, alone
    from jax import shard_map
    def coll(g):
        m = jax.lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True)
        return jax.lax.all_gather(m.astype(jnp.bfloat16), "dp", axis=0, tiled=True)
    g = put(jnp.ones((devs * v, d), jnp.float32), P("dp", None))
    cf = jax.jit(shard_map(coll, mesh=mesh, in_specs=P("dp", None), out_specs=P("dp", None))).lower(g).compile()
    ts = []
    for i in range(8):
        t0 = time.perf_counter(); jax.block_until_ready(cf(g)); ts.append((time.perf_counter() - t0) * 1e3)
    print(f"collectives alone fp32 RS + bf16 AG of [{v}, {d}]: {statistics.median(ts[2:]):.2f} ms", flush=True)
    out[f"{n}x{d}x{v}"]["collectives_ms"] = statistics.median(ts[2:])
    del x, W, y, comp, g, cf
json.dump(dict(device=jax.devices()[0].device_kind, devices=devs, jax=jax.__version__, strategy=strategy, results=out), open(os.path.join(os.environ.get("OUT", "/tmp"), f"jax_rows_sum_{strategy}.json"), "w"), indent=1)
