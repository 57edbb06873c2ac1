"""Test setup: the repository root on sys.path; kernel interpreters when there is no GPU.

TRITON_INTERPRET is read when a @triton.jit function is defined, so it is set here,
before any test imports the kernels.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels in Triton's interpreter
    os.environ.setdefault("LOGITLESS_PALLAS_INTERPRET", "1")  # Pallas kernels in interpret mode
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
