"""Hugging Face causal LMs whose training loss never builds the [B, T, V] logits.

    from torch_impl.transformers import patch_causal_lm, unpatch_causal_lm

    model = patch_causal_lm(AutoModelForCausalLM.from_config(config))  # or patch a class
    loss = model(input_ids, labels=labels).loss                       # model.train()

`patch_causal_lm` replaces the ``forward`` of one model, or of a model class (every
instance, new or old, then runs it). The patched forward, in train mode with ``labels``,
runs the decoder (``self.model``) for the final hidden states [B, T, D] and computes the
loss of ``transformers``' ``ForCausalLMLoss`` with `torch_impl.linear_cross_entropy` from
them and ``lm_head.weight`` [V, D] (+ ``lm_head.bias``), Gemma's
``config.final_logit_softcapping`` as ``softcap``. It returns the model's
``CausalLMOutputWithPast`` with ``logits=None``. In eval mode, or without labels, it calls
the original forward unchanged.

The decoder gets the arguments as the caller gave them, under the caller's names: the
cache argument (``past_key_values``, renamed ``cache`` in transformers 5.24) reaches it
only when given, so the fused call warns about a deprecated name only where the original
would.

``return_dict=False`` returns a tuple with the positional layout of the original's (loss,
logits, cache, hidden states, attentions): the logits slot holds None, so ``out[1]`` is the
logits in both (None when fused) and ``out[2]`` the cache. As in ``ModelOutput.to_tuple``,
the slots after the logits that are None (no cache, hidden states or attentions asked for)
are left out, as the original leaves them out.

The loss is ForCausalLMLoss's: targets are ``labels`` shifted left by one with
``ignore_index`` appended (or the ``shift_labels`` keyword as given); ``ignore_index``
(default -100) as a keyword; ``num_items_in_batch`` given (gradient accumulation) makes it
the fp32 sum over the valid targets divided by ``num_items_in_batch``, else their mean.
A custom ``model.loss_function`` is not called by the fused path. ``labels`` and
``shift_labels`` that are not integer tensors raise TypeError naming them.

``logits_to_keep`` chooses which positions get logits; the fused path builds none, so it
computes the loss over every position, as the original does with the default
``logits_to_keep=0``; any other value raises ValueError in the fused path (in eval mode or
without labels it reaches the original forward as usual).

The fused path reads the head's weight and bias without calling it, so the head must be a
plain ``nn.Linear``, or peft's ``ModulesToSaveWrapper`` around one (``modules_to_save=
["lm_head"]``: the fused loss uses the module the wrapper would run, the active adapter's
trained copy, or the original when adapters are disabled or none is active). Any other
head (a LoRA-wrapped ``lm_head``, say, whose adapter's term would be left out) raises
TypeError naming the model class, the head's type and what to do (merge the adapter).

Under FSDP2 (``fully_shard``) the head is a plain tensor when its group is the root's, whose
forward has gathered it; a head sharded on its own is met as a DTensor and gathered once per
call, its gradient reduce-scattered as FSDP2 reduces its other parameters'.

Covered families: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text,
``Gemma3ForCausalLM``) and Phi-3, those of them that the installed transformers has
(``SUPPORTED_MODELS`` lists their classes); a subclass that does not override ``forward``
counts as its base class. Tested with transformers 4.57, 5.0, 5.23 and 5.24.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from typing import NamedTuple

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from torch_impl.functional import linear_cross_entropy

__all__ = ["patch_causal_lm", "unpatch_causal_lm", "SUPPORTED_MODELS"]


class _Family(NamedTuple):
    """A causal-LM class of transformers and the config attribute of its final-logit softcap."""

    module: str
    class_name: str
    softcap_attr: str | None = None


_FAMILIES = {
    "Llama": _Family("transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    "Mistral": _Family("transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
    "Qwen2": _Family("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "Qwen3": _Family("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    "Gemma 2": _Family("transformers.models.gemma2.modeling_gemma2", "Gemma2ForCausalLM", "final_logit_softcapping"),
    "Gemma 3": _Family("transformers.models.gemma3.modeling_gemma3", "Gemma3ForCausalLM", "final_logit_softcapping"),
    "Phi-3": _Family("transformers.models.phi3.modeling_phi3", "Phi3ForCausalLM"),
}

_ORIGINAL = "_logitless_original"  # attribute of a patched forward: the forward it replaced


def _installed_classes() -> dict[type, str]:
    """The covered classes of the installed transformers -> their family (a key of
    ``_FAMILIES``); families it lacks are left out."""
    classes = {}
    for name, family in _FAMILIES.items():
        try:
            classes[getattr(importlib.import_module(family.module), family.class_name)] = name
        except (ImportError, AttributeError):
            pass
    return classes


_CLASSES = _installed_classes()
SUPPORTED_MODELS: tuple[str, ...] = tuple(cls.__name__ for cls in _CLASSES)


def _original(forward):
    """The forward that a patched ``forward`` replaced; ``forward`` itself when unpatched."""
    return getattr(forward, _ORIGINAL, forward)


def _base_class(cls: type) -> type:
    """The covered class whose forward ``cls`` runs, or ValueError naming ``cls``."""
    forward = _original(getattr(cls, "forward", None))
    for base in _CLASSES:
        if issubclass(cls, base) and forward is _original(vars(base)["forward"]):
            return base
    covered = ", ".join(f"{family} ({known.__name__})" for known, family in _CLASSES.items())
    raise ValueError(f"{cls.__qualname__} is not a causal LM that logitless can patch; covered: {covered}")


def _shift_targets(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """ForCausalLMLoss's targets: labels [..., T] (int) -> [..., T], position t gets
    labels[..., t + 1] and the last position ``ignore_index``."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    *,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_,
) -> torch.Tensor:
    """``ForCausalLMLoss(softcap(lm_head(hidden_states)), labels, ...)`` without the logits.

    Args:
        hidden_states: [B, T, D] final hidden states, the head's dtype.
        lm_head: the head, weight [V, D] and optional bias [V].
        labels: [B, T] int token ids or ``ignore_index``.
        softcap: c for c * tanh(logits / c), or None.
        num_items_in_batch: None for the mean over valid targets; else the loss is their sum
            divided by it (an int or a tensor).
        ignore_index: the target value that adds nothing.
        shift_labels: [B, T] targets to use as given instead of the shifted ``labels``.
        **_: the model's other keywords, which ForCausalLMLoss ignores too.

    Returns:
        The fp32 scalar loss.
    """
    if shift_labels is None:
        shift_labels = _shift_targets(labels, ignore_index)
    loss = linear_cross_entropy(
        hidden_states.reshape(-1, hidden_states.shape[-1]),
        lm_head.weight,
        shift_labels.reshape(-1).to(hidden_states.device),
        linear_bias=lm_head.bias,
        ignore_index=ignore_index,
        softcap=softcap,
        num_items_in_batch=num_items_in_batch,
    )
    return loss


def _is_modules_to_save(head: nn.Module) -> bool:
    """Whether ``head`` has the interface of peft's ``ModulesToSaveWrapper``, read by its
    attributes so that peft need not be importable here."""
    return all(hasattr(head, name) for name in ("original_module", "modules_to_save", "active_adapter", "disable_adapters"))


def _active_module(wrapper: nn.Module) -> nn.Module:
    """The module that a ``ModulesToSaveWrapper`` runs, as its forward picks it: the original
    when adapters are disabled or no active adapter has a copy, else the (one) active
    adapter's copy. ``active_adapter`` is a name in older peft, a list of names in newer."""
    active = wrapper.active_adapter
    names = [active] if isinstance(active, str) else list(active)
    if wrapper.disable_adapters or not names or any(name not in wrapper.modules_to_save for name in names):
        return wrapper.original_module
    return wrapper.modules_to_save[names[0]]


def _linear_head(model: nn.Module) -> nn.Linear:
    """The nn.Linear whose weight and bias make ``model``'s logits, or TypeError: the fused
    loss reads them without calling the head, so a head that computes more (a LoRA adapter's
    term, say) would silently lose it."""
    head = model.lm_head
    if _is_modules_to_save(head):
        head = _active_module(head)
    if not isinstance(head, nn.Linear):
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        raise TypeError(
            f"{type(model).__name__}: the fused loss needs an nn.Linear lm_head (or peft's ModulesToSaveWrapper around "
            f"one), not {kind}: it reads lm_head.weight and lm_head.bias without calling lm_head, so the wrapper's own "
            "computation would be left out; merge an adapter into the weight first (peft's merge_and_unload) or keep "
            "lm_head out of its target modules"
        )
    return head


def _check_labels(**labels) -> None:
    """TypeError, naming the argument, for labels that are not an integer tensor (None
    passes); they would otherwise fail deep inside under another name (the input of the
    shift's pad, the loss's target)."""
    for name, value in labels.items():
        if value is None:
            continue
        if not torch.is_tensor(value):
            raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(value).__name__}")
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got dtype {value.dtype}")


def _positional_tuple(output: CausalLMOutputWithPast) -> tuple:
    """``output.to_tuple()`` with the logits slot kept: (loss, None, cache, ...), the
    original's positions (its tuple always holds the logits at index 1)."""
    loss, *rest = output.to_tuple()
    return (loss, None, *rest)


def _fused_loss_forward(
    self,
    softcap_attr: str | None,
    *,
    labels: torch.Tensor,
    logits_to_keep: int | torch.Tensor = 0,
    return_dict: bool | None = None,
    **model_kwargs,
) -> CausalLMOutputWithPast | tuple:
    """The covered classes' forward with `_causal_lm_loss` in place of the head and
    ForCausalLMLoss: the output has the loss and ``logits=None``.

    Args:
        softcap_attr: the config attribute of the softcap, or None.
        labels, logits_to_keep: the forward's.
        return_dict: the forward's; None reads ``config.return_dict``, as transformers'
            ``can_return_tuple`` does.
        **model_kwargs: every other argument of the call, by the name the caller's forward
            gave it; the decoder gets them all, as the original passes its arguments on.
    """
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("logits_to_keep must be 0 when the loss is fused: no logits are built")
    _check_labels(labels=labels, shift_labels=model_kwargs.get("shift_labels"))
    head = _linear_head(self)
    outputs = self.model(**model_kwargs)
    softcap = None if softcap_attr is None else getattr(self.config, softcap_attr)
    output = CausalLMOutputWithPast(
        loss=_causal_lm_loss(outputs.last_hidden_state, head, labels, softcap=softcap, **model_kwargs),
        logits=None,
        **{name: value for name, value in outputs.items() if name != "last_hidden_state"},  # the cache by its own name
    )
    return output if (self.config.return_dict if return_dict is None else return_dict) else _positional_tuple(output)


def _patched(original, softcap_attr: str | None):
    """A forward that runs `_fused_loss_forward` in train mode with labels, else ``original``
    (a function of (self, ...)) with the arguments as given."""
    signature = inspect.signature(original)
    self_name = next(iter(signature.parameters))
    var_keyword = next((name for name, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        if self.training and arguments.get("labels") is not None:
            named = {name: value for name, value in arguments.items() if name not in (self_name, var_keyword)}
            return _fused_loss_forward(self, softcap_attr, **named, **arguments.get(var_keyword, {}))
        return original(self, *args, **kwargs)

    setattr(forward, _ORIGINAL, original)
    return forward


def _own_forward(obj):
    """The ``forward`` that ``obj`` (a class or a module) holds itself, else None; a bound
    method comes back as its function."""
    forward = vars(obj).get("forward")
    return forward.__func__ if isinstance(forward, types.MethodType) else forward


def patch_causal_lm(model_or_class):
    """Make a covered causal LM, or every instance of a covered class, compute its training
    loss without the logits (see the module's docstring).

    Args:
        model_or_class: a model instance (nn.Module) or a class of ``SUPPORTED_MODELS``
            (or a subclass that does not override ``forward``).

    Returns:
        ``model_or_class``, patched in place; patching it again changes nothing.

    Raises:
        ValueError: for another model or class, naming it and the covered families, or for
            an instance that holds a ``forward`` of its own (e.g. an accelerate hook).
    """
    is_class = isinstance(model_or_class, type)
    cls = model_or_class if is_class else type(model_or_class)
    softcap_attr = _FAMILIES[_CLASSES[_base_class(cls)]].softcap_attr
    if hasattr(cls.forward, _ORIGINAL) or hasattr(_own_forward(model_or_class), _ORIGINAL):
        return model_or_class
    if is_class:
        cls.forward = _patched(cls.forward, softcap_attr)
    elif _own_forward(model_or_class) is not None:
        raise ValueError(f"this {cls.__name__} has a forward of its own (an accelerate hook?): patch it before that is set")
    else:
        model_or_class.forward = types.MethodType(_patched(cls.forward, softcap_attr), model_or_class)
    return model_or_class


def unpatch_causal_lm(model_or_class):
    """Undo `patch_causal_lm` on the same object: ``forward`` is again exactly the original.

    Returns:
        ``model_or_class``.

    Raises:
        ValueError: if ``model_or_class`` itself was not patched (e.g. an instance whose
            class was patched: unpatch the class).
    """
    patched = _own_forward(model_or_class)
    if not hasattr(patched, _ORIGINAL):
        name = model_or_class.__name__ if isinstance(model_or_class, type) else f"this {type(model_or_class).__name__}"
        raise ValueError(f"{name} is not patched by patch_causal_lm")
    del model_or_class.forward
    if isinstance(model_or_class, type) and model_or_class.forward is not getattr(patched, _ORIGINAL):
        model_or_class.forward = getattr(patched, _ORIGINAL)
    return model_or_class
