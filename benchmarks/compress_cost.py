"""What DGC's compress step costs on this CPU, measured side by side in one run.

1. ResNet-50's 161 gradient tensors (25,557,032 elements, shapes from benchmarks/shapes.py):
   per step, accumulate + select + encode for all tensors (dgc_horovod.core.DGCCore on PyTorch
   tensors, density 0.001, default settings) against one plain memory pass over the same
   gradients (an in-place add of one gradient set into another), and against exact per-tensor
   top-k (torch.topk) alone. DGC is timed three ways: per bucket (DGCCore.compress_many on the
   buckets the PyTorch adapter makes with the default bucket_numel = 2**22: what training runs),
   one DGCCore.compress per tensor on the fused C kernels (the adapter with bucket_numel=0), and
   on the tensor-op path (DGCCore.use_kernels = False: CUDA tensors, TensorFlow), one compress()
   per tensor (what compress_many ran on tensor ops before dgc_horovod.core.bucket_ops) and per
   bucket (compress_many: bucket_ops). Prints the ratios, once with 1 torch thread and once with
   torch's default thread count (the kernels use as many threads as torch's intra-op pool); and
   the calls per bucket of the tensor-op path, both ways: calls of the Backend's methods (but
   the metadata reads numel / ndim / is_floating) and of torch functions and tensor methods
   (counted by a TorchFunctionMode: what launches kernels on a GPU).
2. Selection quality: the L1 mass captured by the sampled selection (DGCCore.compress, fused path)
   against the exact top-k of the same count, on Gaussian, Laplace, Student-t (3 dof) and
   tie-heavy gradients.
3. Stages (--parts stages): where the tensor-op path's time goes on ResNet-50's buckets, one
   thread: the CPU time (time.thread_time, so that other processes on a shared machine count
   less) of every Backend call that compress_many makes on tensor ops, by method and the line
   that calls it, in memory passes (each against the median of one memory pass timed the same
   way; the rest, Python and the calls not listed, on the last line).
4. Scale: cost per element of compress (fused path) for tensors of 1e4 … 1e8 elements, in
   buckets as the adapter makes them (ceil(2**22 / n) tensors of n elements per compress_many
   call, one tensor from 2**22 up) and with one compress() call per tensor, timed in interleaved
   rounds as in 1; for buckets of several tensors, how much of a call is spent in the C kernels
   and how much per tensor outside them.

5. CUDA (--parts cuda; needs a GPU, not Horovod): the tensor-op path on CUDA tensors, ResNet-50's
   buckets as in 1: first the same three steps on CUDA and on CPU tensors (payloads and the
   state_dict compared bit for bit), then the wall time per step (torch.cuda.synchronize after
   each) of compress_many per bucket, one compress() per tensor and exact top-k, against one
   memory pass on the GPU, in interleaved rounds; what one step launches (torch.profiler: CUDA
   kernels and copies, and the host waits for the device); and the lines whose calls make the
   host wait (torch.cuda.set_sync_debug_mode). --parts stages-cuda: part 3 on CUDA tensors, in
   wall time.

    python benchmarks/compress_cost.py [--repeats 9] [--max-elements 1e8] [--min-sparse-ndim 1]
                                       [--parts calls,resnet,recall,scaling,stages,cuda,
                                                stages-cuda]
"""
import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import resnet50  # noqa: E402

from dgc_horovod.core import DGCConfig, DGCCore  # noqa: E402
from dgc_horovod.core.buckets import plan_buckets  # noqa: E402
from dgc_horovod.core.sparsify import k_for  # noqa: E402
from dgc_horovod.backends.torch_backend import TorchBackend  # noqa: E402


def timed_rounds(fns, repeats, twice=False):
    """[[seconds of each function] per round]: every function runs once per round, in order,
    after one warm-up call each. twice: in a round each function runs twice in a row and the
    second call is timed (a call right after other work pays for a cold machine, which matters
    for calls of well under a millisecond; in a training step the calls follow one another)."""
    for fn in fns:
        fn()                                         # warm-up (allocations, first-touch)
    rounds = []
    for _ in range(repeats):
        times = []
        for fn in fns:
            if twice:
                fn()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        rounds.append(times)
    return rounds


def interleaved(fns, repeats):
    """Median time of each function and median of each one's ratio to the first, measured in
    rounds (each round runs every function once, in order), so that a slow spell of a shared
    machine affects all of them alike."""
    rounds = timed_rounds(fns, repeats)
    medians = [statistics.median(r[i] for r in rounds) for i in range(len(fns))]
    ratios = [statistics.median(r[i] / r[0] for r in rounds) for i in range(len(fns))]
    return medians, ratios


def adapter_buckets(entries, config, bucket_numel=2 ** 22):
    """The PyTorch adapter's buckets (dgc_horovod/torch/exchange.py, core.buckets.plan_buckets):
    the parameters in reverse registration order, cut into consecutive groups of about
    bucket_numel elements; a bucket's compress_many gets its sparsified tensors, the others are
    compressed one by one (dense allreduce). Returns (buckets, dense entries)."""
    by_name = {e[0]: e for e in entries}
    buckets, dense = [], []
    for members, sparse in plan_buckets([(n, g.numel(), g.dim()) for n, g, _ in entries[::-1]],
                                        bucket_numel, config):
        buckets.append([by_name[n] for n, s in zip(members, sparse) if s])
        dense += [by_name[n] for n, s in zip(members, sparse) if not s]
    return [b for b in buckets if b], dense


def resnet_cost(repeats, density, threads, min_sparse_ndim=1):
    torch.set_num_threads(threads)
    shapes = resnet50()
    grads = [torch.randn(s) for _, s in shapes]
    other = [torch.randn(g.shape) for g in grads]
    batched, single, ops, ops_many = (new_core(density, True, None, min_sparse_ndim),
                                      new_core(density, True, None, min_sparse_ndim),
                                      new_core(density, False, None, min_sparse_ndim),
                                      new_core(density, False, None, min_sparse_ndim))
    buckets, dense = adapter_buckets([(name, g, None) for (name, _), g in zip(shapes, grads)],
                                     batched.config)

    def compress_buckets(core=batched):
        for bucket in buckets:
            core.compress_many(bucket, world_size=8)
        for name, g, _ in dense:
            core.compress(name, g, world_size=8)

    def compress_all(core):
        for (name, _), g in zip(shapes, grads):
            core.compress(name, g, world_size=8)

    def add_pass():
        for a, b in zip(other, grads):
            a.add_(b)

    def exact_topk():
        for g in grads:
            torch.topk(g.abs().reshape(-1), k_for(g.numel(), density), sorted=False)

    (t_pass, t_bucket, t_single, t_ops, t_ops_many, t_topk), \
        (_, r_bucket, r_single, r_ops, r_ops_many, r_topk) = interleaved(
            [add_pass, compress_buckets, lambda: compress_all(single), lambda: compress_all(ops),
             lambda: compress_buckets(ops_many), exact_topk], repeats)
    n = sum(g.numel() for g in grads)
    fused = "fused C kernels" if single.use_kernels else "KERNELS NOT BUILT: tensor ops"
    print(f"ResNet-50 gradients: {len(grads)} tensors, {n:,} elements, density {density}, "
          f"{sum(map(len, buckets))} sparsified (min_sparse_ndim={min_sparse_ndim}), "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print("  (median of the times; ratio: median over the rounds of each round's time / that round's"
          " memory pass)")
    print(f"  one memory pass (in-place add)   {1e3 * t_pass:8.1f} ms   1.00x")
    print(f"  DGC per bucket (compress_many)   {1e3 * t_bucket:8.1f} ms   {r_bucket:5.2f}x"
          f"   ({len(buckets)} buckets of 2**22 elements: the PyTorch adapter's default)")
    print(f"  DGC one compress() per tensor    {1e3 * t_single:8.1f} ms   {r_single:5.2f}x"
          f"   ({fused}; the adapter with bucket_numel=0)")
    print(f"  ... the same on tensor ops       {1e3 * t_ops:8.1f} ms   {r_ops:5.2f}x"
          "   (DGCCore.use_kernels = False: CUDA, TensorFlow; before bucket_ops)")
    print(f"  tensor ops per bucket            {1e3 * t_ops_many:8.1f} ms   {r_ops_many:5.2f}x"
          "   (compress_many, use_kernels = False: bucket_ops)")
    print(f"  exact top-k per tensor (topk)    {1e3 * t_topk:8.1f} ms   {r_topk:5.2f}x")
    return r_bucket


def new_core(density, use_kernels=True, backend=None, min_sparse_ndim=1):
    core = DGCCore(DGCConfig(compress_ratio=density, warmup_epochs=0,
                             min_sparse_ndim=min_sparse_ndim),
                   TorchBackend() if backend is None else backend)
    core.use_kernels = use_kernels and core.use_kernels
    return core


class CountingBackend:
    """Stands in for a Backend and counts the calls of its methods, but the metadata reads
    (numel, ndim, is_floating: the per-entry argument checks)."""

    METADATA = ("numel", "ndim", "is_floating")

    def __init__(self, B):
        self.B, self.calls = B, 0

    def __getattr__(self, name):
        attr = getattr(self.B, name)
        if not callable(attr) or name in self.METADATA:
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)
        return counted


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch functions and tensor methods called (those inside another's handler
    are not dispatched to the mode again: each call counts once): ``calls`` all of them,
    ``ops`` those that are not a metadata read or a view (attributes such as dtype, numel(),
    is_floating_point(), detach(), reshape() / view() of a contiguous tensor, expand(),
    unbind()), i.e. those that may launch a kernel or copy between host and device."""

    METADATA = {"__get__", "numel", "dim", "is_floating_point", "detach", "reshape", "view",
                "contiguous", "expand", "unbind"}

    def __init__(self):
        super().__init__()
        self.calls = self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.ops += getattr(func, "__name__", "") not in self.METADATA
        return func(*args, **(kwargs or {}))


def calls_per_bucket(density, min_sparse_ndim=1, steps=3):
    """Backend and torch calls of the tensor-op path per bucket of ResNet-50's gradients (its
    sparsified tensors), one compress() per tensor (before) and compress_many (bucket_ops), in
    the last of ``steps`` steps (the first builds the state). Returns {path: (backend calls,
    torch calls)} per bucket."""
    shapes = resnet50()
    grads = [torch.randn(s) for _, s in shapes]
    out = {}
    for path in ("per tensor", "per bucket"):
        B = CountingBackend(TorchBackend())
        core = new_core(density, False, B, min_sparse_ndim)
        buckets, _ = adapter_buckets([(name, g, None) for (name, _), g in zip(shapes, grads)],
                                     core.config)
        for _ in range(steps):
            B.calls, mode = 0, TorchCalls()
            with mode:
                for bucket in buckets:
                    if path == "per bucket":
                        core.compress_many(bucket, world_size=8)
                    else:
                        for name, g, p in bucket:
                            core.compress(name, g, world_size=8, param=p)
        out[path] = (B.calls / len(buckets), mode.calls / len(buckets),
                     mode.ops / len(buckets))
    print(f"Calls per bucket on tensor ops (ResNet-50: {len(buckets)} buckets of "
          f"{sum(map(len, buckets))} sparsified tensors, min_sparse_ndim={min_sparse_ndim}, "
          f"density {density}; one step after {steps - 1}; Backend calls without the metadata "
          "reads, and torch calls)")
    for path, (b, t, o) in out.items():
        print(f"  {path:>10}: {b:7.1f} Backend calls, {t:7.1f} torch calls ({o:.1f} of them not "
              "metadata or views) per bucket")
    return out


class StageClock:
    """Stands in for a Backend and adds up the CPU time of its outermost calls (a method that
    calls another counts once) by (method, file:line of the caller)."""

    def __init__(self, B, clock=time.thread_time):
        self.B, self.seconds, self.calls, self._depth = B, {}, {}, 0
        self.clock = clock

    def __getattr__(self, name):
        attr = getattr(self.B, name)
        if not callable(attr) or name in CountingBackend.METADATA:
            return attr

        def timed(*args, **kwargs):
            if self._depth:
                return attr(*args, **kwargs)
            f = sys._getframe(1)
            key = (name, f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}")
            self._depth += 1
            t0 = self.clock()
            try:
                return attr(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds[key] = self.seconds.get(key, 0.0) + self.clock() - t0
                self.calls[key] = self.calls.get(key, 0) + 1
        return timed


def stages(density, repeats, min_sparse_ndim=1, top=20, device="cpu"):
    """The CPU time of the tensor-op path's Backend calls per step on ResNet-50's buckets, one
    thread, in memory passes (see the module docstring). device="cuda": the wall time of each
    call on CUDA tensors instead (kernels run asynchronously: a call that makes the host wait
    for the device is charged with the queued work), each step and pass ending in a
    torch.cuda.synchronize()."""
    torch.set_num_threads(1)
    cuda = device == "cuda"
    now = time.perf_counter if cuda else time.thread_time
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shapes = resnet50()
    grads = [torch.randn(s, device=device) for _, s in shapes]
    other = [torch.randn(g.shape, device=device) for g in grads]
    clock = StageClock(TorchBackend(), now)
    core = new_core(density, False, clock, min_sparse_ndim)
    buckets, _ = adapter_buckets([(name, g, None) for (name, _), g in zip(shapes, grads)],
                                 core.config)
    steps, passes = [], []
    for r in range(repeats + 1):
        sync()
        t0 = now()
        for a, b in zip(other, grads):
            a.add_(b)
        sync()
        t1 = now()
        if r == 1:                       # the first step builds the state: not counted
            clock.seconds.clear()
            clock.calls.clear()
        for bucket in buckets:
            core.compress_many(bucket, world_size=8)
        sync()
        if r:
            passes.append(t1 - t0)
            steps.append(now() - t1)
    one = statistics.median(passes)
    step = statistics.median(steps)
    print(f"Stages of the tensor-op path (compress_many, use_kernels = False) on ResNet-50's "
          f"{len(buckets)} buckets ({sum(map(len, buckets))} sparsified tensors), 1 thread, "
          f"{'wall time on CUDA' if cuda else 'CPU time'} per step, median of {repeats} steps; "
          f"one memory pass (per tensor) {1e3 * one:.2f} ms, "
          f"a step {1e3 * step:.1f} ms = {step / one:.2f} passes; load average "
          f"{os.getloadavg()[0]:.2f}")
    rows = sorted(clock.seconds.items(), key=lambda kv: -kv[1])
    for (name, where), sec in rows[:top]:
        sec /= repeats
        print(f"  {1e3 * sec:7.2f} ms  {sec / one:5.2f} passes  {name:<22} {where:<22} "
              f"({clock.calls[name, where] / repeats:.0f} calls)")
    rest = step - sum(sec for _, sec in rows[:top]) / repeats
    print(f"  {1e3 * rest:7.2f} ms  {rest / one:5.2f} passes  the rest (Python, the other "
          f"{max(0, len(rows) - top)} call sites)")


def _same_on_cuda(shapes, grads, buckets_of, density, min_sparse_ndim, steps=3,
                  devices=("cpu", "cuda")):
    """compress_many on tensor ops over CUDA and over CPU copies of the same gradients, ``steps``
    steps: every payload and the final state_dict bit-equal? Returns the number of payloads."""
    out, states = [], []
    for dev in devices:
        core = new_core(density, False, None, min_sparse_ndim)
        core.use_kernels = False
        gs = [g.to(dev) for g in grads]
        buckets, dense = buckets_of(gs, core)
        payloads = []
        for _ in range(steps):
            for bucket in buckets:
                payloads += [r[1].cpu() for r in core.compress_many(bucket, world_size=8)]
            for name, g, _ in dense:
                payloads.append(core.compress(name, g, world_size=8)[1].cpu())
        out.append(payloads)
        states.append({k: t.cpu() for k, t in _tensors(core.state_dict())})
    assert len(out[0]) == len(out[1])
    bad = [i for i, (a, b) in enumerate(zip(*out)) if not torch.equal(a, b)]
    bad_state = [k for k in states[0] if not torch.equal(states[0][k], states[1].get(k))]
    print(f"  CUDA against CPU tensors, tensor ops, {steps} steps: {len(out[0])} payloads, "
          f"{len(bad)} differ; state_dict: {len(states[0])} tensors, {len(bad_state)} differ"
          + (f" (first: payload {bad[:3]}, state {bad_state[:3]})" if bad or bad_state else ""))
    return not bad and not bad_state


def _tensors(d, prefix=""):
    """(path, tensor) for every tensor in a nested state dict."""
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            yield prefix + str(k), v
        elif isinstance(v, dict):
            yield from _tensors(v, f"{prefix}{k}/")


def cuda_cost(repeats, density, min_sparse_ndim=1):
    """Part 5 of the module docstring."""
    from torch.profiler import ProfilerActivity, profile
    shapes = resnet50()
    grads = [torch.randn(s) for _, s in shapes]

    def buckets_of(gs, core):
        return adapter_buckets([(name, g, None) for (name, _), g in zip(shapes, gs)],
                               core.config)
    print(f"CUDA: {torch.cuda.get_device_name()}, torch {torch.__version__}; ResNet-50 gradients, "
          f"{len(grads)} tensors, density {density}, min_sparse_ndim={min_sparse_ndim}")
    same = _same_on_cuda(shapes, grads, buckets_of, density, min_sparse_ndim)
    grads = [g.cuda() for g in grads]
    other = [torch.randn(g.shape, device="cuda") for g in grads]
    many, single = (new_core(density, False, None, min_sparse_ndim),
                    new_core(density, False, None, min_sparse_ndim))
    buckets, dense = buckets_of(grads, many)

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    def compress_buckets():
        for bucket in buckets:
            many.compress_many(bucket, world_size=8)
        for name, g, _ in dense:
            many.compress(name, g, world_size=8)

    def compress_all():
        for (name, _), g in zip(shapes, grads):
            single.compress(name, g, world_size=8)

    def add_pass():
        for a, b in zip(other, grads):
            a.add_(b)

    def add_flat():                     # the same bytes in one kernel: the bandwidth's pass
        flat_a.add_(flat_b)
    flat_a = torch.cat([g.reshape(-1) for g in other])
    flat_b = torch.cat([g.reshape(-1) for g in grads])

    def exact_topk():
        for g in grads:
            torch.topk(g.abs().reshape(-1), k_for(g.numel(), density), sorted=False)
    torch.cuda.synchronize()
    (t_pass, t_flat, t_many, t_single, t_topk), (_, r_flat, r_many, r_single, r_topk) = \
        interleaved([synced(f) for f in (add_pass, add_flat, compress_buckets, compress_all,
                                         exact_topk)], repeats)
    n = sum(g.numel() for g in grads)
    print(f"  wall time per step, torch.cuda.synchronize() after each; median of {repeats} "
          "rounds; ratio: median over the rounds of each round's time / that round's memory pass")
    print(f"  one memory pass (in-place add per tensor) {1e3 * t_pass:8.3f} ms   1.00x"
          f"   ({12 * n / t_pass / 1e12:.2f} TB/s counting 3 x 4 bytes per element)")
    print(f"  ... one add over the flat buffer          {1e3 * t_flat:8.3f} ms   {r_flat:5.2f}x"
          f"   ({12 * n / t_flat / 1e12:.2f} TB/s)")
    print(f"  DGC per bucket (compress_many)            {1e3 * t_many:8.3f} ms   {r_many:5.2f}x"
          f"   ({len(buckets)} buckets, {sum(map(len, buckets))} sparsified tensors, "
          f"{len(dense)} dense)")
    print(f"  DGC one compress() per tensor             {1e3 * t_single:8.3f} ms   {r_single:5.2f}x")
    print(f"  exact top-k per tensor (topk)             {1e3 * t_topk:8.3f} ms   {r_topk:5.2f}x")
    for label, fn in (("compress_many", compress_buckets), ("compress() per tensor", compress_all)):
        fn()
        torch.cuda.synchronize()
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
        except Exception as e:                      # the profiler is not the measurement
            print(f"  one step of {label}: torch.profiler failed ({type(e).__name__}: {e})")
            continue
        events = prof.events()
        kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        waits = sum(1 for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                    "cudaMemcpy"))
        copies = sum(1 for e in events if e.name.startswith("cudaMemcpy"))
        print(f"  one step of {label}: {kernels} CUDA kernels and copies ({kernels / len(buckets):.1f}"
              f" per bucket), {copies} cudaMemcpy* calls, {waits} host waits for the device "
              "(cudaStreamSynchronize / cudaDeviceSynchronize / cudaMemcpy; the last sync "
              "of the step counted)")
    sync_sites(compress_buckets)
    return same


def sync_sites(fn, top=15):
    """The lines whose torch calls made the host wait for the device during fn() (torch's
    sync debug mode warns at each; a warning names the Python line that called the op)."""
    import collections
    import linecache
    import warnings
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter((w.filename, w.lineno) for w in caught
                                if "synchroniz" in str(w.message))
    print(f"  host waits of one compress_many step by the line that called the op "
          f"({sum(sites.values())} in all; torch.cuda.set_sync_debug_mode('warn')):")
    for (f, line), count in sites.most_common(top):
        print(f"    {count:5d}  {os.path.basename(f)}:{line}  {linecache.getline(f, line).strip()}")


def make_dist(kind, n, rng):
    if kind == "gaussian":
        return rng.standard_normal(n)
    if kind == "laplace":
        return rng.laplace(size=n)
    if kind == "student_t3":
        return rng.standard_t(3, size=n)
    if kind == "tie_heavy":                        # few distinct magnitudes, many exact ties
        return rng.choice([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], size=n,
                          p=[0.0005, 0.05, 0.2, 0.499, 0.2, 0.05, 0.0005])
    raise ValueError(kind)


def recall(n=1_000_000, density=0.001, seeds=5):
    print(f"Selection quality, n={n:,}, density {density}: L1 mass of the sampled selection / "
          "L1 mass of the exact top-k of the same count (min over "
          f"{seeds} seeds)")
    worst = 1.0
    for kind in ("gaussian", "laplace", "student_t3", "tie_heavy"):
        ratios = []
        for seed in range(seeds):
            v = torch.from_numpy(make_dist(kind, n, np.random.default_rng(seed)).astype(np.float32))
            # momentum 0 and an empty residual: the selection runs on v itself
            # min_sparse_ndim=1: v is 1-D, which DGCConfig's default would leave dense
            core = DGCCore(DGCConfig(compress_ratio=density, warmup_epochs=0, momentum=0.0,
                                     momentum_masking=False, seed=seed, min_sparse_ndim=1),
                           TorchBackend())
            idx = core.compress("v", v, world_size=1)[2].indices
            c = idx.numel()
            got = float(v[idx].abs().sum())
            best = float(torch.topk(v.abs(), c).values.sum()) if c else 0.0
            ratios.append(got / best if best else 1.0)
        worst = min(worst, min(ratios))
        print(f"  {kind:>11}: recall {min(ratios):.4f} (count {c:,} of k={k_for(n, density):,})")
    return worst


class _KernelClock:
    """Stands in for dgc_horovod.core.kernels._kernels and adds up the wall time spent inside
    the batch kernel (step_many), to split a compress_many call into C and the
    rest (Python and PyTorch calls)."""

    def __init__(self, module):
        self.module, self.seconds = module, 0.0

    def __getattr__(self, name):
        fn = getattr(self.module, name)
        if name != "step_many":
            return fn

        def timed_call(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed_call


def kernel_split(core, entries, repeats):
    """(median seconds of a compress_many call, median seconds of it inside the C kernels)."""
    from dgc_horovod.core import kernels
    clock, module = _KernelClock(kernels._kernels), kernels._kernels
    kernels._kernels = clock
    try:
        totals, inside = [], []
        for _ in range(repeats):
            clock.seconds = 0.0
            t0 = time.perf_counter()
            core.compress_many(entries, world_size=8)
            totals.append(time.perf_counter() - t0)
            inside.append(clock.seconds)
    finally:
        kernels._kernels = module
    return statistics.median(totals), statistics.median(inside)


def scaling(repeats, max_elements, density):
    print(f"Cost per element of compress (density {density}, torch threads "
          f"{torch.get_num_threads()}): in buckets of 2**22 elements (compress_many, what the "
          "adapter runs) and one compress() per tensor")
    print(f"  ({repeats} interleaved rounds; in a round each call runs twice in a row and the "
          "second is timed; per size the median; max/min: the median over the rounds of each "
          "round's max/min, with their range)")
    cases = []
    for e in range(4, int(round(math.log10(max_elements))) + 1):
        n = 10 ** e
        count = -(-2 ** 22 // n)                    # tensors per bucket
        entries = [(f"w{i}", torch.randn(n), None) for i in range(count)]
        # min_sparse_ndim=1: the tensors are 1-D, which DGCConfig's default would leave dense
        config = DGCConfig(compress_ratio=density, warmup_epochs=0, min_sparse_ndim=1)
        core, one = DGCCore(config, TorchBackend()), DGCCore(config, TorchBackend())
        cases.append((e, n, count, entries, core, one))
    fns = []
    for e, n, count, entries, core, one in cases:
        fns.append(lambda entries=entries, core=core: core.compress_many(entries, world_size=8))
        fns.append(lambda entries=entries, one=one: one.compress("w", entries[0][1],
                                                                  world_size=8))
    rounds = timed_rounds(fns, repeats, twice=True)
    per_el = [[r[2 * j + kind] / (n * (count if kind == 0 else 1))
               for j, (_, n, count, *_) in enumerate(cases)] for r in rounds for kind in (0, 1)]
    bucket_rounds, single_rounds = per_el[0::2], per_el[1::2]
    bucketed = [statistics.median(r[j] for r in bucket_rounds) for j in range(len(cases))]
    single = [statistics.median(r[j] for r in single_rounds) for j in range(len(cases))]
    for j, (e, n, count, entries, core, one) in enumerate(cases):
        print(f"  n=1e{e}: bucket of {count:>3} tensors {1e3 * n * count * bucketed[j]:9.3f} ms "
              f"{1e9 * bucketed[j]:7.3f} ns/element;  one tensor {1e3 * n * single[j]:9.3f} ms "
              f"{1e9 * single[j]:7.3f} ns/element")
        if count > 1 and core.use_kernels:
            total, inside = kernel_split(core, entries, repeats)
            print(f"         of a bucket call: C kernels {1e3 * inside:.3f} ms "
                  f"({1e9 * inside / (n * count):.3f} ns/element), the rest (Python, PyTorch) "
                  f"{1e6 * (total - inside) / count:.1f} us per tensor")
    spread = [max(r) / min(r) for r in bucket_rounds]
    spread_one = [max(r) / min(r) for r in single_rounds]
    print(f"  max/min per-element cost: {statistics.median(spread):.2f}x in buckets (rounds "
          f"{min(spread):.2f}-{max(spread):.2f}x; of the medians above "
          f"{max(bucketed) / min(bucketed):.2f}x), {statistics.median(spread_one):.2f}x one "
          f"tensor per call")
    return statistics.median(spread)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--max-elements", type=float, default=1e8)
    ap.add_argument("--min-sparse-ndim", type=int, default=1,
                    help="ResNet-50 rows: 1 (default) sparsifies every tensor, as the earlier "
                         "numbers of docs/performance.md; 2, DGCConfig's default, leaves the "
                         "1-D tensors dense (outside the buckets)")
    ap.add_argument("--parts", default="calls,resnet,recall,scaling",
                    help="which parts to run, comma-separated (default: all but stages and "
                         "cuda)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    default_threads = torch.get_num_threads()
    print(f"{os.cpu_count()} CPUs; load average before: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if "calls" in parts:
        calls_per_bucket(args.density, args.min_sparse_ndim)
    if "resnet" in parts:
        for threads in sorted({1, default_threads}):
            resnet_cost(args.repeats, args.density, threads, args.min_sparse_ndim)
    if "stages" in parts:
        stages(args.density, args.repeats, args.min_sparse_ndim)
    if "stages-cuda" in parts:
        stages(args.density, args.repeats, args.min_sparse_ndim, device="cuda")
    torch.set_num_threads(default_threads)
    if "recall" in parts:
        recall(density=args.density)
    if "scaling" in parts:
        scaling(args.repeats, args.max_elements, args.density)
    if "cuda" in parts and not cuda_cost(args.repeats, args.density, args.min_sparse_ndim):
        sys.exit("CUDA and CPU tensors gave different results")


if __name__ == "__main__":
    main()
