"""The README's Distributed table, from the JSON the multi-GPU benchmarks write into bench/results.

Files read (each optional; the section exists when `distributed_1gpu.json` and one
`distributed_<P>gpu.json` with P > 1 do), for each rank count P > 1 found (a table each, and
with several, the split head's scaling over them):
- `distributed_1gpu.json`, `distributed_<P>gpu.json`, `distributed_<P>gpu_weak.json`:
  `torchrun --nproc-per-node {1,P} -m bench.distributed [--weak]` (the split head);
- `fsdp_model_<P>gpu.json`, `fsdp_model_tp_<P>gpu.json`, `fsdp_model_2d_<P>gpu.json`:
  `bench.fsdp_model` (FSDP2, `--head tp`, and `--tp T`: FSDP2 with the head split over a
  (dp, tp) mesh);
- `split_1gpu_<loss>.json`, `split_<P>gpu_<loss>.json` (loss: topk, log_probs, policy):
  `bench.distributed --loss <loss>`, the other losses' split heads;
- `jax_mesh_1gpu.json`, `jax_mesh_<P>gpu_vocab.json`, `jax_mesh_<P>gpu_rows.json`:
  `bench.jax_mesh` on one GPU, with the head split over P devices (`--tp P`) and with the
  rows sharded over them (`--tp 1`);
- `jax_mesh_losses.json`: `bench.jax_mesh --loss <loss>` records of every loss, on one GPU
  and on P (rows sharded, the head split, or both sharded: FSDP), `run` naming the records
  of one machine.
"""

from __future__ import annotations

import json
import os
import re

SECTION = "distributed"
PRESET_NAMES = {(16384, 4096, 128256): "L", (8192, 2304, 256000): "G"}
LOSS_NAMES = {"cross_entropy": "cross-entropy", "topk": "top-K distillation (K 32)", "log_probs": "log-probabilities",
              "policy": "policy loss", "dense": "dense distillation"}


def _load(folder: str, name: str):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _dates(*runs) -> str:
    """The dates of the runs given (a JSON document each, None for a file not there): "d",
    or "d1 to d2"."""
    days = sorted({(r["environment"]["date"] if isinstance(r, dict) else r[0]["date"])[:10] for r in runs if r})
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def ranks_measured(folder: str) -> list[int]:
    """Every P > 1 of a `distributed_<P>gpu.json` in folder, ascending."""
    found = [int(m.group(1)) for f in os.listdir(folder) if (m := re.fullmatch(r"distributed_(\d+)gpu\.json", f))]
    return sorted(p for p in found if p > 1)


def _gib(mib) -> str:
    return "-" if mib is None else f"{mib / 1024:.2f}"


def _find(data: dict | None, shape: str, method: str) -> dict | None:
    return next((r for r in (data or {}).get("results", []) if r["shape"] == shape and r["method"] == method), None)


def _peak(r: dict | None) -> str:
    """The per-GPU peak beyond the inputs (GiB) and its ratio to the rank's floor (its slice
    of grad_weight and grad_input)."""
    if r is None or r["peak_extra_mib_per_rank"][0] is None:
        return "-"
    top = max(r["peak_extra_mib_per_rank"])
    return f"{_gib(top)} ({top / r['local_floor_mib']:.2f}x)"


def _split_head_rows(one: dict, many: dict, weak: dict | None, p: int) -> list[list[str]]:
    """Per shape and method: ms on 1 GPU (a group of one) and on P, the speed-up over one
    GPU's unsplit "speed" call, the weak run's ms and efficiency, the per-GPU peak at P (x
    the rank's floor)."""
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in many["results"]):
        base = _find(one, shape, "one-gpu-speed")
        for method in [*dict.fromkeys(r["method"] for r in many["results"] if r["shape"] == shape), "one-gpu-speed"]:
            r1, rp, rw = _find(one, shape, method), _find(many, shape, method), _find(weak, shape, method)
            if rp is None and r1 is None:
                continue
            n, d, v = (rp or r1)["N"], (rp or r1)["D"], (rp or r1)["V"]
            speedup = "-" if rp is None or base is None else f"{base['fwd_bwd_ms'] / rp['fwd_bwd_ms']:.2f}x"
            weak_cell = "-" if rw is None or r1 is None else \
                f"{rw['fwd_bwd_ms']:.1f} ({100 * r1['fwd_bwd_ms'] / rw['fwd_bwd_ms']:.0f}%)"
            peak = _peak(rp)
            label = "one GPU, unsplit" if method == "one-gpu-speed" else method
            rows.append([f"{shape} {n}x{d}x{v} split head", label, f"{r1['fwd_bwd_ms']:.1f}" if r1 else "-",
                         f"{rp['fwd_bwd_ms']:.1f}" if rp else "-", speedup, weak_cell, peak])
    return rows


def _loss_rows(one: dict, many: dict, p: int, loss: str) -> list[list[str]]:
    """Another loss's split head, one row per shape, "speed / memory" in each cell: ms with a
    group of one (the unsplit calls' beside), ms on P GPUs, the speed-up over the unsplit call
    of the same strategy, the per-GPU peak at P (GiB)."""
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in many["results"]):
        cells = {k: [] for k in ("one", "unsplit", "many", "speedup", "peak")}
        for strategy in ("speed", "memory"):
            r1, ru, rp = (_find(one, shape, f"ours-{strategy}"), _find(one, shape, f"one-gpu-{strategy}"),
                          _find(many, shape, f"ours-{strategy}"))
            cells["one"].append(f"{r1['fwd_bwd_ms']:.1f}" if r1 else "-")
            cells["unsplit"].append(f"{ru['fwd_bwd_ms']:.1f}" if ru else "-")
            cells["many"].append(f"{rp['fwd_bwd_ms']:.1f}" if rp else "-")
            cells["speedup"].append(f"{ru['fwd_bwd_ms'] / rp['fwd_bwd_ms']:.2f}x" if ru and rp else "-")
            cells["peak"].append(_gib(max(rp["peak_extra_mib_per_rank"])) if rp and rp["peak_extra_mib_per_rank"][0]
                                 is not None else "-")
        r = next(r for r in many["results"] if r["shape"] == shape)
        rows.append([f"{shape} {r['N']}x{r['D']}x{r['V']} split head, {LOSS_NAMES[loss]}", "ours-speed / ours-memory",
                     f"{' / '.join(cells['one'])} (unsplit {' / '.join(cells['unsplit'])})", " / ".join(cells["many"]),
                     " / ".join(cells["speedup"]), "-", " / ".join(cells["peak"])])
    return rows


def _model_rows(data: dict | None, what: str) -> list[list[str]]:
    """A model step per method: ms at P, the per-GPU peak (GiB, no floor)."""
    if data is None:
        return []
    rows = []
    for r in data["results"]:
        tokens = f"{r['rows_per_rank']}x{r['seq']} tokens"
        rows.append([f"Llama-like model, {what}, {tokens}", r["method"], "-", f"{r['step_ms']:.1f}", "-", "-",
                     _gib(max(r["peak_extra_mib_per_rank"]))])
    return rows


def _jax_rows(one: list | None, sharded: list | None, what: str, device: str) -> list[list[str]]:
    """JAX under jit per shape and method: ms on one GPU and on the mesh, the speed-up, the
    compiled program's temporaries per device (XLA's analysis). The one-GPU time is the
    sharded file's own record (devices 1: the same call, the same machine) where it has one,
    else `one`'s; a machine other than the section's `device` is named in the row."""
    if sharded is None:
        return []
    rows, same_call = [], [b for b in sharded if b["devices"] == 1]
    for r in sharded:
        if r["devices"] == 1:
            continue
        n, d, v = (int(k) for k in r["shape"].split("x"))
        base = _record_like(same_call, r) or _record_like(one or [], r)
        name = PRESET_NAMES.get((n, d, v), "")
        gpu = f" ({r['device_kind']})" if r.get("device_kind", device) != device else ""
        if base and base.get("device_kind", device) != r.get("device_kind", device):
            gpu += f" (one GPU: {base.get('device_kind', device)})"
        rows.append([f"JAX {name} {r['shape']}, {what}{gpu}", r["method"], f"{base['ms']:.1f}" if base else "-",
                     f"{r['ms']:.1f}", f"{base['ms'] / r['ms']:.2f}x" if base else "-", "-",
                     f"{_gib(r['temp_bytes_per_device'] / 2**20)} (temporaries)"])
    return rows


def _record_like(records: list, r: dict) -> dict | None:
    """The record of `records` with r's shape and method, or None."""
    return next((b for b in records if b["shape"] == r["shape"] and b["method"] == r["method"]), None)


def _jax_loss_rows(records: list, p: int, device: str) -> list[list[str]]:
    """Every loss under jit, one row per loss: "speed" / "memory" ms on one GPU and on p (rows
    sharded, the head split, both sharded: FSDP; one entry each), the speed-ups, the
    temporaries per device. The one-GPU record is one of the same run (`run`: the same
    machine; the one-GPU cell names the entries of each where they differ); a machine other than the section's `device`
    is named in the row."""
    rows = []
    for loss in LOSS_NAMES:
        mine, entries = [r for r in records if r["loss_name"] == loss], []
        for tp, fsdp, what in ((1, False, "rows"), (p, False, "head"), (1, True, "FSDP")):
            pairs = []
            for method in ("ours-speed", "ours-memory"):
                many = [r for r in mine if r["devices"] == p and r["tp"] == tp and r.get("fsdp", False) == fsdp
                        and r["method"] == method]
                base = next((b for b in mine if many and b["devices"] == 1 and b["method"] == method
                             and b["shape"] == many[0]["shape"] and b.get("run") == many[0].get("run")), None)
                if many and base:
                    pairs.append((base, many[0]))
            if pairs:
                entries.append((what, pairs))
        if not entries:
            continue
        cell = lambda f: "; ".join(f"{what} " + " / ".join(f(b, m) for b, m in pairs) for what, pairs in entries)
        ones = {}  # the one-GPU time of each run, labelled by its entries where runs differ
        for what, pairs in entries:
            ones.setdefault(" / ".join(f"{b['ms']:.1f}" for b, _ in pairs), []).append(what)
        one = "; ".join(f"{', '.join(whats)} {t}" if len(ones) > 1 else t for t, whats in ones.items())
        first = entries[0][1][0][1]
        kind = first.get("device_kind", device)
        gpu = f" ({kind})" if kind != device else ""
        rows.append([f"JAX {first['shape']}, {LOSS_NAMES[loss]}{gpu}", "speed / memory",
                     one, cell(lambda b, m: f"{m['ms']:.1f}"),
                     cell(lambda b, m: f"{b['ms'] / m['ms']:.2f}x"), "-",
                     cell(lambda b, m: _gib(m["temp_bytes_per_device"] / 2**20)) + " (temporaries)"])
    return rows


def _scaling_table(folder: str, ps: list[int]) -> str:
    """The split head at every P measured, one row per shape and method: ms on 1 GPU, on
    each P (with the speed-up over one GPU's unsplit "speed" call), P x the rows on P
    (weak: ms and efficiency) and the per-GPU peak at each P (x the rank's floor)."""
    one = _load(folder, "distributed_1gpu.json")
    strong = {p: _load(folder, f"distributed_{p}gpu.json") for p in ps}
    weak = {p: _load(folder, f"distributed_{p}gpu_weak.json") for p in ps}
    head = ["workload", "method", "1 GPU: ms", *(f"{p} GPUs: ms (speed-up)" for p in ps),
            *(f"{p} GPUs, {p}x rows: ms (efficiency)" for p in ps), *(f"{p} GPUs: peak GiB (x floor)" for p in ps)]
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in one["results"]):
        base = _find(one, shape, "one-gpu-speed")
        for method in dict.fromkeys(r["method"] for r in one["results"] if r["shape"] == shape):
            if method.startswith("one-gpu"):
                continue
            r1 = _find(one, shape, method)
            cells = [f"{shape} {r1['N']}x{r1['D']}x{r1['V']}", method, f"{r1['fwd_bwd_ms']:.1f}"]
            for p in ps:
                rp = _find(strong[p], shape, method)
                cells.append("-" if rp is None else f"{rp['fwd_bwd_ms']:.1f}" + (
                    f" ({base['fwd_bwd_ms'] / rp['fwd_bwd_ms']:.2f}x)" if base else ""))
            for p in ps:
                rw = _find(weak[p], shape, method)
                cells.append("-" if rw is None else f"{rw['fwd_bwd_ms']:.1f} ({100 * r1['fwd_bwd_ms'] / rw['fwd_bwd_ms']:.0f}%)")
            cells += [_peak(_find(strong[p], shape, method)) for p in ps]
            rows.append(cells)
    env = one["environment"]
    bases = ", ".join(f"{shape} {b['fwd_bwd_ms']:.1f} ms" for shape in dict.fromkeys(r["shape"] for r in one["results"])
                      if (b := _find(one, shape, "one-gpu-speed")))
    text = (f"Split-head scaling, cross-entropy, on 1 to {ps[-1]} x {env['device']} (NCCL), {env['dtype']}, "
            f"{_dates(one, *strong.values(), *weak.values())} (`bench/results/distributed_*`): the split head's fwd+bwd "
            f"on 1 GPU (a group of one) and on P, the speed-up over one GPU's call without a split (\"speed\": "
            f"{bases}); P x the rows on P GPUs (efficiency: the 1-GPU time over it); each GPU's peak beyond its "
            f"inputs, over its floor.\n\n")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    return text + "\n".join(lines) + "\n"


def _table(folder: str, p: int, one: dict, split_head: bool) -> str:
    """The caption and table of every workload measured on P GPUs; split_head: with the
    cross-entropy's split head and its weak runs (which the scaling table shows where there
    is one)."""
    many = _load(folder, f"distributed_{p}gpu.json")
    env = many["environment"]
    runs = [many]
    rows = _split_head_rows(one, many, _load(folder, f"distributed_{p}gpu_weak.json"), p) if split_head else []
    for loss in ("topk", "log_probs", "policy"):
        loss_one, loss_many = _load(folder, f"split_1gpu_{loss}.json"), _load(folder, f"split_{p}gpu_{loss}.json")
        if loss_one is not None and loss_many is not None:
            rows += _loss_rows(loss_one, loss_many, p, loss)
            runs.append(loss_many)
    for name, what in ((f"fsdp_model_{p}gpu.json", "FSDP2"), (f"fsdp_model_tp_{p}gpu.json", "head split by tensor parallelism"),
                       (f"fsdp_model_2d_{p}gpu.json", "FSDP2 and a tensor-parallel head (2-D mesh)")):
        runs.append(_load(folder, name))
        rows += _model_rows(runs[-1], what)
    jax_one = _load(folder, "jax_mesh_1gpu.json")
    for name, what in ((f"jax_mesh_{p}gpu_vocab.json", f"head split over {p} GPUs"),
                       (f"jax_mesh_{p}gpu_rows.json", f"rows sharded over {p} GPUs")):
        runs.append(_load(folder, name))
        rows += _jax_rows(jax_one, runs[-1], what, env["device"])
    losses = _load(folder, "jax_mesh_losses.json") or []
    loss_rows = _jax_loss_rows(losses, p, env["device"])
    rows += loss_rows
    runs.append(losses if loss_rows else None)
    split = (f"Split head: fwd+bwd of the cross-entropy (or the loss named) with each GPU holding 1/{p} of the "
             f"classes (`vocab_parallel`), on 1 GPU (a group of one) and on {p}; speed-up: one GPU's call without "
             f"`vocab_parallel` (\"speed\"; for the other losses, of the same strategy) over this method's time on {p} "
             f"GPUs; ")
    weak = f"weak: {p}x the rows on {p} GPUs (efficiency: the 1-GPU time over it); " if split_head else ""
    loss_parallel = "`loss-parallel`: PyTorch's `loss_parallel` on materialised logits. " if split_head else ""
    text = (f"On {p} x {env['device']} (NCCL), {env['dtype']}, random data, {_dates(*runs)}; torch {env['torch']} "
            f"(`bench/results/distributed_*`, `split_*`, `fsdp_model_*`, `jax_mesh_*`). "
            f"{'' if split_head else 'Cross-entropy: the scaling table above. '}{split}{weak}peak: each GPU's memory "
            f"beyond its inputs, over its floor (its slice of grad_weight and grad_input). "
            f"{loss_parallel}"
            f"Model: a training step (4 layers, D 2048, V 128256, bf16), each GPU its own rows "
            f"(FSDP2), the same rows (tensor-parallel head), or both on a (dp, tp) mesh. JAX: `jax.jit` of the "
            f"unchanged call on sharded arrays; naive: XLA on materialised logits.\n\n")
    head = ["workload", "method", "1 GPU: ms", f"{p} GPUs: ms", "speed-up over 1 GPU", f"{p} GPUs, {p}x rows: ms (weak)",
            f"{p} GPUs: peak GiB per GPU"]
    if not split_head:  # the weak runs are the split head's only
        head, rows = head[:5] + head[6:], [r[:5] + r[6:] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    return text + "\n".join(lines) + "\n"


def distributed_section(folder: str) -> str | None:
    """The section's text (the split head's scaling over every P measured, then a table per
    P of the other workloads; with one P, its table holds the split head too), or None
    without the split head's runs."""
    ps = ranks_measured(folder)
    one = _load(folder, "distributed_1gpu.json")
    if not ps or one is None:
        return None
    tables = [_table(folder, p, one, split_head=len(ps) == 1) for p in ps]
    return "\n".join(([_scaling_table(folder, ps)] if len(ps) > 1 else []) + tables)
