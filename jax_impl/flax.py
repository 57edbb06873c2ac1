"""The fused loss from a Flax model's hidden states and its head, without the logits.

Flax NNX: pass the head module itself; its parameter is read in place, so
``nnx.value_and_grad`` / ``nnx.grad`` send the gradient to it::

    from flax import nnx
    from jax_impl.flax import fused_loss_from_head

    def loss_fn(model):
        hidden = model.features(tokens)                       # [B, T, D]
        return fused_loss_from_head(hidden, model.lm_head, labels, z_loss=1e-4)

    loss, grads = nnx.value_and_grad(loss_fn)(model)

- ``nnx.Linear(D, V)`` head: its kernel [D, V] is used with ``weight_layout="DV"``
  (never transposed into a copy), and its bias when it has one.
- ``nnx.Embed(V, D)`` tied head (what ``embed.attend(hidden)`` computes): its table
  [V, D] is used with ``weight_layout="VD"``; the table's gradient sums the lookup's and
  the head's shares.

Flax Linen: the parameters are a plain dict, so call `logitless.jax.linear_cross_entropy`
directly with the Dense head's kernel [D, V] and ``weight_layout="DV"`` (for a tied head,
``params["embed"]["embedding"]`` [V, D] with the default ``"VD"``)::

    import jax
    import jax_impl

    def loss_fn(params):
        hidden = model.apply({"params": params}, tokens, method=Model.features)
        head = params["lm_head"]
        return jax_impl.linear_cross_entropy(
            hidden, head["kernel"], labels, linear_bias=head.get("bias"), weight_layout="DV"
        )

    loss, grads = jax.value_and_grad(loss_fn)(params)         # grads["lm_head"]["kernel"]
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jax_impl.functional import linear_cross_entropy


def _promote(arrays, dtype):
    """Cast ``arrays`` (None entries kept) to ``dtype``, or to their common dtype if None.

    The promotion ``nnx.Linear.__call__`` / ``nnx.Embed.attend`` apply to their operands;
    an array already in that dtype is returned as is.
    """
    present = [a for a in arrays if a is not None]
    dtype = dtype or jnp.result_type(*present)
    return [None if a is None else a.astype(dtype) for a in arrays]


def _head_operands(hidden, head):
    """The arguments `linear_cross_entropy` needs for ``head`` applied to ``hidden``.

    Args:
        hidden: [..., D] hidden states.
        head: ``nnx.Linear(D, V)`` or ``nnx.Embed(V, D)``.

    Returns:
        ``(hidden, weight, bias, weight_layout)``: ``hidden`` [..., D], ``weight``
        ([D, V] kernel, "DV", or [V, D] table, "VD") and ``bias`` ([V] or None), all in the
        dtype the module computes in (its ``dtype``, else the operands' common dtype).

    Raises:
        TypeError: for any other module.
    """
    if isinstance(head, nnx.Linear):
        bias = head.bias[...] if head.use_bias else None
        hidden, kernel, bias = _promote([hidden, head.kernel[...], bias], head.dtype)
        return hidden, kernel, bias, "DV"
    if isinstance(head, nnx.Embed):
        hidden, table = _promote([hidden, head.embedding[...]], head.dtype)
        return hidden, table, None, "VD"
    raise TypeError(f"head: expected nnx.Linear or nnx.Embed, got {type(head).__name__}")


def fused_loss_from_head(hidden, head, labels, **options):
    """Cross-entropy of ``head(hidden)`` (``head.attend(hidden)`` for an Embed) vs ``labels``.

    Never builds the [..., V] logits; the head's parameters are used in place, so under
    ``nnx.grad`` / ``nnx.value_and_grad`` their gradients land on the module's ``Param``s.
    Like the module, the operands are first cast to ``head.dtype`` when it is set (mixed
    precision: fp32 parameters, bf16 compute; the gradient is cast back to the parameter's
    dtype); the module's ``precision`` and ``dot_general`` are not used.

    Args:
        hidden: [..., D] final hidden states, bf16 / fp16 / fp32.
        head: ``nnx.Linear(D, V)`` (kernel [D, V], optional bias [V]) or ``nnx.Embed(V, D)``
            (a tied head, embedding table [V, D]).
        labels: [...] integer class ids, ``ignore_index`` (-100) for rows that add nothing.
        **options: any keyword of `logitless.jax.linear_cross_entropy` (``reduction``,
            ``label_smoothing``, ``z_loss``, ``softcap``, ``weight``, ``return_lse``,
            ``strategy``, ...) except ``linear_bias`` and ``weight_layout``, which come from
            ``head``.

    Returns:
        What `logitless.jax.linear_cross_entropy` returns: the fp32 loss (a scalar, or [...] for
        ``reduction="none"``), and with ``return_lse=True`` the tuple (loss, lse [...]).

    Raises:
        TypeError: ``head`` is neither ``nnx.Linear`` nor ``nnx.Embed``.
    """
    hidden, weight, bias, layout = _head_operands(hidden, head)
    return linear_cross_entropy(hidden, weight, labels, linear_bias=bias, weight_layout=layout, **options)
