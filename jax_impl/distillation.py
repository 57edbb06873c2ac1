"""The distillation losses for JAX (interop/SPEC-DISTILLATION.md), with the same arguments,
defaults and semantics as `torch_impl.distillation`: check the call, then run the Pallas
path (GPU) or the jax.numpy fallback (`jax_impl.distill_rules`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from interop.distillation import (DenseDistillationOptions, TopKDistillationOptions, check_dense_inputs,
                                  check_topk_inputs, teacher_id_out_of_range_message)
from interop.options import check_flags, check_reduction, check_strategy, check_tuning, target_out_of_range_message
from interop.tuning import Tuning
from jax_impl.distill_rules import dense_distillation, plan_steps, topk_distillation
from jax_impl.distill_rows import TopKTeacher, valid_rows
from jax_impl.functional import (as_array, choose_strategy, denominator, dtype_name, maybe_array, platform_of, shape_of,
                                 whole_vocab)
from jax_impl.rows import compute_dtype, narrow_indices, narrow_targets
from jax_impl.sharding import on_mesh, row_spec, with_rows_axes


def _rows_out_specs(input, reduction: str):
    """The output's PartitionSpec under an explicit mesh: the input's rows for "none"."""
    return lambda: row_spec(input) if reduction == "none" else P()


def _raise_if_concrete(bad_N, values_N, message) -> None:
    """Raise ValueError(message(first bad value)) for concrete arrays; traced ones get NaN rows."""
    if isinstance(bad_N, jax.core.Tracer) or isinstance(values_N, jax.core.Tracer):
        return
    bad = np.asarray(bad_N)
    if bad.any():
        raise ValueError(message(int(np.asarray(values_N)[bad][0])))


def linear_topk_distillation(input, linear_weight, teacher_ids, teacher_logprobs, *, target=None, linear_bias=None,
                             row_mask=None, temperature: float = 1.0, renormalize_teacher: bool = True,
                             tail_bucket: bool = False, temperature_squared: bool = True, weight_soft: float = 1.0,
                             weight_hard: float = 0.0, reduction: str = "mean", num_items_in_batch=None,
                             ignore_index: int | None = -100, softcap: float | None = None, weight_layout: str = "VD",
                             strategy: str = "auto", accumulate_in_input_dtype: bool = False,
                             tuning: Tuning | None = None, vocab_parallel: str | None = None):
    """Distillation from a top-K sparse teacher, fused with the student's head.

    The arguments of `logitless.torch.linear_topk_distillation` (interop/SPEC-DISTILLATION.md):
    input [..., D], linear_weight [V, D] ("VD") or [D, V] ("DV", Flax nnx.Linear's kernel),
    teacher_ids [..., K] (< 0: padding), teacher_logprobs [..., K] (-inf: padding), optional
    target [...], linear_bias [V], row_mask [...] bool. Differentiable in input,
    linear_weight and linear_bias (`jax.custom_vjp`), usable under `jax.jit`, where a
    teacher id >= V (or, with weight_hard > 0, a target out of range) gives its row a NaN
    loss instead of the eager call's ValueError. Arrays, meshes and second derivatives as
    for `logitless.jax.linear_cross_entropy`. vocab_parallel: inside `jax.shard_map`, the mesh
    axis over which the head is split by vocabulary (equal slices in the axis' order; teacher
    ids, targets and inputs the same on every device), as for `logitless.jax.linear_cross_entropy`.

    Returns:
        The loss, fp32 (fp64 for fp64 input): a scalar, or [...] for reduction="none".
    """
    check_flags(accumulate_in_input_dtype=accumulate_in_input_dtype)
    o = TopKDistillationOptions(temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft,
                                weight_hard, reduction, ignore_index, softcap)
    check_strategy(strategy)
    tuning = check_tuning(tuning)
    check_reduction(reduction, num_items_in_batch)
    input, linear_weight = as_array("input", input), as_array("linear_weight", linear_weight)
    teacher_ids, teacher_logprobs = as_array("teacher_ids", teacher_ids), as_array("teacher_logprobs", teacher_logprobs)
    target, linear_bias = maybe_array("target", target), maybe_array("linear_bias", linear_bias)
    row_mask = maybe_array("row_mask", row_mask)
    shape = check_topk_inputs(
        input_shape=input.shape, input_dtype=dtype_name(input), weight_shape=linear_weight.shape,
        weight_dtype=dtype_name(linear_weight), ids_shape=teacher_ids.shape, ids_dtype=dtype_name(teacher_ids),
        logprobs_shape=teacher_logprobs.shape, logprobs_dtype=dtype_name(teacher_logprobs), target_shape=shape_of(target),
        target_dtype=dtype_name(target), bias_shape=shape_of(linear_bias), bias_dtype=dtype_name(linear_bias),
        row_mask_shape=shape_of(row_mask), row_mask_dtype=dtype_name(row_mask), weight_layout=weight_layout,
        weight_hard=o.weight_hard)
    n, K, local_vocab = shape.n_rows, shape.k, shape.vocab
    V = local_vocab if vocab_parallel is None else whole_vocab(linear_weight, weight_layout, vocab_parallel)
    wide_ids = teacher_ids.reshape(n, K)
    bad_id = wide_ids >= V
    _raise_if_concrete(bad_id, wide_ids, lambda i: teacher_id_out_of_range_message(i, V))
    ids = narrow_indices(wide_ids, V, -1, V)  # padding -1, an id >= V stays out of range
    y, ignore32 = (None, o.ignore_index) if target is None else narrow_targets(target.reshape(n), V, o.ignore_index)
    valid = valid_rows(n, y, None if row_mask is None else row_mask.reshape(n), ignore32)
    bad = bad_id.any(axis=1)
    y_kernel = jnp.full((n,), -1, jnp.int32)
    if y is not None and o.weight_hard:
        bad_y = valid & ((y < 0) | (y >= V))
        _raise_if_concrete(bad_y, target.reshape(n), lambda t: target_out_of_range_message(t, V, o.ignore_index))
        bad = bad | bad_y
        y_kernel = jnp.where(valid & ~bad_y, y, -1)
    wide = compute_dtype(input.dtype)
    platform = platform_of(input)
    strategy = choose_strategy(strategy, input.dtype, n, shape.hidden, local_vocab, platform, tuning)
    cfg = plan_steps(tuning, "distillation", o, weight_layout, strategy, n, shape.hidden, local_vocab, input.dtype,
                     accumulate_in_input_dtype, platform, None if vocab_parallel is None else V,
                     recomputes=o.reduction == "none")
    num_items = denominator(num_items_in_batch, wide)

    def rows(x, W, b, ids, logprobs, bad, valid, y_kernel, num_items):
        teacher = TopKTeacher.build(ids, logprobs.reshape(n, K), o.renormalize_teacher, wide, bad & valid)
        loss = topk_distillation(x.reshape(n, shape.hidden), W, b, teacher, y_kernel, valid, num_items, cfg,
                                 vocab_parallel)
        return loss.reshape(shape.lead_shape) if reduction == "none" else loss

    args = (input, linear_weight, linear_bias, ids, teacher_logprobs, bad, valid, y_kernel, num_items)
    if vocab_parallel is not None:  # inside shard_map: the device's own operands
        return rows(input, *with_rows_axes((linear_weight, linear_bias), input), *args[3:])
    return on_mesh(rows, args, _rows_out_specs(input, reduction))


def linear_distillation(input, linear_weight, teacher_input, teacher_weight, *, target=None, row_mask=None,
                        divergence: str = "forward_kl", beta: float = 0.5, temperature: float = 1.0,
                        temperature_squared: bool = True, reduction: str = "mean", num_items_in_batch=None,
                        ignore_index: int | None = -100, weight_layout: str = "VD", strategy: str = "auto",
                        accumulate_in_input_dtype: bool = False, tuning: Tuning | None = None,
                        vocab_parallel: str | None = None):
    """Distillation from a dense teacher, both heads fused: no N x V buffer of either.

    The arguments of `logitless.torch.linear_distillation` (interop/SPEC-DISTILLATION.md):
    student input [..., D] and linear_weight, teacher_input [..., Dt] and teacher_weight
    (same layout; no gradient flows to them), divergence "forward_kl" | "reverse_kl" | "jsd"
    (beta), temperature; both distributions cover the first min(V, Vt) classes.
    vocab_parallel: inside `jax.shard_map`, the mesh axis over which both heads are split
    alike by vocabulary (each device the same slice of each head's classes, in the axis'
    order; the inputs the same on every device): the devices exchange a few statistics per
    row, never logits; the loss is global, grad_weight the device's slice.

    Returns:
        The loss, fp32 (fp64 for fp64 input): a scalar, or [...] for reduction="none".
    """
    check_flags(accumulate_in_input_dtype=accumulate_in_input_dtype)
    o = DenseDistillationOptions(divergence, beta, temperature, temperature_squared, reduction, ignore_index)
    check_strategy(strategy)
    tuning = check_tuning(tuning)
    check_reduction(reduction, num_items_in_batch)
    input, linear_weight = as_array("input", input), as_array("linear_weight", linear_weight)
    teacher_input, teacher_weight = as_array("teacher_input", teacher_input), as_array("teacher_weight", teacher_weight)
    target, row_mask = maybe_array("target", target), maybe_array("row_mask", row_mask)
    shape = check_dense_inputs(
        input_shape=input.shape, input_dtype=dtype_name(input), weight_shape=linear_weight.shape,
        weight_dtype=dtype_name(linear_weight), teacher_input_shape=teacher_input.shape,
        teacher_input_dtype=dtype_name(teacher_input), teacher_weight_shape=teacher_weight.shape,
        teacher_weight_dtype=dtype_name(teacher_weight), target_shape=shape_of(target), target_dtype=dtype_name(target),
        row_mask_shape=shape_of(row_mask), row_mask_dtype=dtype_name(row_mask), weight_layout=weight_layout)
    n = shape.n_rows
    vocab = min(shape.vocab, shape.teacher_vocab)
    classes = vocab
    if vocab_parallel is not None:
        if shape.teacher_vocab != shape.vocab:
            raise ValueError(f"with vocab_parallel, teacher_weight must hold the student's classes on each device: "
                             f"{shape.teacher_vocab} classes here against linear_weight's {shape.vocab} (cut a teacher "
                             "with more classes to the student's before splitting it)")
        classes = whole_vocab(linear_weight, weight_layout, vocab_parallel)
    y, ignore32 = (None, o.ignore_index) if target is None else narrow_targets(target.reshape(n), classes, o.ignore_index)
    valid = valid_rows(n, y, None if row_mask is None else row_mask.reshape(n), ignore32)
    platform = platform_of(input)
    strategy = choose_strategy(strategy, input.dtype, n, shape.hidden, vocab, platform, tuning)
    cfg = plan_steps(tuning, "distillation", o, weight_layout, strategy, n, shape.hidden, vocab, input.dtype,
                     accumulate_in_input_dtype, platform, None if vocab_parallel is None else classes,
                     recomputes=o.reduction == "none")

    def rows(x, W, xt, Wt, valid, num_items):
        xt_ND = jax.lax.stop_gradient(xt.reshape(n, shape.teacher_hidden))
        loss = dense_distillation(x.reshape(n, shape.hidden), W, xt_ND, jax.lax.stop_gradient(Wt), valid, num_items, cfg,
                                  vocab_parallel)
        return loss.reshape(shape.lead_shape) if reduction == "none" else loss

    args = (input, linear_weight, teacher_input, teacher_weight, valid, denominator(num_items_in_batch, compute_dtype(input.dtype)))
    if vocab_parallel is not None:  # inside shard_map: the device's own operands
        return rows(input, with_rows_axes(linear_weight, input), *args[2:])
    return on_mesh(rows, args, _rows_out_specs(input, reduction))
