"""A prototype, not in the package (H100, 2026-11-25; results in git history at be7f2bd,
bench/NOTES.md has the entry).

Can native Triton (the triton package, callable from JAX through jaxlib's `triton_kernel_call`,
as jax-triton does; not Pallas' Triton lowering) update JAX `speed`'s grad_weight in place as
fast as cuBLAS adds into an fp32 accumulator (beta 1)? One row block: dW[V, D] += dz[R, V]^T
x[R, D]. With split=True the fp32 accumulator is two 16-bit planes (the bf16 upper half of each
value's bits, which would be the returned gradient's own buffer, and an int16 lower half): 2 W,
where XLA needs 3 W (its fp32 accumulator beside the bf16 result it allocates apart).
On the H100 the best kernels took L 4.93 / 5.00 ms (fp32 / split) and G 3.50 / 3.41 against
cuBLAS's 3.31-3.37 and 2.43-2.75: no faster than the Pallas and Mosaic GPU kernels of
jax_split_accumulator_dw.py.

Two device calls ran this file: the first with POINTER_TILES_CALL_1 and TMA tiles
(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 4) with
`warp_specialize` in place of `flatten` (all out of shared memory, none timed); the second with
the lists below. Triton 3.9's interpreter (CPU) gets tl.dot of bf16 tiles wrong even for one
16 x 16 product (fp32 tiles are exact), so the check that counts is the GPU's max_rel_err (~1e-7).

Run on a GPU from the repository root: python bench/experiments/native_triton_dw.py
"""
import itertools, json, os, statistics, time
import torch
import triton
import triton.language as tl

dev = "cuda" if torch.cuda.is_available() else "cpu"
# (BV, BD, BK, num_warps, num_stages)
POINTER_TILES_CALL_1 = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
                        (256, 128, 64, 8, 3), (128, 128, 128, 8, 3)]
POINTER_TILES_CALL_2 = [(128, 128, 128, 8, 3)]
TMA_TILES_CALL_2 = [(128, 128, 64, 8, 2), (128, 128, 64, 8, 3), (128, 256, 64, 8, 2), (128, 128, 128, 8, 2), (256, 128, 64, 8, 2)]


@triton.jit
def _join(hi, lo):
    h = hi.to(tl.uint16, bitcast=True).to(tl.uint32)
    return ((h << 16) | lo.to(tl.uint16, bitcast=True).to(tl.uint32)).to(tl.float32, bitcast=True)


@triton.jit
def _split_store(hi_p, lo_p, v, mask):
    bits = v.to(tl.uint32, bitcast=True)
    tl.store(hi_p, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    tl.store(lo_p, (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def _dw_kernel(dz, x, hi, lo, acc32, R, V, D,
               BV: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
               C_FIRST: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    nd = tl.cdiv(D, BD)
    iv, jd = pid // nd, pid % nd
    rv = iv * BV + tl.arange(0, BV)
    rd = jd * BD + tl.arange(0, BD)
    mask = (rv[:, None] < V) & (rd[None, :] < D)
    off = rv[:, None].to(tl.int64) * D + rd[None, :]
    if C_FIRST:
        if SPLIT:
            c = _join(tl.load(hi + off, mask=mask, other=0.0), tl.load(lo + off, mask=mask, other=0))
        else:
            c = tl.load(acc32 + off, mask=mask, other=0.0)
    acc = tl.zeros((BV, BD), tl.float32)
    for k in tl.range(0, R, BK, num_stages=STAGES):
        rk = k + tl.arange(0, BK)
        a = tl.load(dz + rk[None, :].to(tl.int64) * V + rv[:, None], mask=(rk[None, :] < R) & (rv[:, None] < V), other=0.0)
        b = tl.load(x + rk[:, None].to(tl.int64) * D + rd[None, :], mask=(rk[:, None] < R) & (rd[None, :] < D), other=0.0)
        acc = tl.dot(a, b, acc)
    if not C_FIRST:
        if SPLIT:
            c = _join(tl.load(hi + off, mask=mask, other=0.0), tl.load(lo + off, mask=mask, other=0))
        else:
            c = tl.load(acc32 + off, mask=mask, other=0.0)
    acc += c
    if SPLIT:
        _split_store(hi + off, lo + off, acc, mask)
    else:
        tl.store(acc32 + off, acc, mask=mask)


@triton.jit
def _dw_tma_kernel(dz_desc, x_desc, hi_desc, lo_desc, acc_desc, R, V, D,
                   BV: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                   NUM_SMS: tl.constexpr, STAGES: tl.constexpr, FLAT: tl.constexpr):
    """Persistent, TMA loads; tiles in V-major order, D fastest."""
    nd = tl.cdiv(D, BD)
    n_tiles = tl.cdiv(V, BV) * nd
    for t in tl.range(tl.program_id(0), n_tiles, NUM_SMS, flatten=FLAT, num_stages=STAGES):
        iv, jd = t // nd, t % nd
        acc = tl.zeros((BV, BD), tl.float32)
        for k in range(0, R, BK):
            a = dz_desc.load([k, iv * BV])
            b = x_desc.load([k, jd * BD])
            acc = tl.dot(a.T, b, acc)
        if SPLIT:
            hi = hi_desc.load([iv * BV, jd * BD])
            lo = lo_desc.load([iv * BV, jd * BD])
            acc += _join(hi, lo)
            bits = acc.to(tl.uint32, bitcast=True)
            hi_desc.store([iv * BV, jd * BD], (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))
            lo_desc.store([iv * BV, jd * BD], (bits & 0xFFFF).to(tl.uint16).to(tl.int16, bitcast=True))
        else:
            acc += acc_desc.load([iv * BV, jd * BD])
            acc_desc.store([iv * BV, jd * BD], acc)


def run_ptr(dz, x, hi, lo, acc32, cfg):
    BV, BD, BK, W, S, split, cfirst = cfg
    R, V = dz.shape
    D = x.shape[1]
    grid = (triton.cdiv(V, BV) * triton.cdiv(D, BD),)
    _dw_kernel[grid](dz, x, hi, lo, acc32, R, V, D, BV=BV, BD=BD, BK=BK, SPLIT=split, C_FIRST=cfirst,
                     STAGES=S, num_warps=W, num_stages=S)


def make_tma(dz, x, hi, lo, acc32, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor
    BV, BD, BK, W, S, split, flat = cfg
    R, V = dz.shape
    D = x.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d = (TensorDescriptor.from_tensor(dz, [BK, BV]), TensorDescriptor.from_tensor(x, [BK, BD]),
         TensorDescriptor.from_tensor(hi, [BV, BD]), TensorDescriptor.from_tensor(lo, [BV, BD]),
         TensorDescriptor.from_tensor(acc32, [BV, BD]))
    def f():
        _dw_tma_kernel[(sms,)](*d, R, V, D, BV=BV, BD=BD, BK=BK, SPLIT=split, NUM_SMS=sms, STAGES=S, FLAT=flat,
                               num_warps=W, num_stages=S)
    return f


def timed(f, reps=15):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); f(); e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def planes(acc):
    """(bf16 upper half, int16 lower half) of acc's fp32 bits."""
    bits = acc.view(torch.int32)
    return (bits >> 16).to(torch.int16).view(torch.bfloat16).contiguous(), (bits & 0xFFFF).to(torch.int16)


def joined(hi, lo):
    h = hi.view(torch.int16).to(torch.int32) & 0xFFFF
    return ((h << 16) | (lo.to(torch.int32) & 0xFFFF)).view(torch.float32)


def jax_reference(R, V, D):
    import jax, jax.numpy as jnp
    k = jax.random.split(jax.random.key(0), 3)
    dz = (jax.random.normal(k[0], (R, V)) * 1e-3).astype(jnp.bfloat16)
    x = jax.random.normal(k[1], (R, D)).astype(jnp.bfloat16)
    acc = jax.random.normal(k[2], (V, D))
    f = jax.jit(lambda a: jax.lax.fori_loop(0, 10, lambda i, a: a + jax.lax.dot_general(dz, x, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32), a), donate_argnums=0)
    acc = f(acc).block_until_ready()
    ts = []
    for _ in range(7):
        t = time.perf_counter(); acc = f(acc); acc.block_until_ready(); ts.append((time.perf_counter() - t) * 100)
    del acc
    return statistics.median(ts)


def main():
    shapes = {"L": (2048, 128256, 4096), "G": (1024, 256000, 2304)}
    if dev == "cpu":
        shapes = {"tiny": (40, 300, 72)}
    out = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "rows": []}
    for name, (R, V, D) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(0)
        dz = (torch.randn(R, V, device=dev, generator=g) * 1e-3).to(torch.bfloat16)
        x = torch.randn(R, D, device=dev, generator=g).to(torch.bfloat16)
        base = torch.randn(V, D, device=dev, generator=g)
        # correctness (one call of each variant on fresh copies)
        want = base + dz.float().T @ x.float()
        def check(fn, split):
            acc32 = base.clone(); hi, lo = planes(base)
            fn(acc32, hi, lo)
            got = joined(hi, lo) if split else acc32
            return ((got - want).abs().max() / want.abs().max()).item()
        rows = []
        if dev == "cuda":
            acc32 = base.clone()
            try:
                ms = timed(lambda: torch.addmm(acc32, dz.T, x, out_dtype=torch.float32, out=acc32))
                rows.append(("cuBLAS addmm fp32 beta1", ms, None))
            except Exception as e:
                print("cublas out_dtype failed", type(e).__name__, e)
            rows.append(("XLA (cuBLAS) fp32 beta1, 10 chained in one jit, per update", jax_reference(R, V, D), None))
        cfgs = POINTER_TILES_CALL_2
        if dev == "cpu":
            cfgs = [(32, 32, 16, 4, 2)]
        for c, split, cfirst in itertools.product(cfgs, (True, False), (False, True)):
            cfg = c + (split, cfirst)
            try:
                err = check(lambda a, h, l: run_ptr(dz, x, h, l, a, cfg), split)
                acc32 = base.clone(); hi, lo = planes(base)
                ms = timed(lambda: run_ptr(dz, x, hi, lo, acc32, cfg)) if dev == "cuda" else float("nan")
                rows.append((f"ptr {c} split={split} c_first={cfirst}", ms, err))
            except Exception as e:
                rows.append((f"ptr {c} split={split} c_first={cfirst} FAILED {type(e).__name__}: {str(e)[:120]}", None, None))
            print(name, rows[-1], flush=True)
        if dev == "cuda":
            for c, split, flat in itertools.product(TMA_TILES_CALL_2, (True, False), (False, True)):
                cfg = c + (split, flat)
                try:
                    err = check(lambda a, h, l: make_tma(dz, x, h, l, a, cfg)(), split)
                    acc32 = base.clone(); hi, lo = planes(base)
                    ms = timed(make_tma(dz, x, hi, lo, acc32, cfg))
                    rows.append((f"tma persistent {c} split={split} flatten={flat}", ms, err))
                except Exception as e:
                    rows.append((f"tma persistent {c} split={split} flatten={flat} FAILED {type(e).__name__}: {str(e)[:160]}", None, None))
                print(name, rows[-1], flush=True)
                torch.cuda.empty_cache()
        for r in rows:
            out["rows"].append({"shape": name, "R_V_D": [R, V, D], "variant": r[0], "ms": r[1], "max_rel_err": r[2]})
    path = os.path.join(os.environ.get("OUT", "/tmp"), "native_triton_dw.json")
    json.dump(out, open(path, "w"), indent=1)
    print("\n".join(f"{r['shape']} {r['ms'] if r['ms'] is None else round(r['ms'], 3)} ms  err {r['max_rel_err']}  {r['variant']}" for r in out["rows"]))


if __name__ == "__main__":
    main()
