"""The options and input checks of the distillation losses, shared by both frameworks.

Two losses (interop/SPEC-DISTILLATION.md):
- top-K sparse teacher: the teacher gives, per row, K token ids and their log-probabilities;
- dense teacher: the teacher's hidden states and head, its logits fused like the student's.

As in `interop.options`, the frameworks pass plain shape tuples and dtype names.
"""

from __future__ import annotations

import dataclasses
import math

from interop.options import (DEFAULT_IGNORE_INDEX, FLOAT_DTYPES, INT_DTYPES, as_float, check_bias, check_flags, check_reduction,
                             check_weight_layout, nonnegative, positive, set_ignore_index, set_softcap)

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclasses.dataclass(frozen=True)
class TopKDistillationOptions:
    """Options of the top-K sparse-teacher loss, validated on construction.

    temperature: T > 0; the student's log-probabilities are log_softmax(s / T) over the
        full vocabulary (the teacher's are taken as given).
    renormalize_teacher: the teacher's probabilities are exp(logprob) renormalised over its
        K entries (True) or used as given (False, their sum may be < 1).
    tail_bucket: with renormalize_teacher=False, the teacher's missing mass 1 - sum_k P_k
        is matched against the student's mass outside the K ids (one extra bucket).
    temperature_squared: multiply the KD term by T**2 (Hinton et al.), keeping gradient
        magnitudes comparable across temperatures.
    weight_soft, weight_hard: loss = weight_soft * KD + weight_hard * CE(target) (CE at
        temperature 1); weight_hard > 0 needs a target.
    reduction: "none" | "sum" | "mean" (over the valid rows, or over num_items_in_batch).
    ignore_index: target value whose rows are masked out (when a target is given).
    softcap: c > 0 applies c * tanh(z / c) to the student's logits (before the temperature).
    """

    temperature: float = 1.0
    renormalize_teacher: bool = True
    tail_bucket: bool = False
    temperature_squared: bool = True
    weight_soft: float = 1.0
    weight_hard: float = 0.0
    reduction: str = "mean"
    ignore_index: int = DEFAULT_IGNORE_INDEX
    softcap: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "temperature", positive("temperature", self.temperature))
        object.__setattr__(self, "weight_soft", nonnegative("weight_soft", self.weight_soft))
        object.__setattr__(self, "weight_hard", nonnegative("weight_hard", self.weight_hard))
        for name in ("renormalize_teacher", "tail_bucket", "temperature_squared"):
            check_flags(**{name: getattr(self, name)})
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.tail_bucket and self.renormalize_teacher:
            raise ValueError("tail_bucket=True needs renormalize_teacher=False (a renormalised teacher has no missing mass)")
        check_reduction(self.reduction)
        set_ignore_index(self)
        set_softcap(self)

    @property
    def kd_scale(self) -> float:
        """weight_soft, times T**2 with temperature_squared."""
        return self.weight_soft * (self.temperature**2 if self.temperature_squared else 1.0)


@dataclasses.dataclass(frozen=True)
class DenseDistillationOptions:
    """Options of the dense-teacher loss, validated on construction.

    divergence: "forward_kl" KL(P_teacher || Q_student), "reverse_kl" KL(Q || P), or "jsd",
        the generalised Jensen-Shannon divergence beta KL(P || M) + (1 - beta) KL(Q || M)
        with M = beta P + (1 - beta) Q (liger-kernel's and TRL's beta; their beta = 0 and 1
        are "forward_kl" and "reverse_kl" here).
    beta: in (0, 1), used by "jsd".
    temperature: T > 0, applied to both the teacher's and the student's logits.
    temperature_squared: multiply the loss by T**2.
    reduction, ignore_index: as for the top-K loss.
    """

    divergence: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    temperature_squared: bool = True
    reduction: str = "mean"
    ignore_index: int = DEFAULT_IGNORE_INDEX

    def __post_init__(self):
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        beta = as_float("beta", self.beta)
        if self.divergence == "jsd" and not 0.0 < beta < 1.0:  # (the other divergences do not read it)
            raise ValueError(f"beta must lie in (0, 1) (use divergence='forward_kl' or 'reverse_kl' for the ends), got {self.beta!r}")
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "temperature", positive("temperature", self.temperature))
        check_flags(temperature_squared=self.temperature_squared)
        object.__setattr__(self, "temperature_squared", bool(self.temperature_squared))
        check_reduction(self.reduction)
        set_ignore_index(self)

    @property
    def scale(self) -> float:
        """T**2 with temperature_squared, else 1."""
        return self.temperature**2 if self.temperature_squared else 1.0


@dataclasses.dataclass(frozen=True)
class DistillShape:
    """Sizes of one distillation call: N = prod(lead_shape) rows, student hidden D and
    vocabulary V; K teacher entries (top-K) or the teacher's hidden size and vocabulary."""

    lead_shape: tuple
    n_rows: int
    hidden: int
    vocab: int
    k: int = 0
    teacher_hidden: int = 0
    teacher_vocab: int = 0


def _student_shape(input_shape, input_dtype, weight_shape, weight_dtype, weight_layout, name=""):
    """(lead_shape, D, V) of a hidden-states + head pair; `name` prefixes the argument names
    (none: the student's input and linear_weight; "teacher_": teacher_input, teacher_weight)."""
    head = f"{name}weight" if name else "linear_weight"
    check_weight_layout(weight_layout)
    if input_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}input must have a floating dtype {FLOAT_DTYPES}, got {input_dtype}")
    if weight_dtype != input_dtype:
        raise TypeError(f"{name}input and {head} must have the same dtype, got {input_dtype} and {weight_dtype}")
    if len(input_shape) < 1:
        raise ValueError(f"{name}input must have shape [..., D], got {tuple(input_shape)}")
    if len(weight_shape) != 2:
        raise ValueError(f"{head} must be 2-D ({'[V, D]' if weight_layout == 'VD' else '[D, V]'}), got shape {tuple(weight_shape)}")
    vocab, hidden = weight_shape if weight_layout == "VD" else tuple(weight_shape)[::-1]
    if input_shape[-1] != hidden:
        raise ValueError(f"{name}input's last dimension must equal {head}'s hidden size D={hidden} "
                         f"({head} {tuple(weight_shape)}, weight_layout={weight_layout!r}), got {name}input shape {tuple(input_shape)}")
    if vocab < 1:
        raise ValueError(f"{head} must have at least one class, got shape {tuple(weight_shape)}")
    return tuple(input_shape[:-1]), hidden, vocab


def _check_rows(lead, target_shape, target_dtype, row_mask_shape, row_mask_dtype):
    if target_shape is not None:
        if target_dtype not in INT_DTYPES:
            raise ValueError(f"target must hold integer class indices, got dtype {target_dtype}")
        if tuple(target_shape) != lead:
            raise ValueError(f"target must have shape {lead} (input's shape without its last dimension), got {tuple(target_shape)}")
    if row_mask_shape is not None:
        if row_mask_dtype != "bool":
            raise TypeError(f"row_mask must be a bool tensor, got dtype {row_mask_dtype}")
        if tuple(row_mask_shape) != lead:
            raise ValueError(f"row_mask must have shape {lead} (input's shape without its last dimension), got {tuple(row_mask_shape)}")


def check_topk_inputs(*, input_shape, input_dtype, weight_shape, weight_dtype, ids_shape, ids_dtype, logprobs_shape,
                      logprobs_dtype, target_shape=None, target_dtype=None, bias_shape=None, bias_dtype=None,
                      row_mask_shape=None, row_mask_dtype=None, weight_layout="VD", weight_hard=0.0) -> DistillShape:
    """Check one top-K distillation call; raise ValueError/TypeError naming the argument."""
    lead, hidden, vocab = _student_shape(input_shape, input_dtype, weight_shape, weight_dtype, weight_layout, "")
    if ids_dtype not in INT_DTYPES:
        raise TypeError(f"teacher_ids must hold integer token ids, got dtype {ids_dtype}")
    if len(ids_shape) != len(lead) + 1 or tuple(ids_shape[:-1]) != lead:
        raise ValueError(f"teacher_ids must have shape {lead + ('K',)} (input's leading shape, then K), got {tuple(ids_shape)}")
    if tuple(logprobs_shape) != tuple(ids_shape):
        raise ValueError(f"teacher_logprobs must have teacher_ids' shape {tuple(ids_shape)}, got {tuple(logprobs_shape)}")
    if logprobs_dtype not in FLOAT_DTYPES:
        raise TypeError(f"teacher_logprobs must have a floating dtype, got {logprobs_dtype}")
    check_bias(bias_shape, bias_dtype, vocab, weight_shape, input_dtype)
    if weight_hard > 0 and target_shape is None:
        raise ValueError("weight_hard > 0 needs a target (the hard labels)")
    _check_rows(lead, target_shape, target_dtype, row_mask_shape, row_mask_dtype)
    return DistillShape(lead, math.prod(lead), hidden, vocab, k=int(ids_shape[-1]))


def check_dense_inputs(*, input_shape, input_dtype, weight_shape, weight_dtype, teacher_input_shape, teacher_input_dtype,
                       teacher_weight_shape, teacher_weight_dtype, target_shape=None, target_dtype=None,
                       row_mask_shape=None, row_mask_dtype=None, weight_layout="VD") -> DistillShape:
    """Check one dense-teacher distillation call; raise ValueError/TypeError naming the argument."""
    lead, hidden, vocab = _student_shape(input_shape, input_dtype, weight_shape, weight_dtype, weight_layout, "")
    t_lead, t_hidden, t_vocab = _student_shape(teacher_input_shape, teacher_input_dtype, teacher_weight_shape,
                                               teacher_weight_dtype, weight_layout, "teacher_")
    if teacher_input_dtype != input_dtype:
        raise TypeError(f"teacher_input must have the input's dtype {input_dtype}, got {teacher_input_dtype}")
    if t_lead != lead:
        raise ValueError(f"teacher_input must have input's leading shape {lead}, got {tuple(teacher_input_shape)}")
    _check_rows(lead, target_shape, target_dtype, row_mask_shape, row_mask_dtype)
    return DistillShape(lead, math.prod(lead), hidden, vocab, teacher_hidden=t_hidden, teacher_vocab=t_vocab)


def teacher_id_out_of_range_message(bad_id: int, vocab: int) -> str:
    """The error of an eager call whose teacher_ids hold an id >= V (ids < 0 are padding)."""
    return f"teacher_ids holds {bad_id}, outside [0, {vocab}) for a vocabulary of V={vocab} (ids < 0 mark padding)"
