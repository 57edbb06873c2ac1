"""Timing, peak memory and error of one method on one problem (PyTorch)."""

from __future__ import annotations

import statistics
import time

import torch

PRESETS = {
    "L": (16384, 4096, 128256),  # Llama-3-8B head
    "G": (8192, 2304, 256000),  # Gemma-2-2B head
    "S": (4096, 1024, 32000),
    "Q": (4096, 4096, 128256),  # Llama-3's head at a short batch
    "cpu": (1024, 128, 16000),  # the CPU demo shape
}


def make_inputs(n, d, v, dtype, device, ignore_frac=0.1, peaked=False, seed=0, zipf=False):
    """x ~ N(0, 1), W ~ N(0, 1/D) (logits ~ N(0, 1)); 10% of targets -100.

    peaked: the logits are scaled so that the softmax has the entropy of a trained language
    model (a few nats), and the targets are drawn from that softmax's top classes.
    zipf: a Zipf prior over the class ids is added to the logits (class j's logit gets
    -log(j + 1), through x[:, 0] = 1 and W[:, 0]), as a trained head favours frequent tokens
    and BPE vocabularies give those the low ids; targets as with `peaked`.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, d, device=device, generator=gen)
    W = torch.randn(v, d, device=device, generator=gen) / d**0.5
    if peaked:
        W *= 4.0  # logits ~ N(0, 16): entropy of a few nats at V ~ 1e5
    if zipf:
        x[:, 0] = 1.0
        W[:, 0] = -torch.log(torch.arange(1, v + 1, device=device, dtype=W.dtype))
    x, W = x.to(dtype), W.to(dtype)
    y = torch.randint(0, v, (n,), device=device, generator=gen)
    if peaked or zipf:  # the most likely class of each row
        y = torch.cat([y[:0]] + [(x[i : i + 1024] @ W.T).argmax(-1) for i in range(0, n, 1024)])
    y[torch.rand(n, device=device, generator=gen) < ignore_frac] = -100
    return x, W, y


def has_liger() -> bool:
    """Whether Liger's patch can run here: liger-kernel imports and a GPU runs its kernels."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, warmup=3, repeat=10, events=True) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU, else (or with events=False, for
    JAX, whose fn must block until its result is ready) the host clock."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        if device.type == "cuda" and events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step_row(step, device, repeat: int) -> dict:
    """A training step's figures: median ms, peak memory beyond what was in use (MiB, GPUs;
    None elsewhere) and the loss that step() returns."""
    row = {"step_ms": time_ms(step, device, repeat=repeat)}
    peak = peak_extra_bytes(step, device) if device.type == "cuda" else None
    row["peak_extra_mib"] = None if peak is None else peak / 2**20
    row["loss"] = float(step())
    return row


def fwd_bwd(method, x, W, y):
    """One forward + backward; returns (loss, grad_x, grad_W)."""
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    loss = method(x, W, y)
    loss.backward()
    return loss.detach(), x.grad, W.grad


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_extra_bytes(fn, device) -> int | None:
    """Peak memory above what was in use before fn(): the CUDA allocator's peak on a GPU,
    the growth of the process's peak resident memory on a Linux CPU (meaningful in a fresh
    process: see bench.cpu_peak), None where neither is readable."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return peak
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set size to the current one
        base = _status_kib("VmRSS")
    except OSError:
        return None
    out = fn()
    peak = (_status_kib("VmHWM") - base) * 1024
    del out
    return peak


def record(row: dict, fill, log) -> dict:
    """`row` as fill(row) completes it, or with an "error" entry where fill raised (out of
    memory, say: recorded, and the run goes on); the CUDA cache emptied for the next method;
    then logged."""
    try:
        fill(row)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(row)
    return row


def rel_err(a, ref) -> float:
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def matmul_tflops(device, dtype, n=8192) -> float | None:
    """Achieved TFLOP/s of an n^3 matrix product in `dtype`, measured now (CUDA only)."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, warmup=3, repeat=20)
    return 2 * n**3 / ms / 1e9
