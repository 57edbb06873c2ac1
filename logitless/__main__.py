"""`python -m logitless`: what runs where on this machine: the versions, the devices, which
strategy and blocks `auto` picks at the benchmark's shapes (bf16, a reduced loss with
gradients), and which peers import."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

import logitless
from logitless.origin import ROOT, load

SHAPES = {"L": (16384, 4096, 128256), "G": (8192, 2304, 256000), "S": (4096, 1024, 32000)}
PACKAGES = ("numpy", "torch", "triton", "jax", "jaxlib", "flax", "transformers")
PEERS = ("liger_kernel", "cut_cross_entropy", "quack")  # the peers of bench/


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _imports(module: str) -> str:
    try:
        importlib.import_module(module)
        return "imports"
    except Exception as e:  # a peer that fails at import, whatever its error: that is the answer
        return "not installed" if isinstance(e, ModuleNotFoundError) and e.name == module else f"fails ({e!r})"[:120]


def _torch_lines() -> list[str]:
    import torch

    from interop.tuning import DEFAULT
    from torch_impl.head import plan
    from torch_impl.steps import choose_strategy, kernels_can_run

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.empty(0, dtype=torch.bfloat16, device=device)
    where = torch.cuda.get_device_name() if device == "cuda" else "the CPU"
    lines = [f"PyTorch on {where}: the Triton kernels {'run' if kernels_can_run(x) else 'do not run (chunked)'}"]
    for name, (n, d, v) in SHAPES.items():
        strategy = choose_strategy("auto", x, n, d, v, DEFAULT)
        p = plan(DEFAULT, "cross_entropy", strategy, n, d, v, torch.bfloat16, False)
        lines.append(f"  auto at {name} {n}x{d}x{v}: {strategy}, blocks of {p.block_rows} rows x {p.block_cols} "
                     f"classes ({p.layout})")
    return lines


def _jax_lines() -> list[str]:
    import jax

    from interop.options import CrossEntropyOptions
    from interop.tuning import DEFAULT
    from jax_impl.blocked import plan
    from jax_impl.functional import choose_strategy

    device = jax.devices()[0]
    lines = [f"JAX on {device.platform} ({device.device_kind}), {len(jax.devices())} device(s)"]
    for name, (n, d, v) in SHAPES.items():
        strategy = choose_strategy("auto", "bfloat16", n, d, v, device.platform, DEFAULT)
        c = plan(DEFAULT, CrossEntropyOptions(), "VD", strategy, n, d, v, "bfloat16", False, False, device.platform)
        lines.append(f"  auto at {name} {n}x{d}x{v}: {strategy}, blocks of {c.block_rows} rows x {c.block_cols} "
                     f"classes ({c.layout})")
    return lines


def report() -> str:
    lines = [f"logitless {logitless.__version__} at {ROOT}",
             f"python {platform.python_version()} | " + " | ".join(f"{p} {_version(p)}" for p in PACKAGES)]
    for framework, section in (("torch", _torch_lines), ("jax", _jax_lines)):
        try:
            importlib.import_module(framework)
        except ImportError:
            lines.append(f"{framework}: not installed")
            continue
        try:
            load("interop"), load(f"{framework}_impl")
            lines += section()
        except Exception as e:  # a broken install or device: the report says so and goes on
            lines.append(f"{framework}: fails ({e!r})"[:400])
    lines.append("peers: " + " | ".join(f"{p} {_imports(p)}" for p in PEERS))
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
