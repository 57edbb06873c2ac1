"""Autograd helpers of the losses' Functions: backward passes that give first-order
gradients only, and say so when differentiated again."""

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
