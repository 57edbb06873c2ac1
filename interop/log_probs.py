"""The options of `linear_log_probs` (per-token log-probabilities, entropy and argmax at a
temperature, for RL and preference losses), shared by both frameworks (interop/SPEC.md,
"Log-probabilities")."""

from __future__ import annotations

import dataclasses
import math

from interop.options import DEFAULT_IGNORE_INDEX, _as_float

@dataclasses.dataclass(frozen=True)
class LogProbsOptions:
    """Options of `linear_log_probs`, validated on construction.

    temperature: T > 0; the log-probabilities are log_softmax(s / T).
    softcap: c > 0 applies c * tanh(z / c) to the logits (before the temperature); None: none.
    ignore_index: target value whose rows get a log-probability of 0 (None means -100).
    """

    temperature: float = 1.0
    softcap: float | None = None
    ignore_index: int = DEFAULT_IGNORE_INDEX

    def __post_init__(self):
        t = _as_float("temperature", self.temperature)
        if not (t > 0.0 and math.isfinite(t)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", t)
        if self.softcap is not None:
            cap = _as_float("softcap", self.softcap)
            if not (cap > 0.0 and math.isfinite(cap)):
                raise ValueError(f"softcap must be None or a finite number > 0, got {self.softcap!r}")
            object.__setattr__(self, "softcap", cap)
        if self.ignore_index is None:
            object.__setattr__(self, "ignore_index", DEFAULT_IGNORE_INDEX)
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise ValueError(f"ignore_index must be an int, got {self.ignore_index!r}")
