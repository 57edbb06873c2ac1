"""The README's benchmark tables and plot, generated from the committed JSON, never by hand.

python -m bench.report                             # print the tables, write bench/results/cross_entropy.png
python -m bench.report --readme README.md          # and rewrite README.md between its markers
python -m bench.report --readme README.md --check  # exit 1 where README.md's tables differ from the JSON
python -m bench.report FILE.json                   # every row and column of one JSON

The README holds one section per framework between `<!-- bench.report torch -->` and
`<!-- /bench.report torch -->` (the same with `jax`), and one for `compiled_model.json` (a
model's step under torch.compile, written by `python -m bench.compiled_model`), one for
`trl_step.json` (a GRPO step through TRL's fused head, `python -m bench.trl_step`), one for
`log_probs_{torch,jax}.json` (`python -m bench.log_probs`) and one for the multi-GPU runs
(`bench.distributed_report`), each left as it is when the folder has no such file; everything
between a pair is replaced. A check mode lets
a test hold the README to the numbers the JSON records.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from bench import store
from bench.capabilities import SECTION as CAPABILITIES, capabilities_section
from bench.distributed_report import SECTION as DISTRIBUTED, distributed_section
from bench.plots import FRAMEWORKS, by_shape, write_summary_plot

VERSIONS = {"torch": ("torch", "triton", "liger-kernel", "cut-cross-entropy", "quack-kernels", "nvidia-cutlass-dsl"), "jax": ("jax", "jax-cce")}
COMPILED = "compiled_model"  # the section, and its JSON's name in the results folder
RL = "log_probs"  # the RL outputs' section (bench.log_probs), and its JSONs' loss name
TRL_STEP = "trl_step"  # the section of bench.trl_step's run, and its JSON's name in the results folder


def _err(r, key) -> str:
    return "-" if r.get(key) is None else f"{r[key]:.1e}"


def format_row(r) -> str:
    """One console line of a result row."""
    if "error" in r:
        return f"{r['shape']:>10} {r['method']:<16} ERROR {r['error']}"
    mem = "-" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:8.1f} ({r['floor_ratio']:.2f}x)"
    return (f"{r['shape']:>10} {r['method']:<16} fwd {r['fwd_ms']:8.2f} ms  fwd+bwd {r['fwd_bwd_ms']:8.2f} ms  "
            f"{r['tflops']:6.1f} TF/s  mem MiB {mem:>18}  loss {_err(r, 'loss_err')}  dx {_err(r, 'grad_x_err')}  "
            f"dW {_err(r, 'grad_W_err')}")


def markdown_table(results: list[dict]) -> str:
    """Every measured column of every row, in the order run."""
    lines = [
        "| shape | method | fwd ms | fwd+bwd ms | peak extra MiB (x floor) | loss err | grad_x err | grad_W err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['method']} | {r['error']} | | | | | |")
            continue
        mem = "-" if r.get("peak_extra_mib") is None else f"{r['peak_extra_mib']:.0f} ({r['floor_ratio']:.2f}x)"
        lines.append(
            f"| {r['shape']} | {r['method']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {mem} | "
            f"{_err(r, 'loss_err')} | {_err(r, 'grad_x_err')} | {_err(r, 'grad_W_err')} |"
        )
    return "\n".join(lines) + "\n"


def summary_table(results: list[dict]) -> str:
    """The README's table: one row per method, per shape its fwd+bwd time (and ratio to the
    fastest peer's at that shape), its peak extra memory as a multiple of the floor and its
    grad_input / grad_weight errors."""
    shapes = by_shape(results)
    head = "| method | " + " | ".join(f"{s}: fwd+bwd ms (x fastest peer) | {s}: x floor | {s}: dx / dW err" for s in shapes) + " |"
    lines = [head, "|---|" + "---|" * (3 * len(shapes))]
    fastest = {s: min((r["fwd_bwd_ms"] for r in rows if "error" not in r and not store.is_ours(r["method"])), default=None)
               for s, rows in shapes.items()}
    for method in dict.fromkeys(r["method"] for r in results):
        cells = []
        for s, rows in shapes.items():
            r = next((r for r in rows if r["method"] == method), None)
            if r is None or "error" in r:
                cells += ["-" if r is None else r["error"].split(":")[0], "-", "-"]
                continue
            ratio = "" if fastest[s] is None else f" ({r['fwd_bwd_ms'] / fastest[s]:.2f}x)"
            floor = "-" if r["peak_extra_mib"] is None else f"{r['floor_ratio']:.2f}x"
            cells += [f"{r['fwd_bwd_ms']:.2f}{ratio}", floor, f"{_err(r, 'grad_x_err')} / {_err(r, 'grad_W_err')}"]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def caption(data: dict, path: str) -> str:
    """Where and with what the numbers were measured, what the shapes are, what was skipped."""
    env = data["environment"]
    versions = ", ".join(f"{k} {env[k]}" for k in VERSIONS[data["framework"]] if k in env)
    dtypes = ", ".join(sorted({r["dtype"] for r in data["results"]}))
    shapes = "; ".join(f"{s} = {rows[0]['N']} x {rows[0]['D']} x {rows[0]['V']}" for s, rows in by_shape(data["results"]).items())
    skipped = "; ".join(f"{m} ({why})" for m, why in data["skipped"].items()) or "none"
    note = f" {data['note']}" if data.get("note") else ""  # how the rows were gathered, when from several runs
    unmeasured = sorted({r["method"] for r in data["results"] if "error" not in r and r.get("grad_x_err") is None})
    no_errors = (f"; {', '.join(unmeasured)}: no ignore_index, so given targets with -100 replaced by 0 and no "
                 f"errors shown" if unmeasured else "")
    return (f"{FRAMEWORKS[data['framework']]} on {env['device']}, {dtypes}, {data['data']} data, {env['date'][:10]}; "
            f"{versions} (`{path}`). N x D x V: {shapes}. x fastest peer: fwd+bwd time over the fastest "
            f"non-ours method's at that shape; x floor: peak memory beyond the inputs over the bytes of grad_input + "
            f"grad_weight; errors relative to float64{no_errors}. Skipped: {skipped}.{note}\n")


def load(folder: str) -> dict[str, tuple[str, dict]]:
    """{framework: (path, data)} for the cross-entropy JSON present in `folder`."""
    found = {}
    for fw in FRAMEWORKS:
        path = store.json_path(folder, "cross_entropy", fw)
        if os.path.exists(path):
            with open(path) as f:
                found[fw] = (path, json.load(f))
    return found


def section(path: str, data: dict) -> str:
    return caption(data, path) + "\n" + summary_table(data["results"])


def _model(env: dict, rows: list[dict]) -> str:
    m = env["model"]
    return (f"a Llama-like model ({m['num_hidden_layers']} layers, D {m['hidden_size']}, V {m['vocab_size']}, "
            f"random weights) on {env['device']}, {env['dtype']}, {rows[0]['rows']} x {rows[0]['seq']} tokens, "
            f"{env['date'][:10]}")


def _gib(r: dict) -> str:
    return "-" if r.get("peak_extra_mib") is None else f"{r['peak_extra_mib'] / 1024:.2f}"


def compiled_section(path: str, data: dict) -> str:
    """`bench.compiled_model`'s run: a caption, then one column per method (step time, peak
    memory beyond the model and the batch, the graphs Dynamo made)."""
    env, rows = data["environment"], data["results"]
    text = (f"A training step of {_model(env, rows)}; torch {env['torch']} (`{path}`). `compile`: "
            f"`torch.compile(model)`, with compile's own fusion of logits and loss; `-layers`: each decoder layer "
            f"compiled, as torchtitan does; `ours`: `patch_causal_lm`; `ours-compile`: `fullgraph=True`; "
            f"`ours-graph-break`: the loss kept out of the graph; `liger`: Liger's patch. Memory: the peak beyond "
            f"the model and the batch.\n\n")
    lines = ["| | " + " | ".join(r["method"] for r in rows) + " |", "|---|" + "---|" * len(rows),
             "| step ms | " + " | ".join(f"{r['step_ms']:.1f}" for r in rows) + " |",
             "| peak GiB | " + " | ".join(_gib(r) for r in rows) + " |",
             "| graphs | " + " | ".join(str(r["graphs"]) for r in rows) + " |"]
    return text + "\n".join(lines) + "\n"


def trl_step_section(path: str, data: dict) -> str:
    """`bench.trl_step`'s run: one paragraph, each method's step time and peak memory."""
    env, rows = data["environment"], data["results"]
    methods = "; ".join(f"`{r['method']}` {r['step_ms']:.1f} ms, {_gib(r)} GiB" for r in rows)
    return (f"A GRPO step through TRL's fused head (`add_fused_lm_head`: log-probabilities and entropy of the "
            f"completion half of each sequence, DAPO's clipped loss, the backward pass) of {_model(env, rows)}; "
            f"TRL {env['trl']}, torch {env['torch']} (`{path}`), `trl` TRL's own kernel, `ours` `patch_trl`, the "
            f"step's time and its peak memory beyond the model and the batch: {methods}.\n")


def rl_section(runs: dict[str, tuple[str, dict]]) -> str:
    """`bench.log_probs`' runs ({framework: (path, data)}): per framework and method, at each
    shape, fwd+bwd ms and peak memory over the floor of both losses ("-" where not run)."""
    envs = {fw: data["environment"] for fw, (_, data) in runs.items()}
    places = {(env["device"], env["date"][:10]) for env in envs.values()}
    if len(places) == 1:
        (device, date), = places
        where = f"On {device}, bf16, random data, {date}"
    else:  # each framework's rows name their GPU: figures of two GPUs are not compared
        where = ("Each framework's rows on their own GPU (" + "; ".join(
            f"{FRAMEWORKS[fw]}: {env['device']}, {env['date'][:10]}" for fw, env in envs.items()) + "), bf16, random data")
    paths = ", ".join(f"`{path}`" for path, _ in runs.values())
    rows = [r for _, data in runs.values() for r in data["results"]]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    dims = {r["shape"]: f"{r['N']} x {r['D']} x {r['V']}" for r in rows}
    text = (f"{where} ({paths}). Each cell: fwd+bwd ms of "
            f"log-probabilities + entropy (random upstream gradients) / of GRPO's loss (clipped ratio, KL to a "
            f"reference, beta 0.04), then the peak memory beyond the inputs over the floor of each."
            + "".join(f" {data['note']}" for _, data in runs.values() if data.get("note")) + "\n\n")
    lines = ["| method | " + " | ".join(f"{s} ({dims[s]})" for s in shapes) + " |", "|---|" + "---|" * len(shapes)]
    got = lambda r, key, fmt: "-" if r is None or "error" in r else format(r[key], fmt)
    for fw, (_, data) in runs.items():
        for method in dict.fromkeys(r["method"] for r in data["results"]):
            cells = []
            for s in shapes:
                lp, grpo = ({r["loss"]: r for r in data["results"] if r["method"] == method and r["shape"] == s}.get(k)
                            for k in ("log_probs", "grpo"))
                cells.append(f"{got(lp, 'fwd_bwd_ms', '.1f')} / {got(grpo, 'fwd_bwd_ms', '.1f')} "
                             f"({got(lp, 'floor_ratio', '.2f')} / {got(grpo, 'floor_ratio', '.2f')} x floor)")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return text + "\n".join(lines) + "\n"


def sections_of(folder: str, found: dict[str, tuple[str, dict]]) -> dict[str, str]:
    """{section name: its README text}: the frameworks' `found` (`load(folder)`), the
    capability matrix, and the compiled model's, the TRL step's and the RL outputs' where `folder` holds
    their JSON."""
    sections = {fw: section(path, data) for fw, (path, data) in found.items()}
    sections[CAPABILITIES] = capabilities_section()
    for name, make in ((COMPILED, compiled_section), (TRL_STEP, trl_step_section)):
        path = os.path.join(folder, name + ".json")
        if os.path.exists(path):
            with open(path) as f:
                sections[name] = make(path, json.load(f))
    runs = {}
    for fw in FRAMEWORKS:
        path = store.json_path(folder, RL, fw)
        if os.path.exists(path):
            with open(path) as f:
                runs[fw] = (path, json.load(f))
    if runs:
        sections[RL] = rl_section(runs)
    distributed = distributed_section(folder)
    if distributed is not None:
        sections[DISTRIBUTED] = distributed
    return sections


def rewrite(text: str, sections: dict[str, str]) -> str:
    """`text` with each section between its markers; a framework with a JSON but no markers,
    or markers but no JSON, is an error (a README that silently keeps old numbers). The
    compiled model's markers without its JSON keep their text (another command writes it)."""
    for fw in (*FRAMEWORKS, CAPABILITIES, COMPILED, TRL_STEP, RL, DISTRIBUTED):
        pattern = re.compile(rf"(<!-- bench\.report {fw} -->\n).*?(<!-- /bench\.report {fw} -->)", re.DOTALL)
        has_markers = pattern.search(text) is not None
        if has_markers and fw not in sections:
            if fw in (COMPILED, TRL_STEP, RL, DISTRIBUTED):
                continue
            raise ValueError(f"markers for {fw} but no cross_entropy_{fw}.json")
        if fw in sections and not has_markers:
            raise ValueError(f"no <!-- bench.report {fw} --> ... <!-- /bench.report {fw} --> markers")
        if has_markers:
            text = pattern.sub(lambda m: m.group(1) + sections[fw] + m.group(2), text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="?", help="print every row of this one JSON and stop")
    parser.add_argument("--results", default="bench/results", help="the folder of cross_entropy_{torch,jax}.json")
    parser.add_argument("--plot", default=None, help="the PNG to write (default RESULTS/cross_entropy.png)")
    parser.add_argument("--readme", default=None, help="rewrite this file between its bench.report markers")
    parser.add_argument("--check", action="store_true", help="with --readme: write nothing, exit 1 if it differs")
    args = parser.parse_args(argv)
    if args.check and not args.readme:
        parser.error("--check needs --readme FILE")
    if args.json:
        with open(args.json) as f:
            print(markdown_table(json.load(f)["results"]), end="")
        return 0
    found = load(args.results)
    if not found:
        parser.error(f"no cross_entropy_*.json in {args.results}")
    sections = sections_of(args.results, found)
    if args.readme is None:
        print("\n".join(sections.values()), end="")
    else:
        with open(args.readme) as f:
            text = f.read()
        try:
            new = rewrite(text, sections)
        except ValueError as e:
            print(f"{args.readme}: {e}", file=sys.stderr)
            return 1
        if args.check:
            if new != text:
                print(f"{args.readme}: tables differ from {args.results}; run python -m bench.report --readme {args.readme}",
                      file=sys.stderr)
                return 1
            return 0
        with open(args.readme, "w") as f:
            f.write(new)
    png = write_summary_plot({fw: data for fw, (_, data) in found.items()},
                             args.plot or os.path.join(args.results, "cross_entropy.png"))
    print(f"plot {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
