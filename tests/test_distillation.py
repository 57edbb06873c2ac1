"""The distillation losses of both frameworks, every strategy (kernels in interpret mode on
the CPU), against the float64 reference; their parity on shared buffers; bad input."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tests.distill_frameworks import IMPLEMENTATIONS, make_problem, reference, run
from tests.frameworks import DTYPES, rel_err, tolerance
from tests.test_implementations import small_chunks  # noqa: F401 (autouse: several row and column blocks)

TOPK_CASES = {
    "defaults": (dict(), dict()),
    "T2-hard-bias": (dict(temperature=2.0, weight_soft=0.8, weight_hard=0.5), dict(bias=True, target=True)),
    "tail-none-softcap-dups": (dict(renormalize_teacher=False, tail_bucket=True, softcap=4.0, reduction="none"),
                               dict(duplicates=True)),
    "T07-sum-mask-dv-3d": (dict(temperature=0.7, temperature_squared=False, reduction="sum"),
                           dict(mask=True, target=True, weight_layout="DV", lead=(2, 7))),
    "hard-T1-count": (dict(weight_hard=1.0), dict(target=True), 30.0),
}
DENSE_CASES = {
    "forward-kl": (dict(), dict()),
    "reverse-kl-T2-sum-target": (dict(divergence="reverse_kl", temperature=2.0, reduction="sum"), dict(target=True)),
    "jsd-none-bigger-teacher-dv": (dict(divergence="jsd", beta=0.3, reduction="none"),
                                   dict(teacher_vocab=60, weight_layout="DV", mask=True)),
    "forward-kl-T07-smaller-teacher-3d": (dict(temperature=0.7), dict(teacher_vocab=47, lead=(2, 7)), 20.0),
}
CASES = {**{("topk", k): v for k, v in TOPK_CASES.items()}, **{("dense", k): v for k, v in DENSE_CASES.items()}}


def case_inputs(kind, name, dtype):
    options, problem, *count = CASES[(kind, name)]
    seed = zlib.crc32(f"{kind}{name}{dtype}".encode())
    p = make_problem(kind, seed, dtype=dtype, **problem)
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(p.x.shape[:-1]) if options.get("reduction") == "none" else rng.uniform(0.5, 2.0)
    # logits of the student (and the dense teacher, 1.5x) divided by T: the scale of what is rounded
    scale = (1.5 if kind == "dense" else 1.0) / min(1.0, options.get("temperature", 1.0))
    return p, options, g, (count[0] if count else None), scale


def errors(result, ref):
    of = {"loss": ref.loss, "grad_x": ref.grad_input, "grad_W": ref.grad_weight, "grad_b": ref.grad_bias}
    return {k: rel_err(v, of[k]) for k, v in result.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, name", list(CASES))
@pytest.mark.parametrize("framework, strategy", IMPLEMENTATIONS)
def test_matches_reference(framework, strategy, kind, name, dtype):
    p, options, g, count, scale = case_inputs(kind, name, dtype)
    result = run(framework, strategy, p, options, g, count)
    tol = tolerance(dtype, scale)
    for key, err in errors(result, reference(p, options, g, count)).items():
        assert err <= tol, f"{key}: relative error {err:.3g} > {tol:.3g}"
    assert ("grad_b" in result) == (p.b is not None)


@pytest.mark.parametrize("kind, name", [("topk", "T2-hard-bias"), ("dense", "jsd-none-bigger-teacher-dv")])
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_jax_kernels_with_x64_on(strategy, kind, name):
    """The JAX kernels (the dense teacher's pair kernels too) with JAX's 64-bit mode on."""
    import jax

    p, options, g, count, scale = case_inputs(kind, name, "float32")
    with jax.enable_x64(True):
        result = run("jax", strategy, p, options, g, count)
    tol = tolerance("float32", scale)
    for key, err in errors(result, reference(p, options, g, count)).items():
        assert err <= tol, f"{key}: relative error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("kind, name", [("topk", "T2-hard-bias"), ("topk", "tail-none-softcap-dups"),
                                        ("dense", "jsd-none-bigger-teacher-dv")])
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_parity_between_frameworks(strategy, kind, name):
    """torch and JAX on the same input values disagree by no more than the larger of their
    errors against the spec (plus one bf16 tolerance)."""
    p, options, g, count, scale = case_inputs(kind, name, "bfloat16")
    ref = reference(p, options, g, count)
    t, j = run("torch", strategy, p, options, g, count), run("jax", strategy, p, options, g, count)
    et, ej = errors(t, ref), errors(j, ref)
    for key in t:
        between = rel_err(t[key], j[key])
        assert between <= max(et[key], ej[key]) + tolerance("bfloat16", scale), f"{key}: torch vs jax {between:.3g}"


# ----------------------------------------------------------------------------- bad input


def _topk_args(framework, **over):
    p = make_problem("topk", 1, target=True)
    ids, lp = p.teacher
    args = dict(x=p.x, W=p.W, ids=ids, lp=lp, y=p.y)
    args.update(over)
    if framework == "torch":
        import torch
        conv = lambda a: None if a is None else torch.as_tensor(np.array(a))
    else:
        import jax.numpy as jnp
        conv = lambda a: None if a is None else jnp.asarray(a)
    return {k: conv(v) for k, v in args.items()}


def _impl(framework):
    import importlib
    return importlib.import_module(f"{framework}_impl")


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("over, kwargs, error, message", [
    (dict(ids=np.full((13, 5), 53)), dict(), ValueError, "teacher_ids holds 53"),
    (dict(ids=np.zeros((13, 4), np.int64)), dict(), ValueError, "teacher_logprobs must have teacher_ids' shape"),
    (dict(ids=np.zeros((12, 5), np.int64)), dict(), ValueError, "teacher_ids must have shape"),
    (dict(lp=np.zeros((13, 5), np.int64)), dict(), TypeError, "teacher_logprobs must have a floating dtype"),
    (dict(y=None), dict(weight_hard=0.5), ValueError, "weight_hard > 0 needs a target"),
    (dict(y=np.full(13, 99)), dict(weight_hard=0.5), ValueError, "target holds 99"),
    (dict(), dict(tail_bucket=True), ValueError, "tail_bucket"),
    (dict(), dict(reduction="sum", num_items_in_batch=4), ValueError, "num_items_in_batch"),
    (dict(), dict(temperature=0), ValueError, "temperature"),
    (dict(), dict(strategy="fast"), ValueError, "strategy"),
])
def test_topk_bad_input_raises(framework, over, kwargs, error, message):
    a = _topk_args(framework, **over)
    with pytest.raises(error, match=message):
        _impl(framework).linear_topk_distillation(a["x"], a["W"], a["ids"], a["lp"], target=a["y"], **kwargs)


def test_jax_traced_bad_teacher_id_gives_nan_row():
    import jax
    import jax.numpy as jnp

    import jax_impl

    p = make_problem("topk", 2)
    ids = p.teacher[0].copy()
    ids[4, 0] = 53
    f = jax.jit(lambda x, ids: jax_impl.linear_topk_distillation(x, jnp.asarray(p.W), ids, jnp.asarray(p.teacher[1]),
                                                                 reduction="none", strategy="chunked"))
    loss = np.asarray(f(jnp.asarray(p.x), jnp.asarray(ids)))
    assert np.isnan(loss[4]) and np.isfinite(np.delete(loss, 4)).all()


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("teacher_shape, kwargs, error, message", [
    ((13, 21), dict(), ValueError, "teacher_input's last dimension"),
    ((12, 22), dict(), ValueError, "teacher_input must have input's leading shape"),
    (None, dict(divergence="js"), ValueError, "divergence"),
    (None, dict(divergence="jsd", beta=0.0), ValueError, "beta"),
])
def test_dense_bad_input_raises(framework, teacher_shape, kwargs, error, message):
    p = make_problem("dense", 3)
    xt, Wt = p.teacher
    if teacher_shape is not None:
        xt = np.zeros(teacher_shape, xt.dtype)  # the same teacher head, a mismatched input
    if framework == "torch":
        import torch
        conv = torch.as_tensor
    else:
        import jax.numpy as jnp
        conv = jnp.asarray
    with pytest.raises(error, match=message):
        _impl(framework).linear_distillation(conv(p.x), conv(p.W), conv(xt), conv(Wt), **kwargs)
