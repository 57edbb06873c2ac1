"""Test inputs, dtype tolerances, and one adapter per framework, so each test runs on both.

`Problem` holds numpy arrays already rounded to the test dtype, so the float64 reference
sees exactly the values the implementation sees. An adapter runs its framework's
`linear_cross_entropy` on a Problem, with a strategy and an `interop.tuning.Tuning`, and
returns loss, lse and gradients as float64 numpy. The Tuning values the test modules share
(blocks small enough that these tests' small problems span several of them) are defined
here too.
"""

from __future__ import annotations

import dataclasses
import zlib

import ml_dtypes
import numpy as np

from interop.reference import linear_cross_entropy_reference
from interop.tuning import DEFAULT, Tuning

DTYPES = ("bfloat16", "float16", "float32")

# (options, problem keyword arguments, whether the lse output gets a gradient)
CASES = {
    "mean": (dict(), dict(), False),
    "sum-bias": (dict(reduction="sum"), dict(bias=True), False),
    "none-classweights": (dict(reduction="none"), dict(class_weights=True), False),
    "smoothing-classweights": (dict(label_smoothing=0.1), dict(class_weights=True), False),
    "zloss-softcap-bias": (dict(z_loss=1e-2, softcap=4.0), dict(bias=True, logit_scale=3.0), False),
    "everything-none-lse": (
        dict(reduction="none", label_smoothing=0.2, z_loss=1e-3, softcap=4.0),
        dict(bias=True, class_weights=True, logit_scale=3.0), True,
    ),
    "custom-ignore-index": (dict(ignore_index=3), dict(ignore_index=3, class_weights=True), False),
    "3d-lse-sum": (dict(reduction="sum", label_smoothing=0.05), dict(lead=(2, 7)), True),
}

_NUMPY_DTYPE = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32, "float64": np.float64}

# Blocks of 4 rows at the CPU tests' sizes, mostly N x D x V = 13 x 19 x 53 (the defaults would
# use one block): "chunked" in chunks of ceil(N D / V) rows (5 here), "speed" in blocks of 4
# whole rows, "memory" in blocks of 4 rows x 8 to 12 columns (JAX's: 4 rows x 53 columns).
SMALL_BLOCKS = Tuning(min_chunk_rows=1, min_block=4, min_memory_block=(4, 4), speed_block_elements=5 * 53,
                      speed_min_rows=1, one_speed_block_share=0, whole_row_head_bytes=0)
# SMALL_BLOCKS, and an fp32 grad_weight of a 16-bit W in two slabs; JAX's "memory" in blocks of
# 4 rows x 8 columns (XLA's GEMM workspace and per-row temporaries not counted).
SMALL = dataclasses.replace(SMALL_BLOCKS, weight_grad_slab_bytes=1, slab_align=1,
                            xla_memory_cols=8, xla_gemm_workspace=0, xla_row_bytes=0)
# SMALL with "memory" in blocks of whole rows at 13 x 19 x 53: a scratch of 4.5 rows of 53 logits
# (238 elements) after grad_input, blocks of 6, 5 and 2 of 13 rows (4 without grad_input; in
# JAX, whose XLA workspace and per-row temporaries are left out, 2: it counts 2 D values a row
# beside the logits, 238 // (53 + 2 * 19), and takes blocks thinner than Tuning.min_last_rows;
# a whole-row block costs no more than its products in its plan estimate, so both dtypes take
# them).
WHOLE_ROW_MEMORY = dataclasses.replace(SMALL, min_whole_rows=1, whole_row_align=1, min_last_rows=1,
                                       plan_row_block_seconds=0.0,
                                       whole_row_fraction=4.5 * 53 / ((13 + 53) * 19))
# The GPU tests' medium shapes (1000 x 257 x 5003) in several row and column blocks: these
# fields of a Tuning ...
MEDIUM_BLOCK_FIELDS = dict(min_block=64, min_memory_block=(64, 64), speed_block_elements=300 * 5003, memory_fraction=0.01,
                           speed_min_rows=1, one_speed_block_share=0, whole_row_head_bytes=0)
# ... and with them an fp32 grad_weight in two slabs along W's first dimension, in both layouts
# (a [D, V] W's hidden dimension of 257 is cut at 128 rows).
MEDIUM_BLOCKS = Tuning(**MEDIUM_BLOCK_FIELDS, weight_grad_slab_bytes=1 << 16, slab_align=64)
# Bytes the CUDA memory tests allow beyond their bounds: large allocations are rounded up to
# 2 MiB; cuBLAS's workspace (32 MiB on Hopper).
ALLOCATOR_SLACK = 64 << 20


def device() -> str:
    """Where PyTorch's kernels run: CUDA where there is a GPU, else the CPU (Triton's interpreter)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def tolerance(dtype: str, logit_scale: float = 1.0) -> float:
    """Bound on ||got - ref|| / ||ref|| for outputs of a `dtype` computation.

    Two machine epsilons for 16-bit inputs, times twice the logits' scale when it exceeds
    1: the logits are rounded once to the input dtype (as eager's are), an absolute error
    of |z| * eps / 2 (|z| up to about 4 standard deviations) that p = exp(s - lse) turns
    into a relative one. fp16 adds two more: its normal range ends at 6.1e-5, so dz of a
    "mean" over ~1000 rows (p / 1000) is mostly subnormal, quantised to 6e-8 (about one
    eps of grad_input when simulated in float64 with only that rounding), and cuBLAS may
    reduce fp16 partial sums in fp16 (torch's default). 128 epsilons for fp32, whose error
    grows with the sums over D and V.
    """
    eps = float(ml_dtypes.finfo(_NUMPY_DTYPE[dtype]).eps)
    scale = 2 * logit_scale if logit_scale > 1 else 1.0
    return {"float32": 128 * eps, "float64": 1e6 * eps, "float16": (2 * scale + 2) * eps}.get(dtype, 2 * eps * scale)


def seed_of(*parts) -> int:
    """A seed from a test's parameters, the same in every process (unlike hash(), which
    Python salts per process)."""
    return zlib.crc32(repr(parts).encode()) % 2**31


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| in float64 (NaN if either holds NaN where the other doesn't)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise AssertionError(f"shape {got.shape} != reference shape {ref.shape}")
    if not np.array_equal(np.isnan(got), np.isnan(ref)):
        return float("nan")
    got, ref = np.nan_to_num(got), np.nan_to_num(ref)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def check_against_reference(result, ref, dtype, logit_scale=1.0, keys=("loss", "lse", "grad_x", "grad_W", "grad_b")):
    """Each output of `result` (an adapter's) within `tolerance` of the reference's."""
    ref_of = {"loss": ref.loss, "lse": ref.lse, "grad_x": ref.grad_input, "grad_W": ref.grad_weight, "grad_b": ref.grad_bias}
    tol = tolerance(dtype, logit_scale)
    for key in keys:
        if key not in result:
            continue
        err = rel_err(result[key], ref_of[key])
        assert err <= tol, f"{key}: relative error {err:.3g} > {tol:.3g} ({dtype})"


@dataclasses.dataclass
class Problem:
    """One call's inputs as numpy arrays holding values exact in `dtype`."""

    x: np.ndarray  # [..., D]
    W: np.ndarray  # [V, D] or [D, V]
    y: np.ndarray  # [...] int64
    b: np.ndarray | None
    cw: np.ndarray | None
    dtype: str
    weight_layout: str = "VD"
    logit_scale: float = 1.0

    @property
    def vocab(self) -> int:
        return self.W.shape[0] if self.weight_layout == "VD" else self.W.shape[1]


LAYOUTS = ("strided", "transposed", "expanded", "column", "offset")


def laid_out(t, layout: str):
    """A torch view of t's shape in `layout` (LAYOUTS) holding t's values, except "expanded":
    t's first entry along the last dim repeated with stride 0 (a matrix's rows still differ)."""
    if layout == "expanded":
        return t[..., :1].expand(t.shape)
    if layout == "strided":  # every other row of a larger buffer
        big = t.new_zeros((2 * t.shape[0],) + t.shape[1:])
        big[::2] = t
        return big[::2]
    if layout == "transposed":  # column-major (a 1-D tensor: a row of a column-major matrix)
        if t.ndim == 1:
            m = t.new_zeros(t.shape[0], 3).T
            m[1] = t
            return m[1]
        return t.mT.contiguous().mT
    if layout == "column":  # a slice of the last dim at an offset
        if t.ndim == 1:
            wide = t.new_zeros(t.shape[0], 3)
            wide[:, 1] = t
            return wide[:, 1]
        wide = t.new_zeros(t.shape[:-1] + (t.shape[-1] + 5,))
        wide[..., 3 : 3 + t.shape[-1]] = t
        return wide[..., 3 : 3 + t.shape[-1]]
    assert layout == "offset", layout  # an unaligned storage offset
    flat = t.new_zeros(t.numel() + 7)
    flat[7:] = t.reshape(-1)
    return flat[7:].view(t.shape)


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """Round to `dtype` and back to float32 (float64 for float64)."""
    out = np.float64 if dtype == "float64" else np.float32
    return np.asarray(a).astype(_NUMPY_DTYPE[dtype]).astype(out)


def make_problem(
    seed: int,
    lead=(13,),
    hidden: int = 19,
    vocab: int = 53,
    dtype: str = "float32",
    *,
    bias: bool = False,
    class_weights: bool = False,
    weight_layout: str = "VD",
    ignore_frac: float = 0.2,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
) -> Problem:
    """Random inputs with logits of standard deviation about `logit_scale`."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(tuple(lead) + (hidden,)) * logit_scale
    W = rng.standard_normal((vocab, hidden)) / np.sqrt(hidden)
    y = rng.integers(0, vocab, size=tuple(lead))
    y[rng.random(tuple(lead)) < ignore_frac] = ignore_index
    b = rng.standard_normal(vocab) * 0.5 if bias else None
    cw = rng.uniform(0.2, 2.0, vocab) if class_weights else None
    return Problem(
        x=round_to(x, dtype),
        W=round_to(W if weight_layout == "VD" else W.T, dtype),
        y=y,
        b=None if b is None else round_to(b, dtype),
        cw=None if cw is None else cw.astype(np.float32),
        dtype=dtype,
        weight_layout=weight_layout,
        logit_scale=logit_scale,
    )


def upstream_grads(seed: int, problem: Problem, reduction: str, with_lse: bool):
    """Random upstream gradients: (grad_output scalar or [...], grad_lse [...] or None)."""
    rng = np.random.default_rng(seed + 1000)
    lead = problem.y.shape
    g_out = rng.standard_normal(lead) if reduction == "none" else np.asarray(rng.uniform(0.5, 2.0))
    g_lse = rng.standard_normal(lead) if with_lse else None
    return g_out, g_lse


def reference(problem: Problem, options: dict, grad_output, grad_lse):
    return linear_cross_entropy_reference(
        problem.x, problem.W, problem.y, linear_bias=problem.b, weight=problem.cw,
        weight_layout=problem.weight_layout, grad_output=grad_output, grad_lse=grad_lse, **options,
    )


def torch_outputs(loss, lse, leaves: dict, grad_output, grad_lse) -> dict:
    """{"loss", "lse" (unless None), "grad_<k>" for each leaf k not None} as float64 numpy:
    the gradients of `leaves` ({"x": tensor, "W": ..., "b": ... or None}) for the upstream
    gradients grad_output of loss and, unless None, grad_lse of lse (numpy or float)."""
    import torch

    outs, grads_in = [loss], [torch.as_tensor(np.asarray(grad_output), dtype=loss.dtype, device=loss.device)]
    if grad_lse is not None and lse is not None:
        outs.append(lse)
        grads_in.append(torch.as_tensor(np.asarray(grad_lse), dtype=lse.dtype, device=lse.device))
    need = {k: t for k, t in leaves.items() if t is not None}
    grads = torch.autograd.grad(outs, list(need.values()), grads_in)
    for (k, t), g in zip(need.items(), grads):
        assert g.dtype == t.dtype, f"grad_{k} has dtype {g.dtype}, input {t.dtype}"
    result = {"loss": loss} if lse is None else {"loss": loss, "lse": lse}
    result.update({f"grad_{k}": g for k, g in zip(need, grads)})
    return {k: v.detach().double().cpu().numpy() for k, v in result.items()}


class TorchAdapter:
    """`torch_impl.linear_cross_entropy` with a given strategy and tuning, on a given device."""

    def __init__(self, strategy: str = "auto", device: str = "cpu", tuning: Tuning = DEFAULT):
        import torch

        import torch_impl

        self.torch, self.impl = torch, torch_impl
        self.name, self.strategy, self.device, self.tuning = f"torch-{strategy}", strategy, device, tuning
        self.dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}

    def tensor(self, a, dtype: str | None = None, requires_grad: bool = False):
        t = self.torch.as_tensor(np.array(a)).to(self.device)
        if dtype is not None:
            t = t.to(self.dtypes[dtype])
        return t.requires_grad_(requires_grad)

    def call(self, x, W, y, **kwargs):
        """The public call on numpy inputs (floating arrays kept in their numpy dtype)."""
        conv = lambda a: None if a is None else self.tensor(a)
        for k in ("linear_bias", "weight"):
            kwargs[k] = conv(kwargs.get(k))
        return self.impl.linear_cross_entropy(conv(x), conv(W), conv(y), strategy=self.strategy, tuning=self.tuning,
                                              **kwargs)

    def run(self, p: Problem, options: dict, grad_output, grad_lse, wrt=("x", "W", "b"), target_dtype="int64", return_lse=None,
            layouts=None):
        """Loss, lse (when returned) and the gradients wrt `wrt`, as float64 numpy arrays.

        return_lse defaults to whether grad_lse is given (a returned lse stops "speed" from
        computing the gradients in the forward pass, so both paths get tested). layouts:
        {"x" | "W" | "b" | "cw" | "y": a layout of `laid_out`}, views holding the same values."""
        return_lse = grad_lse is not None if return_lse is None else return_lse
        lay = lambda k, t: t if t is None or not layouts or k not in layouts else laid_out(t.detach(), layouts[k])
        tensors = {
            "x": lay("x", self.tensor(p.x, p.dtype)).requires_grad_("x" in wrt),
            "W": lay("W", self.tensor(p.W, p.dtype)).requires_grad_("W" in wrt),
            "b": None if p.b is None else lay("b", self.tensor(p.b, p.dtype)).requires_grad_("b" in wrt),
        }
        cw = None if p.cw is None else lay("cw", self.tensor(p.cw))
        y = lay("y", self.tensor(p.y.astype(target_dtype)))
        out = self.impl.linear_cross_entropy(
            tensors["x"], tensors["W"], y, linear_bias=tensors["b"], weight=cw, weight_layout=p.weight_layout,
            return_lse=return_lse, strategy=self.strategy, tuning=self.tuning, **options,
        )
        loss, lse = out if return_lse else (out, None)
        need = {k: t for k, t in tensors.items() if t is not None and t.requires_grad}
        return torch_outputs(loss, lse, need, grad_output, grad_lse)

class JaxAdapter:
    """`jax_impl.linear_cross_entropy` with a given strategy and tuning."""

    def __init__(self, strategy: str = "auto", tuning: Tuning = DEFAULT):
        import jax
        import jax.numpy as jnp

        import jax_impl

        self.jax, self.jnp, self.impl = jax, jnp, jax_impl
        self.name, self.strategy, self.tuning = f"jax-{strategy}", strategy, tuning

    def array(self, a, dtype: str | None = None):
        return self.jnp.asarray(a, dtype=None if dtype is None else _NUMPY_DTYPE[dtype])

    def call(self, x, W, y, **kwargs):
        """The public call on numpy inputs (floating arrays kept in their numpy dtype)."""
        for k in ("linear_bias", "weight"):
            if kwargs.get(k) is not None:
                kwargs[k] = self.jnp.asarray(kwargs[k])
        return self.impl.linear_cross_entropy(
            self.jnp.asarray(x), self.jnp.asarray(W), self.jnp.asarray(y), strategy=self.strategy, tuning=self.tuning,
            **kwargs,
        )

    def run(self, p: Problem, options: dict, grad_output, grad_lse, wrt=("x", "W", "b"), target_dtype="int32", jit=True, return_lse=None):
        """As TorchAdapter.run (return_lse defaults to whether grad_lse is given: without a
        returned lse, "speed" forms the gradients in the custom_vjp's forward rule)."""
        jnp = self.jnp
        return_lse = grad_lse is not None if return_lse is None else return_lse
        arrays = {"x": self.array(p.x, p.dtype), "W": self.array(p.W, p.dtype),
                  "b": None if p.b is None else self.array(p.b, p.dtype)}
        need = [k for k in wrt if arrays[k] is not None]
        fixed = {k: v for k, v in arrays.items() if k not in need}
        cw = None if p.cw is None else jnp.asarray(p.cw)
        y = jnp.asarray(p.y.astype(target_dtype))

        def loss_and_vjp(diff, y, g_out, g_lse):
            def f(diff):
                a = {**fixed, **diff}
                out = self.impl.linear_cross_entropy(
                    a["x"], a["W"], y, linear_bias=a["b"], weight=cw, weight_layout=p.weight_layout,
                    return_lse=return_lse, strategy=self.strategy, tuning=self.tuning, **options,
                )
                return out if return_lse else (out, None)

            (loss, lse), vjp = self.jax.vjp(f, diff)
            (grads,) = vjp((g_out.astype(loss.dtype), None if lse is None else g_lse.astype(lse.dtype)))
            return loss, lse, grads

        run = self.jax.jit(loss_and_vjp) if jit else loss_and_vjp
        g_lse = np.zeros(p.y.shape) if grad_lse is None else grad_lse
        loss, lse, grads = run({k: arrays[k] for k in need}, y, jnp.asarray(grad_output, jnp.float32), jnp.asarray(g_lse, jnp.float32))
        for k in need:
            assert grads[k].dtype == arrays[k].dtype, f"grad_{k} has dtype {grads[k].dtype}, input {arrays[k].dtype}"
        result = {"loss": loss, **({} if lse is None else {"lse": lse}), **{f"grad_{k}": g for k, g in grads.items()}}
        return {k: np.asarray(v.astype(jnp.float32), np.float64) for k, v in result.items()}


def cpu_implementations(tuning: Tuning = DEFAULT) -> dict:
    """Every implementation that runs on this machine, by name (kernels in interpret mode),
    each with `tuning`."""
    adapters = [cls(s, tuning=tuning) for cls in (TorchAdapter, JaxAdapter) for s in ("chunked", "speed", "memory")]
    return {a.name: a for a in adapters}


def materialised_policy(p, options: dict):
    """The policy of problem p ([V, D] head) on its materialised float64 logits, with autograd:
    (leaves [x, W, and b if any], u = softcap(z) / T, log p(target) (0 where ignored), the
    entropy, valid [...]); options: linear_log_probs' temperature, softcap, ignore_index."""
    import torch

    x, W = torch.tensor(p.x, requires_grad=True), torch.tensor(p.W, requires_grad=True)
    b = None if p.b is None else torch.tensor(p.b, requires_grad=True)
    z = x @ W.T + (0 if b is None else b)
    cap, T = options.get("softcap"), options.get("temperature", 1.0)
    u = (z if cap is None else cap * torch.tanh(z / cap)) / T
    logp_all = torch.log_softmax(u, -1)
    y = torch.tensor(p.y)
    valid = y != options.get("ignore_index", -100)
    logp = torch.where(valid, logp_all.gather(-1, torch.where(valid, y, 0)[..., None])[..., 0], 0.0)
    return [t for t in (x, W, b) if t is not None], u, logp, -(logp_all.exp() * logp_all).sum(-1), valid


# The start of a script that checks logits kept between a jitted loss's passes under a mesh
# (run in a process of its own, after a line setting N, D, V): `spent` collects the shapes
# of the logits each backward pass reads; x [N, D], W [V, D] and y [N] (one ignored row) in
# fp32, two upstream gradients g_a and g_b [N], top-K ids [N, 4] and the teacher's log-probs.
KEPT_LOGITS_PRELUDE = r"""
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_impl, jax_impl.engine as engine

spent = []
backward = engine.backward_kept
engine.backward_kept = lambda *a, **k: spent.append(a[3].shape) or backward(*a, **k)
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
W = jnp.asarray(rng.standard_normal((V, D)) * 0.5, jnp.float32)
y = jnp.asarray(rng.integers(0, V, N), jnp.int32).at[3].set(-100)
g_a, g_b = (jnp.asarray(rng.standard_normal(N), jnp.float32) for _ in range(2))
ids = jnp.asarray(np.stack([rng.permutation(V)[:4] for _ in range(N)]), jnp.int32)
teacher = jax.nn.log_softmax(jnp.asarray(rng.standard_normal((N, 4)), jnp.float32))
"""
