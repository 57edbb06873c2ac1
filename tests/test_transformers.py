"""torch_impl.transformers: a patched Hugging Face causal LM trains exactly like the original
(loss and every gradient) without building the logits; otherwise it is the original. Tiny
random configs of 20 families (no downloads): dense and mixture-of-experts, tied and untied
heads, a head bias, softcapping and logit scaling."""

import copy
import gc
import inspect
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import torch_impl.transformers as patching  # noqa: E402
from torch_impl.transformers import patch_causal_lm, unpatch_causal_lm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 101
SOFTCAP = 1.0
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# mixtures of experts that return their router loss (added to the training loss)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=True,
           router_aux_loss_coef=0.02)
CONFIGS = {  # model class -> (config class, options beyond COMMON)
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {}),
    "GemmaForCausalLM": ("GemmaConfig", {}),  # tied
    "Gemma2ForCausalLM": ("Gemma2Config", {"final_logit_softcapping": SOFTCAP}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {"final_logit_softcapping": SOFTCAP}),
    "Phi3ForCausalLM": ("Phi3Config", {}),
    "PhiForCausalLM": ("PhiConfig", {}),  # a head bias
    "GraniteForCausalLM": ("GraniteConfig", {"logits_scaling": 4.0}),  # logits divided
    "CohereForCausalLM": ("CohereConfig", {"logit_scale": 0.5}),  # logits multiplied, tied
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "GPTNeoXForCausalLM": ("GPTNeoXConfig", {}),
    "StableLmForCausalLM": ("StableLmConfig", {}),
    "Starcoder2ForCausalLM": ("Starcoder2Config", {}),
    "GPT2LMHeadModel": ("GPT2Config", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", MOE),
    "MixtralForCausalLM": ("MixtralConfig", MOE),
    "OlmoeForCausalLM": ("OlmoeConfig", MOE),
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", {**MOE, "logits_scaling": 4.0}),
}
FAMILIES = [name for name in CONFIGS if hasattr(transformers, name)]  # those the installed transformers has
MOE_FAMILIES = [name for name in FAMILIES if "output_router_logits" in CONFIGS[name][1]]
TRANSFORMED = [name for name in FAMILIES if {"final_logit_softcapping", "logits_scaling", "logit_scale"} & set(CONFIGS[name][1])]


def make_model(name: str = "LlamaForCausalLM") -> nn.Module:
    """A tiny randomly initialised fp32 model of class ``name`` (seed 0), in train mode."""
    config_class, options = CONFIGS[name]
    torch.manual_seed(0)
    model = getattr(transformers, name)(getattr(transformers, config_class)(**COMMON, **options))
    return model.train()


def make_batch() -> dict:
    """input_ids [2, 9] (int64) and labels [2, 9] with four of them -100."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (2, 9), generator=gen)
    labels = input_ids.clone()
    labels[0, :3] = -100
    labels[1, 5] = -100
    return {"input_ids": input_ids, "labels": labels}


def word_tokenizer():
    """A tokenizer of the tiny models' VOCAB words "t0" .. "t100" (pad t0, bos t1, eos t2),
    split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0", eos_token="t2",
                                                bos_token="t1")


def train_step(model: nn.Module, **inputs):
    """(output, {parameter name: gradient}) of one forward + backward of ``output.loss``."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def assert_same_training_step(reference: nn.Module, patched: nn.Module, **inputs) -> None:
    """The patched model's loss and every gradient equal the reference's (fp32 tolerance); it has no logits."""
    assert_same_step(train_step(reference, **inputs), train_step(patched, **inputs))


def assert_same_step(reference_step: tuple, patched_step: tuple) -> None:
    """`train_step` results: the same loss and gradients (fp32 tolerance), logits only in the reference's."""
    (ref_out, ref_grads), (out, grads) = reference_step, patched_step
    assert out.logits is None and ref_out.logits is not None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        if ref is None:  # a frozen parameter, or one the step does not reach
            assert grads[name] is None, name
            continue
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=name)


def test_fifteen_families_or_more_are_tested():
    assert len(FAMILIES) >= 15 and {"LlamaForCausalLM", "Qwen3MoeForCausalLM", "GraniteForCausalLM"} <= set(FAMILIES)


@pytest.mark.parametrize("num_items_in_batch", [None, torch.tensor(23)])
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_gradients_match_the_original(name, num_items_in_batch):
    reference = make_model(name)
    patched = patch_causal_lm(copy.deepcopy(reference))
    assert_same_training_step(reference, patched, **make_batch(), num_items_in_batch=num_items_in_batch)


def _fsdp2_worker(rank: int, world: int, port: int) -> None:
    """One gloo rank of `test_fsdp2_training_step_matches_the_original`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.distributed import leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        # each rank its own row of the batch; the global count of valid targets
        batch = {k: v[rank:rank + 1] for k, v in make_batch().items()}
        count = torch.tensor(int((make_batch()["labels"][:, 1:] != -100).sum()))
        # an untied head in the root's group or sharded on its own; a tied head with a softcap
        for name, head_apart in (("LlamaForCausalLM", False), ("LlamaForCausalLM", True), ("Gemma2ForCausalLM", False)):
            steps = []
            for patch in (False, True):
                model = make_model(name)
                if patch:
                    patch_causal_lm(model)
                for layer in model.model.layers:  # as transformers' FSDP plan wraps a model
                    fully_shard(layer, mesh=mesh)
                if head_apart:
                    fully_shard(model.lm_head, mesh=mesh)  # a DTensor head its forward never gathers
                fully_shard(model, mesh=mesh)
                out, grads = train_step(model, **batch, num_items_in_batch=count)
                steps.append((out, {k: None if g is None else g.full_tensor() for k, g in grads.items()}))
            assert_same_step(*steps)
        # Freed while the process group lives (bench.fsdp_model says why).
        model = steps = out = grads = None
        gc.collect()
    finally:
        dist.destroy_process_group()
    leave()


def _zero3_worker(rank: int, world: int, port: int) -> None:
    """One gloo rank of `test_deepspeed_zero3_training_matches_the_original`."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from bench.distributed import leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
              # every parameter partitioned, however small (the default keeps small ones whole)
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    try:
        batch = {k: v[rank:rank + 1] for k, v in make_batch().items()}
        for name in ("LlamaForCausalLM", "Gemma2ForCausalLM"):
            runs = []
            for patch in (False, True):
                model = make_model(name)
                if patch:
                    patch_causal_lm(model)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
                engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
                head = model.get_output_embeddings().weight
                assert head.numel() == 0 and tuple(head.ds_shape) == (VOCAB, model.config.hidden_size)  # partitioned
                steps = []
                for _ in range(2):  # the second after an update of the partitioned weights
                    out = engine(**batch)
                    engine.backward(out.loss)
                    grads = {k: safe_get_full_grad(p) for k, p in model.named_parameters()}
                    steps.append((out, {k: None if g is None else g.clone() for k, g in grads.items()}))
                    engine.step()
                runs.append(steps)
                engine.destroy()
            for reference, patched in zip(*runs):
                assert_same_step(reference, patched)
        model = engine = optimizer = runs = steps = out = grads = None
        gc.collect()
    finally:
        dist.destroy_process_group()
    leave()


def _tensor_parallel_worker(rank: int, world: int, port: int) -> None:
    """One gloo rank of `test_a_tensor_parallel_head_is_split_not_gathered`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import torch_impl.vocab_parallel as vocab_parallel
    from bench.distributed import leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        split, gathered = vocab_parallel.vocab_slice, vocab_parallel._gathered
        calls = []
        vocab_parallel.vocab_slice = lambda *args: calls.append("split") or split(*args)
        vocab_parallel._gathered = lambda t: calls.append("gathered") or gathered(t)
        # patched after and before the split (the head's hooks then meet a DTensor input, or a
        # plain one); Phi has a head bias, split with the head
        for name, patch_first in (("LlamaForCausalLM", False), ("PhiForCausalLM", True)):
            steps, models = [], []
            for patch in (False, True):
                model = make_model(name)
                if patch and patch_first:
                    patch_causal_lm(model)
                # the head split over the vocabulary, its logits gathered (transformers' "colwise_gather_output")
                parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
                if patch and not patch_first:
                    patch_causal_lm(model)
                out, grads = train_step(model, **make_batch())
                steps.append((out, {k: None if g is None else getattr(g, "full_tensor", lambda: g)() for k, g in grads.items()}))
                models.append(model)
            assert_same_step(*steps)
            # the log-probability mode on the split head: the unpatched split model's logits' values
            got = models[1](**make_batch(), return_log_probs=True, temperature=0.7, return_entropy=True)
            for value, want in zip((got.log_probs, got.entropy), _reference_log_probs(models[0], 0.7, **make_batch())):
                torch.testing.assert_close(value, want.detach(), rtol=1e-5, atol=1e-5)
        assert calls == ["split", "split", "split", "split"], calls
        model = models = steps = out = grads = got = None
    finally:
        dist.destroy_process_group()
    leave()


def test_a_tensor_parallel_head_is_split_not_gathered():
    """A head that tensor parallelism splits over its vocabulary (ColwiseParallel) on 2 gloo
    ranks: the fused loss splits the classes the same way (never gathering the head), and
    the loss and every gradient equal the unpatched tensor-parallel model's."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_tensor_parallel_worker, args=(2, port), nprocs=2, join=True)


@pytest.mark.parametrize("head", ["fsdp", "tp", "2d"])
def test_fsdp2_model_benchmark_runs_on_gloo_ranks(tmp_path, head):
    """`torchrun -m bench.fsdp_model` (the multi-GPU model benchmark's command) on CPU ranks
    with a tiny Llama, under FSDP2 (2 ranks), with its head split by tensor parallelism (2),
    or both (4 ranks: a (2, 2) mesh, each data shard its own rows): both methods run and
    give the same loss."""
    import json

    out = tmp_path / "fsdp.json"
    ranks = "4" if head == "2d" else "2"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks,
                           "-m", "bench.fsdp_model", "--tiny", "--seq", "16", "--repeat", "1", "--head", head,
                           "--json", str(out)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["method"], r["head"]) for r in rows] == [("transformers", head), ("ours", head)]
    assert abs(rows[0]["loss"] - rows[1]["loss"]) <= 1e-5 * abs(rows[0]["loss"])


def test_fsdp2_training_step_matches_the_original():
    """Under FSDP2 (`fully_shard` per decoder layer and on the model, the head in the root's
    group or sharded on its own, so the fused loss meets it as a DTensor), on 2 gloo ranks
    with different rows: the patched model's loss and every gradient equal the original's
    under the same sharding (untied Llama, tied Gemma 2 with its softcap)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_fsdp2_worker, args=(2, port), nprocs=2, join=True)


def test_deepspeed_zero3_training_matches_the_original():
    """Under DeepSpeed ZeRO-3 (every parameter partitioned, 2 gloo ranks with different rows):
    the fused loss reads the head inside the engine's forward, where DeepSpeed gathers a
    parameter read outside its module's forward and re-gathers it for the backward pass.
    Two steps (the second after an SGD update): loss and every gradient as the unpatched
    model's (untied Llama, tied Gemma 2 with its softcap)."""
    pytest.importorskip("deepspeed")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_zero3_worker, args=(2, port), nprocs=2, join=True)


@pytest.mark.parametrize("name", TRANSFORMED)
def test_a_transform_of_the_logits_left_out_is_refused(name, monkeypatch):
    """The first eager fused call checks the original's logits at the kept position against
    the softcap and scale read from the config: with those attributes unknown to the patch,
    it raises instead of training a different loss."""
    monkeypatch.setattr(patching, "_SOFTCAP", "no_such_attribute")
    monkeypatch.setattr(patching, "_SCALES", ())
    patched = patch_causal_lm(make_model(name))
    with pytest.raises(ValueError, match=f"{name}: its forward transforms the head's logits"):
        patched(**make_batch())


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM", "Qwen3MoeForCausalLM"])
def test_packed_sequences_train_as_the_original(name):
    """Padding-free batches (`DataCollatorWithFlattening`: the sequences of a batch
    concatenated in one row, position_ids restarting at each, the first label of each -100):
    the same loss and gradients as the unpatched model, and not those of the row unpacked."""
    sequences = [[5, 9, 17, 3, 44, 8, 21], [7, 30, 12], [4, 11, 60, 2, 9]]
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": s} for s in sequences])
    assert batch["input_ids"].shape == (1, 15) and batch["position_ids"][0, 7] == 0
    reference, model = make_model(name), make_model(name)
    patch_causal_lm(model)
    step = train_step(model, **batch)
    assert_same_step(train_step(reference, **batch), step)
    unpacked = train_step(reference, input_ids=batch["input_ids"], labels=batch["labels"])
    assert not torch.allclose(step[0].loss, unpacked[0].loss)


def test_head_bias_shift_labels_and_ignore_index():
    reference = make_model()
    reference.lm_head = nn.Linear(32, VOCAB)
    patched = patch_causal_lm(copy.deepcopy(reference))
    batch = make_batch()
    assert_same_training_step(reference, patched, **batch)
    shifted = torch.roll(batch["labels"], 1, dims=1)
    assert_same_training_step(reference, patched, **batch, shift_labels=shifted)
    fives = batch["labels"].masked_fill(batch["labels"] == -100, 5)
    assert_same_training_step(reference, patched, input_ids=batch["input_ids"], labels=fives, ignore_index=5)


def test_return_dict_false_keeps_the_original_tuple_layout():
    """out[1] is the logits slot (None when fused) and out[2] the cache, as in the original's
    tuple (ModelOutput.to_tuple would drop the None logits and move the cache to out[1])."""
    reference = make_model()
    patched = patch_causal_lm(copy.deepcopy(reference))
    batch = make_batch()
    ref = reference(**batch, return_dict=False)
    out = patched(batch["input_ids"], None, labels=batch["labels"], return_dict=False)
    assert len(out) == len(ref) == 3 and out[1] is None and ref[1].shape == (2, 9, VOCAB)
    assert type(out[2]) is type(ref[2]) and out[2].get_seq_length() == ref[2].get_seq_length() == 9
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=0)


def test_a_cache_given_by_position_reaches_the_decoder_without_a_deprecation_warning():
    """The fourth argument binds to the installed forward's own name for it (``cache`` from
    transformers 5.24, ``past_key_values`` before) and fills the cache; no call passes the
    other name, which 5.24 deprecates with a FutureWarning."""
    patched = patch_causal_lm(make_model())
    batch = make_batch()
    cache = transformers.DynamicCache(config=patched.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = patched(batch["input_ids"], None, None, cache, labels=batch["labels"], use_cache=True)
        assert patched(**batch).logits is None
    assert out.logits is None and cache.get_seq_length() == 9


@pytest.mark.parametrize("name", FAMILIES)
def test_eval_mode_and_no_labels_run_the_original(name):
    reference = make_model(name)
    patched = patch_causal_lm(copy.deepcopy(reference))
    batch = make_batch()
    for inputs in ({"input_ids": batch["input_ids"]}, batch):  # train mode, no labels; then eval mode
        ref_out, out = reference(**inputs), patched(**inputs)
        assert torch.equal(out.logits, ref_out.logits)
        assert (out.loss is None and ref_out.loss is None) or torch.equal(out.loss, ref_out.loss)
        reference.eval(), patched.eval()
    prompt = batch["input_ids"][:, :4]
    # without the router loss, which transformers 4.57 fails to compute over a cache
    options = dict(max_new_tokens=3, do_sample=False, **({"output_router_logits": False} if name in MOE_FAMILIES else {}))
    assert torch.equal(patched.generate(prompt, **options), reference.generate(prompt, **options))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_fused_call_warns_of_nothing_the_original_does_not(name):
    """No deprecation or other warning of the fused call that the original's call with labels
    does not give (transformers 5.24 deprecates names such as past_key_values)."""
    reference = make_model(name)
    patched = patch_causal_lm(copy.deepcopy(reference))
    messages = []
    for model in (reference, patched):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**make_batch(), use_cache=True).loss.backward()
        messages.append({str(w.message) for w in caught})
    assert messages[1] <= messages[0], messages[1] - messages[0]


class ModulesToSave(nn.Module):
    """peft's ModulesToSaveWrapper as the fused loss reads it, for when peft is not installed:
    the original head, a trainable copy per adapter (here one, scaled so that it differs), and
    a forward that runs the active adapter's copy unless adapters are disabled."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.original_module = head
        self.modules_to_save = nn.ModuleDict({"default": copy.deepcopy(head)})
        with torch.no_grad():
            self.modules_to_save["default"].weight.mul_(1.5)
        self.active_adapter = "default"
        self.disable_adapters = False

    def forward(self, hidden_states):
        if self.disable_adapters:
            return self.original_module(hidden_states)
        return self.modules_to_save[self.active_adapter](hidden_states)


class Linear(nn.Module):
    """A LoRA-wrapped head as peft makes it (a class named Linear that is no nn.Linear): the
    base layer plus a low-rank term that only its forward adds."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.base_layer = head
        self.lora_A = nn.Linear(head.in_features, 2, bias=False)
        self.lora_B = nn.Linear(2, head.out_features, bias=False)

    def forward(self, hidden_states):
        return self.base_layer(hidden_states) + self.lora_B(self.lora_A(hidden_states))


def test_fused_path_refuses_logits_to_keep_and_a_wrapped_head():
    batch = make_batch()
    patched = patch_causal_lm(make_model())
    assert patched(**batch, logits_to_keep=0).logits is None
    with pytest.raises(ValueError, match="logits_to_keep"):
        patched(**batch, logits_to_keep=1)
    head = patched.lm_head
    wrappers = [(nn.Sequential(head), r"torch\.nn\.modules\.container\.Sequential"), (Linear(head), r"tests\S*\.Linear")]
    for wrapped, kind in wrappers:
        patched.lm_head = wrapped
        with pytest.raises(TypeError, match=rf"LlamaForCausalLM: .* not {kind}: it reads lm_head.weight .*merge_and_unload"):
            patched(**batch)


def test_a_modules_to_save_head_trains_the_module_it_runs():
    """The fused loss uses the head that the wrapper runs: the active adapter's copy, or the
    original with adapters disabled; loss and every gradient as the unpatched model's."""
    reference = make_model()
    reference.lm_head = ModulesToSave(reference.lm_head)
    patched = patch_causal_lm(copy.deepcopy(reference))
    assert_same_training_step(reference, patched, **make_batch())
    reference.lm_head.disable_adapters = patched.lm_head.disable_adapters = True
    assert_same_training_step(reference, patched, **make_batch())


def test_peft_heads():
    """With peft installed: modules_to_save=["lm_head"] trains like the unpatched PEFT model; LoRA on lm_head is refused."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    reference = peft.get_peft_model(make_model(), config)
    patched = copy.deepcopy(reference)
    patch_causal_lm(patched.get_base_model())
    assert_same_training_step(reference, patched, **make_batch())
    lora = peft.get_peft_model(patch_causal_lm(make_model()), peft.LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(TypeError, match=r"LlamaForCausalLM: .* not peft\.tuners\.lora\S*\.Linear"):
        lora(**make_batch())


def test_models_in_threads_at_once_each_find_their_hidden_states():
    """Two patched models called at once from two threads (as nn.DataParallel's replicas are):
    each fused call finds its own head's hidden states; losses as the unpatched models'."""
    import threading

    names = ["LlamaForCausalLM", "Qwen2ForCausalLM"]
    references = [make_model(name) for name in names]
    expected = [float(model(**make_batch()).loss) for model in references]
    patched = [patch_causal_lm(copy.deepcopy(model)) for model in references]
    results, errors = {}, []

    def run(i):
        try:
            for _ in range(20):
                results.setdefault(i, []).append(float(patched[i](**make_batch()).loss))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(2):
        assert len(results[i]) == 20 and all(abs(v - expected[i]) <= 1e-5 * expected[i] for v in results[i])


def test_labels_of_another_shape_are_refused_by_name():
    patched = patch_causal_lm(make_model())
    batch = make_batch()
    with pytest.raises(ValueError, match=r"labels must have the shape of the input's tokens \(2, 9\), got \(2, 5\)"):
        patched(batch["input_ids"], labels=batch["labels"][:, :5])
    with pytest.raises(ValueError, match=r"shift_labels must have the shape .* got \(18,\)"):
        patched(**batch, shift_labels=batch["labels"].reshape(-1))


def test_labels_that_are_not_integer_tensors_are_refused_by_name():
    patched = patch_causal_lm(make_model())
    batch = make_batch()
    with pytest.raises(TypeError, match="labels must be a torch.Tensor of token ids, got list"):
        patched(batch["input_ids"], labels=batch["labels"].tolist())
    with pytest.raises(TypeError, match="labels must hold integer token ids, got dtype torch.float32"):
        patched(batch["input_ids"], labels=batch["labels"].float())
    with pytest.raises(TypeError, match="shift_labels must be a torch.Tensor of token ids, got list"):
        patched(**batch, shift_labels=batch["labels"].tolist())


def test_unpatch_an_instance_restores_it_exactly():
    model = make_model()
    cls = type(model)
    assert patch_causal_lm(model) is model and patch_causal_lm(model) is model
    params = inspect.signature(model.forward).parameters
    assert "logits_to_keep" in params and any(p.kind is p.VAR_KEYWORD for p in params.values())  # Trainer, generate
    assert copy.deepcopy(model)(**make_batch()).logits is None
    assert unpatch_causal_lm(model) is model
    assert "forward" not in vars(model) and model.forward.__func__ is cls.forward
    assert model(**make_batch()).logits is not None
    with pytest.raises(ValueError, match="not patched"):
        unpatch_causal_lm(model)
    model.forward = model.forward  # an instance-level forward, as accelerate's hooks set
    with pytest.raises(ValueError, match="forward of its own"):
        patch_causal_lm(model)


def test_patch_a_class_then_unpatch_it():
    cls = transformers.LlamaForCausalLM
    original = vars(cls)["forward"]
    subclass = type("Sub", (cls,), {})
    reference_step = train_step(make_model(), **make_batch())
    try:
        assert patch_causal_lm(cls) is cls
        model = make_model()  # made after the patch
        assert_same_step(reference_step, train_step(model, **make_batch()))
        assert patch_causal_lm(model) is model and "forward" not in vars(model)
        with pytest.raises(ValueError, match="not patched"):
            unpatch_causal_lm(model)
        patch_causal_lm(subclass)
        assert "forward" not in vars(subclass)  # it runs its base class's patched forward
    finally:
        unpatch_causal_lm(cls)
    assert vars(cls)["forward"] is original
    assert not model.lm_head._forward_pre_hooks and not model.lm_head._forward_hooks  # its instances unhooked
    patch_causal_lm(subclass)
    assert unpatch_causal_lm(subclass) is subclass and "forward" not in vars(subclass)


def test_eval_with_labels_is_fused_on_request():
    """skip_logits_in_eval=True: an eval call with labels gives the original's eval loss and
    no logits (a validation loss without them); without labels, the original's logits."""
    reference = make_model().eval()
    patched = patch_causal_lm(copy.deepcopy(reference), skip_logits_in_eval=True)
    batch = make_batch()
    with torch.no_grad():
        ref_out, out = reference(**batch), patched(**batch)
        assert out.logits is None
        torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=0)
        assert torch.equal(patched(input_ids=batch["input_ids"]).logits, reference(input_ids=batch["input_ids"]).logits)


def test_what_is_not_a_causal_lm_is_refused():
    no_labels = type("NoLabels", (transformers.LlamaForCausalLM,), {"forward": lambda self, input_ids=None, **kw: None})
    masked = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                                  num_attention_heads=2, intermediate_size=64))
    for unknown, match in [(nn.Linear(2, 2), "Linear is not a causal LM .* no get_output_embeddings"),
                           (no_labels, "NoLabels is not a causal LM .* takes no labels"),
                           (masked, "BertForMaskedLM is not a causal LM .* AutoModelForCausalLM")]:
        with pytest.raises(ValueError, match=match):
            patch_causal_lm(unknown)
    custom = patch_causal_lm(make_model())
    custom.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(ValueError, match="LlamaForCausalLM: its loss_function is .* not transformers' causal-LM loss"):
        custom(**make_batch())


def test_trainer_with_gradient_accumulation_matches_the_unpatched_run(tmp_path, monkeypatch):
    """examples/trainer_torch.py's Trainer run (two micro-batches a step, with different counts
    of valid labels): the patched model gets num_items_in_batch from the Trainer, and its
    losses and final weights are the unpatched run's."""
    pytest.importorskip("accelerate")
    import importlib.util

    spec = importlib.util.spec_from_file_location("trainer_example", os.path.join(ROOT, "examples", "trainer_torch.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    seen, fused = [], patching.linear_cross_entropy
    monkeypatch.setattr(patching, "linear_cross_entropy",
                        lambda *args, **kwargs: seen.append(kwargs["num_items_in_batch"]) or fused(*args, **kwargs))
    reference, ref_losses = example.train(4, patched=False, out_dir=str(tmp_path / "reference"))
    model, losses = example.train(4, patched=True, out_dir=str(tmp_path / "patched"))
    assert len(seen) == 8 and all(torch.is_tensor(n) or isinstance(n, int) for n in seen)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    # each parameter as a whole: Adam turns a rounding-level difference in an element's
    # near-zero gradient into a visible difference of that one weight (one of 2048 by 7e-6 seen)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert float((p - q).norm()) <= 1e-5 * float(q.norm()), name


def test_sft_trainer_trains_a_patched_model_as_the_unpatched_one(tmp_path):
    """TRL's SFTTrainer (1.x) fuses the head itself (its own fused LM head on the model's
    forward, called with fused_lm_head=True): a patched model trains in it exactly as the
    unpatched one, the patch stepping aside."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizer = word_tokenizer()
    rows = datasets.Dataset.from_list([{"input_ids": [int(t) for t in torch.arange(i, i + 9) % 7 + 3]} for i in range(16)])
    runs = []
    for patch in (False, True):
        model = make_model()
        if patch:
            patch_causal_lm(model)
        args = trl.SFTConfig(output_dir=str(tmp_path / str(patch)), max_steps=3, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, seed=0, max_length=9)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
        trainer.train()
        runs.append(([e["loss"] for e in trainer.state.log_history if "loss" in e], model))
    (ref_losses, reference), (losses, patched) = runs
    assert losses == ref_losses
    for p, q in zip(patched.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_the_finetuning_example_learns():
    env = {**os.environ, "PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": ""}
    script = os.path.join(ROOT, "examples", "finetune_torch.py")
    out = subprocess.run([sys.executable, script, "--steps", "8"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    losses = [float(x) for x in re.findall(r"loss (\S+)", out.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1


def _reference_log_probs(model: nn.Module, temperature: float, **inputs):
    """(log_probs, entropy) [B, T] of the unpatched model's logits: the shifted labels'
    log-probabilities at the temperature and the entropy, 0 where the label is -100."""
    logits = model(input_ids=inputs["input_ids"]).logits.float() / temperature
    targets = patching._shift_targets(inputs["labels"], -100)
    logp = logits.log_softmax(-1)
    valid = targets != -100
    token = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, token, 0.0), torch.where(valid, entropy, 0.0)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM", "GraniteForCausalLM", "Qwen3MoeForCausalLM"])
def test_log_prob_mode_matches_the_original_logits(name):
    """model(..., labels=..., return_log_probs=True, temperature=T, return_entropy=True), in
    train and eval mode: per-token log-probabilities and entropy (0 where the label is -100)
    and the gradients of any function of them equal those from the original's logits; no
    logits, no loss (a mixture of experts keeps its aux_loss); only the labelled positions
    reach the head."""
    reference, model = make_model(name), patch_causal_lm(make_model(name))
    inputs, temperature = make_batch(), 0.7
    gen = torch.Generator().manual_seed(2)
    g_lp, g_H = torch.randn(2, 9, generator=gen), torch.randn(2, 9, generator=gen)
    rows = []
    original = patching.linear_log_probs
    spy = lambda x, *a, **k: rows.append(x.shape[0]) or original(x, *a, **k)
    for mode in ("train", "eval"):
        getattr(reference, mode)(), getattr(model, mode)()
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
        want = _reference_log_probs(reference, temperature, **inputs)
        sum(g * v for g, v in zip((g_lp, g_H), want)).sum().backward()
        patching.linear_log_probs = spy
        try:
            out = model(**inputs, return_log_probs=True, temperature=temperature, return_entropy=True)
        finally:
            patching.linear_log_probs = original
        assert out.logits is None and out.loss is None and rows[-1] == int((inputs["labels"][:, 1:] != -100).sum())
        assert (getattr(out, "aux_loss", None) is not None) == (name in MOE_FAMILIES)
        for got, ref in zip((out.log_probs, out.entropy), want):
            assert got.dtype == torch.float32 and got.shape == (2, 9)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        sum(g * v for g, v in zip((g_lp, g_H), (out.log_probs, out.entropy))).sum().backward()
        for (pname, p), ref in zip(model.named_parameters(), reference.parameters()):
            if ref.grad is None:
                assert p.grad is None, pname
                continue
            torch.testing.assert_close(p.grad, ref.grad, rtol=1e-4, atol=1e-5 * float(ref.grad.abs().max()), msg=pname)


def test_log_prob_mode_needs_labels_and_its_options_need_it():
    model = patch_causal_lm(make_model())
    inputs = make_batch()
    with pytest.raises(ValueError, match="return_log_probs=True needs labels"):
        model(input_ids=inputs["input_ids"], return_log_probs=True)
    with pytest.raises(ValueError, match="temperature apply with return_log_probs=True only"):
        model(**inputs, temperature=0.5)
    out = model(**inputs, return_log_probs=True)  # temperature 1, no entropy
    assert "entropy" not in out and out.log_probs.shape == (2, 9)
