"""Test setup: the repository root on sys.path; Triton's interpreter when there is no GPU."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
