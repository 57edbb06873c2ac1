"""Zero-copy handover of buffers between PyTorch and JAX through DLPack.

`to_jax(tensor)` and `to_torch(array)` share the memory (same device pointer, CPU or
CUDA) or refuse with a ValueError that says why and what to do; they never copy behind
the caller's back. On CUDA the consumer never reads a buffer its producer is still writing:
torch -> JAX is ordered by the DLPack stream protocol (JAX passes its stream, torch makes
it wait for its own; measured on an H100, tests/test_dlpack.py), and to_torch waits for
the JAX array to be ready.

Refused: tensors that require grad (pass ``tensor.detach()``; gradients don't cross
DLPack), non-contiguous tensors (``.contiguous()`` copies), int64 tensors while JAX runs
without x64 (JAX would narrow them to int32 in a copy: pass ``tensor.int()``), arrays
sharded over several devices, and deleted arrays.
"""

from __future__ import annotations

SHARED_DTYPES = ("bfloat16", "float16", "float32", "int32", "int64", "bool")


def to_jax(tensor):
    """The torch tensor's buffer as a jax.Array on the same device (no copy)."""
    import jax
    import torch

    if tensor.requires_grad:
        raise ValueError("to_jax: the tensor requires grad; gradients don't cross DLPack, pass tensor.detach()")
    if not tensor.is_contiguous():
        raise ValueError(f"to_jax: the tensor is not contiguous (shape {tuple(tensor.shape)}, strides "
                         f"{tensor.stride()}); .contiguous() makes a copy, if that is what you want")
    if tensor.dtype == torch.int64 and not jax.config.jax_enable_x64:
        raise ValueError("to_jax: an int64 tensor, but JAX runs without x64 and would copy it to int32; "
                         "pass tensor.int() (int32 labels stay zero-copy)")
    return jax.dlpack.from_dlpack(tensor)


def to_torch(array):
    """The jax.Array's buffer as a torch tensor on the same device (no copy)."""
    import torch

    if array.is_deleted():
        raise ValueError("to_torch: the jax.Array was deleted (donated or freed)")
    if len(array.devices()) != 1:
        raise ValueError(f"to_torch: the jax.Array is sharded over {len(array.devices())} devices; "
                         "hand over one shard (array.addressable_shards[i].data)")
    array.block_until_ready()
    return torch.from_dlpack(array)
