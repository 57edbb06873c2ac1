"""Autograd helpers of the losses' Functions: backward passes that give first-order
gradients only, and say so when differentiated again; gradients formed in the forward pass,
scaled by the upstream gradient."""

from __future__ import annotations

import torch

SECOND_ORDER_MESSAGE = (
    'logitless: the kernel strategies ("speed", "memory") of linear_cross_entropy give first-order gradients '
    'only; strategy="chunked" supports second-order derivatives (double backward, Hessians)'
)


class SecondOrderUnsupported(torch.autograd.Function):
    """Passes first-order gradients through unchanged (as views) and raises `message` if
    anything differentiates them."""

    @staticmethod
    def forward(ctx, message: str, n_anchors: int, *tensors):
        ctx.message = message
        return tuple(g.view_as(g) for g in tensors[n_anchors:])

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


def first_order_only(ctx, backward, *grad_outputs, message: str = SECOND_ORDER_MESSAGE) -> tuple:
    """backward(ctx, *grad_outputs) run without autograd recording (the kernels' buffers are
    written in place), its gradients (tensors or None) tied under create_graph=True to the
    inputs that need a gradient through SecondOrderUnsupported: they would otherwise look
    constant to a second differentiation."""
    if not torch.is_grad_enabled():  # the usual backward: no saved tensor is unpacked here
        return backward(ctx, *grad_outputs)
    with torch.no_grad():
        grads = backward(ctx, *grad_outputs)
    anchors = [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
    if not anchors:
        return grads
    tied = iter(SecondOrderUnsupported.apply(message, len(anchors), *anchors, *(g for g in grads if g is not None)))
    return tuple(None if g is None else next(tied) for g in grads)


def scale_formed(grads, grad_loss, kernels: bool) -> tuple:
    """Gradients formed in the forward pass for an upstream gradient of 1, as the upstream
    gradient grad_loss (0-d fp32, or None: zeros) makes them, in place: multiplied in fp32 and
    rounded once to each gradient's dtype. Rounding grad_loss to a 16-bit gradient's dtype
    first would scale it wrongly (bf16(1/3) = 0.33398: 0.2% too large, the loss of a third of
    an accumulated batch). kernels: the kernels formed them (the fp32 scale kernel, which
    leaves a gradient untouched when grad_loss is 1, runs), else PyTorch ops do."""
    if kernels:
        from torch_impl.kernels import scale_  # only where the kernels ran: this module needs no Triton
    else:
        def scale_(g, s):
            return g.mul_(s) if g.dtype in (torch.float32, torch.float64) else g.copy_(g.float() * s)
    if grad_loss is None:
        return tuple(None if g is None else torch.zeros_like(g) for g in grads)
    return tuple(None if g is None else scale_(g, grad_loss) for g in grads)
