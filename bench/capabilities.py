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
GATHERED = "gathered"  # the cell works, on every device's whole operand

_VP = "tests/test_vocab_parallel.py::"
_STRATEGIES = ("speed", "memory", "chunked")


def _strategies(test: str) -> dict:
    return {mode: test for mode in _STRATEGIES}


def _jit(test: str, vocab=None) -> dict:
    return {MODES[7][0]: test, MODES[8][0]: vocab or test, MODES[9][0]: test}


# {(framework, loss): {column: the test (path::function) that checks it, or GATHERED}}
CELLS = {
    ("torch", "cross_entropy"): {
        **_strategies("tests/test_implementations.py::test_matches_reference"),
        SPLIT: _VP + "test_vocab_parallel_matches_reference",
        "DTensor head": _VP + "test_dtensor_head_sharded_on_the_vocabulary",
        SEQUENCE: _VP + "test_sequence_parallel_matches_reference",
        MODES[6][0]: "tests/test_compile.py::test_compiled_call_matches_float64_reference"},
    ("torch", "topk"): {
        **_strategies("tests/test_distillation.py::test_matches_reference"),
        SPLIT: _VP + "test_distillation_with_a_split_head_matches_reference",
        MODES[6][0]: "tests/test_compile.py::test_compiled_topk_distillation_matches_eager"},
    ("torch", "dense"): {
        **_strategies("tests/test_distillation.py::test_matches_reference"),
        SPLIT: _VP + "test_distillation_with_a_split_head_matches_reference",
        MODES[6][0]: "tests/test_compile.py::test_compiled_dense_distillation_matches_eager"},
    ("torch", "log_probs"): {
        **_strategies("tests/test_log_probs.py::test_matches_reference"),
        SPLIT: _VP + "test_log_probs_and_policy_loss_with_a_split_head_match_reference",
        MODES[6][0]: "tests/test_compile.py::test_compiled_log_probs_match_eager"},
    ("torch", "policy"): {
        **_strategies("tests/test_policy_loss.py::test_matches_reference"),
        SPLIT: _VP + "test_log_probs_and_policy_loss_with_a_split_head_match_reference",
        MODES[6][0]: "tests/test_compile.py::test_compiled_policy_loss_matches_eager"},
    ("jax", "cross_entropy"): {
        **_strategies("tests/test_implementations.py::test_matches_reference"),
        SPLIT: _VP + "test_jax_vocab_parallel_in_shard_map_matches_reference",
        **_jit(_VP + "test_jax_jit_partitions_sharded_operands_instead_of_gathering")},
    ("jax", "topk"): {
        **_strategies("tests/test_distillation.py::test_matches_reference"),
        SPLIT: _VP + "test_jax_split_heads_and_sharded_operands_match_reference",
        **_jit(_VP + "test_jax_split_heads_and_sharded_operands_match_reference")},
    ("jax", "dense"): {
        **_strategies("tests/test_distillation.py::test_matches_reference"),
        SPLIT: _VP + "test_jax_split_heads_and_sharded_operands_match_reference",
        **_jit(_VP + "test_jax_split_heads_and_sharded_operands_match_reference", vocab=GATHERED)},
    ("jax", "log_probs"): {
        **_strategies("tests/test_log_probs.py::test_matches_reference"),
        SPLIT: _VP + "test_jax_split_heads_and_sharded_operands_match_reference",
        **_jit(_VP + "test_jax_split_heads_and_sharded_operands_match_reference")},
    ("jax", "policy"): {
        **_strategies("tests/test_policy_loss.py::test_matches_reference"),
        SPLIT: _VP + "test_jax_split_heads_and_sharded_operands_match_reference",
        **_jit(_VP + "test_jax_split_heads_and_sharded_operands_match_reference")},
}


def capabilities_section() -> str:
    """The caption and the table: "yes" where a test checks the cell, "gathered" where the
    call runs on whole operands, "no" where it is refused, blank where the mode is the other
    framework's."""
    head = ["", *(mode for mode, _ in MODES)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (framework, loss), cells in CELLS.items():
        name = f"{'PyTorch' if framework == 'torch' else 'JAX'} `{FUNCTIONS[loss]}`"
        row = [cells[mode] if cells.get(mode) == GATHERED else "yes" if mode in cells
               else "" if only not in (None, framework) else "no" for mode, only in MODES]
        lines.append("| " + " | ".join([name, *row]) + " |")
    caption = ("Every loss in every execution mode (generated from `bench/capabilities.py`, which names the test of "
               "each cell; each checks it against the float64 reference on the CPU: gloo ranks, fake JAX devices). "
               "`vocab_parallel` is a process group in PyTorch and a `shard_map` axis in JAX; `jit` rows: the "
               "unchanged call on sharded arrays.")
    return caption + "\n\n" + "\n".join(lines) + "\n"
