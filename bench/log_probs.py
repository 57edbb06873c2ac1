"""Benchmark of `linear_log_probs` (one GPU): `python -m bench.log_probs`.

Per-token log-probabilities and entropy, forward + backward, of a policy head at RL-like
shapes: `RL` (N 32768 = 8 sequences of 4096, D 4096, V 151936: a Qwen-like head), and L, G.
The upstream gradients are random per token (what a GRPO/PPO loss sends back). Methods:
ours ("speed", "memory"; PyTorch and JAX), the naive formula on materialised bf16 logits
(log_softmax in fp32, gather, entropy) eager, under torch.compile, and under jax.jit, and
liger-kernel's fused GRPO loss (`LigerFusedLinearGRPOLoss`, token-level loss with a KL to
given reference log-probabilities: it computes log-probabilities but no entropy). Per
method: fwd+bwd ms (median), peak memory beyond the inputs as a multiple of the floor (the
bytes of grad_input + grad_weight), and the errors of grad_input and grad_weight against
our fp64 path (not for Liger, whose loss differs). With --out DIR writes
DIR/log_probs_{torch,jax}.json and appends to DIR/history.csv (bench.store).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F

from bench import measure, store
from bench.__main__ import environment
from torch_impl import linear_log_probs

SHAPES = {**measure.PRESETS, "RL": (32768, 4096, 151936)}
SEQ = 4096  # tokens per sequence (Liger's loss takes [B, T, D])


def naive(x, W, y):
    """(log p(y), entropy) from the materialised logits: bf16 product, fp32 log_softmax."""
    logp_all = F.log_softmax((x @ W.T).float(), dim=-1)
    return logp_all.gather(-1, y.clamp(min=0)[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)


def torch_methods():
    ours = lambda s: lambda x, W, y: linear_log_probs(x, W, y, return_entropy=True, strategy=s)
    methods = {"ours-speed": ours("speed"), "ours-memory": ours("memory"), "torch-eager": naive,
               "torch-compile": torch.compile(naive)}
    skipped = {}
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        methods["liger-grpo"] = LigerFusedLinearGRPOLoss(beta=0.04, loss_type="grpo")
    except ImportError as e:
        skipped["liger-grpo"] = f"ImportError: {e}"
    return methods, skipped


def _torch_step(name, fn, x, W, y, g_lp, g_h):
    """One fwd+bwd: (grad_x, grad_W)."""
    x, W = x.detach().requires_grad_(), W.detach().requires_grad_()
    if name == "liger-grpo":
        B = x.shape[0] // SEQ
        mask = (y != -100).view(B, SEQ).int()
        ref = g_lp.view(B, SEQ)  # any log-probabilities of the right shape
        loss = fn(x.view(B, SEQ, -1), W, y.clamp(min=0).view(B, SEQ), mask, g_h[:B], ref_per_token_logps=ref,
                  old_per_token_logps=ref)[0]
    else:
        logp, entropy = fn(x, W, y)
        loss = (logp * g_lp).sum() + (entropy * g_h).sum()
    loss.backward()
    return x.grad, W.grad


def run_torch(shapes, device, repeat, log, only=None):
    rows, methods_skipped = [], {}
    for shape in shapes:
        n, d, v = SHAPES[shape]
        x, W, y = measure.make_inputs(n, d, v, torch.bfloat16, device)
        gen = torch.Generator(device=device).manual_seed(3)
        g_lp, g_h = (torch.randn(n, device=device, generator=gen) for _ in range(2))
        g_lp = torch.where(y != -100, g_lp, 0.0)
        floor = x.numel() * x.element_size() + W.numel() * W.element_size()
        ref = _torch_step("ref", lambda a, b, c: linear_log_probs(a, b, c, return_entropy=True, strategy="chunked"),
                          x.double(), W.double(), y, g_lp.double(), g_h.double())
        methods, methods_skipped = torch_methods()
        for name, fn in methods.items():
            if only is not None and name not in only:
                continue
            def fill(row, name=name, fn=fn, ref=ref):
                step = lambda: _torch_step(name, fn, x, W, y, g_lp, g_h)
                row["fwd_bwd_ms"] = measure.time_ms(step, device, repeat=repeat)
                peak = measure.peak_extra_bytes(step, device)
                row.update(peak_extra_mib=peak / 2**20, floor_ratio=peak / floor)
                if name != "liger-grpo":
                    dx, dW = step()
                    row.update(grad_x_err=measure.rel_err(dx, ref[0]), grad_W_err=measure.rel_err(dW, ref[1]))

            row = {"shape": shape, "N": n, "D": d, "V": v, "loss": "log_probs", "framework": "torch", "method": name,
                   "dtype": "bfloat16"}
            rows.append(measure.record(row, fill, log))
        del ref
    return rows, methods_skipped


def run_jax(shapes, repeat, log, only=None):
    import jax
    import jax.numpy as jnp

    import jax_impl

    def naive_jax(x, W, y):
        logp_all = jax.nn.log_softmax((x @ W.T).astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(logp_all, jnp.maximum(y, 0)[:, None], -1)[:, 0], -(jnp.exp(logp_all) * logp_all).sum(-1)

    ours = lambda s: lambda x, W, y: jax_impl.linear_log_probs(x, W, y, return_entropy=True, strategy=s)
    methods = {"jax-ours-speed": ours("speed"), "jax-ours-memory": ours("memory"), "jax-naive": naive_jax}
    rows = []
    for shape in shapes:
        n, d, v = SHAPES[shape]
        xt, Wt, yt = measure.make_inputs(n, d, v, torch.bfloat16, torch.device("cuda"))
        gen = torch.Generator(device="cuda").manual_seed(3)
        g_lp, g_h = (torch.randn(n, device="cuda", generator=gen) for _ in range(2))
        g_lp = torch.where(yt != -100, g_lp, 0.0)
        ref = _torch_step("ref", lambda a, b, c: linear_log_probs(a, b, c, return_entropy=True, strategy="chunked"),
                          xt.double(), Wt.double(), yt, g_lp.double(), g_h.double())
        ref = [r.float().cpu().numpy() for r in ref]
        floor = xt.numel() * 2 + Wt.numel() * 2
        x, W = (jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16) for t in (xt, Wt))
        y = jnp.asarray(yt.cpu().numpy().astype(np.int32))
        gl, gh = jnp.asarray(g_lp.cpu().numpy()), jnp.asarray(g_h.cpu().numpy())
        del xt, Wt, yt
        torch.cuda.empty_cache()
        for name, fn in methods.items():
            if only is not None and name not in only:
                continue
            def fill(row, fn=fn):
                def loss(x_, W_):
                    logp, entropy = fn(x_, W_, y)
                    return (logp * gl).sum() + (entropy * gh).sum()

                compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, W).compile()
                row["fwd_bwd_ms"] = measure.time_ms(lambda: jax.block_until_ready(compiled(x, W)), torch.device("cuda"),
                                                    repeat=repeat, events=False)
                mem = compiled.memory_analysis()
                peak = mem.temp_size_in_bytes + mem.output_size_in_bytes
                row.update(peak_extra_mib=peak / 2**20, floor_ratio=peak / floor)
                dx, dW = compiled(x, W)
                row.update(grad_x_err=measure.rel_err(torch.from_numpy(np.asarray(dx.astype(jnp.float32))), torch.from_numpy(ref[0])),
                           grad_W_err=measure.rel_err(torch.from_numpy(np.asarray(dW.astype(jnp.float32))), torch.from_numpy(ref[1])))

            row = {"shape": shape, "N": n, "D": d, "V": v, "loss": "log_probs", "framework": "jax", "method": name,
                   "dtype": "bfloat16"}
            rows.append(measure.record(row, fill, log))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.log_probs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="RL,L,G")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    parser.add_argument("--out", default=None, help="folder for log_probs_{torch,jax}.json (overwritten) and history.csv")
    args = parser.parse_args(argv)
    device = torch.device("cuda")

    def log(r):
        if "error" in r:
            print(f"{r['shape']} {r['method']:>16}  {r['error']}", flush=True)
            return
        errs = "" if "grad_x_err" not in r else f"  err dx {r['grad_x_err']:.1e} dW {r['grad_W_err']:.1e}"
        print(f"{r['shape']} {r['method']:>16}  fwd+bwd {r['fwd_bwd_ms']:8.2f} ms  mem {r['floor_ratio']:5.2f}x floor{errs}",
              flush=True)

    only = None if args.methods is None else set(args.methods.split(","))
    shapes, frameworks = args.shapes.split(","), args.frameworks.split(",")
    rows, skipped = run_torch(shapes, device, args.repeat, log, only) if "torch" in frameworks else ([], {})
    if "jax" in frameworks:
        rows += run_jax(shapes, args.repeat, log, only)
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
