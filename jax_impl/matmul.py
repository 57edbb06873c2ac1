"""The matrix products of the JAX paths, at the precision their dtype promises."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def contract(a, b, a_axis: int, b_axis: int, out_dtype=jnp.float32):
    """sum_k a[.., k, ..] b[.., k, ..] over a's `a_axis` and b's `b_axis`, for 2-D a and b,
    accumulated and returned in `out_dtype`. fp32 operands get full fp32 products (XLA on
    GPUs would otherwise use TF32 for them, as PyTorch does not by default)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((a_axis,), (b_axis,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)
