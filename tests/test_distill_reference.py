"""The float64 distillation reference (interop/distill_reference.py) against float64 autograd
of the naive formulas written with PyTorch ops (log_softmax, gather, cross_entropy) on
materialised logits, with random upstream gradients."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

from interop.distill_reference import linear_distillation_reference, linear_topk_distillation_reference
from interop.distillation import DenseDistillationOptions, TopKDistillationOptions
from tests.distill_frameworks import topk_teacher

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

RTOL, ATOL = 1e-9, 1e-12
N, D, V, K = 11, 7, 37, 5


def naive_topk(x, W, b, ids, lp, y, mask, o: TopKDistillationOptions, layout, num_items):
    W_VD = W if layout == "VD" else W.T
    z = x @ W_VD.T + (0 if b is None else b)
    s = z if o.softcap is None else o.softcap * torch.tanh(z / o.softcap)
    logq = F.log_softmax(s / o.temperature, dim=-1)
    entry = (ids >= 0) & (lp > -math.inf)
    lpm = lp.masked_fill(~entry, -math.inf)
    if o.renormalize_teacher:
        logP = torch.where(entry, lpm - torch.logsumexp(lpm, -1, keepdim=True), torch.zeros_like(lp))
    else:
        logP = torch.where(entry, lp, torch.zeros_like(lp))
    P = torch.where(entry, logP.exp(), torch.zeros_like(lp))
    lq = logq.gather(-1, ids.clamp(min=0))
    kd = torch.where(entry, P * (logP - lq), torch.zeros_like(lp)).sum(-1)
    if o.tail_bucket:
        R = (1 - P.sum(-1)).clamp(min=0)
        Q = torch.where(entry, lq.exp(), torch.zeros_like(lp)).sum(-1)
        kd = kd + torch.where(R > 0, R * (torch.log(torch.where(R > 0, R, torch.ones_like(R))) - torch.log1p(-Q)), torch.zeros_like(R))
    row = o.kd_scale * kd
    if y is not None and o.weight_hard:
        row = row + o.weight_hard * F.cross_entropy(s, y.clamp(min=0), reduction="none")
    return _reduce_valid_rows(row, y, mask, o, num_items)


def _reduce_valid_rows(row, y, mask, o, num_items):
    """The loss of per-row terms `row`: rows masked out or whose target is ignored count 0,
    reduced as o.reduction says ("mean" over the valid rows or num_items)."""
    valid = torch.ones(row.shape[0], dtype=torch.bool)
    if mask is not None:
        valid &= mask
    if y is not None:
        valid &= y != o.ignore_index
    row = torch.where(valid, row, torch.zeros_like(row))
    if o.reduction == "none":
        return row
    if o.reduction == "sum":
        return row.sum()
    return row.sum() / (valid.sum() if num_items is None else num_items)


TOPK_CASES = {
    "defaults": (dict(), dict()),
    "temperature-nosquare-sum": (dict(temperature=2.0, temperature_squared=False, reduction="sum"), dict()),
    "raw-teacher": (dict(renormalize_teacher=False), dict()),
    "tail-bucket-none": (dict(renormalize_teacher=False, tail_bucket=True, reduction="none"), dict()),
    "hard-mix-T": (dict(temperature=1.5, weight_soft=0.7, weight_hard=0.3), dict(target=True)),
    "hard-mix-softcap-bias-dv": (dict(weight_hard=0.5, softcap=3.0), dict(target=True, bias=True, layout="DV")),
    "mask-and-target-count": (dict(), dict(target=True, mask=True, num_items=17.0)),
    "duplicates-tail": (dict(renormalize_teacher=False, tail_bucket=True, temperature=0.8), dict(duplicates=True)),
}


@pytest.mark.parametrize("name", list(TOPK_CASES))
def test_topk_reference_matches_autograd(name):
    opts_kw, prob = TOPK_CASES[name]
    o = TopKDistillationOptions(**opts_kw)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    layout = prob.get("layout", "VD")
    x = rng.normal(size=(N, D))
    W = rng.normal(size=(V, D) if layout == "VD" else (D, V))
    b = rng.normal(size=V) if prob.get("bias") else None
    ids, lp = topk_teacher(rng, N, V, K, prob.get("duplicates", False))
    lp = lp.astype(np.float64)
    y = rng.integers(0, V, size=N) if prob.get("target") else None
    if y is not None:
        y[4] = -100
    mask = rng.random(N) > 0.2 if prob.get("mask") else None
    num_items = prob.get("num_items")
    ref = linear_topk_distillation_reference(
        x, W, ids, lp, target=y, linear_bias=b, row_mask=mask, options=o, weight_layout=layout,
        num_items_in_batch=num_items, grad_output=(g := rng.normal(size=N) if o.reduction == "none" else 0.7))
    t = lambda a: None if a is None else torch.tensor(a, dtype=torch.float64, requires_grad=True)
    xt, Wt, bt = t(x), t(W), t(b)
    loss = naive_topk(xt, Wt, bt, torch.tensor(ids), torch.tensor(lp), None if y is None else torch.tensor(y),
                      None if mask is None else torch.tensor(mask), o, layout, num_items)
    grads = torch.autograd.grad(loss, [a for a in (xt, Wt, bt) if a is not None], torch.as_tensor(g, dtype=torch.float64))
    np.testing.assert_allclose(ref.loss, loss.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ref.grad_input, grads[0].numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ref.grad_weight, grads[1].numpy(), rtol=RTOL, atol=ATOL)
    if b is not None:
        np.testing.assert_allclose(ref.grad_bias, grads[2].numpy(), rtol=RTOL, atol=ATOL)


def test_topk_reference_nan_rows_for_bad_ids():
    rng = np.random.default_rng(0)
    ids, lp = topk_teacher(rng, N, V, K)
    ids[5, 0] = V
    ref = linear_topk_distillation_reference(rng.normal(size=(N, D)), rng.normal(size=(V, D)), ids, lp,
                                             options=TopKDistillationOptions(reduction="none"))
    assert np.isnan(ref.loss[5]) and np.isfinite(np.delete(ref.loss, 5)).all()
    assert np.isnan(ref.grad_input[5]).all() and np.isfinite(np.delete(ref.grad_input, 5, axis=0)).all()


def naive_dense(x, W, xt, Wt, y, mask, o: DenseDistillationOptions, layout, num_items):
    W_VD, Wt_VD = (W, Wt) if layout == "VD" else (W.T, Wt.T)
    vm = min(W_VD.shape[0], Wt_VD.shape[0])
    lq = F.log_softmax(x @ W_VD[:vm].T / o.temperature, -1)
    lp = F.log_softmax(xt @ Wt_VD[:vm].T / o.temperature, -1)
    if o.divergence == "forward_kl":
        div = F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)
    elif o.divergence == "reverse_kl":
        div = F.kl_div(lp, lq, log_target=True, reduction="none").sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lp + math.log(o.beta), lq + math.log(1 - o.beta)]), 0)
        div = o.beta * F.kl_div(lm, lp, log_target=True, reduction="none").sum(-1) + \
            (1 - o.beta) * F.kl_div(lm, lq, log_target=True, reduction="none").sum(-1)
    return _reduce_valid_rows(o.scale * div, y, mask, o, num_items)


DENSE_CASES = {
    "forward-kl": (dict(), dict()),
    "reverse-kl-T-sum": (dict(divergence="reverse_kl", temperature=2.0, reduction="sum"), dict()),
    "jsd-none-target": (dict(divergence="jsd", beta=0.3, reduction="none"), dict(target=True)),
    "jsd-bigger-teacher-vocab-dv": (dict(divergence="jsd", temperature=0.7), dict(teacher_vocab=V + 5, layout="DV")),
    "forward-kl-smaller-teacher-vocab-count": (dict(temperature_squared=False), dict(teacher_vocab=V - 6, mask=True, num_items=5)),
}


@pytest.mark.parametrize("name", list(DENSE_CASES))
def test_dense_reference_matches_autograd(name):
    opts_kw, prob = DENSE_CASES[name]
    o = DenseDistillationOptions(**opts_kw)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    layout, Vt, Dt = prob.get("layout", "VD"), prob.get("teacher_vocab", V), D + 2
    x, xt = rng.normal(size=(N, D)), rng.normal(size=(N, Dt))
    W = rng.normal(size=(V, D) if layout == "VD" else (D, V))
    Wt = rng.normal(size=(Vt, Dt) if layout == "VD" else (Dt, Vt)) * 1.5
    y = rng.integers(0, V, size=N) if prob.get("target") else None
    if y is not None:
        y[3] = -100
    mask = rng.random(N) > 0.2 if prob.get("mask") else None
    num_items = prob.get("num_items")
    g = rng.normal(size=N) if o.reduction == "none" else 1.3
    ref = linear_distillation_reference(x, W, xt, Wt, target=y, row_mask=mask, options=o, weight_layout=layout,
                                        num_items_in_batch=num_items, grad_output=g)
    t = lambda a: torch.tensor(a, dtype=torch.float64, requires_grad=True)
    xv, Wv = t(x), t(W)
    loss = naive_dense(xv, Wv, torch.tensor(xt), torch.tensor(Wt), None if y is None else torch.tensor(y),
                       None if mask is None else torch.tensor(mask), o, layout, num_items)
    gx, gW = torch.autograd.grad(loss, [xv, Wv], torch.as_tensor(g, dtype=torch.float64))
    np.testing.assert_allclose(ref.loss, loss.detach().numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ref.grad_input, gx.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(ref.grad_weight, gW.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), "temperature"),
    (dict(tail_bucket=True), "tail_bucket"),
    (dict(weight_hard=-1.0), "weight_hard"),
    (dict(reduction="avg"), "reduction"),
])
def test_topk_options_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TopKDistillationOptions(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(divergence="kl"), "divergence"),
    (dict(divergence="jsd", beta=1.0), "beta"),
    (dict(temperature=-1), "temperature"),
])
def test_dense_options_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DenseDistillationOptions(**kwargs)
