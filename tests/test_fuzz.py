"""A seeded, time-bounded differential fuzz of every implementation against the float64
reference: random shapes, options, argument layouts (PyTorch) and logit scales up to those
of trained models (|z| ~ 300 in bf16).

Accuracy is judged against what users compare with: the naive loss in the input dtype
(logits computed and rounded in that dtype, then an fp32 cross-entropy, differentiated by
PyTorch's autograd). A fuzz case's error may be at most CASE_FACTOR x the naive one plus the
dtype's tolerance at unit logit scale (its few rows make a tighter ratio noise); on a
problem of a few hundred rows and classes in bf16 at logit scales 20-300, each gradient's
error at most 1.25x the naive one's for the default strategies ("speed", "chunked") and 2x
for "memory". LOGITLESS_FUZZ_SECONDS sets the time budget (default 60), LOGITLESS_FUZZ_SEED the
seed (default: fixed, so a failure reproduces).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.frameworks import (LAYOUTS, JaxAdapter, TorchAdapter, device, make_problem, reference, rel_err, seed_of, tolerance,
                              torch_outputs)

BUDGET_S = float(os.environ.get("LOGITLESS_FUZZ_SECONDS", "60"))
SEED = int(os.environ.get("LOGITLESS_FUZZ_SEED", "20261125"))
ERROR_FACTOR = {"speed": 1.25, "chunked": 1.25, "memory": 2.0}
CASE_FACTOR = 4.0  # one case's error over the naive one's, at most (plus the dtype's tolerance)
LOGIT_SCALES = {"bfloat16": (1.0, 4.0, 20.0, 60.0, 300.0), "float16": (1.0, 4.0, 20.0), "float32": (1.0, 4.0, 20.0, 60.0)}
TORCH_ARGS = ("x", "W", "b", "cw", "y")


def _naive(p, options: dict, g_out, g_lse):
    """Loss, lse and gradients of the unfused loss in the input dtype (float64 numpy)."""
    import torch
    import torch.nn.functional as F

    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[p.dtype]
    dev = device()
    x = torch.tensor(p.x, device=dev).to(dt).requires_grad_()
    W = torch.tensor(p.W, device=dev).to(dt).requires_grad_()
    b = None if p.b is None else torch.tensor(p.b, device=dev).to(dt).requires_grad_()
    y = torch.tensor(p.y, device=dev)
    z = F.linear(x, W if p.weight_layout == "VD" else W.T, b).float()
    cap = options.get("softcap")
    s = z if cap is None else cap * torch.tanh(z / cap)
    lse = torch.logsumexp(s, dim=-1)
    cw = None if p.cw is None else torch.tensor(p.cw, device=dev)
    reduction = options.get("reduction", "mean")
    rows = F.cross_entropy(s.reshape(-1, s.shape[-1]), y.reshape(-1), weight=cw, reduction="none",
                           label_smoothing=options.get("label_smoothing", 0.0))
    valid = (y.reshape(-1) != -100).float()
    rows = rows + options.get("z_loss", 0.0) * lse.reshape(-1) ** 2 * valid
    denom = valid.sum() if cw is None else (cw[y.reshape(-1).clamp(min=0)] * valid).sum()
    loss = {"none": rows.reshape(y.shape), "sum": rows.sum(), "mean": rows.sum() / denom}[reduction]
    return torch_outputs(loss, lse, {"x": x, "W": W, "b": b}, g_out, g_lse)


def _case(rng: np.random.Generator):
    """(adapter name, problem, options, g_out, g_lse, torch layouts) drawn at random."""
    dtype = str(rng.choice(["bfloat16", "float16", "float32"]))
    lead = (int(rng.integers(1, 40)),) if rng.random() < 0.7 else (int(rng.integers(1, 5)), int(rng.integers(1, 12)))
    p = make_problem(int(rng.integers(2**31)), lead=lead, hidden=int(rng.integers(1, 48)), vocab=int(rng.integers(1, 300)),
                     dtype=dtype, bias=bool(rng.random() < 0.5), class_weights=bool(rng.random() < 0.3),
                     weight_layout=str(rng.choice(["VD", "DV"])), ignore_frac=float(rng.choice([0.0, 0.2, 0.9])),
                     logit_scale=float(rng.choice(LOGIT_SCALES[dtype])))
    options = dict(reduction=str(rng.choice(["mean", "sum", "none"])))
    if rng.random() < 0.3:
        options["label_smoothing"] = float(rng.uniform(0, 0.3))
    if rng.random() < 0.3:
        options["z_loss"] = 1e-3
    if rng.random() < 0.3:
        options["softcap"] = float(rng.choice([5.0, 30.0, 1e6]))
    g_out = rng.standard_normal(p.y.shape) if options["reduction"] == "none" else np.asarray(rng.uniform(0.5, 2.0))
    g_lse = rng.standard_normal(p.y.shape) if rng.random() < 0.3 else None
    impl = f"{rng.choice(['torch', 'jax'])}-{rng.choice(['speed', 'memory', 'chunked'])}"
    # expanded x or W would make classes or rows alike, whose gradients cancel (tests/test_arguments.py has them)
    layouts = {str(k): str(rng.choice(LAYOUTS[:2] + LAYOUTS[3:] if k in "xW" else LAYOUTS))
               for k in TORCH_ARGS if rng.random() < 0.3}
    if "y" in layouts and layouts["y"] == "expanded":
        p.y[...] = p.y.flat[0] if p.y.flat[0] >= 0 else 0  # an expanded target repeats one class
    if layouts.get("cw") == "expanded" and p.cw is not None:
        p.cw[:] = p.cw[0]
    if layouts.get("b") == "expanded" and p.b is not None:
        p.b[:] = p.b[0]
    return impl, p, options, g_out, g_lse, layouts


def _case_by_seed(case_seed: int):
    """One case of the fuzz again, by the seed its failure message names."""
    return _case(np.random.default_rng(case_seed))


def test_fuzz_against_float64_reference():
    """Each case within CASE_FACTOR x the naive error plus the dtype's tolerance; prints the
    root-mean-square error over the naive one's per implementation, dtype and gradient, at
    logit scales >= 20 (`test_gradient_error_at_trained_model_logit_scales` holds those to
    ERROR_FACTOR on problems large enough for the ratio to mean something)."""
    rng = np.random.default_rng(SEED)
    adapters = {}
    deadline, count, sums = time.monotonic() + BUDGET_S, 0, {}
    while time.monotonic() < deadline:
        case_seed = int(rng.integers(2**31))
        impl, p, options, g_out, g_lse, layouts = _case(np.random.default_rng(case_seed))
        extra = dict(layouts=layouts) if impl.startswith("torch") else {}
        got = _adapter(adapters, impl).run(p, options, g_out, g_lse, **extra)
        errors = _errors(got, p, options, g_out, g_lse)
        for key, (err, naive_err) in errors.items():
            assert err <= CASE_FACTOR * naive_err + tolerance(p.dtype), (
                f"case {case_seed}: {impl} {key}: error {err:.3g} (naive {naive_err:.3g}); {p.dtype}, N {p.y.size} "
                f"D {p.x.shape[-1]} V {p.vocab}, scale {p.logit_scale}, {options}, layouts {layouts}, "
                f"lse grad {g_lse is not None}")
            if key.startswith("grad") and p.logit_scale >= 20:
                sums.setdefault((impl, p.dtype, key), np.zeros(2))[:] += (err**2, naive_err**2)
        count += 1
    assert count > 0
    print(f"\n{count} cases; RMS gradient error / naive's at logit scales >= 20:",
          ", ".join(f"{i} {d} {k} {np.sqrt(e / max(n, 1e-300)):.2f}" for (i, d, k), (e, n) in sorted(sums.items())))


def _adapter(adapters: dict, impl: str):
    framework, strategy = impl.split("-")
    if impl not in adapters:
        adapters[impl] = TorchAdapter(strategy, device()) if framework == "torch" else JaxAdapter(strategy)
    return adapters[impl]


def _errors(got: dict, p, options, g_out, g_lse) -> dict:
    """{output: (its error, the naive loss's error)} against the float64 reference; outputs
    whose naive error is 1 or more (a result that cancels to ~0: no digit of the naive one is
    right either) are left out."""
    ref = reference(p, options, g_out, g_lse)
    naive = _naive(p, options, g_out, g_lse)
    ref_of = {"loss": ref.loss, "lse": ref.lse, "grad_x": ref.grad_input, "grad_W": ref.grad_weight, "grad_b": ref.grad_bias}
    errors = {}
    for key, value in got.items():
        naive_err = rel_err(naive[key], ref_of[key])
        naive_err = naive_err if np.isfinite(naive_err) else 0.0  # the unfused mean of no valid row: 0/0 grads
        if naive_err < 1.0:
            errors[key] = (rel_err(value, ref_of[key]), naive_err)
    return errors


@pytest.mark.parametrize("scale", [20.0, 60.0, 300.0])
@pytest.mark.parametrize("impl", ["torch-speed", "torch-memory", "torch-chunked", "jax-speed", "jax-memory", "jax-chunked"])
def test_gradient_error_at_trained_model_logit_scales(impl, scale):
    """bf16 at the logit scales of trained models (20-40) and beyond: each gradient's error at
    most ERROR_FACTOR x the naive bf16 loss's, on enough rows and classes that the ratio is
    not one rounding's luck."""
    p = make_problem(seed_of("peaked", scale), lead=(256,), hidden=64, vocab=509, dtype="bfloat16", bias=True,
                     logit_scale=scale)
    g_out = np.asarray(1.0)
    got = _adapter({}, impl).run(p, dict(label_smoothing=0.05), g_out, None)
    for key, (err, naive_err) in _errors(got, p, dict(label_smoothing=0.05), g_out, None).items():
        if key.startswith("grad"):
            bound = ERROR_FACTOR[impl.split("-")[1]] * naive_err
            assert err <= bound, f"{key}: error {err:.3g} > {bound:.3g} ({ERROR_FACTOR[impl.split('-')[1]]}x naive {naive_err:.3g})"
