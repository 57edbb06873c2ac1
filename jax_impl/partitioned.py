"""Every loss under `jax.jit` with sharded operands: one `custom_partitioning` for all.

XLA's partitioner cannot split a Pallas kernel (a custom call) by itself: left alone it
would gather every operand of a loss onto every device, and every device would repeat all
the work. A loss therefore runs its passes through `run`, naming each operand's and
output's dimensions by factors (`Layout`: "n" the rows, "v" the classes, any other letter a
dimension never split), and the partitioner is told:

- rows: each device computes the rows it holds (the sharding of the first row operand's
  rows, when the number of rows divides evenly); row operands and row outputs keep it.
  Outputs without rows are each device's partial sums, summed over those axes by
  `Axes.summed`: a reduced loss here, after the body; outputs with classes (grad_weight,
  grad_bias) by the body itself, as it forms them (`jax_impl.head.Head.split_rows`), so that
  the sums overlap its products. Where the head's classes are sharded over those axes
  (FSDP), those outputs are reduce-scattered to the head's sharding, never gathered.
- classes: a head sharded on its vocabulary dimension over one mesh axis that the rows do
  not use (and that divides V evenly) is split there, with every operand of its classes
  ("v", or "u" for another head's; a replicated one is sliced where it lies), where the
  loss can split its head (`Layout.split_vocab`): the pass runs with that axis as its
  `vocab_parallel` axis, combining per-row statistics over it, never logits; outputs with classes keep the head's
  sharding, the others are the same on every device of the axis.
- anything else is gathered as XLA gathers a matrix product's operand: the hidden
  dimension, a head sharded over the rows' axes (FSDP), class weights. Activations never.

A pass is `body(static, axes, *operands) -> tuple of outputs` (None for an absent operand
or output), `axes` an `Axes`: the single-device code, which plans its blocks for the local
shapes it is given. On one device, inside `jax.shard_map` (the caller's own axis) and under
`jax.vmap` (`custom_vmap`), the body runs unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Hashable

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_impl.kernels import no_derivative
from jax_impl.rows import compute_dtype


@dataclasses.dataclass(frozen=True)
class Axes:
    """The mesh axes a pass runs over: `rows`, those splitting its rows (the pass sums what
    needs every row, a mean's denominator, over them); `vocab`, the axis splitting its head
    over the vocabulary (its `vocab_parallel` axis), or None; `classes_on_rows`: the head's
    classes are sharded over the rows' axes (an FSDP-sharded head, gathered for the
    products): outputs with classes are then each device's slice of them."""

    rows: tuple = ()
    vocab: str | None = None
    classes_on_rows: bool = False

    def summed(self, g, dtype, classes: int | None = None):
        """g, a device's partial sum over its share of the rows (in its accumulator's dtype:
        grad_weight and grad_bias unrounded), summed over the rows' axes in fp32 (fp64 for
        fp64), then rounded to dtype. With `classes_on_rows`, an output's dimension of
        classes (`classes`) is reduce-scattered, and the device keeps its slice. Otherwise
        a result with a dimension the devices divide is reduce-scattered over it in fp32,
        rounded, then all-gathered in its own dtype: the same numbers as an fp32
        all-reduce, with 3/4 of its traffic for a 16-bit result where the backend gathers
        in that dtype (a ring all-reduce is a reduce-scatter and an all-gather, both in
        fp32; XLA's CPU backend gathers 16-bit slices as fp32). Slabs formed one after the
        other take `summed_slabs`."""
        wide, devices = compute_dtype(dtype), jax.lax.psum(1, self.rows)
        if self.classes_on_rows and classes is not None:
            return jax.lax.psum_scatter(g.astype(wide), self.rows, scatter_dimension=classes, tiled=True).astype(dtype)
        dim = next((d for d, n in enumerate(g.shape) if n % devices == 0), None)
        if dim is None:
            return jax.lax.psum(g.astype(wide), self.rows).astype(dtype)
        mine = jax.lax.psum_scatter(g.astype(wide), self.rows, scatter_dimension=dim, tiled=True)
        return jax.lax.all_gather(mine.astype(dtype), self.rows, axis=dim, tiled=True)

    def summed_slabs(self, slabs, dtype, classes: int):
        """`summed` of a partial formed in slabs (a list of arrays, to be joined along the
        dimension other than `classes`), each slab reduce-scattered over its classes as soon
        as it is formed, so that its sum overlaps the next slab's product. The device's
        rounded slices are joined (the rounding writes them in place) and gathered once:
        one all-gather, and no copy of the whole result to join gathered slabs. (Not one
        all-reduce per slab: XLA merges those into one after the last slab, for fp32 results
        too.) Where the devices do not divide the classes, each slab is `summed` on its own."""
        wide, devices, join = compute_dtype(dtype), jax.lax.psum(1, self.rows), 1 - classes
        if slabs[0].shape[classes] % devices:
            return jax.numpy.concatenate([self.summed(g, dtype, classes) for g in slabs], axis=join)
        mine = jax.numpy.concatenate(
            [jax.lax.psum_scatter(g.astype(wide), self.rows, scatter_dimension=classes, tiled=True).astype(dtype)
             for g in slabs], axis=join)
        return mine if self.classes_on_rows else jax.lax.all_gather(mine, self.rows, axis=classes, tiled=True)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Each operand's and output's dimensions as factors, e.g. ("n d", "v d", "v", "n") for
    x [N, D], W [V, D], b [V], y [N] and ("", "n d", "v d") for a reduced loss, dx and dW:
    "n" the rows, "v" the classes, "u" another head's classes (a dense teacher's), placed as
    "v" is but a factor of its own for the partitioner's propagation (so that its sharding
    never decides the student's outputs'), "" a scalar, other letters never split. An
    operand or output that is None has the entry None. split_vocab: whether the pass can
    take a head split over the vocabulary (else such a head is gathered, "u" too)."""

    operands: tuple
    outputs: tuple
    split_vocab: bool = True


@dataclasses.dataclass(frozen=True)
class _Pass:
    """The static part of one partitioned pass (hashable: a static argument)."""

    body: Callable
    static: Hashable
    layout: Layout

    def __call__(self, axes: Axes, *arrays):
        """The body on the present operands, giving its present outputs."""
        given = iter(arrays)
        operands = [None if spec is None else next(given) for spec in self.layout.operands]
        outs = self.body(self.static, axes, *operands)
        return tuple(o for o, spec in zip(outs, self.layout.outputs) if spec is not None)


def run(body, static, layout: Layout, *operands, axis: str | None = None, whole: bool = False):
    """body(static, Axes(vocab=axis), *operands) over the whole operands; under jit, split
    over the devices of sharded operands as the module says. axis: the caller's own
    shard_map axis splitting the head (the body then runs as it is, inside shard_map).
    whole: run the body as it is anywhere (jax.numpy passes, which XLA partitions itself
    and which stay differentiable twice; a partitioned pass is not differentiable)."""
    if len(operands) != len(layout.operands):
        raise ValueError(f"a pass of {len(layout.operands)} operands called with {len(operands)}")
    if axis is not None or whole:
        return body(static, Axes(vocab=axis), *operands)
    layout = dataclasses.replace(layout, operands=tuple(None if a is None else spec
                                                        for a, spec in zip(operands, layout.operands)))
    job = _Pass(body, static, layout)
    arrays = tuple(a for a in operands if a is not None)
    outs = iter(_with_vmap(len(arrays), job)(*arrays))
    return tuple(None if spec is None else next(outs) for spec in layout.outputs)


def _batched(job: _Pass, axis_size, in_batched, *arrays):
    """A custom_vmap rule: the single-device body under jax.vmap (custom_partitioning has no
    batching rule of its own)."""
    outs = jax.vmap(functools.partial(job, Axes()), in_axes=tuple(0 if b else None for b in in_batched))(*arrays)
    return outs, jax.tree.map(lambda _: True, outs)


@functools.cache
def _with_vmap(n_arrays: int, job: _Pass):
    """The partitioned pass over n_arrays operands, batched by jax.vmap as the body is and
    refusing derivatives as the kernels inside it do (`kernels.no_derivative`); one function
    per pass (cached), so that JAX's caches of traced functions hit across calls."""
    fn = custom_vmap(lambda *arrays: _partitioned(n_arrays)(*arrays, job))
    fn.def_vmap(functools.partial(_batched, job))
    fn = jax.custom_jvp(fn)
    fn.defjvp(no_derivative)
    return fn


def _body(*args):
    *arrays, job = args
    return job(Axes(), *arrays)


@functools.cache
def _partitioned(n_arrays: int):
    """The custom_partitioning function of passes over n_arrays operands (the pass static)."""
    fn = custom_partitioning(_body, static_argnums=(n_arrays,))
    fn.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule)
    return fn


def _factors(layout: Layout):
    """The present operands' and outputs' factor strings."""
    return [s for s in layout.operands if s is not None], [s for s in layout.outputs if s is not None]


def _axes(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _split(job: _Pass, mesh, arg_shapes) -> Axes:
    """The Axes of a pass from its operands' shardings: the rows of the first operand of
    rows and another dimension (the input, whose sharding is the caller's; an upstream
    gradient's can be anything), the classes of the first head (an operand with classes
    and another dimension). Logits kept between the passes ("n v") are neither: their
    sharding is the pass's own output's."""
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    specs, _ = _factors(job.layout)
    spec_of = lambda a: tuple(getattr(a.sharding, "spec", ()) or ())
    rows, vocab, classes_on_rows = (), None, False
    given = [(a, s.split()) for a, s in zip(arg_shapes, specs) if not {"n", "v"} <= set(s.split())]
    x = next(((a, f) for a, f in given if f[:1] == ["n"] and len(f) > 1), None)
    if x is None:
        raise ValueError(f"a partitioned pass needs an operand of rows and another dimension, got {specs}")
    entries = spec_of(x[0])
    if entries:
        rows = _axes(entries[0])
        if rows and x[0].shape[0] % size(rows):
            rows = ()  # uneven rows would be padded: compute every row everywhere instead
    head = next(((a, f) for a, f in given if "v" in f and len(f) > 1), None)
    if head is not None:
        dim = head[1].index("v")
        entries = spec_of(head[0])
        v_axes = _axes(entries[dim]) if len(entries) > dim else ()
        even = bool(v_axes) and size(v_axes) > 1 and head[0].shape[dim] % size(v_axes) == 0
        if job.layout.split_vocab and len(v_axes) == 1 and v_axes[0] not in rows and even:
            vocab = v_axes[0]
        classes_on_rows = bool(rows) and v_axes == rows and even
    return Axes(rows, vocab, classes_on_rows)


def _spec(factors: str, axes: Axes, output: bool = False) -> P:
    """The PartitionSpec of one operand or output (an output's classes on the rows' axes
    where the head's are, `Axes.classes_on_rows`, unless it has rows too: logits, whose
    rows are the device's and classes the gathered head's)."""
    rows = axes.rows if len(axes.rows) != 1 else axes.rows[0]
    by_class = output and axes.classes_on_rows and "n" not in factors.split()
    place = {"n": rows or None, "v": rows if by_class else axes.vocab, "u": axes.vocab}
    return P(*(place.get(f) for f in factors.split()))


def _partition(job: _Pass, mesh, arg_shapes, result_shape):
    axes = _split(job, mesh, arg_shapes)
    specs, out_specs = _factors(job.layout)

    def lower(*arrays):
        outs = job(axes, *arrays)
        if not axes.rows:
            return outs
        return tuple(o if {"n", "v"} & set(s.split()) else axes.summed(o, r.dtype)
                     for o, s, r in zip(outs, out_specs, jax.tree.leaves(result_shape), strict=True))

    named = lambda s, output=False: NamedSharding(mesh, _spec(s, axes, output))
    return mesh, lower, tuple(named(s, True) for s in out_specs), tuple(map(named, specs))


def _infer(job: _Pass, mesh, arg_shapes, result_shape):
    return _partition(job, mesh, arg_shapes, result_shape)[2]


def _rule(job: _Pass, *_):
    # kept logits ("n v") get a class factor of their own ("w"): tied to the head's, the
    # propagation would give them the head's classes' sharding wherever the head is sharded,
    # and a head the pass gathers (sharded over some of the rows' axes, or over more) would
    # have them resharded twice. Left free, with the head split over the vocabulary, they come
    # out replicated (an all-gather, then the backward pass's slice), which XLA's GPU pipeline
    # removes (all-gather-dynamic-slice-simplifier); the CPU's keeps it.
    specs, out_specs = ([" ".join("w" if f == "v" and "n" in s.split() else f for f in s.split()) for s in group]
                        for group in _factors(job.layout))
    split = {"n", "v", "u", "w"} if job.layout.split_vocab else {"n", "w"}
    # in order of first appearance (the rule's factor indices must be sorted)
    kept = tuple(dict.fromkeys(f for s in specs + out_specs for f in s.split() if f not in split))
    return ", ".join(specs) + " -> " + ", ".join(out_specs), ({"need_replication_factors": tuple(kept)} if kept else {})
