"""The float64 numpy reference (interop/reference.py) against float64 autograd of the naive formula.

Every output of `linear_cross_entropy_reference` (loss, lse, grad_input, grad_weight,
grad_bias) is compared with:

* PyTorch: the spec's formula written directly on materialised float64 logits, its
  gradients from `torch.autograd.grad`; and, wherever PyTorch has the option (z_loss = 0;
  softcap is applied to the logits before the call), `torch.nn.functional.cross_entropy`
  itself, which pins PyTorch's semantics (weighted-mean denominator, label smoothing with
  class weights, ignore_index).
* JAX: the same formula in `jax.numpy` under float64, gradients from `jax.vjp`.

Upstream gradients are random: a scalar for "sum"/"mean", a per-row array for "none", and
optionally a random per-row gradient of the returned lse.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import zlib

import numpy as np
import pytest

from interop.reference import linear_cross_entropy_reference

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RTOL, ATOL = 1e-9, 1e-12
D, V = 7, 37  # odd sizes
SHAPES = {"2d": (13,), "3d": (2, 5)}  # input's leading dims: [13, D] or [2, 5, D]
SOFTCAP = 5.0


# ----------------------------------------------------------------------------- problems


@dataclasses.dataclass(frozen=True)
class Case:
    reduction: str = "mean"
    class_weights: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    ignore: str = "none"  # "none": no ignored rows; "-100": ignore_index=-100; "3": ignore_index=3 (a real class)
    bias: bool = False
    layout: str = "VD"
    shape: str = "2d"

    @property
    def ignore_index(self) -> int:
        return 3 if self.ignore == "3" else -100

    def id(self) -> str:
        return (
            f"{self.reduction}-cw{int(self.class_weights)}-eps{self.label_smoothing}-zl{self.z_loss}"
            f"-cap{self.softcap}-ign{self.ignore}-b{int(self.bias)}-{self.layout}-{self.shape}"
        )


@dataclasses.dataclass
class Problem:
    x: np.ndarray  # [..., D]
    w: np.ndarray  # [V, D] or [D, V]
    y: np.ndarray  # [...] int64
    b: np.ndarray | None  # [V]
    cw: np.ndarray | None  # [V]
    g: np.ndarray  # upstream gradient of the loss: scalar (0-d) or [...]
    g_lse: np.ndarray  # upstream gradient of lse: [...]


def make_problem(case: Case, seed: int, *, lead=None, scale: float = 4.0) -> Problem:
    """Fresh random float64 inputs; logits z have standard deviation ~scale (so |z| > softcap)."""
    rng = np.random.default_rng(seed)
    lead = SHAPES[case.shape] if lead is None else lead
    n = math.prod(lead)
    x = rng.standard_normal((*lead, D)) * scale
    w_vd = rng.standard_normal((V, D)) / math.sqrt(D)
    b = rng.standard_normal(V) * 0.5 if case.bias else None
    cw = rng.uniform(0.2, 2.0, V) if case.class_weights else None
    y = rng.integers(0, V, n)
    if case.ignore != "none" and n >= 2:
        ignored = rng.random(n) < 0.35
        ignored[0], ignored[1] = True, False  # at least one ignored and one valid row
        y[ignored] = case.ignore_index
        if case.ignore == "3":
            y[~ignored & (y == 3)] = 4  # target 3 means "ignored" only
    g = rng.standard_normal(lead) if case.reduction == "none" else np.asarray(rng.uniform(0.5, 2.0))
    g_lse = rng.standard_normal(lead)
    w = w_vd if case.layout == "VD" else np.ascontiguousarray(w_vd.T)
    return Problem(x=x, w=w, y=y.reshape(lead), b=b, cw=cw, g=g, g_lse=g_lse)


def run_reference(case: Case, p: Problem, *, use_g_lse: bool, **overrides):
    kwargs = dict(
        linear_bias=p.b,
        weight=p.cw,
        reduction=case.reduction,
        ignore_index=case.ignore_index,
        label_smoothing=case.label_smoothing,
        z_loss=case.z_loss,
        softcap=case.softcap,
        weight_layout=case.layout,
        grad_output=p.g,
        grad_lse=p.g_lse if use_g_lse else None,
    )
    kwargs.update(overrides)
    return linear_cross_entropy_reference(p.x, p.w, p.y, **kwargs)


def assert_close(actual, expected, name):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != expected {expected.shape}"
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL, err_msg=name)


def assert_matches(ref, expected: dict):
    """expected: loss, lse, grad_input, grad_weight, grad_bias (None when there is no bias)."""
    assert_close(ref.loss, expected["loss"], "loss")
    assert_close(ref.lse, expected["lse"], "lse")
    assert_close(ref.grad_input, expected["grad_input"], "grad_input")
    assert_close(ref.grad_weight, expected["grad_weight"], "grad_weight")
    if expected["grad_bias"] is None:
        assert ref.grad_bias is None, "grad_bias must be None without a bias"
    else:
        assert ref.grad_bias is not None, "grad_bias missing"
        assert_close(ref.grad_bias, expected["grad_bias"], "grad_bias")


# ----------------------------------------------------------------------------- naive PyTorch


def torch_logits(x, w, b, *, softcap, layout):
    """x [..., D] -> soft-capped logits s [N, V] (float64)."""
    x_nd = x.reshape(-1, x.shape[-1])
    w_vd = w if layout == "VD" else w.T
    z = x_nd @ w_vd.T
    if b is not None:
        z = z + b
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def torch_naive_loss(s, y, cw, *, reduction, ignore_index, eps, zl, lead):
    """The spec's loss written directly on the soft-capped logits s [N, V]; returns (loss, lse)."""
    vocab = s.shape[1]
    lse = torch.logsumexp(s, dim=-1)
    y = y.reshape(-1)
    valid = y != ignore_index
    in_range = (y >= 0) & (y < vocab)
    safe_y = torch.where(in_range, y, torch.zeros_like(y))
    cw = torch.ones(vocab, dtype=torch.float64) if cw is None else cw
    cw_y = cw[safe_y]
    s_y = s.gather(1, safe_y[:, None])[:, 0]
    nll = cw_y * (lse - s_y)
    smooth = (cw[None, :] * (lse[:, None] - s)).sum(dim=1) / vocab
    row = (1 - eps) * nll + eps * smooth + zl * lse**2
    # a valid target outside [0, V): NaN loss, and NaN gradients through this row
    row = row * torch.where(valid & ~in_range, torch.tensor(math.nan, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    row = torch.where(valid, row, torch.zeros((), dtype=torch.float64))
    if reduction == "none":
        loss = row.reshape(lead)
    elif reduction == "sum":
        loss = row.sum()
    else:
        loss = row.sum() / torch.where(valid, cw_y, torch.zeros((), dtype=torch.float64)).sum()
    return loss, lse.reshape(lead)


def _formula_options(case: Case) -> dict:
    """The case's options as the naive formulas (torch's and JAX's) take them."""
    return dict(reduction=case.reduction, ignore_index=case.ignore_index, eps=case.label_smoothing, zl=case.z_loss,
                softcap=case.softcap, layout=case.layout)


def torch_expected(case: Case, p: Problem, *, use_g_lse: bool, via: str = "naive"):
    """Loss, lse and gradients from torch autograd; via="naive" (the spec) or "F" (F.cross_entropy)."""
    opts = _formula_options(case)
    lead = p.x.shape[:-1]
    x = torch.tensor(p.x, requires_grad=True)
    w = torch.tensor(p.w, requires_grad=True)
    b = None if p.b is None else torch.tensor(p.b, requires_grad=True)
    y = torch.tensor(p.y, dtype=torch.int64)
    cw = None if p.cw is None else torch.tensor(p.cw)
    s = torch_logits(x, w, b, softcap=opts["softcap"], layout=opts["layout"])
    if via == "naive":
        loss, lse = torch_naive_loss(
            s, y, cw, reduction=opts["reduction"], ignore_index=opts["ignore_index"], eps=opts["eps"], zl=opts["zl"], lead=lead
        )
    else:
        assert opts["zl"] == 0.0, "F.cross_entropy has no z_loss"
        loss = F.cross_entropy(
            s,
            y.reshape(-1),
            weight=cw,
            reduction=opts["reduction"],
            ignore_index=opts["ignore_index"],
            label_smoothing=opts["eps"],
        )
        if opts["reduction"] == "none":
            loss = loss.reshape(lead)
        lse = torch.logsumexp(s, dim=-1).reshape(lead)
    inputs = [x, w] + ([] if b is None else [b])
    outputs, grad_outputs = [loss], [torch.tensor(p.g)]
    if use_g_lse:
        outputs.append(lse)
        grad_outputs.append(torch.tensor(p.g_lse))
    grads = torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(inputs, grads)]
    return dict(
        loss=loss.detach().numpy(),
        lse=lse.detach().numpy(),
        grad_input=grads[0].numpy(),
        grad_weight=grads[1].numpy(),
        grad_bias=None if b is None else grads[2].numpy(),
    )


# ----------------------------------------------------------------------------- naive JAX


def jax_naive(x, w, b, y, cw, *, reduction, ignore_index, eps, zl, softcap, capped, layout):
    """The spec in jax.numpy (call under float64); returns (loss, lse).

    softcap applies where the (traced) boolean capped is true."""
    lead = x.shape[:-1]
    x_nd = x.reshape(-1, x.shape[-1])
    w_vd = w if layout == "VD" else w.T
    vocab = w_vd.shape[0]
    z = x_nd @ w_vd.T
    if b is not None:
        z = z + b
    s = jnp.where(capped, softcap * jnp.tanh(z / softcap), z)
    lse = jax.nn.logsumexp(s, axis=-1)
    y = y.reshape(-1)
    valid = y != ignore_index
    in_range = (y >= 0) & (y < vocab)
    safe_y = jnp.where(in_range, y, 0)
    cw = jnp.ones(vocab, jnp.float64) if cw is None else cw
    cw_y = cw[safe_y]
    s_y = jnp.take_along_axis(s, safe_y[:, None], axis=1)[:, 0]
    nll = cw_y * (lse - s_y)
    smooth = jnp.sum(cw[None, :] * (lse[:, None] - s), axis=1) / vocab
    row = (1 - eps) * nll + eps * smooth + zl * lse**2
    row = row * jnp.where(valid & ~in_range, jnp.nan, 1.0)
    row = jnp.where(valid, row, 0.0)
    if reduction == "none":
        loss = row.reshape(lead)
    elif reduction == "sum":
        loss = jnp.sum(row)
    else:
        loss = jnp.sum(row) / jnp.sum(jnp.where(valid, cw_y, 0.0))
    return loss, lse.reshape(lead)


# LLVM optimisation off: compiling drops from ~0.8 s to ~0.3 s; these graphs are tiny.
_JIT_FAST_COMPILE = (
    {"compiler_options": {"xla_backend_optimization_level": 0}}
    if "compiler_options" in inspect.signature(jax.jit).parameters
    else {}
)


@functools.partial(jax.jit, static_argnames=("reduction", "layout"), **_JIT_FAST_COMPILE)
def _jax_vjp(x, w, b, y, cw, g, g_lse, eps, zl, ignore_index, softcap, capped, *, reduction, layout):
    """(loss, lse) of the naive formula and their VJP with (g, g_lse). The options are traced
    arguments (only reduction and layout are static), so that one compilation serves many
    cases: eager JAX costs ~30 ms a case in Python dispatch, a compilation ~0.5 s."""

    def f(x, w, b):
        return jax_naive(
            x, w, b, y, cw, reduction=reduction, ignore_index=ignore_index, eps=eps, zl=zl,
            softcap=softcap, capped=capped, layout=layout,
        )

    (loss, lse), vjp_fn = jax.vjp(f, x, w, b)
    return (loss, lse, *vjp_fn((g, g_lse)))


def jax_expected(case: Case, p: Problem, *, use_g_lse: bool):
    """Loss, lse and gradients from jax.vjp of the naive formula, in float64.

    A missing bias is a zero bias (its gradient discarded) and missing class weights are
    ones: the same function, and fewer compilations.
    """
    opts = _formula_options(case)
    vocab = p.w.shape[0] if opts["layout"] == "VD" else p.w.shape[1]
    f64 = jnp.float64
    with jax.enable_x64(True):
        loss, lse, gx, gw, gb = _jax_vjp(
            jnp.asarray(p.x, f64),
            jnp.asarray(p.w, f64),
            jnp.asarray(np.zeros(vocab) if p.b is None else p.b, f64),
            jnp.asarray(p.y, jnp.int64),
            jnp.asarray(np.ones(vocab) if p.cw is None else p.cw, f64),
            jnp.asarray(p.g, f64),
            jnp.asarray(p.g_lse if use_g_lse else np.zeros(p.g_lse.shape), f64),
            jnp.asarray(opts["eps"], f64),
            jnp.asarray(opts["zl"], f64),
            jnp.asarray(opts["ignore_index"], jnp.int64),
            jnp.asarray(1.0 if opts["softcap"] is None else opts["softcap"], f64),
            jnp.asarray(opts["softcap"] is not None),
            reduction=opts["reduction"],
            layout=opts["layout"],
        )
        assert loss.dtype == f64 and lse.dtype == f64 and gx.dtype == f64, "JAX is not running in float64"
        return dict(
            loss=np.asarray(loss),
            lse=np.asarray(lse),
            grad_input=np.asarray(gx),
            grad_weight=np.asarray(gw),
            grad_bias=None if p.b is None else np.asarray(gb),
        )


# ----------------------------------------------------------------------------- parametrisation


@pytest.fixture(autouse=True, scope="module")
def _torch_one_thread():
    """Tiny float64 ops: intra-op threads only add wake-up latency (10x slower on 2 busy cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


STRUCTS = list(itertools.product((False, True), ("VD", "DV"), ("2d", "3d")))  # bias, layout, shape

# Every combination of the loss options (144); bias/layout/shape cycle through all 8 combinations.
OPTION_CASES = [
    Case(red, cw, eps, zl, cap, ign, *STRUCTS[i % len(STRUCTS)])
    for i, (red, cw, eps, zl, cap, ign) in enumerate(
        itertools.product(("none", "sum", "mean"), (False, True), (0.0, 0.1), (0.0, 1e-2), (None, SOFTCAP), ("none", "-100", "3"))
    )
]
# Every structural combination, with all options off and all on.
STRUCT_CASES = [
    Case(red, on, 0.1 if on else 0.0, 1e-2 if on else 0.0, SOFTCAP if on else None, "-100" if on else "none", bias, layout, shape)
    for red, on, (bias, layout, shape) in itertools.product(("none", "sum", "mean"), (False, True), STRUCTS)
]
# label_smoothing = 1 (only the smoothing term is left).
SMOOTH1_CASES = [
    Case(red, cw, 1.0, zl, None, "-100", True, "VD", "2d")
    for red, cw, zl in itertools.product(("none", "sum", "mean"), (False, True), (0.0, 1e-2))
]
ALL_CASES = list(dict.fromkeys(OPTION_CASES + STRUCT_CASES + SMOOTH1_CASES))  # no duplicates
# F.cross_entropy has every option but z_loss (softcap is applied to its input logits).
TORCH_CE_CASES = [c for c in ALL_CASES if c.z_loss == 0.0]


def seed_of(case: Case) -> int:
    """A fixed seed per case (stable across runs and processes)."""
    return zlib.crc32(case.id().encode())


def _check_softcap_matters(case: Case, p: Problem):
    if case.softcap is not None:
        w_vd = p.w if case.layout == "VD" else p.w.T
        z = p.x.reshape(-1, D) @ w_vd.T + (0.0 if p.b is None else p.b)
        assert np.abs(z).max() > 1.5 * case.softcap, "logits too small for softcap to matter"


@pytest.mark.parametrize("use_g_lse", [False, True], ids=["g_lse0", "g_lse"])
@pytest.mark.parametrize("case", ALL_CASES, ids=Case.id)
def test_torch_autograd(case, use_g_lse):
    p = make_problem(case, seed_of(case))
    _check_softcap_matters(case, p)
    ref = run_reference(case, p, use_g_lse=use_g_lse)
    assert_matches(ref, torch_expected(case, p, use_g_lse=use_g_lse))


@pytest.mark.parametrize("use_g_lse", [False, True], ids=["g_lse0", "g_lse"])
@pytest.mark.parametrize("case", TORCH_CE_CASES, ids=Case.id)
def test_torch_cross_entropy(case, use_g_lse):
    """Pins PyTorch semantics: loss and gradients equal F.cross_entropy's (+ logsumexp for lse)."""
    p = make_problem(case, seed_of(case) + 1)
    ref = run_reference(case, p, use_g_lse=use_g_lse)
    assert_matches(ref, torch_expected(case, p, use_g_lse=use_g_lse, via="F"))


@pytest.mark.parametrize("case", ALL_CASES, ids=Case.id)
def test_jax_vjp(case):
    p = make_problem(case, seed_of(case) + 2)
    for use_g_lse in (False, True):
        ref = run_reference(case, p, use_g_lse=use_g_lse)
        assert_matches(ref, jax_expected(case, p, use_g_lse=use_g_lse))


def test_options_matter():
    """Sanity of the test data: each option changes every output, so the comparisons above bite."""
    base = Case("mean", True, 0.1, 1e-2, SOFTCAP, "-100", True, "VD", "2d")
    p = make_problem(base, 0)
    r0 = run_reference(base, p, use_g_lse=True)
    variants = [
        dict(label_smoothing=0.0),
        dict(z_loss=0.0),
        dict(softcap=None),
        dict(weight=None),
        dict(ignore_index=3),
        dict(grad_lse=None),
    ]
    for v in variants:
        r1 = run_reference(base, p, use_g_lse=True, **v)
        for name in ("grad_input", "grad_weight", "grad_bias"):
            assert not np.allclose(getattr(r0, name), getattr(r1, name), rtol=1e-6, atol=0), (v, name)


# ----------------------------------------------------------------------------- edge cases

EDGE_RED_CW = list(itertools.product(("none", "sum", "mean"), (False, True)))


def assert_matches_frameworks(case: Case, p: Problem, *, use_g_lse: bool, via_f: bool = True):
    """The reference equals naive torch autograd, naive jax.vjp and (z_loss = 0, via_f) F.cross_entropy."""
    ref = run_reference(case, p, use_g_lse=use_g_lse)
    expected = [("torch", lambda: torch_expected(case, p, use_g_lse=use_g_lse)), ("jax", lambda: jax_expected(case, p, use_g_lse=use_g_lse))]
    if via_f and case.z_loss == 0.0:
        expected.append(("F.cross_entropy", lambda: torch_expected(case, p, use_g_lse=use_g_lse, via="F")))
    for framework, compute in expected:
        try:
            assert_matches(ref, compute())
        except AssertionError as e:
            raise AssertionError(f"vs {framework}, use_g_lse={use_g_lse}: {e}") from None
    return ref


@pytest.mark.parametrize("zl", [0.0, 1e-2])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_large_logits(reduction, zl):
    """Logits ~ +-1000: exp overflows unless lse subtracts the row max (torch.logsumexp does)."""
    case = Case(reduction, True, 0.1, zl, None, "-100", True, "DV", "3d")
    p = make_problem(case, 10, scale=300.0)
    ref = assert_matches_frameworks(case, p, use_g_lse=True)
    assert np.all(np.isfinite(ref.lse)) and np.abs(ref.lse).max() > 700


@pytest.mark.parametrize("eps,zl", [(0.0, 0.0), (0.1, 0.0), (0.1, 1e-2)])
@pytest.mark.parametrize("reduction,cw", EDGE_RED_CW)
def test_all_rows_ignored(reduction, cw, eps, zl):
    """"mean" is 0/0 = NaN (as F.cross_entropy), "sum" 0, "none" zeros; zero gradients (lse's excepted)."""
    case = Case(reduction, cw, eps, zl, None, "-100", True, "DV", "3d")
    p = make_problem(case, 11)
    p.y[...] = -100
    for use_g_lse in (False, True):
        ref = assert_matches_frameworks(case, p, use_g_lse=use_g_lse)
        if reduction == "mean":
            assert np.isnan(ref.loss)
        else:
            assert np.all(ref.loss == 0.0)
        assert np.all(np.isfinite(ref.lse))
        for name in ("grad_input", "grad_weight", "grad_bias"):
            grad = getattr(ref, name)
            assert np.all(grad == 0.0) if not use_g_lse else np.all(np.isfinite(grad)) and np.any(grad != 0), name


@pytest.mark.parametrize("eps,zl", [(0.0, 0.0), (0.1, 0.0), (0.1, 1e-2)])
@pytest.mark.parametrize("reduction,cw", EDGE_RED_CW)
def test_empty_batch(reduction, cw, eps, zl):
    """N = 0: "mean" NaN, "sum" 0, "none" empty (as F.cross_entropy); gradients empty or zero."""
    case = Case(reduction, cw, eps, zl, SOFTCAP, "none", True, "VD", "2d")
    p = make_problem(case, 12, lead=(0,))
    ref = assert_matches_frameworks(case, p, use_g_lse=True)
    assert ref.loss.shape == ((0,) if reduction == "none" else ())
    assert ref.lse.shape == (0,) and ref.grad_input.shape == (0, D)
    if reduction == "mean":
        assert np.isnan(ref.loss)
    elif reduction == "sum":
        assert ref.loss == 0.0
    assert ref.grad_weight.shape == (V, D) and np.all(ref.grad_weight == 0.0)
    assert ref.grad_bias.shape == (V,) and np.all(ref.grad_bias == 0.0)


@pytest.mark.parametrize("bad_target", [V, V + 5, -1, -7])
@pytest.mark.parametrize("ignore", ["-100", "3"])
@pytest.mark.parametrize("use_g_lse", [False, True])
def test_out_of_range_target(bad_target, ignore, use_g_lse):
    """A valid target outside [0, V): that row's loss and grad_input are NaN, the other rows intact."""
    case = Case("none", True, 0.1, 1e-2, SOFTCAP, ignore, True, "VD", "2d")
    p = make_problem(case, 13)
    bad = 5
    p.y[bad] = bad_target
    ref = assert_matches_frameworks(case, p, use_g_lse=use_g_lse, via_f=False)  # NaNs compare equal
    assert np.isnan(ref.loss[bad]) and np.all(np.isnan(ref.grad_input[bad]))
    others = np.arange(len(p.y)) != bad
    assert np.all(np.isfinite(ref.loss[others])) and np.all(np.isfinite(ref.grad_input[others]))
    assert np.all(np.isfinite(ref.lse))
    # grad_weight and grad_bias sum over rows, so the bad row reaches all of them
    assert np.all(np.isnan(ref.grad_weight)) and np.all(np.isnan(ref.grad_bias))
    # the other rows are those of the problem without the bad row
    q = dataclasses.replace(p, x=p.x[others], y=p.y[others], g=p.g[others], g_lse=p.g_lse[others])
    ref_q = run_reference(case, q, use_g_lse=use_g_lse)
    assert_close(ref.loss[others], ref_q.loss, "loss of the other rows")
    assert_close(ref.lse[others], ref_q.lse, "lse of the other rows")
    assert_close(ref.grad_input[others], ref_q.grad_input, "grad_input of the other rows")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_out_of_range_target_reduced(reduction):
    case = Case(reduction, True, 0.1, 0.0, None, "-100", False, "DV", "3d")
    p = make_problem(case, 14)
    p.y[1, 2] = V
    ref = run_reference(case, p, use_g_lse=False)
    assert np.isnan(ref.loss)
    assert np.all(np.isnan(ref.grad_input[1, 2]))
    assert np.isfinite(np.delete(ref.grad_input.reshape(-1, D), 7, axis=0)).all()
    for framework, exp in [("torch", torch_expected(case, p, use_g_lse=False)), ("jax", jax_expected(case, p, use_g_lse=False))]:
        assert np.isnan(exp["loss"]), framework
        assert np.all(np.isnan(exp["grad_input"][1, 2])), framework


@pytest.mark.parametrize("where", ["input_valid_row", "input_ignored_row", "weight", "bias"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nan_propagates(where, reduction):
    """NaN reaches the loss of every valid row it touches; an ignored row's loss stays 0.

    Gradients are compared with autograd, NaNs included: as in PyTorch, a NaN in an ignored
    row's logits still gives that row NaN gradients (softmax backward computes 0 * NaN).
    """
    case = Case(reduction, True, 0.1, 1e-2, None, "-100", True, "VD", "2d")
    p = make_problem(case, 15)
    valid = p.y != -100
    i_valid, i_ign = int(np.flatnonzero(valid)[0]), int(np.flatnonzero(~valid)[0])
    if where == "input_valid_row":
        p.x[i_valid, 2] = np.nan
        nan_rows = np.arange(len(p.y)) == i_valid
    elif where == "input_ignored_row":
        p.x[i_ign, 2] = np.nan
        nan_rows = np.zeros(len(p.y), bool)
    elif where == "weight":
        p.w[4, 1] = np.nan
        nan_rows = valid  # W and b touch every row
    else:
        p.b[9] = np.nan
        nan_rows = valid
    rows = run_reference(case, p, use_g_lse=False, reduction="none", grad_output=np.ones(len(p.y))).loss
    assert np.array_equal(np.isnan(rows), nan_rows)
    assert np.all(rows[~valid] == 0.0)
    for use_g_lse in (False, True):
        ref = assert_matches_frameworks(case, p, use_g_lse=use_g_lse)
        if reduction != "none":
            assert np.isnan(ref.loss) == nan_rows.any()


def test_nan_in_ignored_row_matches_torch_cross_entropy():
    """F.cross_entropy leaves an ignored row's NaN logits out of the loss; so does the reference."""
    case = Case("sum", False, 0.0, 0.0, None, "-100", False, "VD", "2d")
    p = make_problem(case, 16)
    p.x[0, :] = np.nan  # row 0 is ignored (make_problem)
    assert p.y[0] == -100
    ref = assert_matches_frameworks(case, p, use_g_lse=False)
    assert np.isfinite(ref.loss)


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint8, np.int64])
def test_target_dtypes(dtype):
    case = Case("mean", True, 0.1, 1e-2, SOFTCAP, "3", True, "DV", "2d")
    p = make_problem(case, 17)
    ref64 = run_reference(case, p, use_g_lse=True)
    p2 = dataclasses.replace(p, y=p.y.astype(dtype))
    ref = run_reference(case, p2, use_g_lse=True)
    assert_matches(ref, dataclasses.asdict(ref64))


def test_ignore_index_none_means_minus_100():
    """SPEC/options: ignore_index=None means -100 (as torch's linear_cross_entropy)."""
    case = Case("none", True, 0.1, 1e-2, None, "-100", True, "VD", "2d")
    p = make_problem(case, 18)
    ref = run_reference(case, p, use_g_lse=True)
    ref_none = run_reference(case, p, use_g_lse=True, ignore_index=None)
    assert_matches(ref_none, dataclasses.asdict(ref))
