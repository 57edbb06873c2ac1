"""Distillation test inputs and one runner per framework (as tests/frameworks.py does for
cross-entropy): a problem of numpy arrays exact in the test dtype, the float64 reference,
`run(framework, strategy, problem, options, grad_output, tuning=...)` returning float64
numpy, and the cases the distillation tests share (CASES, `case_inputs`, `errors`)."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from interop.distill_reference import linear_distillation_reference, linear_topk_distillation_reference
from interop.distillation import DenseDistillationOptions, TopKDistillationOptions
from interop.tuning import DEFAULT, Tuning
from tests.frameworks import _NUMPY_DTYPE, rel_err, round_to


def topk_teacher(rng, n, vocab, k, duplicates=False):
    """Teacher ids [n, k] and log-probs of a random teacher's top-k, with padding entries
    (id -1, or logprob -inf), a row without entries and, optionally, a repeated id."""
    logits = rng.normal(size=(n, vocab)) * 2
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ids = np.argsort(-logp, axis=1)[:, :k]
    lp = np.take_along_axis(logp, ids, axis=1).astype(np.float32)
    ids[0, -1] = -1
    lp[1, -2:] = -np.inf
    ids[2, :] = -1
    if duplicates:
        ids[3, 1] = ids[3, 0]
    return ids, lp


@dataclasses.dataclass
class DistillProblem:
    """kind "topk": teacher = (ids [..., K], logprobs [..., K]); kind "dense": teacher =
    (teacher input [..., Dt], teacher weight). x, W (and b) hold values exact in dtype."""

    kind: str
    x: np.ndarray
    W: np.ndarray
    teacher: tuple
    y: np.ndarray | None
    b: np.ndarray | None
    mask: np.ndarray | None
    dtype: str
    weight_layout: str = "VD"


def make_problem(kind: str, seed: int, lead=(13,), hidden=19, vocab=53, k=5, dtype="float32", *, weight_layout="VD",
                 bias=False, target=False, mask=False, teacher_vocab=None, duplicates=False, logit_scale=1.0):
    rng = np.random.default_rng(seed)
    n = int(np.prod(lead))
    x = round_to(rng.standard_normal(tuple(lead) + (hidden,)) * logit_scale, dtype)
    W = rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)
    W = round_to(W if weight_layout == "VD" else W.T, dtype)
    if kind == "topk":
        ids, lp = topk_teacher(rng, n, vocab, k, duplicates)
        teacher = (ids.reshape(tuple(lead) + (k,)), lp.reshape(tuple(lead) + (k,)))
    else:
        vt, dt = teacher_vocab or vocab, hidden + 3
        Wt = rng.standard_normal((vt, dt)) * 1.5 / np.sqrt(dt)
        teacher = (round_to(rng.standard_normal(tuple(lead) + (dt,)) * logit_scale, dtype),
                   round_to(Wt if weight_layout == "VD" else Wt.T, dtype))
    y = None
    if target:
        y = rng.integers(0, vocab, size=lead)
        y[rng.random(lead) < 0.2] = -100
    return DistillProblem(
        kind, x, W, teacher, y, round_to(rng.standard_normal(vocab) * 0.5, dtype) if bias else None,
        rng.random(lead) > 0.2 if mask else None, dtype, weight_layout)


def options_of(p: DistillProblem, options: dict):
    return (TopKDistillationOptions if p.kind == "topk" else DenseDistillationOptions)(**options)


def reference(p: DistillProblem, options: dict, grad_output, num_items=None):
    common = dict(target=p.y, row_mask=p.mask, options=options_of(p, options), weight_layout=p.weight_layout,
                  num_items_in_batch=num_items, grad_output=grad_output)
    if p.kind == "topk":
        return linear_topk_distillation_reference(p.x, p.W, *p.teacher, linear_bias=p.b, **common)
    return linear_distillation_reference(p.x, p.W, *p.teacher, **common)


def _torch_run(strategy, p: DistillProblem, options, grad_output, num_items, device, tuning):
    import torch

    import torch_impl

    dt = getattr(torch, p.dtype)
    t = lambda a, dtype=None: None if a is None else torch.as_tensor(np.array(a)).to(device=device, dtype=dtype)
    x, W = t(p.x, dt).requires_grad_(), t(p.W, dt).requires_grad_()
    b = None if p.b is None else t(p.b, dt).requires_grad_()
    common = dict(target=t(p.y), row_mask=t(p.mask), weight_layout=p.weight_layout, strategy=strategy,
                  num_items_in_batch=num_items, tuning=tuning, **options)
    if p.kind == "topk":
        loss = torch_impl.linear_topk_distillation(x, W, t(p.teacher[0]), t(p.teacher[1]), linear_bias=b, **common)
    else:
        loss = torch_impl.linear_distillation(x, W, t(p.teacher[0], dt), t(p.teacher[1], dt), **common)
    wrt = [a for a in (x, W, b) if a is not None]
    grads = torch.autograd.grad(loss, wrt, torch.as_tensor(grad_output, dtype=loss.dtype, device=loss.device))
    for g, a in zip(grads, wrt):
        assert g.dtype == a.dtype, f"gradient dtype {g.dtype} != input dtype {a.dtype}"
    out = {"loss": loss, "grad_x": grads[0], "grad_W": grads[1]}
    if b is not None:
        out["grad_b"] = grads[2]
    return {k: v.detach().double().cpu().numpy() for k, v in out.items()}


def _jax_run(strategy, p: DistillProblem, options, grad_output, num_items, tuning):
    import jax
    import jax.numpy as jnp

    import jax_impl

    dt = _NUMPY_DTYPE[p.dtype]
    arrays = {"x": jnp.asarray(p.x, dt), "W": jnp.asarray(p.W, dt)}
    if p.b is not None:
        arrays["b"] = jnp.asarray(p.b, dt)
    maybe = lambda a: None if a is None else jnp.asarray(a)

    def f(a):
        common = dict(target=maybe(p.y), row_mask=maybe(p.mask), weight_layout=p.weight_layout, strategy=strategy,
                      num_items_in_batch=num_items, tuning=tuning, **options)
        if p.kind == "topk":
            return jax_impl.linear_topk_distillation(a["x"], a["W"], jnp.asarray(p.teacher[0]), jnp.asarray(p.teacher[1]),
                                                     linear_bias=a.get("b"), **common)
        return jax_impl.linear_distillation(a["x"], a["W"], jnp.asarray(p.teacher[0], dt), jnp.asarray(p.teacher[1], dt), **common)

    @jax.jit
    def loss_and_grads(a, g):
        loss, vjp = jax.vjp(f, a)
        return loss, vjp(g.astype(loss.dtype))[0]

    loss, grads = loss_and_grads(arrays, jnp.asarray(grad_output, jnp.float32))
    for k in arrays:
        assert grads[k].dtype == arrays[k].dtype, f"grad_{k} dtype {grads[k].dtype} != input dtype {arrays[k].dtype}"
    out = {"loss": loss, **{f"grad_{k}": g for k, g in grads.items()}}
    return {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in out.items()}


def run(framework: str, strategy: str, p: DistillProblem, options: dict, grad_output, num_items=None, device="cpu",
        tuning: Tuning = DEFAULT):
    """Loss and gradients (grad_x, grad_W, grad_b when there is a bias) as float64 numpy."""
    if framework == "torch":
        return _torch_run(strategy, p, options, grad_output, num_items, device, tuning)
    return _jax_run(strategy, p, options, grad_output, num_items, tuning)


IMPLEMENTATIONS = [(f, s) for f in ("torch", "jax") for s in ("chunked", "speed", "memory")]

# name: (options, make_problem keyword arguments[, num_items_in_batch])
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


def case_inputs(kind, name, dtype, vocab: int = 53, lead=None):
    """(problem, options, grad_output, num_items_in_batch, logit scale) of a CASES case;
    lead: the rows' shape where the case sets none (default (13,))."""
    options, problem, *count = CASES[(kind, name)]
    problem = {"lead": lead, **problem} if lead else problem
    seed = zlib.crc32(f"{kind}{name}{dtype}".encode())
    p = make_problem(kind, seed, dtype=dtype, vocab=vocab, **problem)
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(p.x.shape[:-1]) if options.get("reduction") == "none" else rng.uniform(0.5, 2.0)
    # logits of the student (and the dense teacher, 1.5x) divided by T: the scale of what is rounded
    scale = (1.5 if kind == "dense" else 1.0) / min(1.0, options.get("temperature", 1.0))
    return p, options, g, (count[0] if count else None), scale


def errors(result, ref):
    """{output: relative error} of a `run` result against the reference."""
    of = {"loss": ref.loss, "grad_x": ref.grad_input, "grad_W": ref.grad_weight, "grad_b": ref.grad_bias}
    return {k: rel_err(v, of[k]) for k, v in result.items()}
