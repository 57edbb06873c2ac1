"""The whole-row cross-entropy kernel (`torch_impl.kernels._ce_rows_kernel`: lse, loss and dz
written over a block of logits, one program per row) on one block of the bench shapes' rows,
alone: its launch parameters (stats columns per step, grad columns per step, warps), and
four variants of its two loops, each written from the module's source at run time:
"reversed" (the dz pass walks the row backwards, so its first reads are the columns the
statistics pass read last), "evict" (the statistics pass keeps the row in L2, the dz pass
evicts it first), "lean" (block-wise max and sum per step in place of per-lane running
values) and "prefetch" (each step loads the next step's logits before its arithmetic).
Reports microseconds per launch, the block's bytes read (statistics) or read and written
(statistics + dz) per second, the dz pass's second read of the row not counted, and each
output's largest distance from the current kernel's. L's block is 2048 rows (the default of
2^28-logit blocks then; 4096 since).
(H200, 2026-11-29, on the tree of commit d5b050c; bench/NOTES.md has the entry.) Writes
$OUT/row_kernel_variants.json.

Run on a GPU from the repository root:
OUT=/tmp PYTHONPATH=. python bench/experiments/row_kernel_variants.py"""
import importlib.util, json, os, sys, tempfile, time

import torch
import triton

SHAPES = {"S": (4096, 32000), "Q": (4096, 128256), "L": (2048, 128256), "G": (2048, 256000), "S-memory": (224, 32000)}
PARAMS = [(4096, 2048, 16), (2048, 2048, 8), (4096, 4096, 16), (8192, 4096, 16), (4096, 2048, 8), (8192, 8192, 32),
          (2048, 1024, 4), (1024, 1024, 4)]
SOURCE = open("torch_impl/kernels.py").read()
STATS_LOOP = """    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        s = _capped_logits(z_row_ptr + offs, b_ptr, offs, mask, cap, HAS_BIAS, HAS_CAP)
"""
GRAD_LOOP = """    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        z = _logits(z_row_ptr + offs, b_ptr, offs, mask, HAS_BIAS)
"""
STORE = "        tl.store(dz_row_ptr + offs, dz.to(dz_row_ptr.dtype.element_ty), mask=mask)"
BIAS_CAP = """        if HAS_BIAS:
            s += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            s = cap * _tanh(s / cap)
"""
PREFETCH = """    offs_n = tl.arange(0, BLOCK)
    z_n = tl.load(z_row_ptr + offs_n, mask=offs_n < C, other=0.0)
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        z_c = z_n
        offs_n = offs + BLOCK
        z_n = tl.load(z_row_ptr + offs_n, mask=offs_n < C, other=0.0)
"""
LEAN_STEP = """        s_in = tl.where(mask, s * scale, -float("inf"))
        m_new = nan_max(m, nan_max_reduce(s_in))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        e = tl.where(s_in == m_safe, 1.0, tl.exp(s_in - m_safe))
        l = l * tl.where(m == m_new, 1.0, tl.exp(m - m_safe)) + tl.sum(e, axis=0)
        m = m_new
"""


def _replace(src, old, new):
    assert src.count(old) == 1, old
    return src.replace(old, new)


def variants():
    """{name: module source}: the current kernels and the four variants."""
    out = {"current": SOURCE}
    out["reversed"] = _replace(SOURCE, GRAD_LOOP, GRAD_LOOP.replace(
        "    for c0 in range(0, C, BLOCK):\n",
        "    n_steps = tl.cdiv(C, BLOCK)\n    for i in range(0, n_steps):\n        c0 = (n_steps - 1 - i) * BLOCK\n"))
    evict = _replace(SOURCE, STATS_LOOP, STATS_LOOP.replace(
        "        s = _capped_logits(z_row_ptr + offs, b_ptr, offs, mask, cap, HAS_BIAS, HAS_CAP)\n",
        '        s = tl.load(z_row_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)\n'
        + BIAS_CAP))
    evict = _replace(evict, GRAD_LOOP, GRAD_LOOP.replace(
        "        z = _logits(z_row_ptr + offs, b_ptr, offs, mask, HAS_BIAS)\n",
        '        z = tl.load(z_row_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)\n'
        + BIAS_CAP.replace("s +=", "z +=").split("        if HAS_CAP")[0]))
    out["evict"] = _replace(evict, STORE, STORE[:-1] + ', eviction_policy="evict_first")')
    start = SOURCE.index("    m_vec = tl.full([BLOCK]")
    stop = SOURCE.index("    y_in = (y >= 0) & (y < C)", start)
    body = SOURCE[start:stop]
    lean_body = ('    m = tl.full([], -float("inf"), tl.float32)\n    l = tl.zeros([], tl.float32)\n'
                 '    ws_vec = tl.zeros([BLOCK], tl.float32)\n' + STATS_LOOP + LEAN_STEP
                 + body[body.index("        if NEED_WS:"):body.index("    m = nan_max_reduce(m_vec)")])
    out["lean"] = SOURCE[:start] + lean_body + SOURCE[stop:]
    pre = _replace(SOURCE, STATS_LOOP, PREFETCH + "        s = z_c.to(tl.float32)\n" + BIAS_CAP)
    out["prefetch"] = _replace(pre, GRAD_LOOP, PREFETCH + "        z = z_c.to(tl.float32)\n"
                               + BIAS_CAP.replace("s +=", "z +=").split("        if HAS_CAP")[0])
    return out


def load(name, src, folder):
    path = os.path.join(folder, f"rows_{name}.py")  # Triton reads a kernel's source from its file
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"rows_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module._ce_rows_kernel


def launch(kernel, z, y, den, lse, loss, params, grad=True):
    stats_cols, cols, warps = params
    R, V = z.shape
    kernel[(R,)](z, z.stride(0), z, z, z, y, den, lse, loss, lse, lse, V, -100, 0.0, 0.0, 1.0, 0.0,
                 HAS_BIAS=False, HAS_CW=False, HAS_CAP=False, HAS_LS=False, HAS_Z=False, MEAN=True, GRAD=grad,
                 FILTER=False, BLOCK_STATS=min(stats_cols, triton.next_power_of_2(V)),
                 BLOCK=min(cols, triton.next_power_of_2(V)), num_warps=warps)


def us_per_launch(fn, z, z0):
    """Median of 5 runs of 10 launches, z reset to the logits before each run."""
    for _ in range(3):
        fn()
    runs = []
    for _ in range(5):
        z.copy_(z0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / 10 * 1e3)
    return sorted(runs)[2]


def main():
    dev = torch.device("cuda")
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "rows": []}
    folder = tempfile.mkdtemp()
    kernels = {name: load(name, src, folder) for name, src in variants().items()}
    for shape, (R, V) in SHAPES.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        z0 = (torch.randn(R, V, device=dev, generator=gen) * 4).to(torch.bfloat16)
        y = torch.randint(0, V, (R,), device=dev, generator=gen)
        den = torch.tensor(float(R), device=dev)
        lse, loss = torch.empty(R, device=dev), torch.empty(R, device=dev)
        z = z0.clone()
        reference = {}
        for name, kernel in kernels.items():
            for params in PARAMS if name == "current" else PARAMS[:2]:
                for grad in (False, True):
                    z.copy_(z0)
                    launch(kernel, z, y, den, lse, loss, params, grad)
                    got = (z.float(), lse.clone())
                    ref = reference.setdefault((params, grad), got)
                    us = us_per_launch(lambda: launch(kernel, z, y, den, lse, loss, params, grad), z, z0)
                    row = dict(shape=shape, rows=R, vocab=V, kernel=name, params=list(params),
                               pass_="stats" if not grad else "stats+dz", us=round(us, 1),
                               tb_per_s=round((2 if grad else 1) * R * V * 2 / us / 1e6, 2),
                               dz_distance=(got[0] - ref[0]).abs().max().item() if grad else None,
                               lse_distance=(got[1] - ref[1]).abs().max().item())
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "row_kernel_variants.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
