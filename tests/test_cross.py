"""Each framework's loss called from the other equals the direct call, loss and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl
import torch_impl
from interop.cross import jax_loss_in_torch, torch_loss_in_jax
from tests.frameworks import make_problem, rel_err, tolerance, upstream_grads

OPTIONS = [dict(), dict(reduction="sum", label_smoothing=0.1, softcap=4.0), dict(reduction="none", z_loss=1e-3)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("options", OPTIONS, ids=["mean", "sum-smooth-cap", "none-zloss"])
def test_jax_loss_called_from_torch(options, dtype):
    p = make_problem(31, bias=True, dtype=dtype)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    x, W, b = (torch.from_numpy(a).to(tdt).requires_grad_() for a in (p.x, p.W, p.b))
    y = torch.from_numpy(p.y)
    loss = jax_loss_in_torch(x, W, y, linear_bias=b, **options)
    g = torch.randn(loss.shape) if loss.ndim else torch.tensor(1.7)
    grads = torch.autograd.grad(loss, (x, W, b), g.to(loss.dtype))
    assert [gr.dtype for gr in grads] == [tdt] * 3

    def direct(x, W, b):
        return jax_impl.linear_cross_entropy(x, W, jnp.asarray(p.y), linear_bias=b, **options)

    cpu = jax.devices("cpu")[0]  # where the CPU torch tensors' buffers live, also on a GPU host
    jx = [jax.device_put(jnp.asarray(a, dtype=jnp.dtype(dtype)), cpu) for a in (p.x, p.W, p.b)]
    ref_loss, vjp = jax.vjp(direct, *jx)
    ref_grads = vjp(jax.device_put(jnp.asarray(g.numpy(), ref_loss.dtype), cpu))
    assert rel_err(loss.detach().numpy(), np.asarray(ref_loss)) == 0
    for got, ref in zip(grads, ref_grads):
        assert rel_err(got.float().numpy(), np.asarray(ref.astype(jnp.float32))) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("options", OPTIONS, ids=["mean", "sum-smooth-cap", "none-zloss"])
def test_torch_loss_called_from_jax_under_jit(options, dtype):
    p = make_problem(32, bias=True, dtype=dtype)
    jx = [jnp.asarray(a, dtype=jnp.dtype(dtype)) for a in (p.x, p.W, p.b)]
    y = jnp.asarray(p.y, jnp.int32)
    f = lambda x, W, b: torch_loss_in_jax(x, W, y, linear_bias=b, **options)
    loss, vjp = jax.vjp(jax.jit(f), *jx)
    g = np.asarray(np.random.default_rng(0).standard_normal(loss.shape) + 1.5, np.float32)
    grads = vjp(jnp.asarray(g))
    assert [gr.dtype for gr in grads] == [jnp.dtype(dtype)] * 3

    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    x, W, b = (torch.from_numpy(a).to(tdt).requires_grad_() for a in (p.x, p.W, p.b))
    ref = torch_impl.linear_cross_entropy(x, W, torch.from_numpy(p.y), linear_bias=b, **options)
    ref_grads = torch.autograd.grad(ref, (x, W, b), torch.from_numpy(g).to(ref.dtype))
    assert rel_err(np.asarray(loss), ref.detach().numpy()) <= tolerance("float32")
    for got, r in zip(grads, ref_grads):
        assert rel_err(np.asarray(got.astype(jnp.float32)), r.float().numpy()) <= tolerance("float32")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_jax_loss_called_from_torch_on_cuda_shares_buffers(strategy):
    """CUDA tensors cross without copies and run the JAX kernels; equal to the direct JAX call
    on the same (shared) buffers."""
    from interop.dlpack import to_jax

    p = make_problem(33, lead=(700,), hidden=129, vocab=3001, bias=True, dtype="bfloat16")
    x, W, b = (torch.from_numpy(a).to("cuda", torch.bfloat16).requires_grad_() for a in (p.x, p.W, p.b))
    y = torch.from_numpy(p.y).cuda()
    loss = jax_loss_in_torch(x, W, y, linear_bias=b, strategy=strategy, label_smoothing=0.1)
    grads = torch.autograd.grad(loss, (x, W, b))
    assert all(g.is_cuda and g.dtype == torch.bfloat16 for g in grads)
    jx = [to_jax(t.detach()) for t in (x, W, b)]
    direct = lambda x, W, b: jax_impl.linear_cross_entropy(x, W, to_jax(y.int()), linear_bias=b, strategy=strategy,
                                                           label_smoothing=0.1)
    ref_loss, vjp = jax.vjp(direct, *jx)
    ref_grads = vjp(jnp.ones((), ref_loss.dtype))
    assert rel_err(loss.detach().cpu().numpy(), np.asarray(ref_loss)) == 0
    for got, ref in zip(grads, ref_grads):
        assert rel_err(got.float().cpu().numpy(), np.asarray(ref.astype(jnp.float32))) == 0


def _cpu_arrays(*arrays):
    """numpy arrays as jax.Arrays on the CPU, where the CPU torch tensors' buffers live (also on a GPU host)."""
    cpu = jax.devices("cpu")[0]
    return [jax.device_put(jnp.asarray(a), cpu) for a in arrays]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_jax_loss_called_from_torch_with_class_weights_and_lse(reduction):
    """Class weights cross as a jax.Array; loss and lse both come back, both with gradients."""
    p = make_problem(34, bias=True, class_weights=True)
    options = dict(reduction=reduction, label_smoothing=0.1, return_lse=True)
    x, W, b = (torch.from_numpy(a).requires_grad_() for a in (p.x, p.W, p.b))
    loss, lse = jax_loss_in_torch(x, W, torch.from_numpy(p.y), linear_bias=b, weight=torch.from_numpy(p.cw), **options)
    g_out, g_lse = (np.asarray(g, np.float32) for g in upstream_grads(34, p, reduction, True))
    grads = torch.autograd.grad((loss, lse), (x, W, b), (torch.from_numpy(g_out), torch.from_numpy(g_lse)))

    y, cw = _cpu_arrays(p.y, p.cw)
    direct = lambda x, W, b: jax_impl.linear_cross_entropy(x, W, y, linear_bias=b, weight=cw, **options)
    ref, vjp = jax.vjp(direct, *_cpu_arrays(p.x, p.W, p.b))
    ref_grads = vjp(tuple(_cpu_arrays(g_out, g_lse)))
    for got, want in zip((loss, lse, *grads), (*ref, *ref_grads)):
        assert rel_err(got.detach().numpy(), np.asarray(want)) == 0


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_loss_called_from_jax_with_class_weights_and_lse(reduction):
    """Class weights cross as a host array; loss and lse both come back, both with gradients,
    under jit with the targets and class weights as traced arguments."""
    p = make_problem(35, bias=True, class_weights=True)
    options = dict(reduction=reduction, label_smoothing=0.1, return_lse=True)
    f = jax.jit(lambda x, W, b, y, cw: torch_loss_in_jax(x, W, y, linear_bias=b, weight=cw, **options))
    y, cw = jnp.asarray(p.y, jnp.int32), jnp.asarray(p.cw)
    (loss, lse), vjp = jax.vjp(lambda x, W, b: f(x, W, b, y, cw), *(jnp.asarray(a) for a in (p.x, p.W, p.b)))
    g_out, g_lse = (np.asarray(g, np.float32) for g in upstream_grads(35, p, reduction, True))
    grads = vjp((jnp.asarray(g_out), jnp.asarray(g_lse)))

    x, W, b = (torch.from_numpy(a).requires_grad_() for a in (p.x, p.W, p.b))
    y, cw = torch.from_numpy(p.y), torch.from_numpy(p.cw)
    ref = torch_impl.linear_cross_entropy(x, W, y, linear_bias=b, weight=cw, **options)
    ref_grads = torch.autograd.grad(ref, (x, W, b), (torch.from_numpy(g_out), torch.from_numpy(g_lse)))
    for got, want in zip((loss, lse, *grads), (*ref, *ref_grads)):
        assert rel_err(np.asarray(got), want.detach().numpy()) <= tolerance("float32")


def test_jax_loss_called_from_torch_computes_float64_in_float64():
    """A float64 call runs with JAX's x64 on for its forward and backward (and off after), and
    matches torch's own float64 call far below float32's rounding."""
    p = make_problem(36, bias=True, dtype="float64")
    x, W, b = (torch.from_numpy(a).requires_grad_() for a in (p.x, p.W, p.b))
    y = torch.from_numpy(p.y)
    loss = jax_loss_in_torch(x, W, y, linear_bias=b, label_smoothing=0.1)
    grads = torch.autograd.grad(loss, (x, W, b))
    assert not jax.config.jax_enable_x64
    ref = torch_impl.linear_cross_entropy(x, W, y, linear_bias=b, label_smoothing=0.1)
    ref_grads = torch.autograd.grad(ref, (x, W, b))
    assert [t.dtype for t in (loss, *grads)] == [torch.float64] * 4
    for got, want in zip((loss, *grads), (ref, *ref_grads)):
        assert rel_err(got.detach().numpy(), want.detach().numpy()) <= 1e-12


def test_torch_loss_called_from_jax_keeps_float64():
    """Under x64, float64 arrays give torch's float64 loss, lse and gradients, not float32 ones."""
    p = make_problem(37, dtype="float64")
    with jax.enable_x64(True):
        x, W, y = jnp.asarray(p.x), jnp.asarray(p.W), jnp.asarray(p.y)
        loss, lse = torch_loss_in_jax(x, W, y, return_lse=True)
        grad_x = jax.grad(lambda x: torch_loss_in_jax(x, W, y))(x)
    tx = torch.from_numpy(p.x).requires_grad_()
    ref, ref_lse = torch_impl.linear_cross_entropy(tx, torch.from_numpy(p.W), torch.from_numpy(p.y), return_lse=True)
    assert loss.dtype == lse.dtype == grad_x.dtype == jnp.float64
    for got, want in zip((loss, lse, grad_x), (ref, ref_lse, torch.autograd.grad(ref, tx)[0])):
        assert rel_err(np.asarray(got), want.detach().numpy()) <= 1e-12


def test_jax_loss_called_from_torch_copies_a_view_jax_cannot_alias():
    """x = rows[1:] starts D * 4 = 76 bytes into its storage, an address XLA on the CPU can't
    alias: the call copies it (to_jax alone would refuse it)."""
    p = make_problem(38)
    rows = torch.from_numpy(np.concatenate([p.x[:1], p.x]))
    W, y = torch.from_numpy(p.W), torch.from_numpy(p.y).int()
    assert torch.equal(jax_loss_in_torch(rows[1:], W, y), jax_loss_in_torch(rows[1:].clone(), W, y))


def test_jax_loss_called_from_torch_keeps_wide_and_ignored_targets():
    """int64 targets cross to JAX's int32 without wrapping: 2**32 + 5 is refused as out of
    range (not read as class 5), and a custom ignore_index still ignores its rows."""
    import torch

    import torch_impl
    from interop.cross import jax_loss_in_torch

    x, W = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="4294967301"):
        jax_loss_in_torch(x, W, torch.tensor([1, 2**32 + 5, 3, 4]))
    y = torch.tensor([1, 3, 3, 4])
    got = jax_loss_in_torch(x, W, y, ignore_index=3)
    want = torch_impl.linear_cross_entropy(x, W, y, ignore_index=3)
    assert torch.allclose(got, want, rtol=1e-5)
