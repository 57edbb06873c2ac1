"""The DLPack bridge: zero-copy both ways, and clear refusals (interop/dlpack.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from interop.dlpack import SHARED_DTYPES, to_jax, to_torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
X64_DTYPES = ("int64", "float64")  # shared only while JAX runs with x64


def _pointer(array) -> int:
    return array.unsafe_buffer_pointer()


def _sample(dtype, device):
    t = torch.arange(24, device=device).reshape(4, 6) % 7
    return (t > 2) if dtype == "bool" else t.to(TORCH_DTYPES[dtype])


def _check_round_trip(device, dtype):
    t = _sample(dtype, device)
    a = to_jax(t)
    assert _pointer(a) == t.data_ptr(), "to_jax copied"
    assert a.shape == tuple(t.shape) and jnp.dtype(a.dtype).name == dtype
    assert (device == "cuda") == (a.devices().pop().platform == "gpu")
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().cpu().numpy())
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == t.dtype and back.device == t.device


@pytest.mark.parametrize("dtype", [d for d in SHARED_DTYPES if d not in X64_DTYPES])
@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_shares_memory(device, dtype):
    _check_round_trip(device, dtype)


@pytest.mark.parametrize("dtype", X64_DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_64_bit_round_trip_with_x64(device, dtype):
    with jax.enable_x64(True):
        _check_round_trip(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_a_torch_write_is_seen_through_jax(device):
    """The buffer is the same memory: a later in-place torch write shows in the JAX view."""
    t = torch.zeros(1000, device=device)
    a = to_jax(t)
    t.fill_(3.0)
    if device == "cuda":
        torch.cuda.synchronize()
    assert float(jnp.asarray(a)[999]) == 3.0


@pytest.mark.parametrize("device", DEVICES)
def test_jax_to_torch_shares_memory(device):
    a = jax.device_put(jnp.arange(12, dtype=jnp.float32).reshape(3, 4), jax.devices("gpu" if device == "cuda" else "cpu")[0])
    t = to_torch(a)
    assert t.data_ptr() == _pointer(a) and t.device.type == device
    assert torch.equal(t.cpu(), torch.arange(12, dtype=torch.float32).reshape(3, 4))


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="requires grad"):
        to_jax(torch.ones(3, requires_grad=True))
    with pytest.raises(ValueError, match="not contiguous"):
        to_jax(torch.ones(4, 6).T)
    a = jnp.ones(3)
    a.delete()
    with pytest.raises(ValueError, match="deleted"):
        to_torch(a)


@pytest.mark.parametrize("dtype, narrowed", [("int64", "int32"), ("uint64", "uint32"), ("float64", "float32"),
                                             ("complex128", "complex64")])
def test_64_bit_tensors_without_x64_are_refused(dtype, narrowed):
    """Without x64 JAX would hand back a 32-bit copy: neither shared nor of the tensor's dtype."""
    assert not jax.config.jax_enable_x64
    with pytest.raises(ValueError, match=rf"a {dtype} tensor, but JAX runs without x64 and would copy it to {narrowed}"):
        to_jax(torch.zeros(3, dtype=getattr(torch, dtype)))


def test_a_view_that_jax_cannot_alias_is_refused_or_copied_on_request():
    """XLA on the CPU aliases only 64-byte-aligned memory: t[16:] of a float32 tensor starts 64
    bytes in and is shared, t[1:] would be copied by JAX, so it is refused unless copy=None."""
    t = torch.arange(64, dtype=torch.float32)
    assert _pointer(to_jax(t[16:])) == t[16:].data_ptr()
    with pytest.raises(ValueError, match=r"can't alias .*at element 1, e\.g\. t\[1:\]\).*clone\(\)"):
        to_jax(t[1:])
    clone = t[1:].clone()
    assert _pointer(to_jax(clone)) == clone.data_ptr()
    for view in (t[1:], t.reshape(8, 8).T):  # unaligned; not contiguous
        copied = to_jax(view, copy=None)
        assert _pointer(copied) != view.data_ptr()
        np.testing.assert_array_equal(np.asarray(copied), view.numpy())


@pytest.mark.cuda
@pytest.mark.alone
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_to_jax_waits_for_the_torch_kernel_that_writes_the_buffer():
    """torch's stream is held up (a sleep kernel), then a fill is queued behind it; JAX, on
    its own stream, must see the filled buffer, not the zeros still there while the fill
    waits (the DLPack handover must order JAX's stream after torch's)."""
    t = torch.zeros(1 << 24, device="cuda")
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU cycles on the torch stream
    t.fill_(1.0)
    a = to_jax(t)
    assert float(jnp.min(a)) == 1.0


@pytest.mark.cuda
@pytest.mark.alone
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_to_torch_waits_for_the_jax_computation():
    x = jax.device_put(jnp.ones((4096, 4096), jnp.float32), jax.devices("gpu")[0])
    a = (x @ x) @ x  # still running when to_torch is called
    t = to_torch(a)
    assert float(t.min()) == 4096.0 * 4096.0 and float(t.max()) == 4096.0 * 4096.0
