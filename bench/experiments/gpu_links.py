"""How fast the GPUs of one machine move a grad_weight-sized partial (2 x NVIDIA H200,
2026-11-29; bench/results/jax_rows_sum.json `links`, bench/NOTES.md "JAX rows over 2 GPUs:
the partial's sum against the links"): an fp32 reduce-scatter, a bf16 all-gather and an fp32
all-reduce of [128256, 4096] through torch.distributed (NCCL, one process a GPU) and a peer
copy; then JAX's reduce-scatter ("rs"), bf16 rounding plus all-gather ("ag") and both ("both")
of [V, D] at L's and G's heads, in shard_map programs. Medians of 10 (torch) or 8 (JAX) after
warm-ups. NCCL's variables (NCCL_MIN_NCHANNELS, NCCL_PROTO) are read from the environment.

Run on 2 GPUs from the repository root:
  python bench/experiments/gpu_links.py torch
  PYTHONPATH=. python bench/experiments/gpu_links.py jax
"""
import json, os, statistics, sys, time


def _torch_rank(rank, world):
    import torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    V, D, res = 128256, 4096, {}
    cases = (("reduce_scatter fp32 [V,D]", lambda a, o: dist.reduce_scatter_tensor(o, a),
              lambda: (torch.ones(V, D, device="cuda"), torch.empty(V // world, D, device="cuda"))),
             ("all_gather bf16 [V,D]", lambda a, o: dist.all_gather_into_tensor(o, a),
              lambda: (torch.ones(V // world, D, device="cuda", dtype=torch.bfloat16),
                       torch.empty(V, D, device="cuda", dtype=torch.bfloat16))),
             ("all_reduce fp32 [V,D]", lambda a, o: dist.all_reduce(a), lambda: (torch.ones(V, D, device="cuda"), None)))
    for name, fn, make in cases:
        a, o = make()
        for _ in range(3):
            fn(a, o)
        torch.cuda.synchronize(); dist.barrier()
        ts = []
        for _ in range(10):
            t0 = time.perf_counter(); fn(a, o); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) * 1e3)
        res[name] = round(statistics.median(ts), 3)
        del a, o
    if rank == 0:
        big = torch.ones(V, D, device="cuda:0")
        for _ in range(2):
            big.to("cuda:1")
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        for _ in range(5):
            big.to("cuda:1")
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        res["peer copy 0->1 GB/s"] = round(5 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9, 1)
        print("TORCH", json.dumps(dict(res, env={k: v for k, v in os.environ.items() if k.startswith("NCCL")})), flush=True)
    dist.destroy_process_group()


def _jax():
    import jax, jax.numpy as jnp
    from jax import shard_map
    from jax.sharding import NamedSharding, PartitionSpec as P
    devs = jax.device_count()
    mesh = jax.make_mesh((devs,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    scatter = lambda g: jax.lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True)
    gather = lambda h: jax.lax.all_gather(h.astype(jnp.bfloat16), "dp", axis=0, tiled=True)
    res = {}
    for V, D in ((128256, 4096), (256000, 2304)):
        g = jax.device_put(jnp.ones((devs * V, D), jnp.float32), NamedSharding(mesh, P("dp", None)))
        for name, f in (("rs", scatter), ("ag", lambda g: gather(g[: V // devs])), ("both", lambda g: gather(scatter(g)))):
            run = jax.jit(shard_map(f, mesh=mesh, in_specs=P("dp", None), out_specs=P("dp", None))).lower(g).compile()
            ts = []
            for _ in range(10):
                t0 = time.perf_counter(); jax.block_until_ready(run(g)); ts.append((time.perf_counter() - t0) * 1e3)
            res[f"{name} {V}x{D}"] = round(statistics.median(ts[2:]), 3)
        del g
    print("JAX", json.dumps(dict(res, env={k: v for k, v in os.environ.items() if k.startswith("NCCL")})), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "torch":
        import torch
        torch.multiprocessing.spawn(_torch_rank, args=(2,), nprocs=2)
    else:
        _jax()
