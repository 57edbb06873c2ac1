"""The distillation losses of both frameworks, every strategy (kernels in interpret mode on
the CPU), against the float64 reference; their parity on shared buffers; bad input. The
losses run with tests.frameworks.SMALL: several row and column blocks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distill_frameworks import CASES, IMPLEMENTATIONS, case_inputs, errors, make_problem, reference, run
from tests.frameworks import DTYPES, SMALL, rel_err, tolerance


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, name", list(CASES))
@pytest.mark.parametrize("framework, strategy", IMPLEMENTATIONS)
def test_matches_reference(framework, strategy, kind, name, dtype):
    p, options, g, count, scale = case_inputs(kind, name, dtype)
    result = run(framework, strategy, p, options, g, count, tuning=SMALL)
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
        result = run("jax", strategy, p, options, g, count, tuning=SMALL)
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
    t, j = (run(fw, strategy, p, options, g, count, tuning=SMALL) for fw in ("torch", "jax"))
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
                                                                 reduction="none", strategy="chunked", tuning=SMALL))
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_speed_keeps_the_logits_of_a_loss_per_row(monkeypatch, dtype):
    """JAX "speed" with reduction "none" (top-K and dense teachers), where its logits take at
    most Tuning.keep_logits_share of the free memory: the forward pass keeps the student's
    logits and the backward pass turns them into dz in place (`jax_impl.engine.backward_kept`;
    a dense teacher's logits are recomputed there), in SMALL's row blocks (`Rule.kept_whole`
    off: in one block XLA held a second [N, V]), against the float64 reference. Reduced
    losses form their gradients in the forward pass and keep nothing."""
    import jax

    import jax_impl.engine as engine
    from jax_impl import partitioned
    from jax_impl.distill_rules import _DenseRule, _TopKRule

    jax.clear_caches()  # the spy sees traces: none cached by earlier calls
    partitioned._with_vmap.cache_clear()
    spent = []
    backward = engine.backward_kept
    monkeypatch.setattr(engine, "backward_kept", lambda *a, **k: spent.append(a[3].shape) or backward(*a, **k))
    monkeypatch.setattr(engine, "free_bytes", lambda platform: 1 << 40)
    rows = []  # the rows of the logits blocks whose dz the rules form
    for rule in (_DenseRule, _TopKRule):
        monkeypatch.setattr(rule, "grad", lambda self, z, *a, _f=rule.grad: rows.append(z.shape[0]) or _f(self, z, *a))
    for kind, name in CASES:
        p, options, g, count, scale = case_inputs(kind, name, dtype)
        spent.clear()
        rows.clear()
        result = run("jax", "speed", p, options, g, count, tuning=SMALL)
        per_row = options.get("reduction") == "none"
        assert (len(spent) == 1) == per_row, (kind, name, spent)
        if per_row:
            assert max(rows) < spent[0][0], (kind, name, rows)  # row blocks
        tol = tolerance(dtype, scale)
        for key, err in errors(result, reference(p, options, g, count)).items():
            assert err <= tol, f"{kind} {name} {key}: {err:.3g} > {tol:.3g}"
