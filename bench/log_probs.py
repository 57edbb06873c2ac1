"""Benchmark of the RL outputs (one GPU): `python -m bench.log_probs`.

Two losses of a policy head, forward + backward, at RL-like shapes: `RL` (N 32768 = 8
sequences of 4096, D 4096, V 151936: a Qwen-like head), and L, G.

- `log_probs`: `linear_log_probs`' per-token log-probabilities and entropy with random
  upstream gradients per token (what any loss of them sends back; their backward pass must
  recompute the logits). Against the naive formula on materialised bf16 logits (log_softmax
  in fp32, gather, entropy), eager, under torch.compile and under jax.jit, and against the
  RL trainers' own fused heads (`bench.rl_peers`: TRL's and verl's).
- `grpo`: GRPO's loss (clipped ratio to given old log-probabilities, beta 0.04 times the KL
  to given reference ones, advantages per sequence, a mean over the tokens):
  `linear_policy_loss` against the same formula on materialised logits (eager,
  torch.compile, jax.jit) and liger-kernel's fused GRPO loss (`LigerFusedLinearGRPOLoss`,
  its own per-sequence mean: the same work).

Per method: fwd+bwd ms (median), peak memory beyond the inputs as a multiple of the floor (the
bytes of grad_input + grad_weight), and the errors of grad_input and grad_weight against our
fp64 path (not for Liger, whose normalisation differs). With --out DIR writes
DIR/log_probs_{torch,jax}.json (both losses) and appends to DIR/history.csv (bench.store).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F

from bench import measure, rl_peers, store
from bench.__main__ import environment
from interop.policy_loss import PolicyLossOptions, mean_weight, token_terms
from torch_impl import linear_log_probs, linear_policy_loss

SHAPES = {**measure.PRESETS, "RL": (32768, 4096, 151936)}
SEQ = 4096  # tokens per sequence (Liger's loss takes [B, T, D])
GRPO = PolicyLossOptions(beta=0.04)
LOSSES = ("log_probs", "grpo")


def naive(x, W, y):
    """(log p(y), entropy) from the materialised logits: bf16 product, fp32 log_softmax."""
    logp_all = F.log_softmax((x @ W.T).float(), dim=-1)
    return logp_all.gather(-1, y.clamp(min=0)[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def naive_grpo(x, W, y, advantages, old_log_probs, ref_log_probs):
    """GRPO's loss from the materialised logits (no entropy term: none is asked for)."""
    logp = F.log_softmax((x @ W.T).float(), dim=-1).gather(-1, y.clamp(min=0)[:, None])[:, 0]
    valid = y != -100
    return token_terms(torch, GRPO, logp, None, valid, advantages, old_log_probs, ref_log_probs,
                       mean_weight(torch, valid, logp))[0].sum()


def grpo_inputs(y, device, seed=3):
    """Per-token advantages (one per sequence of SEQ tokens), old and reference log-probabilities
    near those of random logits (about -log V)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n = y.shape[0]
    adv = torch.randn(max(1, n // SEQ), 1, device=device, generator=gen).expand(-1, min(n, SEQ)).reshape(-1)
    old = -12.0 + 0.1 * torch.randn(n, device=device, generator=gen)
    return dict(advantages=adv, old_log_probs=old, ref_log_probs=old + 0.05 * torch.randn(n, device=device, generator=gen))


def torch_methods(loss):
    skipped = {}
    if loss == "log_probs":
        ours = lambda s: lambda x, W, y, _: linear_log_probs(x, W, y, return_entropy=True, strategy=s)
        naive_lp = lambda x, W, y, _: naive(x, W, y)
        methods = {"ours-speed": ours("speed"), "ours-memory": ours("memory"), "torch-eager": naive_lp,
                   "torch-compile": torch.compile(naive_lp)}
        for name, peer in (("trl-chunked", rl_peers.trl_head), ("verl-fused", rl_peers.verl_head)):
            try:
                methods[name] = (lambda head: lambda x, W, y, _: head(x, W, y))(peer())
            except ImportError as e:
                skipped[name] = f"ImportError: {e}"
        return methods, skipped
    ours = lambda s: lambda x, W, y, tok: linear_policy_loss(x, W, y, beta=GRPO.beta, strategy=s, **tok)
    methods = {"ours-speed": ours("speed"), "ours-memory": ours("memory"),
               "torch-eager": lambda x, W, y, tok: naive_grpo(x, W, y, **tok),
               "torch-compile": torch.compile(lambda x, W, y, tok: naive_grpo(x, W, y, **tok))}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        methods["liger-grpo"] = LigerFusedLinearGRPOLoss(beta=GRPO.beta, loss_type="grpo")
    except ImportError as e:
        skipped["liger-grpo"] = f"ImportError: {e}"
    return methods, skipped


def _torch_step(name, fn, x, W, y, extra):
    """One fwd+bwd: (grad_x, grad_W). extra: (g_lp, g_h) for log_probs, the GRPO inputs for grpo."""
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    if name == "liger-grpo":
        B = x.shape[0] // SEQ
        mask = (y != -100).view(B, SEQ).int()
        loss = fn(x.view(B, SEQ, -1), W, y.clamp(min=0).view(B, SEQ), mask, extra["advantages"].view(B, SEQ)[:, 0],
                  ref_per_token_logps=extra["ref_log_probs"].view(B, SEQ),
                  old_per_token_logps=extra["old_log_probs"].view(B, SEQ))[0]
    elif isinstance(extra, dict):
        loss = fn(x, W, y, extra)
    else:
        logp, entropy = fn(x, W, y, None)
        loss = (logp * extra[0]).sum() + (entropy * extra[1]).sum()
    loss.backward()
    return x.grad, W.grad


def _extras(loss, y, device):
    """The upstream gradients (log_probs) or the GRPO inputs (grpo), on `device`."""
    if loss == "grpo":
        return grpo_inputs(y, device)
    gen = torch.Generator(device=device).manual_seed(3)
    g_lp, g_h = (torch.randn(y.shape[0], device=device, generator=gen) for _ in range(2))
    return torch.where(y != -100, g_lp, 0.0), g_h


def _reference(loss, x, W, y, extra):
    """(grad_x, grad_W) of our fp64 path ("chunked": fp64 logits)."""
    if loss == "grpo":
        wide = {k: v.double() for k, v in extra.items()}
        ref = lambda a, b, c, tok: linear_policy_loss(a, b, c, beta=GRPO.beta, strategy="chunked", **tok)
        return _torch_step("ref", ref, x.double(), W.double(), y, wide)
    ref = lambda a, b, c, _: linear_log_probs(a, b, c, return_entropy=True, strategy="chunked")
    return _torch_step("ref", ref, x.double(), W.double(), y, tuple(t.double() for t in extra))


def run_torch(shapes, device, repeat, log, only=None, losses=LOSSES):
    rows, methods_skipped = [], {}
    for shape in shapes:
        n, d, v = SHAPES[shape]
        x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, device)
        floor = x.numel() * x.element_size() + W.numel() * W.element_size()
        for loss in losses:
            extra = _extras(loss, y, device)
            ref = _reference(loss, x, W, y, extra)
            methods, skipped = torch_methods(loss)
            methods_skipped.update(skipped)
            for name, fn in methods.items():
                if only is not None and name not in only:
                    continue

                def fill(row, name=name, fn=fn, ref=ref, extra=extra):
                    step = lambda: _torch_step(name, fn, x, W, y, extra)
                    row["fwd_bwd_ms"] = measure.time_ms(step, device, repeat=repeat)
                    peak = measure.peak_extra_bytes(step, device)
                    row.update(peak_extra_mib=peak / 2**20, floor_ratio=peak / floor)
                    if name != "liger-grpo":
                        dx, dW = step()
                        row.update(grad_x_err=measure.rel_err(dx, ref[0]), grad_W_err=measure.rel_err(dW, ref[1]))

                row = {"shape": shape, "N": n, "D": d, "V": v, "loss": loss, "framework": "torch", "method": name,
                       "dtype": "bfloat16"}
                rows.append(measure.record(row, fill, log))
            del ref
    return rows, methods_skipped


def _host_inputs(shape: str, losses):
    """A shape's inputs on the host for JAX: ((x, W) fp32 arrays of bf16 values, y int32), the
    floor in bytes, and per loss (its upstream gradients or GRPO inputs, the float64 path's
    (grad_x, grad_W) in fp32), made by PyTorch on the GPU."""
    n, d, v = SHAPES[shape]
    device = torch.device("cuda")
    x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, device)
    per_loss = {}
    for loss in losses:
        extra = _extras(loss, y, device)
        ref = [r.float().cpu().numpy() for r in _reference(loss, x, W, y, extra)]
        per_loss[loss] = ({k: t.cpu().numpy() for k, t in extra.items()} if loss == "grpo"
                          else tuple(t.cpu().numpy() for t in extra), ref)
    return ((x.float().cpu().numpy(), W.float().cpu().numpy(), y.cpu().numpy().astype(np.int32)),
            x.numel() * 2 + W.numel() * 2, per_loss)


def run_jax(shapes, repeat, log, only=None, losses=LOSSES):
    import jax
    import jax.numpy as jnp

    import jax_impl

    def naive_jax(x, W, y, _):
        logp_all = jax.nn.log_softmax((x @ W.T).astype(jnp.float32), axis=-1)
        logp = jnp.take_along_axis(logp_all, jnp.maximum(y, 0)[:, None], -1)[:, 0]
        return logp, -(jnp.exp(logp_all) * logp_all).sum(-1)

    def naive_grpo_jax(x, W, y, tok):
        logp = naive_jax(x, W, y, None)[0]
        valid = y != -100
        return token_terms(jnp, GRPO, logp, None, valid, tok["advantages"], tok["old_log_probs"], tok["ref_log_probs"],
                           mean_weight(jnp, valid, logp))[0].sum()

    log_probs = lambda s: lambda x, W, y, _: jax_impl.linear_log_probs(x, W, y, return_entropy=True, strategy=s)
    grpo = lambda s: lambda x, W, y, tok: jax_impl.linear_policy_loss(x, W, y, beta=GRPO.beta, strategy=s, **tok)
    methods = {"log_probs": {"jax-ours-speed": log_probs("speed"), "jax-ours-memory": log_probs("memory"),
                             "jax-naive": naive_jax},
               "grpo": {"jax-ours-speed": grpo("speed"), "jax-ours-memory": grpo("memory"), "jax-naive": naive_grpo_jax}}
    # Every torch-side input and float64 reference first, on the host (about 24 GB for RL, L
    # and G): once JAX has run, its allocator keeps the GPU memory it took (a method that ran
    # out of memory takes it all).
    prepared = {shape: _host_inputs(shape, losses) for shape in shapes}
    torch.cuda.empty_cache()
    rows = []
    for shape in shapes:
        n, d, v = SHAPES[shape]
        (x_host, W_host, y_host), floor, per_loss = prepared.pop(shape)
        x, W = (jnp.asarray(t).astype(jnp.bfloat16) for t in (x_host, W_host))
        y = jnp.asarray(y_host)
        for loss in losses:
            extra_host, ref = per_loss[loss]
            extra = ({k: jnp.asarray(t) for k, t in extra_host.items()} if loss == "grpo"
                     else tuple(jnp.asarray(t) for t in extra_host))
            for name, fn in methods[loss].items():
                if only is not None and name not in only:
                    continue

                def fill(row, fn=fn, extra=extra, ref=ref, loss=loss):
                    def objective(x_, W_):
                        if loss == "grpo":
                            return fn(x_, W_, y, extra)
                        logp, entropy = fn(x_, W_, y, None)
                        return (logp * extra[0]).sum() + (entropy * extra[1]).sum()

                    compiled = jax.jit(jax.grad(objective, argnums=(0, 1))).lower(x, W).compile()
                    row["fwd_bwd_ms"] = measure.time_ms(lambda: jax.block_until_ready(compiled(x, W)),
                                                        torch.device("cuda"), repeat=repeat, events=False)
                    mem = compiled.memory_analysis()
                    peak = mem.temp_size_in_bytes + mem.output_size_in_bytes
                    row.update(peak_extra_mib=peak / 2**20, floor_ratio=peak / floor)
                    dx, dW = (torch.from_numpy(np.asarray(g.astype(jnp.float32))) for g in compiled(x, W))
                    row.update(grad_x_err=measure.rel_err(dx, torch.from_numpy(ref[0])),
                               grad_W_err=measure.rel_err(dW, torch.from_numpy(ref[1])))

                row = {"shape": shape, "N": n, "D": d, "V": v, "loss": loss, "framework": "jax", "method": name,
                       "dtype": "bfloat16"}
                rows.append(measure.record(row, fill, log))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.log_probs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="RL,L,G")
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    parser.add_argument("--out", default=None, help="folder for log_probs_{torch,jax}.json (overwritten) and history.csv")
    args = parser.parse_args(argv)
    device = torch.device("cuda")

    def log(r):
        head = f"{r['shape']} {r['loss']:>9} {r['method']:>16}"
        if "error" in r:
            print(f"{head}  {r['error']}", flush=True)
            return
        errs = "" if "grad_x_err" not in r else f"  err dx {r['grad_x_err']:.1e} dW {r['grad_W_err']:.1e}"
        print(f"{head}  fwd+bwd {r['fwd_bwd_ms']:8.2f} ms  mem {r['floor_ratio']:5.2f}x floor{errs}", flush=True)

    only = None if args.methods is None else set(args.methods.split(","))
    shapes, frameworks, losses = args.shapes.split(","), args.frameworks.split(","), args.losses.split(",")
    rows, skipped = run_torch(shapes, device, args.repeat, log, only, losses) if "torch" in frameworks else ([], {})
    if "jax" in frameworks:
        rows += run_jax(shapes, args.repeat, log, only, losses)
    env = environment(device)
    if args.out:
        report = {"environment": env, "command": store.command("python -m bench.log_probs", argv), "skipped": skipped,
                  "results": rows}
        store.write_json(report, args.out, "log_probs")
        store.append_history(rows, env, args.out, "log_probs")
    else:
        print(json.dumps({"environment": env}, indent=1))


if __name__ == "__main__":
    main()
