"""The `tuning` argument (interop.tuning.Tuning) of every public call of both frameworks:
anything but None or a Tuning is refused with a TypeError naming it; a Tuning reaches the
block planner, whose blocks it changes and whose result it does not (beyond rounding)."""

from __future__ import annotations

import numpy as np
import pytest

from interop.tuning import DEFAULT
from tests import distill_frameworks
from tests.frameworks import SMALL, JaxAdapter, TorchAdapter, device, make_problem, rel_err, tolerance

# (framework, loss): the public calls; "module" is torch_impl.LinearCrossEntropyLoss
CALLS = [("torch", "cross_entropy"), ("torch", "module"), ("torch", "topk"), ("torch", "dense"),
         ("jax", "cross_entropy"), ("jax", "topk"), ("jax", "dense")]


def _run(framework: str, loss: str, tuning, strategy: str = "speed") -> dict:
    """Loss and gradients (float64 numpy) of a small problem (13 x 19 x 53, fp32) through one
    public call with `tuning` (PyTorch's on CUDA where there is a GPU: the kernels run on
    CPU tensors only in Triton's interpreter)."""
    if loss in ("topk", "dense"):
        p = distill_frameworks.make_problem(loss, 7, target=True)
        return distill_frameworks.run(framework, strategy, p, {}, np.asarray(1.0), device=device(), tuning=tuning)
    p = make_problem(7, bias=True)
    if loss == "cross_entropy":
        adapter = TorchAdapter(strategy, device(), tuning) if framework == "torch" else JaxAdapter(strategy, tuning)
        return adapter.run(p, dict(label_smoothing=0.1), np.asarray(1.0), None)
    import torch

    import torch_impl

    x, W, b = (torch.tensor(a, device=device(), requires_grad=True) for a in (p.x, p.W, p.b))
    module = torch_impl.LinearCrossEntropyLoss(label_smoothing=0.1, strategy=strategy, tuning=tuning)
    out = module(x, W, torch.tensor(p.y, device=device()), linear_bias=b)
    grads = torch.autograd.grad(out, (x, W, b))
    return {k: v.detach().double().cpu().numpy() for k, v in zip(("loss", "grad_x", "grad_W", "grad_b"), (out, *grads))}


@pytest.fixture
def plans(monkeypatch):
    """[(the Tuning the planner got, the block rows it planned)] of every call's blocks: the
    one planner of both frameworks, interop.planning.plan."""
    from interop import planning

    seen, planner = [], planning.plan

    def spy(t, *args, **kwargs):
        plan = planner(t, *args, **kwargs)
        seen.append((t, plan.rows))
        return plan

    monkeypatch.setattr(planning, "plan", spy)
    return seen


@pytest.mark.parametrize("bad", [{"min_block": 4}, "small", DEFAULT.__class__], ids=["dict", "str", "class"])
@pytest.mark.parametrize("framework, loss", CALLS)
def test_anything_but_a_tuning_is_refused(framework, loss, bad):
    with pytest.raises(TypeError, match=r"\btuning\b"):
        _run(framework, loss, bad)


@pytest.mark.parametrize("framework, loss", CALLS)
def test_a_tuning_changes_the_blocks_not_the_result(plans, framework, loss):
    """Blocks of 4 rows (SMALL) where the defaults take all 13 rows in one: the planner gets
    the call's Tuning (None: the defaults), and the loss and gradients agree within fp32's
    tolerance."""
    got, rows = {}, {}
    for name, tuning in (("none", None), ("small", SMALL)):
        plans.clear()
        got[name] = _run(framework, loss, tuning)
        assert plans and all(t == (tuning or DEFAULT) for t, _ in plans), plans
        rows[name] = plans[-1][1]
    assert (rows["none"], rows["small"]) == (13, 4)
    assert got["none"].keys() == got["small"].keys()
    for key in got["none"]:
        assert rel_err(got["small"][key], got["none"][key]) <= tolerance("float32"), key
