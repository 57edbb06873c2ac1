"""Test setup: the repository root on sys.path; kernel interpreters when there is no GPU; the
fixtures that several test modules share.

TRITON_INTERPRET is read when a @triton.jit function is defined, so it is set here,
before any test imports the kernels.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels in Triton's interpreter
    os.environ.setdefault("LOGITLESS_PALLAS_INTERPRET", "1")  # Pallas kernels in interpret mode
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda are skipped where no CUDA GPU is (the device tool runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(params=["default-blocks", "small-blocks"])
def blocks(request):
    """The Tuning of the GPU tests' medium shapes: the defaults, and small blocks so that
    they span several row and column blocks (and an fp32 grad_weight two slabs
    along W's first dimension in both layouts): tests.frameworks.MEDIUM_BLOCKS."""
    from interop.tuning import DEFAULT
    from tests.frameworks import MEDIUM_BLOCKS

    return {"default-blocks": DEFAULT, "small-blocks": MEDIUM_BLOCKS}[request.param]
