"""Bad input, empty and all-ignored batches, NaN propagation, out-of-range targets: both frameworks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.frameworks import JaxAdapter, TorchAdapter, cpu_implementations, make_problem, reference, rel_err, tolerance

FRAMEWORKS = {"torch": TorchAdapter(), "jax": JaxAdapter()}
IMPLEMENTATIONS = cpu_implementations()

x_ND = np.zeros((4, 8), np.float32) + 0.5
W_VD = np.ones((10, 8), np.float32)
y_N = np.array([1, 2, -100, 9])

# (arguments changed from a valid call, exception type, words the message must contain)
BAD_CALLS = {
    "hidden-size-mismatch": (dict(W=np.ones((10, 9), np.float32)), ValueError, ["input", "(4, 8)", "(10, 9)"]),
    "weight-rank": (dict(W=np.ones((10, 8, 1), np.float32)), ValueError, ["linear_weight", "(10, 8, 1)"]),
    "input-scalar": (dict(x=np.float32(1.0)), ValueError, ["input", "()"]),
    "target-shape": (dict(y=np.array([1, 2, 3])), ValueError, ["target", "(4,)", "(3,)"]),
    "floating-target": (dict(y=np.array([1.0, 2.0, 3.0, 4.0], np.float32)), ValueError, ["target", "float32"]),
    "dtype-mismatch": (dict(W=np.ones((10, 8), np.float16)), TypeError, ["input", "float32", "linear_weight", "float16"]),
    "integer-input": (dict(x=np.ones((4, 8), np.int32), W=np.ones((10, 8), np.int32)), TypeError, ["input", "int32"]),
    "bias-shape": (dict(linear_bias=np.ones(9, np.float32)), ValueError, ["linear_bias", "(10,)", "(9,)"]),
    "bias-dtype": (dict(linear_bias=np.ones(10, np.float16)), TypeError, ["linear_bias", "float16"]),
    "class-weight-shape": (dict(weight=np.ones(11, np.float32)), ValueError, ["weight", "(10,)", "(11,)"]),
    "reduction": (dict(reduction="avg"), ValueError, ["reduction", "avg"]),
    "label-smoothing-high": (dict(label_smoothing=1.5), ValueError, ["label_smoothing", "1.5"]),
    "label-smoothing-negative": (dict(label_smoothing=-0.1), ValueError, ["label_smoothing", "-0.1"]),
    "softcap-zero": (dict(softcap=0.0), ValueError, ["softcap", "0.0"]),
    "softcap-negative": (dict(softcap=-3.0), ValueError, ["softcap", "-3.0"]),
    "z-loss-negative": (dict(z_loss=-1e-4), ValueError, ["z_loss"]),
    "weight-layout": (dict(weight_layout="NV"), ValueError, ["weight_layout", "NV"]),
    "target-out-of-range": (dict(y=np.array([1, 10, -100, 0])), ValueError, ["target", "10", "[0, 10)"]),
    "target-negative": (dict(y=np.array([1, -1, -100, 0])), ValueError, ["target", "-1", "ignore_index=-100"]),
    "ignore-index-past-int64": (dict(ignore_index=2**70), ValueError, ["ignore_index", "int64", str(2**70)]),
    "label-smoothing-string": (dict(label_smoothing="0.1"), ValueError, ["label_smoothing", "a number", "'0.1'"]),
    "z-loss-string": (dict(z_loss="1e-4"), ValueError, ["z_loss", "a number", "'1e-4'"]),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
@pytest.mark.parametrize("fw", list(FRAMEWORKS))
def test_bad_input_raises_clear_error(fw, case):
    changes, exc, words = BAD_CALLS[case]
    args = {"x": x_ND, "W": W_VD, "y": y_N, **changes}
    x, W, y = args.pop("x"), args.pop("W"), args.pop("y")
    with pytest.raises(exc) as info:
        FRAMEWORKS[fw].call(x, W, y, **args)
    for word in words:
        assert word in str(info.value), f"{word!r} not in message: {info.value}"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_empty_batch_behaves_like_torch_cross_entropy(impl, reduction):
    import torch

    p = make_problem(1, lead=(0,), bias=True)
    g_out = np.zeros((0,)) if reduction == "none" else np.asarray(1.0)
    result = IMPLEMENTATIONS[impl].run(p, dict(reduction=reduction), g_out, None, return_lse=True)
    expected = torch.nn.functional.cross_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), reduction=reduction)
    np.testing.assert_array_equal(result["loss"], expected.double().numpy())
    assert result["grad_x"].shape == (0, 19) and result["lse"].shape == (0,)
    assert np.all(result["grad_W"] == 0) and np.all(result["grad_b"] == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_all_ignored_batch_behaves_like_torch_cross_entropy(impl, reduction):
    import torch

    p = make_problem(2, ignore_frac=1.0, class_weights=True)
    g_out = np.ones(p.y.shape) if reduction == "none" else np.asarray(1.0)
    result = IMPLEMENTATIONS[impl].run(p, dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-2), g_out, None, return_lse=True)
    logits = torch.from_numpy(p.x @ p.W.T).double().requires_grad_()
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(p.y), weight=torch.from_numpy(p.cw).double(),
                                                 reduction=reduction, label_smoothing=0.1)
    expected.backward(torch.from_numpy(g_out).double())
    np.testing.assert_array_equal(result["loss"], expected.detach().numpy())
    assert np.all(logits.grad.numpy() == 0)
    for key in ("grad_x", "grad_W"):
        assert np.all(result[key] == 0), key
    assert np.all(np.isfinite(result["lse"]))


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_nan_input_propagates_to_valid_rows_only(impl):
    p = make_problem(3, ignore_frac=0.0)
    p.x[2, 5] = np.nan  # a valid row
    p.x[4, 0] = np.inf  # a row we then ignore
    p.y[4] = -100
    g_out = np.ones(p.y.shape)
    result = IMPLEMENTATIONS[impl].run(p, dict(reduction="none"), g_out, None)
    loss = result["loss"]
    assert np.isnan(loss[2]) and loss[4] == 0
    assert np.all(np.isfinite(np.delete(loss, [2, 4])))
    summed = IMPLEMENTATIONS[impl].run(p, dict(reduction="mean"), np.asarray(1.0), None)
    assert np.isnan(summed["loss"]), "NaN in a valid row must reach the reduced loss"


def _out_of_range_problem():
    p = make_problem(4, ignore_frac=0.0, bias=True)
    p.y[3] = p.vocab  # just past the end
    p.y[6] = -7  # negative, not ignore_index
    return p


def test_out_of_range_target_is_nan_under_jit():
    """Under jax.jit raising is impossible: those rows' losses and gradients are NaN."""
    p = _out_of_range_problem()
    g_out = np.ones(p.y.shape)
    result = FRAMEWORKS["jax"].run(p, dict(reduction="none"), g_out, None, jit=True)
    ref = reference(p, dict(reduction="none"), g_out, None)
    bad = [3, 6]
    assert np.all(np.isnan(result["loss"][bad])) and np.all(np.isnan(ref.loss[bad]))
    good = np.setdiff1d(np.arange(len(p.y)), bad)
    assert rel_err(result["loss"][good], ref.loss[good]) <= tolerance("float32")
    assert np.all(np.isnan(result["grad_x"][bad])) and rel_err(result["grad_x"][good], ref.grad_input[good]) <= tolerance("float32")


@pytest.mark.parametrize("grad", [True, False], ids=["fwd-bwd", "fwd-only"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_torch_kernels_check_targets_once_behind_the_first_product(monkeypatch, strategy, reduction, grad):
    """The kernel path queues the targets' check after the first logits product (the GPU starts
    on the product while the host prepares the rest), once per call, backward included; a bad
    target then still raises, naming it."""
    import torch

    from torch_impl import functional, head, kernels

    events = []
    check_targets, logits = kernels.check_targets, head.HeadBlocks.logits
    monkeypatch.setattr(kernels, "check_targets", lambda *a: events.append("check") or check_targets(*a))
    monkeypatch.setattr(head.HeadBlocks, "logits", lambda *a, **k: events.append("logits") or logits(*a, **k))
    p = _out_of_range_problem()
    x, W = torch.from_numpy(p.x).requires_grad_(grad), torch.from_numpy(p.W)
    good_y = torch.from_numpy(np.where((p.y >= 0) & (p.y < p.vocab), p.y, -100))
    loss = functional.linear_cross_entropy(x, W, good_y, reduction=reduction, strategy=strategy)
    if grad:
        loss.sum().backward()
    assert events[0] == "logits" and events.count("check") == 1, events
    events.clear()
    with pytest.raises(ValueError, match=f"target holds {p.vocab}"):
        functional.linear_cross_entropy(x, W, torch.from_numpy(p.y), reduction=reduction, strategy=strategy)
    assert events[0] == "logits" and events.count("check") == 1, events


def test_torch_autocast_casts_like_linear():
    """Under autocast, an fp32 input meets a bf16 head (a dtype mismatch without autocast):
    both are cast to the autocast dtype, as F.linear does; each gradient keeps its tensor's dtype."""
    import torch

    import torch_impl

    p = make_problem(9, dtype="bfloat16")  # values exact in bf16
    x = torch.from_numpy(p.x).requires_grad_()
    W = torch.from_numpy(p.W).to(torch.bfloat16).requires_grad_()
    with pytest.raises(TypeError):
        torch_impl.linear_cross_entropy(x, W, torch.from_numpy(p.y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch_impl.linear_cross_entropy(x, W, torch.from_numpy(p.y))
    loss.backward()
    ref = reference(p, {}, 1.0, None)
    assert x.grad.dtype == torch.float32 and W.grad.dtype == torch.bfloat16
    tol = tolerance("bfloat16")
    assert rel_err(loss.detach().numpy(), ref.loss) <= tol
    assert rel_err(x.grad.numpy(), ref.grad_input) <= tol and rel_err(W.grad.float().numpy(), ref.grad_weight) <= tol


@pytest.mark.parametrize("cap", [30.0, 1e6, 1e30])
@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_softcap_is_accurate_at_any_cap(impl, cap):
    """c tanh(z / c) in fp32 as accurate as the framework's own tanh (its "chunked" path)
    whatever c: a cap far above the logits leaves them unchanged (tanh's small-argument
    precision), an ordinary one keeps fp32's accuracy."""
    p = make_problem(21, dtype="float32", bias=True, logit_scale=3.0)
    options = dict(softcap=cap)
    result = IMPLEMENTATIONS[impl].run(p, options, np.asarray(1.0), None)
    eager = IMPLEMENTATIONS[impl.split("-")[0] + "-chunked"].run(p, options, np.asarray(1.0), None)
    ref = reference(p, options, np.asarray(1.0), None)
    for key, r in (("loss", ref.loss), ("grad_x", ref.grad_input), ("grad_W", ref.grad_weight)):
        bound = 2 * rel_err(eager[key], r) + 1e-7
        assert rel_err(result[key], r) <= bound, f"{key}: {rel_err(result[key], r):.3g} > {bound:.3g}"


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
def test_zero_hidden_size(impl):
    """D = 0: every logit is its bias; the loss is defined and the input's gradient empty."""
    p = make_problem(23, hidden=0, bias=True)
    result = IMPLEMENTATIONS[impl].run(p, dict(), np.asarray(1.0), None)
    ref = reference(p, dict(), np.asarray(1.0), None)
    assert rel_err(result["loss"], ref.loss) <= tolerance("float32")
    assert rel_err(result["grad_b"], ref.grad_bias) <= tolerance("float32")


@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
def test_torch_second_backward_through_a_retained_graph(strategy):
    """backward(retain_graph=True) then backward again adds the same gradients twice ("speed"
    hands its forward-pass gradients to the first backward and recomputes for the second)."""
    import torch

    import torch_impl

    p = make_problem(24)
    x, W = torch.tensor(p.x, requires_grad=True), torch.tensor(p.W, requires_grad=True)
    loss = torch_impl.linear_cross_entropy(x, W, torch.tensor(p.y), strategy=strategy)
    loss.backward(retain_graph=True)
    once = x.grad.clone(), W.grad.clone()
    loss.backward()
    for g, g1 in zip((x.grad, W.grad), once):
        assert rel_err(g.numpy(), 2 * g1.numpy()) <= tolerance("float32")


@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
def test_torch_second_order_derivatives(strategy):
    """"chunked" is twice differentiable (a Hessian-vector product matches float64 autograd of
    the unfused loss); the kernel strategies raise a clear error instead of a wrong zero."""
    import torch

    import torch_impl

    p = make_problem(25, dtype="float32", bias=False)
    x, W = torch.tensor(p.x, dtype=torch.float64), torch.tensor(p.W, dtype=torch.float64)
    y = torch.tensor(p.y)
    x32 = x.float().requires_grad_()
    loss = torch_impl.linear_cross_entropy(x32, W.float(), y, strategy=strategy)
    (g,) = torch.autograd.grad(loss, x32, create_graph=True)
    if strategy != "chunked":
        with pytest.raises(RuntimeError, match='strategy="chunked" supports second-order'):
            torch.autograd.grad(g.sum(), x32)
        return
    (hv,) = torch.autograd.grad(g.sum(), x32)
    x64 = x.clone().requires_grad_()
    (g64,) = torch.autograd.grad(torch.nn.functional.cross_entropy(x64 @ W.T, y), x64, create_graph=True)
    (hv64,) = torch.autograd.grad(g64.sum(), x64)
    assert rel_err(hv.numpy(), hv64.numpy()) <= tolerance("float32")


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_torch_softcap_saturated_on_cuda(strategy):
    """|z| / c from 30 to 60, where exp(-2|z| / c) is an fp32 subnormal: the GPU's capped
    logits stay within the cap and match float64 (the CPU's interpreter computes with numpy
    and cannot show this)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    p = make_problem(26, lead=(64,), hidden=32, vocab=300, dtype="float32", bias=True, logit_scale=300.0)
    options = dict(softcap=5.0, reduction="none")
    result = TorchAdapter(strategy, "cuda").run(p, options, np.ones(p.y.shape), np.ones(p.y.shape))
    ref = reference(p, options, np.ones(p.y.shape), np.ones(p.y.shape))
    for key, r in (("loss", ref.loss), ("lse", ref.lse), ("grad_x", ref.grad_input)):
        assert rel_err(result[key], r) <= 1e-5, f"{key}: {rel_err(result[key], r):.3g}"


def test_torch_without_triton_runs_every_loss_on_the_fallback():
    """Where Triton is not installed (it ships for Linux only), every loss and the vocabulary
    split import and run on the fallback, equal to the float64 reference."""
    import socket
    import subprocess
    import sys

    script = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError
import numpy as np, torch
import torch.distributed as dist
import torch_impl
from interop.reference import linear_cross_entropy_reference
from tests.frameworks import make_problem

p = make_problem(7, dtype="float32", bias=True)
x, W, b = (torch.tensor(a, requires_grad=True) for a in (p.x, p.W, p.b))
loss = torch_impl.linear_cross_entropy(x, W, torch.tensor(p.y), linear_bias=b, strategy="speed")
loss.backward()
ref = linear_cross_entropy_reference(p.x, p.W, p.y, linear_bias=p.b, grad_output=1.0)
assert abs(float(loss) - float(ref.loss)) <= 1e-5 * abs(float(ref.loss)), (float(loss), ref.loss)
assert np.abs(x.grad.numpy() - ref.grad_input).max() <= 1e-5 * np.abs(ref.grad_input).max()
assert not any(name.startswith("triton") for name in sys.modules if sys.modules[name] is not None)
ids = torch.topk(torch.tensor(p.x @ p.W.T), 3).indices
torch_impl.linear_topk_distillation(x, W, ids, torch.log_softmax(torch.randn(ids.shape), 1)).backward()
torch_impl.linear_distillation(x, W, x.detach(), W.detach()).backward()
torch_impl.linear_policy_loss(x, W, torch.tensor(p.y), 1.0, strategy="speed").backward()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
split = torch_impl.linear_cross_entropy(x, W, torch.tensor(p.y), linear_bias=b, vocab_parallel=dist.group.WORLD)
assert abs(float(split) - float(loss)) <= 1e-6 * abs(float(loss))
dist.barrier()
dist.destroy_process_group()
print("ok")
"""
    with socket.socket() as free:  # a port no other run holds
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", script.replace("PORT", str(port))], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


EMPTY_CALLS = {  # loss: its call in either framework (f: torch_impl or jax_impl) on x [0, D], W [V, D], targets [0]
    "topk": (lambda f, x, W, y, z, **k: f.linear_topk_distillation(x, W, z(y, 3, ids=True), z(y, 3), **k)),
    "dense": (lambda f, x, W, y, z, **k: f.linear_distillation(x, W, x, W, **k)),
    "log_probs": (lambda f, x, W, y, z, **k: f.linear_log_probs(x, W, y, strategy=k["strategy"])),
    "policy": (lambda f, x, W, y, z, **k: f.linear_policy_loss(x, W, y, z(y, 0), strategy=k["strategy"],
                                                               tuning=k.get("tuning"))),
}


@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
@pytest.mark.parametrize("loss", list(EMPTY_CALLS))
def test_empty_batch_of_every_other_loss(loss, strategy):
    """No rows: each loss gives what PyTorch's does (a mean over no rows NaN, a sum 0, [0]
    per-row outputs) and empty or zero gradients, in both frameworks, eagerly and under
    jax.jit, also where JAX computes only the rows not ignored (a plan of no rows has no
    block to divide them by)."""
    import jax
    import jax.numpy as jnp
    import torch

    import jax_impl
    import torch_impl
    from interop.tuning import Tuning

    call = EMPTY_CALLS[loss]

    def t_zeros(y, k, ids=False):
        shape = (0, k) if k else (0,)
        return torch.zeros(shape, dtype=torch.int64) if ids else torch.full(shape, -1.0)

    def j_zeros(y, k, ids=False):
        shape = (0, k) if k else (0,)
        return jnp.zeros(shape, jnp.int32) if ids else jnp.full(shape, -1.0)

    for reduction in ("mean", "sum"):
        x = torch.zeros(0, 8, requires_grad=True)
        W = torch.ones(16, 8, requires_grad=True)
        y = torch.zeros(0, dtype=torch.int64)
        out = call(torch_impl, x, W, y, t_zeros, reduction=reduction, strategy=strategy)
        expected = out.sum() if out.ndim else out
        expected.backward()
        assert W.grad is not None and torch.all(W.grad == 0) and x.grad.shape == (0, 8)

        def j_loss(x, W):
            o = call(jax_impl, x, W, jnp.zeros((0,), jnp.int32), j_zeros, reduction=reduction, strategy=strategy)
            return o.sum() if o.ndim else o

        xj, Wj = jnp.zeros((0, 8)), jnp.ones((16, 8))
        skipping = lambda x, W: call(jax_impl, x, W, jnp.zeros((0,), jnp.int32), j_zeros, reduction=reduction,
                                     strategy=strategy, tuning=Tuning(skip_ignored_min_work=0)).sum()
        for fn in (j_loss, jax.jit(j_loss)) + ((skipping,) if loss == "policy" else ()):
            value, (gx, gW) = jax.value_and_grad(fn, argnums=(0, 1))(xj, Wj)
            np.testing.assert_array_equal(np.asarray(value), expected.detach().numpy())
            assert gx.shape == (0, 8) and np.all(np.asarray(gW) == 0)


@pytest.mark.parametrize("strategy", ["speed", "memory", "chunked"])
def test_torch_unsigned_targets(strategy):
    """Unsigned targets mean what their values say: uint8/16/32/64 give int64's loss on every
    path and in every loss (a uint8 156 is class 156, not the ignored -100 it equals in
    uint8; the fallback has no comparisons of uint16/32/64 of its own), and a uint64 target
    past int64's range is out of range, not wrapped to the ignored -100."""
    import torch

    import torch_impl

    x, W = torch.randn(4, 8), torch.randn(16, 8)  # fp32: the kernels' paths (interpreted on a CPU)
    y = torch.tensor([1, 2, 15, 4])
    expected = torch_impl.linear_cross_entropy(x, W, y, strategy=strategy)
    for dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        assert torch.equal(torch_impl.linear_cross_entropy(x, W, y.to(dtype), strategy=strategy), expected)
    wrapped = torch.from_numpy(np.array([1, 2, 15, 2**64 - 100], np.uint64))
    for call in (lambda: torch_impl.linear_cross_entropy(x, W, wrapped, strategy=strategy),
                 lambda: torch_impl.linear_log_probs(x, W, wrapped, strategy=strategy),
                 lambda: torch_impl.linear_policy_loss(x, W, wrapped, torch.ones(4), strategy=strategy)):
        with pytest.raises(ValueError, match="target holds a value past int64's range"):
            call()
    with pytest.raises(ValueError, match="teacher_ids holds"):
        torch_impl.linear_topk_distillation(x, W, wrapped.reshape(4, 1), torch.zeros(4, 1),
                                            strategy=strategy)
    W200, Wt = torch.randn(200, 8), torch.randn(200, 8)
    y156 = torch.tensor([1, 2, 156, 4])
    for call in (lambda y: torch_impl.linear_cross_entropy(x, W200, y, reduction="none", strategy=strategy),
                 lambda y: torch_impl.linear_distillation(x, W200, x, Wt, target=y, reduction="none", strategy=strategy),
                 lambda y: torch_impl.linear_policy_loss(x, W200, y, torch.tensor([1.0, 1.0, 5.0, 1.0]), strategy=strategy),
                 lambda y: torch.compile(torch_impl.linear_policy_loss, backend="eager", fullgraph=True)(
                     x, W200, y, torch.tensor([1.0, 1.0, 5.0, 1.0]), strategy=strategy)):
        torch.testing.assert_close(call(y156.to(torch.uint8)), call(y156))


def test_jax_wide_numpy_integers_are_not_wrapped():
    """NumPy int64 / uint64 targets and teacher ids that JAX's 32-bit integers cannot hold
    raise, naming the argument: converted, 2**32 + 15 would be class 15 and 2**32 - 100 the
    ignored -100."""
    import jax
    import jax.numpy as jnp

    import jax_impl

    if jax.config.jax_enable_x64:
        pytest.skip("64-bit types on: nothing is narrowed")
    x, W = jnp.ones((4, 8)), jnp.ones((16, 8))
    for bad in (2**32 + 15, 2**32 - 100):
        y = np.array([1, bad, 3, 4], np.int64)
        for call in (lambda: jax_impl.linear_cross_entropy(x, W, y), lambda: jax_impl.linear_log_probs(x, W, y)):
            with pytest.raises(ValueError, match=f"target holds {bad}"):
                call()
        with pytest.raises(ValueError, match=f"teacher_ids holds {bad}"):
            jax_impl.linear_topk_distillation(x, W, y.reshape(4, 1), np.zeros((4, 1), np.float32))
    with pytest.raises(ValueError, match="target holds 18446744073709551516"):
        jax_impl.linear_cross_entropy(x, W, np.array([1, 2, 3, 2**64 - 100], np.uint64))
    np.testing.assert_array_equal(jax_impl.linear_cross_entropy(x, W, np.array([1, 2, 3, 4], np.int64)),
                                  jax_impl.linear_cross_entropy(x, W, jnp.array([1, 2, 3, 4])))


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_num_items_in_batch_is_one_number(fw):
    """num_items_in_batch is a number > 0 or a tensor / array of one element (the loss stays
    a scalar); [2] values, a string, a list or inf raise naming it, in every loss that
    takes it."""
    if fw == "torch":
        import torch

        import torch_impl as f
        arr, ids = (lambda a: torch.tensor(a, dtype=torch.float32)), (lambda a: torch.tensor(a))
    else:
        import jax.numpy as jnp

        import jax_impl as f
        arr, ids = (lambda a: jnp.asarray(a, jnp.float32)), (lambda a: jnp.asarray(a))
    x, W, y = arr(np.ones((4, 8))), arr(np.arange(128).reshape(16, 8) / 64), ids([1, 2, 3, 4])
    calls = {
        "cross_entropy": lambda n: f.linear_cross_entropy(x, W, y, num_items_in_batch=n),
        "topk": lambda n: f.linear_topk_distillation(x, W, ids([[1], [2], [3], [4]]), arr(np.zeros((4, 1))),
                                                     num_items_in_batch=n),
        "dense": lambda n: f.linear_distillation(x, W, x, W * 2, num_items_in_batch=n),
    }
    for name, call in calls.items():
        expected = np.asarray(call(8.0))
        for one in (arr(8.0), arr([8.0])):
            got = call(one)
            assert np.shape(got) == () and np.allclose(np.asarray(got), expected), name
        for bad, exc, words in ((arr([4.0, 8.0]), ValueError, "shape (2,)"), ("4", TypeError, "str"),
                                ([4], TypeError, "list"), (float("inf"), ValueError, "inf")):
            with pytest.raises(exc, match="num_items_in_batch") as info:
                call(bad)
            assert words in str(info.value), (name, info.value)


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_policy_loss_per_token_arguments_are_numbers_or_arrays(fw):
    """advantages is required, and a per-token argument is a number or a tensor / array:
    None, a string, a bool or a list raise TypeError naming it (not an error from deep
    inside the loss, nor True taken as 1.0)."""
    if fw == "torch":
        import torch

        import torch_impl as f
        x, W, y, a = torch.ones(4, 8), torch.ones(16, 8), torch.tensor([1, 2, 3, 4]), torch.ones(4)
    else:
        import jax.numpy as jnp

        import jax_impl as f
        x, W, y, a = jnp.ones((4, 8)), jnp.ones((16, 8)), jnp.array([1, 2, 3, 4]), jnp.ones(4)
    with pytest.raises(TypeError, match="advantages is required"):
        f.linear_policy_loss(x, W, y, None)
    for bad in ("a", True, [1.0] * 4):
        with pytest.raises(TypeError, match=f"advantages must be .* got {type(bad).__name__}"):
            f.linear_policy_loss(x, W, y, bad)
        with pytest.raises(TypeError, match=f"kl_weight must be .* got {type(bad).__name__}"):
            f.linear_policy_loss(x, W, y, a, kl_weight=bad)
    assert float(f.linear_policy_loss(x, W, y, 1.0)) == float(f.linear_policy_loss(x, W, y, a))


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_distillation_errors_name_the_student_head_linear_weight(fw):
    """The student's head is the argument linear_weight (`weight` is cross-entropy's class
    weights); the teacher's is teacher_weight."""
    if fw == "torch":
        import torch

        import torch_impl as f
        arr, ids = (lambda *s, dtype=None: torch.ones(*s, dtype=dtype)), (lambda *s: torch.zeros(*s, dtype=torch.long))
        half = torch.float16
    else:
        import jax.numpy as jnp

        import jax_impl as f
        arr, ids = (lambda *s, dtype=None: jnp.ones(s, dtype)), (lambda *s: jnp.zeros(s, jnp.int32))
        half = jnp.float16
    x, W = arr(4, 8), arr(16, 8)
    with pytest.raises(ValueError, match=r"equal linear_weight's hidden size D=8 \(linear_weight \(16, 8\)"):
        f.linear_topk_distillation(arr(4, 5), W, ids(4, 1), arr(4, 1))
    with pytest.raises(TypeError, match="input and linear_weight must have the same dtype"):
        f.linear_distillation(x, arr(16, 8, dtype=half), x, W)
    with pytest.raises(ValueError, match="equal teacher_weight's hidden size D=5"):
        f.linear_distillation(x, W, x, arr(16, 5))


def test_tuning_fields_are_checked_when_built():
    """A Tuning whose numbers the planner cannot use raises ValueError naming the field when
    it is built (a 0-row block would divide by zero inside the planner, a float row count
    fail in a loop's shape), in both frameworks alike (one dataclass)."""
    from interop.tuning import Tuning

    for fields, words in ((dict(min_block=0), "Tuning.min_block must be an int >= 1"),
                          (dict(min_chunk_rows=2.5), "Tuning.min_chunk_rows must be an int >= 1"),
                          (dict(speed_min_rows=True), "Tuning.speed_min_rows"),
                          (dict(keep_logits_share="x"), "Tuning.keep_logits_share must be a finite number >= 0"),
                          (dict(memory_fraction=float("nan")), "Tuning.memory_fraction"),
                          (dict(plan_product_flops=0.0), "Tuning.plan_product_flops must be a finite number > 0"),
                          (dict(min_memory_block=(0, 4)), "Tuning.min_memory_block must be a pair")):
        with pytest.raises(ValueError, match=words):
            Tuning(**fields)
    Tuning(skip_ignored_min_work=0, one_speed_block_share=0, keep_logits_share=0.0, xla_gemm_workspace=0)


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_flags_are_true_or_false(fw):
    """A flag given as anything but a bool raises naming it: "no" would count as True (a
    tuple (loss, lse) for return_lse="no")."""
    if fw == "torch":
        import torch

        import torch_impl as f
        x, W, y = torch.ones(4, 8), torch.ones(16, 8), torch.tensor([1, 2, 3, 4])
    else:
        import jax.numpy as jnp

        import jax_impl as f
        x, W, y = jnp.ones((4, 8)), jnp.ones((16, 8)), jnp.array([1, 2, 3, 4])
    ids, lp = y.reshape(4, 1), x[:, :1] * 0
    calls = {
        "return_lse": lambda v: f.linear_cross_entropy(x, W, y, return_lse=v),
        "return_entropy": lambda v: f.linear_log_probs(x, W, y, return_entropy=v),
        "return_argmax": lambda v: f.linear_log_probs(x, W, y, return_argmax=v),
        "return_stats": lambda v: f.linear_policy_loss(x, W, y, 1.0, return_stats=v),
        "accumulate_in_input_dtype": lambda v: f.linear_topk_distillation(x, W, ids, lp, accumulate_in_input_dtype=v),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'no'"):
            call("no")
        call(np.bool_(False))


def test_module_checks_weight_layout_when_built():
    """LinearCrossEntropyLoss refuses a bad weight_layout when built, as it does a bad
    strategy, not at its first forward."""
    import torch_impl

    with pytest.raises(ValueError, match="weight_layout must be one of .* got 'x'"):
        torch_impl.LinearCrossEntropyLoss(weight_layout="x")


@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_dense_distillation_reads_beta_for_jsd_only(fw):
    """beta is the Jensen-Shannon mix: other divergences take any number there (their
    callers pass a default), "jsd" needs it in (0, 1)."""
    head = np.arange(128, dtype=np.float32).reshape(16, 8) / 64  # logits that differ by class
    if fw == "torch":
        import torch

        import torch_impl as f
        x, W = torch.ones(4, 8), torch.from_numpy(head)
    else:
        import jax.numpy as jnp

        import jax_impl as f
        x, W = jnp.ones((4, 8)), jnp.asarray(head)
    for divergence in ("forward_kl", "reverse_kl"):
        loss = float(f.linear_distillation(x, W, x, W * 2, divergence=divergence, beta=0.0))
        assert loss > 0 and loss == float(f.linear_distillation(x, W, x, W * 2, divergence=divergence))
    with pytest.raises(ValueError, match="beta must lie in"):
        f.linear_distillation(x, W, x, W, divergence="jsd", beta=0.0)
