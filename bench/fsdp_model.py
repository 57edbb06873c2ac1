"""`torchrun --nproc-per-node P -m bench.fsdp_model`: a training step of a Llama-like Hugging
Face model under FSDP2 (with `--head tp`, only its head split by tensor parallelism; with
`--head 2d --tp T`, both: a (dp, tp) mesh, the head split over "tp" and everything sharded by
FSDP2 over "dp", as torchtitan composes them), patched
(`torch_impl.transformers.patch_causal_lm`), unpatched, and with Liger's patch (where
liger-kernel imports; its Triton kernels need a GPU).

The model is built from a config (random weights, no download): by default a Llama-3 head
(V 128256, D 2048) on 4 decoder layers, in bf16. FSDP2 wraps each decoder layer and the model,
as transformers' own FSDP plan does; every rank takes its own rows and the mean is over the
global count of valid tokens (`num_items_in_batch`). Per method: the step's median ms (rank
0's clock after a barrier), each rank's peak memory (GPUs), and the loss. NCCL on GPUs
(keep NVLink multicast off: NCCL_NVLS_ENABLE=0), gloo on CPUs, where `--tiny` gives a small
model. Rank 0 writes the JSON (`--json`).
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.distributed as dist

from bench import measure
from bench.distributed import on_ranks

METHODS = ("transformers", "ours", "liger")
MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192)
TINY = dict(vocab_size=1001, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def build(config: dict, method: str, mesh, dtype, device, head: str = "fsdp"):
    """The sharded model of `method`: the same weights (seed 0) for every method. head="tp":
    the head split over its vocabulary by tensor parallelism (ColwiseParallel, its logits
    gathered, as transformers' "colwise_gather_output"), the decoder replicated; "2d" (a
    (dp, tp) mesh): the head split so over "tp", then FSDP2 over "dp"."""
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from torch_impl.transformers import patch_causal_lm

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(device=device, dtype=dtype).train()
    if method == "ours":
        patch_causal_lm(model)
    elif method == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    if head != "fsdp":
        parallelize_module(model, mesh if head == "tp" else mesh["tp"],
                           {"lm_head": ColwiseParallel(output_layouts=Replicate())})
        if head == "tp":
            return model
        mesh = mesh["dp"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(config: dict, rows: int, seq: int, device, rows_of: int, group=None):
    """This rank's input_ids and labels [rows, seq] (10% of labels -100), those of its data
    shard `rows_of` (the same on the ranks of one shard), and the global count of valid
    (shifted) labels: summed over `group` (the data shards' ranks; None: none)."""
    gen = torch.Generator(device=device).manual_seed(1 + rows_of)
    ids = torch.randint(0, config["vocab_size"], (rows, seq), device=device, generator=gen)
    labels = ids.masked_fill(torch.rand(rows, seq, device=device, generator=gen) < 0.1, -100)
    count = (labels[:, 1:] != -100).sum()
    if group is not None:
        dist.all_reduce(count, group=group)
    return {"input_ids": ids, "labels": labels, "num_items_in_batch": count}


def run(config: dict, methods, rows: int, seq: int, dtype, repeat: int, head: str = "fsdp", tp: int = 1) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    world = dist.get_world_size()
    if head == "2d":
        if tp < 2 or world % tp:
            raise ValueError(f"--head 2d needs --tp T > 1 dividing the {world} ranks, got {tp}")
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        inputs = batch(config, rows, seq, device, mesh["dp"].get_local_rank(), mesh["dp"].get_group())
    else:
        mesh = init_device_mesh(device.type, (world,))
        inputs = batch(config, rows, seq, device, 0 if head == "tp" else dist.get_rank(),
                       None if head == "tp" else mesh.get_group())
    results = []
    for method in methods:
        model = build(config, method, mesh, dtype, device, head)

        def step():
            model.zero_grad(set_to_none=True)
            out = model(**inputs)
            out.loss.backward()
            return out.loss.detach()

        dist.barrier()
        row = {"method": method, "head": head, "P": world, "tp": tp if head == "2d" else None, "rows_per_rank": rows,
               "seq": seq,
               "step_ms": measure.time_ms(step, device, repeat=repeat)}
        peak = measure.peak_extra_bytes(step, device) if device.type == "cuda" else None
        row["loss"] = float(step())
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, None if peak is None else peak / 2**20)
        row["peak_extra_mib_per_rank"] = peaks
        results.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
        # Freed while the process group lives: an FSDP2 model left to the collector at exit,
        # after the group is gone, can abort the process ("terminate called without an
        # active exception").
        model = step = None
        gc.collect()
    return results


def main(argv=None):
    """One rank's run; it ends the process (`bench.distributed.on_ranks`), never returning."""
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node P -m bench.fsdp_model",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=None, help=f"default {','.join(METHODS)} (liger where it runs)")
    parser.add_argument("--rows", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU runs)")
    parser.add_argument("--head", choices=("fsdp", "tp", "2d"), default="fsdp",
                        help="fsdp: FSDP2 over every rank (rows split); tp: only the head split over its vocabulary "
                             "(tensor parallel), the same rows on every rank; 2d: a (P / T, T) mesh, the head split "
                             "over its T ranks of 'tp', FSDP2 over 'dp' (the rows split over it)")
    parser.add_argument("--tp", type=int, default=2, help="with --head 2d: the ranks of 'tp' (default 2)")
    parser.add_argument("--repeat", type=int, default=None, help="timed steps (default 10 on GPUs, 2 on CPUs)")
    parser.add_argument("--json", default=None, help="rank 0 writes the results here")
    args = parser.parse_args(argv)
    config = TINY if args.tiny else MODEL
    methods = args.methods.split(",") if args.methods else [m for m in METHODS if m != "liger" or measure.has_liger()]

    def body(gpu: bool, dtype):
        return {"results": run(config, methods, args.rows, args.seq, dtype,
                               args.repeat or (10 if gpu else 2), args.head, args.tp)}

    on_ranks(body, args.json, model=config)


if __name__ == "__main__":
    main()
