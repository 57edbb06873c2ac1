"""Hugging Face causal LMs whose training loss never builds the [B, T, V] logits.

    from torch_impl.transformers import patch_causal_lm, unpatch_causal_lm

    model = patch_causal_lm(AutoModelForCausalLM.from_config(config))  # or patch a class
    loss = model(input_ids, labels=labels).loss                       # model.train()

`patch_causal_lm` wraps the ``forward`` of one model, or of a model class (every instance,
new or old, then runs it). Any transformers causal LM qualifies whose head is the module
``get_output_embeddings()`` returns and whose training loss is transformers' causal-LM loss
(``ForCausalLMLoss``): dense or mixture-of-experts, tied or untied head, with or without a
bias. In train mode with ``labels`` the wrapped forward runs the original forward with
``labels=None``; a hook on the head takes the final hidden states the head receives and
hands the head one position per sequence instead of all, so the original's own code after
the head (softcapping, logit scaling, the mixture-of-experts router loss) runs on [B, 1, V]
logits. The loss is then ForCausalLMLoss's, computed by `logitless.torch.linear_cross_entropy`
from the hidden states and the head's weight and bias:

- the logits' transforms read from the config: ``final_logit_softcapping`` (Gemma 2 and 3)
  as ``softcap``; ``logits_scaling`` (Granite: logits divided by it), ``logit_scale``
  (Cohere: multiplied) as a scale of the hidden states, which scales the logits exactly;
  the first fused call of each model, when eager, checks the original's logits at the kept
  position against these and raises ValueError for a transform it would leave out;
- the targets are ``labels`` shifted left by one with ``ignore_index`` appended (or the
  ``shift_labels`` keyword as given); ``ignore_index`` (default -100) as a keyword;
  ``num_items_in_batch`` given (gradient accumulation) makes the loss the fp32 sum over the
  valid targets divided by it, else their mean;
- a mixture-of-experts model that returns ``aux_loss`` (``output_router_logits``) adds
  ``router_aux_loss_coef * aux_loss``, as the original does.

For RL, ``model(input_ids, ..., labels=labels, return_log_probs=True, temperature=T,
return_entropy=True)`` (train or eval mode) returns the original's output, always a
ModelOutput, with ``loss=None``, ``logits=None`` and, [B, T] each (fp32, fp64 for an fp64
model), ``log_probs`` (position t: log p(labels[t + 1]) under softmax(logits / T), as the
loss shifts them; ``shift_labels`` as given) and, when asked, ``entropy``: 0 where the
shifted label is ``ignore_index`` and at the last position. Only the labelled positions (no
prompt, no padding) reach the head, through `logitless.torch.linear_log_probs` (selecting
them is a graph break under torch.compile); a mixture of experts keeps its ``aux_loss``.
``temperature`` and ``return_entropy`` without ``return_log_probs=True`` raise ValueError.

The output is the original's, with the loss and ``logits=None``. ``return_dict=False``
returns the original's tuple layout (loss, logits, cache, ...) with None in the logits slot.
In eval mode, or without labels, the original forward runs unchanged; with
``skip_logits_in_eval=True`` an eval call with labels is fused too (a validation loss
without the logits). ``logits_to_keep`` other than 0 raises ValueError in the fused path.

The fused path reads the head's weight and bias without calling it on every position, so
the head must be a plain ``nn.Linear``, or peft's ``ModulesToSaveWrapper`` around one
(``modules_to_save=["lm_head"]``: the fused loss uses the module the wrapper would run, the
active adapter's trained copy, or the original when adapters are disabled or none is
active). Any other head (a LoRA-wrapped ``lm_head``, say, whose adapter's term would be left
out) raises TypeError naming the model class, the head's type and what to do (merge the
adapter). A model whose ``loss_function`` is not ForCausalLMLoss (a custom one, or another
task's) raises ValueError naming it.

Under FSDP2 (``fully_shard``) the head is a plain tensor when its group is the root's, whose
forward has gathered it; a head sharded on its own is met as a DTensor and gathered once per
call, its gradient reduce-scattered as FSDP2 reduces its other parameters'. A head that
tensor parallelism splits over its vocabulary (``ColwiseParallel``, transformers' "colwise"
plans) stays split: the loss splits the classes over the same ranks, exchanging a few
floats per row (`torch_impl.vocab_parallel`). Inside
``torch.compile`` the fused forward traces whole (the loss is a custom op); patch an instance
(which installs the head's hook) before compiling it. CI tests the oldest transformers
supported (4.57) and the newest pip offers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import weakref

import torch
from torch import nn

from torch_impl.functional import linear_cross_entropy
from torch_impl.log_probs import linear_log_probs

__all__ = ["patch_causal_lm", "unpatch_causal_lm"]

_ORIGINAL = "_logitless_original"  # attribute of a patched forward: the forward it replaced
_VERIFIED = "_logitless_verified"  # attribute of a model whose logits' transforms were checked
# The config attributes of the transforms applied to the logits after the head, and how:
# (attribute, multiplies the logits (True) or divides them (False)).
_SCALES = (("logit_scale", True), ("logits_scaling", False))
_SOFTCAP = "final_logit_softcapping"
_LOG_PROB_OPTIONS = ("temperature", "return_entropy")  # keywords of the log-probability mode


@dataclasses.dataclass(eq=False)  # compared by identity: each call finds and removes its own
class _Capture:
    """One fused call's view of its head: the head module (whose hook fills `hidden`) and
    whether the logits the original computes at the kept position are checked (`logits`:
    the head's output there)."""

    head: nn.Module
    check: bool
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


# The fused calls running, innermost last: one list for every thread (a Python global, which
# torch.compile traces), each hook finding the call of its own head, so that models running
# in threads at once (nn.DataParallel's replicas) each find theirs.
_CAPTURES: list[_Capture] = []
_HOOKED = weakref.WeakKeyDictionary()  # head -> the class of the model whose call hooked it


def _capture_of(module) -> _Capture | None:
    """The innermost running fused call whose head is `module`, or None."""
    for capture in reversed(_CAPTURES):
        if capture.head is module:
            return capture
    return None


def _capture_hook(module, args):
    """Forward pre-hook of a patched model's head: inside a fused call, keep the hidden states
    [..., T, D] and give the head the first position only."""
    capture = _capture_of(module)
    if capture is None:
        return None
    capture.hidden = args[0]
    return (args[0][..., :1, :], *args[1:])


def _logits_hook(module, args, output):
    """Forward hook of a patched model's head: the head's own logits at the kept position,
    kept when the call checks the transforms after it."""
    capture = _capture_of(module)
    if capture is not None and capture.check:
        # a head split by tensor parallelism whose hooks run after this one: its shard, gathered
        capture.logits = output.full_tensor() if hasattr(output, "full_tensor") else output


def _install_hooks(head: nn.Module, model_class: type) -> None:
    """Give ``head`` the capture hooks once (a model's head can be replaced after the patch:
    each fused call installs them on the head it meets)."""
    if _capture_hook not in head._forward_pre_hooks.values():
        head.register_forward_pre_hook(_capture_hook)
        head.register_forward_hook(_logits_hook)
        _HOOKED[head] = model_class


def _remove_hooks(head: nn.Module | None) -> None:
    if head is None:
        return
    _HOOKED.pop(head, None)
    for hooks, hook in ((head._forward_pre_hooks, _capture_hook), (head._forward_hooks, _logits_hook)):
        for key in [k for k, v in hooks.items() if v is hook]:
            del hooks[key]


def _original(forward):
    """The forward that a patched ``forward`` replaced; ``forward`` itself when unpatched."""
    return getattr(forward, _ORIGINAL, forward)


def _causal_lm_names() -> set[str]:
    """The class names AutoModelForCausalLM builds, for every model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def _check_class(cls: type) -> None:
    """ValueError naming ``cls`` unless it is a transformers causal LM: a class that
    AutoModelForCausalLM builds (or a subclass, or a remote-code class named ...ForCausalLM),
    with ``get_output_embeddings`` and a forward taking ``labels``. Other heads with labels
    (masked LM, sequence-to-sequence) define their loss otherwise."""
    forward = getattr(cls, "forward", None)
    prefix = f"{cls.__qualname__} is not a causal LM that logitless can patch"
    if forward is None or not callable(getattr(cls, "get_output_embeddings", None)):
        raise ValueError(f"{prefix}: it has no get_output_embeddings() (a transformers model with a language-modelling "
                         "head has)")
    if "labels" not in inspect.signature(_original(forward)).parameters:
        raise ValueError(f"{prefix}: its forward takes no labels")
    names = _causal_lm_names()
    if not (cls.__name__.endswith("ForCausalLM") or any(base.__name__ in names for base in cls.__mro__)):
        raise ValueError(f"{prefix}: AutoModelForCausalLM does not build it (its loss is not the shifted "
                         "next-token cross-entropy)")


def _check_model(model: nn.Module) -> nn.Module:
    """The head module of a model the fused path can serve, or ValueError naming the model
    and why not (no head; a training loss other than transformers' causal-LM loss)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(model).__name__
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{name}: get_output_embeddings() is None, so there is no head to fuse with the loss")
    loss_function = getattr(model, "loss_function", ForCausalLMLoss)
    if loss_function is not ForCausalLMLoss:
        raise ValueError(f"{name}: its loss_function is {getattr(loss_function, '__qualname__', loss_function)!r}, not "
                         "transformers' causal-LM loss (ForCausalLMLoss): the fused path computes only that loss")
    return head


def _shift_targets(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """ForCausalLMLoss's targets: labels [..., T] (int) -> [..., T], position t gets
    labels[..., t + 1] and the last position ``ignore_index``."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _checked_targets(hidden_states: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                     shift_labels: torch.Tensor | None) -> torch.Tensor:
    """The targets [B, T]: shift_labels as given, else labels shifted (`_shift_targets`);
    ValueError naming the argument when their shape is not the tokens' (hidden_states [B, T, D])."""
    name = "labels" if shift_labels is None else "shift_labels"
    if shift_labels is None:
        shift_labels = _shift_targets(labels, ignore_index)
    if tuple(shift_labels.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(f"{name} must have the shape of the input's tokens {tuple(hidden_states.shape[:-1])}, got "
                         f"{tuple(shift_labels.shape)}")
    return shift_labels


def _logit_transforms(config) -> tuple[float, float | None]:
    """(scale, softcap) of the logits after the head: logits = softcap(scale * (x W^T + b))."""
    scale = 1.0
    for attr, multiplies in _SCALES:
        value = getattr(config, attr, None)
        if value is not None:
            scale = scale * value if multiplies else scale / value
    return scale, getattr(config, _SOFTCAP, None)


def _causal_lm_loss(
    hidden_states: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    *,
    scale: float = 1.0,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_,
) -> torch.Tensor:
    """``ForCausalLMLoss(softcap(scale * lm_head(hidden_states)), labels, ...)`` without the logits.

    Args:
        hidden_states: [B, T, D] final hidden states, the head's dtype.
        lm_head: the head, weight [V, D] and optional bias [V].
        labels: [B, T] int token ids or ``ignore_index``.
        scale: the logits' factor (the bias is scaled with them: it scales the hidden
            states and the bias, which is the same).
        softcap: c for c * tanh(logits / c), or None.
        num_items_in_batch: None for the mean over valid targets; else the loss is their sum
            divided by it (an int or a tensor).
        ignore_index: the target value that adds nothing.
        shift_labels: [B, T] targets to use as given instead of the shifted ``labels``.
        **_: the model's other keywords, which ForCausalLMLoss ignores too.

    Returns:
        The fp32 scalar loss.
    """
    shift_labels = _checked_targets(hidden_states, labels, ignore_index, shift_labels)
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    bias = lm_head.bias
    if scale != 1.0:
        x = x * scale
        bias = None if bias is None else bias * scale
    return linear_cross_entropy(_tensor_parallel_input(x, lm_head), lm_head.weight,
                                shift_labels.reshape(-1).to(hidden_states.device), linear_bias=bias,
                                ignore_index=ignore_index, softcap=softcap, num_items_in_batch=num_items_in_batch)


def _causal_lm_log_probs(
    hidden_states: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token (log p(next token), entropy or None) of softmax(softcap(scale *
    lm_head(hidden_states)) / temperature), [B, T] fp32 each, 0 where the shifted target is
    ignore_index; only the other positions (no prompt, no padding) reach the head.

    Args as for `_causal_lm_loss`; temperature: T > 0 (the rollouts' sampling temperature);
    return_entropy: also the entropy. Selecting the labelled positions waits for the device
    (`nonzero`): under torch.compile a graph break."""
    shift_labels = _checked_targets(hidden_states, labels, ignore_index, shift_labels)
    if hasattr(hidden_states, "to_local"):  # a DTensor replicated by a tensor-parallel head's input hook
        hidden_states = hidden_states.full_tensor()
    targets = shift_labels.reshape(-1).to(hidden_states.device)
    rows = (targets != ignore_index).nonzero().squeeze(1)  # the positions computed
    x = hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, rows)
    bias = lm_head.bias
    if scale != 1.0:
        x = x * scale
        bias = None if bias is None else bias * scale
    log_probs, entropy = linear_log_probs(_tensor_parallel_input(x, lm_head), lm_head.weight, targets[rows],
                                          linear_bias=bias, temperature=temperature, softcap=softcap,
                                          ignore_index=ignore_index, return_entropy=True)
    spread = lambda v: v.new_zeros(targets.shape).index_copy(0, rows, v).reshape(shift_labels.shape)
    return spread(log_probs), (spread(entropy) if return_entropy else None)


def _tensor_parallel_input(x: torch.Tensor, lm_head: nn.Linear):
    """x as a DTensor replicated on the head's mesh when tensor parallelism splits the head
    over its vocabulary (a Shard(0) DTensor weight, as ColwiseParallel and transformers'
    "colwise" plans make it, on a module FSDP2 does not manage): the loss then splits the
    classes over the ranks as the head does (`torch_impl.vocab_parallel`), where a plain x
    would have the head gathered. Else x."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    weight = lm_head.weight
    if not isinstance(weight, DTensor) or isinstance(x, DTensor) or tuple(weight.placements) != (Shard(0),):
        return x
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    if isinstance(lm_head, FSDPModule):  # FSDP2's shards split the rows of the batch, not the classes
        return x
    return DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)


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


def _linear_head(model: nn.Module, head: nn.Module) -> nn.Linear:
    """The nn.Linear whose weight and bias make ``model``'s logits, or TypeError: the fused
    loss reads them without calling the head, so a head that computes more (a LoRA adapter's
    term, say) would silently lose it."""
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


def _check_transforms(model: nn.Module, capture: _Capture, logits: torch.Tensor, scale: float, softcap) -> None:
    """ValueError naming the model when the logits its forward returned at the kept position
    are not softcap(scale * the head's logits): a transform the fused loss would leave out."""
    expected = capture.logits.float() * scale
    if softcap is not None:
        expected = softcap * torch.tanh(expected / softcap)
    tol = 1e-2 if logits.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if logits.shape != expected.shape or not torch.allclose(logits.float(), expected, rtol=tol, atol=tol):
        raise ValueError(
            f"{type(model).__name__}: its forward transforms the head's logits in a way the fused loss does not "
            f"reproduce (it applies softcap={softcap} and scale={scale} from the config's {_SOFTCAP}, "
            f"{', '.join(a for a, _ in _SCALES)}); unpatch it, or report the model")


def _positional_tuple(output) -> tuple:
    """The output as the original's tuple with labels: the fields that are not None in their
    order, the logits slot kept (None), as ``ModelOutput.to_tuple`` lays out the original's."""
    return tuple(getattr(output, f.name) for f in dataclasses.fields(output)
                 if f.name == "logits" or getattr(output, f.name) is not None)


def _fused_loss_forward(self, original, bound: inspect.BoundArguments, var_keyword: str | None,
                        log_probs: dict | None = None):
    """The original forward with ``labels=None`` and the head hooked (`_capture_hook`), then
    the fused loss (with the router loss of a mixture of experts): the original's output
    with the loss and ``logits=None``. With ``log_probs`` (the options of
    `_causal_lm_log_probs`: temperature, return_entropy), the per-token ``log_probs`` and
    ``entropy`` instead of the loss, which is None (the router loss stays in ``aux_loss``)."""
    arguments = bound.arguments
    # every argument by name (the loss reads num_items_in_batch, ignore_index, shift_labels)
    named = {**{k: v for k, v in list(arguments.items())[1:] if k != var_keyword}, **arguments.get(var_keyword, {})}
    labels, logits_to_keep = named.pop("labels"), named.get("logits_to_keep", 0)
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError("logits_to_keep must be 0 when the loss is fused: no logits are built")
    _check_labels(labels=labels, shift_labels=named.get("shift_labels"))
    module = _check_model(self)
    head = _linear_head(self, module)
    _install_hooks(module, type(self))
    return_dict = named.get("return_dict")
    arguments["labels"] = None
    if "return_dict" in bound.signature.parameters:  # the original's output as a ModelOutput, read by name
        arguments["return_dict"] = True
    elif var_keyword:
        arguments[var_keyword] = {**arguments.get(var_keyword, {}), "return_dict": True}
    capture = _Capture(module, check=not torch.compiler.is_compiling() and not getattr(self, _VERIFIED, False))
    _CAPTURES.append(capture)
    try:
        output = original(*bound.args, **bound.kwargs)
    finally:
        _CAPTURES.remove(capture)
    if capture.hidden is None:
        raise RuntimeError(f"{type(self).__name__}: its forward did not call the module get_output_embeddings() returns, "
                           "so the fused loss has no hidden states")
    scale, softcap = _logit_transforms(self.config)
    if capture.check:
        _check_transforms(self, capture, output.logits, scale, softcap)
        setattr(self, _VERIFIED, True)
    fields = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
    if log_probs is not None:
        token_log_probs, entropy = _causal_lm_log_probs(capture.hidden, head, labels, scale=scale, softcap=softcap,
                                                        **log_probs, **named)
        output = type(output)(**{**fields, "loss": None, "logits": None})
        output["log_probs"] = token_log_probs
        if entropy is not None:
            output["entropy"] = entropy
        return output
    loss = _causal_lm_loss(capture.hidden, head, labels, scale=scale, softcap=softcap, **named)
    aux_loss = getattr(output, "aux_loss", None)
    if aux_loss is not None:
        if not hasattr(self, "router_aux_loss_coef"):
            raise ValueError(f"{type(self).__name__} returns aux_loss without router_aux_loss_coef: the fused loss "
                             "does not know how the original adds it")
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    # a new output of the original's class: a ModelOutput's keys are fixed when it is made
    output = type(output)(**{**fields, "loss": loss, "logits": None})
    return output if (self.config.return_dict if return_dict is None else return_dict) else _positional_tuple(output)


def _patched(original, skip_logits_in_eval: bool):
    """A forward that runs `_fused_loss_forward` in train mode with labels (in eval mode too
    with ``skip_logits_in_eval``), else ``original`` (a function of (self, ...)) as given."""
    signature = inspect.signature(original)
    var_keyword = next((name for name, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if kwargs.pop("return_log_probs", False):
            log_probs = {k: kwargs.pop(k) for k in _LOG_PROB_OPTIONS if k in kwargs}
            bound = signature.bind(self, *args, **kwargs)
            if bound.arguments.get("labels") is None:
                raise ValueError("return_log_probs=True needs labels: the tokens whose log-probabilities are asked "
                                 "(-100 where none is: the prompt, the padding)")
            return _fused_loss_forward(self, original, bound, var_keyword, log_probs)
        unknown = [k for k in _LOG_PROB_OPTIONS if k in kwargs]
        if unknown:
            raise ValueError(f"{', '.join(unknown)} apply with return_log_probs=True only")
        bound = signature.bind(self, *args, **kwargs)
        if (self.training or skip_logits_in_eval) and bound.arguments.get("labels") is not None:
            return _fused_loss_forward(self, original, bound, var_keyword)
        return original(self, *args, **kwargs)

    setattr(forward, _ORIGINAL, original)
    return forward


def _own_forward(obj):
    """The ``forward`` that ``obj`` (a class or a module) holds itself, else None; a bound
    method comes back as its function."""
    forward = vars(obj).get("forward")
    return forward.__func__ if isinstance(forward, types.MethodType) else forward


def patch_causal_lm(model_or_class, *, skip_logits_in_eval: bool = False):
    """Make a causal LM, or every instance of a causal-LM class, compute its training loss
    without the logits (see the module's docstring).

    Args:
        model_or_class: a transformers causal LM (an instance) or its class.
        skip_logits_in_eval: also fuse the loss of calls with labels in eval mode (their
            logits are then None); by default eval calls run the original forward.

    Returns:
        ``model_or_class``, patched in place; patching it again changes nothing.

    Raises:
        ValueError: for what is not a causal LM the fused loss can serve, naming it and why
            (no head, no labels, another loss), or for an instance that holds a ``forward``
            of its own (e.g. an accelerate hook).
    """
    is_class = isinstance(model_or_class, type)
    cls = model_or_class if is_class else type(model_or_class)
    _check_class(cls)
    if not is_class:
        _install_hooks(_check_model(model_or_class), cls)
    if hasattr(cls.forward, _ORIGINAL) or hasattr(_own_forward(model_or_class), _ORIGINAL):
        return model_or_class
    if is_class:
        cls.forward = _patched(cls.forward, skip_logits_in_eval)
    elif _own_forward(model_or_class) is not None:
        raise ValueError(f"this {cls.__name__} has a forward of its own (an accelerate hook?): patch it before that is set")
    else:
        model_or_class.forward = types.MethodType(_patched(cls.forward, skip_logits_in_eval), model_or_class)
    return model_or_class


def unpatch_causal_lm(model_or_class):
    """Undo `patch_causal_lm` on the same object: ``forward`` is again exactly the original,
    and an instance's head loses its hooks.

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
    if isinstance(model_or_class, type):
        if model_or_class.forward is not getattr(patched, _ORIGINAL):
            model_or_class.forward = getattr(patched, _ORIGINAL)
        for head, model_class in list(_HOOKED.items()):  # the heads its instances' calls hooked
            if issubclass(model_class, model_or_class):
                _remove_hooks(head)
    else:
        _remove_hooks(model_or_class.get_output_embeddings())
        model_or_class.__dict__.pop(_VERIFIED, None)
    return model_or_class
