"""verl's fused head on the library (`torch_impl.verl`): verl's signature and outputs against
the float64 reference, its tensor-parallel group as the split head, and `patch_verl` making
verl's modules call it (a stand-in verl package: verl itself needs Ray and more to import)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from interop.log_probs_reference import linear_log_probs_reference
from tests.frameworks import make_problem, rel_err, seed_of, tolerance
from tests.frameworks import device as default_device


def _run(p, temperature, reduction, g_lp, g_H, group=None):
    """verl's call on p's rows; {"log_probs", "entropy", "grad_x", "grad_W"} as float64 numpy."""
    from torch_impl.verl import linear_cross_entropy

    dev, dtype = default_device(), getattr(torch, p.dtype)
    x = torch.tensor(p.x, device=dev).to(dtype).requires_grad_()
    W = torch.tensor(p.W, device=dev).to(dtype).requires_grad_()
    logp, entropy = linear_cross_entropy(x, W, torch.tensor(p.y, device=dev), temperature, reduction, group)
    assert logp.dtype == entropy.dtype == torch.float32 and entropy.shape == p.y.shape
    assert logp.shape == (p.y.shape if reduction == "none" else ())
    g = torch.tensor(g_lp if reduction == "none" else g_lp.flat[0], device=dev, dtype=torch.float32)
    (logp * g).sum().add_((entropy * torch.tensor(g_H, device=dev, dtype=torch.float32)).sum()).backward()
    out = dict(log_probs=logp, entropy=entropy, grad_x=x.grad, grad_W=W.grad)
    return {k: v.detach().double().cpu().numpy() for k, v in out.items()}


def _check(case: str, dtype: str, reduction: str, group=None):
    temperature = 0.7
    seed = seed_of("verl", case, dtype, reduction)
    p = make_problem(seed, dtype=dtype, ignore_frac=0.0)
    rng = np.random.default_rng(seed + 1)
    # "sum"/"mean": one upstream gradient for the reduced log-probabilities, spread over the rows
    g_lp = rng.standard_normal(p.y.shape) if reduction == "none" else np.full(p.y.shape, rng.standard_normal())
    g_H = rng.standard_normal(p.y.shape)
    got = _run(p, temperature, reduction, g_lp, g_H, group)
    scale = 1.0 / p.y.size if reduction == "mean" else 1.0
    want = linear_log_probs_reference(p.x, p.W, p.y, temperature=temperature, ignore_index=None,
                                      grad_log_probs=g_lp * scale, grad_entropy=g_H)
    reduced = {"none": want.log_probs, "sum": want.log_probs.sum(), "mean": want.log_probs.mean()}[reduction]
    tol = tolerance(dtype, p.logit_scale)
    for key, ref in (("log_probs", reduced), ("entropy", want.entropy), ("grad_x", want.grad_input),
                     ("grad_W", want.grad_weight)):
        assert rel_err(got[key], ref) <= tol, (case, dtype, reduction, key, rel_err(got[key], ref))


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_verl_signature_matches_reference(dtype, reduction):
    """Per-token log p(label) and entropy at a temperature, reduced as verl reduces them, and
    the gradients of any combination of both, against the float64 reference."""
    _check("plain", dtype, reduction)


def _tensor_parallel_worker(rank: int, world: int, port: int) -> None:
    """One gloo rank of `test_verl_tensor_parallel_group_is_the_split_head`."""
    import os

    import torch.distributed as dist

    from torch_impl.verl import linear_cross_entropy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        p = make_problem(seed_of("verl-tp"), vocab=54, ignore_frac=0.0)
        rng = np.random.default_rng(5)
        g_lp, g_H = rng.standard_normal(p.y.shape), rng.standard_normal(p.y.shape)
        share = p.W.shape[0] // world
        # Megatron's shapes: hidden [T, 1, H] (sequence first), labels [1, T]; the rank's classes
        hidden = torch.tensor(p.x)[:, None, :].requires_grad_()
        W = torch.tensor(p.W[rank * share:(rank + 1) * share]).requires_grad_()
        logp, entropy = linear_cross_entropy(hidden, W, torch.tensor(p.y)[None, :], 0.7, "none", dist.group.WORLD)
        assert logp.shape == entropy.shape == p.y.shape
        (logp * torch.tensor(g_lp, dtype=torch.float32) + entropy * torch.tensor(g_H, dtype=torch.float32)).sum().backward()
        dx = hidden.grad[:, 0].clone()
        dist.all_reduce(dx)  # what Megatron's backward of its gather does with the ranks' shares
        want = linear_log_probs_reference(p.x, p.W, p.y, temperature=0.7, grad_log_probs=g_lp, grad_entropy=g_H)
        tol = tolerance("float32")
        for key, got, ref in (("log_probs", logp, want.log_probs), ("entropy", entropy, want.entropy),
                              ("grad_x", dx, want.grad_input),
                              ("grad_W", W.grad, want.grad_weight[rank * share:(rank + 1) * share])):
            assert rel_err(got.detach().double().numpy(), ref) <= tol, (rank, key)
    finally:
        dist.destroy_process_group()


def test_verl_tensor_parallel_group_is_the_split_head():
    """On 2 gloo ranks, each holding half the classes, with Megatron's shapes: the
    log-probabilities and entropy of the whole head on every rank, each rank's slice of
    grad_weight, and grad_input's shares summing to the whole (as verl's kernel)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_tensor_parallel_worker, args=(2, port), nprocs=2, join=True)


def test_verl_arguments_are_checked():
    from torch_impl.verl import linear_cross_entropy

    x, W, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 4])
    with pytest.raises(ValueError, match="reduction .* 'avg'"):
        linear_cross_entropy(x, W, y, reduction="avg")
    with pytest.raises(ValueError, match="target holds 7"):
        linear_cross_entropy(x, W, torch.tensor([0, 7, 1]))
    logp, _ = linear_cross_entropy(x, W, torch.tensor([0, -100, 1]))  # the library's ignore_index
    assert logp[1] == 0 and logp[0] < 0


@pytest.fixture
def fake_verl(monkeypatch):
    """A stand-in for verl's modules: its kernel module and a forward module that took the
    kernel at its top (as verl's Megatron forwards do)."""
    def original(*args, **kwargs):
        raise AssertionError("verl's own kernel ran")

    modules = {}
    for name in ("verl", "verl.utils", "verl.utils.kernel", "verl.utils.kernel.linear_cross_entropy",
                 "verl.models.mcore.model_forward_fused"):
        modules[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, modules[name])
    modules["verl.utils.kernel.linear_cross_entropy"].linear_cross_entropy = original
    modules["verl.models.mcore.model_forward_fused"].linear_cross_entropy = original
    return modules


def test_patch_verl_replaces_the_kernel_where_verl_calls_it(fake_verl):
    """After patch_verl, verl's kernel module and the modules that imported its kernel call the
    library; a forward importing it later (verl's Hugging Face paths) gets it too."""
    import logitless.torch as lt
    from torch_impl import verl

    kernel = fake_verl["verl.utils.kernel.linear_cross_entropy"]
    lt.patch_verl()
    lt.patch_verl()  # a second call changes nothing
    assert kernel.linear_cross_entropy is verl.linear_cross_entropy
    assert fake_verl["verl.models.mcore.model_forward_fused"].linear_cross_entropy is verl.linear_cross_entropy
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    x, W, y = torch.randn(6, 4), torch.randn(9, 4), torch.tensor([0, 1, 8, 2, 3, 4])
    logp, entropy = linear_cross_entropy(x, W, y, 0.5)
    ref = torch.log_softmax(x.double() @ W.double().T / 0.5, -1)
    torch.testing.assert_close(logp, ref[torch.arange(6), y].float())
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1).float())


def test_patch_verl_names_what_is_missing(monkeypatch, fake_verl):
    import logitless.torch as lt

    del fake_verl["verl.utils.kernel.linear_cross_entropy"].linear_cross_entropy
    with pytest.raises(RuntimeError, match="verl.utils.kernel.linear_cross_entropy has no linear_cross_entropy"):
        lt.patch_verl()
    monkeypatch.setitem(sys.modules, "verl.utils.kernel.linear_cross_entropy", None)  # not installed
    with pytest.raises(ImportError, match="patch_verl needs verl"):
        lt.patch_verl()
