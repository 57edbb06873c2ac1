"""The README's capability matrix: each loss in each execution mode, in both frameworks, and
the test that checks that cell against the float64 reference.

`CELLS` is the one record of what each public call supports; `tests/test_capabilities.py`
holds it to the code: every named test exists, and a call takes `vocab_parallel` (or
`sequence_parallel`) exactly where its row says it splits a head (or rows) that way.
`python -m bench.report --readme README.md` writes the table between the README's
`<!-- bench.report capabilities -->` markers.
"""

from __future__ import annotations

SECTION = "capabilities"
LOSSES = {"cross_entropy": "cross-entropy", "topk": "top-K distillation", "dense": "dense distillation",
          "log_probs": "log-probabilities", "policy": "policy loss"}
FUNCTIONS = {"cross_entropy": "linear_cross_entropy", "topk": "linear_topk_distillation", "dense": "linear_distillation",
             "log_probs": "linear_log_probs", "policy": "linear_policy_loss"}
# (column, framework it exists in, or None for both)
MODES = (("speed", None), ("memory", None), ("chunked", None), ("split head (`vocab_parallel`)", None),
         ("DTensor head", "torch"), ("sequence parallel", "torch"), ("`torch.compile(fullgraph=True)`", "torch"),
         ("`jit`, rows sharded", "jax"), ("`jit`, head sharded on V", "jax"), ("`jit`, FSDP head", "jax"))
SPLIT, SEQUENCE = MODES[3][0], MODES[5][0]

_VP = "tests/test_vocab_parallel.py::"
_MATCHES = "::test_matches_reference"
_JAX_SPLIT = _VP + "test_jax_split_heads_and_sharded_operands_match_reference"


def _row(strategies: str, split: str | None, compiled: str | None = None, jit: str | None = None, **more) -> dict:
    """One (framework, loss)'s cells: the test of its three strategies (a file), of its split
    head, of torch.compile, of jit (rows, vocabulary, FSDP), and `more` by column."""
    cells = {mode: f"tests/{strategies}{_MATCHES}" for mode in ("speed", "memory", "chunked")}
    cells |= {SPLIT: split, MODES[6][0]: compiled, MODES[7][0]: jit, MODES[8][0]: jit, MODES[9][0]: jit}
    return {mode: test for mode, test in (cells | more).items() if test is not None}


_COMPILE = "tests/test_compile.py::"
# the other losses' DTensor heads and sequence parallel
_FORMS = {mode: _VP + "test_other_losses_with_dtensor_heads_and_sequence_parallel_match_reference"
          for mode in ("DTensor head", SEQUENCE)}
# {(framework, loss): {column: the test (path::function) that checks it}}
CELLS = {
    ("torch", "cross_entropy"): _row(
        "test_implementations.py", _VP + "test_vocab_parallel_matches_reference",
        _COMPILE + "test_compiled_call_matches_float64_reference",
        **{"DTensor head": _VP + "test_dtensor_head_sharded_on_the_vocabulary",
           SEQUENCE: _VP + "test_sequence_parallel_matches_reference"}),
    ("torch", "topk"): _row("test_distillation.py", _VP + "test_distillation_with_a_split_head_matches_reference",
                            _COMPILE + "test_compiled_topk_distillation_matches_eager", **_FORMS),
    ("torch", "dense"): _row("test_distillation.py", _VP + "test_distillation_with_a_split_head_matches_reference",
                             _COMPILE + "test_compiled_dense_distillation_matches_eager", **_FORMS),
    ("torch", "log_probs"): _row("test_log_probs.py",
                                 _VP + "test_log_probs_and_policy_loss_with_a_split_head_match_reference",
                                 _COMPILE + "test_compiled_log_probs_match_eager", **_FORMS),
    ("torch", "policy"): _row("test_policy_loss.py",
                              _VP + "test_log_probs_and_policy_loss_with_a_split_head_match_reference",
                              _COMPILE + "test_compiled_policy_loss_matches_reference", **_FORMS),
    ("jax", "cross_entropy"): _row("test_implementations.py", _VP + "test_jax_vocab_parallel_in_shard_map_matches_reference",
                                   jit=_VP + "test_jax_jit_partitions_sharded_operands_instead_of_gathering"),
    ("jax", "topk"): _row("test_distillation.py", _JAX_SPLIT, jit=_JAX_SPLIT),
    ("jax", "dense"): _row("test_distillation.py", _JAX_SPLIT, jit=_JAX_SPLIT),
    ("jax", "log_probs"): _row("test_log_probs.py", _JAX_SPLIT, jit=_JAX_SPLIT),
    ("jax", "policy"): _row("test_policy_loss.py", _JAX_SPLIT, jit=_JAX_SPLIT),
}


def capabilities_section() -> str:
    """The caption and the table: "yes" where a test checks the cell, "no" where it is
    refused, blank where the mode is the other framework's."""
    head = ["", *(mode for mode, _ in MODES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (framework, loss), cells in CELLS.items():
        name = f"{'PyTorch' if framework == 'torch' else 'JAX'} `{FUNCTIONS[loss]}`"
        row = ["yes" if mode in cells else "" if only not in (None, framework) else "no" for mode, only in MODES]
        lines.append("| " + " | ".join([name, *row]) + " |")
    caption = ("Every loss in every execution mode (generated from `bench/capabilities.py`, which names the test of "
               "each cell; each checks it against the float64 reference on the CPU, on gloo ranks and fake JAX "
               "devices, or, for `torch.compile` of the distillation losses and log-probabilities, against the eager "
               "call). "
               "`vocab_parallel` is a process group in PyTorch and a `shard_map` axis in JAX; `jit` rows: the "
               "unchanged call on sharded arrays.")
    return caption + "\n\n" + "\n".join(lines) + "\n"
