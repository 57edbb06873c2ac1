"""`linear_cross_entropy` for PyTorch: checks the call, then runs the best path available."""

from __future__ import annotations

import dataclasses

import torch

from interop.blocking import skipping_pays
from interop.options import (DEFAULT_IGNORE_INDEX, CrossEntropyOptions, check_filter_eps, check_flags, check_inputs, check_reduction, check_strategy, check_tuning,
                             target_out_of_range_message)
from interop.tuning import Tuning
from torch_impl.arguments import autocast_inputs, check_tensors, dense, denominator, indices
from torch_impl.rows import compute_dtype
from torch_impl import custom_ops
from torch_impl.cross_entropy_rule import CrossEntropyCall
from torch_impl import engine, head
from torch_impl.steps import choose_strategy, plan_steps

try:
    from torch_impl import blocked
    from torch_impl.kernels import TargetCheck
except ImportError:  # no Triton: the chunked path serves every call
    blocked = None
try:
    from torch_impl import vocab_parallel as parallel
except ImportError:  # no torch.distributed: no head split over ranks
    parallel = None


def check_target_range(y_N: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise ValueError for a target outside [0, V) that is not ignore_index (eager calls: it
    waits for the device)."""
    bad = (y_N != ignore_index) & ((y_N < 0) | (y_N >= vocab))
    if bool(bad.any()):
        raise ValueError(target_out_of_range_message(int(y_N[bad][0]), vocab, ignore_index))


def rows_to_compute(keep_N: torch.Tensor) -> torch.Tensor | None:
    """int64 [A], ascending: the rows where keep_N (bool [N]) is set, or None when all or none
    are. Waits for the GPU (call it only where `skipping_pays`)."""
    active = keep_N.nonzero().squeeze(1)
    return active if 0 < active.shape[0] < keep_N.shape[0] else None


def valid_rows_only(t: Tuning, strategy: str, valid_N: torch.Tensor, hidden: int, vocab: int) -> torch.Tensor | None:
    """The valid rows [A] (int64) when the kernels should compute only those (the others add
    nothing to a loss; `rows_to_compute`, where `skipping_pays`), else None."""
    if strategy == "chunked" or not skipping_pays(t, valid_N.shape[0], hidden, vocab):
        return None
    return rows_to_compute(valid_N)


def head_slice(group, check_local, device, fingerprint: int = 0, kept=None, rows_dim: int | None = None):
    """This rank's `torch_impl.vocab_parallel.VocabSplit` of a head split over `group`, after
    every rank's own checks (`check_local`: the ProblemShape of this rank's arguments, or
    their error), which every rank learns of with what every rank's call must share
    (`torch_impl.vocab_parallel.vocab_slice`; kept may be a function of no arguments,
    called after check_local passes). rows_dim: as `split_operands` returns it."""
    if parallel is None:
        raise RuntimeError("vocab_parallel needs torch.distributed and Triton's package, which this install lacks")
    if not isinstance(group, torch.distributed.ProcessGroup):
        raise TypeError(f"vocab_parallel must be a torch.distributed ProcessGroup, got {type(group).__name__}")
    try:
        local, problem = check_local(), None
        kept = kept() if callable(kept) else kept
    except (ValueError, TypeError) as e:
        local, problem = None, e
    sizes = (0, 0, 0) if local is None else (local.vocab, local.hidden, local.n_rows)
    fingerprint = parallel.call_fingerprint(fingerprint, rows_dim)
    return parallel.vocab_slice(group, *sizes, device, problem, fingerprint, kept).with_rows_dim(rows_dim)


def runs_compiled(vocab_parallel, sequence_parallel: bool, *tensors) -> bool:
    """Whether a call runs as its custom op: inside torch.compile, with no head split over
    ranks (a split runs as one eager step there, a graph break)."""
    return torch.compiler.is_compiling() and vocab_parallel is None and not sequence_parallel \
        and (parallel is None or not parallel.any_dtensor(*tensors))


def split_operands(vocab_parallel, sequence_parallel: bool, weight_layout: str, *heads):
    """(heads, process group or None, rows_dim) of a call whose head may be split over ranks.

    heads: (input, linear_weight, linear_bias) triples: the student's, and a teacher's. They
    come back as given, or for DTensor arguments as their local tensors
    (`torch_impl.vocab_parallel.local_operands`): a head sharded on its vocabulary gives its
    mesh's group, an input sharded on its rows the dimension that the ranks split (rows_dim);
    every head must then be placed alike. With sequence_parallel, rows_dim is 0: the input
    holds this rank's part of the rows along its first dimension."""
    rows_dim = 0 if sequence_parallel else None
    if parallel is not None and parallel.any_dtensor(*(t for h in heads for t in h)):
        if vocab_parallel is not None:
            raise TypeError("vocab_parallel takes plain tensors (this rank's slices); DTensor arguments bring their "
                            "mesh's group: pass them without vocab_parallel")
        local = [parallel.local_operands(w, x, b, weight_layout) or (x, w, b, None, None) for x, w, b in heads]
        if any(part[3:] != local[0][3:] for part in local):
            raise ValueError("the teacher's input and head must be DTensors placed as the student's input and head")
        heads, (vocab_parallel, rows_dim) = [part[:3] for part in local], local[0][3:]
        if sequence_parallel and rows_dim is None:
            raise ValueError("sequence_parallel with DTensor arguments: the input's placement says which rows a rank "
                             "holds (Shard on a dimension of its rows, with a head sharded on its vocabulary)")
    if sequence_parallel and vocab_parallel is None:
        raise ValueError("sequence_parallel needs vocab_parallel (the process group that splits the rows and the head)")
    return heads, vocab_parallel, rows_dim


def whole_input(input: torch.Tensor, rows_dim: int | None, group) -> torch.Tensor:
    """input, or with sequence parallel a stand-in of the ranks' parts gathered (their shape,
    input's dtype and device, no storage): what the call's checks see."""
    return input if rows_dim is None else input.new_empty(()).expand(_whole_shape(input, rows_dim, group))


def _whole_shape(input: torch.Tensor, rows_dim: int | None, group) -> tuple[int, ...]:
    """The input's shape, or with sequence parallel the shape of every rank's part gathered
    along rows_dim."""
    if rows_dim is None:
        return tuple(input.shape)
    if input.dim() < 2:
        raise ValueError(f"sequence_parallel needs an input of rows [..., D], got input of shape {tuple(input.shape)}")
    shape = list(input.shape)
    shape[rows_dim] *= torch.distributed.get_world_size(group)
    return tuple(shape)


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_lse: bool = False,
    weight_layout: str = "VD",
    strategy: str = "auto",
    accumulate_in_input_dtype: bool = False,
    filter_eps: float | None = None,
    tuning: Tuning | None = None,
    vocab_parallel=None,
    sequence_parallel: bool = False,
    num_items_in_batch=None,
):
    """Cross-entropy of ``input @ linear_weight.T + linear_bias`` without the N x V logits.

    A drop-in for ``torch.nn.functional.linear_cross_entropy`` (PyTorch 2.13) on the
    arguments they share, with ``z_loss``, ``softcap``, ``return_lse`` and
    ``weight_layout`` added; interop/SPEC.md defines every option.

    Args:
        input: [..., D] bf16/fp16/fp32/fp64 hidden states.
        linear_weight: [V, D] (``weight_layout="VD"``, nn.Linear) or [D, V] ("DV"), the
            input's dtype.
        target: [...] integer class indices (or ``ignore_index``).
        linear_bias: optional [V], the input's dtype.
        weight: optional [V] class weights.
        reduction: "mean" (default), "sum" or "none".
        ignore_index: target value to ignore (default -100; None means -100).
        label_smoothing: in [0, 1].
        z_loss: coefficient of lse**2 per valid row.
        softcap: c > 0 to use c * tanh(logits / c); None for none.
        return_lse: also return the per-row logsumexp [...] (differentiable).
        weight_layout: "VD" or "DV", the layout of linear_weight.
        strategy: "auto", "speed", "memory" or "chunked" (interop.options.check_strategy).
        accumulate_in_input_dtype: accumulate grad_weight in the input dtype rather than
            fp32 ("speed": holds no V*D*4-byte accumulator, and with a 16-bit input takes
            blocks of 1.5x the logits; costs accuracy).
        filter_eps: gradient filtering, off (None) by default (interop.options.
            check_filter_eps). The kernels drop, per block of whole rows, each tile of
            512 classes whose every entry of dz lies below filter_eps x the row's scale
            (for plain cross-entropy: p_ij < filter_eps) and skip its matrix products;
            the targets' terms stay exact. 2**-12 is a common choice for bf16. Blocks of
            partial rows ("memory" at a large V) and "chunked" compute every entry.
        tuning: the block planner's numbers (interop.tuning.Tuning); None for the defaults,
            measured on H100/H200 GPUs.
        vocab_parallel: a process group over which the head is split by vocabulary: this
            rank's linear_weight (and linear_bias) hold a contiguous slice of the classes,
            the ranks' slices in rank order (uneven allowed); input, target and the class
            weights (all V classes) are the same on every rank (`torch_impl.vocab_parallel`).
            The loss and lse are global; grad_weight is this rank's slice, grad_input the
            full gradient (all-reduced). A DTensor head sharded on its vocabulary dimension
            with a replicated DTensor input is split the same way without this argument.
        sequence_parallel: with vocab_parallel, input holds this rank's part of the rows,
            split along its first dimension in rank order (equal parts, as Megatron's
            [s, b, h] activations); target has the whole rows. The parts are gathered in
            each pass and grad_input is this rank's part, reduce-scattered. A DTensor input
            sharded on a dimension other than its last, with a head sharded on its
            vocabulary, is handled the same way (torchtitan's Shard(1) hidden states).
        num_items_in_batch: with reduction="mean", the denominator in place of the valid
            rows' summed class weight (a number > 0 or a tensor): the global number of
            valid tokens when the rows of a batch are split across ranks or micro-batches,
            as Hugging Face's Trainer passes it.

    Returns:
        The loss, fp32 (fp64 for fp64 input): a scalar, or [...] for reduction="none";
        with ``return_lse``, the tuple (loss, lse [...]).

    On the kernel path, a large call (N * D * V >= tuning.skip_ignored_min_work) without
    ``return_lse`` computes only the rows whose target is not ``ignore_index`` (their
    logits, products and gradients; the others' grad_input is 0): finding them makes the
    host wait for the GPU once. A bad target raises ValueError in the same call; the host
    waits for the targets' check, not for the call's work.

    Inside ``torch.compile`` the call is the custom op ``logitless::linear_cross_entropy_<digest>``
    (`torch_impl.custom_ops`): the model compiles whole (``fullgraph=True``), once for any
    number of rows, and never waits for the GPU, so CUDA graphs can capture it. There a bad
    target gives a NaN row (and a NaN mean) instead of raising, ignored rows are computed
    and masked, and gradients are first-order. A head split over ranks (``vocab_parallel``
    or DTensors) runs as one eager step there (a graph break).
    """
    check_flags(return_lse=return_lse, accumulate_in_input_dtype=accumulate_in_input_dtype, sequence_parallel=sequence_parallel)
    kwargs = dict(linear_bias=linear_bias, weight=weight, reduction=reduction, ignore_index=ignore_index,
                  label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, return_lse=return_lse,
                  weight_layout=weight_layout, strategy=strategy, accumulate_in_input_dtype=accumulate_in_input_dtype,
                  filter_eps=filter_eps, tuning=tuning, num_items_in_batch=num_items_in_batch)
    if runs_compiled(vocab_parallel, sequence_parallel, input, linear_weight, linear_bias):
        return _compiled(input, linear_weight, target, **kwargs)
    return _eager(input, linear_weight, target, vocab_parallel=vocab_parallel, sequence_parallel=sequence_parallel,
                  **kwargs)


def _compiled(input, linear_weight, target, *, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss,
              softcap, return_lse, weight_layout, strategy, accumulate_in_input_dtype, filter_eps, tuning,
              num_items_in_batch):
    """The call inside torch.compile: the custom op (`torch_impl.custom_ops`), which checks
    the rest of the arguments when it is traced."""
    input, linear_weight, linear_bias = custom_ops.compiled_call(
        input, dict(linear_weight=linear_weight, target=target), dict(linear_bias=linear_bias, weight=weight), reduction,
        num_items_in_batch, linear_weight, linear_bias)
    loss, lse, *_ = _op(
        input, linear_weight, target, linear_bias, weight, "sum" if num_items_in_batch is not None else reduction,
        DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index, custom_ops.number("label_smoothing", label_smoothing),
        custom_ops.number("z_loss", z_loss), custom_ops.number("softcap", softcap, optional=True), weight_layout, strategy,
        accumulate_in_input_dtype, custom_ops.number("filter_eps", filter_eps, optional=True),
        custom_ops.tuning_values(check_tuning(tuning)),
        custom_ops.formed_now(reduction != "none" and not return_lse, strategy, input, linear_weight, linear_bias))
    lead = input.shape[:-1]
    loss = custom_ops.divided(loss.reshape(lead) if reduction == "none" else loss, num_items_in_batch)
    return (loss, lse.reshape(lead)) if return_lse else loss


def head_shape(input, linear_weight, target, linear_bias, weight, weight_layout, classes=None):
    """The ProblemShape of a cross-entropy call's tensors (`interop.options.check_inputs`:
    ValueError / TypeError naming the argument); classes: a split head's, if not the
    weight's."""
    return check_inputs(
        input_shape=tuple(input.shape), input_dtype=custom_ops.dtype_of(input),
        weight_shape=tuple(linear_weight.shape), weight_dtype=custom_ops.dtype_of(linear_weight),
        target_shape=tuple(target.shape), target_dtype=custom_ops.dtype_of(target),
        bias_shape=custom_ops.optional_shape(linear_bias), bias_dtype=custom_ops.dtype_of(linear_bias),
        class_weight_shape=custom_ops.optional_shape(weight), class_weight_dtype=custom_ops.dtype_of(weight),
        weight_layout=weight_layout, classes=classes)


def _op_checked(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss,
                softcap, weight_layout, strategy, accumulate_in_input_dtype, filter_eps, tuning):
    """(options, shape) of an op's call: the eager call's checks."""
    opts = CrossEntropyOptions(reduction, ignore_index, label_smoothing, z_loss, softcap)
    check_strategy(strategy)
    check_filter_eps(filter_eps)
    return opts, head_shape(input, linear_weight, target, linear_bias, weight, weight_layout)


def _op_build(*args):
    """The op's Call: the kernels' `blocked.KernelCall` with a plan that never waits for the
    GPU, or where the strategy resolves to "chunked", the block steps' `CrossEntropyCall`."""
    *args, grads = args
    (input, linear_weight, target, linear_bias, weight, _, _, _, _, _, weight_layout, strategy, accumulate,
     filter_eps, tuning) = args
    opts, shape = _op_checked(*args)
    n, d, vocab, t = shape.n_rows, shape.hidden, shape.vocab, custom_ops.tuning_from_values(tuning)
    x, y = input.reshape(n, d), indices(dense(target.reshape(n)))
    b, cw = dense(linear_bias), dense(weight)
    strategy = choose_strategy(strategy, x, n, d, vocab, t)
    if strategy == "chunked":
        plan, ops = plan_steps(t, "cross_entropy", strategy, n, d, vocab, x.dtype, accumulate)
        return CrossEntropyCall(opts, weight_layout, plan, ops), (x, linear_weight, b, cw, y)
    plan = head.plan(t, "cross_entropy", strategy, n, d, vocab, x.dtype, accumulate, filter_eps, forward_only=not any(grads))
    check = TargetCheck(y, cw, opts.ignore_index, vocab, watch=False)
    call = blocked.KernelCall(opts, weight_layout, dataclasses.replace(plan, host_sync=False), False, check)
    return call, (x, linear_weight, b, cw, y, None)


def _op_fake(*args):
    """(loss, lse), (lse,): the loss 0-d, or [N] for "none"; fp32 (fp64 for fp64 input)."""
    opts, shape = _op_checked(*args)
    lse = args[0].new_empty(shape.n_rows, dtype=compute_dtype(args[0].dtype))
    return (lse if opts.reduction == "none" else lse.new_empty(()), lse), (lse,)


_op = custom_ops.define(custom_ops.OpSpec(
    "linear_cross_entropy",
    "Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias, Tensor? weight, str reduction, "
    "int ignore_index, float label_smoothing, float z_loss, float? softcap, str weight_layout, str strategy, "
    "bool accumulate_in_input_dtype, float? filter_eps, float[] tuning",
    _op_build, _op_fake, outputs=2, values=2, grads_of=(0, 1, 3)))


@torch.compiler.disable
def _eager(input, linear_weight, target, *, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss, softcap,
           return_lse, weight_layout, strategy, accumulate_in_input_dtype, filter_eps, tuning, vocab_parallel,
           sequence_parallel, num_items_in_batch):
    """The eager call (and a split head's step in compiled code)."""
    ((input, linear_weight, linear_bias),), vocab_parallel, rows_dim = split_operands(
        vocab_parallel, sequence_parallel, weight_layout, (input, linear_weight, linear_bias))
    check_tensors(input, dict(linear_weight=linear_weight, target=target), dict(linear_bias=linear_bias, weight=weight))
    input, linear_weight, linear_bias = autocast_inputs(input, linear_weight, linear_bias)
    check_reduction(reduction, num_items_in_batch)
    opts = CrossEntropyOptions("sum" if num_items_in_batch is not None else reduction, ignore_index, label_smoothing,
                               z_loss, softcap)
    check_strategy(strategy)
    filter_eps = check_filter_eps(filter_eps)
    tuning = check_tuning(tuning)
    checked = lambda cw, classes: head_shape(whole_input(input, rows_dim, vocab_parallel), linear_weight, target,
                                             linear_bias, cw, weight_layout, classes)
    split = None
    if vocab_parallel is not None:
        # what decides the ranks' blocks and collectives, the same on every rank or an error on all
        grads = torch.is_grad_enabled(), *(t is not None and t.requires_grad for t in (input, linear_weight, linear_bias))
        fingerprint = parallel.call_fingerprint(strategy, custom_ops.dtype_of(input), opts, return_lse, weight_layout,
                                                accumulate_in_input_dtype, tuning, grads, weight is None)
        kept = target.ne(opts.ignore_index).sum() if not target.is_floating_point() else None
        split = head_slice(vocab_parallel, lambda: checked(None, None), input.device, fingerprint, kept, rows_dim)
    shape = checked(weight, None if split is None else split.vocab)
    # with sequence parallel, the rank's part of the rows: the split's loops gather them
    x_ND = input.reshape(shape.n_rows, shape.hidden) if rows_dim is None else input
    y_N = indices(dense(target.reshape(shape.n_rows)))
    linear_bias, weight = dense(linear_bias), dense(weight)
    local_vocab = linear_weight.shape[0 if weight_layout == "VD" else 1]
    # the classes a rank plans its blocks for: the whole head's, or the largest rank's slice
    # (the ranks then plan the same blocks and make the same collectives)
    plan_vocab = shape.vocab if split is None else split.largest
    requested = strategy
    choose = lambda x: choose_strategy(requested, x, shape.n_rows, shape.hidden, plan_vocab, tuning, split)
    strategy = choose(x_ND)
    if strategy == "chunked":  # block steps: the fallback
        check_target_range(y_N, shape.vocab, opts.ignore_index)
        plan, ops = plan_steps(tuning, "cross_entropy", strategy, shape.n_rows, shape.hidden, local_vocab, x_ND.dtype,
                               accumulate_in_input_dtype)
        loss, lse_N = engine.apply(CrossEntropyCall(opts, weight_layout, plan, ops, split), x_ND, linear_weight,
                                   linear_bias, weight, y_N)
    else:
        # The kernels read out-of-range targets safely (NaN rows), so the work is queued before
        # the host looks at the bad-target count: the check runs behind the first logits
        # product, and the host waits for the check only, not for the call's work.
        check = TargetCheck(y_N, weight, opts.ignore_index, shape.vocab)
        skip = not return_lse and skipping_pays(tuning, shape.n_rows, shape.hidden, shape.vocab)
        active = rows_to_compute(y_N != opts.ignore_index) if skip else None
        n_active = shape.n_rows if active is None else active.shape[0]
        needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_ND, linear_weight, linear_bias))
        dtype, gathered = x_ND.dtype, active is not None  # values: the backward pass's replan holds no tensor
        plan_for = lambda chosen: head.plan(tuning, "cross_entropy", chosen, n_active, shape.hidden, plan_vocab, dtype,
                                            accumulate_in_input_dtype, filter_eps if split is None else None,
                                            gathered_rows=gathered, n_all=shape.n_rows, forward_only=not needs_grad,
                                            whole_vocab=None if split is None else split.vocab)
        call = blocked.KernelCall(opts, weight_layout, plan_for(strategy), return_lse, check, split)
        if requested == "auto":
            engine.choose_again(call, lambda x: {"plan": plan_for(choose(x))})
        loss, lse_N = engine.apply(call, x_ND, linear_weight, linear_bias, weight, y_N, active)
        if check.bad_count():
            check_target_range(y_N, shape.vocab, opts.ignore_index)
    if opts.reduction == "none":
        loss = loss.reshape(shape.lead_shape)
    if num_items_in_batch is not None:
        loss = loss / denominator(num_items_in_batch, loss.dtype, loss.device)
    if return_lse:
        return loss, lse_N.reshape(shape.lead_shape)
    return loss
