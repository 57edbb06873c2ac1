"""The RL trainers' own fused heads as benchmark peers, each `fn(x, W, y) -> (log_probs,
entropy)` ([N] each, fp32) at temperature 1: TRL's `ChunkedLogProbFunction` (TRL >= 1.15,
what `add_fused_lm_head` runs) and verl's `linear_cross_entropy` (`use_fused_kernels`).

verl's package imports Ray and its trainer at its top, while its two kernel modules need
only four helpers of `verl.utils.device`: `verl_head` loads those two files from the
installed package (found, not imported) under stand-in parent modules that give the
helpers for CUDA, so a benchmark needs verl's wheel and none of its dependencies.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

TRL_CHUNK = 32768  # the vocabulary tile add_fused_lm_head gives TRL's function (its _CHUNKED_LOGPROB_CHUNK_SIZE)
VERL_KERNEL = "verl.utils.kernel"


def trl_head():
    """TRL's function as the trainers call it; ImportError without TRL >= 1.15."""
    from trl.kernels import ChunkedLogProbFunction

    def run(x, W, y):
        return ChunkedLogProbFunction.apply(x, W, None, y, 1.0, TRL_CHUNK, None, 1.0, ("log_probs", "entropy"))[:2]

    return run


def _stand_in(name: str, path: str | None = None, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    if path is not None:
        module.__path__ = [path]
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def verl_head():
    """verl's kernel (reduction "none", no process group); ImportError without verl."""
    name = VERL_KERNEL + ".linear_cross_entropy"
    if name not in sys.modules and "verl" in sys.modules:  # the real package, imported: its own import
        importlib.import_module(name)
    if name not in sys.modules:
        spec = importlib.util.find_spec("verl")  # the package's place; its __init__ does not run
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("verl is not installed")
        root = spec.submodule_search_locations[0]
        utils = os.path.join(root, "utils")
        _stand_in("verl", root)
        _stand_in("verl.utils", utils)
        _stand_in("verl.utils.device", get_device_capability=torch.cuda.get_device_capability,
                  get_device_name=lambda: "cuda", is_cuda_available=torch.cuda.is_available(),
                  get_torch_device=lambda: torch.cuda)
        _stand_in(VERL_KERNEL, os.path.join(utils, "kernel"))
        for part in ("kernels", "linear_cross_entropy"):
            full = f"{VERL_KERNEL}.{part}"
            spec = importlib.util.spec_from_file_location(full, os.path.join(utils, "kernel", f"{part}.py"))
            module = importlib.util.module_from_spec(spec)
            sys.modules[full] = module
            spec.loader.exec_module(module)
    kernel = sys.modules[name].linear_cross_entropy
    return lambda x, W, y: kernel(x, W, y, 1.0, "none", None)
