"""`linear_cross_entropy` for PyTorch: checks the call, then runs the best path available."""

from __future__ import annotations

import torch

from interop.options import CrossEntropyOptions, check_inputs, default_chunk_rows, target_out_of_range_message
from torch_impl.chunked import ChunkedLinearCrossEntropy


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def _is_traced() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _check_target_range(y_N: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise ValueError for a target outside [0, V) that is not ignore_index (eager calls only)."""
    bad = (y_N != ignore_index) & ((y_N < 0) | (y_N >= vocab))
    if bool(bad.any()):
        raise ValueError(target_out_of_range_message(int(y_N[bad][0]), vocab, ignore_index))


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    weight_layout: str = "VD",
):
    """Cross-entropy of ``input @ linear_weight.T + linear_bias`` without the N x V logits.

    A drop-in for ``torch.nn.functional.linear_cross_entropy`` (PyTorch 2.13) on the
    arguments they share, with ``z_loss``, ``softcap``, ``return_lse`` and
    ``weight_layout`` added; interop/SPEC.md defines every option.

    Args:
        input: [..., D] bf16/fp16/fp32/fp64 hidden states.
        linear_weight: [V, D] (``weight_layout="VD"``, nn.Linear) or [D, V] ("DV"), the
            input's dtype.
        target: [...] integer class indices (or ``ignore_index``).
        linear_bias: optional [V], the input's dtype.
        weight: optional [V] class weights.
        reduction: "mean" (default), "sum" or "none".
        ignore_index: target value to ignore (default -100; None means -100).
        label_smoothing: in [0, 1].
        z_loss: coefficient of lse**2 per valid row.
        softcap: c > 0 to use c * tanh(logits / c); None for none.
        return_lse: also return the per-row logsumexp [...] (differentiable).

    Returns:
        The loss, fp32 (fp64 for fp64 input): a scalar, or [...] for reduction="none";
        with ``return_lse``, the tuple (loss, lse [...]).
    """
    opts = CrossEntropyOptions(reduction, ignore_index, label_smoothing, z_loss, softcap)
    shape = check_inputs(
        input_shape=tuple(input.shape),
        input_dtype=dtype_name(input.dtype),
        weight_shape=tuple(linear_weight.shape),
        weight_dtype=dtype_name(linear_weight.dtype),
        target_shape=tuple(target.shape),
        target_dtype=dtype_name(target.dtype),
        bias_shape=None if linear_bias is None else tuple(linear_bias.shape),
        bias_dtype=None if linear_bias is None else dtype_name(linear_bias.dtype),
        class_weight_shape=None if weight is None else tuple(weight.shape),
        class_weight_dtype=None if weight is None else dtype_name(weight.dtype),
        weight_layout=weight_layout,
    )
    x_ND = input.reshape(shape.n_rows, shape.hidden)
    y_N = target.reshape(shape.n_rows)
    if not _is_traced():
        _check_target_range(y_N, shape.vocab, opts.ignore_index)
    loss, lse_N = ChunkedLinearCrossEntropy.apply(
        x_ND, linear_weight, linear_bias, weight, y_N, opts, weight_layout,
        default_chunk_rows(shape.n_rows, shape.hidden, shape.vocab),
    )
    if opts.reduction == "none":
        loss = loss.reshape(shape.lead_shape)
    if return_lse:
        return loss, lse_N.reshape(shape.lead_shape)
    return loss
