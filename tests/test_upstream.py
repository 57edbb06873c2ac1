"""A loss scaled by s gives gradients scaled by s, to the gradients' own rounding: gradients
formed in the forward pass are multiplied by the upstream gradient in fp32 and rounded once,
never by the upstream gradient rounded to their dtype (bf16(1/3) = 0.33398, 0.2% large, as a
loss divided over 3 accumulated micro-batches gets). Every PyTorch loss and strategy in fp32,
and in 16 bits the losses whose "speed" forms the gradients in the forward pass; fp16
and fp32 on the CPU (the kernels interpreted: Triton's interpreter rounds bf16 toward zero,
a bias of its own), bf16 too on CUDA."""

from __future__ import annotations

import pytest
import torch

import torch_impl
from tests.frameworks import SMALL

SCALE = 1 / 3


def _losses(device):
    """{name: loss(x, W) -> scalar} on fixed targets and teachers (N 64, D 19, V 53)."""
    gen = torch.Generator().manual_seed(7)
    n, v = 64, 53
    y = torch.randint(0, v, (n,), generator=gen)
    y[3] = -100
    ids = torch.randint(0, v, (n, 5), generator=gen)
    logprobs = torch.log_softmax(torch.randn(n, 5, generator=gen), -1)
    xt, Wt = torch.randn(n, 11, generator=gen), torch.randn(v, 11, generator=gen) * 0.3
    adv, old = torch.randn(n, generator=gen), -torch.rand(n, generator=gen) * 3
    y, ids, logprobs, xt, Wt, adv, old = (t.to(device) for t in (y, ids, logprobs, xt, Wt, adv, old))
    return {
        "cross_entropy": lambda x, W, s: torch_impl.linear_cross_entropy(x, W, y, strategy=s, tuning=SMALL),
        "topk_distillation": lambda x, W, s: torch_impl.linear_topk_distillation(
            x, W, ids, logprobs, target=y, strategy=s, tuning=SMALL),
        "distillation": lambda x, W, s: torch_impl.linear_distillation(
            x, W, xt.to(x.dtype), Wt.to(x.dtype), strategy=s, tuning=SMALL),
        "log_probs": lambda x, W, s: torch_impl.linear_log_probs(x, W, y, strategy=s, tuning=SMALL).sum(),
        "policy_loss": lambda x, W, s: torch_impl.linear_policy_loss(
            x, W, y, adv, old_log_probs=old, strategy=s, tuning=SMALL),
    }


def _grads(loss, x, W, strategy, scale):
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    (loss(x, W, strategy) * scale).backward()
    return x.grad.float(), W.grad.float()


def _check(device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64, 19, generator=gen).to(device, dtype)
    W = (torch.randn(53, 19, generator=gen) * 0.5).to(device, dtype)
    # Each element of a 16-bit gradient rounds on its own (at most eps / 2 relative, unbiased):
    # the mean of the elements' ratios over ~1000 elements lies within ~eps / 100 of s. A scale
    # rounded to the dtype first is off on every element by 2e-3 (bf16) or 2.4e-4 (fp16).
    tol = {torch.bfloat16: 4e-4, torch.float16: 5e-5}.get(dtype, 1e-6)
    for name, loss in _losses(device).items():
        # 16-bit: the losses and strategy whose gradients are formed in the forward pass (the
        # recomputing paths' own 16-bit drift is in bench/NOTES.md, 2026-11-26); fp32: all
        wide = dtype == torch.float32
        for strategy in ("speed", "memory", "chunked") if wide else ("speed",) if name != "log_probs" else ():
            plain, scaled = _grads(loss, x, W, strategy, 1.0), _grads(loss, x, W, strategy, SCALE)
            for what, g1, gs in zip(("grad_input", "grad_weight"), plain, scaled):
                kept = g1.abs() > 1e-2 * g1.abs().max()  # tiny entries: fp16 subnormals, cancellations
                ratio = float((gs[kept] / g1[kept]).mean())
                assert abs(ratio / SCALE - 1) <= tol, f"{name}, {strategy}, {dtype}, {what}: ratio {ratio!r}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_scaled_loss_scales_every_gradient(dtype):
    _check("cpu", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_scaled_loss_scales_every_gradient_on_cuda(dtype):
    _check("cuda", dtype)


def test_no_gradient_is_formed_where_autograd_does_not_record(monkeypatch):
    """Under torch.no_grad (an evaluation pass) with inputs that require gradients, "speed"
    computes the loss only: the loop forms no gradient in the forward pass (an autograd
    Function's forward is told which inputs require one, not whether anything records)."""
    from torch_impl import engine

    asked = []
    original = engine.forward
    monkeypatch.setattr(engine, "forward", lambda rule, blocks, grads_now=(False,) * 3, *a, **k: asked.append(
        any(grads_now)) or original(rule, blocks, grads_now, *a, **k))
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(64, 19, generator=gen).requires_grad_()
    W = (torch.randn(53, 19, generator=gen) * 0.5).requires_grad_()
    for name, loss in _losses("cpu").items():
        with torch.no_grad():
            loss(x, W, "speed")
        assert asked and not any(asked), name
        asked.clear()
        loss(x, W, "speed").backward()  # a training step still forms them
        assert any(asked) or name == "log_probs", name
        asked.clear()


def test_every_logits_buffer_is_freed_before_grad_weight_is_converted(monkeypatch):
    """The loop drops every logits buffer of a call (a dense teacher's too) before grad_weight's
    fp32 accumulator is converted to W's dtype, which allocates: a block of logits (half a GiB
    at L in "speed") must not stay alive there."""
    import weakref

    from torch_impl import engine, head

    made, alive = [], []
    init = head.HeadBlocks.__init__
    monkeypatch.setattr(head.HeadBlocks, "__init__", lambda self, *a, **k: made.append(weakref.ref(self)) or
                        init(self, *a, **k))
    final = engine.final_grad
    monkeypatch.setattr(engine, "final_grad", lambda acc, like: alive.extend(
        b.buffer.numel() for b in (r() for r in made) if b is not None and b.buffer is not None and b.buffer.numel())
        or final(acc, like))
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(64, 19, generator=gen).requires_grad_()
    W = (torch.randn(53, 19, generator=gen) * 0.5).requires_grad_()
    for name, loss in _losses("cpu").items():
        for strategy in ("speed", "memory"):
            made.clear()
            loss(x, W, strategy).backward()
            assert made and not alive, (name, strategy, alive)
