"""The autograd Function of the kernel path (`torch_impl.blocked`)."""

from __future__ import annotations

import torch

from torch_impl import blocked
from torch_impl.ce_kernels import TargetCheck
from torch_impl.kernels import scale_


class KernelLinearCrossEntropy(torch.autograd.Function):
    """Over flattened rows x [N, D], y [N]; returns (reduced loss, lse [N]), both fp32. With
    `active` (int64 [A]: the rows not ignored) only those rows are computed and lse is [A].

    When the loss is reduced, no lse is returned and some input needs a gradient, the
    "speed" plan computes the gradients in the forward pass and the backward pass scales
    them by the upstream gradient (in place). Otherwise the backward pass recomputes.
    `check` is the call's TargetCheck over all of y: the caller asks it for bad targets
    after the forward pass is queued.
    """

    @staticmethod
    def forward(ctx, x_ND, W, b_V, cw_V, y_N, opts, weight_layout: str, plan: blocked.BlockPlan, return_lse: bool,
                check: TargetCheck, active=None):
        need = ctx.needs_input_grad[:3]
        in_forward = any(need) and plan.strategy == "speed" and opts.reduction != "none" and not return_lse
        loss, lse, dx, dW, db = blocked.forward(
            x_ND, W, b_V, cw_V, y_N, opts, weight_layout, plan, need if in_forward else (False, False, False), check,
            active,
        )
        ctx.in_forward = in_forward
        ctx.opts, ctx.weight_layout, ctx.plan, ctx.check = opts, weight_layout, plan, check
        if in_forward:
            ctx.grads = (dx, dW, db)
        else:
            ctx.save_for_backward(x_ND, W, b_V, cw_V, y_N, lse, active)
        ctx.set_materialize_grads(False)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        none = (None,) * 8
        if grad_loss is None and grad_lse is None:
            return (None, None, None) + none
        if ctx.in_forward:
            grads, ctx.grads = ctx.grads, None
            if grad_loss is None:
                return tuple(None if g is None else torch.zeros_like(g) for g in grads) + none
            return tuple(None if g is None else scale_(g, grad_loss) for g in grads) + none
        x_ND, W, b_V, cw_V, y_N, lse, active = ctx.saved_tensors
        grads = blocked.backward(
            grad_loss, grad_lse, x_ND, W, b_V, cw_V, y_N, lse, ctx.opts, ctx.weight_layout, ctx.plan,
            ctx.needs_input_grad[:3], ctx.check, active,
        )
        return tuple(grads) + none
