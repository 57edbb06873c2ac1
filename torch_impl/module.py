"""`LinearCrossEntropyLoss`: the nn.Module form of `logitless.torch.linear_cross_entropy`."""

from __future__ import annotations

import torch
from torch import nn

from interop.options import (CrossEntropyOptions, check_filter_eps, check_flags, check_strategy, check_tuning,
                             check_weight_layout)
from interop.tuning import Tuning
from torch_impl.functional import linear_cross_entropy


class LinearCrossEntropyLoss(nn.Module):
    """Holds the options (and class weights) like ``nn.CrossEntropyLoss``: every keyword of
    `logitless.torch.linear_cross_entropy`.

    ``forward(input [..., D], linear_weight [V, D] or [D, V], target [...], linear_bias=None,
    num_items_in_batch=None)`` returns what `logitless.torch.linear_cross_entropy` returns with
    these options (num_items_in_batch, which changes with every batch, is an argument of the
    call).
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        *,
        reduction: str = "mean",
        ignore_index: int | None = -100,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        softcap: float | None = None,
        return_lse: bool = False,
        weight_layout: str = "VD",
        strategy: str = "auto",
        accumulate_in_input_dtype: bool = False,
        filter_eps: float | None = None,
        tuning: Tuning | None = None,
        vocab_parallel=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        check_flags(return_lse=return_lse, accumulate_in_input_dtype=accumulate_in_input_dtype,
                    sequence_parallel=sequence_parallel)
        self.options = CrossEntropyOptions(reduction, ignore_index, label_smoothing, z_loss, softcap)
        self.register_buffer("weight", weight)
        self.return_lse = return_lse
        self.weight_layout = check_weight_layout(weight_layout)
        self.strategy = check_strategy(strategy)
        self.accumulate_in_input_dtype = accumulate_in_input_dtype
        self.filter_eps = check_filter_eps(filter_eps)
        self.tuning = check_tuning(tuning)
        self.vocab_parallel = vocab_parallel
        self.sequence_parallel = sequence_parallel

    def forward(self, input, linear_weight, target, linear_bias=None, num_items_in_batch=None):
        o = self.options
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight,
            reduction=o.reduction, ignore_index=o.ignore_index, label_smoothing=o.label_smoothing,
            z_loss=o.z_loss, softcap=o.softcap, return_lse=self.return_lse, weight_layout=self.weight_layout,
            strategy=self.strategy, accumulate_in_input_dtype=self.accumulate_in_input_dtype, filter_eps=self.filter_eps,
            tuning=self.tuning, vocab_parallel=self.vocab_parallel, sequence_parallel=self.sequence_parallel,
            num_items_in_batch=num_items_in_batch,
        )

    def extra_repr(self) -> str:
        o = self.options
        return (f"reduction={o.reduction!r}, ignore_index={o.ignore_index}, label_smoothing={o.label_smoothing}, "
                f"z_loss={o.z_loss}, softcap={o.softcap}, return_lse={self.return_lse}, weight_layout={self.weight_layout!r}, "
                f"strategy={self.strategy!r}, accumulate_in_input_dtype={self.accumulate_in_input_dtype}, "
                f"filter_eps={self.filter_eps}")
