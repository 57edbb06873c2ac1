"""Every tensor argument in every layout a caller can pass, every argument on the wrong device
or not a tensor: PyTorch (the JAX arrays a caller passes have no strides).

The layout matrix runs each strategy on views that hold the same kind of values as a fresh
contiguous tensor (strided, transposed, expanded, a column slice, an unaligned storage
offset) and checks loss, lse and gradients against the float64 reference, with blocks small
enough that the kernels see several row and column blocks and the rows skipped for ignored
targets are gathered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from interop.tuning import DEFAULT, Tuning
from tests.frameworks import (LAYOUTS, Problem, check_against_reference, laid_out, make_problem, reference, rel_err, seed_of,
                              tolerance)
from torch_impl import linear_cross_entropy

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                    reason="needs a CUDA GPU")])]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# config: (options, whether lse is returned and gets a gradient). "reduced" takes "speed"'s
# gradients-in-the-forward path and the gathered rows; "rows" the recomputing backward pass.
CONFIGS = {
    "reduced": (dict(label_smoothing=0.1, z_loss=1e-3, softcap=8.0), False),
    "rows": (dict(reduction="none", label_smoothing=0.1, z_loss=1e-3, softcap=8.0), True),
}
TENSOR_ARGS = ("input", "linear_weight", "target", "linear_bias", "weight")
GRAD_ARGS = ("grad_output", "grad_lse")


# Blocks small enough for a test's shape (27 x 16 x 70) to span several row and column blocks
# (two fp32 grad_weight slabs), with the ignored rows skipped.
SMALL_BLOCKS = Tuning(min_block=8, min_memory_block=(8, 16), memory_fraction=0.01, speed_block_elements=16 * 70, speed_min_rows=1,
                      whole_row_head_bytes=0, one_speed_block_share=0,
                      weight_grad_slab_bytes=1 << 10, slab_align=8, skip_ignored_min_work=0, min_whole_rows=1 << 30)


def _inputs(seed: int, dtype: str, device: str) -> dict:
    p = make_problem(seed, lead=(3, 9), hidden=16, vocab=70, dtype=dtype, bias=True, class_weights=True, logit_scale=2.0)
    p.y.flat[0] = 5  # an "expanded" target repeats a class, not ignore_index
    t = {"input": torch.tensor(p.x), "linear_weight": torch.tensor(p.W), "linear_bias": torch.tensor(p.b)}
    t = {k: v.to(device, DTYPES[dtype]) for k, v in t.items()}
    rng = np.random.default_rng(seed + 1)
    t.update(target=torch.tensor(p.y, device=device), weight=torch.tensor(p.cw, device=device),
             grad_output=torch.tensor(rng.standard_normal(p.y.shape), dtype=torch.float32, device=device),
             grad_lse=torch.tensor(rng.standard_normal(p.y.shape), dtype=torch.float32, device=device))
    return t


def _problem(t: dict, dtype: str) -> Problem:
    as_np = lambda a: a.detach().double().cpu().numpy()
    return Problem(x=as_np(t["input"]), W=as_np(t["linear_weight"]), y=t["target"].cpu().numpy(),
                   b=as_np(t["linear_bias"]), cw=as_np(t["weight"]), dtype=dtype, logit_scale=2.0)


def _check(t: dict, dtype: str, strategy: str, config: str, tuning: Tuning = DEFAULT) -> None:
    options, with_lse = CONFIGS[config]
    leaves = {k: t[k].detach().requires_grad_() for k in ("input", "linear_weight", "linear_bias")}
    out = linear_cross_entropy(leaves["input"], leaves["linear_weight"], t["target"], linear_bias=leaves["linear_bias"],
                               weight=t["weight"], strategy=strategy, return_lse=with_lse, tuning=tuning, **options)
    loss, lse = out if with_lse else (out, None)
    g_out = t["grad_output"] if loss.ndim else torch.ones((), device=loss.device)
    outs, grads_in = ([loss, lse], [g_out, t["grad_lse"]]) if with_lse else ([loss], [g_out])
    grads = torch.autograd.grad(outs, list(leaves.values()), grads_in)
    ref = reference(_problem(t, dtype), options, g_out.double().cpu().numpy(),
                    t["grad_lse"].double().cpu().numpy() if with_lse else None)
    got = {"loss": loss, "lse": lse, "grad_x": grads[0], "grad_W": grads[1], "grad_b": grads[2]}
    check_against_reference({k: v.detach().double().cpu().numpy() for k, v in got.items() if v is not None}, ref, dtype, 2.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arg", TENSOR_ARGS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
@pytest.mark.parametrize("device", DEVICES)
def test_tensor_argument_layouts(device, strategy, config, arg, layout, dtype):
    t = _inputs(seed_of(strategy, config, arg, layout, dtype), dtype, device)
    t[arg] = laid_out(t[arg], layout)
    _check(t, dtype, strategy, config, SMALL_BLOCKS)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arg", GRAD_ARGS)
@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
@pytest.mark.parametrize("device", DEVICES)
def test_upstream_gradient_layouts(device, strategy, arg, layout, dtype):
    t = _inputs(seed_of(strategy, arg, layout, dtype), dtype, device)
    t[arg] = laid_out(t[arg], layout)
    _check(t, dtype, strategy, "rows", SMALL_BLOCKS)


@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
@pytest.mark.parametrize("device", DEVICES)
def test_lse_sum_backward(device, strategy):
    """lse.sum().backward() hands the kernels an upstream gradient of stride 0."""
    t = _inputs(seed_of("lse-sum", strategy), "float32", device)
    x = t["input"].requires_grad_()
    _, lse = linear_cross_entropy(x, t["linear_weight"], t["target"], return_lse=True, strategy=strategy)
    lse.sum().backward()
    ref = x.detach().double().reshape(-1, 16) @ t["linear_weight"].double().T
    expected = torch.softmax(ref, dim=1) @ t["linear_weight"].double()
    assert rel_err(x.grad.double().reshape(-1, 16).cpu().numpy(), expected.cpu().numpy()) <= tolerance("float32")


def _call(**changed):
    t = _inputs(0, "float32", "cpu")
    args = dict(input=t["input"], linear_weight=t["linear_weight"], target=t["target"], linear_bias=None, weight=None)
    args.update(changed)
    x, W, y = args.pop("input"), args.pop("linear_weight"), args.pop("target")
    return linear_cross_entropy(x, W, y, strategy="memory", **args)


@pytest.mark.parametrize("arg", TENSOR_ARGS)
def test_non_tensor_argument_is_a_type_error(arg):
    with pytest.raises(TypeError, match=f"{arg} must be a torch.Tensor"):
        _call(**{arg: [1.0, 2.0]})


@pytest.mark.parametrize("arg", TENSOR_ARGS)
def test_argument_on_meta_device_is_refused(arg):
    t = _inputs(0, "float32", "cpu")
    value = torch.empty_like(t[arg] if arg in t else t["linear_bias"], device="meta")
    with pytest.raises(ValueError, match=f"{arg} is on the meta device"):
        _call(**{arg: value})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["auto", "speed", "memory", "chunked"])
@pytest.mark.parametrize("arg", ["linear_weight", "target", "linear_bias", "weight"])
def test_argument_on_another_device_is_refused(arg, strategy):
    t = {k: v.cuda() for k, v in _inputs(0, "float32", "cpu").items()}
    args = dict(input=t["input"], linear_weight=t["linear_weight"], target=t["target"], linear_bias=t["linear_bias"],
                weight=t["weight"])
    args[arg] = args[arg].cpu()
    x, W, y = args.pop("input"), args.pop("linear_weight"), args.pop("target")
    with pytest.raises(ValueError, match=f"{arg} is on cpu but input is on cuda"):
        linear_cross_entropy(x, W, y, strategy=strategy, **args)
