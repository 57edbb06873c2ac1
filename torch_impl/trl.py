"""TRL's fused LM head on the library: `fused_head_outputs`, with the signature and outputs of
the per-token function TRL's `add_fused_lm_head` calls (TRL >= 1.15: every trainer's
`model(..., fused_lm_head=True)`), and `patch_trl`, which makes TRL call it.

TRL wraps each trainer's model (SFT, DPO, KTO, GRPO, RLOO, ...) in `add_fused_lm_head`,
whose forward hands the labelled positions' hidden states to
`trl.trainer.utils._ChunkedLogProbFunction.apply`. TRL offers no public way to give that
forward another kernel, so `patch_trl` replaces that one name, after checking that it is
there and takes the arguments this module was written for: when TRL's internals move, it
raises naming the TRL version, rather than computing something else.

The outputs: log p(label) and the entropy from `linear_log_probs` (differentiable; never the
N x V logits, grad_weight accumulated in fp32); is_top1 from its argmax; mean_logits from
`log_probs_rule.mean_logits` (without a softcap, one [N, D] x [D] product); log(sum_v p_v^2)
from log-probabilities at half the temperature, 2 log p_T(y) - log p_{T/2}(y), one more
forward pass, only when asked (DPO's WPO weights).
"""

from __future__ import annotations

import importlib
import inspect

import torch

from interop.log_probs import LogProbsOptions
from interop.options import check_tuning
from torch_impl.arguments import autocast_inputs
from torch_impl.log_probs import linear_log_probs
from torch_impl.log_probs_rule import mean_logits
from torch_impl.steps import plan_steps

TRL_MODULE = "trl.trainer.utils"
TRL_HOOK = "_ChunkedLogProbFunction"  # the name add_fused_lm_head's forward calls at each call
# The per-token outputs, in the order TRL's function returns them
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# The arguments of TRL's function's forward after ctx: what fused_head_outputs takes
PARAMETERS = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
              "logit_scale", "outputs")


def fused_head_outputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                       temperature: float = 1.0, chunk_size: int | None = None,
                       final_logit_softcapping: float | None = None, logit_scale: float = 1.0,
                       outputs: tuple[str, ...] = ("log_probs",)):
    """Per-token outputs of u = softcap(logit_scale * (hidden @ weight^T + bias)) / temperature,
    as TRL's fused head returns them.

    Args:
        hidden: [N, D] hidden states. weight: [V, D]; bias: [V] or None. Under autocast all
            three run in its dtype, else in hidden's (TRL's `cast_lm_head_to_fp32` passes fp32
            hidden states with a 16-bit head: the head runs in fp32).
        targets: [N] int64 class ids in [0, V).
        temperature: T > 0. final_logit_softcapping: c > 0 for c * tanh(z / c), or None.
        logit_scale: s, the logits' multiplier before the softcap (Cohere's, Granite's
            1 / logits_scaling). s > 0 is exact as a change of units: softcap_c(s z) / T =
            softcap_{c/s}(z) / (T / s); another s scales the hidden states and the bias.
        chunk_size: TRL's vocabulary tile, unused (the library plans its own blocks).
        outputs: which of OUTPUTS to return; log_probs always is.

    Returns:
        (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1), [N] each, None where
        not asked: log p(target) and the entropy (fp32, fp64 for fp64; differentiable),
        log(sum_v p_v^2) and the mean of u over the classes (the same dtype, no gradient),
        whether the target is the first most likely class (bool).
    """
    del chunk_size
    unknown = [name for name in outputs if name not in OUTPUTS]
    if unknown:
        raise ValueError(f"outputs must be among {OUTPUTS}, got {tuple(outputs)!r}")
    device = hidden.device
    x, W, b = autocast_inputs(hidden, weight, bias)
    W, b = (None if t is None else t.to(x.dtype) for t in (W, b))  # TRL's cast_lm_head_to_fp32: fp32 hidden
    T, cap = temperature, final_logit_softcapping
    if logit_scale > 0:  # a change of units, exact
        T, cap = T / logit_scale, None if cap is None else cap / logit_scale
    else:  # 0 (a uniform distribution, as TRL keeps it) or negative: the logits scaled
        x, b = x * logit_scale, None if b is None else b * logit_scale
    head = dict(linear_bias=b, softcap=cap, ignore_index=None)
    with torch.autocast(device.type, enabled=False):
        log_probs, entropy, argmax = linear_log_probs(x, W, targets, temperature=T, return_entropy=True,
                                                      return_argmax=True, **head)
        log_sum_sq = mean = None
        if "log_sum_sq_probs" in outputs:
            with torch.no_grad():
                log_sum_sq = 2 * log_probs.detach() - linear_log_probs(x, W, targets, temperature=T / 2, **head)
        if "mean_logits" in outputs:
            n, d = x.shape
            plan, _ = plan_steps(check_tuning(None), "log_probs", "chunked", n, d, W.shape[0], x.dtype, False)
            mean = mean_logits(x, W, b, LogProbsOptions(T, cap, None), "VD", plan)
    return (log_probs, entropy if "entropy" in outputs else None, log_sum_sq, mean,
            argmax == targets if "is_top1" in outputs else None)


class _FusedHead:
    """What TRL's forward calls in place of its function: `apply` with its arguments."""

    @staticmethod
    def apply(*args, **kwargs):
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        tensors = args[:3] + tuple(kwargs.get(k) for k in PARAMETERS[len(args):3])
        differentiated = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
        if differentiated and is_deepspeed_zero3_enabled():
            # TRL gathers a ZeRO-3 head around the forward call only; the library's backward
            # pass reads the head again, outside that gather, where it holds no elements.
            raise RuntimeError("patch_trl does not support DeepSpeed ZeRO-3 (the backward pass reads the head "
                               "outside TRL's gather of it): use ZeRO-2 or FSDP2, or leave TRL's own fused head")
        return fused_head_outputs(*args, **kwargs)


def _trl_version() -> str:
    try:
        return importlib.import_module("trl").__version__
    except (ImportError, AttributeError):
        return "unknown"


def patch_trl() -> None:
    """Make TRL's fused LM head (`add_fused_lm_head`, which every TRL >= 1.15 trainer puts on
    its model and its reference model) run on `fused_head_outputs`. Call it once per process,
    before the trainer's first step (before or after the trainer is built); a second call
    changes nothing. Raises ImportError naming TRL when it is not installed, RuntimeError
    naming the TRL version when its fused head is not the one this was written for."""
    try:
        module = importlib.import_module(TRL_MODULE)
    except ImportError as error:
        raise ImportError(f"patch_trl needs TRL >= 1.15 ({TRL_MODULE} did not import: {error})") from error
    current = getattr(module, TRL_HOOK, None)
    if current is _FusedHead:
        return
    unsupported = f"TRL {_trl_version()} is not supported by patch_trl (written for TRL 1.15 to 1.16)"
    if current is None or not hasattr(module, "add_fused_lm_head"):
        raise RuntimeError(f"{unsupported}: {TRL_MODULE} has no {TRL_HOOK} and add_fused_lm_head")
    try:
        parameters = tuple(inspect.signature(current.forward).parameters)[1:]
    except (AttributeError, TypeError, ValueError):
        parameters = None
    if parameters != PARAMETERS:
        raise RuntimeError(f"{unsupported}: {TRL_MODULE}.{TRL_HOOK}.forward takes {parameters}, not {PARAMETERS}")
    setattr(module, TRL_HOOK, _FusedHead)
