"""TRL's fused LM head on the library (`torch_impl.trl`): its outputs and gradients against
float64 autograd of the formula and against TRL's own function, `patch_trl`'s checks, and
each TRL trainer (SFT, DPO with WPO's weights, KTO, GRPO's loss types, RLOO) trained on a
tiny model with and without it: the same losses, metrics and weights."""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl.trainer import utils as trl_utils  # noqa: E402

from torch_impl import trl as adapter  # noqa: E402
from interop.log_probs import LogProbsOptions  # noqa: E402
from tests.frameworks import SMALL, rel_err, tolerance  # noqa: E402
from torch_impl.log_probs_rule import mean_logits  # noqa: E402
from torch_impl.steps import plan_steps  # noqa: E402
from tests.test_transformers import VOCAB, make_model, word_tokenizer  # noqa: E402

TRL_FUNCTION = getattr(trl_utils, adapter.TRL_HOOK, None)
FUSED_HEAD = adapter.fused_head_outputs
needs_trl_head = pytest.mark.skipif(TRL_FUNCTION is None, reason="this TRL has no fused LM head (TRL < 1.15)")


def _formula(x, W, b, y, temperature, softcap, scale):
    """TRL's outputs from float64 logits: (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)."""
    z = (x.double() @ W.double().T + (0 if b is None else b.double())) * scale
    u = (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature
    logp = u.log_softmax(-1)
    return (logp.gather(1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1), torch.logsumexp(2 * logp, -1),
            u.mean(-1), u.argmax(-1) == y)


def _err(got, ref):
    return rel_err(got.detach().double().numpy(), ref.detach().double().numpy())


LOGIT_SCALE = 3.0
CASES = {  # name -> (temperature, softcap, logit_scale, bias)
    "plain": (1.0, None, 1.0, False),
    "temperature-bias": (0.7, None, 1.0, True),
    "softcap-scale": (0.9, 3.0, 0.25, True),  # Gemma's cap with a logit scale (Cohere's, Granite's)
    "scale": (1.2, None, 1.7, False),
}


@needs_trl_head
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_gradients_match_the_formula_and_trls_function(case, dtype):
    """Every output and the gradients of log-probabilities and entropy against float64
    autograd of the formula, within the dtype's tolerance; in fp32, against TRL's function."""
    temperature, softcap, scale, bias = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    n, d = 37, 16
    x = torch.randn(n, d, generator=gen).to(dtype)  # logits of standard deviation LOGIT_SCALE, as trained models'
    W = (torch.randn(VOCAB, d, generator=gen) * LOGIT_SCALE / d**0.5).to(dtype)
    b = torch.randn(VOCAB, generator=gen).to(dtype) if bias else None
    y = torch.randint(0, VOCAB, (n,), generator=gen)
    z = x.double() @ W.double().T + (0 if b is None else b.double())
    y[::3] = z[::3].argmax(-1)  # some targets the most likely class (the caps and scales keep the order)
    g_lp, g_H = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    runs = {}
    for name, f in (("ours", adapter.fused_head_outputs), ("trl", TRL_FUNCTION.apply), ("want", None)):
        args = [None if t is None else t.detach().clone().requires_grad_() for t in (x, W, b)]
        leaves = [t for t in args if t is not None]
        outs = (_formula(*args, y, temperature, softcap, scale) if f is None
                else f(*args, y, temperature, 32, softcap, scale, adapter.OUTPUTS))
        (outs[0] * g_lp + outs[1] * g_H).sum().backward()
        runs[name] = [o.detach() for o in outs], [t.grad for t in leaves]
    (want, want_grads), (outs, grads) = runs["want"], runs["ours"]
    tol = tolerance(str(dtype).removeprefix("torch."), LOGIT_SCALE)
    assert torch.equal(outs[4], want[4]) or dtype == torch.bfloat16  # bf16: ties of rounded logits
    for key, got, ref in zip(adapter.OUTPUTS[:4], outs, want):
        assert got.dtype == torch.float32 and got.shape == (n,)
        assert _err(got, ref) <= tol, key
    for got, ref in zip(grads, want_grads):
        assert _err(got, ref) <= tol
    if dtype == torch.float32:
        assert torch.equal(outs[4], runs["trl"][0][4])
        for got, ref in zip(outs[:4] + grads, runs["trl"][0][:4] + runs["trl"][1]):
            assert _err(got, ref) <= 1e-5


@needs_trl_head
def test_only_the_asked_outputs_and_bad_arguments_named():
    gen = torch.Generator().manual_seed(3)
    x, W, y = torch.randn(5, 8, generator=gen), torch.randn(VOCAB, 8, generator=gen), torch.randint(0, VOCAB, (5,))
    outs = adapter.fused_head_outputs(x, W, None, y, 1.0, 32, None, 1.0, ("log_probs", "is_top1"))
    assert [o is not None for o in outs] == [True, False, False, False, True] and outs[4].dtype == torch.bool
    with pytest.raises(ValueError, match="outputs must be among .* got .*'logits'"):
        adapter.fused_head_outputs(x, W, None, y, 1.0, 32, None, 1.0, ("log_probs", "logits"))
    with pytest.raises(ValueError, match="target"):
        adapter.fused_head_outputs(x, W, None, y + VOCAB, 1.0, 32, None, 1.0)


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_a_logit_scale_not_above_zero_scales_the_logits(scale):
    """logit_scale 0 (a uniform distribution, which TRL keeps) and a negative one: the
    formula's numbers, from scaled hidden states."""
    gen = torch.Generator().manual_seed(4)
    x, W = torch.randn(7, 8, generator=gen), torch.randn(VOCAB, 8, generator=gen)
    b, y = torch.randn(VOCAB, generator=gen), torch.randint(0, VOCAB, (7,), generator=gen)
    got = adapter.fused_head_outputs(x, W, b, y, 0.8, 32, 2.0, scale, adapter.OUTPUTS[:4])
    want = _formula(x, W, b, y, 0.8, 2.0, scale)
    for key, g, w in zip(adapter.OUTPUTS[:4], got, want):
        assert torch.allclose(g.double(), w, rtol=1e-5, atol=1e-5), key
    if scale == 0.0:
        assert torch.allclose(got[0], torch.full((7,), -math.log(VOCAB)))


def test_fp32_hidden_states_with_a_16_bit_head_run_in_fp32():
    """TRL's cast_lm_head_to_fp32 passes fp32 hidden states with the bf16 head: the head runs
    in fp32 (fp32's tolerance of the formula on the bf16 weights), gradients in each dtype."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 8, generator=gen, requires_grad=True)
    W = (torch.randn(VOCAB, 8, generator=gen) * LOGIT_SCALE / 8**0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, VOCAB, (9,), generator=gen)
    logp, entropy, *_ = adapter.fused_head_outputs(x, W, None, y, 1.0, 32, None, 1.0, ("log_probs", "entropy"))
    want = _formula(x.detach(), W.detach(), None, y, 1.0, None, 1.0)
    assert _err(logp, want[0]) <= tolerance("float32") and _err(entropy, want[1]) <= tolerance("float32")
    (logp.sum() + entropy.sum()).backward()
    assert x.grad.dtype == torch.float32 and W.grad.dtype == torch.bfloat16


@needs_trl_head
def test_deepspeed_zero3_is_refused_where_a_gradient_is_taken(monkeypatch):
    """Under ZeRO-3 (TRL gathers the head around the forward call only) a call that takes
    gradients raises; scoring without them (a reference model) runs."""
    import transformers.integrations.deepspeed as deepspeed

    monkeypatch.setattr(deepspeed, "is_deepspeed_zero3_enabled", lambda: True)
    gen = torch.Generator().manual_seed(6)
    x, W, y = torch.randn(5, 8, generator=gen), torch.randn(VOCAB, 8, generator=gen), torch.randint(0, VOCAB, (5,))
    with torch.no_grad():
        adapter._FusedHead.apply(x, W.requires_grad_(), None, y, 1.0, 32, None, 1.0, ("log_probs",))
    with pytest.raises(RuntimeError, match="does not support DeepSpeed ZeRO-3"):
        adapter._FusedHead.apply(x, W, None, y, 1.0, 32, None, 1.0, ("log_probs",))


@needs_trl_head
def test_patch_trl_replaces_one_name_and_refuses_a_moved_trl(monkeypatch):
    import inspect

    assert tuple(inspect.signature(adapter.fused_head_outputs).parameters) == adapter.PARAMETERS
    monkeypatch.setattr(trl_utils, adapter.TRL_HOOK, TRL_FUNCTION)
    adapter.patch_trl()
    adapter.patch_trl()  # a second call changes nothing
    assert getattr(trl_utils, adapter.TRL_HOOK) is adapter._FusedHead

    class Moved(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
            return hidden

    monkeypatch.setattr(trl_utils, adapter.TRL_HOOK, Moved)
    with pytest.raises(RuntimeError, match=rf"TRL {trl.__version__} is not supported by patch_trl .*\.forward takes"):
        adapter.patch_trl()
    monkeypatch.delattr(trl_utils, adapter.TRL_HOOK)
    with pytest.raises(RuntimeError, match=rf"TRL {trl.__version__} .* has no {adapter.TRL_HOOK}"):
        adapter.patch_trl()


@pytest.mark.parametrize("layout", ["VD", "DV"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_mean_logits_over_several_blocks(layout, softcap):
    """`mean_logits` (the linear form without a softcap, the blocks' sums with one) against
    float64, over tiles of 4 rows x 8 columns and either layout."""
    gen = torch.Generator().manual_seed(9)
    n, d = 13, 8
    x, W, b = torch.randn(n, d, generator=gen), torch.randn(VOCAB, d, generator=gen), torch.randn(VOCAB, generator=gen)
    plan, _ = plan_steps(SMALL, "log_probs", "memory", n, d, VOCAB, x.dtype, False)
    head = W if layout == "VD" else W.T.contiguous()
    got = mean_logits(x, head, b, LogProbsOptions(0.7, softcap, None), layout, plan)
    want = _formula(x, W, b, torch.zeros(n, dtype=torch.int64), 0.7, softcap, 1.0)[3]
    assert plan.block_rows < n and plan.block_cols < VOCAB and got.dtype == torch.float32
    assert _err(got, want) <= tolerance("float32")


# ----------------------------------------------------------------------------- the trainers

# log entries that differ between any two runs
_TIMING = ("time", "runtime", "per_second", "flos")


def _train(trainer_class, config_class, tmp_path, monkeypatch, patched: bool, dataset, steps=2, **options):
    """(the numeric log entries, the trained model, the library head's calls: whether each
    ran under autocast) of a short run of `trainer_class` on a tiny fp32 Llama
    (`make_model`, saved under tmp_path)."""
    monkeypatch.setattr(trl_utils, adapter.TRL_HOOK, TRL_FUNCTION)  # TRL's own, restored after the test
    calls = []
    spy = lambda *a: calls.append(torch.is_autocast_enabled(a[0].device.type)) or FUSED_HEAD(*a)
    monkeypatch.setattr(adapter, "fused_head_outputs", spy)
    if patched:
        adapter.patch_trl()
    path = tmp_path / "model"
    if not path.exists():  # a path, from which the trainers load their reference models too
        make_model().save_pretrained(path)
    args = config_class(output_dir=str(tmp_path / f"{trainer_class.__name__}{patched}"), max_steps=steps,
                        learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                        **{"bf16": False, **options})  # fp32 (both heads exact to rounding) unless asked
    kwargs = {"train_dataset": dataset, "processing_class": word_tokenizer()}
    if trainer_class is trl.GRPOTrainer or trainer_class is trl.RLOOTrainer:
        kwargs["reward_funcs"] = _reward
    trainer = trainer_class(model=str(path), args=args, **kwargs)
    trainer.train()
    logs = [{k: v for k, v in entry.items() if isinstance(v, (int, float)) and not any(t in k for t in _TIMING)}
            for entry in trainer.state.log_history]
    return logs, trainer.model, calls


def _reward(completions, **kwargs):
    """A reward that varies within a group: the count of even tokens in the completion."""
    return [float(sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit())) for c in completions]


def _check_same_run(tmp_path, monkeypatch, trainer_class, config_class, dataset, rtol=1e-4, **options):
    (ref_logs, reference, stock_calls), (logs, model, calls) = (
        _train(trainer_class, config_class, tmp_path, monkeypatch, patched, dataset, **options)
        for patched in (False, True))
    assert not stock_calls and calls, "the library's head ran in the patched run only"
    assert [set(e) for e in logs] == [set(e) for e in ref_logs]
    for entry, ref in zip(logs, ref_logs):
        for key, value in ref.items():
            assert math.isclose(entry[key], value, rel_tol=rtol, abs_tol=rtol / 100), (key, entry[key], value)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert float((p - q).norm()) <= 10 * rtol * float(q.norm()), name
    assert all(autocast == options.get("bf16", False) for autocast in calls)
    return logs


def _words(rng, n):
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=rng))


@needs_trl_head
def test_sft_trainer(tmp_path, monkeypatch):
    """SFT: the loss, entropy and token accuracy (is_top1) metrics and the weights."""
    rows = datasets.Dataset.from_list([{"input_ids": [int(t) for t in torch.arange(i, i + 9) % 7 + 3]}
                                       for i in range(16)])
    logs = _check_same_run(tmp_path, monkeypatch, trl.SFTTrainer, trl.SFTConfig, rows, per_device_train_batch_size=2,
                           gradient_accumulation_steps=2, max_length=9)
    assert "mean_token_accuracy" in logs[0] and "entropy" in logs[0]


def _preferences(n=8):
    rng = torch.Generator().manual_seed(5)
    return datasets.Dataset.from_list([{"prompt": _words(rng, 4), "chosen": _words(rng, 5), "rejected": _words(rng, 3)}
                                       for _ in range(n)])


@needs_trl_head
@pytest.mark.parametrize("use_weighting", [False, True])
def test_dpo_trainer(tmp_path, monkeypatch, use_weighting):
    """DPO: the loss, rewards, log-probability and mean-logit metrics; WPO's weights
    (use_weighting) from log(sum p^2)."""
    logs = _check_same_run(tmp_path, monkeypatch, trl.DPOTrainer, trl.DPOConfig, _preferences(),
                           per_device_train_batch_size=4, max_length=16, use_weighting=use_weighting)
    assert any("logits" in k for k in logs[0])


@needs_trl_head
def test_kto_trainer(tmp_path, monkeypatch):
    rng = torch.Generator().manual_seed(6)
    rows = datasets.Dataset.from_list([{"prompt": _words(rng, 4), "completion": _words(rng, 4), "label": i % 2 == 0}
                                       for i in range(8)])
    _check_same_run(tmp_path, monkeypatch, trl.KTOTrainer, trl.KTOConfig, rows, per_device_train_batch_size=4,
                    max_length=16)


def _prompts(n=4):
    rng = torch.Generator().manual_seed(7)
    return datasets.Dataset.from_list([{"prompt": _words(rng, 3)} for _ in range(n)])


GRPO_CASES = {**{loss: dict(loss_type=loss) for loss in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")},
              "gspo": dict(importance_sampling_level="sequence"),  # a sequence-level ratio
              "entropy-mask": dict(top_entropy_quantile=0.5)}  # only the high-entropy tokens


@needs_trl_head
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_trainer(tmp_path, monkeypatch, case):
    """GRPO's loss types, GSPO and the entropy mask, with the bias-corrected KL to the
    reference model (TRL's default) and two steps on each generation (the second's ratio
    is not 1: the clips act)."""
    _check_same_run(tmp_path, monkeypatch, trl.GRPOTrainer, trl.GRPOConfig, _prompts(), per_device_train_batch_size=4,
                    num_generations=4, max_completion_length=6, beta=0.04, temperature=0.8, num_iterations=2,
                    **GRPO_CASES[case])


@needs_trl_head
def test_grpo_trainer_under_bf16_autocast(tmp_path, monkeypatch):
    """TRL's default precision (bf16=True: the fp32 model under bf16 autocast), where both
    heads compute in bf16: the same run within bf16's rounding."""
    _check_same_run(tmp_path, monkeypatch, trl.GRPOTrainer, trl.GRPOConfig, _prompts(), rtol=2e-2,
                    per_device_train_batch_size=4, num_generations=4, max_completion_length=6, beta=0.04,
                    temperature=0.8, num_iterations=2, bf16=True)


@needs_trl_head
def test_rloo_trainer(tmp_path, monkeypatch):
    _check_same_run(tmp_path, monkeypatch, trl.RLOOTrainer, trl.RLOOConfig, _prompts(), per_device_train_batch_size=4,
                    num_generations=4, max_completion_length=6, beta=0.04, temperature=0.8, num_iterations=2)
