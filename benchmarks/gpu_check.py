"""The GPU check of the Triton engine (issue #39): one command, a few minutes on one GPU.

    python benchmarks/gpu_check.py            # on a CUDA machine (no Horovod needed)
    python benchmarks/gpu_check.py --tiny     # everything at small sizes, on CPU, under Triton's
                                              # interpreter (TRITON_INTERPRET=1): what CI runs

Prints, in order:

1. **conformance** on CUDA tensors against the CPU reference (``OpsEngine`` on the NumPy
   backend), bit for bit, step after step, for a few configs and hard gradients: payloads,
   counts, finite flags, the entries sent, float16 counts, u and v; the receive path of the
   bucket (``decode_bucket``: 3 ranks' frames, NaN and the put-back where a segment is
   non-finite) and the per-tensor ``decode``;
2. **time per step** of ResNet-50's sparsified buckets (benchmarks/shapes.py; buckets of 2**22
   elements cut as ``dgc_horovod.core.buckets.plan_buckets`` cuts them) at densities 0.004 and
   0.001: the Triton engine (compress, and compress + decode_bucket of 4 ranks' frames), the
   tensor-op engine (``OpsEngine`` on ``TorchBackend``: compress, split, per-tensor decode), and
   one flat pass (a torch add over the model's 25.6 M elements); CUDA events, median after a
   warm-up, and the host's time to issue a step;
3. **launches and host synchronisations per step**: :class:`DeviceCounter` (Triton launches and
   aten ops; host reads), the CUDA kernels ``torch.profiler`` sees, and the synchronisations
   ``torch.cuda.set_sync_debug_mode("warn")`` reports, for both engines.

4. **a simulated-cluster step** (:class:`dgc_horovod.simulate.SimulatedCluster`, N = 4 workers
   in one process, each with its own DGC state) of a small real CNN on synthetic images, with
   DGC (default options; the Triton engine on CUDA) against dense averaging: wall time per step
   (backward of the 4 workers, compress, exchange, decode, optimizer step), CUDA-synchronised,
   median after a warm-up.

Exit status 1 when a conformance case differs, the Triton path synchronises, a bucket takes
more than 12 launches, or the simulated DGC step does not train. Imports no Horovod.
"""
import argparse
import os
import statistics
import sys
import time
import warnings

if __name__ == "__main__" and "--tiny" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before triton is imported

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from shapes import resnet50  # noqa: E402

from dgc_horovod.backends.torch_backend import TorchBackend  # noqa: E402
from dgc_horovod.core import DGCConfig, wire  # noqa: E402
from dgc_horovod.core.backend import NumpyBackend  # noqa: E402
from dgc_horovod.core.buckets import plan_buckets  # noqa: E402
from dgc_horovod.core.engine import OpsEngine, make_step  # noqa: E402

F32 = np.float32
NB = NumpyBackend()
aten = torch.ops.aten


# ----------------------------------------------------------------------------- counting
class DeviceCounter(TorchDispatchMode):
    """Counts, while active, what needs the device's data on the host (``syncs``) and the
    kernel launches (``launches``), as lists of op names.

    Syncs: ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``), ``nonzero``,
    ``masked_select``, ``unique``, boolean-mask indexing, copies to the CPU from another device,
    and ``Tensor.tolist`` / ``.numpy`` (which bypass the dispatcher). On CPU tensors (Triton's
    interpreter) these are the calls that would wait for the device on CUDA. Launches: every
    Triton kernel launch (its ``run``; the tensor ops the interpreter makes inside are not
    counted) and every aten op that is neither a view nor an allocation."""

    SYNC = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique2,
            aten.unique_dim, aten.unique_consecutive, aten._unique}
    FREE = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty,
            aten.new_empty_strided, aten.detach, aten.lift_fresh, aten.alias}

    def __init__(self):
        super().__init__()
        self.syncs, self.launches = [], []
        self._quiet = 0
        self._saved = []

    def __enter__(self):
        from dgc_horovod.backends import triton_engine
        counter = self

        def wrap(owner, attr, on_call):
            orig = getattr(owner, attr)

            def patched(obj, *args, **kwargs):
                return on_call(orig, obj, *args, **kwargs)
            self._saved.append((owner, attr, orig))
            setattr(owner, attr, patched)

        def host_read(orig, obj, *args, **kwargs):
            if not counter._quiet:
                counter.syncs.append(orig.__name__)
            return orig(obj, *args, **kwargs)

        def launch(orig, kernel, *args, **kwargs):
            counter.launches.append(getattr(kernel, "__name__", "triton kernel"))
            counter._quiet += 1                 # the interpreter's own tensor ops
            try:
                return orig(kernel, *args, **kwargs)
            finally:
                counter._quiet -= 1

        for attr in ("tolist", "numpy"):
            wrap(torch.Tensor, attr, host_read)
        wrap(type(triton_engine._k_scan), "run", launch)
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, attr, orig in reversed(self._saved):
            setattr(owner, attr, orig)
        self._saved = []
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._quiet:
            packet = func.overloadpacket
            name = str(packet)
            if packet in self.SYNC:
                self.syncs.append(name)
            elif packet in (aten.index, aten.index_put, aten.index_put_) and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] if len(args) > 1 else ())):
                self.syncs.append(name + " (boolean mask)")
            elif packet in (aten._to_copy, aten.copy_) and self._to_host(func, args, kwargs):
                self.syncs.append(name + " (to the host)")
            elif not (func.is_view or packet in self.FREE):
                self.launches.append(name)
        return func(*args, **kwargs)

    @staticmethod
    def _to_host(func, args, kwargs):
        if func.overloadpacket is aten.copy_:
            return args[0].device.type == "cpu" and args[1].device.type != "cpu"
        dev = kwargs.get("device")
        return (dev is not None and torch.device(dev).type == "cpu"
                and args[0].device.type != "cpu")


# ----------------------------------------------------------------------------- conformance
CONFIGS = {
    "default": {}, "nesterov": {"nesterov": True}, "no-momentum": {"momentum": 0.0},
    "no-masking": {"momentum_masking": False}, "int32": {"wire_index": "int32"},
    "fp16": {"wire_values": "float16"},
    "int32-fp16": {"wire_index": "int32", "wire_values": "float16"},
    "exact": {"exact_topk": True}, "coarse-samples": {"sample_ratio": 0.001},
}


def _grads(rng, sizes, kind, t, rank):
    out = []
    for j, n in enumerate(sizes):
        g = rng.standard_normal(n).astype(F32)
        if kind == "ties":
            g = np.round(g * 2).astype(F32) / F32(2)
        elif kind == "sparse":
            g[rng.random(n) < 0.995] = 0
        elif kind == "nan" and rank == 2 and j == 0 and t == 2:
            g[n // 2] = np.nan
        elif kind == "inf" and rank == 1 and j == len(sizes) - 1 and t == 1:
            g[0] = -np.inf
        elif kind == "huge" and rank == 0:
            g *= F32(3e4) if t == 2 else F32(1e-8)
        elif kind == "heavy":
            g = (rng.standard_cauchy(n) * 3).astype(F32)
        out.append(g)
    return out


def _host(x):
    """A device tensor, NumPy array or list as a NumPy array (on the host)."""
    if torch.is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class _Rank:
    """One rank's bucket (flat u, v) on an engine: the NumPy reference, or Triton on
    ``device``."""

    def __init__(self, engine, device, config, sizes, names):
        self.engine, self.device, self.config = engine, device, config
        self.sizes, self.names = sizes, names
        offsets = make_step(config, names, sizes, 0.5, 1).offsets
        if device is None:
            mk = lambda: np.zeros(offsets[-1], F32)          # noqa: E731
        else:
            mk = lambda: torch.zeros(offsets[-1], device=device)  # noqa: E731
        self.u = mk() if config.momentum > 0 else None
        self.v = mk()
        cut = lambda f: [f[a:a + n] for a, n in zip(offsets, sizes)]  # noqa: E731
        self.us = [None] * len(sizes) if self.u is None else cut(self.u)
        self.vs = cut(self.v)

    def compress(self, t, density, grads, scales):
        step = make_step(self.config, self.names, self.sizes, density, t)
        if self.device is not None:
            grads = [torch.from_numpy(g).to(self.device) for g in grads]
        else:
            grads = [g.copy() for g in grads]
        return step, self.engine.compress(step, self.us, self.vs, grads, scales,
                                          flat=(self.u, self.v))


def _snapshot(r, rank):
    bits = lambda x: _host(x).view(np.int32).tolist()        # noqa: E731
    return {
        "payloads": [bits(p) for p in r.payloads],
        "counts": [int(c) for c in _host(r.counts).tolist()],
        "finite": [bool(f) for f in _host(r.finite).tolist()],
        "sel": _host(r.sel).tolist(), "vals": bits(r.vals),
        "usent": None if r.usent is None else bits(r.usent),
        "fp16": [tuple(int(x) for x in f) for f in _host(r.fp16).tolist()],
        "dropped": [bool(d) for d in _host(r.dropped).tolist()],
        "u": None if rank.u is None else bits(rank.u), "v": bits(rank.v),
    }


def reference_bucket(step, gathered, ranks, inv, rank, r):
    """The reference's receive path of a bucket (what ``decode_bucket`` must give): split,
    each member decoded in rank order, a non-finite member NaN with the entries ``rank`` sent
    (its Result ``r``) put back into its state (unless its state was dropped). Returns (the flat
    output, the non-finite flags)."""
    parts = wire.split_bucket(NB, gathered, ranks, len(step.sizes))
    out = np.zeros(step.offsets[-1], F32)
    nfs = []
    for j, (a, n) in enumerate(zip(step.offsets, step.sizes)):
        seg = out[a:a + n]
        nf = OpsEngine(NB).decode(np.concatenate(parts[j]), n, ranks, seg, inv)
        if nf:
            seg[:] = np.nan
            if not r.dropped[j]:
                e, c = step.starts[j], int(r.counts[j])
                idx = _host(r.sel)[e:e + c]
                rank.vs[j][idx] = _host(r.vals)[e:e + c]
                if r.usent is not None and rank.us[j] is not None:
                    rank.us[j][idx] = _host(r.usent)[e:e + c]
        nfs.append(bool(nf))
    return out, nfs


def conformance_case(engine, device, config, kind, sizes, density=0.01, steps=3, ranks=3,
                     me=1, scales=None):
    """Rank ``me`` of ``ranks`` on the Triton engine beside the reference, step after step:
    compress, the bucket's receive path and the per-tensor decode. Returns the first
    difference (a string) or None."""
    cfg = DGCConfig(**CONFIGS[config])
    names = [f"layer{j}.weight" for j in range(len(sizes))]
    refs = [_Rank(OpsEngine(NB), None, cfg, sizes, names) for _ in range(ranks)]
    tri = _Rank(engine, device, cfg, sizes, names)
    rng = np.random.default_rng(11)
    scales = scales or [1.0] * len(sizes)
    inv = 1.0 / ranks
    for t in range(1, steps + 1):
        results = []
        for k in range(ranks):
            grads = _grads(rng, sizes, kind, t, k)
            step, r = refs[k].compress(t, density, grads, scales)
            results.append(r)
            if k == me:
                _, rt = tri.compress(t, density, grads, scales)
        want, got = _snapshot(results[me], refs[me]), _snapshot(rt, tri)
        for key in want:
            if got[key] != want[key]:
                return f"step {t}: compress: {key} differs"
        # the per-tensor decode of each segment (before the bucket's put-back changes state)
        for j, n in enumerate(sizes):
            gathered = np.concatenate([r.payloads[j] for r in results])
            ref_out = np.zeros(n, F32)
            ref_nf = OpsEngine(NB).decode(gathered, n, ranks, ref_out, inv)
            out = torch.full((n,), 3.0, device=device)
            nf = engine.decode(torch.from_numpy(gathered).to(device), n, ranks, out, inv)
            if nf != ref_nf or (not nf and _host(out).view(np.int32).tolist()
                                != ref_out.view(np.int32).tolist()):
                return f"step {t}: decode of segment {j} differs"
        # the bucket's receive path
        frames = [wire.frame_bucket(NB, list(enumerate(r.payloads)), np.zeros(1, np.int32))
                  for r in results]
        gathered = np.concatenate(frames)
        want_out, want_nf = reference_bucket(step, gathered, ranks, inv, refs[me], results[me])
        out = torch.full((step.offsets[-1],), 3.0, device=device)
        nf, err = engine.decode_bucket(step, torch.from_numpy(gathered).to(device), ranks, out,
                                       inv, result=rt, flat=(tri.u, tri.v))
        got_out = _host(out)
        if _host(err).tolist() != [0] * len(sizes):
            return f"step {t}: decode_bucket flagged an error"
        if [bool(x) for x in _host(nf).tolist()] != want_nf:
            return f"step {t}: decode_bucket: non-finite flags differ"
        if np.isnan(got_out).tolist() != np.isnan(want_out).tolist():
            return f"step {t}: decode_bucket: NaN segments differ"
        ok = ~np.isnan(want_out)
        if got_out[ok].view(np.int32).tolist() != want_out[ok].view(np.int32).tolist():
            return f"step {t}: decode_bucket: sums differ"
        if _snapshot(rt, tri)["v"] != _snapshot(results[me], refs[me])["v"] or (
                tri.u is not None
                and _host(tri.u).view(np.int32).tolist() != refs[me].u.view(np.int32).tolist()):
            return f"step {t}: decode_bucket: the state after the put-back differs"
    return None


def conformance(engine, device, tiny):
    print("== 1. conformance: Triton on", device, "vs the NumPy reference (bit for bit)")
    if tiny:
        sizes = [1, 7, 65, 1000, 4099]
        cases = [("default", "normal", 0.01, None), ("fp16", "huge", 0.01, None),
                 ("int32", "nan", 0.01, None), ("exact", "ties", 0.01, None)]
        steps = 2
    else:
        sizes = [1, 7, 64, 65, 1000, 4099, 70001, 1048583]
        cases = [(c, "normal", 0.01, None) for c in CONFIGS]
        cases += [("default", k, 0.01, None) for k in ("ties", "sparse", "nan", "inf", "heavy")]
        cases += [("fp16", "huge", 0.01, None), ("default", "normal", 1.0, None),
                  ("default", "normal", 0.25, None), ("default", "normal", 0.001, None),
                  ("nesterov", "normal", 0.01, [0.5, 1.0, 0.25, 1.0, 0.75, 0.125, 0.3, 0.9])]
        steps = 3
    failed = 0
    for config, kind, density, scales in cases:
        t0 = time.perf_counter()
        why = conformance_case(engine, device, config, kind, sizes, density, steps,
                               scales=scales)
        failed += why is not None
        print(f"  {'PASS' if why is None else 'FAIL'}  {config:14s} {kind:7s} density "
              f"{density:<6g} {time.perf_counter() - t0:6.1f} s  {why or ''}")
    if not tiny:        # sample and candidate counts beyond the in-register search
        t0 = time.perf_counter()
        why = conformance_case(engine, device, "default", "normal", [4000037], 0.01, 2)
        failed += why is not None
        print(f"  {'PASS' if why is None else 'FAIL'}  default        normal  n=4000037 "
              f"(s, candidates > rb) {time.perf_counter() - t0:6.1f} s  {why or ''}")
    return failed


# ----------------------------------------------------------------------------- timing
TINY_MODEL = [("conv1.weight", (16, 1, 5, 5)), ("conv1.bias", (16,)),
              ("conv2.weight", (32, 16, 5, 5)), ("conv2.bias", (32,)),
              ("fc1.weight", (64, 512)), ("fc1.bias", (64,)), ("fc2.weight", (10, 64))]


class _Bucket:
    def __init__(self, names, sizes, device, rng):
        self.names, self.sizes = names, sizes
        cfg = DGCConfig()
        self.offsets = make_step(cfg, names, sizes, 0.5, 1).offsets
        L = self.offsets[-1]
        self.grads = [torch.from_numpy(rng.standard_normal(n).astype(F32)).to(device)
                      for n in sizes]
        self.scales = [1.0] * len(sizes)
        self.state = {}
        for which in ("triton", "ops"):
            u, v = torch.zeros(L, device=device), torch.zeros(L, device=device)
            cut = lambda f: [f[a:a + n] for a, n in zip(self.offsets, sizes)]  # noqa: E731
            self.state[which] = (u, v, cut(u), cut(v))
        self.out = torch.zeros(L, device=device)
        self.outs = [self.out[a:a + n] for a, n in zip(self.offsets, sizes)]


def model_buckets(shapes, bucket_numel, device, seed=0):
    """The sparsified members of each bucket of the model, as the adapter plans them."""
    cfg = DGCConfig()
    params = [(name, int(np.prod(shape)), len(shape)) for name, shape in reversed(shapes)]
    numel = {name: n for name, n, _ in params}
    rng = np.random.default_rng(seed)
    out = []
    for members, sparse in plan_buckets(params, bucket_numel, cfg):
        names = [m for m, s in zip(members, sparse) if s]
        if names:
            out.append(_Bucket(names, [numel[m] for m in names], device, rng))
    return out


def _median_ms(fn, iters, warm, device):
    """(median device ms by CUDA events, median host ms to issue) of fn(i) (CPU: wall)."""
    gpu, host = [], []
    for i in range(warm + iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn(i)
            end.record()
            issued = time.perf_counter() - t0
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn(i)
            issued = elapsed = time.perf_counter() - t0
            elapsed *= 1e3
        if i >= warm:
            gpu.append(elapsed)
            host.append(issued * 1e3)
    return statistics.median(gpu), statistics.median(host)


def timing(engine, device, tiny):
    ranks = 4
    shapes = TINY_MODEL if tiny else resnet50()
    bucket_numel = 2 ** 12 if tiny else 2 ** 22
    buckets = model_buckets(shapes, bucket_numel, device)
    total = sum(int(np.prod(s)) for _, s in shapes)
    sparse = sum(sum(b.sizes) for b in buckets)
    iters, warm = (2, 1) if tiny else (20, 5)
    print(f"\n== 2. time per step: {'a tiny CNN' if tiny else 'ResNet-50'} ({total:,} "
          f"parameters, {sparse:,} in {len(buckets)} sparsified buckets of <= {bucket_numel:,}),"
          f" {ranks} ranks' frames decoded, on {device}")
    B = TorchBackend()
    ops = OpsEngine(B)
    cfg = DGCConfig()
    x = torch.ones(total, device=device)
    y = torch.ones(total, device=device)
    flat_ms, _ = _median_ms(lambda i: x.add_(y), iters, warm, device)
    print(f"  one flat pass (x.add_(y), {total:,} elements): {flat_ms:.3f} ms")
    report = {"flat_ms": flat_ms}
    t0 = time.perf_counter()
    n_steps = 10
    for i in range(n_steps):
        for b in buckets:
            make_step(cfg, b.names, b.sizes, 0.004, i + 1)
    print(f"  make_step for every bucket (host, the core's part): "
          f"{(time.perf_counter() - t0) / n_steps * 1e3:.3f} ms per step")
    for density in (0.004, 0.001):
        steps = [[make_step(cfg, b.names, b.sizes, density, i + 1) for b in buckets]
                 for i in range(warm + iters + 8)]
        gathered = []                              # every rank's frame: this rank's, N times
        for b, st in zip(buckets, steps[0]):
            u, v, us, vs = b.state["triton"]
            r = engine.compress(st, us, vs, b.grads, b.scales, (u, v))
            frame = wire.frame_bucket(B, list(enumerate(r.payloads)), like=r.payloads[0])
            gathered.append(torch.cat([frame] * ranks))

        def triton_compress(i, steps=steps):
            for b, st in zip(buckets, steps[i]):
                u, v, us, vs = b.state["triton"]
                engine.compress(st, us, vs, b.grads, b.scales, (u, v))

        def triton_step(i, steps=steps, gathered=gathered):
            for b, st, g in zip(buckets, steps[i], gathered):
                u, v, us, vs = b.state["triton"]
                r = engine.compress(st, us, vs, b.grads, b.scales, (u, v))
                engine.decode_bucket(st, g, ranks, b.out, 1.0 / ranks, result=r, flat=(u, v))

        def ops_step(i, steps=steps, gathered=gathered):
            for b, st, g in zip(buckets, steps[i], gathered):
                u, v, us, vs = b.state["ops"]
                ops.compress(st, us, vs, b.grads, b.scales, (u, v))
                parts = wire.split_bucket(B, g, ranks, len(b.sizes))
                for j, n in enumerate(b.sizes):
                    ops.decode(torch.cat(parts[j]), n, ranks, b.outs[j], 1.0 / ranks)

        c_ms, c_host = _median_ms(triton_compress, iters, warm, device)
        t_ms, t_host = _median_ms(triton_step, iters, warm, device)
        o_ms, o_host = _median_ms(ops_step, min(iters, 3), 1, device)
        print(f"  density {density}: Triton compress {c_ms:.3f} ms (host issues it in "
              f"{c_host:.3f} ms); compress + decode_bucket {t_ms:.3f} ms (host {t_host:.3f} "
              f"ms) = {t_ms / flat_ms:.1f} flat passes; tensor ops (compress, split, decode) "
              f"{o_ms:.3f} ms = {o_ms / max(t_ms, 1e-9):.3g}x Triton's")
        report[density] = {"triton_compress_ms": c_ms, "triton_ms": t_ms, "triton_host_ms":
                           t_host, "ops_ms": o_ms}
        report[("steps", density)] = (triton_step, ops_step, len(buckets), warm + iters)
    return report


# ----------------------------------------------------------------------------- launches, syncs
def launches_and_syncs(report, device):
    print("\n== 3. launches and host synchronisations per step (density 0.004)")
    triton_step, ops_step, nb, i = report[("steps", 0.004)]
    bad = 0
    for name, fn in (("Triton", triton_step), ("tensor ops", ops_step)):
        with DeviceCounter() as c:
            fn(i)
        print(f"  {name:10s}: {len(c.launches)} launches ({len(c.launches) / nb:.1f} per "
              f"bucket), {len(c.syncs)} host reads (DeviceCounter)")
        if name == "Triton":
            per_bucket = len(c.launches) / nb
            if c.syncs or per_bucket > 12:
                bad += 1
                print(f"    FAIL: syncs {sorted(set(c.syncs))}, {per_bucket:.1f} launches per "
                      "bucket")
        i += 1
        if device.type != "cuda":
            continue
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(i)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        i += 1
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn(i)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        i += 1
        print(f"  {'':10s}  profiler: {len(kernels)} device activities (kernels, copies, "
              f"memsets; {len(kernels) / nb:.1f} per bucket); set_sync_debug_mode: "
              f"{len(syncs)} synchronising calls")
        if name == "Triton" and syncs:
            bad += 1
            print("    FAIL:", syncs[0].message)
    return bad


# ----------------------------------------------------------------------------- main
class _CNN(torch.nn.Module):
    """A small real CNN (conv–BN–ReLU blocks, ~0.6 M parameters at width 64) for part 4."""

    def __init__(self, width):
        super().__init__()
        c = width

        def block(i, o, stride):
            return torch.nn.Sequential(torch.nn.Conv2d(i, o, 3, stride, 1, bias=False),
                                       torch.nn.BatchNorm2d(o), torch.nn.ReLU())
        self.features = torch.nn.Sequential(block(3, c, 1), block(c, c, 1), block(c, 2 * c, 2),
                                            block(2 * c, 2 * c, 1), block(2 * c, 4 * c, 2))
        self.head = torch.nn.Linear(4 * c, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def simulated_step(device, tiny):
    """Part 4 (module docstring). Returns the number of failures (0 or 1)."""
    from dgc_horovod.simulate import SimulatedCluster
    width, batch, side, steps = (8, 4, 8, 3) if tiny else (64, 32, 32, 30)
    N = 4
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, 3, side, side, generator=gen).to(device),
             torch.randint(0, 10, (batch,), generator=gen).to(device)) for _ in range(N)]
    print(f"\n4. simulated cluster: N = {N} workers of a CNN ({width} channels, batch {batch} "
          f"of {side}x{side} each), {steps} steps after 2 warm-up steps")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, losses = {}, {}
    for label, config in (("dense", None),
                          ("DGC", DGCConfig(warmup_steps=0, environ={}))):
        torch.manual_seed(0)
        model = _CNN(width).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if config else 0.9)
        cluster = SimulatedCluster(model, opt, N, config)
        closures = [lambda x=x, y=y: torch.nn.functional.cross_entropy(model(x), y)
                    for x, y in data]
        per, seen = [], []
        for i in range(steps + 2):
            sync()
            t0 = time.perf_counter()
            seen.append(sum(cluster.backward(closures)) / N)
            opt.step()
            sync()
            if i >= 2:
                per.append(time.perf_counter() - t0)
        times[label], losses[label] = statistics.median(per), seen
        print(f"   {label:>5}: {1e3 * times[label]:8.2f} ms per step; loss {seen[0]:.3f} -> "
              f"{seen[-1]:.3f}")
    print(f"   DGC / dense: {times['DGC'] / times['dense']:.2f}x")
    ok = all(np.isfinite(losses["DGC"])) and losses["DGC"][-1] < losses["DGC"][0]
    if not ok:
        print("   FAILED: the DGC run did not train (losses not finite or not falling)")
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="small sizes, on CPU under Triton's interpreter (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    if args.tiny:
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            sys.exit("--tiny runs under Triton's interpreter: set TRITON_INTERPRET=1 before "
                     "triton is imported (running this file with --tiny does)")
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("no CUDA device: run with --tiny (CPU, Triton's interpreter)")
    import triton
    from dgc_horovod.backends.triton_engine import TritonEngine
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (interpreter)'}")
    engine = TritonEngine(TorchBackend())
    t0 = time.perf_counter()
    failed = conformance(engine, device, args.tiny)
    report = timing(engine, device, args.tiny)
    failed += launches_and_syncs(report, device)
    failed += simulated_step(device, args.tiny)
    print(f"\n{'OK' if not failed else f'{failed} FAILED'} in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
