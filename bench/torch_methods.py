"""The PyTorch methods the benchmark compares: ours, torch eager / compile, and the peers.

Each method is a function (x [N, D], W [V, D], y [N]) -> scalar mean loss over rows whose
target is not -100. A peer that can't be imported is reported as skipped with the reason.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _eager(x, W, y):
    return F.cross_entropy((x @ W.T).float(), y)


def _ours(strategy, **options):
    import torch_impl

    return lambda x, W, y: torch_impl.linear_cross_entropy(x, W, y, strategy=strategy, **options)


def _compiled():
    return torch.compile(_eager, dynamic=False)


def _torch_native():
    if not hasattr(F, "linear_cross_entropy"):
        raise ImportError(f"torch {torch.__version__} has no F.linear_cross_entropy (added in 2.13)")
    options = torch.nn.LinearCrossEntropyOptions()
    return lambda x, W, y: F.linear_cross_entropy(x, W, y, options=options)


def _liger(impl):
    """Liger's fused loss with its backend named: left to choose, Liger takes its CuTe DSL
    backend wherever `cutlass.cute` imports, so the Triton row would silently change kernels."""
    from liger_kernel.functional import fused_linear_cross_entropy

    if impl == "nvidia-cutedsl":
        import cutlass.cute  # noqa: F401  (Liger would fall back to Triton with a warning)

        if torch.cuda.get_device_capability() < (9, 0):
            raise ImportError("Liger's CuTe DSL backend needs compute capability 9.0 or newer")
    return lambda x, W, y: fused_linear_cross_entropy(x, W, y, impl=impl)[0]


def _quack(chunked):
    """QuACK (quack-kernels, CuTe DSL): its chunked linear cross-entropy, which keeps one chunk
    of logits, or its fused cross-entropy on the whole N x V logits."""
    from quack.linear_cross_entropy import chunked_linear_cross_entropy, linear_cross_entropy_func

    if chunked:
        return lambda x, W, y: chunked_linear_cross_entropy(x, W, y)
    return lambda x, W, y: linear_cross_entropy_func(x, W, None, y, inplace_backward=True)


def _cce(filter_eps):
    from cut_cross_entropy import linear_cross_entropy

    if filter_eps == "default":
        return lambda x, W, y: linear_cross_entropy(x, W, y)
    return lambda x, W, y: linear_cross_entropy(x, W, y, filter_eps=filter_eps)


METHODS = {
    "ours-speed": functools.partial(_ours, "speed"),
    "ours-memory": functools.partial(_ours, "memory"),
    "ours-chunked": functools.partial(_ours, "chunked"),
    "ours-speed-filter": functools.partial(_ours, "speed", filter_eps=2**-12),  # gradient filtering at CCE's bf16 eps
    "torch-eager": lambda: _eager,
    "torch-compile": _compiled,
    "torch-native": _torch_native,
    "liger": functools.partial(_liger, "nvidia-triton"),
    "liger-cute": functools.partial(_liger, "nvidia-cutedsl"),
    "quack": functools.partial(_quack, True),
    "quack-logits": functools.partial(_quack, False),
    "cce": functools.partial(_cce, "default"),
    "cce-nofilter": functools.partial(_cce, None),
}


def load(names):
    """(methods {name: fn}, skipped {name: reason}) for the requested names."""
    methods, skipped = {}, {}
    for name in names:
        try:
            methods[name] = METHODS[name]()
        except Exception as e:  # a missing or broken peer is reported, never dropped
            skipped[name] = f"{type(e).__name__}: {e}"
    return methods, skipped
