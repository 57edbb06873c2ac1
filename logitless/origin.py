"""The implementation packages keep the repository's top-level names (`torch_impl`,
`jax_impl`, `interop`), which another distribution can also install (PyPI's `interop`) and
a module of the caller's can shadow (a `torch_impl.py` beside a script). `load` imports one
and checks that it is this library's, so that the wrong one never loads silently.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pathlib

import logitless

ROOT = pathlib.Path(logitless.__file__).resolve().parent.parent  # where logitless and its packages lie


def load(name: str):
    """The package `name` (torch_impl, jax_impl or interop), or ImportError naming what
    Python finds instead: its file, and the distributions that install that name. Where it
    lies is checked before it runs (a caller's module of that name is never executed), its
    marker after."""
    spec = importlib.util.find_spec(name)
    where = None if spec is None or spec.origin in (None, "namespace") else pathlib.Path(spec.origin).resolve()
    if where is None or where.parent != ROOT / name:
        raise ImportError(_message(name, where))
    module = importlib.import_module(name)
    if getattr(module, "__library__", None) != "logitless":
        raise ImportError(_message(name, where))
    return module


def _message(name: str, found: pathlib.Path | None) -> str:
    owners = sorted(set(importlib.metadata.packages_distributions().get(name, [])))
    if len(owners) > 1:
        why = (f"the distributions {', '.join(repr(o) for o in owners)} all install a top-level {name!r}: one "
               "overwrote or shadows the other (pip uninstall the other one, then reinstall logitless)")
    elif found is None:
        why = "its files are missing or partly removed (reinstall logitless)"
    else:
        why = f"a module of that name earlier on sys.path shadows it (rename {found.name!r}, or run from another directory)"
    seen = "no module file" if found is None else found
    return f"logitless needs its own package {name!r} at {ROOT / name}, but Python finds {seen}: {why}"
