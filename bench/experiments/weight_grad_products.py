"""One row block's grad_weight update of PyTorch "speed", acc += dz^T x with 16-bit dz, x and an
fp32 acc, through cuBLAS in the layouts and libraries a caller can reach: the accumulator [V, D]
(dz^T x, the library's, in two slabs or one) or [D, V] (x^T dz), torch's default BLAS path or cuBLASLt
(`torch.backends.cuda.preferred_blas_library`), and XLA's product (which autotunes its cuBLAS
algorithm) in the same process; beside them the same product into a 16-bit acc and into an
fp32 acc not read (beta 0). Then the whole "speed" call at G and L under each torch BLAS path.

Run on a GPU from the repository root:
  OUT=/tmp PYTHONPATH=. python bench/experiments/weight_grad_products.py
"""
import json, os, statistics
import torch
from bench import measure

dev = torch.device("cuda")
SHAPES = {"G": (2048, 2304, 256000), "L": (4096, 4096, 128256)}  # one block's rows R, D, V
REPEAT = 20


def time_ms(fn, repeat=REPEAT, events=True):
    """`bench.measure.time_ms`: 3 warm-up runs, the median of `repeat` (CUDA events, or the
    host clock for JAX's calls, which block until their result is ready)."""
    return measure.time_ms(fn, dev, warmup=3, repeat=repeat, events=events)


def torch_variants(R, D, V):
    g = torch.Generator(device=dev).manual_seed(0)
    dz = (torch.randn(R, V, device=dev, generator=g) * 1e-3).bfloat16()
    x = torch.randn(R, D, device=dev, generator=g).bfloat16()
    half = (V // 2) // 256 * 256
    vd = torch.zeros(V, D, device=dev)
    dv = torch.zeros(D, V, device=dev)
    vd16 = torch.zeros(V, D, device=dev, dtype=torch.bfloat16)

    def slabs(beta):
        def f():
            torch.addmm(vd[:half], dz[:, :half].T, x, beta=beta, out_dtype=torch.float32, out=vd[:half])
            torch.addmm(vd[half:], dz[:, half:].T, x, beta=beta, out_dtype=torch.float32, out=vd[half:])
        return f

    return {
        "VD fp32, 2 slabs (the library's)": slabs(1.0),
        "VD fp32, 2 slabs, beta 0": slabs(0.0),
        "VD fp32, 1 slab": lambda: torch.addmm(vd, dz.T, x, out_dtype=torch.float32, out=vd),
        "DV fp32 (x^T dz)": lambda: torch.addmm(dv, x.T, dz, out_dtype=torch.float32, out=dv),
        "DV fp32, 2 slabs of D": lambda: [torch.addmm(dv[a:b], x[:, a:b].T, dz, out_dtype=torch.float32, out=dv[a:b])
                                          for a, b in ((0, D // 2), (D // 2, D))],
        "VD bf16 acc": lambda: vd16.addmm_(dz.T, x),
        "DV bf16 out, beta 0 (a plain product)": lambda: torch.mm(x.T, dz),
    }, (dz, x)


def jax_variants(dz_t, x_t):
    import jax, jax.numpy as jnp
    dz, x = jnp.array(jax.dlpack.from_dlpack(dz_t)), jnp.array(jax.dlpack.from_dlpack(x_t))
    R, V = dz.shape
    D = x.shape[1]
    f_vd = jax.jit(lambda acc, dz, x: acc + jax.lax.dot_general(dz, x, (((0,), (0,)), ((), ())),
                                                                  preferred_element_type=jnp.float32), donate_argnums=0)
    f_dv = jax.jit(lambda acc, dz, x: acc + jax.lax.dot_general(x, dz, (((0,), (0,)), ((), ())),
                                                                  preferred_element_type=jnp.float32), donate_argnums=0)
    out = {}
    for name, f, shape in (("XLA VD fp32", f_vd, (V, D)), ("XLA DV fp32", f_dv, (D, V))):
        acc = [jnp.zeros(shape, jnp.float32)]

        def step():
            acc[0] = f(acc[0], dz, x)
            acc[0].block_until_ready()
        out[name] = time_ms(step, events=False)
        del acc[0]
    return out


def whole_call(name):
    import torch_impl
    n, d, v = {"G": (8192, 2304, 256000), "L": (16384, 4096, 128256)}[name]
    x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
    x.requires_grad_(True); W.requires_grad_(True)

    def f():
        torch_impl.linear_cross_entropy(x, W, y, strategy="speed").backward()
        x.grad = W.grad = None
    res = {}
    for rnd in range(3):
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            res.setdefault(lib, []).append(time_ms(f, 5))
    torch.backends.cuda.preferred_blas_library("cublas")
    return {k: statistics.median(v) for k, v in res.items()}


if __name__ == "__main__":
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, (R, D, V) in SHAPES.items():
        row = {}
        flops = 2 * R * D * V
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            variants, (dz, x) = torch_variants(R, D, V)
            for k, fn in variants.items():
                ms = time_ms(fn)
                row[f"{k} [{lib}]"] = (round(ms, 3), round(flops / ms / 1e9))
            del variants
        torch.backends.cuda.preferred_blas_library("cublas")
        try:
            for k, ms in jax_variants(dz, x).items():
                row[k] = (round(ms, 3), round(flops / ms / 1e9))
        except Exception as e:  # noqa: BLE001 (a missing JAX leaves the torch rows)
            row["XLA"] = repr(e)[:200]
        del dz, x
        torch.cuda.empty_cache()
        results[f"{name} one block (ms, TFLOP/s) R={R} D={D} V={V}"] = row
        print(name, json.dumps(row, indent=1), flush=True)
    for name in ("G", "L"):
        results[f"{name} whole speed call, fwd+bwd ms"] = whole_call(name)
        print(name, results[f"{name} whole speed call, fwd+bwd ms"], flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "weight_grad_products.json"), "w") as fh:
        json.dump(results, fh, indent=1)
