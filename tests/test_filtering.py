"""Gradient filtering (`filter_eps`) of the PyTorch kernels against a float64 simulation of
its rule, on the CPU in Triton's interpreter.

The rule (torch_impl.kernels.row_grad): in each block of whole rows, a tile of FILTER_COLS
classes is dropped from dz when every entry of it, the target's term left out, lies at or
below filter_eps * max(|P_i|, |T_i|) of its row; the targets' terms are always kept. The
problems put most of each row's probability on the first tile, so the later tiles are
dropped at filter_eps = 1e-3 while their dropped share (~2e-4 of the gradient) is well
above the fp32 tolerance: in fp32 a kernel that drops nothing, or the wrong tiles, fails;
bf16 checks the same path in that dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from interop.options import check_filter_eps
from interop.tuning import Tuning
from tests.frameworks import seed_of, tolerance
from torch_impl.kernels import FILTER_COLS

N, D = 40, 12
HOT = 64  # classes of the first tile that take most of each row's probability
# Blocks of 16 (V = 2100) or 24 (V = 1300) whole rows for "speed" at these sizes (the defaults
# would use one); every test here runs with it.
SMALL_BLOCKS = Tuning(min_block=4, speed_block_elements=16 * 2100, min_memory_block=(4, 4), speed_min_rows=1,
                      whole_row_head_bytes=0, one_speed_block_share=0)


def make_inputs(seed: int, vocab: int, dtype, layout: str, bias: bool, class_weights: bool, n=N, d=D, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 0.3
    x[:, 0] = 3.0
    W = torch.randn(vocab, d, generator=g) * 0.3
    W[:HOT, 0] = 3.0  # logits ~9 on the hot classes, ~0 elsewhere: p ~ 1e-5 outside them
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::7] = -100
    b = torch.randn(vocab, generator=g) * 0.3 if bias else None
    cw = torch.rand(vocab, generator=g) + 0.5 if class_weights else None
    x, W, y = x.to(device, dtype), W.to(device, dtype), y.to(device)
    b, cw = (None if t is None else t.to(device) for t in (b, cw))
    return x, W if layout == "VD" else W.T.contiguous(), y, None if b is None else b.to(dtype), cw


def simulated_grads(x, W_VD, b, cw, y, opts: dict, filter_eps, block_rows: int, g_out):
    """float64 (dx, dW [V, D], db) of the filtered loss, following the rule above."""
    x, W = x.double(), W_VD.double()
    n, vocab = x.shape[0], W.shape[0]
    eps, zl, cap = opts.get("label_smoothing", 0.0), opts.get("z_loss", 0.0), opts.get("softcap")
    z = x @ W.T + (0 if b is None else b.double())
    s = z if cap is None else cap * torch.tanh(z / cap)
    cap_grad = torch.ones_like(z) if cap is None else 1 - (s / cap) ** 2
    lse = torch.logsumexp(s, 1)
    valid, in_range = y != -100, (y >= 0) & (y < vocab)
    safe_y = torch.where(in_range, y, 0)
    cwd = torch.ones(vocab, dtype=torch.float64, device=x.device) if cw is None else cw.double()
    cw_y = torch.where(valid, cwd[safe_y], 0.0)
    r = torch.as_tensor(g_out, dtype=torch.float64, device=x.device).expand(n) * valid
    if opts.get("reduction", "mean") == "mean":
        r = r / cw_y.sum()
    P = r * ((1 - eps) * cw_y + eps * cwd.sum() / vocab + 2 * zl * lse)
    T = r * (1 - eps) * cw_y * in_range
    dense = (P[:, None] * torch.exp(s - lse[:, None]) - (r * eps / vocab)[:, None] * cwd) * cap_grad
    threshold = filter_eps * torch.maximum(P.abs(), T.abs())
    keep = torch.zeros_like(dense, dtype=torch.bool)
    for r0 in range(0, n, block_rows):
        for c0 in range(0, vocab, FILTER_COLS):
            big = dense[r0 : r0 + block_rows, c0 : c0 + FILTER_COLS].abs() > threshold[r0 : r0 + block_rows, None]
            keep[r0 : r0 + block_rows, c0 : c0 + FILTER_COLS] = big.any()
    dz = dense * keep
    rows = torch.arange(n, device=x.device)
    dz[rows, safe_y] -= T * cap_grad[rows, safe_y]
    return dz @ W, dz.T @ x, dz.sum(0), keep


def run(x, W, y, b, cw, layout, opts, strategy, filter_eps, g_out, tuning: Tuning = SMALL_BLOCKS):
    from torch_impl import linear_cross_entropy

    leaves = [t.detach().clone().requires_grad_() for t in (x, W) + (() if b is None else (b,))]
    loss = linear_cross_entropy(leaves[0], leaves[1], y, linear_bias=leaves[2] if b is not None else None, weight=cw,
                                weight_layout=layout, strategy=strategy, filter_eps=filter_eps, tuning=tuning, **opts)
    loss.backward(torch.as_tensor(g_out, dtype=loss.dtype, device=loss.device).expand(loss.shape))
    grads = [t.grad.double() for t in leaves]
    if layout == "DV":
        grads[1] = grads[1].T
    return grads


def speed_rows(vocab: int, dtype) -> int:
    from torch_impl import head

    rows = head.plan(SMALL_BLOCKS, "cross_entropy", "speed", N, D, vocab, dtype, False).block_rows
    assert rows < N, "several row blocks"
    return rows


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


OPTION_CASES = {
    "mean": (dict(), False, False),
    "none-classweights": (dict(reduction="none"), False, True),
    "sum-everything": (dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=12.0), True, True),
}


@pytest.mark.parametrize("gather_share", [0.0, 1.0])  # the dropped tiles zeroed in place / the kept ones gathered
@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1300, 2100])
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_filtered_speed_matches_simulated_rule(case, vocab, dtype, layout, gather_share):
    opts, bias, class_weights = OPTION_CASES[case]
    seed = seed_of(case, vocab, str(dtype), layout)
    x, W, y, b, cw = make_inputs(seed, vocab, dtype, layout, bias, class_weights)
    g_out = torch.rand(N, generator=torch.Generator().manual_seed(seed)) + 0.5 if opts.get("reduction") == "none" else 1.0
    W_VD = W if layout == "VD" else W.T
    block_rows = speed_rows(vocab, dtype)
    got = run(x, W, y, b, cw, layout, opts, "speed", 1e-3, g_out, dataclasses.replace(SMALL_BLOCKS, gather_share=gather_share))
    *want, keep = simulated_grads(x, W_VD, b, cw, y, opts, 1e-3, block_rows, g_out)
    assert 0 < keep.double().mean() < 0.5, "the problem should drop some tiles and keep others"
    exact = simulated_grads(x, W_VD, b, cw, y, opts, 0.0, block_rows, g_out)[:3]
    tol = tolerance(str(dtype).removeprefix("torch."), 3.0)  # logits up to ~9
    for name, g, w, e in zip(("grad_x", "grad_W", "grad_b"), got, want, exact):
        if dtype == torch.float32:  # bf16's rounding hides the dropped share: fp32 tells what is dropped
            assert rel(w, e) > 4 * tol, f"{name}: the dropped share should exceed the tolerance"
        assert rel(g, w) <= tol, f"{name}: {rel(g, w):.3g} from the filtered rule > {tol:.3g}"


@pytest.mark.parametrize("case", ["mean", "none-classweights"])
def test_filtered_speed_on_the_rows_not_ignored(case):
    """When only the rows not ignored are computed (torch_impl.functional.rows_to_compute),
    the rule applies to blocks of those rows; the ignored rows get a zero grad_input."""
    from torch_impl import head

    skipping = dataclasses.replace(SMALL_BLOCKS, skip_ignored_min_work=0)
    opts, bias, class_weights = OPTION_CASES[case]
    vocab, seed = 2100, seed_of("rows-not-ignored", case)
    x, W, y, b, cw = make_inputs(seed, vocab, torch.float32, "VD", bias, class_weights)
    g_out = torch.rand(N, generator=torch.Generator().manual_seed(seed)) + 0.5 if opts.get("reduction") == "none" else 1.0
    kept = y != -100
    block_rows = head.plan(skipping, "cross_entropy", "speed", int(kept.sum()), D, vocab, torch.float32, False).block_rows
    assert block_rows < kept.sum(), "several row blocks"
    got = run(x, W, y, b, cw, "VD", opts, "speed", 1e-3, g_out, skipping)
    g_kept = g_out[kept] if isinstance(g_out, torch.Tensor) else g_out
    *want, keep = simulated_grads(x[kept], W, b, cw, y[kept], opts, 1e-3, block_rows, g_kept)
    assert 0 < keep.double().mean() < 0.5
    tol = tolerance("float32", 3.0)
    assert rel(got[0][kept], want[0]) <= tol and not got[0][~kept].any()
    for g, w in zip(got[1:], want[1:]):
        assert rel(g, w) <= tol


@pytest.mark.parametrize("strategy", ["speed", "chunked"])
def test_filter_zero_keeps_every_entry_and_huge_keeps_only_targets(strategy):
    """filter_eps=0 keeps everything (entries equal to 0 aside); a huge one leaves the
    targets' terms only ("speed"); "chunked" computes every entry whatever filter_eps is."""
    x, W, y, b, cw = make_inputs(seed_of("extremes", strategy), 1300, torch.float32, "VD", False, False)
    exact = simulated_grads(x, W, b, cw, y, {}, 0.0, N, 1.0)[:2]
    only_targets = simulated_grads(x, W, b, cw, y, {}, 1e30, N, 1.0)[:2]
    tol = tolerance("float32")
    for filter_eps, want in ((0.0, exact), (1e30, only_targets if strategy == "speed" else exact)):
        got = run(x, W, y, b, cw, "VD", {}, strategy, filter_eps, 1.0)
        for g, w in zip(got, want):
            assert rel(g, w) <= tol


def test_memory_blocks_of_partial_rows_compute_every_entry():
    """"memory" with several column blocks per row does not filter (documented)."""
    x, W, y, b, cw = make_inputs(seed_of("memory"), 1300, torch.float32, "VD", False, False)
    exact = simulated_grads(x, W, b, cw, y, {}, 0.0, N, 1.0)[:2]
    for g, w in zip(run(x, W, y, b, cw, "VD", {}, "memory", 1e-3, 1.0), exact):
        assert rel(g, w) <= tolerance("float32")


@pytest.mark.cuda
@pytest.mark.parametrize("gather_share", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["mean", "sum-everything"])
def test_cuda_filtered_speed_matches_simulated_rule(case, dtype, gather_share):
    """The same rule on the GPU: 2048 rows in blocks of 512, V = 40000 (79 tiles), D = 96."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    n, d, vocab = 2048, 96, 40000
    tuning = dataclasses.replace(SMALL_BLOCKS, speed_block_elements=512 * vocab, gather_share=gather_share)
    opts, bias, class_weights = OPTION_CASES[case]
    x, W, y, b, cw = make_inputs(seed_of("cuda", case, str(dtype)), vocab, dtype, "VD", bias, class_weights, n, d, "cuda")
    got = run(x, W, y, b, cw, "VD", opts, "speed", 1e-3, 1.0, tuning)
    *want, keep = simulated_grads(x, W, b, cw, y, opts, 1e-3, 512, 1.0)
    assert 0 < keep.double().mean() < 0.5
    exact = simulated_grads(x, W, b, cw, y, opts, 0.0, 512, 1.0)[:3]
    tol = tolerance(str(dtype).removeprefix("torch."), 3.0)
    for name, g, w, e in zip(("grad_x", "grad_W", "grad_b"), got, want, exact):
        if dtype == torch.float32:
            assert rel(w, e) > 4 * tol, f"{name}: the dropped share should exceed the tolerance"
        assert rel(g, w) <= tol, f"{name}: {rel(g, w):.3g} from the filtered rule > {tol:.3g}"


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "auto", True])
def test_bad_filter_eps_is_refused(bad):
    with pytest.raises(ValueError, match="filter_eps"):
        check_filter_eps(bad)
