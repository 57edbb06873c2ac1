"""JAX log-probabilities with the entropy at Llama-3.2-1B's head (16384 x 2048 x 128256,
bf16, random upstream gradients of both): "memory" (its plan printed: `row_products`' tiles
since the plan of least estimated time) and "speed" against "chunked" (fp32 logits), the
relative (Frobenius) error of grad_input and grad_weight (H200, 2026-11-28; results at 00e9b14
in bench/results/cuda_tests_jax_log_probs_plans.txt, bench/NOTES.md has the entry).

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/jax_log_probs_memory_errors.py"""
import jax, jax.numpy as jnp, numpy as np
import jax_impl
from interop.tuning import DEFAULT
from jax_impl.distill_rules import plan_steps
from interop.log_probs import LogProbsOptions
n, d, v = 16384, 2048, 128256
cfg = plan_steps(DEFAULT, "log_probs", LogProbsOptions(), "VD", "memory", n, d, v, jnp.bfloat16, False, "gpu")
print("memory plan", cfg.block_rows, cfg.block_cols, cfg.kernel_products)
k = jax.random.split(jax.random.PRNGKey(0), 5)
x = jax.random.normal(k[0], (n, d), jnp.float32).astype(jnp.bfloat16)
W = (jax.random.normal(k[1], (v, d), jnp.float32) * 0.02).astype(jnp.bfloat16)
y = jax.random.randint(k[2], (n,), 0, v).at[::10].set(-100)
g1, g2 = jax.random.normal(k[3], (n,)), jax.random.normal(k[4], (n,))
def f(strategy):
    def loss(x, W):
        lp, H = jax_impl.linear_log_probs(x, W, y, return_entropy=True, strategy=strategy)
        return (lp * g1).sum() + (H * g2).sum()
    return jax.jit(jax.grad(loss, (0, 1)))
ref = [a.astype(jnp.float32) for a in f("chunked")(x, W)]
rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
for s in ("speed", "memory"):
    got = f(s)(x, W)
    print(s, "dx rel", rel(got[0], ref[0]), "dW rel", rel(got[1], ref[1]))
