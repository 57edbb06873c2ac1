"""The parity suite: the same buffers through `torch_impl` and `jax_impl`.

For every case (tests.frameworks.CASES, and `LOG_PROBS_CASES` of `linear_log_probs`), dtype
and strategy, the inputs are created once as torch tensors and handed to JAX through DLPack
(interop.dlpack, no copy); both frameworks compute every output (loss and lse, or
log-probabilities and entropy) and every gradient for the same upstream gradients. Each is
compared with the float64 spec, and with the other: a disagreement between the two
implementations, or an error against the spec, above the dtype's tolerance fails.

On the CPU (tests/test_parity.py) it runs small shapes with the kernels in their
interpreters. On a GPU, one command runs it at larger shapes and writes a report:

    python -m tests.parity --device cuda --out bench/results/parity_cuda

(parity.json with every error, parity.md with the worst per case, both rewritten after each
case; `--resume` runs only the cases a cut run left; exit status 1 on a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from interop.tuning import DEFAULT, Tuning
from tests.frameworks import CASES, make_problem, reference, rel_err, seed_of, tolerance, torch_outputs, upstream_grads

STRATEGIES = ("chunked", "speed", "memory")
OUTPUTS = ("loss", "lse", "log_probs", "entropy", "grad_x", "grad_W", "grad_b")
# linear_log_probs: name -> (options, make_problem arguments)
LOG_PROBS_CASES = {
    "log-probs": (dict(), dict()),
    "log-probs-T0.7-softcap-bias": (dict(temperature=0.7, softcap=4.0), dict(bias=True, logit_scale=3.0)),
}


def _torch_side(tensors, options, strategy, g_out, g_lse, tuning):
    import torch_impl

    x, W, b, cw, y = (t.detach().requires_grad_(t.is_floating_point() and k in "xWb") if t is not None else None
                      for k, t in zip("xWbcy", tensors))
    loss, lse = torch_impl.linear_cross_entropy(x, W, y, linear_bias=b, weight=cw, return_lse=True, strategy=strategy,
                                                tuning=tuning, **options)
    return torch_outputs(loss, lse, {"x": x, "W": W, "b": b}, g_out, g_lse)


def _jax_side(arrays, options, strategy, g_out, g_lse, tuning):
    import jax
    import jax.numpy as jnp

    import jax_impl

    x, W, b, cw, y = arrays

    def f(x, W, b):
        return jax_impl.linear_cross_entropy(x, W, y, linear_bias=b, weight=cw, return_lse=True, strategy=strategy,
                                             tuning=tuning, **options)

    (loss, lse), vjp = jax.vjp(f, x, W, b)
    g_lse = np.zeros(lse.shape) if g_lse is None else g_lse
    gx, gW, gb = vjp((jnp.asarray(g_out, loss.dtype), jnp.asarray(g_lse, lse.dtype)))
    result = {"loss": loss, "lse": lse, "grad_x": gx, "grad_W": gW}
    if b is not None:
        result["grad_b"] = gb
    return {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in result.items()}


def _shared(p, dtype: str, device: str):
    """p's x, W, b (None) and int32 targets as torch tensors, and the same buffers as JAX arrays."""
    import torch

    from interop.dlpack import to_jax

    tdt = getattr(torch, dtype)
    # Created once, in torch, and shared with JAX without a copy.
    tensors = [None if a is None else torch.tensor(a).to(device=device, dtype=tdt) for a in (p.x, p.W, p.b)]
    tensors.append(None if p.cw is None else torch.tensor(p.cw, device=device))
    tensors.append(torch.tensor(p.y.astype(np.int32), device=device))
    return tensors, [None if t is None else to_jax(t) for t in tensors]


def _compare(case, dtype, strategy, shape, tol, spec, got_t, got_j) -> dict:
    errors = {}
    for k in OUTPUTS:
        if k in got_t:
            errors[k] = {"torch": rel_err(got_t[k], spec[k]), "jax": rel_err(got_j[k], spec[k]),
                         "torch_vs_jax": rel_err(got_t[k], got_j[k])}
    failed = sorted(f"{k}:{side}" for k, e in errors.items() for side, v in e.items() if not v <= tol)
    return {"case": case, "dtype": dtype, "strategy": strategy, "shape": shape, "tolerance": tol, "errors": errors,
            "failed": failed}


def run_case(case: str, dtype: str, strategy: str, device: str, lead=(13,), hidden=19, vocab=53,
             tuning: Tuning = DEFAULT) -> dict:
    """Errors of both frameworks against the spec and against each other, for one case, both
    planning their blocks with `tuning`."""
    if case in LOG_PROBS_CASES:
        return _run_log_probs_case(case, dtype, strategy, device, lead, hidden, vocab, tuning)
    options, problem_kwargs, with_lse = CASES[case]
    problem_kwargs = dict(problem_kwargs)
    lead = problem_kwargs.pop("lead", lead)
    seed = seed_of(case, dtype, strategy)
    p = make_problem(seed, lead=lead, hidden=hidden, vocab=vocab, dtype=dtype, **problem_kwargs)
    g_out, g_lse = upstream_grads(seed, p, options.get("reduction", "mean"), with_lse)
    tensors, arrays = _shared(p, dtype, device)
    ref = reference(p, options, g_out, g_lse)
    spec = {"loss": ref.loss, "lse": ref.lse, "grad_x": ref.grad_input, "grad_W": ref.grad_weight, "grad_b": ref.grad_bias}
    got_t = _torch_side(tensors, options, strategy, g_out, g_lse, tuning)
    got_j = _jax_side(arrays, options, strategy, g_out, g_lse, tuning)
    return _compare(case, dtype, strategy, [*lead, hidden, vocab], tolerance(dtype, p.logit_scale), spec, got_t, got_j)


def _run_log_probs_case(case, dtype, strategy, device, lead, hidden, vocab, tuning) -> dict:
    """`run_case` for `linear_log_probs`: log-probabilities and entropy, and the gradients of
    random upstream gradients of both."""
    import jax
    import jax.numpy as jnp

    import jax_impl
    import torch_impl
    from interop.log_probs_reference import linear_log_probs_reference

    options, problem_kwargs = LOG_PROBS_CASES[case]
    seed = seed_of(case, dtype, strategy)
    p = make_problem(seed, lead=lead, hidden=hidden, vocab=vocab, dtype=dtype, **problem_kwargs)
    rng = np.random.default_rng(seed + 1)
    g_lp, g_h = rng.standard_normal(p.y.shape), rng.standard_normal(p.y.shape)
    (x, W, b, _, y), arrays = _shared(p, dtype, device)
    leaves = {k: None if t is None else t.detach().requires_grad_() for k, t in zip("xWb", (x, W, b))}
    lp, H = torch_impl.linear_log_probs(leaves["x"], leaves["W"], y, linear_bias=leaves["b"], return_entropy=True,
                                        strategy=strategy, tuning=tuning, **options)
    got_t = torch_outputs(lp, H, leaves, g_lp, g_h)
    got_t["log_probs"], got_t["entropy"] = got_t.pop("loss"), got_t.pop("lse")

    def f(x, W, b):
        return jax_impl.linear_log_probs(x, W, arrays[4], linear_bias=b, return_entropy=True, strategy=strategy,
                                         tuning=tuning, **options)

    (lp_j, H_j), vjp = jax.vjp(f, *arrays[:3])
    grads = vjp((jnp.asarray(g_lp, lp_j.dtype), jnp.asarray(g_h, H_j.dtype)))
    got_j = {"log_probs": lp_j, "entropy": H_j, **dict(zip(("grad_x", "grad_W", "grad_b"), grads))}
    got_j = {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in got_j.items() if v is not None}
    ref = linear_log_probs_reference(p.x, p.W, p.y, linear_bias=p.b, grad_log_probs=g_lp, grad_entropy=g_h, **options)
    spec = {"log_probs": ref.log_probs, "entropy": ref.entropy, "grad_x": ref.grad_input, "grad_W": ref.grad_weight,
            "grad_b": ref.grad_bias}
    return _compare(case, dtype, strategy, [*lead, hidden, vocab], tolerance(dtype, p.logit_scale), spec, got_t, got_j)


def markdown(results: list[dict]) -> str:
    lines = ["| case | dtype | strategy | tolerance | worst torch | worst jax | worst torch vs jax | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        worst = {side: max(e[side] for e in r["errors"].values()) for side in ("torch", "jax", "torch_vs_jax")}
        lines.append(f"| {r['case']} | {r['dtype']} | {r['strategy']} | {r['tolerance']:.1e} | {worst['torch']:.1e} | "
                     f"{worst['jax']:.1e} | {worst['torch_vs_jax']:.1e} | {', '.join(r['failed']) or '-'} |")
    return "\n".join(lines) + "\n"


def environment(device: str) -> dict:
    """Device name, versions and date, for the report."""
    import datetime
    import platform

    import jax
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu")
    return {"device": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__}


def write_report(out: str, env: dict, args, results: list[dict]) -> None:
    """parity.json (every error) and parity.md (the worst per case) in the folder `out`."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "parity.json"), "w") as f:
        json.dump({"environment": env, "shape": [args.rows, args.hidden, args.vocab], "results": results}, f, indent=1)
    with open(os.path.join(out, "parity.md"), "w") as f:
        f.write(f"Parity suite on {env['device']} ({env['date']}; torch {env['torch']}, jax {env['jax']}), "
                f"N={args.rows}, D={args.hidden}, V={args.vocab}: worst relative errors per case.\n\n")
        f.write(markdown(results))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.parity", description="The parity suite, with a report.")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True, help="folder for parity.json and parity.md")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=257)
    parser.add_argument("--vocab", type=int, default=5003)
    parser.add_argument("--resume", action="store_true",
                        help="keep the cases of the folder's parity.json (same shape and device) and run the others")
    args = parser.parse_args(argv)
    env = environment(args.device)
    results, path = [], os.path.join(args.out, "parity.json")
    if args.resume and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("shape") == [args.rows, args.hidden, args.vocab] and old["environment"]["device"] == env["device"]:
            results = old["results"]
    done = {(r["case"], r["dtype"], r["strategy"]) for r in results}
    for case in [*CASES, *LOG_PROBS_CASES]:
        for dtype in ("bfloat16", "float16", "float32"):
            for strategy in STRATEGIES:
                if (case, dtype, strategy) in done:
                    continue
                r = run_case(case, dtype, strategy, args.device, (args.rows,), args.hidden, args.vocab)
                print(f"{case:>24} {dtype:>9} {strategy:>8} {'FAILED ' + ', '.join(r['failed']) if r['failed'] else 'ok'}", flush=True)
                results.append(r)
                # Rewritten after every case, so that a run cut short keeps what it finished.
                write_report(args.out, env, args, results)
    failures = sum(bool(r["failed"]) for r in results)
    print(f"{len(results) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
