"""`torchrun --nproc-per-node P -m bench.distributed`: the cross-entropy (or with `--loss`
another loss) of a head split over the vocabulary across P ranks, beside PyTorch's
`loss_parallel` over materialised logits (cross-entropy only).

Every rank holds the same N rows and V / P classes of the head (uneven when P does not
divide V). Per shape and method: fwd+bwd ms (median, rank 0's clock after a barrier),
each rank's peak memory beyond its inputs (GPUs), rank 0's floor (the bytes of its slice
of grad_weight and of grad_input), and the loss (the same for every method).
"one-gpu-speed" (and "one-gpu-memory", on request) is the call without `vocab_parallel`
(the whole head, one GPU): strong scaling's baseline, run at P = 1 only.
`--weak` multiplies N by P (weak
scaling: each rank's logits keep their size). NCCL on GPUs (keep NVLink multicast off:
NCCL_NVLS_ENABLE=0), gloo on CPUs. Rank 0 writes the JSON (`--json`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench import measure

METHODS = ("ours-speed", "ours-memory", "loss-parallel", "one-gpu-speed")
LOSSES = ("cross_entropy", "topk", "log_probs", "policy")  # --loss; loss-parallel is cross-entropy's
# NVLink multicast off in every process of a run: on a shared host a program using it can put
# every GPU of the host out of service (NCCL's NVLS, PyTorch's symmetric memory, NVSHMEM).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _grads(loss, x, W):
    loss.backward()
    return loss.detach(), x.grad, W.grad


def _ours(strategy: str, group, loss: str, y, vocab: int):
    """fwd+bwd of this rank's slice through `vocab_parallel=group` (None: the whole head, no
    split) for one of LOSSES: (loss, grad_x, grad_W). The top-K teacher (K = 32, random ids
    and log-probabilities), the RL losses' advantages and upstream gradients are drawn once
    per call of `_ours`, from a generator seeded with 0 (the same on every rank)."""
    import torch_impl

    gen = torch.Generator(device=y.device).manual_seed(0)
    n, dev = y.shape[0], y.device
    ids = torch.randint(0, vocab, (n, 32), generator=gen, device=dev)
    teacher = torch.randn(n, 32, generator=gen, device=dev).log_softmax(-1)
    signs = torch.randn(n, generator=gen, device=dev)
    calls = {
        "cross_entropy": lambda x, W: torch_impl.linear_cross_entropy(x, W, y, strategy=strategy, vocab_parallel=group),
        "topk": lambda x, W: torch_impl.linear_topk_distillation(x, W, ids, teacher, target=y, strategy=strategy,
                                                                 vocab_parallel=group),
        "log_probs": lambda x, W: (torch_impl.linear_log_probs(x, W, y, strategy=strategy, vocab_parallel=group)
                                   * signs).sum(),
        "policy": lambda x, W: torch_impl.linear_policy_loss(x, W, y, signs, strategy=strategy, vocab_parallel=group),
    }
    call = calls[loss]

    def step(x, W, y):
        x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
        return _grads(call(x, W), x, W)

    return step


def _loss_parallel(mesh, vocab: int):
    """fwd+bwd of PyTorch's tensor-parallel loss: this rank's logits [N, V / P] as a DTensor
    sharded on the classes, cross-entropy and its backward under `loss_parallel()`."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    def step(x, W, y):
        x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
        with loss_parallel():
            local = x @ W.T
            logits = DTensor.from_local(local, mesh, [Shard(1)], shape=(x.shape[0], vocab), stride=(vocab, 1))
            return _grads(F.cross_entropy(logits.float(), y, ignore_index=-100), x, W)

    return step


def run(shapes, methods, dtype, repeat: int, weak: bool, loss: str = "cross_entropy") -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    group = mesh.get_group()
    rows = []
    for name in shapes:
        n, d, v = measure.PRESETS[name] if name in measure.PRESETS else tuple(int(k) for k in name.split("x"))
        n = n * world if weak else n
        x, W_full, y = measure.make_inputs(n, d, v, dtype, device)
        # the classes split as a DTensor's Shard splits them (torch.chunk), which loss_parallel's layout assumes
        slices = W_full.chunk(world)
        if len(slices) < world:
            raise ValueError(f"{v} classes can't be split over {world} ranks as torch.chunk splits them")
        W = slices[rank].contiguous()
        del W_full
        for mname in methods:
            if mname.startswith("one-gpu") and world > 1:
                continue  # the whole head on one GPU: strong scaling's baseline, measured at P = 1
            strategy = mname.rsplit("-", 1)[1]
            if mname == "loss-parallel" and loss != "cross_entropy":
                continue
            step = (_loss_parallel(mesh, v) if mname == "loss-parallel"
                    else _ours(strategy, None if mname.startswith("one-gpu") else group, loss, y, v))
            row = {"shape": name, "N": n, "D": d, "V": v, "P": world, "loss_fn": loss, "method": mname,
                   "local_floor_mib": (x.numel() + W.numel()) * x.element_size() / 2**20}
            # An error on one rank (out of memory) would leave the others in a collective: it
            # ends the run (torchrun stops every rank).
            dist.barrier()
            row["fwd_bwd_ms"] = measure.time_ms(lambda: step(x, W, y), device, repeat=repeat)
            peak = measure.peak_extra_bytes(lambda: step(x, W, y), device) if device.type == "cuda" else None
            row["loss"] = float(step(x, W, y)[0])
            peaks = [None] * world
            dist.all_gather_object(peaks, None if peak is None else peak / 2**20)
            row["peak_extra_mib_per_rank"] = peaks
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    return rows


def main(argv=None):
    """One rank's run; it ends the process (`bench.distributed.on_ranks`), never returning."""
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node P -m bench.distributed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None, help="presets or NxDxV; default L,G on GPUs, 256x64x1000 on CPUs")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--weak", action="store_true", help="N times the number of ranks (weak scaling)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs (default 10 on GPUs, 2 on CPUs)")
    parser.add_argument("--json", default=None, help="rank 0 writes the results here")
    parser.add_argument("--loss", default="cross_entropy", choices=LOSSES)
    args = parser.parse_args(argv)
    def body(gpu: bool, dtype):
        shapes = (args.shapes or ("L,G" if gpu else "256x64x1000")).split(",")
        rows = run(shapes, args.methods.split(","), dtype, args.repeat or (10 if gpu else 2), args.weak, args.loss)
        return {"weak": args.weak, "loss_fn": args.loss, "results": rows}

    on_ranks(body, args.json)


def leave() -> None:
    """End a rank's process once its work is out and its process group destroyed, without
    the interpreter's teardown: there a gloo worker thread still holding a tensor can abort
    the process (std::terminate, "terminate called without an active exception") after a
    clean run, about one run in ten on two busy CPU cores."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def on_ranks(body, json_path: str | None, **environment) -> None:
    """A torchrun process: the process group (NCCL on GPUs, gloo on CPUs), then
    body(gpu, dtype) -> a dict that rank 0 writes to json_path with the run's environment
    (date, torch, ranks, device, dtype, and `environment`'s entries); then the process ends
    (`leave`)."""
    os.environ.update(NO_MULTICAST)
    gpu = torch.cuda.is_available()
    if gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)  # bound to its GPU: NCCL need not guess
    else:
        dist.init_process_group("gloo")
    try:
        dtype = torch.bfloat16 if gpu else torch.float32
        record = body(gpu, dtype)
        if dist.get_rank() == 0 and json_path:
            env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "torch": torch.__version__, "ranks": dist.get_world_size(),
                   "device": torch.cuda.get_device_name() if gpu else "cpu", "dtype": str(dtype).removeprefix("torch."),
                   **environment}
            with open(json_path, "w") as f:
                json.dump({"environment": env, **record}, f, indent=1)
        dist.barrier()  # no rank tears its group down while another still uses it
    finally:
        dist.destroy_process_group()
    leave()


if __name__ == "__main__":
    main()
