"""Cross-entropy's plan for JAX (`plan`: interop.planning's blocks in a `BlockedConfig`, as
`torch_impl.head.plan`'s BlockPlan) and a call's `Problem`: the head in the plan's column blocks with the
block steps of `jax_impl.steps` (the Pallas kernels for "speed" and "memory", jax.numpy for
"chunked", the fallback wherever the kernels do not run: fp32 logits, fp64 for fp64
inputs, blocks of whole rows, chunk_rows each). `jax_impl.cross_entropy_rule` runs them.

- "speed": blocks of whole rows; grad_weight accumulated in fp32 (or the input dtype with
  accumulate_in_input_dtype).
- "memory": the forward pass takes its statistics from `jax_impl.fused_stats`, which forms
  no logits block; blocks of rows and vocabulary columns in the backward pass, grad_input
  of a row block accumulated in fp32 over its column blocks, grad_weight in the input
  dtype; the blocks' products XLA's or `jax_impl.row_products`' kernels. Or "memory" runs
  as "speed" in blocks of whole rows with grad_weight in the input dtype: of these plans
  within its memory the planner takes the one of least estimated time.
A large call without a returned lse (interop.blocking.skipping_pays) computes only the row
blocks that hold rows whose target is not ignored, those rows first (`jax_impl.rows.row_loop`
with `keep`): as PyTorch's kernels, the other rows get no logits and a zero grad_input.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from interop import planning
from interop.options import CrossEntropyOptions
from interop.tuning import Tuning
from jax_impl.head import Head
from jax_impl.rows import TargetRows, compute_dtype
from jax_impl.steps import steps_of


@dataclasses.dataclass(frozen=True)
class BlockedConfig:
    """Static configuration of one call (hashable: part of its `engine.Call`)."""

    options: CrossEntropyOptions
    weight_layout: str
    strategy: str  # the caller's: "speed", "memory" or "chunked"
    layout: str  # "rows": blocks of whole rows (gradients can be formed in the forward pass); "tiles": rows x columns
    block_rows: int
    block_cols: int
    accumulate_in_input_dtype: bool  # grad_weight accumulates in the input dtype (the plan's narrow_accumulator)
    return_lse: bool
    interpret: bool  # Pallas interpret mode (the arrays are not on a GPU)
    skip_ignored: bool  # compute only the row blocks holding rows whose target is not ignored
    fused_stats: bool  # a forward pass without gradients takes its statistics from `fused_stats.row_stats`
    tuning: Tuning
    kernel_products: bool = False  # "memory" blocks multiplied by `row_products`' kernels, not XLA
    split_rows: object = None  # the Axes of rows split across devices (`Head.split_rows`), or None
    keep_logits: bool = False  # the forward pass keeps the logits for the backward pass (`engine.keeps_logits`)

    @property
    def tail_split(self) -> int:
        """row_loop's tail_split when skipping ignored rows."""
        return self.tuning.speed_tail_split if self.layout == "rows" else 1

    @property
    def grads_in_forward(self) -> bool:
        """Whole-row blocks form the gradients in the forward rule; "chunked" recomputes them,
        holding no gradient between the rules (its role: the least memory, anywhere)."""
        return (self.layout == "rows" and self.options.reduction != "none" and not self.return_lse
                and self.strategy != "chunked")

    @property
    def ops(self):
        return steps_of(self.strategy, self.interpret)


def plan(t: Tuning, options, weight_layout, strategy, n_rows, hidden, vocab, dtype, accumulate_in_input_dtype,
         return_lse, platform, whole_vocab: int | None = None, split_rows=None) -> BlockedConfig:
    """The call's configuration: `interop.planning.plan`'s blocks ("memory": whole rows,
    tiles sized for XLA's temporaries or tiles for `row_products`' kernels, the least
    estimated time; its forward pass without gradients from `fused_stats`);
    whole_vocab: a split head's classes (vocab: the device's; "memory" then takes one
    device's block for the whole head, whole rows included, which PyTorch's split never
    takes); split_rows: the rows are one device's share of rows split across devices, over
    these `partitioned.Axes` (`Head.split_rows`; the same blocks: see
    `interop.blocking.one_speed_block`)."""
    p = planning.plan(t, "jax", "cross_entropy", strategy, n_rows, hidden, vocab, jnp.dtype(dtype).itemsize,
                      accumulate_in_input_dtype, return_lse=return_lse, whole_vocab=whole_vocab,
                      grads_in_backward=options.reduction == "none")
    return BlockedConfig(options, weight_layout, strategy, p.layout, p.rows, p.cols, p.narrow_accumulator, return_lse,
                         interpret=platform != "gpu", skip_ignored=p.skip_ignored, fused_stats=p.fused_stats, tuning=t,
                         kernel_products=p.kernel_products, split_rows=split_rows)


class Problem(Head):
    """A cross-entropy call: the head in cfg's column blocks (through `row_products`' kernels
    with cfg.kernel_products) plus the options, target facts and block steps; per-row
    values in `wide` (fp32, fp64 for fp64 inputs), the logits too for steps that compute on
    them (XlaOps)."""

    def __init__(self, x_ND, W, b_V, cw_V, y_N, cfg: BlockedConfig):
        self.ops = cfg.ops
        self.wide = compute_dtype(x_ND.dtype)
        super().__init__(x_ND, W, b_V, cfg.weight_layout, cfg.block_cols,
                         logits_dtype=self.wide if self.ops.compute_logits else None, split_rows=cfg.split_rows,
                         kernel_products=cfg.kernel_products, interpret=cfg.interpret)
        self.cfg = cfg
        self.cw = None if cw_V is None else cw_V.astype(self.wide)
        self.cw_sum = self.vocab if self.cw is None else self.cw.sum()
        self.rows = TargetRows.build(y_N, self.cw, self.vocab, cfg.options.ignore_index, self.wide)
        self.keep = self.rows.valid if cfg.skip_ignored else None  # the rows row_loop must compute


def split_config(cfg: BlockedConfig) -> BlockedConfig:
    """A plan's configuration for a head split over the vocabulary: every row computed (the
    rows to skip would differ between the devices' steps)."""
    return dataclasses.replace(cfg, skip_ignored=False)
