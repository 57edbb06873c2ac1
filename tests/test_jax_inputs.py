"""`jax_impl`'s losses on input that the spec covers but ordinary tests don't reach: NaN
in a row, 16-bit logits of large scale, softcaps far from the logits, 64-bit targets and
teacher ids, a hidden size of 0, NumPy arrays under jit, arguments that are no arrays,
second derivatives, and JAX's meshes (Explicit axes, shard_map). Every strategy; on the
CPU the Pallas kernels run in interpret mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from interop.tuning import DEFAULT, Tuning
from tests import distill_frameworks
from tests.frameworks import KEPT_LOGITS_PRELUDE, JaxAdapter, make_problem, reference, rel_err, round_to, tolerance

jax = pytest.importorskip("jax")
jnp = jax.numpy

import jax_impl  # noqa: E402
from jax_impl import fused_stats, kernels, pair_kernels  # noqa: E402

STRATEGIES = ["speed", "memory", "chunked"]
KERNEL_STRATEGIES = ["speed", "memory"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- NaN


@pytest.fixture
def triton_max(monkeypatch):
    """The kernels' modules see jnp.maximum and jnp.max as Pallas' Triton lowering computes
    them: maxnum, where a NaN operand loses to the other (interpret mode would propagate
    it, hiding a kernel that relies on it)."""
    maximum, reduce_max = jnp.maximum, jnp.max

    def maxnum(a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        return maximum(jnp.where(jnp.isnan(a), b, a), jnp.where(jnp.isnan(b), a, b))

    def maxnum_reduce(v, axis=None, **kw):
        return reduce_max(jnp.where(jnp.isnan(v), -jnp.inf, v), axis=axis, **kw)

    triton_jnp = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})
    triton_jnp.maximum, triton_jnp.max = maxnum, maxnum_reduce
    for module in (kernels, fused_stats, pair_kernels):
        monkeypatch.setattr(module, "jnp", triton_jnp)


def _nan_problem(source: str):
    """A problem whose logits hold a NaN (source: "input": rows 2 and 4, the latter ignored;
    "weight" / "bias": class 7 in every row, row 4 ignored), and the rows it reaches."""
    p = make_problem(31, bias=True, ignore_frac=0.0)
    p.y[4] = -100
    p.y[p.y == 7] = 8  # the NaN class is no row's target: only lse carries it
    if source == "input":
        p.x[[2, 4]] = np.nan
        return p, np.isin(np.arange(len(p.y)), [2, 4])
    if source == "weight":
        p.W[7, 3] = np.nan
    else:
        p.b[7] = np.nan
    return p, np.ones(len(p.y), bool)


@pytest.mark.parametrize("source", ["input", "weight", "bias"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_logit_makes_its_row_lse_and_loss_nan(triton_max, strategy, source):
    """A NaN logit anywhere in a row (from the input row, the head or the bias) makes the
    row's lse NaN (not -inf) and, unless the row is ignored (exactly 0), its loss, with the
    GPU's max; the other rows are untouched."""
    p, reached = _nan_problem(source)
    g_out, g_lse = np.ones(p.y.shape), np.zeros(p.y.shape)
    result = JaxAdapter(strategy).run(p, dict(reduction="none"), g_out, g_lse)
    assert np.array_equal(np.isnan(result["lse"]), reached), result["lse"]
    assert np.array_equal(np.isnan(result["loss"]), reached & (p.y != -100)), result["loss"]
    assert result["loss"][4] == 0
    ref = reference(p, dict(reduction="none"), g_out, g_lse)
    assert rel_err(result["loss"][~reached], ref.loss[~reached]) <= tolerance("float32")
    mean = JaxAdapter(strategy).run(p, dict(), np.asarray(1.0), None)
    assert np.isnan(mean["loss"])


@pytest.mark.parametrize("kind", ["topk", "dense"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_in_the_head_reaches_the_distillation_rows(triton_max, strategy, kind):
    """A NaN in one class of the student's head makes the distillation loss NaN in every
    row that has a teacher entry (the class is no teacher id: only the student's lse
    carries it; a row without entries has KD = 0)."""
    p = distill_frameworks.make_problem(kind, 32)
    reached = np.ones(p.x.shape[0], bool)
    if kind == "topk":
        ids, lp = p.teacher
        ids[ids == 7] = -1
        reached = ((ids >= 0) & (lp > -np.inf)).any(axis=1)
    p.W[7, 0] = np.nan
    result = distill_frameworks.run("jax", strategy, p, dict(reduction="none"), np.ones(p.x.shape[:-1]))
    assert np.array_equal(np.isnan(result["loss"]), reached), result["loss"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_teacher_logprob_is_an_entry(strategy):
    """Only -inf (or a negative id) is padding: a NaN teacher log-probability makes its
    row's loss and gradients NaN and leaves the other rows as the reference has them."""
    p = distill_frameworks.make_problem("topk", 33)
    p.teacher[1][5, 1] = np.nan
    g = np.ones(p.x.shape[:-1])
    result = distill_frameworks.run("jax", strategy, p, dict(reduction="none"), g)
    others = np.arange(len(g)) != 5
    assert np.isnan(result["loss"][5]) and np.all(np.isnan(result["grad_x"][5]))
    ref = distill_frameworks.reference(p, dict(reduction="none"), g)
    assert rel_err(result["loss"][others], ref.loss[others]) <= tolerance("float32")
    assert rel_err(result["grad_x"][others], ref.grad_input[others]) <= tolerance("float32")


# ----------------------------------------------------------------------------- 16-bit logits


def _naive_16bit_gradients(p):
    """(grad_x, grad_W) of the unfused loss in p's 16-bit dtype: the logits rounded to it,
    log_softmax in full precision, dz rounded to it as a 16-bit product's cotangent, and
    the gradients' products rounded to it (float64 otherwise)."""
    valid = p.y != -100
    z = round_to(p.x.astype(np.float64) @ p.W.T, p.dtype).astype(np.float64)
    prob = np.exp(z - z.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)
    prob[np.flatnonzero(valid), p.y[valid]] -= 1.0
    dz = round_to(np.where(valid[:, None], prob, 0.0) / valid.sum(), p.dtype).astype(np.float64)
    return round_to(dz @ p.W, p.dtype), round_to(dz.T @ p.x, p.dtype)


@pytest.mark.parametrize("logit_scale", [4.0, 64.0])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("strategy", ["speed", "memory", "memory-kernel-products", "chunked"])
def test_16bit_gradients_as_accurate_as_naive(strategy, dtype, logit_scale):
    """bf16/fp16 gradients within 1.25 times the naive 16-bit computation's error ("memory":
    2 times) at logits up to |z| ~ 300: the forward statistics come from the logits the
    backward pass recomputes, so p sums to 1 there (fp32 statistics against 16-bit
    recomputed logits give 21 times naive bf16's error at |z| ~ 300)."""
    tuning = DEFAULT
    if strategy == "memory-kernel-products":  # blocks of rows and columns, products by row_products' kernels
        tuning = Tuning(min_block=4, min_memory_block=(4, 4), xla_memory_cols=8, xla_gemm_workspace=0, xla_row_bytes=0,
                        whole_row_head_bytes=0)
    p = make_problem(34, lead=(48,), hidden=16, vocab=160, dtype=dtype, logit_scale=logit_scale)
    ref = reference(p, {}, np.asarray(1.0), None)
    result = JaxAdapter(strategy.split("-")[0], tuning).run(p, {}, np.asarray(1.0), None, wrt=("x", "W"))
    naive_x, naive_W = _naive_16bit_gradients(p)
    bound = 2.0 if strategy.startswith("memory") else 1.25
    for key, naive, r in (("grad_x", naive_x, ref.grad_input), ("grad_W", naive_W, ref.grad_weight)):
        err, naive_err = rel_err(result[key], r), rel_err(naive, r)
        assert err <= bound * naive_err, f"{key}: {err:.3g} > {bound} x naive {naive_err:.3g}"


# ----------------------------------------------------------------------------- softcap


@pytest.mark.parametrize("cap", [1.0, 1e6, 1e30])
def test_kernel_softcap_matches_float64_tanh(cap):
    """The kernels' c tanh(z / c) against float64's for z / c from 1e-30 to 20 (either
    sign): a few fp32 rounding errors, also where tanh(u) ~ u is far below 1 (on a GPU,
    in the Triton lowering)."""
    u = np.geomspace(1e-30, 20.0, 241)
    z = np.concatenate([u, -u]).astype(np.float32) * np.float32(cap)
    R = len(z)
    stats = (jnp.full((R,), -jnp.inf), jnp.zeros(R), jnp.zeros(R), jnp.zeros(R))
    _, _, s_y, _ = kernels.block_stats(jnp.asarray(z)[:, None], kernels.v0_array(0), None, None, jnp.zeros(R, jnp.int32),
                                       stats, cap, False, interpret=jax.default_backend() != "gpu")
    want = cap * np.tanh(z.astype(np.float64) / cap)
    err = np.abs(np.asarray(s_y, np.float64) - want) / np.abs(want)
    assert err.max() <= 4 * np.finfo(np.float32).eps, f"worst at z / c = {z[err.argmax()] / cap:.3g}: {err.max():.3g}"


# ----------------------------------------------------------------------------- targets and ids


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_64bit_targets_never_wrap_into_range(strategy):
    """With x64 on, int64 targets 2**32 - 100 and 2**32 + 5 would wrap in int32 to -100
    (ignore_index) and 5 (a class): under jit their rows get NaN; eagerly, ValueError."""
    p = make_problem(35, ignore_frac=0.0)
    g_out = np.ones(p.y.shape)
    ref = reference(p, dict(reduction="none"), g_out, None)
    wide = p.y.copy()
    wide[[3, 6]] = [2**32 - 100, 2**32 + 5]
    p.y = wide
    bad = np.isin(np.arange(len(wide)), [3, 6])
    with jax.enable_x64(True):
        result = JaxAdapter(strategy).run(p, dict(reduction="none"), g_out, None, target_dtype="int64")
        x, W = jnp.asarray(p.x), jnp.asarray(p.W)
        with pytest.raises(ValueError, match=str(2**32 - 100)):
            jax_impl.linear_cross_entropy(x, W, jnp.asarray(wide), strategy=strategy)
    assert np.array_equal(np.isnan(result["loss"]), bad)
    assert np.all(np.isnan(result["grad_x"][bad]))
    assert rel_err(result["loss"][~bad], ref.loss[~bad]) <= tolerance("float32")


# (JAX's 64-bit mode, the targets' dtype, ignore_index, V, the fraction of rows ignored)
IGNORE_CASES = {
    "int32-ignore-2**40": (False, "int32", 2**40, 53, 0.0),
    "int64-ignore-2**40": (True, "int64", 2**40, 53, 0.3),
    "uint8-ignore-minus-100": (False, "uint8", -100, 53, 0.0),
    "int8-vocab-300": (False, "int8", -100, 300, 0.3),
}


@pytest.mark.parametrize("case", list(IGNORE_CASES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_any_ignore_index_with_any_integer_targets(strategy, case):
    """ignore_index may lie outside the targets' dtype (then no row equals it, though 2**40
    wraps to class 0 in int32) or need int64; targets narrower than int32 compare with a V
    their dtype can't hold."""
    x64, target_dtype, ignore, vocab, ignore_frac = IGNORE_CASES[case]
    p = make_problem(36, vocab=vocab, ignore_frac=ignore_frac, ignore_index=ignore)
    p.y = np.where(p.y == ignore, ignore, np.minimum(p.y, 120))  # int8 holds up to 127
    p.y[0] = 0
    g_out = np.ones(p.y.shape)
    options = dict(reduction="none", ignore_index=ignore)
    with jax.enable_x64(x64):
        result = JaxAdapter(strategy).run(p, options, g_out, None, target_dtype=target_dtype)
    ref = reference(p, options, g_out, None)
    assert rel_err(result["loss"], ref.loss) <= tolerance("float32")
    assert rel_err(result["grad_x"], ref.grad_input) <= tolerance("float32")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_64bit_teacher_ids_and_targets_never_wrap_into_range(strategy):
    """Top-K distillation with x64 on: a teacher id 2**32 + 5 (class 5 once wrapped) and a
    hard target 2**32 - 100 (ignore_index once wrapped) give their rows NaN under jit;
    eagerly they raise ValueError."""
    p = distill_frameworks.make_problem("topk", 37, target=True)
    p.y[p.y == -100] = 1
    p.y = p.y.astype(np.int64)
    p.teacher = (p.teacher[0].astype(np.int64), p.teacher[1])
    p.teacher[0][4, 0] = 2**32 + 5
    p.y[8] = 2**32 - 100
    options = dict(reduction="none", weight_hard=0.5)
    g = np.ones(p.x.shape[:-1])
    with jax.enable_x64(True):
        result = distill_frameworks.run("jax", strategy, p, options, g)
        x, W, ids, lp, y = (jnp.asarray(a) for a in (p.x, p.W, *p.teacher, p.y))
        call = lambda ids, y: jax_impl.linear_topk_distillation(x, W, ids, lp, target=y, weight_hard=0.5, strategy=strategy)
        with pytest.raises(ValueError, match=str(2**32 + 5)):
            call(ids, y.at[8].set(1))
        with pytest.raises(ValueError, match=str(2**32 - 100)):
            call(ids.at[4, 0].set(0), y)
    bad = np.isin(np.arange(len(g)), [4, 8])
    assert np.array_equal(np.isnan(result["loss"]), bad), result["loss"]


# ----------------------------------------------------------------------------- shapes and argument types


@pytest.mark.parametrize("kind", ["topk", "dense"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_distillation_with_hidden_size_0(strategy, kind):
    """D = 0: the student's logits are its bias (or 0), and the losses are those of a
    student with one hidden unit of value 0 (the reference's D >= 1)."""
    p = distill_frameworks.make_problem(kind, 38, hidden=0, bias=kind == "topk", target=True)
    g = np.ones(p.x.shape[:-1])
    options = dict(reduction="none", **(dict(weight_hard=0.5) if kind == "topk" else {}))
    result = distill_frameworks.run("jax", strategy, p, options, g)
    assert result["grad_x"].shape == p.x.shape and result["grad_W"].shape == p.W.shape
    p.x, p.W = np.zeros(p.x.shape[:-1] + (1,), np.float32), np.ones(p.W.shape[:-1] + (1,), np.float32)
    ref = distill_frameworks.reference(p, options, g)
    assert rel_err(result["loss"], ref.loss) <= tolerance("float32")
    if kind == "topk":
        assert rel_err(result["grad_b"], ref.grad_bias) <= tolerance("float32")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_numpy_class_weights_and_bias_under_jit(strategy):
    """NumPy class weights and bias (float64 ones too) inside jax.jit(jax.value_and_grad(f))."""
    p = make_problem(39, bias=True, class_weights=True)
    x, W, y = jnp.asarray(p.x), jnp.asarray(p.W), jnp.asarray(p.y.astype(np.int32))
    cw = p.cw.astype(np.float64)

    def f(x, W):
        return jax_impl.linear_cross_entropy(x, W, y, linear_bias=p.b, weight=cw, label_smoothing=0.1, strategy=strategy)

    loss, (gx, gW) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, W)
    ref = reference(p, dict(label_smoothing=0.1), np.asarray(1.0), None)
    for got, want in ((loss, ref.loss), (gx, ref.grad_input), (gW, ref.grad_weight)):
        assert rel_err(got, want) <= tolerance("float32")


NOT_ARRAYS = {"a list": [[0.5, 1.0]], "a string": "x"}


def _cross_entropy_call(**changed):
    p = make_problem(40, bias=True, class_weights=True)
    args = {**dict(input=p.x, linear_weight=p.W, target=p.y, linear_bias=p.b, weight=p.cw), **changed}
    return lambda: jax_impl.linear_cross_entropy(args.pop("input"), args.pop("linear_weight"), args.pop("target"), **args)


def _distillation_call(kind, **changed):
    p = distill_frameworks.make_problem(kind, 41, bias=kind == "topk", target=True, mask=True)
    args = dict(input=p.x, linear_weight=p.W, target=p.y, row_mask=p.mask)
    if kind == "topk":
        args = {**args, "teacher_ids": p.teacher[0], "teacher_logprobs": p.teacher[1], "linear_bias": p.b, **changed}
        return lambda: jax_impl.linear_topk_distillation(args.pop("input"), args.pop("linear_weight"),
                                                         args.pop("teacher_ids"), args.pop("teacher_logprobs"), **args)
    args = {**args, "teacher_input": p.teacher[0], "teacher_weight": p.teacher[1], **changed}
    return lambda: jax_impl.linear_distillation(args.pop("input"), args.pop("linear_weight"), args.pop("teacher_input"),
                                                args.pop("teacher_weight"), **args)


ARGUMENTS = [("cross_entropy", a) for a in ("input", "linear_weight", "target", "linear_bias", "weight")] + \
    [("topk", a) for a in ("teacher_ids", "teacher_logprobs", "target", "row_mask", "linear_bias")] + \
    [("dense", a) for a in ("teacher_input", "teacher_weight", "input")]


@pytest.mark.parametrize("not_array", list(NOT_ARRAYS))
@pytest.mark.parametrize("loss, argument", ARGUMENTS)
def test_argument_that_is_no_array_raises_type_error_naming_it(loss, argument, not_array):
    value = NOT_ARRAYS[not_array]
    call = _cross_entropy_call(**{argument: value}) if loss == "cross_entropy" else _distillation_call(loss, **{argument: value})
    with pytest.raises(TypeError, match=f"^{argument} must be a JAX or NumPy array"):
        call()


# ----------------------------------------------------------------------------- second derivatives


def _hvp(f, x, v):
    """The Hessian of f at x times v: forward mode over the gradient."""
    return jax.jvp(jax.grad(f), (x,), (v,))[1]


def test_chunked_second_derivatives_match_finite_differences():
    """"chunked" is twice differentiable (its custom_vjp rule is plain XLA): jax.hessian and
    a Hessian-vector product agree with central differences of its gradient (x64)."""
    p = make_problem(42, lead=(5,), hidden=6, vocab=11, bias=True)
    with jax.enable_x64(True):
        x, W, b = (jnp.asarray(a, jnp.float64) for a in (p.x, p.W, p.b))
        y = jnp.asarray(p.y)
        f = lambda x: jax_impl.linear_cross_entropy(x, W, y, linear_bias=b, label_smoothing=0.1, z_loss=0.01,
                                                    softcap=3.0, strategy="chunked")
        v = jnp.asarray(np.random.default_rng(42).standard_normal(x.shape))
        h = 1e-5
        want = (jax.grad(f)(x + h * v) - jax.grad(f)(x - h * v)) / (2 * h)
        assert rel_err(jax.jit(_hvp, static_argnums=0)(f, x, v), want) <= 1e-6
        hessian = jax.jit(jax.hessian(f))(x).reshape(x.size, x.size)
        assert rel_err(hessian @ v.reshape(-1), want.reshape(-1)) <= 1e-6


@pytest.mark.parametrize("loss", ["topk", "dense", "log_probs", "policy"])
def test_chunked_second_derivatives_of_the_other_losses(loss):
    """"chunked" stays twice differentiable for every loss (its passes run as plain XLA, not
    through the partitioner): a Hessian-vector product agrees with central differences of
    the gradient (x64)."""
    with jax.enable_x64(True):
        if loss in ("topk", "dense"):
            p = distill_frameworks.make_problem(loss, 44, lead=(5,), hidden=6, vocab=11)
            W = jnp.asarray(p.W, jnp.float64)
            teacher = tuple(jnp.asarray(a, jnp.float64 if loss == "dense" or i else None) for i, a in enumerate(p.teacher))
            impl = jax_impl.linear_topk_distillation if loss == "topk" else jax_impl.linear_distillation
            f = lambda x: impl(x, W, *teacher, temperature=0.7, strategy="chunked")
        else:
            p = make_problem(44, lead=(5,), hidden=6, vocab=11)
            W, y = jnp.asarray(p.W, jnp.float64), jnp.asarray(p.y)
            if loss == "log_probs":
                f = lambda x: (lambda lp, h: (lp * lp).sum() + h.sum())(
                    *jax_impl.linear_log_probs(x, W, y, return_entropy=True, strategy="chunked"))
            else:
                f = lambda x: jax_impl.linear_policy_loss(x, W, y, 0.5, entropy_coef=0.1, strategy="chunked")
        x = jnp.asarray(p.x, jnp.float64)
        v = jnp.asarray(np.random.default_rng(44).standard_normal(x.shape))
        h = 1e-5
        want = (jax.grad(f)(x + h * v) - jax.grad(f)(x - h * v)) / (2 * h)
        assert rel_err(jax.jit(_hvp, static_argnums=0)(f, x, v), want) <= 1e-5


@pytest.mark.parametrize("loss", ["cross_entropy", "topk", "dense"])
@pytest.mark.parametrize("strategy", KERNEL_STRATEGIES)
def test_kernel_strategies_refuse_second_derivatives_clearly(strategy, loss):
    """The Pallas kernels have no derivatives: differentiating a gradient raises an error
    that names the strategy that supports it (not Pallas' bare AssertionError)."""
    if loss == "cross_entropy":
        p = make_problem(43)
        W, y = jnp.asarray(p.W), jnp.asarray(p.y)
        f = lambda x: jax_impl.linear_cross_entropy(x, W, y, strategy=strategy)
    else:
        p = distill_frameworks.make_problem(loss, 43)
        W, teacher = jnp.asarray(p.W), tuple(map(jnp.asarray, p.teacher))
        impl = jax_impl.linear_topk_distillation if loss == "topk" else jax_impl.linear_distillation
        f = lambda x: impl(x, W, *teacher, strategy=strategy)
    x = jnp.asarray(p.x)
    for second in (lambda: jax.hessian(f)(x), lambda: _hvp(f, x, x), lambda: jax.grad(lambda x: jax.grad(f)(x).sum())(x)):
        with pytest.raises(NotImplementedError, match="strategy='chunked' supports them"):
            second()


# ----------------------------------------------------------------------------- meshes

MESH_SCRIPT = textwrap.dedent('''
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jax_impl

    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    args = (f32(8, 12), f32(40, 12), jnp.asarray(rng.integers(0, 40, 8), jnp.int32),
            jnp.asarray(rng.integers(-1, 40, (8, 3)), jnp.int32), jnp.asarray(np.log(rng.dirichlet(np.ones(3), 8)), jnp.float32),
            f32(8, 10), f32(40, 10))
    batch = (P("x"), P(), P("x"), P("x"), P("x"), P("x"), P())
    LOSSES = {
        "cross_entropy": lambda s: lambda x, W, y, ids, lp, xt, Wt: jax_impl.linear_cross_entropy(
            x, W, y, reduction="sum", label_smoothing=0.1, strategy=s),
        "topk": lambda s: lambda x, W, y, ids, lp, xt, Wt: jax_impl.linear_topk_distillation(
            x, W, ids, lp, target=y, weight_hard=0.5, reduction="sum", strategy=s),
        "dense": lambda s: lambda x, W, y, ids, lp, xt, Wt: jax_impl.linear_distillation(
            x, W, xt, Wt, target=y, reduction="sum", strategy=s),
        "log_probs": lambda s: lambda x, W, y, ids, lp, xt, Wt: sum(
            out.sum() for out in jax_impl.linear_log_probs(x, W, y, temperature=0.8, return_entropy=True, strategy=s)),
    }
    mesh = jax.make_mesh((4,), ("x",))  # the default axis types: Explicit
    try:
        shard_map = jax.shard_map
    except AttributeError:
        from jax.experimental.shard_map import shard_map
    set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh

    def check(name, got, want):
        (loss, grads), (want_loss, want_grads) = got, want
        for g, w in zip((loss, *grads), (want_loss, *want_grads)):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            err = np.linalg.norm(g - w) / np.linalg.norm(w)
            assert err <= 1e-5, (name, err)

    for loss_name, make in LOSSES.items():
        for strategy in ("speed", "memory", "chunked"):
            f = jax.value_and_grad(make(strategy), argnums=(0, 1))
            want = f(*args)
            for specs in (batch, (P(),) * 7):
                name = (loss_name, strategy, "batch" if specs is batch else "replicated")
                placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
                check(name + ("explicit, no current mesh",), jax.jit(f)(*placed), want)
                with set_mesh(mesh):
                    check(name + ("explicit",), jax.jit(f)(*placed), want)

                    def per_device(*a):
                        loss, (gx, gW) = f(*a)
                        return loss[None], gx, gW

                    rows = P("x") if specs is batch else P()
                    out = jax.jit(shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=(P("x"), rows, P())))(*placed)
                    losses = np.asarray(out[0])
                    loss = losses.sum() if specs is batch else losses[0]
                    check(name + ("shard_map",), (loss, out[1:]), want)
    print("all equal")
''')


def test_every_strategy_on_explicit_meshes_and_in_shard_map():
    """On 4 CPU devices: on an Explicit mesh (jax.make_mesh's default; made current by
    jax.set_mesh, or only named by the operands' shardings) and inside jax.shard_map
    (check_vma=True), with replicated or batch-sharded inputs, every strategy of every loss
    gives the single device's loss and gradients ("sum" over the shards' losses; the
    replicated head's gradient summed over them)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               LOGITLESS_PALLAS_INTERPRET="1", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "all equal" in done.stdout, done.stderr[-4000:]


KEPT_MESH_SCRIPT = "N, D, V = 16, 8, 24\n" + KEPT_LOGITS_PRELUDE + r'''
from tests.frameworks import SMALL

engine.free_bytes = lambda platform: 1 << 40

def log_probs(x, W, t):
    lp, H = jax_impl.linear_log_probs(x, W, y, return_entropy=True, softcap=3.0, strategy="speed", tuning=t)
    return (lp * g_a).sum() + (H * g_b).sum()

def cross_entropy(x, W, t):
    loss, lse = jax_impl.linear_cross_entropy(x, W, y, reduction="none", return_lse=True, label_smoothing=0.1,
                                              strategy="speed", tuning=t)
    return (loss * g_a).sum() + (lse * g_b).sum()

def topk_none(x, W, t):
    loss = jax_impl.linear_topk_distillation(x, W, ids, teacher, reduction="none", strategy="speed", tuning=t)
    return (loss * g_a).sum()

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("r", "c"))
for objective in (log_probs, cross_entropy, topk_none):
    grad = jax.jit(jax.grad(objective, (0, 1)), static_argnums=2)
    spent.clear()
    want = grad(x, W, dataclasses.replace(SMALL, keep_logits_share=0.0))
    assert spent == []
    for name, xs, ws, local in (("rows", P("r", None), P(), (8, 24)),
                                ("rows and vocabulary", P("r", None), P("c", None), (8, 12)),
                                ("FSDP", P(("r", "c"), None), P(("r", "c"), None), (4, 24)),
                                ("head over one of the rows' axes", P(("r", "c"), None), P("r", None), (4, 24)),
                                ("head over more axes than the rows", P("r", None), P(("r", "c"), None), (8, 24))):
        spent.clear()
        args = jax.device_put(x, NamedSharding(mesh, xs)), jax.device_put(W, NamedSharding(mesh, ws)), SMALL
        got = grad(*args)
        assert local in spent, (objective.__name__, name, spent)  # (the body is traced at the whole shapes too)
        # the logits stay where the forward pass left them (a gathered head's classes are not theirs)
        text = grad.lower(*args).compile().as_text()
        assert "all-to-all" not in text and "collective-permute" not in text, (objective.__name__, name)
        for a, b in zip(got, want):
            err = float(jnp.abs(a - b).max() / jnp.abs(b).max())
            assert err < 1e-6, (objective.__name__, name, err)
print("all equal")
'''


def test_jax_kept_logits_under_a_mesh():
    """On 4 CPU devices under jit, "speed"'s kept logits (log-probabilities; cross-entropy and
    top-K distillation per row) are each device's rows and classes: rows sharded, rows and
    a head split over the vocabulary, and a head the pass gathers (FSDP-sharded, or over one
    of the rows' axes, or over more axes than the rows): the gradients of the recomputing
    backward pass, and no all-to-all or collective-permute moving the logits."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               LOGITLESS_PALLAS_INTERPRET="1", PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", KEPT_MESH_SCRIPT], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "all equal" in done.stdout, done.stderr[-4000:]
