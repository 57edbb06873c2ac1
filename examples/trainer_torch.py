"""Hugging Face's Trainer with a patched causal LM: the loss is fused, gradient accumulation
passes num_items_in_batch through to it, and the run is the unpatched run's.

    python examples/trainer_torch.py --steps 8

A tiny Llama built from a config (no download) learns a repeating token pattern on the
CPU. Any Trainer setting works as usual: the patch changes the model's forward only.

TRL's SFTTrainer (1.x) fuses the head itself: it wraps the model's forward with its own
fused LM head and calls it with ``fused_lm_head=True``. A patched model trains in it exactly
as an unpatched one (tests/test_transformers.py), the patch stepping aside there; the patch
serves the Trainer, custom loops and evaluation.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

from logitless.torch import patch_causal_lm

VOCAB, SEQ = 64, 16


def dataset(n: int) -> list[dict]:
    """n sequences of a repeating pattern, with the first positions ignored (a prompt)."""
    rows = []
    for i in range(n):
        ids = torch.arange(i, i + SEQ) % 7 + 3
        labels = ids.clone()
        labels[: 2 + i % 3] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def train(steps: int, patched: bool, out_dir: str) -> tuple[transformers.PreTrainedModel, list[float]]:
    """A tiny Llama trained for `steps` optimizer steps (two micro-batches each); its losses."""
    transformers.set_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = transformers.LlamaForCausalLM(config)
    if patched:
        patch_causal_lm(model)
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_drop_last=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(4 * steps))
    trainer.train()
    return model, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        model, losses = train(args.steps, patched=True, out_dir=out_dir)
    print("losses:", " ".join(f"{loss:.3f}" for loss in losses))
    assert losses[-1] < losses[0], "the loss should fall"


if __name__ == "__main__":
    main()
