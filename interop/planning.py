"""The one planner of both frameworks: how a call is cut into blocks of logits.

`plan` turns a call's facts (which loss, which framework, its strategy, N, D, V, the input's
bytes per value) into a `Plan`; `torch_impl.head.plan` and the JAX configurations
(`jax_impl.blocked.plan`, `jax_impl.distill_rules.plan_steps`) only translate it. The block
shapes are interop.blocking's rules, their numbers the call's `Tuning`.

| strategy | cross-entropy (its fused kernels) | the other losses (block steps) |
|---|---|---|
| "chunked" | whole rows, `chunk_rows` of them | the same |
| "speed" | whole rows (`block_shape`); larger ones when no gradient is taken (PyTorch) | whole rows (`block_shape`) |
| "memory" | PyTorch: whole rows where enough fit (`whole_row_memory_scratch`), else tiles (`block_shape`); JAX: of whole rows, tiles sized for XLA's temporaries and tiles of its own products, the one of least estimated time (`memory_plan_seconds`) | tiles (`block_shape`); JAX log-probabilities: XLA's or its own products' tiles, the faster estimate, where either fits |

"speed" takes one block of all rows where its logits fit in the bytes of a block and the fp32
grad_weight accumulator that one block does without (`one_speed_block`; an accumulator in the
input dtype is grad_weight itself and earns no bytes; a call with PyTorch's gradient filter,
which adds grad_weight in parts into an accumulator, keeps several blocks). PyTorch plans on the
count of rows not ignored; JAX's count is traced, so its one block computes the ignored rows
too (Q with half the targets ignored, H100, in blocks of 2^28 logits: 18.8 ms against 15.2 in
blocks of the kept rows; with a tenth, 19.4 against 26.2), and `Tuning.one_speed_block_share=0`
keeps the blocks (where N fits one block of `Tuning.speed_block_elements`, as Q's 4096 rows now
do, a smaller block size too).

The frameworks differ where their products do: PyTorch's "speed" grows its blocks when
grad_weight accumulates in 16 bits (cuBLAS adds into it in place); XLA owns grad_input's
buffer, so JAX's whole-row "memory" blocks cannot grow into it, and its tiles leave room for
XLA's GEMM workspace. grad_weight accumulates in the input dtype with
accumulate_in_input_dtype or under "memory" (the least memory), else in fp32 (fp64 for fp64
inputs).
"""

from __future__ import annotations

import dataclasses
import functools

from interop.blocking import (block_shape, chunk_rows, forward_only_rows, jax_whole_row_block_rows,
                              kernel_memory_block_shape, memory_plan_seconds, skipping_pays, whole_row_memory_scratch,
                              without_a_thin_last_block, xla_memory_block_shape, xla_memory_blocks_fit)
from interop.tuning import Tuning

FRAMEWORKS = ("torch", "jax")
LOSSES = ("cross_entropy", "distillation", "log_probs")  # log_probs: the policy loss too


@dataclasses.dataclass(frozen=True)
class Plan:
    """strategy: "speed", "memory" or "chunked"; layout: "rows" (blocks of whole rows, whose
    gradients can be formed in the forward pass) or "tiles" (rows x vocabulary columns,
    recomputed in the backward pass); rows, cols: a block's; narrow_accumulator: grad_weight
    accumulates in the input dtype; scratch: PyTorch's elements of logits scratch after
    grad_input (whole-row "memory", 0: none); skip_ignored: JAX computes only the row blocks
    holding rows whose target is not ignored (PyTorch gathers those rows before planning);
    fused_stats: JAX's "memory" forward pass takes its statistics without a logits block;
    kernel_products: JAX's tiles are multiplied by its own kernels (`jax_impl.row_products`)."""

    strategy: str
    layout: str
    rows: int
    cols: int
    narrow_accumulator: bool
    scratch: int = 0
    skip_ignored: bool = False
    fused_stats: bool = False
    kernel_products: bool = False


def plan(t: Tuning, framework: str, loss: str, strategy: str, n_rows: int, hidden: int, vocab: int, itemsize: int,
         accumulate_in_input_dtype: bool, *, buffers: int = 1, gathered_rows: bool = False, n_all: int | None = None,
         forward_only: bool = False, whole_vocab: int | None = None, return_lse: bool = False,
         grads_in_backward: bool = False,
         filtered: bool = False) -> Plan:
    """The call's Plan (the table above). n_rows: the rows computed, of n_all (default n_rows);
    vocab: the classes a device plans for (a split head: the largest rank's); buffers: logits
    buffers held at once (2: a dense teacher's beside the student's); gathered_rows: PyTorch
    gathers the rows computed (each row block a copy); forward_only: no gradient is taken;
    return_lse: the call returns lse (JAX then computes every row); grads_in_backward: its
    gradients are formed in the backward pass whatever its blocks (reduction "none", an
    upstream gradient per row); filtered: PyTorch's
    cross-entropy filters its gradient (several "speed" blocks).

    whole_vocab: a head split over the vocabulary, whose whole head has these classes
    (PyTorch's grad_input is then an fp32 sum over the ranks: no whole-row scratch after
    it). "memory" then takes the logits block one device would for the whole head, over the
    device's classes: the same tiles, or whole rows of fewer classes, as many more rows
    (`without_a_thin_last_block`). Its budget is a fraction of the gradients' bytes, and a
    device's share of them (grad_input whole, V / P classes) would leave it blocks of a few
    rows (JAX at L on 2 devices: 128 rows, 0.9x one device's speed)."""
    if framework not in FRAMEWORKS or loss not in LOSSES:
        raise ValueError(f"plan: framework must be one of {FRAMEWORKS} and loss one of {LOSSES}, "
                         f"got {framework!r}, {loss!r}")
    if strategy == "memory" and whole_vocab is not None and whole_vocab > vocab:
        p = plan(t, framework, loss, strategy, n_rows, hidden, whole_vocab, itemsize, accumulate_in_input_dtype,
                 buffers=buffers, gathered_rows=gathered_rows, n_all=n_all, forward_only=forward_only,
                 whole_vocab=whole_vocab, return_lse=return_lse, grads_in_backward=grads_in_backward,
                 filtered=filtered)
        if p.layout == "tiles":
            return dataclasses.replace(p, cols=min(p.cols, vocab))
        rows = without_a_thin_last_block(t, n_rows, min(n_rows, p.rows * whole_vocab // max(vocab, 1)))
        return dataclasses.replace(p, rows=rows, cols=vocab)
    narrow = accumulate_in_input_dtype or strategy == "memory"
    if strategy == "chunked":
        return Plan(strategy, "rows", chunk_rows(t, n_rows, hidden, vocab), vocab, narrow)
    if loss == "cross_entropy" and framework == "torch":
        n_all = n_rows if n_all is None else n_all
        return _torch_cross_entropy(t, strategy, n_rows, hidden, vocab, itemsize, narrow, gathered_rows, n_all,
                                    forward_only, whole_vocab is not None, filtered)
    if loss == "cross_entropy":
        return _jax_cross_entropy(t, strategy, n_rows, hidden, vocab, itemsize, narrow, return_lse, grads_in_backward)
    if framework == "jax" and loss == "log_probs" and strategy == "memory":
        plans = _jax_memory_plans(t, n_rows, hidden, vocab, itemsize, functools.partial(Plan, strategy,
                                                                                      narrow_accumulator=narrow))
        if plans:  # its gradients come in the backward pass: computed again there
            return _fastest(t, plans, n_rows, hidden, vocab, itemsize, grads_in_forward=False)
    # PyTorch's rows may be gathered; JAX's block steps read them in place
    rows, cols = block_shape(t, strategy, n_rows, hidden, vocab, itemsize, buffers,
                             gathered_rows=gathered_rows and framework == "torch",
                             narrow_accumulator=accumulate_in_input_dtype, narrow_grows=framework == "torch")
    return Plan(strategy, "rows" if strategy == "speed" else "tiles", rows, cols, narrow)


def _torch_cross_entropy(t, strategy, n_rows, hidden, vocab, itemsize, narrow, gathered_rows, n_all, forward_only,
                         split, filtered) -> Plan:
    scratch = None
    if strategy == "memory" and not split:
        scratch = whole_row_memory_scratch(t, n_all, n_rows, hidden, vocab, itemsize, gathered_rows)
    if scratch:
        return Plan(strategy, "rows", min(n_rows, scratch // vocab), vocab, narrow, scratch=scratch)
    rows, cols = block_shape(t, strategy, n_rows, hidden, vocab, itemsize, gathered_rows=gathered_rows,
                             narrow_accumulator=narrow, one_block=not filtered)
    if strategy == "speed":
        rows = forward_only_rows(t, n_rows, hidden, vocab, itemsize) if forward_only else rows
        return Plan(strategy, "rows", rows, cols, narrow)
    return Plan(strategy, "tiles", rows, cols, narrow)


def _jax_cross_entropy(t, strategy, n_rows, hidden, vocab, itemsize, narrow, return_lse, grads_in_backward) -> Plan:
    skip = not return_lse and skipping_pays(t, n_rows, hidden, vocab)
    if strategy == "speed":
        rows, cols = block_shape(t, strategy, n_rows, hidden, vocab, itemsize, gathered_rows=skip,
                                 narrow_accumulator=narrow, narrow_grows=False)
        return Plan(strategy, "rows", rows, cols, narrow, skip_ignored=skip)
    memory = functools.partial(Plan, strategy, narrow_accumulator=narrow, skip_ignored=skip, fused_stats=True)
    whole_rows = jax_whole_row_block_rows(t, n_rows, hidden, vocab, itemsize)
    plans = ([memory("rows", whole_rows, vocab)] if whole_rows else []) + \
        _jax_memory_plans(t, n_rows, hidden, vocab, itemsize, memory)
    if not plans:  # a head too small for any block of min_block rows: XLA's smallest blocks
        return memory("tiles", *xla_memory_block_shape(t, n_rows, hidden, vocab, itemsize))
    return _fastest(t, plans, n_rows, hidden, vocab, itemsize, grads_in_forward=not (return_lse or grads_in_backward))


def _jax_memory_plans(t, n_rows, hidden, vocab, itemsize, memory) -> list[Plan]:
    """JAX "memory"'s tiles within its budget (`memory` makes a Plan of a layout and a
    block): XLA's, and `row_products`' (16-bit inputs; fp32 where XLA's do not fit: the
    kernels' fp32 products run without tensor cores and their rate was measured in bf16
    only; never fp64)."""
    plans = []
    if xla_memory_blocks_fit(t, n_rows, hidden, vocab, itemsize):
        plans.append(memory("tiles", *xla_memory_block_shape(t, n_rows, hidden, vocab, itemsize)))
    kernels = itemsize <= 2 or (itemsize == 4 and not plans)
    kernel_shape = kernel_memory_block_shape(t, n_rows, hidden, vocab, itemsize) if kernels else None
    if kernel_shape:
        plans.append(memory("tiles", *kernel_shape, kernel_products=True))
    return plans


def _fastest(t, plans, n_rows, hidden, vocab, itemsize, grads_in_forward: bool) -> Plan:
    """The plan of least `memory_plan_seconds`."""
    return min(plans, key=lambda p: memory_plan_seconds(t, p.layout, p.kernel_products, p.rows, p.cols, n_rows, hidden,
                                                        vocab, itemsize, grads_in_forward))
