"""The loss options and the input checks, defined once for both frameworks.

`torch_impl` and `jax_impl` translate their tensors' shapes and dtypes into plain
tuples and dtype names (``"bfloat16"``, ``"int64"``, ...) and call the functions here,
so both frameworks accept the same arguments and refuse bad input with the same
messages.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from interop.tuning import DEFAULT as DEFAULT_TUNING, Tuning

REDUCTIONS = ("none", "sum", "mean")
STRATEGIES = ("auto", "speed", "memory", "chunked")
WEIGHT_LAYOUTS = ("VD", "DV")
DEFAULT_IGNORE_INDEX = -100
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


@dataclasses.dataclass(frozen=True)
class CrossEntropyOptions:
    """The options of linear cross-entropy, validated on construction.

    reduction: "none" | "sum" | "mean" (mean divides by the summed class weight of the
        valid rows, as `torch.nn.functional.cross_entropy` does).
    ignore_index: target value whose rows contribute nothing (default -100). ``None``
        is accepted as in `torch.nn.functional.linear_cross_entropy` and means -100.
    label_smoothing: eps in [0, 1]; mixes the one-hot target with a uniform one.
    z_loss: coefficient of lse**2 added to each valid row's loss (>= 0).
    softcap: c > 0 applies c * tanh(z / c) to the logits; None disables it.
    """

    reduction: str = "mean"
    ignore_index: int = DEFAULT_IGNORE_INDEX
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        set_ignore_index(self)
        eps = as_float("label_smoothing", self.label_smoothing)
        if not 0.0 <= eps <= 1.0:
            raise ValueError(f"label_smoothing must lie in [0, 1], got {self.label_smoothing!r}")
        object.__setattr__(self, "label_smoothing", eps)
        object.__setattr__(self, "z_loss", nonnegative("z_loss", self.z_loss))
        set_softcap(self)


def as_float(name: str, value) -> float:
    """value as a float, or ValueError naming the option (a bool, or a string that float()
    would parse, is not a number here)."""
    if isinstance(value, (bool, str, bytes)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def check_weight_layout(weight_layout: str) -> str:
    """weight_layout is "VD" ([V, D], nn.Linear's) or "DV" ([D, V], Flax's kernel); ValueError else."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    return weight_layout


def check_flags(**flags) -> None:
    """Each flag True or False (a NumPy bool too); ValueError naming it else: a string such
    as "no" would count as True."""
    for name, value in flags.items():
        if not (isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def positive(name: str, value) -> float:
    """A finite number > 0, or ValueError naming the option."""
    v = as_float(name, value)
    if not (0.0 < v < math.inf):  # comparisons only: Dynamo traces them on a symbolic float
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


def nonnegative(name: str, value) -> float:
    """A finite number >= 0, or ValueError naming the option."""
    v = as_float(name, value)
    if not (0.0 <= v < math.inf):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def set_ignore_index(opts) -> None:
    """An options dataclass's ignore_index: None becomes -100 (as PyTorch's functions take
    it); anything but an int, or one outside int64, raises ValueError."""
    if opts.ignore_index is None:
        object.__setattr__(opts, "ignore_index", DEFAULT_IGNORE_INDEX)
    if isinstance(opts.ignore_index, bool) or not isinstance(opts.ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {opts.ignore_index!r}")
    if not -2**63 <= opts.ignore_index < 2**63:  # the targets' widest type
        raise ValueError(f"ignore_index must fit int64, got {opts.ignore_index}")


def set_softcap(opts) -> None:
    """An options dataclass's softcap: None, or a finite number > 0 (as a float)."""
    if opts.softcap is not None:
        cap = as_float("softcap", opts.softcap)
        if not (0.0 < cap < math.inf):
            raise ValueError(f"softcap must be None or a finite number > 0, got {opts.softcap!r}")
        object.__setattr__(opts, "softcap", cap)


@dataclasses.dataclass(frozen=True)
class ProblemShape:
    """Sizes of one call: ``lead_shape`` is the input's shape without D; N = prod(lead_shape)."""

    lead_shape: tuple
    n_rows: int
    hidden: int
    vocab: int


def check_inputs(
    *,
    input_shape: tuple,
    input_dtype: str,
    weight_shape: tuple,
    weight_dtype: str,
    target_shape: tuple,
    target_dtype: str,
    bias_shape: tuple | None = None,
    bias_dtype: str | None = None,
    class_weight_shape: tuple | None = None,
    class_weight_dtype: str | None = None,
    weight_layout: str = "VD",
    classes: int | None = None,
) -> ProblemShape:
    """Check shapes and dtypes of one call; return its sizes.

    Shapes are tuples of ints, dtypes are names such as "bfloat16". ``weight_shape`` is
    [V, D] for ``weight_layout="VD"`` (nn.Linear, tied embeddings) or [D, V] for "DV"
    (Flax nnx.Linear's kernel). ``classes``: the classes the targets and class weights
    index, when the head holds only a slice of them (a head split over the vocabulary);
    ProblemShape.vocab is then ``classes``. Raises ValueError for shapes, ranks and
    layouts, and TypeError for dtypes, naming the argument and what it got.
    """
    input_shape, weight_shape, target_shape = tuple(input_shape), tuple(weight_shape), tuple(target_shape)
    check_weight_layout(weight_layout)
    if input_dtype not in FLOAT_DTYPES:
        raise TypeError(f"input must have a floating dtype {FLOAT_DTYPES}, got {input_dtype}")
    if weight_dtype != input_dtype:
        raise TypeError(
            f"input and linear_weight must have the same dtype, got input {input_dtype} and linear_weight {weight_dtype}"
        )
    if len(input_shape) < 1:
        raise ValueError(f"input must have shape [..., D], got a scalar of shape {input_shape}")
    if len(weight_shape) != 2:
        raise ValueError(f"linear_weight must be 2-D ({'[V, D]' if weight_layout == 'VD' else '[D, V]'}), got shape {weight_shape}")
    vocab, hidden = weight_shape if weight_layout == "VD" else weight_shape[::-1]
    if input_shape[-1] != hidden:
        raise ValueError(
            f"input's last dimension must equal linear_weight's hidden size D={hidden} "
            f"(linear_weight {weight_shape}, weight_layout={weight_layout!r}), got input shape {input_shape}"
        )
    if vocab < 1:
        raise ValueError(f"linear_weight must have at least one class, got shape {weight_shape}")
    if target_dtype in FLOAT_DTYPES or target_dtype not in INT_DTYPES:
        raise ValueError(f"target must hold integer class indices, got dtype {target_dtype} (class-probability targets are not supported)")
    lead_shape = input_shape[:-1]
    if target_shape != lead_shape:
        raise ValueError(f"target must have shape {lead_shape} (input {input_shape} without its last dimension), got {target_shape}")
    check_bias(bias_shape, bias_dtype, vocab, weight_shape, input_dtype)
    vocab = vocab if classes is None else classes
    if class_weight_shape is not None:
        if tuple(class_weight_shape) != (vocab,):
            raise ValueError(f"weight (class weights) must have shape ({vocab},), got {tuple(class_weight_shape)}")
        if class_weight_dtype not in FLOAT_DTYPES:
            raise TypeError(f"weight (class weights) must have a floating dtype, got {class_weight_dtype}")
    return ProblemShape(lead_shape=lead_shape, n_rows=math.prod(lead_shape), hidden=hidden, vocab=vocab)


def check_reduction(reduction: str, num_items_in_batch=None) -> None:
    """reduction is one of REDUCTIONS; num_items_in_batch (the denominator replacing the
    valid-row count of "mean", for gradient accumulation) goes with "mean" only."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(f"num_items_in_batch replaces the denominator of reduction='mean'; got reduction={reduction!r}")


def check_num_items(num_items_in_batch) -> None:
    """num_items_in_batch: a finite number > 0 (Python or NumPy), or a tensor or array of
    one element, whose value (possibly traced) is taken as given; ValueError for another
    number or another shape (a loss divided by [2] values would be [2] losses), TypeError
    for anything else (a string, a list)."""
    n = num_items_in_batch
    if isinstance(n, bool) or (isinstance(n, numbers.Number) and not (  # (an int is finite: a traced one stays unguarded)
            isinstance(n, numbers.Real) and (isinstance(n, numbers.Integral) or math.isfinite(n)) and n > 0)):
        raise ValueError(f"num_items_in_batch must be a number > 0, a tensor or an array, got {n!r}")
    if isinstance(n, numbers.Number):
        return
    shape = getattr(n, "shape", None)
    if shape is None:
        raise TypeError(f"num_items_in_batch must be a number > 0, a tensor or an array, got {type(n).__name__}")
    if math.prod(shape) != 1:
        raise ValueError(f"num_items_in_batch must hold one number, got shape {tuple(shape)}")


def check_strategy(strategy: str) -> str:
    """How the loss is computed (same meaning in both frameworks):

    "auto": the kernels where they run (CUDA), choosing "speed" when its extra memory
        takes at most a quarter of the free GPU memory, else "memory"; "chunked" where the
        kernels don't run;
    "speed": kernels, fewest flops (gradients in the forward pass where possible);
    "memory": kernels, least memory (logits recomputed in the backward pass);
    "chunked": the pure-framework path (also what "speed" and "memory" fall back to
        where the kernels can't run, e.g. on a CPU).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def check_filter_eps(filter_eps):
    """Gradient filtering (same meaning in both frameworks): None (default) computes every
    entry of the logits' gradient dz; a number e >= 0 lets the implementation drop entries
    whose magnitude is below e times the larger of the row's coefficients |P|, |T|
    (interop/SPEC.md), for plain cross-entropy the entries whose probability p_ij is below e.
    The target's own term is never dropped. Returns it as a float (or None)."""
    if filter_eps is None:
        return None
    e = as_float("filter_eps", filter_eps)
    if not (0.0 <= e < math.inf):
        raise ValueError(f"filter_eps must be None or a finite number >= 0, got {filter_eps!r}")
    return e


def check_tuning(tuning):
    """The call's `interop.tuning.Tuning`: the default for None, else a TypeError naming the
    argument for anything but a Tuning."""
    if tuning is None:
        return DEFAULT_TUNING
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be None or an interop.tuning.Tuning, got {type(tuning).__name__}")
    return tuning


def target_out_of_range_message(bad_target: int, vocab: int, ignore_index: int) -> str:
    """The error raised, in eager calls, for a target outside [0, V) that is not ignore_index
    (int64's largest stands for a uint64 target past int64's range, `indices`)."""
    held = "a value past int64's range" if bad_target == 2**63 - 1 else bad_target
    return (
        f"target holds {held}, outside [0, {vocab}) for a vocabulary of V={vocab} "
        f"and not ignore_index={ignore_index}"
    )


def check_bias(bias_shape, bias_dtype, vocab: int, weight_shape, input_dtype) -> None:
    """linear_bias (or None) must be [V] (V from linear_weight) in the input's dtype."""
    if bias_shape is None:
        return
    if tuple(bias_shape) != (vocab,):
        raise ValueError(f"linear_bias must have shape ({vocab},) matching linear_weight {tuple(weight_shape)}, got {tuple(bias_shape)}")
    if bias_dtype != input_dtype:
        raise TypeError(f"linear_bias must have the input's dtype {input_dtype}, got {bias_dtype}")
