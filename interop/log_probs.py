"""The options of `linear_log_probs` (per-token log-probabilities, entropy and argmax at a
temperature, for RL and preference losses), shared by both frameworks (interop/SPEC.md,
"Log-probabilities")."""

from __future__ import annotations

import dataclasses

from interop.options import DEFAULT_IGNORE_INDEX, positive, set_ignore_index, set_softcap

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
        object.__setattr__(self, "temperature", positive("temperature", self.temperature))
        set_softcap(self)
        set_ignore_index(self)
