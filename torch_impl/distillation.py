"""The distillation losses for PyTorch (interop/SPEC-DISTILLATION.md): check the call, then
run the block engine with its rules (`torch_impl.distill_rules`) on the Triton kernels (CUDA) or the PyTorch fallback."""

from __future__ import annotations

import torch

from interop.distillation import (DenseDistillationOptions, TopKDistillationOptions, check_dense_inputs, check_topk_inputs,
                                  teacher_id_out_of_range_message)
from interop.options import (DEFAULT_IGNORE_INDEX, check_flags, check_reduction, check_strategy, check_tuning,
                             target_out_of_range_message)
from interop.tuning import Tuning
from torch_impl import custom_ops
from torch_impl.arguments import autocast_inputs, check_tensors, dense, denominator, indices
from torch_impl.custom_ops import dtype_of, optional_shape
from torch_impl.distill_rules import DenseCall, TopKCall
from torch_impl import engine
from torch_impl.steps import choose_strategy, plan_steps
from torch_impl.distill_rows import TopKTeacher, valid_rows
from torch_impl.functional import (head_slice, runs_compiled, split_operands, valid_rows_only,
                                  whole_input)
from torch_impl.rows import compute_dtype
from torch_impl.vocab_parallel import call_fingerprint, local_targets


def _valid(o, shape, target, row_mask, device) -> torch.Tensor:
    """bool [N]: the rows that count (`distill_rows.valid_rows`) of a checked call."""
    n = shape.n_rows
    y = None if target is None else dense(indices(target.reshape(n)))
    return valid_rows(n, y, None if row_mask is None else dense(row_mask.reshape(n)), o.ignore_index, device)


def _dense_checked(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta, temperature,
                   temperature_squared, reduction, ignore_index, weight_layout, strategy, split: bool):
    """`dense_checked`; with a split, also that the rank's slices of the two
    heads are as many classes (ValueError naming both shapes otherwise)."""
    o, shape = dense_checked(input, linear_weight, teacher_input, teacher_weight, target, row_mask,
                                         divergence, beta, temperature, temperature_squared, reduction, ignore_index,
                                         weight_layout, strategy)
    if split and shape.vocab != shape.teacher_vocab:
        raise ValueError(f"vocab_parallel: linear_weight {tuple(linear_weight.shape)} and teacher_weight "
                         f"{tuple(teacher_weight.shape)} must hold the same classes on each rank ({shape.vocab} and "
                         f"{shape.teacher_vocab} here): cut the teacher's head to the student's classes")
    return o, shape


def _planner(strategy, n, hidden, plan_vocab, dtype, accumulate_in_input_dtype, tuning, split, buffers=1):
    """(choose(x) -> the strategy for the rows x, "auto" by the free memory now and the same on
    every rank of a split; plan_for(strategy, rows, gathered) -> (plan, ops) of `rows` rows)."""
    def choose(x):
        return choose_strategy(strategy, x, n, hidden, plan_vocab, tuning, split)

    def plan_for(chosen, rows, gathered):
        return plan_steps(tuning, "distillation", chosen, rows, hidden, plan_vocab, dtype, accumulate_in_input_dtype,
                          buffers=buffers, gathered_rows=gathered, whole_vocab=None if split is None else split.vocab)

    return choose, plan_for


def _all_rows(loss_A, rows, n: int):
    """Per-row losses of the computed rows [A] as [N], 0 for the others (differentiable)."""
    return loss_A if rows is None else loss_A.new_zeros(n).index_copy(0, rows, loss_A)


def linear_topk_distillation(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    linear_bias: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    renormalize_teacher: bool = True,
    tail_bucket: bool = False,
    temperature_squared: bool = True,
    weight_soft: float = 1.0,
    weight_hard: float = 0.0,
    reduction: str = "mean",
    num_items_in_batch=None,
    ignore_index: int | None = -100,
    softcap: float | None = None,
    weight_layout: str = "VD",
    strategy: str = "auto",
    accumulate_in_input_dtype: bool = False,
    tuning: Tuning | None = None,
    vocab_parallel=None,
    sequence_parallel: bool = False,
):
    """Distillation from a top-K sparse teacher, fused with the student's head.

    KL(teacher's top-K distribution || student's full-vocabulary softmax at temperature T),
    optionally mixed with a hard-label cross-entropy, without the N x V logits
    (interop/SPEC-DISTILLATION.md defines every option).

    Args:
        input: [..., D] student hidden states (bf16/fp16/fp32/fp64).
        linear_weight: [V, D] ("VD") or [D, V] ("DV"), the input's dtype.
        teacher_ids: [..., K] integer token ids; ids < 0 are padding.
        teacher_logprobs: [..., K] the teacher's log-probabilities of those ids (-inf: padding).
        target: optional [...] hard labels (for weight_hard and to mask ignore_index rows).
        linear_bias: optional [V]. row_mask: optional [...] bool, False rows are left out.
        temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft,
        weight_hard, softcap: see interop.distillation.TopKDistillationOptions.
        reduction: "mean" (over valid rows, or over num_items_in_batch), "sum" or "none".
        strategy, accumulate_in_input_dtype, weight_layout, tuning: as for linear_cross_entropy.
        vocab_parallel: a process group over which the head is split by vocabulary, as for
            linear_cross_entropy: this rank's linear_weight (and linear_bias) hold its
            contiguous slice of the classes; the other arguments, teacher ids (global) and
            target included, are the same on every rank. Each rank gathers the teacher's
            ids in its slice; the ranks exchange per-row statistics and the student's
            logits at the K ids (never a row of V logits). The loss is global, grad_weight
            this rank's slice, grad_input the full gradient (all-reduced). A DTensor head
            sharded on its vocabulary, with a DTensor input, is split the same way.
        sequence_parallel: with vocab_parallel, input holds this rank's part of the rows, as
            for linear_cross_entropy (the other per-row arguments hold the whole rows).

    Returns:
        The loss, fp32 (fp64 for fp64 input): a scalar, or [...] for reduction="none".
        Gradients flow to input, linear_weight and linear_bias.

    Inside torch.compile the call is the custom op ``logitless::linear_topk_distillation_<digest>``
    (as linear_cross_entropy's): a teacher id >= V or a bad hard target there gives a NaN
    row instead of raising; a split head (vocab_parallel, sequence_parallel, DTensors) runs as one eager step
    there (a graph break).
    """
    check_flags(accumulate_in_input_dtype=accumulate_in_input_dtype, sequence_parallel=sequence_parallel)
    kwargs = dict(target=target, linear_bias=linear_bias, row_mask=row_mask, temperature=temperature,
                  renormalize_teacher=renormalize_teacher, tail_bucket=tail_bucket,
                  temperature_squared=temperature_squared, weight_soft=weight_soft, weight_hard=weight_hard,
                  reduction=reduction, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index, softcap=softcap,
                  weight_layout=weight_layout, strategy=strategy, accumulate_in_input_dtype=accumulate_in_input_dtype)
    if runs_compiled(vocab_parallel, sequence_parallel, input, linear_weight, linear_bias):
        input, linear_weight, linear_bias = custom_ops.compiled_call(
            input, dict(linear_weight=linear_weight, teacher_ids=teacher_ids, teacher_logprobs=teacher_logprobs),
            dict(target=target, linear_bias=linear_bias, row_mask=row_mask), reduction, num_items_in_batch,
            linear_weight, linear_bias)
        loss, *_ = _topk_op(
            input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask,
            custom_ops.number("temperature", temperature), renormalize_teacher, tail_bucket, temperature_squared,
            custom_ops.number("weight_soft", weight_soft), custom_ops.number("weight_hard", weight_hard),
            "sum" if num_items_in_batch is not None else reduction,
            DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index,
            custom_ops.number("softcap", softcap, optional=True), weight_layout, strategy, accumulate_in_input_dtype,
            custom_ops.tuning_values(check_tuning(tuning)),
            custom_ops.formed_now(reduction != "none", strategy, input, linear_weight, linear_bias))
        return custom_ops.divided(loss.reshape(input.shape[:-1]) if reduction == "none" else loss, num_items_in_batch)
    return _topk_eager(input, linear_weight, teacher_ids, teacher_logprobs, **kwargs, tuning=tuning,
                       vocab_parallel=vocab_parallel, sequence_parallel=sequence_parallel)


@torch.compiler.disable
def _topk_eager(input, linear_weight, teacher_ids, teacher_logprobs, *, target, linear_bias, row_mask, temperature,
                renormalize_teacher, tail_bucket, temperature_squared, weight_soft, weight_hard, reduction,
                num_items_in_batch, ignore_index, softcap, weight_layout, strategy, accumulate_in_input_dtype, tuning,
                vocab_parallel, sequence_parallel):
    ((input, linear_weight, linear_bias),), vocab_parallel, rows_dim = split_operands(
        vocab_parallel, sequence_parallel, weight_layout, (input, linear_weight, linear_bias))
    check_tensors(input, dict(linear_weight=linear_weight, teacher_ids=teacher_ids, teacher_logprobs=teacher_logprobs),
                  dict(target=target, linear_bias=linear_bias, row_mask=row_mask))
    input, linear_weight, linear_bias = autocast_inputs(input, linear_weight, linear_bias)
    tuning = check_tuning(tuning)
    check_reduction(reduction, num_items_in_batch)
    checked = lambda: topk_checked(
        whole_input(input, rows_dim, vocab_parallel), linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask, temperature,
        renormalize_teacher, tail_bucket, temperature_squared, weight_soft, weight_hard, reduction, ignore_index, softcap,
        weight_layout, strategy)
    split = None
    if vocab_parallel is not None:
        # what decides the ranks' blocks and collectives, the same on every rank or an error on all
        fingerprint = call_fingerprint(
            temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft, weight_hard, reduction,
            ignore_index, softcap, strategy, input.dtype, weight_layout, accumulate_in_input_dtype, tuning,
            teacher_ids.shape[-1], target is None, row_mask is None, linear_bias is None, torch.is_grad_enabled(),
            *(t is not None and t.requires_grad for t in (input, linear_weight, linear_bias)))
        split = head_slice(vocab_parallel, lambda: checked()[1], input.device, fingerprint,
                           lambda: _valid(*checked(), target, row_mask, input.device).sum(), rows_dim)
    o, shape = checked()
    first, V = (0, shape.vocab) if split is None else (split.first, split.vocab)
    n, dev = shape.n_rows, input.device
    ids = dense(indices(teacher_ids.reshape(n, shape.k)))
    if bool((ids >= V).any()):
        raise ValueError(teacher_id_out_of_range_message(int(ids[ids >= V][0]), V))
    y = None if target is None else dense(indices(target.reshape(n)))
    valid = _valid(o, shape, target, row_mask, dev)
    y_kernel = torch.full((n,), -1, dtype=torch.int64, device=dev)
    if y is not None and o.weight_hard:
        bad = valid & ((y < 0) | (y >= V))
        if bool(bad.any()):
            raise ValueError(target_out_of_range_message(int(y[bad][0]), V, o.ignore_index))
        y_kernel = torch.where(valid, y, y_kernel)
    x_ND = input.reshape(n, shape.hidden) if rows_dim is None else input  # a part: the loops gather
    logprobs = dense(teacher_logprobs.reshape(n, shape.k))
    linear_bias = dense(linear_bias)
    wide = compute_dtype(input.dtype)
    # the classes a rank plans its blocks for: its own, or the largest rank's slice (the
    # ranks then plan the same blocks and make the same collectives)
    plan_vocab = shape.vocab if split is None else split.largest
    choose, plan_for = _planner(strategy, n, shape.hidden, plan_vocab, input.dtype, accumulate_in_input_dtype, tuning,
                                split)
    chosen = choose(x_ND)
    rows = valid_rows_only(tuning, chosen, valid, shape.hidden, plan_vocab)
    if rows is not None:  # the rows left out contribute nothing: the kernels compute only the others
        ids, logprobs, y_kernel, valid = (t.index_select(0, rows) for t in (ids, logprobs, y_kernel, valid))
    teacher = TopKTeacher(ids, logprobs, o.renormalize_teacher, wide)
    if split is not None:  # this rank's columns: the ids and target in its slice of the classes
        teacher, y_kernel = teacher.columns_of(first, shape.vocab), local_targets(y_kernel, first, shape.vocab)
    n_kept, gathered = valid.shape[0], rows is not None  # values: the backward pass's replan holds no tensor
    fields = lambda s: dict(zip(("plan", "ops"), plan_for(s, n_kept, gathered)))
    call = TopKCall(teacher, o, weight_layout, **fields(chosen), num_items=denominator(num_items_in_batch, wide, dev),
                    active=rows, split=split)
    if strategy == "auto":
        engine.choose_again(call, lambda x: fields(choose(x)))
    loss = engine.apply(call, x_ND, linear_weight, linear_bias, y_kernel, valid)
    return _all_rows(loss, rows, n).reshape(shape.lead_shape) if reduction == "none" else loss


def linear_distillation(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    temperature_squared: bool = True,
    reduction: str = "mean",
    num_items_in_batch=None,
    ignore_index: int | None = -100,
    weight_layout: str = "VD",
    strategy: str = "auto",
    accumulate_in_input_dtype: bool = False,
    tuning: Tuning | None = None,
    vocab_parallel=None,
    sequence_parallel: bool = False,
):
    """Distillation from a dense teacher, both heads fused: no N x V buffer of either.

    Args:
        input: [..., D] student hidden states; linear_weight: [V, D] ("VD") or [D, V].
        teacher_input: [..., Dt] teacher hidden states (the input's dtype and leading
            shape); teacher_weight: [Vt, Dt] or [Dt, Vt] (same layout). Neither gets a
            gradient. Both distributions cover the first min(V, Vt) classes.
        target: optional [...] labels, only to mask ignore_index rows; row_mask: optional
            [...] bool.
        divergence: "forward_kl" (default), "reverse_kl" or "jsd" (with beta in (0, 1)).
        temperature, temperature_squared: see interop.distillation.DenseDistillationOptions.
        reduction: "mean" (over valid rows, or over num_items_in_batch), "sum" or "none".
        strategy, accumulate_in_input_dtype, weight_layout, tuning: as for linear_cross_entropy.
        vocab_parallel: a process group over which both heads are split by vocabulary, as
            for linear_cross_entropy: this rank's linear_weight and teacher_weight hold the
            same contiguous slice of the classes (cut a teacher with more classes than the
            student to the student's first: other slices raise); the inputs are the same on
            every rank.
            The ranks exchange a few statistics per row, never logits; the loss is global,
            grad_weight this rank's slice, grad_input the full gradient (all-reduced).
            DTensor heads sharded on their vocabulary, with DTensor inputs, are split the
            same way (the teacher's placed as the student's).
        sequence_parallel: with vocab_parallel, input and teacher_input hold this rank's
            part of the rows, as for linear_cross_entropy.

    Returns:
        The loss, fp32 (fp64 for fp64 input): a scalar, or [...] for reduction="none".

    Inside torch.compile the call is the custom op ``logitless::linear_distillation_<digest>`` (as
    linear_cross_entropy's); a split head (vocab_parallel, sequence_parallel, DTensors) runs as one eager step
    there (a graph break).
    """
    check_flags(accumulate_in_input_dtype=accumulate_in_input_dtype, sequence_parallel=sequence_parallel)
    kwargs = dict(target=target, row_mask=row_mask, divergence=divergence, beta=beta, temperature=temperature,
                  temperature_squared=temperature_squared, reduction=reduction, num_items_in_batch=num_items_in_batch,
                  ignore_index=ignore_index, weight_layout=weight_layout, strategy=strategy,
                  accumulate_in_input_dtype=accumulate_in_input_dtype)
    if runs_compiled(vocab_parallel, sequence_parallel, input, linear_weight, teacher_input, teacher_weight):
        input, linear_weight, teacher_input, teacher_weight = custom_ops.compiled_call(
            input, dict(linear_weight=linear_weight, teacher_input=teacher_input, teacher_weight=teacher_weight),
            dict(target=target, row_mask=row_mask), reduction, num_items_in_batch, linear_weight, teacher_input,
            teacher_weight)
        loss, *_ = _dense_op(
            input, linear_weight, teacher_input.detach(), teacher_weight.detach(), target, row_mask, divergence,
            custom_ops.number("beta", beta), custom_ops.number("temperature", temperature), temperature_squared,
            "sum" if num_items_in_batch is not None else reduction,
            DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index, weight_layout, strategy,
            accumulate_in_input_dtype, custom_ops.tuning_values(check_tuning(tuning)),
            custom_ops.formed_now(reduction != "none", strategy, input, linear_weight))
        return custom_ops.divided(loss.reshape(input.shape[:-1]) if reduction == "none" else loss, num_items_in_batch)
    return _dense_eager(input, linear_weight, teacher_input, teacher_weight, **kwargs, tuning=tuning,
                        vocab_parallel=vocab_parallel, sequence_parallel=sequence_parallel)


@torch.compiler.disable
def _dense_eager(input, linear_weight, teacher_input, teacher_weight, *, target, row_mask, divergence, beta, temperature,
                 temperature_squared, reduction, num_items_in_batch, ignore_index, weight_layout, strategy,
                 accumulate_in_input_dtype, tuning, vocab_parallel, sequence_parallel):
    ((input, linear_weight, _), (teacher_input, teacher_weight, _)), vocab_parallel, rows_dim = split_operands(
        vocab_parallel, sequence_parallel, weight_layout, (input, linear_weight, None),
        (teacher_input, teacher_weight, None))
    check_tensors(input, dict(linear_weight=linear_weight, teacher_input=teacher_input, teacher_weight=teacher_weight),
                  dict(target=target, row_mask=row_mask))
    input, linear_weight, teacher_input, teacher_weight = autocast_inputs(input, linear_weight, teacher_input, teacher_weight)
    tuning = check_tuning(tuning)
    check_reduction(reduction, num_items_in_batch)
    checked = lambda: _dense_checked(whole_input(input, rows_dim, vocab_parallel), linear_weight,
                                     whole_input(teacher_input, rows_dim, vocab_parallel), teacher_weight, target,
                                     row_mask, divergence, beta, temperature, temperature_squared, reduction,
                                     ignore_index, weight_layout, strategy, vocab_parallel is not None)
    split = None
    if vocab_parallel is not None:
        # what decides the ranks' blocks and collectives, the same on every rank or an error on all
        fingerprint = call_fingerprint(
            divergence, beta, temperature, temperature_squared, reduction, ignore_index, strategy, input.dtype,
            weight_layout, accumulate_in_input_dtype, tuning, target is None, row_mask is None, torch.is_grad_enabled(),
            input.requires_grad, linear_weight.requires_grad)
        split = head_slice(vocab_parallel, lambda: checked()[1], input.device, fingerprint,
                           lambda: _valid(*checked(), target, row_mask, input.device).sum(), rows_dim)
    o, shape = checked()
    n, dev = shape.n_rows, input.device
    vocab = min(shape.vocab, shape.teacher_vocab)  # with a split: this rank's slice of both heads'
    plan_vocab = vocab if split is None else split.largest
    y = None if target is None else dense(indices(target.reshape(n)))
    valid = valid_rows(n, y, None if row_mask is None else dense(row_mask.reshape(n)), o.ignore_index, dev)
    x_ND, xt_ND = input, teacher_input.detach()  # with sequence parallel the parts: the loops gather
    if rows_dim is None:
        x_ND, xt_ND = x_ND.reshape(n, shape.hidden), xt_ND.reshape(n, shape.teacher_hidden)
    choose, plan_for = _planner(strategy, n, shape.hidden, plan_vocab, input.dtype, accumulate_in_input_dtype, tuning,
                                split, buffers=2)
    chosen = choose(x_ND)
    rows = valid_rows_only(tuning, chosen, valid, shape.hidden, plan_vocab)
    if rows is not None:
        valid = valid.index_select(0, rows)
    n_kept, gathered = valid.shape[0], rows is not None  # values: the backward pass's replan holds no tensor
    fields = lambda s: dict(zip(("plan", "ops"), plan_for(s, n_kept, gathered)))
    call = DenseCall(o, weight_layout, vocab, **fields(chosen),
                     num_items=denominator(num_items_in_batch, compute_dtype(input.dtype), dev), active=rows, split=split)
    if strategy == "auto":
        engine.choose_again(call, lambda x: fields(choose(x)))
    loss = engine.apply(call, x_ND, linear_weight, xt_ND, teacher_weight.detach(), valid)
    return _all_rows(loss, rows, n).reshape(shape.lead_shape) if reduction == "none" else loss


# ----------------------------------------------------------------------------- the custom ops


def topk_checked(input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask, temperature,
                  renormalize_teacher, tail_bucket, temperature_squared, weight_soft, weight_hard, reduction,
                  ignore_index, softcap, weight_layout, strategy):
    """(options, shape) of a top-K call: the eager call's checks."""
    o = TopKDistillationOptions(temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft,
                                weight_hard, reduction, ignore_index, softcap)
    check_strategy(strategy)
    shape = check_topk_inputs(
        input_shape=tuple(input.shape), input_dtype=dtype_of(input), weight_shape=tuple(linear_weight.shape),
        weight_dtype=dtype_of(linear_weight), ids_shape=tuple(teacher_ids.shape), ids_dtype=dtype_of(teacher_ids),
        logprobs_shape=tuple(teacher_logprobs.shape), logprobs_dtype=dtype_of(teacher_logprobs),
        target_shape=optional_shape(target), target_dtype=dtype_of(target), bias_shape=optional_shape(linear_bias),
        bias_dtype=dtype_of(linear_bias), row_mask_shape=optional_shape(row_mask), row_mask_dtype=dtype_of(row_mask),
        weight_layout=weight_layout, weight_hard=o.weight_hard)
    return o, shape


def _topk_operands(o, shape, input, teacher_ids, teacher_logprobs, target, row_mask):
    """(x [N, D], teacher, y [N] int64 (-1: none), valid [N]) as the eager call prepares them,
    except that a row with a teacher id >= V, or with a bad hard target, gets NaN teacher
    log-probabilities (a NaN loss and gradient) instead of raising; the bad id reads nothing."""
    n, V, dev, wide = shape.n_rows, shape.vocab, input.device, compute_dtype(input.dtype)
    ids = indices(teacher_ids.reshape(n, shape.k))
    bad = (ids >= V).any(1)
    ids = torch.where(ids >= V, -1, ids).contiguous()
    y = None if target is None else indices(target.reshape(n))
    valid = valid_rows(n, y, None if row_mask is None else dense(row_mask.reshape(n)), o.ignore_index, dev)
    y_kernel = torch.full((n,), -1, dtype=torch.int64, device=dev)
    if y is not None and o.weight_hard:
        in_range = (y >= 0) & (y < V)
        bad = bad | (valid & ~in_range)
        y_kernel = torch.where(valid & in_range, y, y_kernel)
    lp = teacher_logprobs.reshape(n, shape.k).to(wide)
    lp = torch.where(bad[:, None], torch.full_like(lp, torch.nan), lp).contiguous()
    return input.reshape(n, shape.hidden), TopKTeacher(ids, lp, o.renormalize_teacher, wide), y_kernel, valid


def _topk_build(input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask, temperature,
                renormalize_teacher, tail_bucket, temperature_squared, weight_soft, weight_hard, reduction, ignore_index,
                softcap, weight_layout, strategy, accumulate_in_input_dtype, tuning, grads):
    """The top-K op's Call (`custom_ops.OpSpec`)."""
    o, shape = topk_checked(input, linear_weight, teacher_ids, teacher_logprobs, target, linear_bias, row_mask,
                            temperature, renormalize_teacher, tail_bucket, temperature_squared, weight_soft, weight_hard,
                            reduction, ignore_index, softcap, weight_layout, strategy)
    x, teacher, y, valid = _topk_operands(o, shape, input, teacher_ids, teacher_logprobs, target, row_mask)
    plan, ops = custom_ops.block_steps("distillation", strategy, x, shape.vocab, input.dtype, accumulate_in_input_dtype, tuning)
    return TopKCall(teacher, o, weight_layout, plan, ops, None, None, None), (x, linear_weight, dense(linear_bias), y, valid)


def _topk_fake(*args):
    """(loss,), (lse_T, lse_1 [N], s_ids [N, K], s_y [N]): the compute dtype."""
    o, shape = topk_checked(*args[:18])
    rows = lambda *s: args[0].new_empty(s, dtype=compute_dtype(args[0].dtype))
    n = shape.n_rows
    return (rows(n) if o.reduction == "none" else rows(),), (rows(n), rows(n), rows(n, shape.k), rows(n))


_topk_op = custom_ops.define(custom_ops.OpSpec(
    "linear_topk_distillation",
    "Tensor input, Tensor linear_weight, Tensor teacher_ids, Tensor teacher_logprobs, Tensor? target, "
    "Tensor? linear_bias, Tensor? row_mask, float temperature, bool renormalize_teacher, bool tail_bucket, "
    "bool temperature_squared, float weight_soft, float weight_hard, str reduction, int ignore_index, float? softcap, "
    "str weight_layout, str strategy, bool accumulate_in_input_dtype, float[] tuning",
    _topk_build, _topk_fake, outputs=1, values=1, grads_of=(0, 1, 5)))


def dense_checked(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta, temperature,
                   temperature_squared, reduction, ignore_index, weight_layout, strategy):
    """(options, shape) of a dense-teacher call: the eager call's checks."""
    o = DenseDistillationOptions(divergence, beta, temperature, temperature_squared, reduction, ignore_index)
    check_strategy(strategy)
    shape = check_dense_inputs(
        input_shape=tuple(input.shape), input_dtype=dtype_of(input), weight_shape=tuple(linear_weight.shape),
        weight_dtype=dtype_of(linear_weight), teacher_input_shape=tuple(teacher_input.shape),
        teacher_input_dtype=dtype_of(teacher_input), teacher_weight_shape=tuple(teacher_weight.shape),
        teacher_weight_dtype=dtype_of(teacher_weight), target_shape=optional_shape(target), target_dtype=dtype_of(target),
        row_mask_shape=optional_shape(row_mask), row_mask_dtype=dtype_of(row_mask), weight_layout=weight_layout)
    return o, shape


def _dense_operands(o, shape, input, teacher_input, target, row_mask):
    """(x [N, D], teacher x [N, Dt], valid [N], vocab: the classes both heads cover)."""
    n = shape.n_rows
    y = None if target is None else indices(target.reshape(n))
    valid = valid_rows(n, y, None if row_mask is None else dense(row_mask.reshape(n)), o.ignore_index, input.device)
    return (input.reshape(n, shape.hidden), teacher_input.reshape(n, shape.teacher_hidden), valid,
            min(shape.vocab, shape.teacher_vocab))


def _dense_build(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta, temperature,
                 temperature_squared, reduction, ignore_index, weight_layout, strategy, accumulate_in_input_dtype, tuning,
                 grads):
    """The dense-teacher op's Call (`custom_ops.OpSpec`)."""
    o, shape = dense_checked(input, linear_weight, teacher_input, teacher_weight, target, row_mask, divergence, beta,
                             temperature, temperature_squared, reduction, ignore_index, weight_layout, strategy)
    x, xt, valid, vocab = _dense_operands(o, shape, input, teacher_input, target, row_mask)
    plan, ops = custom_ops.block_steps("distillation", strategy, x, vocab, input.dtype, accumulate_in_input_dtype, tuning, buffers=2)
    return DenseCall(o, weight_layout, vocab, plan, ops, None, None, None), (x, linear_weight, xt, teacher_weight, valid)


def _dense_fake(*args):
    """(loss,), (lse_s, lse_t, kl_q [N]): the compute dtype."""
    o, shape = dense_checked(*args[:14])
    rows = lambda *s: args[0].new_empty(s, dtype=compute_dtype(args[0].dtype))
    n = shape.n_rows
    return (rows(n) if o.reduction == "none" else rows(),), (rows(n), rows(n), rows(n))


_dense_op = custom_ops.define(custom_ops.OpSpec(
    "linear_distillation",
    "Tensor input, Tensor linear_weight, Tensor teacher_input, Tensor teacher_weight, Tensor? target, Tensor? row_mask, "
    "str divergence, float beta, float temperature, bool temperature_squared, str reduction, int ignore_index, "
    "str weight_layout, str strategy, bool accumulate_in_input_dtype, float[] tuning",
    _dense_build, _dense_fake, outputs=1, values=1, grads_of=(0, 1)))
