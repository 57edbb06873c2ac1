"""OpenRLHF's actor on the library: `patch_openrlhf` makes ``openrlhf.models.Actor.forward``
take its per-token log-probabilities and entropy from the patched Hugging Face model's
log-prob mode (`torch_impl.transformers`) instead of from fp32 [B, T, V] logits.

OpenRLHF's forward (0.11) runs the model for the logits, casts them to fp32, divides them by
the actor's ``temperature``, takes log p(next token) and, with ``return_entropy``, the
entropy of every position, and keeps the last ``action_mask.shape[1]`` positions times the
action mask. Patched, the same call returns the same tensors (fp32) without the logits (from
a 16-bit model, closer to the exact ones: OpenRLHF rounds its logits to the model's dtype
before their fp32 cast):

- padded batches: with an ``action_mask`` only the positions whose next token is an action
  (mask 1) reach the head; with ``return_logprobs`` alone, every position. The
  log-probabilities and the entropy are 0 at the positions left out, which OpenRLHF's
  trainers mask (the policy loss multiplies by the action mask, the entropy term reads the
  actions only);
- packed samples (``packing_samples``, ring attention included): every position of the
  rank's slice, unpadded and gathered by OpenRLHF's own functions, as its forward does;
- ``output`` (``return_output=True``) is the model's, with ``logits=None``, the router loss
  kept in ``aux_loss`` and ``entropy`` set as OpenRLHF sets it.

A call that asks for the logits themselves (neither ``action_mask`` nor ``return_logprobs``)
and a vision-language actor run OpenRLHF's forward unchanged. The actor's model (the model
inside a peft wrapper) is patched with `patch_causal_lm` at its first call, so its head must
be one that function serves (a plain ``nn.Linear``: merge a LoRA adapter on ``lm_head``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect

import torch

from torch_impl.transformers import patch_causal_lm

ACTOR_MODULE = "openrlhf.models.actor"
IGNORE_INDEX = -100
# Actor.forward's parameters in OpenRLHF 0.11, the version this adapter follows
PARAMETERS = ("self", "sequences", "action_mask", "attention_mask", "return_output", "allgather_logits",
              "return_logprobs", "ring_attn_group", "packed_seq_lens", "return_entropy", "mm_inputs")
_ORIGINAL = "_logitless_original"


def _targets(rolled: torch.Tensor, action_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, T] next tokens (``rolled``: the sequences rolled left by one) at the positions the
    caller keeps, IGNORE_INDEX elsewhere: the last ``action_mask.shape[1]`` positions before
    the last where the mask is 1, or, without a mask, every position but the last."""
    targets = torch.full_like(rolled, IGNORE_INDEX)
    if action_mask is None:
        targets[:, :-1] = rolled[:, :-1]
    else:
        start = rolled.shape[1] - 1 - action_mask.shape[1]
        targets[:, start:-1] = rolled[:, start:-1].masked_fill(~action_mask.bool(), IGNORE_INDEX)
    return targets


def _language_model(actor) -> torch.nn.Module:
    """The actor's Hugging Face causal LM, patched for its log-prob mode (through peft's
    wrapper, which passes the keywords on, to the model it wraps)."""
    model = actor.model
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    patch_causal_lm(inner)
    return model


def _forward(original, actor_module):
    @functools.wraps(original)
    def forward(self, sequences, action_mask=None, attention_mask=None, return_output=False, allgather_logits=False,
                return_logprobs=False, ring_attn_group=None, packed_seq_lens=None, return_entropy=False, **mm_inputs):
        if (action_mask is None and not return_logprobs) or getattr(self, "is_vlm", False):
            return original(self, sequences, action_mask, attention_mask, return_output, allgather_logits,
                            return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs)
        if return_entropy and not return_output:
            raise ValueError("return_entropy=True needs return_output=True: the entropy is an attribute of the output "
                             "(as in OpenRLHF's forward)")
        batch, seqlen = sequences.shape
        if self.packing_samples:
            sequences, position_ids, targets, pad_len, indices = actor_module.unpad_and_slice_tensor(
                sequences, attention_mask, ring_attn_group)
            attention_mask = None
        else:
            targets = _targets(torch.roll(sequences, shifts=-1, dims=1), action_mask)
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
        output = _language_model(self)(
            sequences, attention_mask=attention_mask, position_ids=position_ids, labels=targets, shift_labels=targets,
            return_log_probs=True, temperature=self.temperature, return_entropy=return_entropy, **mm_inputs)
        # fp32, as OpenRLHF's logits are cast (the log-prob mode gives fp64 for an fp64 model)
        log_probs, entropy = output["log_probs"].float(), output.get("entropy")
        entropy = None if entropy is None else entropy.float()
        if self.packing_samples:
            gather = functools.partial(actor_module.gather_and_pad_tensor, ring_attn_group=ring_attn_group,
                                       ring_attn_pad_len=pad_len, indices=indices, batch=batch, seqlen=seqlen)
            log_probs = gather(log_probs)
            entropy = None if entropy is None else gather(entropy)
        if entropy is not None:
            output["entropy"] = entropy[:, :-1]
        log_probs = log_probs[:, :-1]
        if action_mask is not None:
            log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
        return (log_probs, output) if return_output else log_probs

    setattr(forward, _ORIGINAL, original)
    return forward


def _version() -> str:
    try:
        return importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def patch_openrlhf() -> None:
    """Make every OpenRLHF ``Actor`` (policy and reference) compute its log-probabilities and
    entropy without the logits (see the module's docstring). Call it in each process that
    runs an actor (Ray workers too) before the actor runs; a second call changes nothing.

    Raises:
        ImportError: OpenRLHF is not installed (naming the module that did not import).
        RuntimeError: ``Actor.forward`` has other parameters than the versions this adapter
            follows (naming OpenRLHF's version and the parameters).
    """
    try:
        module = importlib.import_module(ACTOR_MODULE)
    except ImportError as error:
        raise ImportError(f"patch_openrlhf needs OpenRLHF ({ACTOR_MODULE} did not import: {error})") from error
    actor = module.Actor
    if hasattr(actor.forward, _ORIGINAL):
        return
    parameters = tuple(inspect.signature(actor.forward).parameters)
    if parameters != PARAMETERS:
        raise RuntimeError(f"OpenRLHF {_version()}: Actor.forward takes {parameters}, not {PARAMETERS}; this "
                           "adapter follows OpenRLHF 0.11")
    actor.forward = _forward(actor.forward, module)
