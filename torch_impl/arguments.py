"""The tensor arguments of a call as the kernels may receive them: checked, then laid out.

Every public loss passes its tensors through `check_tensors` before anything reads them, and
every per-row or per-class tensor through `dense` before a kernel indexes it, so that no
argument a caller can pass (another device, the meta device, a strided or expanded view)
reaches a kernel that would misread it.
"""

from __future__ import annotations

import torch

from interop.options import check_num_items


def check_tensors(input: torch.Tensor, required: dict, optional: dict) -> None:
    """Refuse what the kernels must never see: TypeError for an argument that is not a tensor
    (None allowed for `optional`), ValueError for one on the meta device (shapes without data:
    a kernel would read uninitialised memory) or on another device than `input`. The dicts map
    argument names to values; `input` is checked as "input"."""
    named = {"input": input, **required, **optional}
    for name, t in named.items():
        if t is None and name in optional:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if name in optional else ''}, got {type(t).__name__}")
    for name, t in named.items():
        if t is None:
            continue
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (a shape without data): materialise it first "
                             "(e.g. module.to_empty(device=...) and load the weights)")
        if t.device != input.device:
            raise ValueError(f"{name} is on {t.device} but input is on {input.device}: every tensor argument "
                             "must be on the input's device")


def autocast_inputs(*tensors):
    """The floating inputs cast to the autocast dtype where autocast is on (None kept), as
    F.linear would cast them; else unchanged."""
    if not torch.is_autocast_enabled(tensors[0].device.type):
        return tensors
    dtype = torch.get_autocast_dtype(tensors[0].device.type)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """t with the strides the kernels index by (row-major, no gaps, no stride 0), or None.

    The kernels address per-row and per-class tensors (targets, bias, class weights, teacher
    ids, upstream gradients) as contiguous; every such tensor enters them through here, so a
    strided, sliced, transposed or expanded view is copied once per call instead of misread.
    """
    return None if t is None else t.contiguous()


def indices(t: torch.Tensor | None) -> torch.Tensor | None:
    """Integer targets or teacher ids as int64, or None. A uint64 value past int64's range
    would wrap to a negative one (2**64 - 100 to an ignored -100): it becomes int64's
    largest, outside every vocabulary, so an eager call reports it out of range and a
    compiled one gives its row NaN, as for any target >= V."""
    if t is None or t.dtype != torch.uint64:
        return None if t is None else t.to(torch.int64)
    wrapped = t.view(torch.int64)
    return torch.where(wrapped < 0, torch.iinfo(torch.int64).max, wrapped)


def denominator(num_items_in_batch, dtype: torch.dtype, device) -> torch.Tensor | float | None:
    """num_items_in_batch (None, a number > 0, or a tensor of one element) as the
    denominator of a mean: a 0-d tensor moved to `device` in `dtype`, a float, or None
    (`check_num_items`'s errors else)."""
    if num_items_in_batch is None:
        return None
    check_num_items(num_items_in_batch)
    if isinstance(num_items_in_batch, torch.Tensor):
        return num_items_in_batch.to(device=device, dtype=dtype).reshape(())
    return float(num_items_in_batch)
