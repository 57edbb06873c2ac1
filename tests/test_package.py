"""The package users import: `logitless.torch`, `logitless.jax` and `logitless.spec` give the
public API, `python -m logitless` reports the machine, a wheel installs every module and spec
file, and a package of the same name as one of the implementation packages (another
distribution's `interop`, a caller's `torch_impl.py`) is never loaded silently."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("logitless", "torch_impl", "jax_impl", "interop")
FUNCTIONS = ["linear_cross_entropy", "linear_topk_distillation", "linear_distillation", "linear_log_probs",
             "linear_policy_loss"]


def _python(code: str, cwd, pythonpath: str | None = None, python=sys.executable) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh process started in cwd (its own modules first on sys.path;
    PYTHONPATH only as given)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_both_frameworks_have_the_same_functions_and_the_version():
    import jax_impl
    import torch_impl

    import logitless
    import logitless.jax as lj
    import logitless.spec
    import logitless.torch as lt

    for name in FUNCTIONS:
        assert name in lt.__all__ and name in lj.__all__, name
        assert getattr(lt, name) is getattr(torch_impl, name) and getattr(lj, name) is getattr(jax_impl, name)
    assert lt.LinearCrossEntropyLoss is torch_impl.LinearCrossEntropyLoss and callable(lt.patch_causal_lm)
    for name in logitless.spec.__all__:
        assert getattr(logitless.spec, name) is not None, name
    assert logitless.__version__ == importlib.metadata.version("logitless")


def test_the_bridge_refuses_a_numpy_array_with_a_type_error():
    from logitless.spec import to_jax, to_torch

    for convert, expected in ((to_jax, "torch.Tensor"), (to_torch, "jax.Array")):
        with pytest.raises(TypeError, match=f"expected a {expected}, got numpy.ndarray"):
            convert(np.zeros(3, np.float32))


def test_python_m_logitless_reports_the_machine():
    out = subprocess.run([sys.executable, "-m", "logitless"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for line in ("logitless 0.1.0", "torch ", "jax ", "PyTorch on", "JAX on", "auto at L 16384x4096x128256: ", "peers: "):
        assert line in out.stdout, (line, out.stdout)


def test_a_local_module_that_shadows_an_implementation_package_raises(tmp_path):
    """A caller's torch_impl.py beside the script comes first on sys.path: importing
    logitless.torch raises, naming that file, and never runs it."""
    (tmp_path / "torch_impl.py").write_text('print("the local module ran")\n')
    out = _python("import logitless.torch", tmp_path, pythonpath=str(ROOT))
    assert out.returncode != 0
    assert "ImportError" in out.stderr and str(tmp_path / "torch_impl.py") in out.stderr, out.stderr
    assert "shadows it" in out.stderr and "ran" not in out.stdout, out.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel `pip wheel .` builds from a copy of this tree's project files (setuptools
    leaves its build folder in the source tree)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = out.glob("logitless-*.whl")
    return path


def _fresh_venv(path: pathlib.Path, *installs, dependencies: bool = False) -> pathlib.Path:
    """A new virtual environment with `installs` (wheels, project folders) pip-installed into
    it without their dependencies; with `dependencies`, this environment's packages (torch,
    jax, ...) visible from it through a .pth file (its own site directory's: an editable
    install of this checkout there is not). Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=300)
    python = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    for what in installs:
        run = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                              str(what)], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
    if dependencies:
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        ours = [p for p in sys.path if p.endswith("site-packages")]
        pathlib.Path(site, "dependencies.pth").write_text("\n".join(ours) + "\n")
    return python


def test_the_wheel_holds_every_module_and_spec_file_and_imports_from_elsewhere(wheel, tmp_path):
    """`pip install .` (not editable) of this tree into a fresh environment: every module and
    spec file is in the wheel, and the API imports from another directory, from the
    installed copy."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in PACKAGES:
        for path in (ROOT / package).iterdir():
            if path.suffix in (".py", ".md"):
                assert f"{package}/{path.name}" in names, f"{package}/{path.name} is not in the wheel"
    python = _fresh_venv(tmp_path / "venv", wheel, dependencies=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import logitless, logitless.spec, logitless.torch as lt, logitless.jax as lj, torch_impl, interop; "
            "print(logitless.__file__, torch_impl.__file__, interop.__file__, sep='\\n')")
    out = _python(code, elsewhere, python=python)
    assert out.returncode == 0, out.stderr[-2000:]
    files = out.stdout.splitlines()[-3:]
    assert all(f.startswith(str(tmp_path / "venv")) for f in files), files


def test_another_distribution_of_the_same_top_level_name_raises(wheel, tmp_path):
    """A stand-in of PyPI's `interop` (Illumina's), pip-installed after logitless into the
    same environment: pip checks no file conflicts and overwrites logitless's
    `interop/__init__.py` (the submodules stay); logitless then raises ImportError naming
    both distributions instead of running the other's code."""
    stand_in = tmp_path / "stand-in"
    (stand_in / "interop").mkdir(parents=True)
    (stand_in / "interop" / "__init__.py").write_text('"""InterOp (a stand-in)."""\n__version__ = "1.9.0"\n')
    (stand_in / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "interop"\nversion = "1.9.0"\n[tool.setuptools]\npackages = ["interop"]\n')
    python = _fresh_venv(tmp_path / "venv", wheel, stand_in)
    for module in ("logitless.spec", "logitless.torch", "logitless.jax"):  # each checks interop first
        out = _python(f"import {module}", tmp_path, python=python)
        assert out.returncode != 0 and "ImportError" in out.stderr, (module, out.stderr[-2000:])
        assert "'interop', 'logitless'" in out.stderr, out.stderr[-2000:]


def test_the_repository_tree_is_what_loads_here():
    """In this checkout the implementation packages are the repository's (editable install)."""
    from logitless.origin import ROOT as root, load

    assert root == ROOT
    for name in ("interop", "torch_impl", "jax_impl"):
        assert pathlib.Path(load(name).__file__).parent == ROOT / name
