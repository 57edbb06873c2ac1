"""`linear_policy_loss` (PPO/GRPO's clipped policy-gradient loss) in both frameworks against its
float64 reference, itself checked against float64 autograd of the formula on materialised
logits: every strategy (several row and column blocks), bf16/fp32/fp64, layouts, ignored
tokens, both clips, the KL and entropy terms, errors named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from interop.log_probs_reference import linear_log_probs_reference, linear_policy_loss_reference
from interop.policy_loss import TOKEN_ARGUMENTS
from tests.frameworks import SMALL, laid_out, make_problem, materialised_policy, rel_err, seed_of, tolerance
from tests.frameworks import device as default_device

# name -> (loss options, make_problem arguments, per-token inputs: which of "old", "ref", "weight")
CASES = {
    "on-policy": (dict(), dict(), ()),
    "clipped-kl": (dict(beta=0.04, epsilon_high=0.28), dict(), ("old", "ref")),
    "entropy-T-bias-softcap": (dict(entropy_coef=0.01, temperature=0.7, softcap=4.0, epsilon_low=0.1),
                               dict(bias=True, logit_scale=3.0, lead=(2, 7)), ("old",)),
    # every per-token input; the KL and the entropy weighed otherwise than the policy term
    "weights-ignore": (dict(beta=0.1, entropy_coef=0.02, ignore_index=3), dict(ignore_index=3),
                       ("old", "ref", "weight", "policy", "terms")),
    # verl's dual-clip, TRL's bias-corrected KL and importance-sampling weights (0: a mask)
    "dual-clip-corrected-kl-is": (dict(beta=0.04, clip_ratio_c=1.5, kl_bias_correction=True), dict(lead=(4, 7)),
                                  ("old", "ref", "policy")),
}
STRATEGIES = ["speed", "memory", "chunked"]
# The runs differentiate SCALE times the loss (as a loss divided for gradient accumulation,
# or multiplied by AMP's scaler), and report the gradients divided by it.
SCALE = 2.5
RUNS = [(f, s) for f in ("torch", "jax") for s in STRATEGIES]


def _problem(case: str, dtype: str, layout: str = "VD", vocab: int = 53, lead=None):
    """(problem, options, per-token inputs as float64 numpy of the target's shape)."""
    options, kwargs, which = CASES[case]
    kwargs = {"lead": lead, **kwargs} if lead else kwargs  # the rows' shape where the case sets none
    seed = seed_of("policy", case, dtype, layout)
    p = make_problem(seed, dtype=dtype, weight_layout=layout, vocab=vocab, **kwargs)
    rng = np.random.default_rng(seed + 1)
    shape = p.y.shape
    tokens = {"advantages": rng.standard_normal(shape[:-1] + (1,))}  # one per sequence, broadcast
    if "clip_ratio_c" in options:  # the dual-clip bounds negative advantages (all of them: a sum without cancellation)
        tokens["advantages"] = -np.abs(tokens["advantages"])
    # old log-probabilities within a ratio of 0.5 to 2 of the policy's: both clips are hit
    logp = ref_logp(p, options)
    if "old" in which:
        tokens["old_log_probs"] = logp + rng.uniform(-0.7, 0.7, shape)
    if "ref" in which:
        tokens["ref_log_probs"] = logp + rng.uniform(-0.5, 0.5, shape)
    if "weight" in which:
        tokens["token_weight"] = rng.uniform(0.0, 1.0, shape) / shape[-1]
    if "policy" in which:
        tokens["policy_weight"] = rng.uniform(0.5, 1.5, shape) * (rng.random(shape) > 0.2)
    if "terms" in which:
        tokens["kl_weight"] = rng.uniform(0.0, 2.0, shape) / shape[-1]
        tokens["entropy_weight"] = np.full(shape, 1.0 / p.y.size)
    return p, options, tokens


def ref_logp(p, options):
    """The policy's float64 log-probabilities of the targets (0 where ignored)."""
    head = {k: v for k, v in options.items() if k in ("temperature", "softcap", "ignore_index")}
    return linear_log_probs_reference(p.x, p.W, p.y, linear_bias=p.b, weight_layout=p.weight_layout, **head).log_probs


def _reference(p, options, tokens):
    return linear_policy_loss_reference(p.x, p.W, p.y, linear_bias=p.b, weight_layout=p.weight_layout, **options,
                                        **tokens)


def run_torch(p, options, tokens, strategy, device=None, layouts=None, tuning=SMALL, compiled=False):
    """{"loss", "grad_x", "grad_W", "grad_b"} as float64 numpy; compiled: the call under
    torch.compile(fullgraph=True)."""
    import torch_impl

    device = device or default_device()
    dtype = getattr(torch, p.dtype)
    lay = lambda k, t: t if not layouts or k not in layouts else laid_out(t, layouts[k])
    x = lay("x", torch.tensor(p.x, device=device).to(dtype)).requires_grad_()
    W = lay("W", torch.tensor(p.W, device=device).to(dtype)).requires_grad_()
    b = None if p.b is None else torch.tensor(p.b, device=device).to(dtype).requires_grad_()
    y = lay("y", torch.tensor(p.y, device=device))
    tok = {k: lay(k, torch.tensor(v, device=device).to(dtype if dtype == torch.float64 else torch.float32))
           for k, v in tokens.items()}
    def call(x, W, y, b, tok):  # the options constants of the compiled code, as a model's
        return torch_impl.linear_policy_loss(x, W, y, linear_bias=b, weight_layout=p.weight_layout, strategy=strategy,
                                             tuning=tuning, **options, **tok)

    if compiled:
        call = torch.compile(call, fullgraph=True, backend="aot_eager")
    loss = call(x, W, y, b, tok)
    assert loss.dtype == (torch.float64 if p.dtype == "float64" else torch.float32) and loss.shape == ()
    grads = torch.autograd.grad(SCALE * loss, [t for t in (x, W, b) if t is not None])
    out = dict(zip(("grad_x", "grad_W", "grad_b"), (g.double() / SCALE for g in grads)), loss=loss)
    return {k: v.detach().double().cpu().numpy() for k, v in out.items()}


def run_jax(p, options, tokens, strategy, jit=False, tuning=SMALL):
    import jax
    import jax.numpy as jnp

    import jax_impl

    dtype = getattr(jnp, p.dtype)
    args = [jnp.asarray(p.x, dtype), jnp.asarray(p.W, dtype)] + ([] if p.b is None else [jnp.asarray(p.b, dtype)])
    tok = {k: jnp.asarray(v, jnp.float64 if p.dtype == "float64" else jnp.float32) for k, v in tokens.items()}

    def f(x, W, b=None):
        return jax_impl.linear_policy_loss(x, W, jnp.asarray(p.y.astype(np.int32)), linear_bias=b,
                                           weight_layout=p.weight_layout, strategy=strategy, tuning=tuning, **options,
                                           **tok)

    grad = jax.value_and_grad(lambda *a: SCALE * f(*a), argnums=tuple(range(len(args))))
    loss, grads = (jax.jit(grad) if jit else grad)(*args)
    loss, grads = loss / SCALE, tuple(g.astype(jnp.float64 if p.dtype == "float64" else jnp.float32) / SCALE
                                      for g in grads)
    assert loss.dtype == (jnp.float64 if p.dtype == "float64" else jnp.float32) and loss.shape == ()
    out = dict(zip(("grad_x", "grad_W", "grad_b"), grads), loss=loss)
    return {k: np.asarray(v.astype(jnp.float32 if p.dtype != "float64" else jnp.float64), np.float64)
            for k, v in out.items()}


def run(framework, strategy, p, options, tokens, device=None):
    if framework == "torch":
        return run_torch(p, options, tokens, strategy, device)
    if p.dtype != "float64":
        return run_jax(p, options, tokens, strategy)
    import jax

    with jax.enable_x64(True):  # JAX computes fp64 only in its 64-bit mode
        return run_jax(p, options, tokens, strategy)


def check(got: dict, ref, dtype: str, logit_scale: float, where: str) -> None:
    tol = tolerance(dtype, logit_scale)
    for key, want in (("loss", ref.loss), ("grad_x", ref.grad_input), ("grad_W", ref.grad_weight),
                      ("grad_b", ref.grad_bias)):
        if want is not None:
            err = rel_err(got[key], want)
            assert err <= tol, f"{where}, {key}: relative error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_float64_autograd(case):
    """The reference's loss and gradients equal float64 autograd of the formula on
    materialised logits (TRL's GRPO terms), and its tokens hit both clips."""
    p, options, tokens = _problem(case, "float64")
    ref = _reference(p, options, tokens)
    leaves, _, logp, entropy, valid = materialised_policy(p, options)
    tok = {k: torch.tensor(v) for k, v in tokens.items()}
    old = tok.get("old_log_probs", logp.detach())
    ratio = torch.exp(logp - old)
    adv = tok["advantages"].expand(ratio.shape)
    eps_low, eps_high = options.get("epsilon_low", 0.2), options.get("epsilon_high", 0.2)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    if options.get("clip_ratio_c"):  # verl's dual-clip
        per_token = torch.where(adv < 0, torch.minimum(-adv * options["clip_ratio_c"], per_token), per_token)
    w = tok.get("token_weight", torch.full(ratio.shape, 1.0 / max(int(valid.sum()), 1), dtype=torch.float64))
    per_token = w * per_token * tok.get("policy_weight", 1.0)
    if options.get("beta"):
        d = tok["ref_log_probs"] - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + tok.get("kl_weight", w) * options["beta"] * (kl * ratio if options.get(
            "kl_bias_correction") else kl)
    per_token = per_token - tok.get("entropy_weight", w) * options.get("entropy_coef", 0.0) * entropy
    loss = torch.where(valid, per_token, 0.0).sum()
    grads = torch.autograd.grad(loss, leaves)
    np.testing.assert_allclose(ref.loss, loss.detach().numpy(), rtol=1e-12)
    for got, want in zip((ref.grad_input, ref.grad_weight, ref.grad_bias), grads):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-13)
    # the logged values, from the same formula (0 / False where ignored)
    kl_term = (kl * ratio if options.get("kl_bias_correction") else kl) if options.get("beta") else None
    want = dict(log_probs=logp, entropy=entropy, ratio=ratio, kl=kl_term, clipped_low=(ratio < 1 - eps_low) & (adv < 0),
                clipped_high=(ratio > 1 + eps_high) & (adv > 0))
    if options.get("clip_ratio_c"):
        unbounded = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
        want["dual_clipped"] = (adv < 0) & (unbounded > -options["clip_ratio_c"] * adv)
    want = {k: torch.where(valid, v.detach(), False if v.dtype == torch.bool else 0.0).numpy()
            for k, v in want.items() if v is not None}
    assert set(ref.stats) == set(want)
    for key, value in want.items():
        np.testing.assert_allclose(ref.stats[key], value, rtol=1e-12, atol=1e-14, err_msg=key)
    if "old_log_probs" in tokens:
        r = np.exp(ref_logp(p, options) - tokens["old_log_probs"])[p.y != options.get("ignore_index", -100)]
        assert (r < 1 - eps_low).any() and (r > 1 + eps_high).any()
        if options.get("clip_ratio_c"):  # some tokens of negative advantage meet the dual-clip's bound
            adv = np.broadcast_to(tokens["advantages"], p.y.shape)[p.y != options.get("ignore_index", -100)]
            assert ((r > options["clip_ratio_c"]) & (adv < 0)).any()


@pytest.mark.parametrize("framework, strategy", RUNS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_matches_reference(framework, strategy, case, dtype):
    """Loss and gradients within the dtype's tolerance of the float64 reference, in SMALL
    blocks (several row and column blocks, the last ones partial). fp64 runs as "chunked"."""
    if dtype == "float64" and strategy != "chunked":
        pytest.skip("fp64 runs as chunked")
    p, options, tokens = _problem(case, dtype)
    got = run(framework, strategy, p, options, tokens)
    check(got, _reference(p, options, tokens), dtype, p.logit_scale, f"{framework}, {strategy}, {case}")


# SMALL with the ignored tokens skipped at any size (by default from N D V = 2^40)
SKIP_IGNORED = dataclasses.replace(SMALL, skip_ignored_min_work=0)


@pytest.mark.parametrize("framework, strategy", [r for r in RUNS if r[1] != "chunked"])
@pytest.mark.parametrize("case", ["weights-ignore", "entropy-T-bias-softcap"])
def test_only_the_tokens_not_ignored_are_computed(framework, strategy, case, monkeypatch):
    """The kernel strategies compute only the rows whose token is not ignored (an ignored
    token adds nothing to the loss or the gradients): PyTorch's blocks hold those rows, JAX's
    row loop keeps them; the result is the reference's, grad_input 0 on the others."""
    p, options, tokens = _problem(case, "float32")
    ignored = p.y.reshape(-1) == options.get("ignore_index", -100)
    assert ignored.any() and not ignored.all()
    if framework == "torch":
        from torch_impl import log_probs_rule as log_probs

        computed = []
        original = log_probs._blocks
        monkeypatch.setattr(log_probs, "_blocks", lambda *a, **k: computed.append(original(*a, **k).n_rows) or
                            original(*a, **k))
        got = run_torch(p, options, tokens, strategy, tuning=SKIP_IGNORED)
        assert computed and set(computed) == {int((~ignored).sum())}, computed
    else:
        from jax_impl import rows

        kept = []
        original = rows.row_loop
        monkeypatch.setattr(rows, "row_loop", lambda *a, **k: kept.append(k.get("keep", a[5] if len(a) > 5 else None))
                            or original(*a, **k))
        import jax_impl.engine

        monkeypatch.setattr(jax_impl.engine, "row_loop", rows.row_loop)
        got = run_jax(p, options, tokens, strategy, tuning=SKIP_IGNORED)
        assert kept and all(k is not None for k in kept), kept
    check(got, _reference(p, options, tokens), "float32", p.logit_scale, f"{framework}, {strategy}")
    assert not got["grad_x"].reshape(-1, p.x.shape[-1])[ignored].any()


@pytest.mark.parametrize("layout", ["strided", "transposed", "expanded", "offset"])
def test_torch_layouts(layout):
    """Views of every argument that takes one (the hidden states, the head, the targets, the
    per-token tensors) give the dense call's result; DV weights too."""
    p, options, tokens = _problem("weights-ignore", "float32", "DV")
    ref = _reference(p, options, tokens)
    per_token = TOKEN_ARGUMENTS[1:]
    assert set(per_token) <= set(tokens)
    layouts = {k: layout for k in ("x", "W", "y") + per_token}
    if layout == "expanded":  # an expanded x, W or y is a different problem; the per-token tensors may be
        layouts = {k: layout for k in per_token}
        tokens = {k: laid_out(torch.tensor(v), "expanded").numpy() if k in layouts else v for k, v in tokens.items()}
        ref = _reference(p, options, tokens)
    for strategy in ("speed", "memory"):
        check(run_torch(p, options, tokens, strategy, layouts=layouts), ref, "float32", 1.0, f"{layout}, {strategy}")


def test_torch_speed_forms_gradients_in_the_forward_pass_and_recomputes_after(monkeypatch):
    """"speed" forms the gradients in the forward pass (no second pass over the logits in the
    backward), and a second backward through the same graph (retain_graph) recomputes them:
    the same gradients twice."""
    import torch_impl
    from torch_impl import log_probs_rule as log_probs

    p, options, tokens = _problem("clipped-kl", "float32")
    x = torch.tensor(p.x, device=default_device(), requires_grad=True)
    W = torch.tensor(p.W, device=default_device(), requires_grad=True)
    tok = {k: torch.tensor(v, dtype=torch.float32, device=x.device) for k, v in tokens.items()}
    calls = []
    for name in ("forward_with_grads", "backward"):
        original = getattr(log_probs, name)
        monkeypatch.setattr(log_probs, name, lambda *a, original=original, name=name, **k: calls.append(name) or
                            original(*a, **k))
    loss = torch_impl.linear_policy_loss(x, W, torch.tensor(p.y, device=x.device), strategy="speed", tuning=SMALL,
                                         **options, **tok)
    first = torch.autograd.grad(loss, (x, W), retain_graph=True)
    assert calls == ["forward_with_grads"]
    second = torch.autograd.grad(loss, (x, W))
    assert calls == ["forward_with_grads", "backward"]
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_jax_under_jit_and_nan_for_a_bad_target():
    """jax.jit gives the eager call's loss and gradients; a target out of [0, V) that is not
    ignore_index raises ValueError eagerly and gives a NaN loss under jit."""
    import jax
    import jax.numpy as jnp

    import jax_impl

    p, options, tokens = _problem("clipped-kl", "float32")
    for strategy in STRATEGIES:
        eager, jitted = run_jax(p, options, tokens, strategy), run_jax(p, options, tokens, strategy, jit=True)
        for k in eager:
            np.testing.assert_allclose(jitted[k], eager[k], rtol=1e-5, atol=1e-7)
    y = p.y.astype(np.int32)
    y.flat[2] = p.vocab
    args = (jnp.asarray(p.x), jnp.asarray(p.W), jnp.asarray(y), jnp.asarray(tokens["advantages"]))
    with pytest.raises(ValueError, match="target"):
        jax_impl.linear_policy_loss(*args)
    assert np.isnan(float(jax.jit(jax_impl.linear_policy_loss)(*args)))


def _stats(framework: str, strategy: str, p, options, tokens, compiled=False):
    """(loss, stats) of return_stats=True as float64 numpy (bool stats as bool)."""
    if framework == "torch":
        import torch_impl

        dev = default_device()
        x, W = torch.tensor(p.x, device=dev, requires_grad=True), torch.tensor(p.W, device=dev)
        tok = {k: torch.tensor(v, dtype=torch.float32, device=dev) for k, v in tokens.items()}
        call = lambda x, W, y, tok: torch_impl.linear_policy_loss(x, W, y, strategy=strategy, tuning=SMALL,
                                                                  return_stats=True, **options, **tok)
        if compiled:
            call = torch.compile(call, fullgraph=True, backend="aot_eager")
        loss, stats = call(x, W, torch.tensor(p.y, device=dev), tok)
        assert not any(v.requires_grad for v in stats.values())
        loss.backward()  # the loss keeps its gradients
    else:
        import jax.numpy as jnp

        import jax_impl

        loss, stats = jax_impl.linear_policy_loss(jnp.asarray(p.x), jnp.asarray(p.W), jnp.asarray(p.y.astype(np.int32)),
                                                  strategy=strategy, tuning=SMALL, return_stats=True, **options,
                                                  **{k: jnp.asarray(v, jnp.float32) for k, v in tokens.items()})
    as_numpy = lambda v: np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v)
    return float(as_numpy(loss)), {k: as_numpy(v) for k, v in stats.items()}


@pytest.mark.parametrize("framework, strategy", RUNS + [("torch-compiled", "speed")])
@pytest.mark.parametrize("case", ["clipped-kl", "dual-clip-corrected-kl-is", "weights-ignore"])
def test_return_stats_match_reference(framework, strategy, case):
    """return_stats=True: the same loss, and the per-token values trainers log (0 / False
    where ignored) as the float64 reference gives them, of the target's shape."""
    p, options, tokens = _problem(case, "float32")
    ref = _reference(p, options, tokens)
    loss, stats = _stats(framework.split("-")[0], strategy, p, options, tokens, compiled="compiled" in framework)
    assert rel_err(loss, ref.loss) <= tolerance("float32")
    assert set(stats) == set(ref.stats) and ("dual_clipped" in stats) == ("clip_ratio_c" in options)
    for key, want in ref.stats.items():
        assert stats[key].shape == p.y.shape, key
        if want.dtype == bool:
            assert stats[key].dtype == bool and np.array_equal(stats[key], want), key
        else:
            assert rel_err(stats[key], want) <= tolerance("float32"), key
    assert (ref.stats["clipped_low"] | ref.stats["clipped_high"]).any()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_per_token_values_of_ignored_tokens_are_never_read(framework):
    """NaN and inf in the advantages, old and reference log-probabilities and both weights of
    ignored tokens (anything may stand there) change neither the loss nor the gradients."""
    p, options, tokens = _problem("weights-ignore", "float32")
    ignored = p.y == options["ignore_index"]
    poisoned = {k: np.where(ignored, bad, np.broadcast_to(v, p.y.shape))
                for (k, v), bad in zip(tokens.items(), (np.nan, -np.inf, np.inf, np.nan, -np.inf, np.inf, np.nan),
                                       strict=True)}
    for strategy in STRATEGIES:
        clean, dirty = run(framework, strategy, p, options, tokens), run(framework, strategy, p, options, poisoned)
        for k in clean:
            np.testing.assert_array_equal(dirty[k], clean[k], err_msg=f"{strategy}, {k}")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_nan_in_a_per_token_input_is_a_nan_gradient(framework):
    """A NaN old log-probability of a valid token makes the loss NaN and that token's
    gradient NaN (as autograd of the formula gives), never a silently dropped token."""
    p, options, tokens = _problem("clipped-kl", "float32")
    row = int(np.flatnonzero(p.y.reshape(-1) != -100)[0])
    tokens["old_log_probs"].reshape(-1)[row] = np.nan
    for strategy in STRATEGIES:
        got = run(framework, strategy, p, options, tokens)
        assert np.isnan(got["loss"]) and np.isnan(got["grad_x"].reshape(-1, p.x.shape[-1])[row]).all(), strategy
    tokens["old_log_probs"].reshape(-1)[row] = 0.0  # a NaN importance-sampling weight: the same
    tokens["policy_weight"] = np.ones(p.y.shape)
    tokens["policy_weight"].reshape(-1)[row] = np.nan
    got = run(framework, "speed", p, options, tokens)
    assert np.isnan(got["loss"]) and np.isnan(got["grad_x"].reshape(-1, p.x.shape[-1])[row]).all()


def test_torch_forms_no_gradient_where_none_is_asked(monkeypatch):
    """Under torch.no_grad (an evaluation pass) "speed" computes the loss only: no gradient
    is formed in the forward pass."""
    import torch_impl
    from torch_impl import log_probs_rule as log_probs

    p, options, tokens = _problem("clipped-kl", "float32")
    calls = []
    original = log_probs.forward_with_grads
    monkeypatch.setattr(log_probs, "forward_with_grads", lambda *a, **k: calls.append(1) or original(*a, **k))
    x = torch.tensor(p.x, device=default_device(), requires_grad=True)
    args = (x, torch.tensor(p.W, device=x.device, requires_grad=True), torch.tensor(p.y, device=x.device))
    tok = {k: torch.tensor(v, dtype=torch.float32, device=x.device) for k, v in tokens.items()}
    with torch.no_grad():
        loss = torch_impl.linear_policy_loss(*args, strategy="speed", tuning=SMALL, **options, **tok)
    assert not calls
    np.testing.assert_allclose(float(loss), _reference(p, options, tokens).loss, rtol=1e-5)
    torch_impl.linear_policy_loss(*args, strategy="speed", tuning=SMALL, **options, **tok)
    assert calls


def test_torch_per_token_tensors_changed_before_the_backward_pass_raise():
    """A per-token tensor changed in place between the forward and the backward pass raises
    (as for a saved input), rather than giving the gradient of other values."""
    import torch_impl

    p, options, tokens = _problem("clipped-kl", "float32")
    x = torch.tensor(p.x, device=default_device(), requires_grad=True)
    old = torch.tensor(tokens["old_log_probs"], dtype=torch.float32, device=x.device)
    loss = torch_impl.linear_policy_loss(x, torch.tensor(p.W, device=x.device), torch.tensor(p.y, device=x.device),
                                         torch.tensor(tokens["advantages"], device=x.device), old_log_probs=old,
                                         ref_log_probs=old.clone(), strategy="memory", tuning=SMALL, beta=0.04)
    old.fill_(-10.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_nan_in_the_head_is_a_nan_loss(framework):
    """A NaN in one class of the head makes every row's softmax NaN: the loss and the
    gradients are NaN, never a finite number."""
    p, options, tokens = _problem("on-policy", "float32")
    p.W[5, 3] = np.nan
    for strategy in STRATEGIES:
        got = run(framework, strategy, p, options, tokens)
        assert np.isnan(got["loss"]) and np.isnan(got["grad_x"]).any(), strategy


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_errors_name_the_argument(framework):
    """beta > 0 without ref_log_probs, a per-token tensor of another shape, integer
    advantages, a clip range that is not one, a dual-clip bound not above 1: ValueError
    naming what is wrong."""
    import jax.numpy as jnp

    import jax_impl
    import torch_impl

    p, _, _ = _problem("on-policy", "float32")
    if framework == "torch":
        fn, arr = torch_impl.linear_policy_loss, torch.tensor
    else:
        fn, arr = jax_impl.linear_policy_loss, jnp.asarray
    x, W, y = arr(p.x), arr(p.W), arr(p.y.astype(np.int32))
    adv = arr(np.ones(p.y.shape, np.float32))
    with pytest.raises(ValueError, match="ref_log_probs"):
        fn(x, W, y, adv, beta=0.1)
    with pytest.raises(ValueError, match="old_log_probs of shape"):
        fn(x, W, y, adv, old_log_probs=arr(np.zeros(p.y.shape[0] + 1, np.float32)))
    with pytest.raises(ValueError, match="advantages must be a floating"):
        fn(x, W, y, arr(np.ones(p.y.shape, np.int32)))
    with pytest.raises(ValueError, match="epsilon_low"):
        fn(x, W, y, adv, epsilon_low=1.0)
    with pytest.raises(ValueError, match="beta"):
        fn(x, W, y, adv, beta=-1.0)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        fn(x, W, y, adv, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="kl_bias_correction must be True or False"):
        fn(x, W, y, adv, kl_bias_correction="yes")
    for name in TOKEN_ARGUMENTS[4:]:  # the weights
        with pytest.raises(ValueError, match=f"{name} of shape"):
            fn(x, W, y, adv, **{name: arr(np.ones(p.y.shape[0] + 1, np.float32))})


def test_torch_device_mix_is_named():
    """A per-token tensor on another device than the input: ValueError naming it."""
    import torch_impl

    p, _, _ = _problem("on-policy", "float32")
    x, W, y = torch.tensor(p.x), torch.tensor(p.W), torch.tensor(p.y)
    with pytest.raises(ValueError, match="old_log_probs"):
        torch_impl.linear_policy_loss(x, W, y, 1.0, old_log_probs=torch.zeros(p.y.shape, device="meta"))
    for name in TOKEN_ARGUMENTS[4:]:  # the weights
        with pytest.raises(ValueError, match=name):
            torch_impl.linear_policy_loss(x, W, y, 1.0, **{name: torch.ones(p.y.shape, device="meta")})


def test_same_arguments_and_defaults_in_both_frameworks():
    import inspect

    import jax_impl
    import torch_impl

    # sequence_parallel is PyTorch's (JAX splits rows by the operands' shardings)
    params = lambda f: [(p.name, p.default) for p in inspect.signature(f).parameters.values()
                        if p.name != "sequence_parallel"]
    assert params(torch_impl.linear_policy_loss) == params(jax_impl.linear_policy_loss)


@pytest.mark.cuda
@pytest.mark.parametrize("framework, strategy", RUNS)
def test_on_the_gpu(framework, strategy):
    """Every case in bf16 and fp32 on the GPU (PyTorch on CUDA, JAX on its default GPU), and
    the "DV" layout."""
    for case in CASES:
        for dtype in ("bfloat16", "float32"):
            p, options, tokens = _problem(case, dtype)
            got = run(framework, strategy, p, options, tokens, "cuda")
            check(got, _reference(p, options, tokens), dtype, p.logit_scale, f"{framework}, {strategy}, {case}, {dtype}")
    p, options, tokens = _problem("weights-ignore", "float32", "DV")
    check(run(framework, strategy, p, options, tokens, "cuda"), _reference(p, options, tokens), "float32", 1.0, "DV")


@pytest.mark.parametrize("on_policy", [True, False])
def test_token_terms_match_autograd_of_the_trainers_formulas(on_policy):
    """interop.policy_loss.token_terms, float64, advantages of both signs, on- and
    off-policy: the loss and its derivative in logp equal autograd of verl's dual-clip and
    TRL's bias-corrected KL with an importance-sampling weight on the policy term (the
    ratio differentiated, on-policy r = exp(logp - logp.detach()))."""
    from interop.policy_loss import PolicyLossOptions, token_terms

    rng = np.random.default_rng(9)
    n = 64
    logp = torch.tensor(rng.uniform(-4, -0.1, n), requires_grad=True)
    old = None if on_policy else torch.tensor(logp.detach().numpy() + rng.uniform(-0.9, 0.9, n))
    ref = torch.tensor(logp.detach().numpy() + rng.uniform(-0.5, 0.5, n))
    adv, v = torch.tensor(rng.standard_normal(n)), torch.tensor(rng.uniform(0, 2, n) * (rng.random(n) > 0.2))
    w, valid = torch.full((n,), 1.0 / n, dtype=torch.float64), torch.ones(n, dtype=torch.bool)
    for c, corrected in [(None, True), (1.5, True), (3.0, False)]:
        o = PolicyLossOptions(epsilon_low=0.2, epsilon_high=0.28, beta=0.04, clip_ratio_c=c, kl_bias_correction=corrected)
        r = torch.exp(logp - (logp.detach() if old is None else old))
        pg = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.28))
        if c is not None:
            pg = torch.where(adv < 0, torch.minimum(-adv * c, pg), pg)
        d = ref - logp
        kl = torch.exp(d) - d - 1
        want = (w * (v * pg + 0.04 * (r * kl if corrected else kl))).sum()
        (grad,) = torch.autograd.grad(want, logp)
        loss, g, _ = token_terms(torch, o, logp.detach(), None, valid, adv, old, ref, w, v)
        torch.testing.assert_close(loss.sum(), want.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(g, grad, rtol=1e-10, atol=1e-15)
        if c == 1.5 and not on_policy:
            assert ((adv < 0) & (-adv * r.detach() > -adv * c)).any()  # the dual-clip's bound is met
