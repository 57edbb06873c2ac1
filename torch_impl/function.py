"""The autograd Function of the kernel path (`torch_impl.blocked`)."""

from __future__ import annotations

import torch

from torch_impl import blocked
from torch_impl.blocks import BlockPlan
from torch_impl.arguments import dense
from torch_impl.autograd import first_order_only, scale_formed
from torch_impl.kernels import TargetCheck


class KernelLinearCrossEntropy(torch.autograd.Function):
    """Over flattened rows x [N, D], y [N]; returns (reduced loss, lse [N]), both fp32. With
    `active` (int64 [A]: the rows not ignored) only those rows are computed and lse is [A].
    With `split` (`torch_impl.vocab_parallel.VocabSplit`), W is this rank's slice of a head
    split over the vocabulary (and with sequence parallel x its part of the rows).

    When the loss is reduced, no lse is returned and some input needs a gradient, the
    plan in blocks of whole rows computes the gradients in the forward pass and the first backward pass
    scales them by the upstream gradient (in place) and hands them over; a later backward
    through the same graph (``retain_graph=True``) recomputes, as every backward pass of the
    other plans does: so the inputs are saved on every plan (x [N, D] stays alive until the
    backward pass, as a linear layer's input does). `check` is the call's TargetCheck over all of y: the caller asks it
    for bad targets after the forward pass is queued.

    The backward pass is not itself differentiable: under ``create_graph=True`` its
    gradients carry `SecondOrderUnsupported`, so a second-order derivative raises a clear
    error instead of PyTorch's "does not require grad" or a wrong zero.
    """

    @staticmethod
    def forward(ctx, x_ND, W, b_V, cw_V, y_N, opts, weight_layout: str, plan: BlockPlan, return_lse: bool,
                check: TargetCheck, active=None, split=None):
        need = ctx.needs_input_grad[:3]
        in_forward = any(need) and plan.layout == "rows" and opts.reduction != "none" and not return_lse
        loss, lse, dx, dW, db = blocked.forward(
            x_ND, W, b_V, cw_V, y_N, opts, weight_layout, plan, need if in_forward else (False, False, False), check,
            active, split,
        )
        ctx.opts, ctx.weight_layout, ctx.plan, ctx.check, ctx.split = opts, weight_layout, plan, check, split
        ctx.grads = (dx, dW, db) if in_forward else None
        ctx.save_for_backward(x_ND, W, b_V, cw_V, y_N, lse, active)
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        return first_order_only(ctx, KernelLinearCrossEntropy._backward, grad_loss, grad_lse)

    @staticmethod
    def _backward(ctx, grad_loss, grad_lse):
        none = (None,) * 9
        if grad_loss is None and grad_lse is None:
            return (None, None, None) + none
        if ctx.grads is not None:  # the first backward of gradients formed in the forward pass
            grads, ctx.grads = ctx.grads, None
            return scale_formed(grads, grad_loss, kernels=True) + none
        grad_loss, grad_lse = dense(grad_loss), dense(grad_lse)  # an expanded upstream gradient has stride 0
        x_ND, W, b_V, cw_V, y_N, lse, active = ctx.saved_tensors
        grads = blocked.backward(
            grad_loss, grad_lse, x_ND, W, b_V, cw_V, y_N, lse, ctx.opts, ctx.weight_layout, ctx.plan,
            ctx.needs_input_grad[:3], ctx.check, active, ctx.split,
        )
        return tuple(grads) + none
