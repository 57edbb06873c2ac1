"""Where the time goes: the CUDA kernels of one fwd+bwd of a method, by total time.

python -m bench.profile_torch [--shape L] [--method ours-speed]
"""

from __future__ import annotations

import argparse

import torch

from bench import measure, torch_methods


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="L")
    parser.add_argument("--method", default="ours-speed")
    parser.add_argument("--rows", type=int, default=12)
    args = parser.parse_args()
    x, W, y = measure.make_inputs(*measure.PRESETS[args.shape], torch.bfloat16, torch.device("cuda"))
    methods, skipped = torch_methods.load([args.method])
    if skipped:
        raise SystemExit(f"{args.method}: {skipped[args.method]}")
    method = methods[args.method]
    for _ in range(2):
        measure.fwd_bwd(method, x, W, y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        measure.fwd_bwd(method, x, W, y)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
