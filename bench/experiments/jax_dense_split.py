"""`linear_distillation` (jsd) under jax.jit with the student's head split over 2 GPUs ("tp")
and the teacher's replicated (2 x NVIDIA H200, 2026-11-29; bench/results/cuda_tests_dense_split.txt):
loss, grad_input and grad_weight against the float64 reference, beside the same call on one
GPU, fp32 and bf16, both layouts, "speed" and "memory"; W's sharding kept, W never gathered.
Its pass line asks each error within the test suite's tolerance at logit scale 4 or 1.5x one GPU's.

Run on 2 GPUs from the repository root (on CPU devices with
XLA_FLAGS=--xla_force_host_platform_device_count=2 LOGITLESS_PALLAS_INTERPRET=1, smaller):
  PYTHONPATH=. python bench/experiments/jax_dense_split.py
"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jax_impl
from interop.distill_reference import linear_distillation_reference
from interop.distillation import DenseDistillationOptions
from tests.frameworks import tolerance
mesh = jax.make_mesh((1, 2), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
rng = np.random.default_rng(3)
bad = []
for dtype in (jnp.float32, jnp.bfloat16):
    for layout in ("VD", "DV"):
        N, D, Dt, V = (1000, 256, 320, 4096) if jax.devices()[0].platform == "gpu" else (40, 16, 24, 64)
        x = jnp.asarray(rng.standard_normal((N, D)), dtype)
        W = jnp.asarray(rng.standard_normal((V, D) if layout == "VD" else (D, V)) * D**-0.5 * 4, dtype)
        xt = jnp.asarray(rng.standard_normal((N, Dt)), dtype)
        Wt = jnp.asarray(rng.standard_normal((V, Dt) if layout == "VD" else (Dt, V)) * Dt**-0.5 * 4, dtype)
        y = jnp.asarray(np.where(rng.random(N) < 0.1, -100, rng.integers(0, V, N)), jnp.int32)
        for strategy in ("speed", "memory"):
            f = jax.jit(jax.value_and_grad(lambda x, W, xt, Wt: jax_impl.linear_distillation(
                x, W, xt, Wt, target=y, weight_layout=layout, strategy=strategy, divergence="jsd"), argnums=(0, 1)))
            one = f(x, W, xt, Wt)
            ws = P("tp", None) if layout == "VD" else P(None, "tp")
            put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
            args = (put(x, P()), put(W, ws), put(xt, P()), put(Wt, P()))
            two = f(*args)
            hlo = f.lower(*args).compile().as_text()
            gathered = [l.strip()[:90] for l in hlo.splitlines() if " all-gather" in l and ("[%d,%d]" % W.shape) in l]
            f64 = lambda a: np.asarray(a, np.float64)
            ref = linear_distillation_reference(f64(x), f64(W), f64(xt), f64(Wt), target=np.asarray(y), weight_layout=layout,
                                                options=DenseDistillationOptions(divergence="jsd"))
            want = (ref.loss, ref.grad_input, ref.grad_weight)
            err = lambda got: [float(np.linalg.norm(f64(g) - w) / np.linalg.norm(w)) for g, w in zip(jax.tree.leaves(got), want)]
            e1, e2 = err(one), err(two)
            tol = tolerance(jnp.dtype(dtype).name, 4.0)
            print(jnp.dtype(dtype).name, layout, strategy, "rel errs vs float64: 2 GPUs", ["%.1e" % e for e in e2], "one GPU", ["%.1e" % e for e in e1],
                  "tolerance %.1e" % tol, "W sharding", two[1][1].sharding.spec, "gathers of W", len(gathered), flush=True)
            if any(b > max(tol, 1.5 * a) for a, b in zip(e1, e2)) or gathered:  # as accurate as one GPU, or within tolerance
                bad.append((dtype, layout, strategy))
print("BAD", bad)
print("done" if not bad else "failed")
