"""`python -m bench.trl_step`: a GRPO training step of a Llama-like model through TRL's fused
LM head (TRL >= 1.15), on TRL's own kernel (`trl`) and on the library (`ours`, `patch_trl`).

The model is `bench.fsdp_model`'s (random weights from a config, no download; `--tiny` for a
CPU), in bf16 on a GPU, one process, wrapped by TRL's `add_fused_lm_head` as GRPOTrainer
wraps its policy (log-probabilities and entropy). A step is what GRPOTrainer's loss does
after generation: the forward with labels and `fused_lm_head=True` over B sequences of T
tokens whose first half (the prompt) is ignored, GRPO's per-token loss (the ratio to fixed
old log-probabilities clipped to [0.8, 1.28], one advantage per sequence, a mean over the
completion tokens: TRL's "dapo") and the backward pass. Per method: the step's median ms,
the peak memory beyond the model and the batch (GPUs), the loss. `--json` writes them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from bench import measure
from bench.compiled_model import model_device, parse_model_arguments
from bench.fsdp_model import MODEL, TINY

METHODS = ("trl", "ours")
CLIP = (0.8, 1.28)  # GRPO's epsilon_low 0.2 and DAPO's epsilon_high 0.28


def build(config: dict, method: str, dtype, device):
    """The model of `method` (seed 0: the same weights for all), TRL's fused head on it."""
    import transformers
    from trl.trainer import utils as trl_utils

    from torch_impl import trl as adapter

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(device=device, dtype=dtype).train()
    if method == "ours":
        adapter.patch_trl()
    elif getattr(trl_utils, adapter.TRL_HOOK) is adapter._FusedHead:  # TRL's own again after "ours"
        from trl.kernels import ChunkedLogProbFunction

        setattr(trl_utils, adapter.TRL_HOOK, ChunkedLogProbFunction)
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def batch(config: dict, rows: int, seq: int, device):
    """(input ids, labels with the prompt half -100, advantages [rows, 1], old log-probabilities
    [rows, seq - 1] near random logits')."""
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (rows, seq), device=device, generator=gen)
    labels = ids.clone()
    labels[:, : seq // 2] = -100
    advantages = torch.randn(rows, 1, device=device, generator=gen)
    old = -torch.log(torch.tensor(float(config["vocab_size"]))) + 0.3 * torch.randn(rows, seq - 1, device=device,
                                                                                     generator=gen)
    return ids, labels, advantages, old


def run(config: dict, methods, rows: int, seq: int, dtype, device, repeat: int, save=lambda results: None):
    """The rows of `methods`, each passed to `save` with those before it once measured."""
    ids, labels, advantages, old = batch(config, rows, seq, device)
    results = []
    for method in methods:
        model = build(config, method, dtype, device)

        def step():
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            mask = out.label_mask
            ratio = torch.exp(out.log_probs - old)
            per_token = -torch.minimum(ratio * advantages, ratio.clamp(*CLIP) * advantages)
            loss = (per_token * mask).sum() / mask.sum()
            loss.backward()
            return loss.detach()

        row = {"method": method, "rows": rows, "seq": seq, **measure.step_row(step, device, repeat)}
        results.append(row)
        save(results)
        print(json.dumps(row), flush=True)
        model = step = None
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.trl_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parse_model_arguments(parser, argv, rows=8, seq=2048)
    gpu, device, dtype = model_device(args)
    config = TINY if args.tiny else MODEL
    import trl

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "trl": trl.__version__,
           "device": torch.cuda.get_device_name() if gpu else "cpu", "dtype": str(dtype).removeprefix("torch."),
           "model": config, "command": "python -m bench.trl_step " + " ".join(argv if argv is not None else sys.argv[1:])}

    def save(results):
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env, "results": results}, f, indent=1)

    return run(config, args.methods.split(","), args.rows, args.seq, dtype, device, args.repeat or (10 if gpu else 2),
               save)


if __name__ == "__main__":
    main()
