"""JAX's row kernels alone on one block of logits of the bench shapes, under each set of
launch parameters: columns per step (`interop.tuning.BLOCK_COLS`), warps and pipeline
stages (`JAX_ROW_KERNEL_PARAMS`). "stats" is `jax_impl.kernels.block_stats`, "grad"
`block_grad`, "rows" `rows_stats_grad` (both over whole rows in one program per row, the
kernel of cross-entropy's blocks that form the gradients in the forward pass). Each kernel
runs 10 times in one jitted loop (dz written over its input, as in the losses); reports
microseconds per launch and the block's bytes per second (statistics: read once; dz and
rows: read and written once, the second read not counted).
(H200, 2026-11-29; bench/NOTES.md has the entry. The first run, on commit c7feb25's kernels,
timed a prototype of the fused kernel in place of "rows": results/jax_row_kernel_params_sweep.json.)
Writes $OUT/jax_row_kernel_params.json.

Run on a GPU from the repository root (PARAMS: COLSxWARPSxSTAGES,... to try only those):
OUT=/tmp PYTHONPATH=. python bench/experiments/jax_row_kernel_params.py [SHAPE ...]"""
import functools, itertools, json, os, sys, time

import jax
import jax.numpy as jnp

import jax_impl.kernels as K

# rows x columns of one block: "speed"'s blocks at Q, G, L (Q's block: 4096 rows) and S, and
# one of "memory"'s whole-row blocks at L (about 270 rows at 1.1x the floor)
SHAPES = {"Q": (4096, 128256), "G": (2048, 256000), "L": (4096, 128256), "S": (4096, 32000), "L-memory": (256, 128256)}
PARAMS = [tuple(int(v) for v in p.split("x")) for p in os.environ["PARAMS"].split(",")] if os.environ.get("PARAMS") else \
    list(itertools.product((2048, 4096, 8192), (4, 8, 16), (1, 3)))
REPEAT = 10
INTERPRET = jax.default_backend() != "gpu"  # a check of the script on the CPU


def timed(fn, z, donates: bool):
    """Microseconds per kernel launch of a jitted loop of REPEAT launches (a loop that
    donates z gets its own output back as the next z)."""
    z = z.copy() if donates else z
    best = float("inf")
    for i in range(4):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(z))
        if i:
            best = min(best, time.perf_counter() - t0)
        z = out if donates else z
    return best / REPEAT * 1e6


def run(name, R, C):
    key = jax.random.PRNGKey(0)
    z = (jax.random.normal(key, (R, C), jnp.float32) * 4).astype(jnp.bfloat16)
    y = jax.random.randint(key, (R,), 0, C, jnp.int32)
    p = jnp.full((R,), 1.0 / R, jnp.float32)
    zeros, v0 = jnp.zeros((R,), jnp.float32), K.v0_array(0)
    lse = jax.nn.logsumexp(z.astype(jnp.float32), axis=1)
    coefs = (p, jnp.ones((R,), jnp.float32), p * 0.5, zeros)  # P = 1 / R, T = P / 2, S = 0
    nbytes = R * C * 2
    rows = []
    for cols, warps, stages in PARAMS:
        K.BLOCK_COLS, K.JAX_ROW_KERNEL_PARAMS = cols, dict(num_warps=warps, num_stages=stages)

        @jax.jit
        def stats_loop(z):
            init = (jnp.full((R,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
            return jax.lax.fori_loop(0, REPEAT, lambda i, st: K.block_stats(z, v0, None, None, y, st, None, False, INTERPRET), init)

        @functools.partial(jax.jit, donate_argnums=0)
        def grad_loop(z):
            return jax.lax.fori_loop(0, REPEAT, lambda i, z: K.block_grad(z, v0, None, None, y, lse, p, p * 0.5, zeros, None,
                                                                           INTERPRET), z)

        @functools.partial(jax.jit, donate_argnums=0)
        def rows_loop(z):
            return jax.lax.fori_loop(0, REPEAT, lambda i, z: K.rows_stats_grad(z, None, None, y, *coefs, None, False, 0.0,
                                                                                INTERPRET)[3], z)

        try:
            if not rows:  # the fused kernel's lse and dz against the two kernels'
                l2, _, _, dz2 = K.rows_stats_grad(z.copy(), None, None, y, *coefs, None, False, 0.0, INTERPRET)
                dz1 = K.block_grad(z.copy(), v0, None, None, y, lse, p, p * 0.5, zeros, None, INTERPRET)
                print(f"{name}: rows dz off by {float(jnp.abs(dz2.astype(jnp.float32) - dz1.astype(jnp.float32)).max()):.3g}, "
                      f"lse by {float(jnp.abs(l2 - lse).max()):.3g}", flush=True)
            us = {"stats": timed(stats_loop, z, False), "grad": timed(grad_loop, z, True), "rows": timed(rows_loop, z, True)}
        except Exception as e:  # a launch that does not compile (registers, shared memory)
            print(f"{name} {cols} {warps} {stages}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        row = {"shape": name, "rows": R, "cols": C, "block_cols": cols, "warps": warps, "stages": stages,
               **{f"{k}_us": round(v, 1) for k, v in us.items()},
               "stats_TBps": round(nbytes / us["stats"] / 1e6, 2), "grad_TBps": round(2 * nbytes / us["grad"] / 1e6, 2),
               "rows_TBps": round(2 * nbytes / us["rows"] / 1e6, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    names = sys.argv[1:] or list(SHAPES)
    rows = [r for name in names for r in run(name, *SHAPES[name])]
    env = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "jax_row_kernel_params.json"), "w") as f:
        json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
