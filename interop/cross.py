"""Each framework's loss called from the other, with gradients.

- `jax_loss_in_torch(input, linear_weight, target, **options)`: `jax_impl`'s loss on torch
  tensors, as a torch autograd Function. The buffers cross through DLPack without a copy
  (CPU and CUDA); only an int64 target is narrowed to int32 (N elements) for JAX.
- `torch_loss_in_jax(input, linear_weight, target, **options)`: `torch_impl`'s loss on
  jax arrays, inside a `jax.custom_vjp`, usable under `jax.jit`. It goes through
  `jax.pure_callback`, whose operands live in host memory: on a GPU every call copies the
  inputs (N*D + V*D elements) to the host and the gradients back, and runs torch on the
  CPU. JAX offers no device-side callback that hands its buffers to another framework, so
  this direction is for interoperability and tests, not speed.

`options` are those of `linear_cross_entropy` (both frameworks accept the same).
"""

from __future__ import annotations

import numpy as np

from interop.dlpack import to_jax, to_torch


def _jax_function(options: dict):
    import jax_impl

    return lambda x, W, b, y: jax_impl.linear_cross_entropy(x, W, y, linear_bias=b, **options)


def jax_loss_in_torch(input, linear_weight, target, *, linear_bias=None, **options):
    """`jax_impl.linear_cross_entropy` on torch tensors; differentiable in torch."""
    import torch

    class _JaxLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, W, b):
            import jax

            args = [to_jax(t.detach().contiguous()) if t is not None else None for t in (x, W, b)]
            y = to_jax(target.detach().to(torch.int32).contiguous())
            # Under jax.vjp the inputs are tracers, and JAX would pick its default backend's
            # path; CPU tensors (also on a GPU host) take the chunked path, which runs anywhere.
            opts = options if x.is_cuda else {**options, "strategy": "chunked"}
            loss, vjp = jax.vjp(lambda x, W, b: _jax_function(opts)(x, W, b, y), *args)
            ctx.vjp = vjp
            return to_torch(loss).clone()  # the loss is small; a torch-owned copy is safer

        @staticmethod
        def backward(ctx, grad_loss):
            grads = ctx.vjp(to_jax(grad_loss.contiguous()))
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


def torch_loss_in_jax(input, linear_weight, target, *, linear_bias=None, **options):
    """`torch_impl.linear_cross_entropy` on jax arrays; differentiable in JAX (through host
    memory, see the module's docstring)."""
    import jax
    import jax.numpy as jnp

    reduction = options.get("reduction", "mean")
    loss_shape = target.shape if reduction == "none" else ()
    has_bias = linear_bias is not None

    def torch_call(x, W, b, y, g):
        """Loss (g is None) or gradients for upstream g, computed by torch on host arrays."""
        import torch

        import torch_impl

        t = [None if a is None else _host_tensor(a).requires_grad_(g is not None) for a in (x, W, b)]
        loss = torch_impl.linear_cross_entropy(t[0], t[1], _host_tensor(y), linear_bias=t[2], **options)
        if g is None:
            return loss.detach().numpy().astype(np.float32)
        grads = torch.autograd.grad(loss, [a for a in t if a is not None], _host_tensor(g).to(loss.dtype))
        return tuple(_host_array(gr) for gr in grads)

    def call_loss(x, W, b, y):
        out = jax.ShapeDtypeStruct(loss_shape, jnp.float32)
        return jax.pure_callback(lambda x, W, b, y: torch_call(x, W, b, y, None), out, x, W, b, y)

    @jax.custom_vjp
    def loss_fn(x, W, b):
        return call_loss(x, W, b, target)

    def fwd(x, W, b):
        return call_loss(x, W, b, target), (x, W, b)

    def bwd(res, g):
        x, W, b = res
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, W, b) if a is not None]
        grads = jax.pure_callback(lambda x, W, b, y, g: torch_call(x, W, b, y, g), tuple(shapes), x, W, b, target, g)
        return grads[0], grads[1], grads[2] if has_bias else None

    loss_fn.defvjp(fwd, bwd)
    return loss_fn(input, linear_weight, linear_bias)

