"""OpenRLHF's actor on the log-prob mode: `patch_openrlhf` against OpenRLHF's own
``Actor.forward`` (its logits path) on a tiny Llama, padded and packed, with its temperature,
entropy and gradients.

OpenRLHF's package imports Ray, vLLM and flash-attn; only ``openrlhf/models/actor.py`` is
loaded here, with its package's ``__init__`` skipped and flash-attn's padding helpers given
in plain torch (what flash-attn's ``bert_padding`` computes), so OpenRLHF's forward runs as
written on a CPU.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
pytest.importorskip("peft")
if importlib.util.find_spec("openrlhf") is None:
    pytest.skip("OpenRLHF is not installed (pip install --no-deps openrlhf)", allow_module_level=True)

from torch_impl import openrlhf as adapter  # noqa: E402


def _unpad_input(hidden, mask):
    indices = mask.flatten().nonzero().flatten()
    lengths = mask.sum(-1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return hidden.reshape(-1, *hidden.shape[2:])[indices], indices, cu_seqlens, int(lengths.max()), lengths


def _pad_input(hidden, indices, batch, seqlen):
    out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])


def _rearrange(x, pattern):
    assert pattern == "b s ... -> (b s) ..."
    return x.reshape(-1, *x.shape[2:])


@pytest.fixture(scope="module")
def actor_module():
    """openrlhf.models.actor, imported alone (see the module's docstring); OpenRLHF's entries in
    sys.modules (and flash-attn's, where they are stubs) restored after."""
    saved = dict(sys.modules)
    root = os.path.dirname(importlib.util.find_spec("openrlhf").origin)
    for name, path in (("openrlhf", root), ("openrlhf.models", os.path.join(root, "models"))):
        package = types.ModuleType(name)
        package.__path__ = [path]
        package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = package
    helpers = {"flash_attn.bert_padding": {"unpad_input": _unpad_input, "pad_input": _pad_input,
                                           "index_first_axis": lambda x, i: x[i], "rearrange": _rearrange},
               "flash_attn.utils.distributed": {"all_gather": None}, "flash_attn": {}, "flash_attn.utils": {}}
    stubs = importlib.util.find_spec("flash_attn") is None
    if stubs:
        for name, attributes in helpers.items():
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__dict__.update(attributes)
            sys.modules[name] = module
    module = importlib.import_module(adapter.ACTOR_MODULE)
    original = module.Actor.forward
    yield module
    module.Actor.forward = original
    ours = ("openrlhf", "flash_attn") if stubs else ("openrlhf",)  # a real flash-attn stays imported
    for name in [n for n in sys.modules if n.split(".")[0] in ours]:
        del sys.modules[name]
    sys.modules.update({n: m for n, m in saved.items() if n.split(".")[0] in ours})


def _actor(module, packing, temperature, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).double()
    model.config.use_cache = False
    actor = module.Actor(model, temperature=temperature)
    actor.packing_samples = packing
    return actor


def _batch(batch=3, prompt=6, actions=5, vocab=96, seed=1):
    """OpenRLHF's layout: prompts padded on the left, responses on the right."""
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(1, vocab, (batch, prompt + actions), generator=g)
    attention_mask = torch.ones_like(sequences)
    attention_mask[0, :2] = 0  # a short prompt
    attention_mask[1, -2:] = 0  # a short response
    sequences = sequences.masked_fill(attention_mask == 0, 0)
    action_mask = attention_mask[:, prompt:].bool()
    return sequences, attention_mask, action_mask


def _run(actor, sequences, attention_mask, action_mask, **kwargs):
    actor.zero_grad()
    log_probs, output = actor(sequences, action_mask=action_mask, attention_mask=attention_mask, return_output=True,
                              return_entropy=True, **kwargs)
    actions = action_mask.shape[1]
    entropy = output.entropy[:, -actions:] * action_mask
    (log_probs.sum() + 0.3 * entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in actor.named_parameters()}
    return log_probs.detach(), entropy.detach(), output, grads


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_patched_actor_gives_openrlhfs_log_probs_entropy_and_gradients(actor_module, packing):
    sequences, attention_mask, action_mask = _batch()
    actor = _actor(actor_module, packing, temperature=0.7)
    want = _run(actor, sequences, attention_mask, action_mask)
    original = actor_module.Actor.forward
    adapter.patch_openrlhf()
    patched = actor_module.Actor.forward
    adapter.patch_openrlhf()  # a second call changes nothing
    assert actor_module.Actor.forward is patched and getattr(patched, adapter._ORIGINAL) is original
    try:
        got = _run(actor, sequences, attention_mask, action_mask)
    finally:
        actor_module.Actor.forward = getattr(actor_module.Actor.forward, adapter._ORIGINAL)
    # OpenRLHF casts the fp64 model's logits to fp32: both sides round to fp32 once
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=2e-6)
    assert got[2].logits is None and want[2].logits is not None
    for name, grad in want[3].items():
        torch.testing.assert_close(got[3][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_log_probs_of_every_position_as_openrlhfs(actor_module, packing):
    """return_logprobs=True without an action mask (OpenRLHF's SFT and DPO trainers): every
    position's log-probability, as OpenRLHF's own forward gives it."""
    sequences, attention_mask, _ = _batch()
    actor = _actor(actor_module, packing, temperature=1.0)
    with torch.no_grad():
        want = actor(sequences, attention_mask=attention_mask, return_logprobs=True)
        adapter.patch_openrlhf()
        try:
            got = actor(sequences, attention_mask=attention_mask, return_logprobs=True)
        finally:
            actor_module.Actor.forward = getattr(actor_module.Actor.forward, adapter._ORIGINAL)
    assert got.shape == want.shape == (sequences.shape[0], sequences.shape[1] - 1)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_only_the_actions_reach_the_head(actor_module, monkeypatch):
    """Padded: the head sees the action positions whose mask is 1, nothing of the prompts."""
    import torch_impl.transformers as patching

    sequences, attention_mask, action_mask = _batch()
    actor = _actor(actor_module, False, temperature=1.0)
    rows, original = [], patching.linear_log_probs
    monkeypatch.setattr(patching, "linear_log_probs", lambda x, *a, **k: (rows.append(x.shape[0]), original(x, *a, **k))[1])
    adapter.patch_openrlhf()
    try:
        log_probs = actor(sequences, action_mask=action_mask, attention_mask=attention_mask)
    finally:
        actor_module.Actor.forward = getattr(actor_module.Actor.forward, adapter._ORIGINAL)
    assert rows == [int(action_mask.sum())]
    assert log_probs.shape == action_mask.shape and (log_probs[~action_mask] == 0).all()


def test_a_call_for_the_logits_runs_openrlhfs_forward(actor_module):
    sequences, attention_mask, _ = _batch()
    actor = _actor(actor_module, False, temperature=1.0)
    adapter.patch_openrlhf()
    try:
        output = actor(sequences, attention_mask=attention_mask, return_output=True)
        with pytest.raises(ValueError, match="return_entropy=True needs return_output=True"):
            actor(sequences, attention_mask=attention_mask, return_logprobs=True, return_entropy=True)
    finally:
        actor_module.Actor.forward = getattr(actor_module.Actor.forward, adapter._ORIGINAL)
    assert output.logits.shape == (*sequences.shape, 96) and output.logits.dtype == torch.float32


def test_an_actor_forward_of_other_parameters_is_refused(actor_module, monkeypatch):
    def forward(self, sequences, num_actions, attention_mask=None):
        pass

    monkeypatch.setattr(actor_module.Actor, "forward", forward)
    with pytest.raises(RuntimeError, match=r"OpenRLHF \S+: Actor.forward takes \('self', 'sequences', 'num_actions'"):
        adapter.patch_openrlhf()
