"""JAX's row kernels (`jax_impl.kernels.block_stats` and `block_grad`, one program per row
looping over its columns) alone on one block of logits of the bench shapes, under each set
of launch parameters: columns per step (`interop.tuning.BLOCK_COLS`), warps and pipeline
stages (`JAX_ROW_KERNEL_PARAMS`). Beside them, "fused": one program per row running both
loops (the statistics, then dz from the row's lse), as PyTorch's whole-row kernel does, so
that the second read of a row may come from L2. Each kernel runs 10 times in one jitted
loop (dz written over its input, as in the losses); reports microseconds per launch and the
block's bytes per second (statistics: read once; dz: read and written once).
Writes $OUT/jax_row_kernel_params.json.

Run on a GPU from the repository root:
OUT=/tmp PYTHONPATH=. python bench/experiments/jax_row_kernel_params.py [SHAPE ...]"""
import functools, itertools, json, os, sys, time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

import jax_impl.kernels as K

# rows x columns of one block: "speed"'s blocks at Q, G, L and S, and one of "memory"'s
# whole-row blocks at L (about 270 rows at 1.1x the floor)
SHAPES = {"Q": (4096, 128256), "G": (2048, 256000), "L": (4096, 128256), "S": (4096, 32000), "L-memory": (256, 128256)}
COLS, WARPS, STAGES = (2048, 4096, 8192), (4, 8, 16), (1, 3)
REPEAT = 10
INTERPRET = jax.default_backend() != "gpu"  # a check of the script on the CPU


def fused_kernel(z_ref, y_ref, p_ref, t_ref, s_ref, lse_ref, dz_ref, *, C, block):
    """lse of a row, then dz = P exp(z - lse) - T [j == y] - S over the same row."""
    row = pl.program_id(0)
    y = K._load_scalar(y_ref, row)
    ninf = jnp.float32(-jnp.inf)

    def stats(i, carry):
        m_vec, l_vec = carry
        offs = i * block + jnp.arange(block)
        mask = offs < C
        s = jnp.where(mask, plt.load(z_ref.at[row, pl.ds(i * block, block)], mask=mask, other=0.0).astype(jnp.float32), ninf)
        m_new = K.max_keep_nan(m_vec, s)
        m_safe = jnp.where(m_new == ninf, 0.0, m_new)
        return m_new, l_vec * jnp.exp(m_vec - m_safe) + jnp.exp(s - m_safe)

    m_vec, l_vec = K.column_loop(C, block, stats, (jnp.full((block,), ninf), jnp.zeros((block,), jnp.float32)))
    m = K.reduce_max_keep_nan(m_vec)
    m_safe = jnp.where(m == ninf, 0.0, m)
    lse = m_safe + jnp.log(jnp.sum(jnp.where(m_vec == ninf, 0.0, l_vec * jnp.exp(m_vec - m_safe))))
    K._store_scalar(lse_ref, row, lse)
    p, t, s_coef = K._load_scalar(p_ref, row), K._load_scalar(t_ref, row), K._load_scalar(s_ref, row)

    def grad(i, carry):
        offs = i * block + jnp.arange(block)
        mask = offs < C
        z = plt.load(z_ref.at[row, pl.ds(i * block, block)], mask=mask, other=0.0).astype(jnp.float32)
        dz = p * jnp.exp(z - lse) - jnp.where(offs == y, t, 0.0) - s_coef
        plt.store(dz_ref.at[row, pl.ds(i * block, block)], dz.astype(dz_ref.dtype), mask=mask)
        return carry

    K.column_loop(C, block, grad, 0)


def fused(z, y, p, t, s, cols, params):
    R, C = z.shape
    kernel = functools.partial(fused_kernel, C=C, block=min(cols, pl.next_power_of_2(C)))
    return pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((R,), jnp.float32), jax.ShapeDtypeStruct((R, C), z.dtype)),
                          grid=(R,), input_output_aliases={0: 1}, interpret=INTERPRET,
                          compiler_params=plt.CompilerParams(**params))(z, y, p, t, s)


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
    nbytes = R * C * 2
    rows = []
    for cols, warps, stages in itertools.product(COLS, WARPS, STAGES):
        params = dict(num_warps=warps, num_stages=stages)
        K.BLOCK_COLS, K.JAX_ROW_KERNEL_PARAMS = cols, params

        @jax.jit
        def stats_loop(z):
            init = (jnp.full((R,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
            return jax.lax.fori_loop(0, REPEAT, lambda i, st: K.block_stats(z, v0, None, None, y, st, None, False, INTERPRET), init)

        @functools.partial(jax.jit, donate_argnums=0)
        def grad_loop(z):
            return jax.lax.fori_loop(0, REPEAT, lambda i, z: K.block_grad(z, v0, None, None, y, lse, p, p * 0.5, zeros, None, INTERPRET), z)

        @functools.partial(jax.jit, donate_argnums=0)
        def fused_loop(z):
            return jax.lax.fori_loop(0, REPEAT, lambda i, z: fused(z, y, p, p * 0.5, zeros, cols, params)[1], z)

        try:
            if not rows:  # the fused kernel's dz and lse against the two kernels'
                l2, dz2 = fused(z.copy(), y, p, p * 0.5, zeros, cols, params)
                dz1 = K.block_grad(z.copy(), v0, None, None, y, lse, p, p * 0.5, zeros, None, INTERPRET)
                print(f"{name}: fused dz off by {float(jnp.abs(dz2.astype(jnp.float32) - dz1.astype(jnp.float32)).max()):.3g}, "
                      f"lse by {float(jnp.abs(l2 - lse).max()):.3g}", flush=True)
            us = {"stats": timed(stats_loop, z, False), "grad": timed(grad_loop, z, True), "fused": timed(fused_loop, z, True)}
        except Exception as e:  # a launch that does not compile (registers, shared memory)
            print(f"{name} {cols} {warps} {stages}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        row = {"shape": name, "rows": R, "cols": C, "block_cols": cols, "warps": warps, "stages": stages,
               **{f"{k}_us": round(v, 1) for k, v in us.items()},
               "stats_TBps": round(nbytes / us["stats"] / 1e6, 2), "grad_TBps": round(2 * nbytes / us["grad"] / 1e6, 2),
               "fused_TBps": round(2 * nbytes / us["fused"] / 1e6, 2)}
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
