"""The losses on JAX's meshes: one device's computation, whatever the mesh says.

- Explicit axes (`jax.make_mesh`'s default since JAX 0.7, made current by `jax.set_mesh`,
  or only named by the operands' NamedShardings): an array's sharding is part of its type,
  and products whose contracted rows are sharded, or the Pallas interpreter's updates of
  its outputs, have no sharding JAX can infer. The loss runs with those axes made Auto
  (`jax.sharding.auto_axes`): XLA's partitioner places the work, the kernels' passes split
  by `jax_impl.partitioned`; its outputs are replicated, or sharded as the input's rows for
  per-row outputs.
- Manual axes (inside `jax.shard_map`, whose default check_vma=True types every value
  with the axes it varies over): the operands are cast to vary over every axis that any of
  them varies over (`vary`), and so are the loops' initial carries, built from constants
  (`rows.row_loop`, `head.Head.col_loop`), and the Pallas kernels' outputs (`struct`),
  so that each loop's carry keeps one type. JAX transposes the cast of an operand that
  did not vary (a replicated head) into the sum of its gradient over those axes. (Pallas'
  interpreter, which the tests run, needs more: `kernels._interpret_varying`.)

Older JAX without these types (no `jax.typeof`, no abstract mesh) takes none of these steps.
"""

from __future__ import annotations

import inspect

import jax
from jax.sharding import PartitionSpec as P

_STRUCT_PARAMETERS = inspect.signature(jax.ShapeDtypeStruct).parameters


def explicit_mesh(*arrays):
    """The mesh whose Explicit axes shard `arrays` (None entries skipped): the current mesh
    (`jax.set_mesh`) where it has Explicit axes, else the one in the operands' types (arrays
    put on a NamedSharding of an Explicit mesh carry it there, with no mesh made current);
    None without one, or on older JAX."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_mesh is None:
        return None
    candidates = [get_mesh()] + [getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
                                 for a in arrays if a is not None]
    return next((m for m in candidates if getattr(m, "explicit_axes", ())), None)


def varying_axes(*arrays) -> frozenset:
    """The Manual mesh axes over which any of `arrays` (None skipped; ShapeDtypeStructs too)
    varies: its type's `manual_axis_type` (JAX 0.10+) or `vma` (earlier); empty outside
    shard_map."""
    axes = frozenset()
    if not hasattr(jax, "typeof"):
        return axes
    for a in arrays:
        if a is None:
            continue
        aval = a if isinstance(a, jax.ShapeDtypeStruct) else jax.typeof(a)
        mat = getattr(aval, "manual_axis_type", None)
        axes |= frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))
    return axes


def vary(tree, axes: frozenset):
    """Every array of `tree` cast to vary over `axes` (those it does not vary over yet)."""
    if not axes:
        return tree
    cast = getattr(jax.lax, "pcast", None)

    def one(a):
        missing = tuple(sorted(axes - varying_axes(a)))
        if not missing:
            return a
        return cast(a, missing, to="varying") if cast else jax.lax.pvary(a, missing)

    return jax.tree.map(one, tree)


def vary_like(tree, *like):
    """`tree` cast to vary over the axes over which any array of `like` varies."""
    return vary(tree, varying_axes(*jax.tree.leaves(like)))


def with_rows_axes(head, x):
    """A head's arrays, split over a shard_map axis, cast to vary also over the axes that split
    the rows x (data parallel beside the head's split): each device's gradient of the head is
    a partial sum over its rows, and JAX's transpose of the cast sums it over those axes (a
    custom_vjp's cotangent is typed as its primal, so the cast comes before the loss's)."""
    return vary_like(head, x, head)


def struct(shape, dtype, axes: frozenset) -> jax.ShapeDtypeStruct:
    """The ShapeDtypeStruct of a Pallas kernel's output varying over `axes`: shard_map's
    check_vma needs it said (pallas_call can't infer it from the operands)."""
    if "manual_axis_type" in _STRUCT_PARAMETERS:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    if "vma" in _STRUCT_PARAMETERS:
        return jax.ShapeDtypeStruct(shape, dtype, vma=axes)
    return jax.ShapeDtypeStruct(shape, dtype)


def row_spec(x) -> P:
    """The PartitionSpec of x's leading dimensions (all but the last) under an explicit mesh."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return P(*(spec + (None,) * (x.ndim - len(spec)))[:-1])


def on_mesh(fn, arrays: tuple, out_specs):
    """fn(*arrays) (None entries allowed) on their mesh: the operands cast to vary over the
    same Manual axes; with Explicit axes (`explicit_mesh`), run with them made Auto, the
    outputs sharded as out_specs() says (a pytree of PartitionSpecs like fn's result, asked
    for only then)."""
    arrays = vary(arrays, varying_axes(*arrays))
    mesh = explicit_mesh(*arrays)
    if mesh is None:
        return fn(*arrays)
    run = lambda: jax.sharding.auto_axes(fn, axes=mesh.explicit_axes, out_sharding=out_specs())(*arrays)
    if getattr(jax.sharding.get_abstract_mesh(), "explicit_axes", ()):
        return run()
    # the operands' mesh made current for the call (auto_axes reads the current one); JAX
    # before 0.7.2 has no way to, and there such operands need `jax.set_mesh`
    use_mesh = getattr(jax.sharding, "use_abstract_mesh", None)
    if use_mesh is None:
        return fn(*arrays)
    with use_mesh(mesh):
        return run()
