"""jax_impl.flax: the fused loss of Flax NNX / Linen models equals optax's on the full logits."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")

import jax_impl  # noqa: E402
from jax_impl.flax import fused_loss_from_head  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, DIM, BATCH, SEQ = 101, 16, 3, 7


def make_data(seed: int = 0):
    """Tokens [B, T] int32 in [0, V) and labels [B, T] with about a quarter set to -100."""
    k_tok, k_lab, k_mask = jax.random.split(jax.random.key(seed), 3)
    tokens = jax.random.randint(k_tok, (BATCH, SEQ), 0, VOCAB)
    labels = jax.random.randint(k_lab, (BATCH, SEQ), 0, VOCAB)
    labels = jnp.where(jax.random.uniform(k_mask, labels.shape) < 0.25, -100, labels)
    assert 0 < int((labels == -100).sum()) < labels.size
    return tokens, labels


def optax_mean_loss(logits, labels):
    """Mean of optax's integer-label cross-entropy over the rows whose label is not -100."""
    valid = labels != -100
    per_row = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    return jnp.sum(jnp.where(valid, per_row, 0.0)) / jnp.sum(valid)


def assert_trees_close(actual, expected, rtol=1e-5):
    """Same tree structure, every leaf within rtol (atol: rtol times the leaf's max |value|)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype
        np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * float(np.abs(e).max()))


class TinyNNX(nnx.Module):
    """Embed -> residual MLP -> LayerNorm, then a head: nnx.Linear, or the embedding (tied)."""

    def __init__(self, *, head: str, rngs: nnx.Rngs, dtype=None):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.mlp = nnx.Linear(DIM, DIM, rngs=rngs)
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.tied = head == "tied"
        if not self.tied:
            bias_init = nnx.initializers.normal(0.5)
            self.lm_head = nnx.Linear(
                DIM, VOCAB, use_bias=head == "linear_bias", bias_init=bias_init, dtype=dtype, rngs=rngs
            )

    def features(self, tokens):
        x = self.embed(tokens)
        return self.norm(x + jnp.tanh(self.mlp(x)))

    def head(self):
        return self.embed if self.tied else self.lm_head

    def logits(self, tokens):
        hidden = self.features(tokens)
        return self.embed.attend(hidden) if self.tied else self.lm_head(hidden)


@pytest.mark.parametrize("head", ["linear", "linear_bias", "tied"])
def test_nnx_loss_and_grads_match_optax(head):
    model = TinyNNX(head=head, rngs=nnx.Rngs(0))
    tokens, labels = make_data()

    def fused(model):
        return fused_loss_from_head(model.features(tokens), model.head(), labels)

    def reference(model):
        return optax_mean_loss(model.logits(tokens), labels)

    loss, grads = nnx.value_and_grad(fused)(model)
    ref_loss, ref_grads = nnx.value_and_grad(reference)(model)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads)


def test_nnx_jit_and_mixed_precision_head():
    """bf16 compute over fp32 parameters, under nnx.jit: the head's fp32 kernel and bias get
    fp32 gradients close to those of the module's own bf16 logits."""
    model = TinyNNX(head="linear_bias", rngs=nnx.Rngs(1), dtype=jnp.bfloat16)
    tokens, labels = make_data(1)

    @nnx.jit
    def fused(model):
        return nnx.value_and_grad(lambda m: fused_loss_from_head(m.features(tokens), m.lm_head, labels))(model)

    def reference(model):
        return optax_mean_loss(model.logits(tokens).astype(jnp.float32), labels)

    loss, grads = fused(model)
    ref_loss, ref_grads = nnx.value_and_grad(reference)(model)
    assert grads["lm_head"]["kernel"][...].dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    assert_trees_close(grads, ref_grads, rtol=5e-2)


def test_unsupported_head_raises():
    with pytest.raises(TypeError, match="nnx.Linear or nnx.Embed"):
        fused_loss_from_head(jnp.ones((2, DIM)), nnx.LayerNorm(DIM, rngs=nnx.Rngs(0)), jnp.zeros(2, jnp.int32))


class TinyLinen(linen.Module):
    """Embed -> residual MLP -> LayerNorm -> Dense head "lm_head" (kernel [D, V], bias [V])."""

    def setup(self):
        self.embed = linen.Embed(VOCAB, DIM)
        self.mlp = linen.Dense(DIM)
        self.norm = linen.LayerNorm()
        self.lm_head = linen.Dense(VOCAB, bias_init=linen.initializers.normal(0.5))

    def features(self, tokens):
        x = self.embed(tokens)
        return self.norm(x + jnp.tanh(self.mlp(x)))

    def __call__(self, tokens):
        return self.lm_head(self.features(tokens))


def test_linen_kernel_dv_matches_optax():
    model = TinyLinen()
    tokens, labels = make_data(2)
    params = model.init(jax.random.key(0), tokens)["params"]

    def fused(params):
        hidden = model.apply({"params": params}, tokens, method=TinyLinen.features)
        head = params["lm_head"]
        return jax_impl.linear_cross_entropy(
            hidden, head["kernel"], labels, linear_bias=head["bias"], weight_layout="DV"
        )

    def reference(params):
        return optax_mean_loss(model.apply({"params": params}, tokens), labels)

    loss, grads = jax.value_and_grad(fused)(params)
    ref_loss, ref_grads = jax.value_and_grad(reference)(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads)


def test_train_flax_example_loss_decreases():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    script = os.path.join(ROOT, "examples", "train_flax.py")
    out = subprocess.run(
        [sys.executable, script, "--steps", "12"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    losses = [float(v) for v in re.findall(r"^step\s+\d+ loss (\S+)$", out.stdout, flags=re.M)]
    assert len(losses) == 12, out.stdout
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses
