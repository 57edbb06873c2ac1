"""XLA's memory (temp + output) for JAX "memory" in rows x columns blocks, compile only, blocks
forced: how it grows with the block's rows, N, D and V (interop.blocking._xla_memory_rows had
counted 512 bytes per row of N, Tuning.xla_row_bytes of whole rows at L; XLA holds ~13 here).
H100, 2026-11-25; results in git history at 9e19130, bench/NOTES.md has the entry. Writes
$OUT/jax_memory_xla_model_G.json.

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/jax_memory_xla_model_G.py"""
import json, os, time
import jax, jax.numpy as jnp
import jax_impl
import jax_impl.blocked as blocked

default = blocked.xla_memory_block_shape


def needed(n, d, v, rows, cols, return_lse=False):
    blocked.xla_memory_block_shape = (lambda *a: (rows, cols)) if rows else default
    y = jnp.where(jnp.arange(n) % 10 == 0, -100, jnp.arange(n) * 7919 % v).astype(jnp.int32)

    def loss(x, W):
        out = jax_impl.linear_cross_entropy(x, W, y, strategy="memory", return_lse=return_lse)
        return (out[0] + 0 * out[1].sum()) if return_lse else out

    args = [jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((v, d), jnp.bfloat16)]
    a = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    return a.temp_size_in_bytes + a.output_size_in_bytes


cases = [(8192, 2304, 256000, r, 2048, False) for r in (2816, 3072, 3584, 3712, 3840)]
cases += [(n, 2304, 256000, 2816, 2048, False) for n in (4096, 12288, 16384)]
cases += [(8192, 2304, 256000, 3712, 2048, True), (8192, 2304, 256000, 2816, 2048, True)]
cases += [(8192, 3072, 256000, 2816, 2048, False), (8192, 1536, 256000, 2816, 2048, False),
          (8192, 2304, 128000, 2816, 2048, False), (8192, 2304, 256000, 2816, 1536, False),
          (16384, 2304, 256000, 3712, 2048, False), (16384, 2304, 256000, 3712, 2048, True)]
out = {"gpu": str(jax.devices()[0].device_kind), "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "rows": []}
for n, d, v, rows, cols, lse in cases:
    b = needed(n, d, v, rows, cols, lse)
    floor = (n + v) * d * 2
    beyond = (b - floor) / 2**20
    out["rows"].append(dict(n=n, d=d, v=v, rows=rows, cols=cols, return_lse=lse, bytes=b, x_floor=b / floor,
                            beyond_floor_mib=beyond, bound_margin_mib=(1.10 * floor + 16 * n - b) / 2**20))
    print(f"N {n:6d} D {d} V {v} rows {rows} cols {cols} lse {lse!s:5s}: {b / floor:.4f}x, {beyond:7.2f} MiB beyond the floor,"
          f" margin to the bound {(1.10 * floor + 16 * n - b) / 2**20:6.2f} MiB", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "jax_memory_xla_model_G.json"), "w"), indent=1)
