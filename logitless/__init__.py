"""logitless: fused "linear head + loss" for large-vocabulary models that never builds the
N x V logits, in PyTorch and JAX.

    import logitless.torch as lt    # linear_cross_entropy, linear_log_probs, ... (PyTorch)
    import logitless.jax as lj      # the same names and options (JAX)
    import logitless.spec           # the options, the float64 references, the DLPack bridge

`python -m logitless` prints what runs where on this machine.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("torch", "jax", "spec")


def __getattr__(name: str):
    """The submodules on first use (`logitless.torch` imports PyTorch, `logitless.jax` JAX)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"logitless.{name}")
    raise AttributeError(f"module 'logitless' has no attribute {name!r}")


__all__ = ["__version__", *_SUBMODULES]
