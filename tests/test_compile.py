"""`linear_cross_entropy` under torch.compile: the custom op (`torch_impl.custom_ops`).

A model that calls the loss compiles whole (fullgraph=True), with a varying number of rows
compiled once; values and gradients equal the eager call's and the float64 reference's;
in compiled code a bad target gives a NaN row instead of raising. The tests run where the
other suites run: on the CPU (the kernels in Triton's interpreter) without a GPU, else on
CUDA (the compiled kernels). The graphs run through AOTAutograd with the eager backend, and
through Inductor (on the CPU where a C++ compiler is present); on a GPU a training step is
also captured in a CUDA graph and replayed.
"""

import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

import torch_impl
from interop.reference import linear_cross_entropy_reference
from tests import test_policy_loss
from tests.frameworks import SMALL_BLOCKS, device

DEV = torch.device(device())

STRATEGIES = ["chunked", "speed", "memory"]
N, D, V = 13, 19, 53


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: the same model code with other options is a new graph, and
    Dynamo's limit of recompilations per code object would count them all."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class TinyLM(torch.nn.Module):
    """Embedding, one hidden layer and a head whose loss is linear_cross_entropy."""

    def __init__(self, dtype=torch.float32, bias=False, **loss_options):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D, dtype=dtype, device=DEV)
        self.mlp = torch.nn.Linear(D, D, dtype=dtype, device=DEV)
        self.head = torch.nn.Linear(D, V, bias=bias, dtype=dtype, device=DEV)
        self.loss_options = loss_options

    def forward(self, ids, labels):
        h = torch.tanh(self.mlp(self.embed(ids)))
        return torch_impl.linear_cross_entropy(h, self.head.weight, labels, linear_bias=self.head.bias,
                                               **self.loss_options)


def _labels(shape, generator, ignored=(), bad=()):
    y = torch.randint(0, V, shape, generator=generator)
    for i in ignored:
        y.view(-1)[i] = -100
    for i in bad:
        y.view(-1)[i] = V + 3
    return y.to(DEV)


def _loss_and_grads(model, ids, labels, reduce=lambda out: out.sum()):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels)
    total = reduce(out)
    total.backward()
    return out, {k.removeprefix("_orig_mod."): p.grad.clone() for k, p in model.named_parameters()}


def _host(t):
    """t as a float64 numpy array (for the float64 reference)."""
    return t.detach().cpu().double().numpy()


def _tolerance(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction, return_lse", [("mean", False), ("none", False), ("sum", True)])
def test_fullgraph_compile_matches_eager(strategy, reduction, return_lse):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TinyLM(bias=True, strategy=strategy, reduction=reduction, return_lse=return_lse, label_smoothing=0.1,
                   z_loss=1e-3, tuning=SMALL_BLOCKS)
    ids = _ids(2, 7, generator=gen)
    labels = _labels((2, 7), gen, ignored=(1, 8))
    reduce = (lambda out: out[0].sum() + 0.5 * out[1].sum()) if return_lse else (lambda out: (out * 1.5).sum())
    eager_out, eager_grads = _loss_and_grads(model, ids, labels, reduce)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    out, grads = _loss_and_grads(compiled, ids, labels, reduce)
    for e, c in zip(eager_out if return_lse else [eager_out], out if return_lse else [out]):
        torch.testing.assert_close(c, e)
    for k in eager_grads:
        torch.testing.assert_close(grads[k], eager_grads[k], msg=k)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_call_matches_float64_reference(strategy, dtype):
    """The op itself against the spec: strided views, a bias, class weights, softcap."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 2 * D, generator=gen).to(DEV, dtype)[:, ::2].requires_grad_()  # strided
    W = (torch.randn(D, V, generator=gen) * 0.5).to(DEV, dtype).T.requires_grad_()  # transposed
    b = torch.randn(V, generator=gen).to(DEV, dtype).requires_grad_()
    cw = (torch.rand(V, generator=gen) + 0.5).to(DEV)
    y = _labels((N,), gen, ignored=(4,))

    def f(x, W, b, y):
        return torch_impl.linear_cross_entropy(x, W, y, linear_bias=b, weight=cw, softcap=7.0, strategy=strategy,
                                               tuning=SMALL_BLOCKS)

    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(x, W, b, y)
    grads = torch.autograd.grad(loss, (x, W, b))
    ref = linear_cross_entropy_reference(_host(x), _host(W), y.cpu().numpy(), linear_bias=_host(b), weight=_host(cw),
                                         softcap=7.0)
    tol = _tolerance(dtype)
    np.testing.assert_allclose(float(loss), ref.loss, **tol)
    for g, r in zip(grads, (ref.grad_input, ref.grad_weight, ref.grad_bias)):
        np.testing.assert_allclose(_host(g), r, **tol)


def test_op_names_carry_the_digest_of_the_library_sources(tmp_path):
    """Each op is named <loss>_<digest of torch_impl's and interop's sources>, and the compiled
    graph calls it by that name: a changed library is a new op to torch.compile's caches (an
    Inductor FX-graph cache on disk could replay an older op's output shapes under an unchanged
    name). The digest changes with any byte of those sources and with nothing else, and is the
    same when the packages are imported from a zip."""
    import interop
    from torch._dynamo.testing import CompileCounterWithBackend

    from torch_impl import custom_ops

    suffix = custom_ops.OP_SUFFIX
    assert len(suffix) == 8 and int(suffix, 16) >= 0
    for loss in ("linear_cross_entropy", "linear_log_probs", "linear_topk_distillation", "linear_distillation"):
        assert hasattr(torch.ops.logitless, f"{loss}_{suffix}"), loss
        assert hasattr(torch.ops.logitless, f"{loss}_{suffix}_backward"), loss
    counter = CompileCounterWithBackend("aot_eager")
    x, W = torch.randn(6, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    y = torch.randint(0, 10, (6,))
    torch.compile(torch_impl.linear_cross_entropy, fullgraph=True, backend=counter)(x, W, y).backward()
    called = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert f"logitless.linear_cross_entropy_{suffix}.default" in called, called
    folders = []
    for package in (torch_impl, interop):
        folders.append(tmp_path / package.__name__)
        shutil.copytree(os.path.dirname(package.__file__), folders[-1], ignore=shutil.ignore_patterns("__pycache__"))
    assert custom_ops.source_digest(folders) == suffix
    (folders[-1] / "notes.txt").write_text("not a source")
    assert custom_ops.source_digest(folders) == suffix
    archive = tmp_path / "packages.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for folder in folders:
            for path in folder.rglob("*.py"):
                z.write(path, path.relative_to(tmp_path).as_posix())
    zipped = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(archive)!r}); "
                             "import torch_impl.custom_ops as c; print(c.OP_SUFFIX, c.__file__)"],
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=""))
    assert zipped.returncode == 0 and zipped.stdout.split()[0] == suffix and ".zip" in zipped.stdout, zipped.stderr[-2000:]
    spec = folders[-1] / "options.py"
    spec.write_text(spec.read_text() + "\n")
    assert custom_ops.source_digest(folders) != suffix


def test_varying_rows_compile_once():
    """dynamic=True: one graph for every number of rows (the block plan is made when the op runs)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    gen = torch.Generator().manual_seed(2)
    model = TinyLM(strategy="speed", tuning=SMALL_BLOCKS)
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=True)
    first = None
    for n in (5, 11, 23):
        ids, labels = _ids(n, generator=gen), _labels((n,), gen)
        _, grads = _loss_and_grads(compiled, ids, labels)
        _, eager = _loss_and_grads(model, ids, labels)
        for k in eager:
            torch.testing.assert_close(grads[k], eager[k])
        first = first or counter.frame_count
    assert counter.frame_count == first


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bad_target_gives_nan_row_in_compiled_code(strategy):
    """Compiled code does not wait for the GPU to check targets: the bad row is NaN (its
    gradient too), every other row as eager; eager raises."""
    gen = torch.Generator().manual_seed(3)
    model = TinyLM(strategy=strategy, reduction="none", tuning=SMALL_BLOCKS)
    ids, good = _ids(N, generator=gen), _labels((N,), gen, ignored=(2,))
    bad = good.clone()
    bad[5] = V + 3
    with pytest.raises(ValueError, match="target"):
        model(ids, bad)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(ids, bad)
    assert torch.isnan(out[5]) and torch.isfinite(out[torch.arange(N, device=DEV) != 5]).all()
    torch.testing.assert_close(out[torch.arange(N, device=DEV) != 5], model(ids, good)[torch.arange(N, device=DEV) != 5])
    mean = torch.compile(TinyLM(strategy=strategy, tuning=SMALL_BLOCKS), fullgraph=True, backend="aot_eager")(ids, bad)
    assert torch.isnan(mean)


def test_compiled_options_match_eager():
    """num_items_in_batch, gradient filtering (compiled: dropped tiles zeroed, not gathered)
    and the DV layout."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(N, D, generator=gen).to(DEV).requires_grad_()
    W = torch.randn(D, V, generator=gen).to(DEV).requires_grad_()
    y = _labels((N,), gen, ignored=(0, 7))
    opts = dict(weight_layout="DV", num_items_in_batch=torch.tensor(40, device=DEV), filter_eps=2.0**-6, strategy="speed",
                tuning=SMALL_BLOCKS)

    def f(x, W, y):
        return torch_impl.linear_cross_entropy(x, W, y, **opts)

    eager = f(x, W, y)
    eager_grads = torch.autograd.grad(eager, (x, W))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, W, y)
    torch.testing.assert_close(compiled, eager)
    for g, e in zip(torch.autograd.grad(compiled, (x, W)), eager_grads):
        torch.testing.assert_close(g, e)


def test_compiled_call_checks_its_arguments():
    x, W = torch.randn(N, D, device=DEV), torch.randn(V, D + 1, device=DEV)
    f = torch.compile(lambda x, W, y: torch_impl.linear_cross_entropy(x, W, y), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="linear_weight"):
        f(x, W, torch.zeros(N, dtype=torch.int64, device=DEV))
    g = torch.compile(lambda x, W, y: torch_impl.linear_cross_entropy(x, W, y, reduction="avg"), fullgraph=True,
                      backend="aot_eager")
    with pytest.raises(Exception, match="reduction"):
        g(x, W[:, :D], torch.zeros(N, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("loss", ["cross_entropy", "topk", "log_probs"])
def test_compiled_call_checks_its_shapes_when_traced(loss):
    """A target of the wrong shape gets the eager call's error when the op is traced (its
    fake implementation checks), not a reshape's error after it."""
    x, W, y = torch.randn(N, D, device=DEV), torch.randn(V, D, device=DEV), torch.zeros(N - 1, dtype=torch.int64, device=DEV)
    ids, lp = torch.zeros(N, 2, dtype=torch.int64, device=DEV), torch.full((N, 2), -0.7, device=DEV)
    call = {"cross_entropy": lambda x, W, y: torch_impl.linear_cross_entropy(x, W, y, reduction="none"),
            "topk": lambda x, W, y: torch_impl.linear_topk_distillation(x, W, ids, lp, target=y, reduction="none"),
            "log_probs": lambda x, W, y: torch_impl.linear_log_probs(x, W, y)}[loss]
    with pytest.raises(Exception, match="target must have shape"):
        torch.compile(call, fullgraph=True, backend="aot_eager")(x, W, y)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_call_takes_expanded_and_offset_views(strategy):
    """A head expanded from one row (stride 0), an input and a bias sliced at an offset, targets
    read with a step: values and the gradients of the views' bases as eager and the float64
    reference (an expanded head's gradient is the sum of its rows')."""
    gen = torch.Generator().manual_seed(16)
    xs = torch.randn(N + 3, D, generator=gen).to(DEV).requires_grad_()
    row = torch.randn(1, D, generator=gen).to(DEV).requires_grad_()
    bs = torch.randn(V + 2, generator=gen).to(DEV).requires_grad_()
    ys = _labels((2 * N,), gen, ignored=(2,))

    views = lambda xs, row, bs: (xs[3:], row.expand(V, D), ys[::2], bs[2:])
    x, W, y, b = views(xs, row, bs)
    assert x.storage_offset() and not W.stride(0) and y.stride(0) == 2 and b.storage_offset()

    def f(xs, row, bs):
        x, W, y, b = views(xs, row, bs)
        return torch_impl.linear_cross_entropy(x, W, y, linear_bias=b, strategy=strategy, tuning=SMALL_BLOCKS)

    eager = f(xs, row, bs)
    eager_grads = torch.autograd.grad(eager, (xs, row, bs))
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(xs, row, bs)
    grads = torch.autograd.grad(loss, (xs, row, bs))
    torch.testing.assert_close(loss, eager)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)
    ref = linear_cross_entropy_reference(_host(xs)[3:], np.repeat(_host(row), V, 0), ys.cpu().numpy()[::2],
                                         linear_bias=_host(bs)[2:])
    np.testing.assert_allclose(float(loss), ref.loss, rtol=1e-5)
    np.testing.assert_allclose(_host(grads[0])[3:], ref.grad_input, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_host(grads[1])[0], ref.grad_weight.sum(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_host(grads[2])[2:], ref.grad_bias, rtol=1e-5, atol=1e-6)
    assert not _host(grads[0])[:3].any() and not _host(grads[2])[:2].any()


@pytest.mark.parametrize("fullgraph", [True, False])
def test_compiled_call_names_a_meta_argument(fullgraph):
    """A tensor without data (the meta device) is refused by name inside torch.compile too,
    by the checks eager calls run (a compiled call that breaks its graph raises the eager
    ValueError; fullgraph=True reports it inside Dynamo's error)."""
    x, W, y = torch.randn(N, D, device=DEV), torch.randn(V, D, device=DEV), torch.zeros(N, dtype=torch.int64, device=DEV)
    f = torch.compile(lambda x, W, y: torch_impl.linear_cross_entropy(x, W, y), fullgraph=fullgraph, backend="aot_eager")
    for args, name in (((x.to("meta"), W, y), "input"), ((x, W.to("meta"), y), "linear_weight"),
                       ((x, W, y.to("meta")), "target")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=f"{name} is on the meta device") as raised:
            f(*args)
        assert fullgraph or raised.type is ValueError


def _compare(f, args, grad_of, reduce=lambda out: out.sum()):
    """f compiled (fullgraph) against f eager: outputs and the gradients of reduce(out)
    with respect to args[i] for i in grad_of."""
    def run(fn):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(reduce(out), [args[i] for i in grad_of])
        return outs, grads

    eager = run(f)
    compiled = run(torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True))
    for e, c in zip(eager[0] + eager[1], compiled[0] + compiled[1]):
        torch.testing.assert_close(c, e, equal_nan=True)
    return compiled[0]


def _ids(*shape, generator):
    return torch.randint(0, V, shape, generator=generator).to(DEV)


def _head(gen, dtype=torch.float32, vocab=V):
    x = torch.randn(N, D, generator=gen).to(DEV, dtype).requires_grad_()
    W = (torch.randn(vocab, D, generator=gen) * 0.5).to(DEV, dtype).requires_grad_()
    return x, W


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_topk_distillation_matches_eager(strategy, reduction):
    gen = torch.Generator().manual_seed(7)
    x, W = _head(gen)
    b = torch.randn(V, generator=gen).to(DEV).requires_grad_()
    ids = torch.stack([torch.randperm(V, generator=gen)[:5] for _ in range(N)]).to(DEV)
    ids[2, 3] = -1  # padding
    logprobs = torch.log_softmax(torch.randn(N, 5, generator=gen), -1).to(DEV)
    y = _labels((N,), gen, ignored=(4,))

    def f(x, W, b):
        return torch_impl.linear_topk_distillation(x, W, ids, logprobs, target=y, linear_bias=b, weight_hard=0.3,
                                                   temperature=2.0, reduction=reduction, strategy=strategy,
                                                   num_items_in_batch=20 if reduction == "mean" else None,
                                                   tuning=SMALL_BLOCKS)

    _compare(f, (x, W, b), (0, 1, 2), reduce=lambda out: (out * 1.5).sum())


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("reduction, divergence", [("mean", "forward_kl"), ("none", "jsd"), ("sum", "reverse_kl")])
def test_compiled_dense_distillation_matches_eager(strategy, reduction, divergence):
    gen = torch.Generator().manual_seed(8)
    x, W = _head(gen)
    xt, Wt = _head(gen, vocab=V + 4)
    row_mask = (torch.rand(N, generator=gen) > 0.2).to(DEV)

    def f(x, W):
        return torch_impl.linear_distillation(x, W, xt, Wt, row_mask=row_mask, divergence=divergence,
                                              reduction=reduction, strategy=strategy, tuning=SMALL_BLOCKS)

    _compare(f, (x, W), (0, 1), reduce=lambda out: (out * 1.5).sum())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_log_probs_match_eager(strategy):
    """A GRPO-like function of log-probabilities and entropy."""
    gen = torch.Generator().manual_seed(9)
    x, W = _head(gen)
    b = torch.randn(V, generator=gen).to(DEV).requires_grad_()
    y = _labels((N,), gen, ignored=(1,))
    advantages = torch.randn(N, generator=gen).to(DEV)

    def f(x, W, b):
        return torch_impl.linear_log_probs(x, W, y, linear_bias=b, temperature=0.7, return_entropy=True,
                                           return_argmax=True, strategy=strategy, tuning=SMALL_BLOCKS)

    def grpo(out):
        logp, entropy, _ = out
        return -(torch.exp(logp - logp.detach()) * advantages).sum() - 0.01 * entropy.sum()

    _compare(f, (x, W, b), (0, 1, 2), reduce=grpo)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", sorted(test_policy_loss.CASES))
def test_compiled_policy_loss_matches_reference(strategy, case):
    """`linear_policy_loss` compiles whole (fullgraph): every case of tests/test_policy_loss.py
    (on-policy GRPO with a per-sequence advantage; old and reference log-probabilities, the
    KL, the entropy bonus, token weights, a custom ignore_index) gives the float64
    reference's loss and gradients at the dtype's tolerance."""
    p, options, tokens = test_policy_loss._problem(case, "float32")
    got = test_policy_loss.run_torch(p, options, tokens, strategy, device=DEV, compiled=True)
    test_policy_loss.check(got, test_policy_loss._reference(p, options, tokens), "float32", p.logit_scale, case)


def test_compiled_distillation_and_log_probs_give_nan_rows_for_bad_ids():
    """A teacher id >= V, a bad hard target, a bad log-prob target: NaN rows, never a read
    outside the head; eager raises."""
    gen = torch.Generator().manual_seed(10)
    x, W = _head(gen)
    ids = torch.stack([torch.randperm(V, generator=gen)[:4] for _ in range(N)]).to(DEV)
    ids[3, 1] = V + 7
    logprobs = torch.log_softmax(torch.randn(N, 4, generator=gen), -1).to(DEV)
    y = _labels((N,), gen, bad=(6,))
    topk = lambda x, W: torch_impl.linear_topk_distillation(x, W, ids, logprobs, target=y, weight_hard=0.5,
                                                            reduction="none", strategy="speed", tuning=SMALL_BLOCKS)
    log_probs = lambda x, W: torch_impl.linear_log_probs(x, W, y, strategy="memory", tuning=SMALL_BLOCKS)
    for f, bad_rows in ((topk, {3, 6}), (log_probs, {6})):
        with pytest.raises(ValueError):
            f(x, W)
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, W)
        assert {i for i in range(N) if torch.isnan(out[i])} == bad_rows


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_patched_transformers_model_compiles_whole(name):
    """A Hugging Face causal LM patched to the fused loss compiles with fullgraph=True; its
    loss and every gradient equal the unpatched eager model's."""
    pytest.importorskip("transformers")
    from tests.test_transformers import assert_same_step, make_batch, make_model, train_step
    from torch_impl.transformers import patch_causal_lm

    reference, model = make_model(name), make_model(name)
    patch_causal_lm(model)
    expected = train_step(reference, **make_batch())
    out, _ = train_step(torch.compile(model, fullgraph=True, backend="aot_eager"), **make_batch())
    assert_same_step(expected, (out, {k: p.grad for k, p in model.named_parameters()}))


def test_compiled_model_benchmark_runs(tmp_path):
    """`python -m bench.compiled_model` on the CPU with a tiny Llama: every method gives the
    same loss; the patched model compiles as one graph, as several with the loss kept out."""
    pytest.importorskip("transformers")
    import json

    from bench import compiled_model

    out = tmp_path / "compiled.json"
    compiled_model.main(["--tiny", "--backend", "aot_eager", "--seq", "16", "--repeat", "1", "--dtype", "float32",
                         "--json", str(out),
                         "--methods", "eager,compile,ours,ours-compile,ours-graph-break"])
    saved = json.loads(out.read_text())
    assert saved["environment"]["dtype"] == "float32"
    rows = {r["method"]: r for r in saved["results"]}
    for r in rows.values():
        assert abs(r["loss"] - rows["eager"]["loss"]) <= 1e-5 * abs(rows["eager"]["loss"]), r
    assert rows["ours-compile"]["graphs"] == 1 and rows["ours-graph-break"]["graphs"] > 1
    compiled_model.main(["--tiny", "--seq", "8", "--repeat", "1", "--dtype", "bfloat16", "--json", str(out),
                         "--methods", "eager,ours"])
    saved = json.loads(out.read_text())
    assert saved["environment"]["dtype"] == "bfloat16" and [r["method"] for r in saved["results"]] == ["eager", "ours"]


def test_a_head_split_over_ranks_runs_as_an_eager_step_in_compiled_code():
    """vocab_parallel (a process group, which an op can't take) inside torch.compile: one
    eager step (a graph break), equal to the eager call; fullgraph refuses it."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(11)
    x, W = _head(gen)
    y = _labels((N,), gen)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        f = lambda x, W: torch_impl.linear_cross_entropy(x, W, y, vocab_parallel=dist.group.WORLD, tuning=SMALL_BLOCKS)
        eager = f(x, W)
        torch.testing.assert_close(torch.compile(f, backend="aot_eager")(x, W), eager)
        torch._dynamo.reset()  # Dynamo's cache of f's frame would answer the next call
        with pytest.raises(Exception, match="disable|graph break|Unsupported|skip"):
            torch.compile(f, fullgraph=True, backend="aot_eager")(x, W)
    finally:
        dist.destroy_process_group()


def test_integer_num_items_compile_once_for_every_loss():
    """num_items_in_batch as a Python int (what the Trainer passes before it makes a tensor)
    divides outside the ops: a new count is no new graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    gen = torch.Generator().manual_seed(12)
    x, W = _head(gen)
    ids = torch.stack([torch.randperm(V, generator=gen)[:4] for _ in range(N)]).to(DEV)
    logprobs = torch.log_softmax(torch.randn(N, 4, generator=gen), -1).to(DEV)
    y = _labels((N,), gen)
    calls = {
        "cross-entropy": lambda n: torch_impl.linear_cross_entropy(x, W, y, num_items_in_batch=n),
        "top-K": lambda n: torch_impl.linear_topk_distillation(x, W, ids, logprobs, num_items_in_batch=n),
        "dense": lambda n: torch_impl.linear_distillation(x, W, x.detach(), W.detach(), num_items_in_batch=n),
    }
    for name, call in calls.items():
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(call, backend=counter, dynamic=True)
        for n in (20, 21, 22, 23, 24):
            torch.testing.assert_close(compiled(n), call(n), msg=name)
        assert counter.frame_count <= 2, (name, counter.frame_count)


def test_compiled_options_are_checked_as_eager_ones():
    """A bool is no number (eager raises; so does a compiled call); a NumPy float, which
    Dynamo traces as a tensor, is refused by name inside torch.compile."""
    import numpy as np

    gen = torch.Generator().manual_seed(13)
    x, W = _head(gen)
    y = _labels((N,), gen)
    f = lambda x, W, **options: torch_impl.linear_cross_entropy(x, W, y, **options)
    with pytest.raises(ValueError, match="label_smoothing must be a number"):
        f(x, W, label_smoothing=True)
    with pytest.raises(Exception, match="label_smoothing must be a number"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(x, W, label_smoothing=True)
    torch._dynamo.reset()
    torch.testing.assert_close(f(x, W, softcap=np.float64(5.0)), f(x, W, softcap=5.0))
    with pytest.raises(Exception, match="softcap must be a Python number inside torch.compile"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(x, W, softcap=np.float64(5.0))


def test_gradients_are_formed_early_only_where_eager_forms_them():
    """The kernels' blocks of whole rows ("speed", "auto" but not in fp16); "chunked" and
    "memory" leave the gradients to the backward op (formed at scale 1 in a 16-bit
    accumulator, a loss-scaled fp16 gradient would underflow)."""
    from torch_impl.custom_ops import formed_now

    x, W = (torch.zeros(4, 3, device=DEV, requires_grad=True) for _ in range(2))
    half = x.detach().half().requires_grad_()
    assert formed_now(True, "speed", x, W, None) == [True, True, False]
    assert formed_now(True, "auto", x, W, None) == [True, True, False]
    assert not any(formed_now(True, "auto", half, W, None))
    for strategy in ("chunked", "memory"):
        assert not any(formed_now(True, strategy, x, W, None))
    assert not any(formed_now(False, "speed", x, W, None))


def test_compiled_unreduced_loss_filters_its_gradient_as_eager():
    """filter_eps reaches the backward op (reduction "none": the gradients are recomputed
    there): compiled gradients equal eager's, which differ from unfiltered ones."""
    gen = torch.Generator().manual_seed(14)
    x, W = _head(gen)
    x = (x.detach() * 4).requires_grad_()
    y = _labels((N,), gen)
    f = lambda x, W, eps: torch_impl.linear_cross_entropy(x, W, y, reduction="none", filter_eps=eps, strategy="speed",
                                                         tuning=SMALL_BLOCKS)
    eager = torch.autograd.grad(f(x, W, 0.5).sum(), (x, W))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, W, 0.5).sum(), (x, W))
    unfiltered = torch.autograd.grad(f(x, W, None).sum(), (x, W))
    for c, e, u in zip(compiled, eager, unfiltered):
        torch.testing.assert_close(c, e)
        assert not torch.allclose(e, u)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="Inductor on a CPU needs a C++ compiler")
def test_inductor_takes_transposed_inputs():
    """Sequence-first hidden states [T, B, D] read as [B, T, D] and a head passed as E.T
    ([D, V], "DV"): the ops' gradients are contiguous whatever the inputs' strides, and the
    fakes say so (Inductor checks the strides it was told)."""
    gen = torch.Generator().manual_seed(15)
    h = torch.randn(7, 2, D, generator=gen).to(DEV).requires_grad_()
    E = torch.randn(V, D, generator=gen).to(DEV).requires_grad_()
    y = _labels((2, 7), gen)
    f = lambda h, E: torch_impl.linear_cross_entropy(h.transpose(0, 1), E.T, y, weight_layout="DV", strategy="chunked")
    eager = torch.autograd.grad(f(h, E), (h, E))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(h, E), (h, E))
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="Inductor on a CPU needs a C++ compiler")
def test_inductor_compiles_a_model_with_the_loss():
    gen = torch.Generator().manual_seed(5)
    model = TinyLM(strategy="chunked")
    ids, labels = _ids(2, 9, generator=gen), _labels((2, 9), gen, ignored=(3,))
    _, eager = _loss_and_grads(model, ids, labels)
    _, grads = _loss_and_grads(torch.compile(model, fullgraph=True), ids, labels)
    for k in eager:
        torch.testing.assert_close(grads[k], eager[k], rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["speed", "memory"])
def test_cuda_inductor_and_cuda_graph_training_step(strategy):
    """A bf16 model compiled by Inductor equals eager; a training step (forward, backward,
    optimizer) captured in a CUDA graph and replayed on new data gives eager's gradients."""
    torch.manual_seed(6)
    dev = torch.device("cuda")
    model = TinyLM(dtype=torch.bfloat16, strategy=strategy).to(dev)
    ids, labels = torch.randint(0, V, (4, 64), device=dev), torch.randint(0, V, (4, 64), device=dev)
    labels[0, :5] = -100
    _, eager = _loss_and_grads(model, ids, labels)
    _, grads = _loss_and_grads(torch.compile(model, fullgraph=True, dynamic=True), ids, labels)
    for k in eager:
        torch.testing.assert_close(grads[k], eager[k], **_tolerance(torch.bfloat16))

    static_ids, static_labels = ids.clone(), labels.clone()
    compiled = torch.compile(model, fullgraph=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (compiles, autotunes)
        for _ in range(2):
            model.zero_grad(set_to_none=False)
            compiled(static_ids, static_labels).backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        static_loss = compiled(static_ids, static_labels)
        static_loss.backward()
    new_ids, new_labels = torch.randint(0, V, (4, 64), device=dev), torch.randint(0, V, (4, 64), device=dev)
    static_ids.copy_(new_ids)
    static_labels.copy_(new_labels)
    for p in model.parameters():
        p.grad.zero_()
    graph.replay()
    replayed = {k: p.grad.clone() for k, p in model.named_parameters()}
    loss, eager = _loss_and_grads(model, new_ids, new_labels)
    torch.testing.assert_close(static_loss, loss, **_tolerance(torch.bfloat16))
    for k in eager:
        torch.testing.assert_close(replayed[k], eager[k], **_tolerance(torch.bfloat16))
