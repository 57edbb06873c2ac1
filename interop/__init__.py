"""What PyTorch and JAX share: the option definitions and checks, and the float64 spec."""

__library__ = "logitless"  # `logitless.origin` tells this package from another of the same name

from interop.options import CrossEntropyOptions, ProblemShape, check_inputs
from interop.reference import ReferenceResult, linear_cross_entropy_reference
from interop.tuning import Tuning

__all__ = [
    "CrossEntropyOptions",
    "ProblemShape",
    "check_inputs",
    "ReferenceResult",
    "linear_cross_entropy_reference",
    "Tuning",
]
