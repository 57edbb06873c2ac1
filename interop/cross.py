"""Each framework's loss called from the other, with gradients.

- `jax_loss_in_torch(input, linear_weight, target, **options)`: `jax_impl`'s loss on torch
  tensors, as a torch autograd Function. The buffers cross through DLPack without a copy
  (CPU and CUDA) where JAX can alias them; a non-contiguous tensor, or a view at an address
  XLA can't alias (``t[1:]`` on the CPU), is copied, and an int64 target is narrowed to
  int32 (N elements) for JAX. A float64 call runs with JAX's x64 mode turned on for its
  forward and backward (``jax.enable_x64``), so it computes in float64 as torch's own call
  does, whatever the global setting.
- `torch_loss_in_jax(input, linear_weight, target, **options)`: `torch_impl`'s loss on
  jax arrays, inside a `jax.custom_vjp`, usable under `jax.jit`. It goes through
  `jax.pure_callback`, whose operands live in host memory: on a GPU every call copies the
  inputs (N*D + V*D elements) to the host and the gradients back, and runs torch on the
  CPU. JAX offers no device-side callback that hands its buffers to another framework, so
  this direction is for interoperability and tests, not speed.

`options` are those of `linear_cross_entropy` (both frameworks accept the same); the class
weights ``weight`` are an array of the calling framework, constants as in the direct call,
and ``return_lse=True`` returns (loss, lse), both differentiable.
"""

from __future__ import annotations

import contextlib

import numpy as np

from interop.dlpack import to_jax, to_torch


def _x64_mode(on: bool):
    """JAX's x64 mode turned on (a float64 call: JAX would narrow its buffers to float32
    without it), else the setting as it is."""
    import jax

    return jax.enable_x64(True) if on else contextlib.nullcontext()


def _as_jax(t):
    """A torch tensor's data as a jax.Array: its buffer where JAX can alias it, else a copy."""
    return to_jax(t.detach(), copy=None)


def _int32_targets(target, vocab: int, ignore_index):
    """target as int32 for JAX without x64, with -100 as its ignore_index: a bad target
    raises here, as the native call would, instead of wrapping into a class."""
    import torch

    from interop.options import target_out_of_range_message

    ignore_index = -100 if ignore_index is None else ignore_index
    y = target.to(torch.int64)
    if target.dtype == torch.uint64:  # past int64 it would wrap (2**64 - 100 to -100): out of range instead
        y = torch.where(target.view(torch.int64) < 0, torch.iinfo(torch.int64).max, target.view(torch.int64))
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
    if bool(bad.any()):
        raise ValueError(target_out_of_range_message(int(y[bad][0]), vocab, ignore_index))
    return torch.where(y == ignore_index, -100, y).to(torch.int32)


def jax_loss_in_torch(input, linear_weight, target, *, linear_bias=None, weight=None, return_lse=False, **options):
    """`logitless.jax.linear_cross_entropy` on torch tensors; differentiable in torch with respect
    to ``input``, ``linear_weight`` and ``linear_bias`` (see the module's docstring)."""
    import torch

    import jax_impl

    float64 = any(t is not None and t.dtype == torch.float64 for t in (input, linear_weight, linear_bias, weight))

    class _JaxLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, W, b):
            import jax

            with _x64_mode(float64):
                vocab = W.shape[0] if options.get("weight_layout", "VD") == "VD" else W.shape[1]
                y = _as_jax(_int32_targets(target, vocab, options.get("ignore_index", -100)))
                w = None if weight is None else _as_jax(weight)
                # Under jax.vjp the inputs are tracers, and JAX would pick its default backend's
                # path; CPU tensors (also on a GPU host) take the chunked path, which runs anywhere.
                opts = {**options, "ignore_index": -100}  # _int32_targets' ignored rows
                opts = opts if x.is_cuda else {**opts, "strategy": "chunked"}

                def loss(x, W, b):
                    return jax_impl.linear_cross_entropy(x, W, y, linear_bias=b, weight=w, return_lse=return_lse, **opts)

                outputs, ctx.vjp = jax.vjp(loss, *(None if t is None else _as_jax(t) for t in (x, W, b)))
            # The outputs are small; torch-owned copies are safer than JAX's immutable buffers.
            return tuple(to_torch(o).clone() for o in outputs) if return_lse else to_torch(outputs).clone()

        @staticmethod
        def backward(ctx, *grad_outputs):
            with _x64_mode(float64):
                cotangents = tuple(_as_jax(g) for g in grad_outputs)
                grads = ctx.vjp(cotangents if return_lse else cotangents[0])
                return tuple(None if g is None else to_torch(g) for g in grads)

    return _JaxLoss.apply(input, linear_weight, linear_bias)


def _host_tensor(a):
    """A host numpy array (ml_dtypes bfloat16 too) as a torch tensor (sharing its memory
    when it is writable)."""
    import torch

    a = np.asarray(a)
    if not a.flags.writeable:  # callback operands are read-only; torch wants writable memory
        a = a.copy()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _host_array(t):
    """A CPU torch tensor as a numpy array (ml_dtypes bfloat16 for bfloat16)."""
    import ml_dtypes
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def torch_loss_in_jax(input, linear_weight, target, *, linear_bias=None, weight=None, return_lse=False, **options):
    """`logitless.torch.linear_cross_entropy` on jax arrays; differentiable in JAX with respect to
    ``input``, ``linear_weight`` and ``linear_bias`` (through host memory, see the module's
    docstring)."""
    import jax
    import jax.numpy as jnp

    row_shape = target.shape if options.get("reduction", "mean") == "none" else ()
    dtype = jnp.float64 if input.dtype == jnp.float64 else jnp.float32  # torch_impl's loss and lse dtype
    output_shapes = (jax.ShapeDtypeStruct(row_shape, dtype),) + (jax.ShapeDtypeStruct(target.shape, dtype),) * return_lse

    def torch_call(x, W, b, y, w, g):
        """The outputs (g is None) or the gradients of x, W (and b) for the upstream
        gradients g of the outputs, computed by torch on host arrays."""
        import torch

        import torch_impl

        t = [None if a is None else _host_tensor(a).requires_grad_(g is not None) for a in (x, W, b)]
        class_weights = None if w is None else _host_tensor(w)
        outputs = torch_impl.linear_cross_entropy(t[0], t[1], _host_tensor(y), linear_bias=t[2], weight=class_weights,
                                                  return_lse=return_lse, **options)
        outputs = outputs if return_lse else (outputs,)
        if g is None:
            return tuple(o.detach().numpy() for o in outputs)
        grads = torch.autograd.grad(outputs, [a for a in t if a is not None], [_host_tensor(gi) for gi in g])
        return tuple(_host_array(gr) for gr in grads)

    def call_outputs(x, W, b, y, w):
        return jax.pure_callback(lambda x, W, b, y, w: torch_call(x, W, b, y, w, None), output_shapes, x, W, b, y, w)

    @jax.custom_vjp
    def loss_fn(x, W, b, y, w):
        return call_outputs(x, W, b, y, w)

    def fwd(x, W, b, y, w):
        return call_outputs(x, W, b, y, w), (x, W, b, y, w)

    def bwd(res, g):
        x, W, b, y, w = res
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, W, b) if a is not None)
        grads = jax.pure_callback(torch_call, shapes, x, W, b, y, w, g)
        return grads[0], grads[1], grads[2] if b is not None else None, None, None

    loss_fn.defvjp(fwd, bwd)
    outputs = loss_fn(input, linear_weight, linear_bias, target, weight)
    return outputs if return_lse else outputs[0]
