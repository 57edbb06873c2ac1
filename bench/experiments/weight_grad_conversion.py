"""PyTorch "speed"'s fp32 grad_weight of a bf16 W converted into its first slab's storage
(`torch_impl.head.WeightGrad`) against the two slabs converted and concatenated (`CatWeightGrad`
below, with the same slab edges), and "speed"'s row blocks at L and G (NVIDIA H200, 2026-11-29;
bench/NOTES.md has the entry, bench/results/weight_grad_conversion.json the numbers): fwd+bwd
ms over 5 interleaved rounds, peak memory, and whether the gradients equal the default's bit for
bit; then JAX "speed" at two row-block sizes (XLA's temporaries). SHARE=0 keeps several blocks
where one block of all rows would be taken; NOCAT=1 leaves out the concatenating variant.

Run on a GPU from the repository root:
  OUT=/tmp PYTHONPATH=. python bench/experiments/weight_grad_conversion.py "L;G" "L;G"
  SHARE=0 NOCAT=1 OUT=/tmp PYTHONPATH=. python bench/experiments/weight_grad_conversion.py "G:2048,2560,2816,3072,4096"
"""
import dataclasses, statistics, sys, time, json, os
import torch
from bench import measure
from interop.tuning import Tuning
from interop.blocking import weight_grad_slabs
import torch_impl
from torch_impl import head

class CatWeightGrad(head.WeightGrad):
    def __init__(self, W, layout, dtype, t):
        lead, row = W.shape
        self.layout, self.dtype = layout, W.dtype
        self.starts = weight_grad_slabs(t, lead, row * dtype.itemsize, dtype != W.dtype)
        self._out = None
        self.slabs = [torch.empty(b - a, row, dtype=dtype, device=W.device) for a, b in zip(self.starts, self.starts[1:])]
        self.written = [False] * len(self.slabs)
    def result(self):
        slabs, self.slabs = self.slabs, []
        for i in range(len(slabs)):
            if not self.written[i]:
                slabs[i].zero_()
        if len(slabs) == 1:
            return slabs[0].to(self.dtype)
        parts = []
        while slabs:
            parts.append(slabs.pop(0).to(self.dtype))
        return torch.cat(parts, 0)

New = head.WeightGrad
SH = {"L": (16384, 4096, 128256, [4096, 5504, 8192]), "G": (8192, 2304, 256000, [2048, 2816, 4096])}
dev = torch.device("cuda")
out = {}
for spec in sys.argv[1].split(";"):
    name, _, rl = spec.partition(":")
    n, d, v, rows_list = SH[name]
    rows_list = [int(r) for r in rl.split(",")] if rl else rows_list
    x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
    variants = {}
    for rows in rows_list:
        t = dataclasses.replace(Tuning(), speed_block_elements=rows * v, speed_min_rows=1, one_speed_block_share=float(os.environ.get("SHARE", "1")))
        variants[f"inplace-{rows}"] = (New, t)
    if not os.environ.get("NOCAT"):
        variants[f"cat-{rows_list[0]}"] = (CatWeightGrad, Tuning())
    fns = {}
    def mk(cls, t):
        def f():
            head.WeightGrad = cls
            try:
                return measure.fwd_bwd(lambda x, W, y: torch_impl.linear_cross_entropy(x, W, y, strategy="speed", tuning=t), x, W, y)
            finally:
                head.WeightGrad = New
        return f
    fns = {k: mk(*vv) for k, vv in variants.items()}
    ref = fns[f"inplace-{rows_list[0]}"]()
    res = {}
    for k, f in fns.items():
        o = f()
        same = torch.equal(o[1], ref[1]) and torch.equal(o[2], ref[2])
        peak = measure.peak_extra_bytes(f, dev) / 2**20
        res[k] = dict(peak_mib=peak, same_as_default=bool(same), ms=[])
        del o
    for r in range(5):
        for k, f in fns.items():
            res[k]["ms"].append(measure.time_ms(f, dev, warmup=2, repeat=8))
    for k in res:
        res[k]["median_ms"] = statistics.median(res[k]["ms"])
        print(f"torch {name} {k}: {res[k]['median_ms']:.2f} ms peak {res[k]['peak_mib']:.0f} MiB same {res[k]['same_as_default']} rounds {[round(t, 2) for t in res[k]['ms']]}", flush=True)
    out[f"torch-{name}"] = res
    del x, W, y, ref, fns
    torch.cuda.empty_cache()
if len(sys.argv) > 2:
    import jax
    from interop.dlpack import to_jax
    import jax_impl
    for name in sys.argv[2].split(";"):
        n, d, v, rows_list = SH[name]
        x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, dev)
        xj, Wj, yj = to_jax(x), to_jax(W), to_jax(y.int())
        del x, W, y; torch.cuda.empty_cache()
        fns, res = {}, {}
        for rows in rows_list[:2]:
            t = dataclasses.replace(Tuning(), speed_block_elements=rows * v, speed_min_rows=1)
            f = jax.jit(jax.value_and_grad(lambda x, W, y, t=t: jax_impl.linear_cross_entropy(x, W, y, strategy="speed", tuning=t), argnums=(0, 1)))
            c = f.lower(xj, Wj, yj).compile()
            jax.block_until_ready(f(xj, Wj, yj))
            fns[rows] = f
            res[rows] = dict(temp_mib=c.memory_analysis().temp_size_in_bytes / 2**20, ms=[])
        for r in range(5):
            for k, f in fns.items():
                for _ in range(2): jax.block_until_ready(f(xj, Wj, yj))
                ts = []
                for _ in range(8):
                    t0 = time.perf_counter(); jax.block_until_ready(f(xj, Wj, yj)); ts.append(time.perf_counter() - t0)
                res[k]["ms"].append(statistics.median(ts) * 1e3)
        for k in res:
            res[k]["median_ms"] = statistics.median(res[k]["ms"])
            print(f"jax {name} rows {k}: {res[k]['median_ms']:.2f} ms temp {res[k]['temp_mib']:.0f} MiB rounds {[round(t, 2) for t in res[k]['ms']]}", flush=True)
        out[f"jax-{name}"] = {str(k): vv for k, vv in res.items()}
        del xj, Wj, yj, fns
        jax.clear_caches()
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ab_slabs.json"), "w"), indent=1)
