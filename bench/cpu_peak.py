"""Peak extra memory of one PyTorch method's fwd+bwd on the CPU, measured in a fresh
process (an allocator that has already served other methods hides growth).

python -m bench.cpu_peak METHOD N D V DTYPE   -> prints the bytes (Linux: peak RSS growth)
"""

from __future__ import annotations

import subprocess
import sys

import torch


def measure_in_subprocess(method: str, n: int, d: int, v: int, dtype: str) -> int | None:
    """Run this module for one method; None if the measurement is unavailable."""
    out = subprocess.run([sys.executable, "-m", "bench.cpu_peak", method, str(n), str(d), str(v), dtype],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return int(out.stdout.strip().splitlines()[-1])


def main(method: str, n: int, d: int, v: int, dtype: str) -> None:
    from bench import measure, torch_methods

    x, W, y = measure.make_inputs(n, d, v, getattr(torch, dtype), torch.device("cpu"))
    fn = torch_methods.METHODS[method]()
    peak = measure.peak_extra_bytes(lambda: measure.fwd_bwd(fn, x, W, y), torch.device("cpu"))
    print(peak)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:5]), sys.argv[5])
