"""Train a tiny Flax NNX language model with the fused head + cross-entropy loss.

    python examples/train_flax.py [--steps 40]

(from a checkout: ``pip install -e ".[flax]" optax`` first, or run with ``PYTHONPATH=.``).
Runs on JAX's default device (a GPU when jax has one, else the CPU). The model, an
embedding, two attention-free residual MLP blocks and an ``nnx.Linear`` head, learns to
predict the next token of sequences that follow ``t -> (7 t + 3) mod V``; the same batch is
used at every step, so the printed loss falls. The logits [B, T, V] are never built:
`logitless.jax.fused_loss_from_head` takes the hidden states and the head module.
Needs flax >= 0.12 (``nnx.List``, ``nnx.Optimizer(model, tx, wrt=...)``) and optax.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from logitless.jax import fused_loss_from_head

VOCAB, DIM, BATCH, SEQ = 257, 64, 16, 32


class Block(nnx.Module):
    """Pre-norm residual MLP: x + W2 gelu(W1 norm(x)), x [..., D] -> [..., D]."""

    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TinyLM(nnx.Module):
    """Token ids [B, T] -> hidden states [B, T, D]; ``lm_head`` maps them to V logits."""

    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def features(self, tokens):
        """Final hidden states [B, T, D] (fp32) of int tokens [B, T]."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def make_batch(key, batch: int, seq: int, vocab: int):
    """Tokens [B, T] (int32) following t -> (7 t + 3) mod V, and labels [B, T]: the next
    token, -100 at the last position (no next token there)."""
    start = jax.random.randint(key, (batch, 1), 0, vocab)
    steps = [start]
    for _ in range(seq - 1):
        steps.append((7 * steps[-1] + 3) % vocab)
    tokens = jnp.concatenate(steps, axis=1)
    labels = jnp.concatenate([tokens[:, 1:], jnp.full((batch, 1), -100, tokens.dtype)], axis=1)
    return tokens, labels


def loss_fn(model: TinyLM, tokens, labels):
    """Mean next-token cross-entropy (fp32 scalar) over the labels that are not -100."""
    return fused_loss_from_head(model.features(tokens), model.lm_head, labels)


@nnx.jit
def train_step(model: TinyLM, optimizer: nnx.Optimizer, tokens, labels):
    """One AdamW step on (tokens, labels); returns the loss before the update."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, labels)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    model = TinyLM(VOCAB, DIM, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    tokens, labels = make_batch(jax.random.key(1), BATCH, SEQ, VOCAB)
    print(f"device {jax.devices()[0]}, vocab {VOCAB}, {BATCH}x{SEQ} tokens")
    for step in range(args.steps):
        loss = train_step(model, optimizer, tokens, labels)
        print(f"step {step:3d} loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
