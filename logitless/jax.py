"""The JAX API of logitless (the names and options of `logitless.torch`'s functions; the Flax
helper `fused_loss_from_head` needs flax)."""

import importlib

from logitless.origin import load

load("interop")
load("jax_impl")

from jax_impl import (linear_cross_entropy, linear_distillation, linear_log_probs, linear_policy_loss,  # noqa: E402
                      linear_topk_distillation)

__all__ = ["linear_cross_entropy", "linear_topk_distillation", "linear_distillation", "linear_log_probs",
           "linear_policy_loss"]  # and `fused_loss_from_head`, on first use


def __getattr__(name: str):
    """`fused_loss_from_head` on first use (it imports flax)."""
    if name == "fused_loss_from_head":
        return importlib.import_module("jax_impl.flax").fused_loss_from_head
    raise AttributeError(f"module 'logitless.jax' has no attribute {name!r}")
