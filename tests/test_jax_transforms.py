"""`jax_impl.linear_cross_entropy` under JAX's transformations: `vmap` over a leading batch
axis, `jax.checkpoint` (remat) and donated buffers, each against the float64 reference of
every batch item, for every strategy, with and without skipping ignored rows (on the CPU
the Pallas kernels run in interpret mode, in several row and column blocks: tests.frameworks.SMALL)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.frameworks import SMALL, check_against_reference, make_problem, reference, seed_of, tolerance

jax = pytest.importorskip("jax")
jnp = jax.numpy

import jax_impl  # noqa: E402

STRATEGIES = ["speed", "memory", "chunked"]
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-3)


@pytest.fixture(params=[False, True], ids=["all-rows", "skip-ignored"])
def tuning(request):
    """SMALL, computing every row or only those not ignored (at any size)."""
    return dataclasses.replace(SMALL, skip_ignored_min_work=0) if request.param else SMALL


def skips(tuning) -> bool:
    """Whether `tuning` skips ignored rows at these sizes (a part of the tests' seeds)."""
    return tuning.skip_ignored_min_work == 0


def batch_problem(seed: int, batch: int = 3):
    """A [batch, 13, 19] problem (V 53); with batch > 1 its second item has one target left."""
    p = make_problem(seed, lead=(batch, 13), ignore_frac=0.3, bias=True)
    if batch > 1:
        p.y[1] = -100
        p.y[1, 5] = 7
    return p


def item_reference(p, i: int, reduction: str = "mean"):
    item = make_problem(0)
    item.x, item.W, item.y, item.b = p.x[i], p.W, p.y[i], p.b
    return reference(item, dict(OPTIONS, reduction=reduction), np.float64(1.0), None)


def loss_fn(strategy: str, tuning):
    return lambda x, W, b, y: jax_impl.linear_cross_entropy(x, W, y, linear_bias=b, strategy=strategy, tuning=tuning,
                                                            **OPTIONS)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_vmap_over_a_leading_batch_axis(strategy, tuning):
    p = batch_problem(seed_of("vmap", strategy, skips(tuning)))
    grad = jax.value_and_grad(loss_fn(strategy, tuning), argnums=(0, 1, 2))
    losses, (gx, gW, gb) = jax.jit(jax.vmap(grad, in_axes=(0, None, None, 0)))(
        jnp.asarray(p.x), jnp.asarray(p.W), jnp.asarray(p.b), jnp.asarray(p.y.astype(np.int32)))
    for i in range(p.x.shape[0]):
        result = {"loss": losses[i], "grad_x": gx[i], "grad_W": gW[i], "grad_b": gb[i]}
        check_against_reference(result, item_reference(p, i), "float32")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_recomputes_the_same_gradients(strategy, tuning):
    p = batch_problem(seed_of("remat", strategy, skips(tuning)), batch=1)
    f = jax.checkpoint(loss_fn(strategy, tuning), policy=jax.checkpoint_policies.nothing_saveable)
    loss, (gx, gW, gb) = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(
        jnp.asarray(p.x[0]), jnp.asarray(p.W), jnp.asarray(p.b), jnp.asarray(p.y[0].astype(np.int32)))
    check_against_reference({"loss": loss, "grad_x": gx, "grad_W": gW, "grad_b": gb}, item_reference(p, 0), "float32")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_donated_weight_in_a_training_step(strategy, tuning):
    """A step that donates W and returns the updated one: the same update as the reference's."""
    p = batch_problem(seed_of("donate", strategy, skips(tuning)), batch=1)
    lr = 0.5

    def step(W, x, b, y):
        loss, gW = jax.value_and_grad(loss_fn(strategy, tuning), argnums=1)(x, W, b, y)
        return loss, W - lr * gW

    W = jnp.asarray(p.W)
    loss, W_new = jax.jit(step, donate_argnums=(0,))(W, jnp.asarray(p.x[0]), jnp.asarray(p.b),
                                                      jnp.asarray(p.y[0].astype(np.int32)))
    ref = item_reference(p, 0)
    tol = tolerance("float32")
    assert abs(float(loss) - ref.loss) <= tol * abs(ref.loss)
    want = p.W - lr * ref.grad_weight
    assert np.linalg.norm(np.asarray(W_new) - want) <= tol * np.linalg.norm(want)
