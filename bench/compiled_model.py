"""`python -m bench.compiled_model`: a training step of a Llama-like Hugging Face model under
torch.compile, with the fused loss and without.

The model is `bench.fsdp_model`'s (random weights from a config, no download; `--tiny` for a
CPU), in bf16 on a GPU, one process. Methods:

- `eager`, `compile`: transformers unpatched, eager and `torch.compile(model)` (compile's own
  fusion of the logits and the cross-entropy);
- `compile-layers`: unpatched, each decoder layer compiled, as torchtitan compiles;
- `ours`, `ours-compile`, `ours-compile-layers`: the same, patched
  (`torch_impl.transformers.patch_causal_lm`); `ours-compile` is `fullgraph=True`;
- `ours-graph-break`: patched and compiled whole, with the loss kept out of the graph
  (`torch.compiler.disable`): what the custom op saves over a graph break;
- `liger`: Liger's patch of Llama (eager), where liger-kernel is installed.

Per method: the step's median ms (after warm-up steps, which compile), the peak memory beyond
the model and the batch (GPUs), the loss, and the graphs Dynamo compiled (more than one
where a graph breaks). `--json` writes the results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from unittest import mock

import torch

from bench import measure
from bench.fsdp_model import MODEL, TINY

METHODS = ("eager", "compile", "compile-layers", "ours", "ours-compile", "ours-compile-layers", "ours-graph-break",
           "liger")


def build(config: dict, method: str, dtype, device, backend: str):
    """(the model of `method`, a context its steps run in): the same weights (seed 0) for all."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(device=device, dtype=dtype).train()
    context = contextlib.nullcontext()
    if method == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif method.startswith("ours"):
        from torch_impl import transformers as patching

        patching.patch_causal_lm(model)
        if method == "ours-graph-break":
            eager_loss = torch.compiler.disable(patching.linear_cross_entropy)
            context = mock.patch.object(patching, "linear_cross_entropy", eager_loss)
    if method.endswith("compile-layers"):
        for layer in model.model.layers:
            layer.compile(backend=backend)
    elif method.endswith("compile") or method == "ours-graph-break":
        model = torch.compile(model, backend=backend, fullgraph=method == "ours-compile")
    return model, context


def run(config: dict, methods, rows: int, seq: int, dtype, device, repeat: int, backend: str,
        save=lambda results: None) -> list[dict]:
    """The rows of `methods`, each passed to `save` with those before it as soon as it is
    measured (a run cut short keeps what it finished)."""
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (rows, seq), device=device, generator=gen)
    labels = ids.masked_fill(torch.rand(rows, seq, device=device, generator=gen) < 0.1, -100)
    results = []
    for method in methods:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model, context = build(config, method, dtype, device, backend)

        def step():
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            return out.loss.detach()

        with context:
            row = {"method": method, "rows": rows, "seq": seq, **measure.step_row(step, device, repeat)}
        row["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        results.append(row)
        save(results)
        print(json.dumps(row), flush=True)
        model = step = None
    return results


def parse_model_arguments(parser, argv, rows: int, seq: int):
    """The arguments of a model-step benchmark (beside the parser's own), parsed."""
    parser.add_argument("--rows", type=int, default=rows, help="sequences")
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--tiny", action="store_true", help="a small model (CPU runs)")
    parser.add_argument("--repeat", type=int, default=None, help="timed steps (default 10 on GPUs, 2 on CPUs)")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                        help="the model's dtype (default bfloat16 on GPUs, float32 on CPUs)")
    parser.add_argument("--json", default=None, help="rewritten after every method")
    return parser.parse_args(argv)


def model_device(args):
    """(a GPU is there, the device, the model's dtype) of parsed model-step arguments."""
    gpu = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if gpu else torch.float32
    return gpu, torch.device("cuda" if gpu else "cpu"), dtype


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.compiled_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=None, help=f"of {','.join(METHODS)} (default: all that import)")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: a quick CPU check)")
    args = parse_model_arguments(parser, argv, rows=2, seq=4096)
    gpu, device, dtype = model_device(args)
    methods = args.methods.split(",") if args.methods else [m for m in METHODS if m != "liger" or measure.has_liger()]
    config = TINY if args.tiny else MODEL
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if gpu else "cpu",
           "dtype": str(dtype).removeprefix("torch."), "backend": args.backend, "model": config,
           "command": "python -m bench.compiled_model " + " ".join(argv if argv is not None else sys.argv[1:])}

    def save(results):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env, "results": results}, f, indent=1)

    run(config, methods, args.rows, args.seq, dtype, device, args.repeat or (10 if gpu else 2), args.backend, save)


if __name__ == "__main__":
    main()
