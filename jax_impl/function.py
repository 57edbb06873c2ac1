"""The custom_vjp of the JAX kernel path (`jax_impl.blocked`).

The primal computes the statistics only (a call that takes no gradient). Under
differentiation, a plan of whole-row blocks with a reduced loss and no returned lse forms
the gradients in the forward rule (6 N D V flops) and the backward rule scales them by the
upstream gradient; every other plan saves its inputs and lse, and the backward rule
recomputes the logits block by block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_impl import blocked
from jax_impl.blocked import BlockedConfig


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def kernel_linear_cross_entropy(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig):
    """(loss, lse [N]) over flattened rows x [N, D], y [N] (int32); fp32."""
    loss, lse, _ = blocked.forward(x_ND, W, b_V, cw_V, y_N, cfg, with_grads=False)
    return loss, lse


def _fwd(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig):
    if cfg.grads_in_forward:
        loss, lse, grads = blocked.forward(x_ND, W, b_V, cw_V, y_N, cfg, with_grads=True)
        return (loss, lse), grads
    loss, lse, _ = blocked.forward(x_ND, W, b_V, cw_V, y_N, cfg, with_grads=False)
    return (loss, lse), (x_ND, W, b_V, cw_V, y_N, lse)


def _bwd(cfg: BlockedConfig, res, cotangents):
    g_loss, g_lse = cotangents
    if cfg.grads_in_forward:  # lse is not returned to the caller: its cotangent is zero
        dx, dW, db = res
        scale = lambda g: None if g is None else (g * g_loss.astype(jnp.float32)).astype(g.dtype)
        return scale(dx), scale(dW), scale(db), None, None
    x_ND, W, b_V, cw_V, y_N, lse = res
    dx, dW, db = blocked.backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse, cfg)
    return dx, dW, db, None, None


kernel_linear_cross_entropy.defvjp(_fwd, _bwd)
