"""The custom_vjp of JAX's cross-entropy (`jax_impl.blocked`), every strategy.

The primal computes the statistics only (a call that takes no gradient). Under
differentiation, a kernel plan of whole-row blocks with a reduced loss and no returned lse
forms the gradients in the forward rule (6 N D V flops) and the backward rule scales them by
the upstream gradient; every other plan saves its inputs and lse, and the backward rule
recomputes the logits block by block. On "chunked"'s jax.numpy steps both rules are plain
XLA, so the derivative can be differentiated again. The kernel plans' rules run through
`jax_impl.partitioned`, which splits them over the devices of sharded operands under jit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_impl import blocked, partitioned
from jax_impl.blocked import BlockedConfig
from jax_impl.partitioned import Call


def _operands(x_ND, W, b_V, cw_V, cfg: BlockedConfig):
    """(Call, b, cw) with absent b and cw as zeros [V] (`partitioned.Call`)."""
    vocab = W.shape[0] if cfg.weight_layout == "VD" else W.shape[1]
    call = Call(cfg, b_V is not None, cw_V is not None)
    b = jnp.zeros((vocab,), x_ND.dtype) if b_V is None else b_V
    return call, b, jnp.zeros((vocab,), jnp.float32) if cw_V is None else cw_V


def _statistics(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig):
    """(loss, lse): the kernels' through `partitioned`; "chunked"'s directly (plain XLA, which
    the partitioner splits itself, and which stays differentiable)."""
    if cfg.strategy == "chunked":
        return blocked.forward(x_ND, W, b_V, cw_V, y_N, cfg, with_grads=False)[:2]
    call, b, cw = _operands(x_ND, W, b_V, cw_V, cfg)
    return partitioned.forward(x_ND, W, b, cw, y_N, call, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def blocked_linear_cross_entropy(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig):
    """(loss, lse [N]) over flattened rows x [N, D], y [N] (int32); fp32 (fp64 for fp64 input)."""
    return _statistics(x_ND, W, b_V, cw_V, y_N, cfg)


def _fwd(x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig):
    if cfg.grads_in_forward:  # kernel plans only
        call, b, cw = _operands(x_ND, W, b_V, cw_V, cfg)
        loss, lse, dx, dW, db = partitioned.forward(x_ND, W, b, cw, y_N, call, True)
        return (loss, lse), (dx, dW, None if b_V is None else db)
    loss, lse = _statistics(x_ND, W, b_V, cw_V, y_N, cfg)
    return (loss, lse), (x_ND, W, b_V, cw_V, y_N, lse)


def _bwd(cfg: BlockedConfig, res, cotangents):
    g_loss, g_lse = cotangents
    if cfg.grads_in_forward:  # lse is not returned to the caller: its cotangent is zero
        dx, dW, db = res
        scale = lambda g: None if g is None else (g * g_loss.astype(jnp.float32)).astype(g.dtype)  # kernels: no fp64
        return scale(dx), scale(dW), scale(db), None, None
    x_ND, W, b_V, cw_V, y_N, lse = res
    if cfg.strategy == "chunked":
        return blocked.backward(g_loss, g_lse, x_ND, W, b_V, cw_V, y_N, lse, cfg) + (None, None)
    call, b, cw = _operands(x_ND, W, b_V, cw_V, cfg)
    dx, dW, db = partitioned.backward(g_loss, g_lse, x_ND, W, b, cw, y_N, lse, call)
    return dx, dW, None if b_V is None else db, None, None


blocked_linear_cross_entropy.defvjp(_fwd, _bwd)
