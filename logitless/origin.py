"""The implementation packages keep the repository's top-level names (`torch_impl`,
`jax_impl`, `interop`), which another distribution can also install (PyPI's `interop`) and
a module of the caller's can shadow (a `torch_impl.py` beside a script). `load` imports one
and checks that it is this library's, so that the wrong one never loads silently.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib

import logitless

ROOT = pathlib.Path(logitless.__file__).resolve().parent.parent  # where logitless and its packages lie


def load(name: str):
    """The package `name` (torch_impl, jax_impl or interop), or ImportError naming what
    Python found instead: its file, and the distributions that install that name."""
    module = importlib.import_module(name)
    found = pathlib.Path(getattr(module, "__file__", None) or name).resolve()
    if found.parent == ROOT / name and getattr(module, "__library__", None) == "logitless":
        return module
    raise ImportError(_message(name, found))


def _message(name: str, found: pathlib.Path) -> str:
    owners = sorted(set(importlib.metadata.packages_distributions().get(name, [])))
    why = (f"the distributions {', '.join(repr(o) for o in owners)} all install a top-level {name!r}: one "
           f"overwrote or shadows the other (pip uninstall the other one, then reinstall logitless)"
           if len(owners) > 1 else
           f"a module of that name earlier on sys.path shadows it (rename {found.name!r}, or run from another "
           "directory)")
    return (f"logitless needs its own package {name!r} at {ROOT / name}, but Python imports {found}: {why}")
