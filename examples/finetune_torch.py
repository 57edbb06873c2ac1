"""Train a tiny Hugging Face Llama whose loss never builds the [B, T, V] logits.

    python examples/finetune_torch.py [--steps 30]

(from a checkout: ``pip install -e ".[torch]" transformers`` first, or run with
``PYTHONPATH=.``). Runs on a CUDA GPU when torch has one, else the CPU. The model, a
randomly initialised two-layer ``LlamaForCausalLM`` (nothing is downloaded), is patched
with `logitless.torch.patch_causal_lm`: in train mode with ``labels`` its forward
returns the loss of Hugging Face's shifted next-token cross-entropy with ``logits=None``.
It learns one batch of random tokens (the first 8 positions of each row ignored, as a
prompt would be), the same batch at every step, so the printed loss falls.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from logitless.torch import patch_causal_lm

VOCAB, DIM, BATCH, SEQ, PROMPT = 4099, 64, 8, 64, 8


def make_model(device: torch.device) -> LlamaForCausalLM:
    """A patched fp32 Llama (seed 0) with a V=4099 head, in train mode on ``device``."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=4 * DIM, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )
    return patch_causal_lm(LlamaForCausalLM(config)).to(device).train()


def make_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] (int64, random) and labels [B, T]: the input ids, -100 on the prompt.

    The model shifts the labels itself: position t is trained to predict labels[:, t + 1].
    """
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    labels = input_ids.clone()
    labels[:, :PROMPT] = -100
    return input_ids.to(device), labels.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    input_ids, labels = make_batch(device)
    print(f"device {device}, vocab {VOCAB}, {BATCH}x{SEQ} tokens")
    for step in range(args.steps):
        out = model(input_ids=input_ids, labels=labels)
        assert out.logits is None  # the fused loss built no logits
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step:3d} loss {out.loss.item():.4f}")


if __name__ == "__main__":
    main()
