"""Does JAX memory's grad_weight update at L run slower in its loop (~1.02 ms a 250-row
block in a profile of the whole call) than on its own (~0.77 ms measured another way)?
Kernels seen by CUPTI, printed: no, the same cuBLAS kernel at the same 1.02 ms both ways
(H100, 2026-11-25; the output is in git history at f614a9c, bench/NOTES.md has the entry).

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/jax_memory_dw_kernels_L.py"""
import torch
import jax, jax.numpy as jnp
import jax_impl
from bench import measure
from interop.dlpack import to_jax
from torch.profiler import profile, ProfilerActivity

dev = torch.device("cuda")


def kernels(fn, label, calls=2):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]
    print(f"== {label}")
    for e in rows:
        print(f"  {e.device_time_total / 1e3 / calls:8.2f} ms/call  {e.count // calls:5d} x {e.device_time_total / max(e.count, 1):8.1f} us  {e.key[:150]}")


n, d, v = 16384, 4096, 128256
x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
xj, Wj, yj = to_jax(x), to_jax(W), to_jax(y.int())
f = jax.jit(jax.value_and_grad(lambda x, W, y: jax_impl.linear_cross_entropy(x, W, y, strategy="memory"), argnums=(0, 1)))
kernels(lambda: jax.block_until_ready(f(xj, Wj, yj)), "L memory fwd+bwd")
del x, W, y

R = 250
k = jax.random.split(jax.random.key(0), 3)
dzs = (jax.random.normal(k[0], (10, R, v)) * 1e-3).astype(jnp.bfloat16)
xs = jax.random.normal(k[1], (10, R, d)).astype(jnp.bfloat16)
dW0 = jnp.zeros((v, d), jnp.bfloat16)
share = lambda dz, x: jax.lax.dot_general(dz, x, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
loop = jax.jit(lambda dW: jax.lax.fori_loop(0, 10, lambda i, dW: dW + share(dzs[i], xs[i]), dW), donate_argnums=0)
dW = loop(dW0)
holder = [dW]
def run_loop():
    holder[0] = loop(holder[0]); holder[0].block_until_ready()
kernels(run_loop, "dW += dz^T x, 10 in a fori_loop (R = 250)")
one = jax.jit(lambda dW, dz, x: dW + share(dz, x), donate_argnums=0)
def run_one():
    holder[0] = one(holder[0], dzs[0], xs[0]); holder[0].block_until_ready()
kernels(run_one, "dW += dz^T x, one call (R = 250)", calls=10)
