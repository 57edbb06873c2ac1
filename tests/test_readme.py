"""The README stays true: its examples run as written, it stays short, user-facing, and its
Layout table lists exactly the module files of logitless/, torch_impl/, jax_impl/ and interop/."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)
PACKAGES = ("logitless", "torch_impl", "jax_impl", "interop")
# five public calls and the RL trainers, each with its example, and the generated results tables (one to four GPUs)
MAX_LINES = 570


def test_readme_has_an_example_per_framework():
    assert any("import logitless.torch" in e for e in EXAMPLES) and any("import logitless.jax" in e for e in EXAMPLES)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index):
    out = subprocess.run([sys.executable, "-c", EXAMPLES[index]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


def test_readme_is_short_and_for_users():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines, at most {MAX_LINES}"
    lab_word = "sess" + "ion"  # the lab log's word (bench/NOTES.md), spelt apart so this file holds none
    assert lab_word not in README.lower(), f"README.md mentions a {lab_word!r}"


def test_readme_keeps_the_generated_results_markers():
    for framework in ("torch", "jax"):
        start, end = f"<!-- bench.report {framework} -->", f"<!-- /bench.report {framework} -->"
        assert start in README and end in README and README.index(start) < README.index(end)
    assert "bench/results/cross_entropy.png" in README


def layout_table_files() -> list[str]:
    """The paths in the first column of the README's Layout table that lie in PACKAGES; a
    cell may name several files of one folder (`a/b.py`, `c.py`: a/b.py and a/c.py)."""
    section = README.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    paths = []
    for cell in re.findall(r"^\| ((?:`[^`]+`(?:, )?)+) \|", section, flags=re.M):
        first, *rest = re.findall(r"`([^`]+)`", cell)
        paths += [first] + [f"{first.rsplit('/', 1)[0]}/{name}" for name in rest]
    return [p for p in paths if p.split("/", 1)[0] in PACKAGES]


def test_layout_table_lists_exactly_the_module_files():
    listed = layout_table_files()
    present = sorted(
        os.path.relpath(path, ROOT).replace(os.sep, "/")
        for package in PACKAGES
        for ext in ("py", "md")
        for path in glob.glob(os.path.join(ROOT, package, f"*.{ext}"))
    )
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({p for p in listed if listed.count(p) > 1})}"
    missing, extra = sorted(set(present) - set(listed)), sorted(set(listed) - set(present))
    assert not missing and not extra, f"Layout table lacks {missing}; lists files that do not exist: {extra}"
