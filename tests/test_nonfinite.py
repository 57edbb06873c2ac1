"""NaN and inf placed in every tensor that makes logits, on every implementation: a
non-finite value reaches exactly the outputs the float64 reference says it reaches (a
diverging model must never report a finite loss), and the top-K teacher's NaN is not
mistaken for padding.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.frameworks import JaxAdapter, TorchAdapter, device, make_problem, reference

# PyTorch's kernels run on CUDA where there is a GPU (on a CPU, in Triton's interpreter)
IMPLEMENTATIONS = {a.name: a for s in ("chunked", "speed", "memory") for a in (TorchAdapter(s, device()), JaxAdapter(s))}
UNTARGETED = 7  # a class no row targets: only the row statistics (max, sum) see it

# placement: how it changes a problem (x [N, D], W [V, D], b [V], y [N])
PLACEMENTS = {
    "nan-head-class-untargeted": lambda p: p.W.__setitem__((UNTARGETED, 3), np.nan),
    "nan-bias-class-untargeted": lambda p: p.b.__setitem__(UNTARGETED, np.nan),
    "nan-input-row": lambda p: p.x.__setitem__(2, np.nan),
    "nan-input-entry-ignored-row": lambda p: p.x.__setitem__((4, 0), np.nan),
    "inf-input-entry": lambda p: p.x.__setitem__((2, 1), np.inf),
    "inf-head-entry-untargeted": lambda p: p.W.__setitem__((UNTARGETED, 0), -np.inf),
}


def _problem(placement: str):
    p = make_problem(11, lead=(9,), hidden=12, vocab=40, bias=True, ignore_frac=0.0)
    p.y[p.y == UNTARGETED] = UNTARGETED + 1
    p.y[4] = -100
    PLACEMENTS[placement](p)
    return p


def _finite(a) -> np.ndarray:
    return np.isfinite(np.asarray(a, np.float64))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_nonfinite_rows_match_reference(impl, placement):
    """reduction="none" with lse: the rows whose loss and lse are not finite are the
    reference's, row by row; a gradient holds a non-finite value iff the reference's does."""
    p = _problem(placement)
    g_out, g_lse = np.ones(p.y.shape), np.ones(p.y.shape)
    got = IMPLEMENTATIONS[impl].run(p, dict(reduction="none"), g_out, g_lse)
    ref = reference(p, dict(reduction="none"), g_out, g_lse)
    assert np.array_equal(_finite(got["loss"]), _finite(ref.loss)), (got["loss"], ref.loss)
    assert np.array_equal(_finite(got["lse"]), _finite(ref.lse)), (got["lse"], ref.lse)
    assert got["loss"][4] == 0, "an ignored row contributes exactly 0"
    for key, r in (("grad_x", ref.grad_input), ("grad_W", ref.grad_weight), ("grad_b", ref.grad_bias)):
        assert _finite(got[key]).all() == _finite(r).all(), key


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_nonfinite_reaches_the_reduced_loss(impl, placement):
    """A reduced loss without lse ("speed" forms the gradients in the forward pass)."""
    p = _problem(placement)
    got = IMPLEMENTATIONS[impl].run(p, dict(reduction="mean"), np.asarray(1.0), None)
    ref = reference(p, dict(reduction="mean"), np.asarray(1.0), None)
    assert _finite(got["loss"]) == _finite(ref.loss), (got["loss"], ref.loss)
    for key, r in (("grad_x", ref.grad_input), ("grad_W", ref.grad_weight), ("grad_b", ref.grad_bias)):
        assert _finite(got[key]).all() == _finite(r).all(), key


def _topk_teacher(n: int, k: int, vocab: int):
    rng = np.random.default_rng(5)
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n)])
    lp = np.log(rng.dirichlet(np.ones(k), n))
    lp[1, 2] = np.nan  # a corrupted teacher entry
    lp[3, 0] = -np.inf  # padding
    return ids, lp


@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_topk_teacher_nan_is_not_padding(framework, strategy):
    n, d, vocab, k = 6, 8, 30, 4
    rng = np.random.default_rng(6)
    x, W = rng.standard_normal((n, d)).astype(np.float32), rng.standard_normal((vocab, d)).astype(np.float32)
    ids, lp = _topk_teacher(n, k, vocab)
    if framework == "torch":
        import torch

        import torch_impl

        loss = torch_impl.linear_topk_distillation(torch.tensor(x), torch.tensor(W), torch.tensor(ids),
                                                   torch.tensor(lp, dtype=torch.float32), reduction="none",
                                                   strategy=strategy).numpy()
    else:
        import jax.numpy as jnp

        import jax_impl

        loss = np.asarray(jax_impl.linear_topk_distillation(jnp.asarray(x), jnp.asarray(W), jnp.asarray(ids),
                                                            jnp.asarray(lp, jnp.float32), reduction="none",
                                                            strategy=strategy))
    assert np.isnan(loss[1]), "a NaN teacher log-probability must reach its row's loss"
    assert np.isfinite(np.delete(loss, 1)).all(), "-inf is padding: the other rows stay finite"
