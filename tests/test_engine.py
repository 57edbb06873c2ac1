"""What the PyTorch engine does for every loss: an "auto" call chooses its strategy again in
a backward pass that recomputes (where its gradient buffers are allocated), for
cross-entropy with lse returned (eager and compiled) and top-K distillation per row as for
log-probabilities (tests/test_log_probs.py); a set strategy is planned once (in each op of
a compiled call)."""

from __future__ import annotations

import pytest
import torch

from tests.frameworks import device


def _kernels_or_skip():
    from torch_impl.steps import kernels_can_run

    if not kernels_can_run(torch.zeros(1, device=device())):
        pytest.skip("the kernels can't run here")


def _spy(monkeypatch, module, chosen, planned, planner, strategy_at, free=0):
    """module.choose_strategy gives "auto" the strategies `chosen` in turn; the strategy of
    every call of module's `planner` is appended to `planned`. free: the bytes the engine
    sees free for logits kept between the passes (0: none kept, the backward pass recomputes
    and plans again)."""
    import torch_impl.engine as engine

    monkeypatch.setattr(engine, "free_bytes", lambda x: free)
    monkeypatch.setattr(module, "choose_strategy", lambda strategy, *a: next(chosen) if strategy == "auto" else strategy)
    owner, name = planner
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        planned.append(args[strategy_at])
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)


def _inputs(n=37, d=24, v=301, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    W = torch.randn(v, d, generator=g, dtype=torch.float64) / 2
    y = torch.randint(0, v, (n,), generator=g)
    y[::5] = -100
    return x, W, y, g


def _grads(fn, x, W, *upstream):
    xx, WW = (t.to(device(), torch.float32).requires_grad_() for t in (x, W))
    outputs = fn(xx, WW)
    sum(((o.double() * u.to(o.device)).sum() for o, u in zip(outputs, upstream))).backward()
    return [o.detach().double().cpu() for o in outputs] + [xx.grad.double().cpu(), WW.grad.double().cpu()]


def _close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backward", ["memory", "speed"])
def test_cross_entropy_with_lse_chooses_again_in_the_backward_pass(monkeypatch, backward):
    import torch_impl.functional as functional
    import torch_impl.head as head
    from torch_impl import linear_cross_entropy

    _kernels_or_skip()
    x, W, y, g = _inputs()
    upstream = (torch.tensor(0.7, dtype=torch.float64), torch.randn(y.shape[0], generator=g, dtype=torch.float64))
    valid = y != -100
    logits = x @ W.T
    lse = torch.logsumexp(logits, -1)
    xx, WW = x.clone().requires_grad_(), W.clone().requires_grad_()
    z = xx @ WW.T
    l_ref = torch.logsumexp(z, -1)
    loss_ref = (l_ref - z.gather(1, y.clamp(min=0)[:, None])[:, 0])[valid].mean()
    (loss_ref * upstream[0] + (l_ref * upstream[1]).sum()).backward()
    want = [loss_ref.detach(), lse, xx.grad, WW.grad]

    chosen, planned = iter(["speed", backward]), []
    _spy(monkeypatch, functional, chosen, planned, (head, "plan"), 2)
    call = lambda a, b: linear_cross_entropy(a, b, y.to(a.device), return_lse=True, strategy="auto")
    _close(_grads(call, x, W, *upstream), want)
    assert planned == ["speed", backward], planned
    planned.clear()
    _close(_grads(lambda a, b: linear_cross_entropy(a, b, y.to(a.device), return_lse=True, strategy="memory"), x, W,
                  *upstream), want)
    assert planned == ["memory"], planned


@pytest.mark.parametrize("backward", ["memory", "speed"])
def test_compiled_cross_entropy_with_lse_chooses_again_in_the_backward_pass(monkeypatch, backward):
    """Inside torch.compile the backward op builds its call from the op's arguments, "auto"
    included, so it chooses its strategy again where its buffers are allocated, as the eager
    call does."""
    import torch_impl.functional as functional
    import torch_impl.head as head
    from torch_impl import linear_cross_entropy

    _kernels_or_skip()
    x, W, y, g = _inputs()
    upstream = (torch.tensor(0.7, dtype=torch.float64), torch.randn(y.shape[0], generator=g, dtype=torch.float64))
    run = lambda strategy: torch.compile(lambda a, b: linear_cross_entropy(
        a, b, y.to(a.device), return_lse=True, strategy=strategy), fullgraph=True, backend="aot_eager")
    want = _grads(run("memory"), x, W, *upstream)

    chosen, planned = iter(["speed", backward]), []
    _spy(monkeypatch, functional, chosen, planned, (head, "plan"), 2)
    _close(_grads(run("auto"), x, W, *upstream), want)
    assert planned == ["speed", backward], planned
    planned.clear()
    _close(_grads(run("memory"), x, W, *upstream), want)
    assert planned == ["memory", "memory"], planned  # a set strategy: the same plan in both ops


@pytest.mark.parametrize("backward", ["memory", "speed"])
def test_topk_distillation_per_row_chooses_again_in_the_backward_pass(monkeypatch, backward):
    import torch_impl.distillation as distillation
    from torch_impl import linear_topk_distillation

    _kernels_or_skip()
    x, W, y, g = _inputs()
    ids = torch.stack([torch.randperm(W.shape[0], generator=g)[:4] for _ in range(x.shape[0])])
    teacher = torch.log_softmax(torch.randn(ids.shape, generator=g, dtype=torch.float64), -1)
    upstream = (torch.randn(x.shape[0], generator=g, dtype=torch.float64),)
    run = lambda strategy: lambda a, b: (linear_topk_distillation(
        a, b, ids.to(a.device), teacher.float().to(a.device), reduction="none", strategy=strategy),)
    want = _grads(run("memory"), x, W, *upstream)

    chosen, planned = iter(["speed", backward]), []
    _spy(monkeypatch, distillation, chosen, planned, (distillation, "plan_steps"), 2)
    _close(_grads(run("auto"), x, W, *upstream), want)
    assert planned == ["speed", backward], planned


def test_a_call_that_chooses_again_keeps_no_input_alive(monkeypatch):
    """The backward pass's plan holds values, not the call's tensors, and not the call (a
    cycle): the hidden states are freed once the graph is, without the garbage collector."""
    import gc
    import weakref

    import torch_impl.functional as functional
    from torch_impl import linear_cross_entropy

    _kernels_or_skip()
    monkeypatch.setattr(functional, "choose_strategy", lambda strategy, *a: "speed" if strategy == "auto" else strategy)
    x, W, y, _ = _inputs()
    a = x.to(device(), torch.float32).requires_grad_()
    h = a * 2  # an intermediate, as a model's last hidden states
    alive = weakref.ref(h)
    gc.disable()
    try:
        loss, lse = linear_cross_entropy(h, W.to(device(), torch.float32), y.to(device()), return_lse=True,
                                         strategy="auto")
        (loss + lse.sum()).backward()
        del h, loss, lse
        assert alive() is None
    finally:
        gc.enable()


def test_policy_loss_chooses_again_in_the_backward_pass(monkeypatch):
    """GRPO's loss planned "memory" (the backward pass recomputes) chooses "speed" there: the
    same loss and gradients as a call planned "memory" throughout."""
    import torch_impl.policy_loss as policy_loss
    from torch_impl import linear_policy_loss

    _kernels_or_skip()
    x, W, y, g = _inputs()
    advantages = torch.randn(x.shape[0], generator=g, dtype=torch.float64)
    old = -torch.rand(x.shape[0], generator=g, dtype=torch.float64) * 3
    run = lambda strategy: lambda a, b: (linear_policy_loss(
        a, b, y.to(a.device), advantages.float().to(a.device), old_log_probs=old.float().to(a.device), beta=0.0,
        strategy=strategy),)
    upstream = (torch.tensor(0.7, dtype=torch.float64),)
    want = _grads(run("memory"), x, W, *upstream)
    chosen, planned = iter(["memory", "speed"]), []
    _spy(monkeypatch, policy_loss, chosen, planned, (policy_loss, "plan_steps"), 2)
    _close(_grads(run("auto"), x, W, *upstream), want)
    assert planned == ["memory", "speed"], planned


def test_a_call_that_kept_its_logits_does_not_choose_again(monkeypatch):
    """An "auto" call planned "speed" whose forward pass kept its logits takes its backward
    pass from them, on the forward pass's plan (it allocates less than a recomputing one):
    no second plan, the gradients of a call planned "memory"."""
    import torch_impl.log_probs as log_probs
    from torch_impl import linear_log_probs

    _kernels_or_skip()
    x, W, y, g = _inputs()
    upstream = (torch.randn(x.shape[0], generator=g, dtype=torch.float64),)
    run = lambda strategy: lambda a, b: (linear_log_probs(a, b, y.to(a.device), strategy=strategy),)
    want = _grads(run("memory"), x, W, *upstream)
    chosen, planned = iter(["speed", "memory"]), []
    _spy(monkeypatch, log_probs, chosen, planned, (log_probs, "plan_steps"), 2, free=1 << 40)
    _close(_grads(run("auto"), x, W, *upstream), want)
    assert planned == ["speed"], planned


def _kept_calls(x, W, y, g):
    """name -> (call(x, W, strategy, tuning) -> outputs, upstream gradients): the losses whose
    backward pass would recompute the logits (the upstream gradients unknown in the forward
    pass), at a temperature and a softcap where the loss takes them."""
    from torch_impl import linear_cross_entropy, linear_distillation, linear_log_probs, linear_topk_distillation

    n, v = x.shape[0], W.shape[0]
    ids = torch.stack([torch.randperm(v, generator=g)[:4] for _ in range(n)])
    teacher = torch.log_softmax(torch.randn(ids.shape, generator=g, dtype=torch.float64), -1)
    x_t, W_t = torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randn(v, 8, generator=g, dtype=torch.float64)
    rows = lambda: torch.randn(n, generator=g, dtype=torch.float64)
    on = lambda t, a: t.to(a.device, torch.float32 if t.is_floating_point() else t.dtype)
    return {
        "log_probs": (lambda a, b, s, t: linear_log_probs(a, b, on(y, a), return_entropy=True, temperature=0.7,
                                                          softcap=3.0, strategy=s, tuning=t), (rows(), rows())),
        "cross_entropy_none": (lambda a, b, s, t: (linear_cross_entropy(a, b, on(y, a), reduction="none",
                                                                        label_smoothing=0.1, strategy=s, tuning=t),),
                               (rows(),)),
        "cross_entropy_lse": (lambda a, b, s, t: linear_cross_entropy(a, b, on(y, a), return_lse=True, softcap=5.0,
                                                                      strategy=s, tuning=t),
                              (torch.tensor(0.7, dtype=torch.float64), rows())),
        "topk_none": (lambda a, b, s, t: (linear_topk_distillation(a, b, on(ids, a), on(teacher, a), reduction="none",
                                                                   strategy=s, tuning=t),), (rows(),)),
        "dense_none": (lambda a, b, s, t: (linear_distillation(a, b, on(x_t, a), on(W_t, a), reduction="none",
                                                               divergence="jsd", strategy=s, tuning=t),), (rows(),)),
    }


@pytest.mark.parametrize("loss", ["log_probs", "cross_entropy_none", "cross_entropy_lse", "topk_none", "dense_none"])
def test_speed_keeps_the_logits_for_the_backward_pass_where_they_fit(monkeypatch, loss):
    """Where "speed"'s logits take at most Tuning.keep_logits_share of the free memory, the
    forward pass keeps them and the first backward pass turns them into dz (one product per
    gradient over all rows): the outputs and gradients of the recomputing backward pass, for
    every loss whose upstream gradients the forward pass does not know; a second backward
    pass (retain_graph) recomputes. Share 0, a "memory" call and a call that records no
    gradient keep nothing."""
    import dataclasses

    import torch_impl.engine as engine
    from tests.frameworks import SMALL

    _kernels_or_skip()
    x, W, y, g = _inputs()
    call, upstream = _kept_calls(x, W, y, g)[loss]
    want = _grads(lambda a, b: call(a, b, "memory", SMALL), x, W, *upstream)
    spent = []
    original = engine._backward_kept
    monkeypatch.setattr(engine, "_backward_kept", lambda *a: spent.append(a[2].z.shape[1]) or original(*a))
    monkeypatch.setattr(engine, "free_bytes", lambda t: 1 << 40)
    for share, kept in ((1.0, [W.shape[0]]), (0.0, [])):
        spent.clear()
        tuning = dataclasses.replace(SMALL, keep_logits_share=share)
        xx, WW = (t.to(device(), torch.float32).requires_grad_() for t in (x, W))
        outputs = call(xx, WW, "speed", tuning)
        total = sum((o.double() * u.to(o.device)).sum() for o, u in zip(outputs, upstream))
        first = torch.autograd.grad(total, (xx, WW), retain_graph=True)
        assert spent == kept, (share, spent)
        again = torch.autograd.grad(total, (xx, WW))
        assert spent == kept, "a second backward pass recomputes"
        got = [o.detach().double().cpu() for o in outputs]
        _close(got + [t.double().cpu() for t in first], want)
        _close(got + [t.double().cpu() for t in again], want)
    xx, WW = (t.to(device(), torch.float32).requires_grad_() for t in (x, W))
    spent.clear()
    with torch.no_grad():
        call(xx, WW, "speed", SMALL)
    _grads(lambda a, b: call(a, b, "memory", SMALL), x, W, *upstream)
    assert spent == []
