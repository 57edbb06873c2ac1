"""The JAX methods the benchmark compares: ours, jit'd naive XLA, and jax-cce.

Each method is a function (x [N, D], W [V, D], y [N] int32) -> scalar mean loss over rows
whose target is not -100, timed under `jax.jit`.
"""

from __future__ import annotations

import functools


def _naive(x, W, y):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax((x @ W.T).astype(jnp.float32), axis=-1)
    valid = y != -100
    nll = -jnp.take_along_axis(logp, jnp.where(valid, y, 0)[:, None], axis=1)[:, 0]
    return jnp.where(valid, nll, 0.0).sum() / valid.sum()


def _ours(strategy):
    import jax_impl

    return lambda x, W, y: jax_impl.linear_cross_entropy(x, W, y, strategy=strategy)


def _jax_cce():
    from jax_cce import linear_cross_entropy

    return lambda x, W, y: linear_cross_entropy(x, W, y)


class Method:
    """A loss function and whether it honours ignore_index=-100 (jax-cce does not: it is
    given targets with -100 replaced by 0 and its errors are not reported)."""

    def __init__(self, fn, ignores=True):
        self.fn, self.ignores = fn, ignores


METHODS = {
    "jax-ours-speed": lambda: Method(_ours("speed")),
    "jax-ours-memory": lambda: Method(_ours("memory")),
    "jax-ours-chunked": lambda: Method(_ours("chunked")),
    "jax-naive": lambda: Method(_naive),
    "jax-cce": lambda: Method(_jax_cce(), ignores=False),
}


def load(names):
    """(methods {name: Method}, skipped {name: reason}) for the requested names."""
    methods, skipped = {}, {}
    for name in names:
        try:
            import jax  # noqa: F401

            methods[name] = METHODS[name]()
        except Exception as e:
            skipped[name] = f"{type(e).__name__}: {e}"
    return methods, skipped


@functools.lru_cache(maxsize=None)
def compiled_pair(fn):
    """(jit(fn), jit(value_and_grad(fn) wrt x and W)) for a method function."""
    import jax

    return jax.jit(fn), jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
