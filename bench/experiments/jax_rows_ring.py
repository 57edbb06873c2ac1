"""JAX cross-entropy "speed" under jit with the rows sharded over every local device: the
device's fp32 grad_weight partial summed by a ring of its own products and sends, against
the library's slabs (`jax_impl.head.Head.summed_row_shares`: each hidden-dimension slab
reduce-scattered as it is formed, one all-gather).

"ring": P steps; at step k a device forms the partial of one of P chunks of the hidden
dimension, adds the running sum it received and sends it on (a collective-permute), so
that each send can overlap the next chunk's product; the last chunk is the device's own,
then rounded and all-gathered (beside grad_input's product). Under an FSDP head "ring" runs
as "ringv". "ringv": the same over chunks of the classes (dz's column slices; what an FSDP
head, whose classes the devices hold, needs: its chunk is then kept, not gathered).
"ringp": "ring" with the rounded chunks passed round the ring by collective-permutes in
place of the all-gather, written into a zero-filled result. "after": the library's slabs
with grad_input's product after the sum (`jax_fsdp_order.reordered`). "firstS":
grad_input's product first, then S slabs, each summed on its own (`first`). (2 x NVIDIA
H200, 2026-11-30; bench/NOTES.md has the entry, bench/results/jax_rows_ring.json the
numbers, jax_rows_traces.txt the kernels.)

  SHAPES HEAD [time|schedule|trace]: HEAD "replicated" or "fsdp".
  time (the default): per variant fwd+bwd ms (`timed`: lone calls, and calls dispatched
    back to back, "pipelined"; 4 interleaved rounds, medians), temporaries per device,
    results bit-equal to the library's, and the same call on one device (device 0, the
    whole head) for the ratio 2-device / (one / P): $OUT/jax_rows_ring_HEAD.json.
  schedule: each variant's scheduled entry computation (its products, kernels and
    collectives in order): $OUT/schedule_HEAD_SHAPE_VARIANT.txt.
  trace: each variant's and the one-device call's GPU kernels from JAX's profiler
    (`trace`): $OUT/trace_HEAD_SHAPE.txt.

VARIANTS=library,after (an environment variable) picks the variants; "library", the
reference of the bit-equality, comes first. The default is every variant of VARIANTS.

Run on GPUs from the repository root:
  OUT=/tmp PYTHONPATH=. [VARIANTS=...] python bench/experiments/jax_rows_ring.py 16384x4096x128256,8192x2304x256000 {replicated,fsdp} [schedule|trace]
"""
import json, os, statistics, sys
import jax, jax.numpy as jnp
from bench.experiments.jax_fsdp_order import bit_equal, call_ms, compiled_with, inputs, reordered
from bench.jax_mesh import back_to_back_ms
from jax_impl import head as H

LIBRARY = H.Head.summed_row_shares


def ring(on_classes, passed=False):
    """Head.summed_row_shares with grad_weight summed by a ring over chunks of the hidden
    dimension (on_classes False) or of the classes (True); with `passed`, the rounded
    chunks are gathered by P - 1 sends round the ring (collective-permutes, no all-gather),
    each written into place."""
    def summed_row_shares(self, dz, x_R, dx_dtype):
        dx_R = self.grad_input_share(dz, self.head_cols(0, self.vocab), dx_dtype)
        axes = self.split_rows.rows
        if self.split_rows.classes_on_rows:
            dz, dx_R = jax.lax.optimization_barrier((dz, dx_R))
        devices, me = jax.lax.psum(1, axes), jax.lax.axis_index(axes)
        classes = 0 if self.vd else 1
        split = classes if on_classes or self.split_rows.classes_on_rows else 1 - classes
        size = (dz.shape[1] if split == classes else x_R.shape[1]) // devices
        perm = [(j, (j + 1) % devices) for j in range(devices)]
        acc = None
        for k in range(devices):
            start = ((me + devices - 1 - k) % devices) * size
            if split == classes:
                part = self.grad_weight_share(jax.lax.dynamic_slice_in_dim(dz, start, size, axis=1), x_R, jnp.float32)
            else:
                part = self.grad_weight_share(dz, jax.lax.dynamic_slice_in_dim(x_R, start, size, axis=1), jnp.float32)
            acc = part if acc is None else part + acc
            if k < devices - 1:
                acc = jax.lax.ppermute(acc, axes, perm)
        mine = acc.astype(self.W.dtype)
        if self.split_rows.classes_on_rows:
            dW = mine
        elif passed:  # a zero-filled result, each chunk written into place as it arrives
            dW = jnp.zeros(self.W.shape, self.W.dtype)
            for k in range(devices):
                dW = jax.lax.dynamic_update_slice_in_dim(dW, mine, ((me + devices - k) % devices) * size, axis=split)
                if k < devices - 1:
                    mine = jax.lax.ppermute(mine, axes, perm)
        else:
            dW = jax.lax.all_gather(mine, axes, axis=split, tiled=True)
        db = None if self.b is None else self.split_rows.summed(dz.astype(jnp.float32).sum(0), self.b.dtype, 0)
        return dW, db, dx_R
    return summed_row_shares


def first(slabs):
    """Head.summed_row_shares with grad_input's product first (an optimization barrier) and
    grad_weight in `slabs` slabs of the hidden dimension, each reduce-scattered, rounded
    and (a replicated head's) all-gathered on its own (`Axes.summed`), the slabs then
    joined: every collective but the last slab's can run beside a grad_weight product, none
    beside grad_input's. Under an FSDP head it is the library's order in `slabs` slabs."""
    def summed_row_shares(self, dz, x_R, dx_dtype):
        dx_R = self.grad_input_share(dz, self.head_cols(0, self.vocab), dx_dtype)
        dz, dx_R = jax.lax.optimization_barrier((dz, dx_R))
        wide, hidden, classes = H._wide(dz), x_R.shape[1], 0 if self.vd else 1
        edges = [hidden * k // slabs for k in range(slabs + 1)]
        dW = jnp.concatenate([self.split_rows.summed(self.grad_weight_share(dz, x_R[:, a:e], wide), self.W.dtype, classes)
                              for a, e in zip(edges, edges[1:])], axis=1 - classes)
        db = None if self.b is None else self.split_rows.summed(dz.astype(wide).sum(0), self.b.dtype, 0)
        return dW, db, dx_R
    return summed_row_shares


VARIANTS = {"library": LIBRARY, "ring": ring(False), "ringv": ring(True), "after": reordered("after"),
            "ringp": ring(False, passed=True), "first2": first(2), "first4": first(4), "first8": first(8)}


def compiled(variant, *args):
    return compiled_with(VARIANTS[variant], *args)


def timed(fns, args, rounds=4):
    """Per variant: 5 lone calls, each waited for ("call"), and 5 batches of 10 calls
    dispatched back to back ("pipelined", `bench.jax_mesh.back_to_back_ms`), ms per call;
    `rounds` rounds, the variants interleaved."""
    times = {k: {"call": [], "pipelined": []} for k in fns}
    for _ in range(rounds):
        for k, c in fns.items():
            times[k]["call"] += call_ms(c, args[k])
            times[k]["pipelined"] += back_to_back_ms(c, args[k], 5)
    return times


def schedule(c):
    """The compiled program's entry computation in its scheduled order, without the
    instructions that move no data (parameters, tuples, bitcasts, constants)."""
    text = c.as_text()
    entry = text[text.index("\nENTRY "):]
    skip = ("parameter(", "get-tuple-element(", "tuple(", "bitcast(", "constant(")
    return [line.strip()[:160] for line in entry.splitlines()[1:]
            if "=" in line and not any(f" {k}" in line for k in skip)]


def trace(fns, args, path):
    """The GPU kernels of 3 calls of each program dispatched back to back, from JAX's
    profiler: per device and stream, each kernel of at least 20 us (start from the device's
    first kernel, duration; ms) to `path`."""
    import glob, tempfile
    from jax.profiler import ProfileData
    lines = []
    for k, c in fns.items():
        jax.block_until_ready(c(*args[k]))
        d = tempfile.mkdtemp()
        with jax.profiler.trace(d):
            jax.block_until_ready([c(*args[k]) for _ in range(3)])
        data = ProfileData.from_file(glob.glob(d + "/**/*.xplane.pb", recursive=True)[0])
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            streams = [(line.name, sorted((e.start_ns, e.duration_ns, e.name) for e in line.events)) for line in plane.lines]
            t0 = min((events[0][0] for _, events in streams if events), default=0)
            for name, events in streams:
                if not events:
                    continue
                lines.append(f"== {k} {plane.name} {name}: {len(events)} events")
                lines += [f"{(t - t0) / 1e6:9.3f} {dt / 1e6:8.3f} {kernel[:90]}" for t, dt, kernel in events if dt >= 20e3]
    with open(path, "w") as fh:
        fh.write("\n".join(lines))


def main(shapes, head, mode="time"):
    devices = jax.device_count()
    res = {"device": jax.devices()[0].device_kind, "devices": devices, "jax": jax.__version__, "head": head}
    for shape in shapes.split(","):
        _, whole, sharded = inputs(shape, fsdp=head == "fsdp")
        one = tuple(jax.device_put(a, jax.devices()[0]) for a in whole)
        chosen = os.environ.get("VARIANTS", ",".join(VARIANTS)).split(",")  # "library" first
        fns = {k: compiled(k, *sharded) for k in chosen}
        if mode == "schedule":
            for k, c in fns.items():
                with open(os.path.join(os.environ.get("OUT", "/tmp"), f"schedule_{head}_{shape}_{k}.txt"), "w") as fh:
                    fh.write("\n".join(schedule(c)))
            continue
        fns["one"] = compiled("library", *one)
        args = {k: (one if k == "one" else sharded) for k in fns}
        if mode == "trace":
            trace(fns, args, os.path.join(os.environ.get("OUT", "/tmp"), f"trace_{head}_{shape}.txt"))
            continue
        out = {k: c(*args[k]) for k, c in fns.items()}
        times = timed(fns, args)
        res[shape] = {}
        for how in ("call", "pipelined"):
            one_ms = statistics.median(times["one"][how])
            res[shape][how] = {"one_device_ms": round(one_ms, 2)}
            for k in chosen:
                ms = statistics.median(times[k][how])
                res[shape][how][k] = {"ms": round(ms, 2), "x_one_over_P": round(ms / (one_ms / devices), 3),
                                      "ms_rounds": [round(t, 2) for t in times[k][how]]}
        for k in chosen:
            res[shape][k] = {"temp_GB": round(fns[k].memory_analysis().temp_size_in_bytes / 1e9, 3),
                             "bit_equal": bit_equal(out["library"], out[k])}
        del out
        print(shape, json.dumps({how: {k: v["ms"] if isinstance(v, dict) else v for k, v in res[shape][how].items()}
                                 for how in ("call", "pipelined")}), json.dumps({k: res[shape][k] for k in chosen}),
              flush=True)
        del fns, sharded, one
    if mode == "time":
        with open(os.path.join(os.environ.get("OUT", "/tmp"), f"jax_rows_ring_{head}.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
