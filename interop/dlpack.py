"""Zero-copy handover of buffers between PyTorch and JAX through DLPack.

`to_jax(tensor)` and `to_torch(array)` share the memory (same device pointer, CPU or
CUDA) or refuse with a ValueError that says why and what to do; they never copy behind
the caller's back. On CUDA the consumer never reads a buffer its producer is still writing:
torch -> JAX is ordered by the DLPack stream protocol (JAX passes its stream, torch makes
it wait for its own; tests/test_dlpack.py checks it on a GPU), and to_torch waits for
the JAX array to be ready.

`to_jax` refuses: tensors that require grad (pass ``tensor.detach()``; gradients don't
cross DLPack); non-contiguous tensors (``.contiguous()`` copies); 64-bit tensors (int64,
uint64, float64, complex128) while JAX runs without x64, which JAX would narrow to 32 bits
in a copy (turn x64 on, or narrow in torch, e.g. ``tensor.int()``); and buffers that XLA
can't alias: on the CPU it aliases only 64-byte-aligned memory, so a view that starts
inside its storage (``t[1:]`` of a float32 tensor), or memory torch did not allocate
(``torch.from_numpy``: numpy aligns to 16 bytes), would be copied (``tensor.clone()``
gives it its own, aligned memory). ``to_jax(tensor, copy=None)`` copies the non-contiguous
and unaligned tensors instead of refusing them (the DLPack ``copy`` argument's meaning).

`to_torch` refuses arrays sharded over several devices, and deleted arrays.
``torch.from_dlpack`` itself never copies: it shares every dtype that both frameworks have
(measured on the CPU, 64-bit ones and float8 included) and raises for the others.
"""

from __future__ import annotations

SHARED_DTYPES = ("bfloat16", "float16", "float32", "float64", "int32", "int64", "bool")

# The dtypes that JAX without x64 narrows in a copy: dtype -> (what JAX makes of it, the torch
# call that narrows it instead).
_X64_ONLY = {
    "int64": ("int32", "tensor.int()"),
    "uint64": ("uint32", "tensor.to(torch.uint32)"),
    "float64": ("float32", "tensor.float()"),
    "complex128": ("complex64", "tensor.to(torch.complex64)"),
}


def _check_no_narrowing(tensor) -> None:
    """ValueError for a 64-bit tensor while JAX runs without x64: JAX would hand back a
    32-bit copy, neither shared nor of the tensor's dtype."""
    import jax

    name = str(tensor.dtype).removeprefix("torch.")
    if name in _X64_ONLY and not jax.config.jax_enable_x64:
        narrow, how = _X64_ONLY[name]
        raise ValueError(f"to_jax: a {name} tensor, but JAX runs without x64 and would copy it to {narrow}; "
                         "turn x64 on to share it (jax.config.update('jax_enable_x64', True), or call inside "
                         f"`with jax.enable_x64(True):`), or pass {how} (a {narrow} copy made by torch, which then "
                         "crosses as is)")


def to_jax(tensor, *, copy: bool | None = False):
    """The torch tensor's buffer as a jax.Array on the same device.

    Args:
        tensor: a torch tensor that does not require grad.
        copy: False (default): share the buffer or raise ValueError; None: share it where
            JAX can alias it, else copy (a non-contiguous or unaligned tensor); True: always
            copy.
    """
    import jax
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"to_jax: expected a torch.Tensor, got {type(tensor).__module__}.{type(tensor).__qualname__} "
                        "(jax.numpy.asarray takes a numpy array)")
    if tensor.requires_grad:
        raise ValueError("to_jax: the tensor requires grad; gradients don't cross DLPack, pass tensor.detach()")
    _check_no_narrowing(tensor)
    if not tensor.is_contiguous():
        if copy is False:
            raise ValueError(f"to_jax: the tensor is not contiguous (shape {tuple(tensor.shape)}, strides "
                             f"{tensor.stride()}); .contiguous() makes a copy, if that is what you want")
        tensor = tensor.contiguous()
    try:
        return jax.dlpack.from_dlpack(tensor, copy=copy)
    except ValueError as e:
        if copy is not False:  # a copy was allowed: the error is not about aliasing
            raise
        raise ValueError(f"to_jax: JAX can't alias this tensor's data at 0x{tensor.data_ptr():x}: XLA needs "
                         "64-byte-aligned memory on the CPU, which a view that starts inside its storage (here at "
                         f"element {tensor.storage_offset()}, e.g. t[1:]) or memory that torch did not allocate (e.g. "
                         "torch.from_numpy) may not be; tensor.clone() gives it its own, aligned memory, if a copy "
                         "is what you want") from e


def to_torch(array):
    """The jax.Array's buffer as a torch tensor on the same device (no copy)."""
    import jax
    import torch

    if not isinstance(array, jax.Array):
        raise TypeError(f"to_torch: expected a jax.Array, got {type(array).__module__}.{type(array).__qualname__} "
                        "(torch.from_numpy takes a numpy array)")
    if array.is_deleted():
        raise ValueError("to_torch: the jax.Array was deleted (donated or freed)")
    if len(array.devices()) != 1:
        raise ValueError(f"to_torch: the jax.Array is sharded over {len(array.devices())} devices; "
                         "hand over one shard (array.addressable_shards[i].data)")
    array.block_until_ready()
    return torch.from_dlpack(array)
