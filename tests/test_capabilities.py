"""The capability matrix (`bench/capabilities.py`) against the code: every cell's test exists,
and each call takes `vocab_parallel` / `sequence_parallel` exactly where its row says."""

import ast
import inspect
import os

import pytest

from bench.capabilities import CELLS, FUNCTIONS, SEQUENCE, SPLIT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _test_functions(path: str) -> set[str]:
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_cell_names_a_test_that_exists():
    for key, cells in CELLS.items():
        for mode, test in cells.items():
            path, _, name = test.partition("::")
            assert name in _test_functions(path), (key, mode, test)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_calls_take_the_split_arguments_their_rows_claim(framework):
    module = pytest.importorskip(f"{framework}_impl")
    for loss, function in FUNCTIONS.items():
        cells = CELLS[(framework, loss)]
        parameters = inspect.signature(getattr(module, function)).parameters
        assert ("vocab_parallel" in parameters) == (SPLIT in cells), (framework, loss)
        if framework == "torch":
            assert ("sequence_parallel" in parameters) == (SEQUENCE in cells), (framework, loss)
