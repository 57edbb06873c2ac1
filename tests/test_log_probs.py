"""`linear_log_probs` in both frameworks against the float64 reference (itself checked against
float64 autograd): log-probabilities, entropy and argmax at a temperature, and the gradients
of any combination of log-probabilities and entropy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from interop.log_probs_reference import linear_log_probs_reference
from tests.frameworks import SMALL, laid_out, make_problem, materialised_policy, rel_err, seed_of, tolerance
from tests.frameworks import device as default_device

# name -> (options, make_problem arguments, which upstream gradients: "both", "log_probs", "entropy")
CASES = {
    "plain": (dict(), dict(), "both"),
    "T0.7-bias": (dict(temperature=0.7), dict(bias=True), "both"),
    "softcap-T2-3d": (dict(softcap=4.0, temperature=2.0), dict(lead=(2, 7), bias=True, logit_scale=3.0), "both"),
    "custom-ignore-logp-only": (dict(ignore_index=3), dict(ignore_index=3), "log_probs"),
    "entropy-only-hot": (dict(temperature=0.5), dict(logit_scale=4.0), "entropy"),
}
FRAMEWORKS = ["torch", "jax"]
STRATEGIES = ["speed", "memory", "chunked"]
# (framework, strategy) pairs; SMALL blocks make "memory" span several vocabulary blocks
RUNS = [("torch", s) for s in STRATEGIES] + [("jax", s) for s in STRATEGIES]


def _problem(case: str, dtype: str, layout: str = "VD", vocab: int = 53, lead=None):
    options, kwargs, which = CASES[case]
    kwargs = {"lead": lead, **kwargs} if lead else kwargs  # the rows' shape where the case sets none
    seed = seed_of("log-probs", case, dtype, layout)
    p = make_problem(seed, dtype=dtype, weight_layout=layout, vocab=vocab, **kwargs)
    rng = np.random.default_rng(seed + 1)
    g_lp = rng.standard_normal(p.y.shape) if which in ("both", "log_probs") else None
    g_H = rng.standard_normal(p.y.shape) if which in ("both", "entropy") else None
    return p, options, g_lp, g_H


def _reference(p, options, g_lp, g_H):
    return linear_log_probs_reference(p.x, p.W, p.y, linear_bias=p.b, weight_layout=p.weight_layout,
                                      grad_log_probs=g_lp, grad_entropy=g_H, **options)


def run_torch(p, options, g_lp, g_H, device=None, layouts=None, strategy="auto"):
    """{"log_probs", "entropy", "argmax", "grad_x", "grad_W", "grad_b"} as numpy."""
    import torch_impl
    from torch_impl.steps import kernels_can_run

    device = device or default_device()  # CUDA where there is a GPU
    # the kernel strategies run their kernels (Triton's interpreter off a GPU), not the fallback
    assert strategy not in ("speed", "memory") or kernels_can_run(torch.zeros(1, device=device))

    dtype = getattr(torch, p.dtype)
    lay = lambda k, t: t if not layouts or k not in layouts else laid_out(t, layouts[k])
    x = lay("x", torch.tensor(p.x, device=device).to(dtype)).requires_grad_()
    W = lay("W", torch.tensor(p.W, device=device).to(dtype)).requires_grad_()
    b = None if p.b is None else lay("b", torch.tensor(p.b, device=device).to(dtype)).requires_grad_()
    y = lay("y", torch.tensor(p.y, device=device))
    lp, H, am = torch_impl.linear_log_probs(x, W, y, linear_bias=b, weight_layout=p.weight_layout, return_entropy=True,
                                            return_argmax=True, strategy=strategy, tuning=SMALL, **options)
    outs, grads = [], []
    for out, g in ((lp, g_lp), (H, g_H)):
        if g is not None:
            outs.append(out)
            grads.append(torch.tensor(g, dtype=out.dtype, device=device))
    leaves = [t for t in (x, W, b) if t is not None]
    got = dict(zip(("grad_x", "grad_W", "grad_b"), torch.autograd.grad(outs, leaves, grads)))
    got.update(log_probs=lp, entropy=H, argmax=am)
    assert am.dtype == torch.int64 and lp.dtype == H.dtype == (torch.float64 if p.dtype == "float64" else torch.float32)
    return {k: v.detach().cpu().numpy() if k == "argmax" else v.detach().double().cpu().numpy() for k, v in got.items()}


def run_jax(p, options, g_lp, g_H, strategy="auto", tuning=SMALL):
    import jax
    import jax.numpy as jnp

    import jax_impl

    from jax_impl.kernels import kernels_can_run

    assert strategy not in ("speed", "memory") or kernels_can_run(jax.default_backend())
    dtype = getattr(jnp, p.dtype)
    args = [jnp.asarray(p.x, dtype), jnp.asarray(p.W, dtype)] + ([] if p.b is None else [jnp.asarray(p.b, dtype)])

    def f(x, W, b=None):
        return jax_impl.linear_log_probs(x, W, jnp.asarray(p.y.astype(np.int32)), linear_bias=b,
                                         weight_layout=p.weight_layout, return_entropy=True, return_argmax=True,
                                         strategy=strategy, tuning=tuning, **options)

    (lp, H, am), vjp = jax.vjp(f, *args)
    zeros = np.zeros(p.y.shape)
    grads = vjp((jnp.asarray(zeros if g_lp is None else g_lp, lp.dtype), jnp.asarray(zeros if g_H is None else g_H, H.dtype),
                 np.zeros(am.shape, jax.dtypes.float0)))
    got = dict(zip(("grad_x", "grad_W", "grad_b"), grads))
    got.update(log_probs=lp, entropy=H)
    out = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in got.items()}
    assert am.dtype == jnp.int32
    out["argmax"] = np.asarray(am)
    return out


def check(got: dict, ref, dtype: str, logit_scale: float, where: str) -> None:
    tol = tolerance(dtype, logit_scale)
    for key, want in (("log_probs", ref.log_probs), ("entropy", ref.entropy), ("grad_x", ref.grad_input),
                      ("grad_W", ref.grad_weight), ("grad_b", ref.grad_bias)):
        if want is not None:
            err = rel_err(got[key], want)
            assert err <= tol, f"{where}, {key}: relative error {err:.3g} > {tol:.3g}"
    if dtype in ("float32", "float64"):  # 16-bit logits may round a near-tie either way
        assert (got["argmax"] == ref.argmax).all(), where


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_float64_autograd(case):
    """The reference's outputs and gradients equal float64 autograd of the naive formula."""
    p, options, g_lp, g_H = _problem(case, "float64")
    ref = _reference(p, options, g_lp, g_H)
    leaves, u, lp, H, _ = materialised_policy(p, options)
    total = sum((out * torch.tensor(g)).sum() for out, g in ((lp, g_lp), (H, g_H)) if g is not None)
    grads = torch.autograd.grad(total, leaves)
    np.testing.assert_allclose(ref.log_probs, lp.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.entropy, H.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert (ref.argmax == u.argmax(-1).numpy()).all()
    for got, want in zip((ref.grad_input, ref.grad_weight, ref.grad_bias), grads):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)


def run(framework: str, strategy: str, p, options, g_lp, g_H, device=None):
    if framework == "torch":
        return run_torch(p, options, g_lp, g_H, device, strategy=strategy)
    return run_jax(p, options, g_lp, g_H, strategy)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("framework, strategy", RUNS)
def test_matches_reference(framework, strategy, case, dtype):
    p, options, g_lp, g_H = _problem(case, dtype)
    got = run(framework, strategy, p, options, g_lp, g_H)
    check(got, _reference(p, options, g_lp, g_H), dtype, p.logit_scale, f"{framework}, {strategy}, {case}, {dtype}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_float64_matches_reference(case):
    """fp64 inputs (PyTorch; JAX computes fp64 only with jax_enable_x64) run "chunked" in fp64."""
    p, options, g_lp, g_H = _problem(case, "float64")
    check(run_torch(p, options, g_lp, g_H, strategy="speed"), _reference(p, options, g_lp, g_H), "float64", 1.0, case)


@pytest.mark.parametrize("framework, strategy", RUNS)
def test_dv_layout(framework, strategy):
    p, options, g_lp, g_H = _problem("T0.7-bias", "float32", "DV")
    check(run(framework, strategy, p, options, g_lp, g_H), _reference(p, options, g_lp, g_H), "float32", 1.0,
          f"{framework}, {strategy}, DV")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layouts", [dict(x="transposed", W="offset", b="expanded", y="strided"),
                                     dict(x="column", W="transposed", b="strided", y="offset")])
def test_views_give_what_their_copies_give(layouts, strategy):
    p, options, g_lp, g_H = _problem("T0.7-bias", "float32")
    got = run_torch(p, options, g_lp, g_H, layouts=layouts, strategy=strategy)
    if layouts.get("b") == "expanded":  # an expanded bias holds its first entry everywhere
        p.b = np.full_like(p.b, p.b[0])
    check(got, _reference(p, options, g_lp, g_H), "float32", 1.0, str(layouts))


@pytest.mark.parametrize("framework, strategy", RUNS)
def test_nan_in_the_head_and_a_masking_bias(framework, strategy):
    """A NaN in one class of the head makes every row's log-probability and entropy NaN
    (ignored rows keep a log-probability of 0); a bias of -inf on some classes (masked
    tokens) leaves everything finite and equal to the reference."""
    p, options, g_lp, g_H = _problem("T0.7-bias", "float32")
    p.b[[4, 17, 30]] = -np.inf
    p.y[0] = 17  # a target on a masked class: log-probability -inf, finite gradients
    got = run(framework, strategy, p, options, g_lp, g_H)
    ref = _reference(p, options, g_lp, g_H)
    masked = np.isin(p.y, [4, 17, 30])
    assert masked[0] and (got["log_probs"][masked] == -np.inf).all() and np.isfinite(got["log_probs"][~masked]).all()
    assert np.isfinite(got["entropy"]).all() and np.isfinite(got["grad_W"]).all() and np.isfinite(got["grad_x"]).all()
    got["log_probs"][masked] = ref.log_probs[masked] = 0  # (rel_err of -inf against -inf is NaN)
    check(got, ref, "float32", 1.0, "masking bias")
    assert not np.isin(got["argmax"], [4, 17, 30]).any()
    W = p.W.copy()
    W[9, 2] = np.nan
    p.W = W
    got = run(framework, strategy, p, options, g_lp, g_H)
    valid = p.y != -100
    assert np.isnan(got["log_probs"][valid]).all() and (got["log_probs"][~valid] == 0).all()
    assert np.isnan(got["entropy"]).all() and (got["argmax"] == 9).all()  # a NaN counts as the largest


@pytest.mark.parametrize("framework, strategy", RUNS)
def test_argmax_takes_the_first_of_equal_maxima(framework, strategy):
    """Classes 3, 20 and 40 share one row of the head (in different column blocks of the
    "memory" plan) and a bias that makes them the largest: every row's argmax is 3."""
    p, options, g_lp, g_H = _problem("T0.7-bias", "float32")
    W = p.W.copy()
    W[20] = W[40] = W[3]
    p.W, p.b = W, np.zeros_like(p.b)
    p.b[[3, 20, 40]] = 50.0
    assert (run(framework, strategy, p, options, g_lp, g_H)["argmax"] == 3).all()


def test_return_flags_and_arguments():
    import torch_impl

    p, _, _, _ = _problem("plain", "float32")
    x, W, y = torch.tensor(p.x), torch.tensor(p.W), torch.tensor(p.y)
    lp = torch_impl.linear_log_probs(x, W, y)
    assert lp.shape == y.shape
    lp2, am = torch_impl.linear_log_probs(x, W, y, return_argmax=True)
    assert torch.equal(lp, lp2) and am.shape == y.shape
    for kwargs, match in ((dict(strategy="fast"), "strategy"), (dict(temperature=0.0), "temperature"),
                          (dict(softcap=-1.0), "softcap"), (dict(weight_layout="DV"), "D=")):
        with pytest.raises(ValueError, match=match):
            torch_impl.linear_log_probs(x, W, y, **kwargs)
    bad = y.clone()
    bad[3] = p.vocab
    with pytest.raises(ValueError, match="target"):
        torch_impl.linear_log_probs(x, W, bad)
    with pytest.raises(TypeError, match="linear_bias"):
        torch_impl.linear_log_probs(x, W, y, linear_bias=[0.0])


def test_jax_target_out_of_range_raises_eagerly_and_gives_nan_under_jit():
    import jax
    import jax.numpy as jnp

    import jax_impl

    p, _, _, _ = _problem("plain", "float32")
    y = p.y.astype(np.int32)
    y[3] = p.vocab
    with pytest.raises(ValueError, match="target"):
        jax_impl.linear_log_probs(jnp.asarray(p.x), jnp.asarray(p.W), jnp.asarray(y))
    lp = jax.jit(jax_impl.linear_log_probs)(jnp.asarray(p.x), jnp.asarray(p.W), jnp.asarray(y))
    assert np.isnan(np.asarray(lp)[3]) and np.isfinite(np.delete(np.asarray(lp), 3)).all()


@pytest.mark.cuda
@pytest.mark.parametrize("framework, strategy", RUNS)
def test_on_the_gpu(framework, strategy):
    """Every case, bf16 and fp32, on the GPU (PyTorch on CUDA, JAX on its default GPU), the
    "DV" layout and a masking bias."""
    for case in CASES:
        for dtype in ("bfloat16", "float32"):
            p, options, g_lp, g_H = _problem(case, dtype)
            got = run(framework, strategy, p, options, g_lp, g_H, "cuda")
            check(got, _reference(p, options, g_lp, g_H), dtype, p.logit_scale, f"{framework}, {strategy}, {case}, {dtype}")
    p, options, g_lp, g_H = _problem("T0.7-bias", "float32", "DV")
    p.b[[4, 17, 30]] = -np.inf
    check(run(framework, strategy, p, options, g_lp, g_H, "cuda"), _reference(p, options, g_lp, g_H), "float32", 1.0, "DV")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_grpo_and_dpo_recipes_match_the_materialised_formulas(framework):
    """examples/rl_losses_{torch,jax}.py: GRPO (clipped ratio, KL to a reference, entropy
    bonus, at a temperature) and DPO on fused log-probabilities equal the same formulas on
    materialised logits, losses and gradients (fp32)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                        f"rl_losses_{framework}.py")
    spec = importlib.util.spec_from_file_location(f"rl_losses_{framework}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, diff in module.differences().items():
        assert diff <= 1e-5, (name, diff)


def test_same_arguments_and_defaults_in_both_frameworks():
    import inspect

    import jax_impl
    import torch_impl

    # sequence_parallel is PyTorch's (JAX splits rows by the operands' shardings)
    params = lambda f: [(p.name, p.default) for p in inspect.signature(f).parameters.values()
                        if p.name != "sequence_parallel"]
    assert params(torch_impl.linear_log_probs) == params(jax_impl.linear_log_probs)


def test_jax_memory_blocks_are_sized_for_xla():
    """JAX "memory" takes cross-entropy's rows x columns blocks: XLA's, sized for what XLA
    holds beyond the gradients (interop.blocking.xla_memory_block_shape; 1.10x the floor at
    RL on an H200, where the distillation losses' blocks hold 1.21x), or `row_products`'
    where their estimate is less (Llama-3.2-1B's head: XLA's blocks would hold 384 rows,
    the kernels' 2816). A head too small for either (XLA's GEMM workspace alone over the
    budget) keeps the distillation blocks."""
    import jax.numpy as jnp

    from interop import blocking
    from interop.log_probs import LogProbsOptions
    from interop.tuning import DEFAULT
    from jax_impl.distill_rules import plan_steps

    o = LogProbsOptions()
    for n, d, v in ((32768, 4096, 151936), (16384, 4096, 128256)):
        cfg = plan_steps(DEFAULT, "log_probs", o, "VD", "memory", n, d, v, jnp.bfloat16, False, "gpu")
        assert (cfg.block_rows, cfg.block_cols) == blocking.xla_memory_block_shape(DEFAULT, n, d, v, 2)
        assert cfg.block_cols < v and cfg.strategy == "memory" and not cfg.kernel_products
        speed = plan_steps(DEFAULT, "log_probs", o, "VD", "speed", n, d, v, jnp.bfloat16, False, "gpu")
        assert speed == plan_steps(DEFAULT, "distillation", o, "VD", "speed", n, d, v, jnp.bfloat16, False, "gpu")
    cfg = plan_steps(DEFAULT, "log_probs", o, "VD", "memory", 16384, 2048, 128256, jnp.bfloat16, False, "gpu")
    assert (cfg.block_rows, cfg.block_cols, cfg.kernel_products) == (2816, 2048, True)
    small = (1000, 257, 5003)
    assert not blocking.xla_memory_blocks_fit(DEFAULT, *small, 2)
    assert plan_steps(DEFAULT, "log_probs", o, "VD", "memory", *small, jnp.bfloat16, False, "gpu") == plan_steps(
        DEFAULT, "distillation", o, "VD", "memory", *small, jnp.bfloat16, False, "gpu")


# SMALL with room for XLA's blocks: JAX "memory" at 13 x 19 x 53 in blocks of 4 rows x 8 columns
XLA_BLOCKS = dataclasses.replace(SMALL, xla_blocks_fraction=0.5, xla_blocks_row_bytes=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_jax_memory_in_xla_blocks_matches_reference(case):
    """JAX "memory" in XLA's rows x columns blocks (several of each, the last ones partial)
    against the float64 reference, bf16 and fp32."""
    import jax.numpy as jnp

    from interop.log_probs import LogProbsOptions
    from jax_impl.distill_rules import plan_steps

    for dtype in ("bfloat16", "float32"):
        p, options, g_lp, g_H = _problem(case, dtype)
        cfg = plan_steps(XLA_BLOCKS, "log_probs", LogProbsOptions(), "VD", "memory", p.y.size, p.x.shape[-1], p.vocab,
                         jnp.dtype(dtype), False, "gpu")
        assert (cfg.block_rows, cfg.block_cols) == (4, 8), (cfg.block_rows, cfg.block_cols)
        got = run_jax(p, options, g_lp, g_H, "memory", XLA_BLOCKS)
        check(got, _reference(p, options, g_lp, g_H), dtype, p.logit_scale, f"{case}, {dtype}")


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_jax_memory_in_kernel_blocks_matches_reference(case, layout):
    """JAX "memory" in blocks of 4 rows x 8 columns through `row_products`' kernels (XLA's
    GEMM workspace counted as 1 TiB, the budget 4.5 rows of the kernels' blocks), the last
    ones partial, against the float64 reference, bf16 and fp32, W [V, D] and [D, V]."""
    import jax.numpy as jnp

    from interop.log_probs import LogProbsOptions
    from jax_impl.distill_rules import plan_steps

    for dtype in ("bfloat16", "float32"):
        p, options, g_lp, g_H = _problem(case, dtype, layout)
        n, d, v, itemsize = p.y.size, p.x.shape[-1], p.vocab, jnp.dtype(dtype).itemsize
        row_bytes = 8 * itemsize + d * (4 + itemsize)  # logits, fp32 grad_input accumulator, x
        t = dataclasses.replace(SMALL, xla_gemm_workspace=1 << 40,
                                whole_row_fraction=4.5 * row_bytes / ((n + v) * d * itemsize))
        cfg = plan_steps(t, "log_probs", LogProbsOptions(), layout, "memory", n, d, v, jnp.dtype(dtype), False, "gpu")
        assert (cfg.block_rows, cfg.block_cols, cfg.kernel_products) == (4, 8, True)
        got = run_jax(p, options, g_lp, g_H, "memory", t)
        check(got, _reference(p, options, g_lp, g_H), dtype, p.logit_scale, f"{case}, {dtype}")


@pytest.mark.parametrize("backward", ["memory", "speed"])
def test_auto_chooses_again_in_the_backward_pass(monkeypatch, backward):
    """An "auto" call allocates its gradient buffers in the backward pass, so it chooses its
    strategy again there, from the memory free then: a forward pass planned as "speed" and a
    backward as `backward` (the kernels; Triton's interpreter off a GPU) give the float64
    reference's values and gradients. A set strategy is planned once."""
    import torch_impl.engine as engine
    import torch_impl.log_probs as tlp
    from torch_impl.steps import kernels_can_run

    if not kernels_can_run(torch.zeros(1, device=default_device())):
        pytest.skip("the kernels can't run here")
    chosen, planned = iter(["speed", backward]), []
    monkeypatch.setattr(engine, "free_bytes", lambda x: 0)  # no logits kept: the backward pass recomputes
    monkeypatch.setattr(tlp, "choose_strategy", lambda strategy, *a: next(chosen) if strategy == "auto" else strategy)
    original = tlp.plan_steps
    monkeypatch.setattr(tlp, "plan_steps", lambda t, loss, s, *a, **k: planned.append(s) or original(t, loss, s, *a, **k))
    p, options, g_lp, g_H = _problem("T0.7-bias", "float32")
    check(run_torch(p, options, g_lp, g_H, strategy="auto"), _reference(p, options, g_lp, g_H), "float32",
          p.logit_scale, f"speed, then {backward}")
    assert planned == ["speed", backward], planned
    planned.clear()
    run_torch(p, options, g_lp, g_H, strategy="memory")
    assert planned == ["memory"], planned


@pytest.mark.cuda
def test_auto_is_speed_where_it_fits_in_pytorch(monkeypatch):
    """PyTorch's "auto" is "speed" where its blocks fit a quarter of the free memory, eager
    and compiled, as JAX's: at TRL's GRPO head (8184 x 2048 x 128256, H100) "memory"'s tiles
    took 55.4 ms against 31.4. Where they don't fit, "memory"."""
    import torch_impl
    import torch_impl.log_probs
    import torch_impl.steps

    planned = []
    for module in (torch_impl.log_probs, torch_impl.custom_ops):
        original = module.plan_steps

        def spy(t, loss, strategy, *args, original=original, **kwargs):
            planned.append(strategy)
            return original(t, loss, strategy, *args, **kwargs)

        monkeypatch.setattr(module, "plan_steps", spy)
    x = torch.randn(64, 32, device="cuda", requires_grad=True)
    W = torch.randn(1000, 32, device="cuda", requires_grad=True)
    y = torch.randint(0, 1000, (64,), device="cuda")
    compiled = torch.compile(lambda *a: torch_impl.linear_log_probs(*a), fullgraph=True, backend="aot_eager")
    torch_impl.linear_log_probs(x, W, y).sum().backward()
    compiled(x, W, y).sum().backward()
    assert planned and set(planned) == {"speed"}, planned
    planned.clear()
    monkeypatch.setattr(torch_impl.steps, "speed_extra_bytes", lambda *a: float("inf"))
    torch_impl.linear_log_probs(x, W, y).sum().backward()
    assert planned == ["memory", "memory"], planned  # the forward pass's choice, then the backward's


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_speed_keeps_the_logits_for_the_backward_pass_where_they_fit(monkeypatch, dtype):
    """Where "speed"'s logits take at most Tuning.keep_logits_share of the free memory, JAX's
    forward pass returns them as a residual and the backward pass turns them into dz in
    place (`jax_impl.engine.backward_kept`): the float64 reference's outputs and gradients
    in every case, where "speed" takes row blocks of 4 (SMALL) and one block. A kept call is
    one block of every row in both passes (the product writes the kept array; dz is written
    over it in one pass). Share 0, "memory" and a call that nothing differentiates keep
    nothing."""
    import jax
    import jax.numpy as jnp

    import jax_impl
    import jax_impl.engine as engine
    from jax_impl import partitioned
    from jax_impl.log_probs_rule import _LogProbsRule

    # the spies see traces: none cached by earlier calls (on a GPU those keep their logits too)
    jax.clear_caches()
    partitioned._with_vmap.cache_clear()
    kept, spent = [], []
    forward, backward = engine.forward, engine.backward_kept
    monkeypatch.setattr(engine, "forward", lambda *a, **k: kept.append(k.get("keep_logits")) or forward(*a, **k))
    monkeypatch.setattr(engine, "backward_kept", lambda *a, **k: spent.append(a[3].shape) or backward(*a, **k))
    monkeypatch.setattr(engine, "free_bytes", lambda platform: 1 << 40)
    blocks = []  # the logits blocks the rule's steps see
    for step in ("stats", "grad"):
        original = getattr(_LogProbsRule, step)
        monkeypatch.setattr(_LogProbsRule, step, lambda self, z, *a, _f=original: blocks.append(z.shape) or _f(self, z, *a))
    for tuning in (SMALL, dataclasses.replace(SMALL, speed_block_elements=1 << 20)):
        for case in sorted(CASES):
            p, options, g_lp, g_H = _problem(case, dtype)
            spent.clear()
            blocks.clear()
            got = run_jax(p, options, g_lp, g_H, strategy="speed", tuning=tuning)
            assert spent == [(p.y.size, p.W.shape[0])], (case, spent)
            assert set(blocks) == {(p.y.size, p.W.shape[0])}, (case, blocks)
            check(got, _reference(p, options, g_lp, g_H), dtype, CASES[case][1].get("logit_scale", 1.0), case)
    p, options, g_lp, g_H = _problem("plain", dtype)
    spent.clear()
    run_jax(p, options, g_lp, g_H, strategy="speed", tuning=dataclasses.replace(SMALL, keep_logits_share=0.0))
    run_jax(p, options, g_lp, g_H, strategy="memory")
    kept.clear()
    x, W = jnp.asarray(p.x, getattr(jnp, dtype)), jnp.asarray(p.W, getattr(jnp, dtype))
    jax.jit(lambda x, W: jax_impl.linear_log_probs(x, W, jnp.asarray(p.y.astype(np.int32)), strategy="speed",
                                                   tuning=SMALL))(x, W)
    assert spent == [] and not any(kept), (spent, kept)

