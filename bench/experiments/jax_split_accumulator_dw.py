"""A prototype, not in the package (H100, 2026-11-24; results in git history at e80f16e,
bench/NOTES.md has the entry).

JAX "speed" holds an fp32 grad_weight accumulator (2 W) beside the bf16 gradient XLA returns
(W): 3 W, 2.67x the floor at L before any logits block. Kept as two 16-bit planes, the upper
half (bf16, the returned gradient's own buffer) and the lower half (uint16) of each fp32 value,
the accumulator is exactly fp32 and needs 2 W; a last pass would round hi + lo into hi. XLA's
products cannot update such planes, so dW += dz^T x must be a kernel that reads and writes
them in place. Both versions below are exact (they match XLA's fp32 accumulation), and both
are ~30% slower than cuBLAS at one "speed" block (H100: L 4.59-4.72 ms vs 3.49-3.54, G
3.28-3.42 vs 2.50-2.58), ~8 ms at L over its 7-8 blocks: not taken. These are the measured
kernels tidied afterwards (the bit juggling shared by `_join` / `_halves`, the Mosaic variant
that loads the planes after the main loop, its fastest); the tidied Triton version was checked
in interpret mode only, the tidied Mosaic version not re-run. The Triton kernel's K loop is
`row_products._grad_weight_kernel`'s, with the split epilogue in place of its one rounding.

Run on a GPU from the repository root: PYTHONPATH=. python bench/experiments/jax_split_accumulator_dw.py
"""
import functools, statistics, time
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax_impl import row_products as rp
from jax_impl.matmul import contract


def _join(hi, lo):
    """fp32 from the bf16 upper and uint16 lower halves of its bits."""
    h = jax.lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type((h << 16) | lo.astype(jnp.uint32), jnp.float32)


def _halves(v):
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16), (bits & 0xFFFF).astype(jnp.uint16)


def _triton_kernel(dz_ref, x_ref, hi_in, lo_in, hi_ref, lo_ref, *, R, C, D, bv, bd, bk):
    j, i = pl.program_id(0), pl.program_id(1)
    _, v_mask = rp._span(i * bv, bv, C)
    _, d_mask = rp._span(j * bd, bd, D)

    def step(k, acc):
        _, k_mask = rp._span(k * bk, bk, R)
        dz = rp._load(dz_ref.at[pl.ds(k * bk, bk), pl.ds(i * bv, bv)], rp._both(k_mask, v_mask))
        x = rp._load(x_ref.at[pl.ds(k * bk, bk), pl.ds(j * bd, bd)], rp._both(k_mask, d_mask))
        return acc + rp._dot(dz, x, 0, 0)

    acc = jax.lax.fori_loop(*rp._k_steps(R, bk), step, jnp.zeros((bv, bd), jnp.float32))
    mask = rp._both(v_mask, d_mask)
    hi_t, lo_t = hi_ref.at[pl.ds(i * bv, bv), pl.ds(j * bd, bd)], lo_ref.at[pl.ds(i * bv, bv), pl.ds(j * bd, bd)]
    hi, lo = _halves(_join(rp._load(hi_t, mask), rp._load(lo_t, mask)) + acc)
    rp._store(hi_t, hi, mask)
    rp._store(lo_t, lo, mask)


def triton_split_add(hi, lo, dz, x, tile=(128, 256, 128, 8, 3)):
    """(hi, lo) [V, D] plus dz^T x (dz [R, V], x [R, D]); Pallas' Triton lowering, in place."""
    R, C = dz.shape
    D = x.shape[1]
    bv, bd, bk = tile[0], tile[1], tile[2] // 2
    kern = functools.partial(_triton_kernel, R=R, C=C, D=D, bv=bv, bd=bd, bk=bk)
    shapes = (jax.ShapeDtypeStruct(hi.shape, hi.dtype), jax.ShapeDtypeStruct(lo.shape, lo.dtype))
    return pl.pallas_call(kern, out_shape=shapes, grid=(pl.cdiv(D, bd), pl.cdiv(C, bv)), input_output_aliases={2: 0, 3: 1},
                          compiler_params=plt.CompilerParams(num_warps=tile[3], num_stages=tile[4]))(dz, x, hi, lo)


def mosaic_split_add(hi, lo, a, b, *, bm=128, bn=128, bk=64, stages=4):
    """The same with Mosaic GPU (JAX >= 0.11, Hopper): one warpgroup per 128 x 128 tile, wgmma
    on a transposed a tile, TMA loads; in place through refs. a [K, M], b [K, N]; M, N, K
    multiples of the tile."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    K, M = a.shape
    N = b.shape[1]

    def transforms(cols):
        swizzle = plgpu.find_swizzle(cols * 16)
        return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)

    def kernel(a_gmem, b_gmem, hi_gmem, lo_gmem):
        m_i, n_i = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        tile = (pl.ds(m_i * bm, bm), pl.ds(n_i * bn, bn))

        def body(hi_smem, lo_smem, bar):
            def acc_scope(acc_ref):
                def step(_, a_smem, b_smem):
                    plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_smem)
                specs = [plgpu.BlockSpec((bk, bm), lambda k: (k, m_i), transforms=transforms(bk), delay_release=1),
                         plgpu.BlockSpec((bk, bn), lambda k: (k, n_i), transforms=transforms(bk), delay_release=1)]
                plgpu.emit_pipeline(step, grid=(K // bk,), in_specs=specs, max_concurrent_steps=stages)(a_gmem, b_gmem)
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))
            plgpu.copy_gmem_to_smem(hi_gmem.at[tile], hi_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(lo_gmem.at[tile], lo_smem, bar.at[1])
            plgpu.barrier_wait(bar.at[0])
            plgpu.barrier_wait(bar.at[1])
            hi_smem[...], lo_smem[...] = _halves(_join(hi_smem[...], lo_smem[...]) + acc)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(hi_smem, hi_gmem.at[tile])
            plgpu.copy_smem_to_gmem(lo_smem, lo_gmem.at[tile])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(body, plgpu.SMEM((bm, bn), jnp.bfloat16, transforms=transforms(bn)),
                      plgpu.SMEM((bm, bn), jnp.uint16, transforms=transforms(bn)), plgpu.Barrier(num_barriers=2))

    hi_ref, lo_ref = jax.new_ref(hi), jax.new_ref(lo)
    plgpu.kernel(kernel, out_type=(), grid=(M // bm, N // bn), grid_names=("m", "n"),
                 compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(
        a, b, hi_ref, lo_ref)
    return jax.freeze(hi_ref), jax.freeze(lo_ref)


if __name__ == "__main__":
    for name, R, V, D in [("L", 2048, 128256, 4096), ("G", 1024, 256000, 2304)]:
        k1, k2 = jax.random.split(jax.random.PRNGKey(0))
        dz = (jax.random.normal(k1, (R, V), jnp.float32) * 1e-3).astype(jnp.bfloat16)
        x = jax.random.normal(k2, (R, D), jnp.float32).astype(jnp.bfloat16)
        planes = lambda: (jnp.zeros((V, D), jnp.bfloat16), jnp.zeros((V, D), jnp.uint16))
        xla = lambda reps: jax.lax.fori_loop(0, reps, lambda i, a: a + contract(dz, x, 0, 0), jnp.zeros((V, D), jnp.float32))
        for label, add in [("XLA fp32", None), ("Triton split", triton_split_add), ("Mosaic split", mosaic_split_add)]:
            run = (lambda reps=10: xla(reps)) if add is None else (
                lambda reps=10, add=add: jax.lax.fori_loop(0, reps, lambda i, c: add(*c, dz, x), planes()))
            f = jax.jit(run)
            jax.block_until_ready(f())
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(f())
                ts.append((time.perf_counter() - t0) * 100)
            print(f"{name} {label}: {statistics.median(ts):.2f} ms per update")
