"""The batch path (`DGCCore.compress_many`, `kernels.Batch`, `_kernels.step_many` and the
kernels' persistent thread pool, also driven through `kernels.all_finite`), organised by property.

The contract: ``core.compress_many(entries, N)`` gives the same results (payloads and the sparse
contexts' indices / values / u_sent), the same state (every tensor's u and v), the same random
generator state and the same statistics (every CompressionStats field but compress_seconds) as
``[core.compress(name, grad, N, param=param) for name, grad, param in entries]`` on an identical
core, on the NumPy and PyTorch backends; and the tensor-op path (``use_kernels = False``) agrees
bit for bit. Most tests run a "batch" core (compress_many, possibly several calls per step) and a
"single" core (one compress() per entry, in order) side by side, some a third core on tensor ops,
and compare all of that after every call or step.

The properties, one section each:

1. Bit-identity whatever the bucket holds: sizes around the kernel's limits, dtypes, layouts,
   0-d and empty tensors, new tensors, entry order, fuzzed buckets.
2. Selection: the sampled threshold's fallbacks (too few / too many candidates), the rows the
   kernel finishes or leaves to the backend, the random draws and their order, the density
   crossing the sampling limit.
3. Non-finite values: NaN/Inf gradients, velocities overflowing, weight decay turning a finite
   gradient non-finite, a NaN in the residual, another rank's non-finite payload.
4. Statistics: buckets split over calls, steps starting inside a call, the first step after a
   resume.
5. State changes between calls: checkpoints loaded (into fresh cores, mid-step), use_kernels
   toggled.
6. Threads and processes: thread counts, several Python threads, fork() while the pool is busy,
   the pool's regions, torch.set_flush_denormal after the pool started.
7. The tensor-op path in buckets (compress_many with use_kernels = False: bucket_ops): the same
   as one compress() per tensor on tensor ops on all three backends, the settle rule's edge
   cases, the flat state (checkpoints, kernels, decompress), backend calls per bucket.

(Merged from test_batch_robustness.py and test_batch_review.py, the second review's file; the
four bugs that review found, fixed, have their regression tests in sections 3 and 6.)
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from conftest import ROOT
from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend, kernels, wire
from dgc_horovod.core.driver import _BatchContext
from dgc_horovod.backends.torch_backend import TorchBackend
from helpers import F32, convert, raw, same_gen, to_np

# these tests are of the sparse path's mechanics on flat gradients (see conftest); core only
pytestmark = [pytest.mark.usefixtures("sparse_mechanics"), pytest.mark.unit]

BACKENDS = {"numpy": NumpyBackend, "torch": TorchBackend}
SMALL = kernels.SMALL_NUMEL
STATS = ("steps", "tensors", "sparse_tensors", "elements", "selected", "wire_bytes",
         "dense_bytes", "nonfinite_tensors", "density")
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels not built/disabled")


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Every test leaves torch's intra-op thread count as it found it."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# ============================================================================== helpers
# batch core vs single core (two cores)
def check(batch_core, single_core, got, want, names, what):
    """Results of one call (or one step) and the complete state of both cores."""
    assert len(got) == len(want), what
    for name, a, b in zip(names, got, want):
        w = f"{what}: tensor {name!r}"
        assert a[0] == b[0], w + " kind"
        assert raw(a[1]) == raw(b[1]), w + " payload"
        assert (a[2] is None) == (b[2] is None), w + " context"
        if a[2] is not None:
            assert (a[2].name, a[2].numel) == (b[2].name, b[2].numel), w
            for attr in ("indices", "values", "u_sent"):
                assert raw(getattr(a[2], attr)) == raw(getattr(b[2], attr)), f"{w} ctx.{attr}"
    assert set(batch_core.states) == set(single_core.states), what + ": state names"
    for name, sa in batch_core.states.items():
        sb = single_core.states[name]
        assert (sa.numel, sa.sparse) == (sb.numel, sb.sparse), f"{what}: {name!r} numel/sparse"
        for attr in ("u", "v"):
            assert raw(getattr(sa, attr)) == raw(getattr(sb, attr)), \
                f"{what}: state {name!r}.{attr}"
    assert same_gen(batch_core, single_core), what + ": generator state"
    check_stats(batch_core, single_core, what)


def check_stats(a, b, what, labels=("batch", "single")):
    for which in ("step_stats", "total_stats"):
        for attr in STATS:
            x, y = getattr(getattr(a, which), attr), getattr(getattr(b, which), attr)
            assert x == y, f"{what}: {which}.{attr} {labels[0]} {x!r} != {labels[1]} {y!r}"


def by_kernel(results):
    """Per result of one compress_many call, whether the batch kernel finished that tensor itself
    (selected, gathered, cleared and encoded it): its context is then a view of the batch's
    buffers (a _BatchContext). A call whose results are all finished by the kernel took the
    all-finished path; in any other call of the batch path the core settled some rows (or entries
    outside the batch) after the kernel ran."""
    return [isinstance(r[2], _BatchContext) for r in results]


def pair(backend, **cfg):
    conf = DGCConfig(**cfg)
    cores = [DGCCore(conf, BACKENDS[backend]()) for _ in range(2)]
    assert all(c.use_kernels for c in cores)
    return cores


def run_step(cores, make_entries, world=4, splits=(), each_call=None, finished=None):
    """Core 0: compress_many over the bucket cut at `splits` (several calls); core 1: compress()
    per entry. make_entries() builds fresh tensors (same values) for each core. If each_call is
    given, it is called after each batch call with the entries done so far (to compare
    statistics at call boundaries). If finished is a list, :func:`by_kernel` of each batch call
    is appended to it."""
    ea, eb = make_entries(), make_entries()
    cuts = [0] + list(splits) + [len(ea)]
    got, want = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        out = cores[0].compress_many(ea[lo:hi], world)
        got += out
        if finished is not None:
            finished.append(by_kernel(out))
        want += [cores[1].compress(n, g, world, param=p) for n, g, p in eb[lo:hi]]
        if each_call is not None:
            each_call(lo, hi)
    return got, want, [e[0] for e in ea]


# batch core vs single core vs tensor ops (three cores)
def compare(ref, other, core_ref, core_other, names, what, check_state=True):
    assert len(ref) == len(other), what
    for name, a, b in zip(names, ref, other):
        w = f"{what}, tensor {name}"
        assert a[0] == b[0], w
        assert raw(a[1]) == raw(b[1]), w + ": payload"
        if a[0] == "sparse":
            for attr in ("indices", "values", "u_sent"):
                assert raw(getattr(a[2], attr)) == raw(getattr(b[2], attr)), f"{w}: {attr}"
        if check_state:
            for attr in ("u", "v"):
                assert raw(getattr(core_ref.states[name], attr)) == \
                    raw(getattr(core_other.states[name], attr)), f"{w}: state {attr}"
    assert same_gen(core_ref, core_other), what + ": generator state"


def compare_stats(cores, what):
    for stats in ("total_stats", "step_stats"):
        for attr in STATS:
            got = [getattr(getattr(c, stats), attr) for c in cores]
            assert all(g == got[0] for g in got), (what, stats, attr, got)


def path_cores(backend, **cfg):
    conf = DGCConfig(**cfg)
    cores = [DGCCore(conf, BACKENDS[backend]()) for _ in range(4)]
    cores[2].use_kernels = cores[3].use_kernels = False
    assert cores[0].use_kernels and cores[1].use_kernels
    return cores


def step_all(cores, entries_fn, split=None, world=4):
    """Batch (core 0, in one or two compress_many calls), per tensor (1), tensor ops (2), and
    tensor ops in buckets (3: compress_many on tensor ops, split as core 0's)."""
    def many(core):
        e = entries_fn()
        if split:
            return core.compress_many(e[:split], world) + core.compress_many(e[split:], world)
        return core.compress_many(e, world)
    batch = many(cores[0])
    single = [cores[1].compress(n, g, world, param=p) for n, g, p in entries_fn()]
    ops = [cores[2].compress(n, g, world, param=p) for n, g, p in entries_fn()]
    return batch, single, ops, many(cores[3])


# ======================================================== 1. bit-identity whatever the bucket holds
ODD_CONFIGS = [
    dict(),
    dict(momentum=0.0, momentum_masking=False),
    dict(nesterov=True, momentum_masking=False, clip_norm=0.3),
    dict(wire_index="int32", weight_decay=1e-2),
    dict(wire_values="float16", exact_topk=True),
    dict(compress_ratio=0.2, sample_ratio=0.5, clip_norm=2.0, weight_decay=1e-3, nesterov=True),
]
SHAPES = [(), (1,), (2,), (3,), (64,), (40, 25), (1000,), (4099,), (70_001,), (3, 7), (131_073,)]


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", ODD_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in
                                                                   c.items()) or "defaults")
def test_compress_many_bit_identical_on_odd_inputs(backend, cfg):
    """0-d / 1-element / transposed / strided / float16 / bfloat16 / float64 gradients, ties,
    all-zero gradients, a NaN in the middle of the bucket, the warm-up density changing between
    calls and the thread count changing between calls (1, 2, 8 > cores, 3); buckets split in two
    calls on odd steps."""
    rng = np.random.default_rng(7)
    cores = path_cores(backend, **dict(dict(warmup_epochs=2, min_sparse_numel=1), **cfg))
    kinds = (["", "f16", "bf16", "f64", "T", "strided"] if backend == "torch"
             else ["", "f64", "T", "strided"])
    names = [f"t{i}" for i in range(len(SHAPES))]
    for step, threads in enumerate((1, 2, 8, 3)):
        torch.set_num_threads(threads)
        for c in cores:
            c.set_epoch(step * 0.7)
        grads = []
        for i, shape in enumerate(SHAPES):
            g = rng.standard_normal(shape).astype(F32)
            if (i + step) % 5 == 1:
                g = np.round(g * 2).astype(F32)                       # many exact ties
            if (i + step) % 7 == 3:
                g = np.zeros_like(g)
            if step == 2 and i in (5, 8):
                g.flat[g.size // 2] = np.nan if i == 5 else -np.inf   # non-finite mid-bucket
            grads.append(g)
        params = [rng.standard_normal(s).astype(F32) for s in SHAPES]

        def entries():
            return [(n, convert(backend, g, kinds[(i + step) % len(kinds)]),
                     convert(backend, p, "")) for i, (n, g, p) in enumerate(zip(names, grads,
                                                                                params))]
        batch, single, ops, ops_many = step_all(cores, entries, split=6 if step % 2 else None)
        compare(single, batch, cores[1], cores[0], names, f"step {step} batch vs single")
        compare(single, ops, cores[1], cores[2], names, f"step {step} ops vs single")
        compare(single, ops_many, cores[1], cores[3], names, f"step {step} ops buckets vs single")
        compare_stats(cores, f"step {step}")


CONFIGS = [
    dict(),
    dict(warmup_epochs=0, momentum=0.0, momentum_masking=False),
    dict(warmup_epochs=0, nesterov=True, clip_norm=0.5),
    dict(warmup_epochs=0, weight_decay=1e-2, clip_norm=5.0, momentum_masking=False),
    dict(warmup_epochs=0, wire_index="int32"),
    dict(warmup_epochs=0, wire_values="float16"),
    dict(warmup_epochs=0, exact_topk=True),
    dict(warmup_epochs=0, compress_ratio=0.3),
    dict(warmup_epochs=0, compress_ratio=0.45, sample_ratio=1.0),
    dict(warmup_epochs=0, momentum=0.0),
    dict(warmup_epochs=0, compress_ratio=1.0),
]
CFG_IDS = ["warmup", "m0", "nesterov-clip", "wd-clip-nomask", "int32", "fp16", "exact",
           "ratio0.3", "ratio0.45-s1", "m0-masking", "ratio1"]


def _boundary_grads(rng, sizes, step):
    grads = [rng.standard_normal(n).astype(F32) for n in sizes]
    if step % 3 == 2:
        grads = [np.round(g * 2).astype(F32) for g in grads]              # many ties
    # non-finite values: none / first entry / middle / last / all, then finite again
    bad = {1: [0], 2: [len(sizes) // 2], 3: [len(sizes) - 1], 4: list(range(len(sizes))),
           6: [1, len(sizes) - 2]}.get(step, [])
    for j, i in enumerate(bad):
        g = grads[i]
        g[(7 * j + step) % g.size] = (np.nan, np.inf, -np.inf)[(i + step) % 3]
    return grads


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
def test_sizes_at_small_numel_boundary_and_tiny_with_nonfinite_positions(backend, cfg):
    """Tensors of 1, 2, 3, 63, 64, 65 elements and of SMALL_NUMEL - 1, SMALL_NUMEL and
    SMALL_NUMEL + 1 elements (checked in the updating task vs in the kernel's first phase) in one bucket, in an
    order rotated every step (so each lands first, in the middle and last), with NaN/Inf in the
    first / middle / last / every / two entries on some steps and finite ones in between."""
    cores = pair(backend, **dict(dict(min_sparse_numel=1), **cfg))
    finished = []                   # by_kernel() of every batch call
    rng = np.random.default_rng(11)
    sizes = [1, 2, 3, 63, 64, 65, SMALL - 1, SMALL, SMALL + 1, 1000]
    names = [f"b{n}" for n in sizes]
    params = {n: rng.standard_normal(s).astype(F32) for n, s in zip(names, sizes)}
    for step in range(8):
        if backend == "torch":
            torch.set_num_threads((1, 2, 3)[step % 3])
        for c in cores:
            c.set_epoch(step * 0.6)
        rot = (3 * step) % len(sizes)
        order = list(range(len(sizes)))[rot:] + list(range(len(sizes)))[:rot]
        grads = _boundary_grads(rng, [sizes[i] for i in order], step)

        def entries():
            return [(names[i], convert(backend, g), convert(backend, params[names[i]]))
                    for i, g in zip(order, grads)]
        got, want, nm = run_step(cores, entries, splits=(4,) if step % 4 == 3 else (),
                                 finished=finished)
        check(cores[0], cores[1], got, want, nm, f"{cfg} step {step}")
    # the non-finite rows (small and large) are settled inside the batch: not all finished (and
    # where the config lets the kernel finish rows, in a call where it finished others)
    assert any(not all(done) for done in finished)
    if any(any(done) for done in finished):
        assert any(any(done) and not all(done) for done in finished)


FUZZ_CONFIGS = [
    dict(warmup_epochs=2, warmup_per_step=True, min_sparse_numel=50),
    dict(warmup_epochs=0, min_sparse_numel=50, weight_decay=5e-3, clip_norm=2.0, nesterov=True),
    dict(warmup_epochs=0, min_sparse_numel=50, momentum=0.0, wire_index="int32"),
    dict(warmup_epochs=1, min_sparse_numel=50, wire_values="float16", momentum_masking=False),
    dict(warmup_epochs=0, min_sparse_numel=50, compress_ratio=0.3, sample_ratio=0.2),
]


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", FUZZ_CONFIGS, ids=["warmup-per-step", "wd-clip-nesterov",
                                                   "m0-int32", "fp16-nomask", "ratio0.3"])
def test_fuzzed_buckets_mixed_kinds_new_tensors_and_split_calls(backend, cfg):
    """Random buckets: dense tensors (below min_sparse_numel), float16 / bfloat16 / float64 /
    transposed / strided gradients, tensors appearing for the first time mid-training, random
    order, NaN/Inf in random tensors, buckets cut into up to three compress_many calls, names
    coming back within a step (a new statistics step), the warm-up position moving by steps and
    the thread count changing. Statistics are compared after every call."""
    rng = np.random.default_rng(3 + FUZZ_CONFIGS.index(cfg))
    cores = pair(backend, **cfg)
    shapes = {"d1": (7,), "d2": (3, 4), "s1": (1, 60), "s2": (65,), "m1": (40, 50),
              "m2": (3001,), "m3": (257, 33), "L1": (SMALL + 1,), "L2": (SMALL,),
              "m4": (9000,), "t1": (64,), "z0": (0,), "z1": (2, 0), "sc": (), "m5": (20_000,)}
    kinds = ["", "", "", "f16", "f64", "T", "strided"] + (["bf16"] if backend == "torch"
                                                          else ["be"])
    pool = list(shapes)
    for step in range(8):
        if backend == "torch":
            torch.set_num_threads(int(rng.integers(1, 4)))
        for c in cores:
            c.set_step(step, 3)
        live = pool[:4 + 2 * step]                   # more tensors appear as training goes
        names = [str(x) for x in rng.permutation(live)]
        if step % 3 == 2:                            # a name seen again within the step
            names.append(names[0])
        grads, kind_of = {}, {}
        for j, n in enumerate(names):
            g = rng.standard_normal(shapes[n]).astype(F32)
            if rng.random() < 0.15 and g.size:
                g.flat[int(rng.integers(g.size))] = (np.nan, np.inf, -np.inf)[int(rng.integers(3))]
            grads[j] = g
            kind_of[j] = kinds[int(rng.integers(len(kinds)))]
        params = {n: rng.standard_normal(shapes[n]).astype(F32) for n in set(names)}

        def entries():
            return [(n, convert(backend, grads[j], kind_of[j]), convert(backend, params[n]))
                    for j, n in enumerate(names)]
        # calls: names must be distinct within a call; the repeated one goes to the last call
        n_calls = int(rng.integers(1, 4))
        cuts = sorted(set(int(x) for x in rng.integers(1, len(names) - 1, n_calls - 1)))
        if step % 3 == 2:
            cuts = sorted(set(cuts + [len(names) - 1]))

        def each_call(lo, hi):
            check_stats(cores[0], cores[1], f"step {step} after call [{lo}:{hi}]")
        got, want, nm = run_step(cores, entries, splits=cuts, each_call=each_call)
        # repeated names: compare per-entry results; the final state is compared once
        check(cores[0], cores[1], got, want, nm, f"{cfg} step {step}")


@needs_kernels
def test_huge_tensor_and_many_tiny_ones_in_one_bucket():
    """One 2**22+5 element tensor (many update chunks, several gather ranges, the large-tensor
    phase) with 150 tiny ones (finished inside their update task) in one bucket, 2 threads."""
    torch.set_num_threads(2)
    rng = np.random.default_rng(9)
    sizes = [2 ** 22 + 5] + [int(s) for s in rng.integers(1, 400, 150)]
    names = [f"p{i}" for i in range(len(sizes))]
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.001)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    for step in range(2):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        a = cores[0].compress_many([(n, torch.from_numpy(g), None)
                                    for n, g in zip(names, grads)], 8)
        b = [cores[1].compress(n, torch.from_numpy(g), 8) for n, g in zip(names, grads)]
        compare(b, a, cores[1], cores[0], names, f"step {step}")
    compare_stats(cores, "huge")
    assert isinstance(a[0][2], _BatchContext)          # the big one was finished by the kernel


@needs_kernels
@pytest.mark.parametrize("odd", ["float16", "new", "strided"])
def test_batch_keeps_entry_order_when_an_odd_entry_sits_in_the_middle(odd):
    # every entry ends up in the batch, but the middle one is classified the long way (a float16
    # gradient, a tensor seen for the first time, a non-contiguous gradient): the rows must still
    # follow the entries' order
    rng = np.random.default_rng(8)
    sizes = {"a": 30_000, "mid": 20_000, "b": 10_000}
    cores = [DGCCore(DGCConfig(warmup_epochs=0, seed=2), TorchBackend()) for _ in range(2)]
    for step in range(3):
        grads = {n: rng.standard_normal(k).astype(np.float32) for n, k in sizes.items()}

        def entries():
            out = []
            for n, g in grads.items():
                t = torch.from_numpy(g.copy())
                if n == "mid" and odd == "float16":
                    t = t.half()
                elif n == "mid" and odd == "strided":
                    t = torch.from_numpy(np.repeat(g, 2)).view(-1, 2)[:, 0]
                out.append((n, t, None))
            if odd == "new" and step == 0:                # "mid" first appears at step 1
                return [e for e in out if e[0] != "mid"]
            return out
        many = cores[0].compress_many(entries(), 2)
        one = [cores[1].compress(n, g, 2) for n, g, _ in entries()]
        assert len(many) == len(one)
        for (k1, p1, _), (k2, p2, _) in zip(many, one):
            assert k1 == k2 and torch.equal(p1, p2), step
        for n in cores[1].states:
            for attr in ("u", "v"):
                assert torch.equal(getattr(cores[0].states[n], attr),
                                   getattr(cores[1].states[n], attr)), (step, n, attr)


# =================================== 2. selection: threshold fallbacks, finished rows, random draws
@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kind", ["cauchy", "spiky", "ties", "sparse"])
def test_threshold_fallbacks_too_few_and_too_many_candidates(backend, kind):
    """Heavy tails and spikes make the sampled threshold overshoot (fewer than k/2 candidates:
    the batch kernel lowers the threshold or takes the exact top-k itself, compress() leaves it
    to the backend) or undershoot (more candidates than the plan's buffers); ties and mostly-zero
    gradients make the kernel give up. Many steps, small and large tensors."""
    cores = pair(backend, warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.005,
                 sample_ratio=0.002)
    finished = []                   # by_kernel() of every batch call
    rng = np.random.default_rng(53)
    sizes = [40_000, 100_000, SMALL + 1, 3000]
    names = [f"f{i}" for i in range(len(sizes))]
    for step in range(12):
        grads = []
        for n in sizes:
            if kind == "cauchy":
                g = rng.standard_cauchy(n)
            elif kind == "spiky":
                g = rng.standard_normal(n) * 1e-3
                g[rng.integers(0, n, 8)] = rng.standard_normal(8) * 1e3
                if step % 2:
                    g[: n // 3] = rng.standard_normal(n // 3) * 10    # undershoot
            elif kind == "ties":
                g = rng.integers(-2, 3, n).astype(float)
            else:
                g = rng.standard_normal(n) * (rng.random(n) < 0.003)
            grads.append(g.astype(F32))

        def entries():
            return [(n, convert(backend, g), None) for n, g in zip(names, grads)]
        got, want, nm = run_step(cores, entries, finished=finished)
        check(cores[0], cores[1], got, want, nm, f"{kind} step {step}")
    # cauchy / spiky: the kernel settles every row itself (all-finished path) in some call;
    # ties / sparse: some rows are left to the backend
    if kind in ("cauchy", "spiky"):
        assert any(all(done) for done in finished)
    else:
        assert any(not all(done) for done in finished)


@needs_kernels
def test_finished_and_unfinished_rows_interleave():
    """Rows the kernel finishes and rows it leaves to the backend (ties at the k-th magnitude,
    all zeros) alternate inside one call: the compaction of the batch
    buffers must still hand every finished row its own indices / values / u_sent / payload."""
    rng = np.random.default_rng(21)
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.01)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    seen = []                       # by_kernel() of every call (all 12 entries are batch rows)
    names = [f"r{i}" for i in range(12)]
    for step in range(3):
        grads = []
        for i in range(12):
            n = 3000 + 997 * i
            if i % 3 == 1:
                g = np.ones(n, F32)                               # all tied: backend's top-k
            elif i % 3 == 2 and step == 0:
                g = np.zeros(n, F32)
            else:
                g = rng.standard_normal(n).astype(F32)
            grads.append(g)
        a = cores[0].compress_many([(n, torch.from_numpy(g), None)
                                    for n, g in zip(names, grads)], 2)
        seen.append(by_kernel(a))
        b = [cores[1].compress(n, torch.from_numpy(g), 2) for n, g in zip(names, grads)]
        compare(b, a, cores[1], cores[0], names, f"step {step}")
        for (kind, payload, ctx), n in zip(a, names):   # valid payloads that decode
            wire.decode_sum(cores[0].B, payload, cores[0].states[n].numel, 1, n)
    # in one call: a finished row after an unfinished one after a finished one
    assert any(any(f[i] and not f[i + 1] and f[i + 2] for i in range(len(f) - 2)) for f in seen)
    compare_stats(cores, "interleave")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sample_draws_batch_and_match_sample(backend):
    # the kernels draw a bucket's uniforms in one call: the same values as one call per tensor,
    # into a buffer or not; and sample() gathers at sparsify.sample_positions of those draws
    from dgc_horovod.core.sparsify import sample_positions
    B = BACKENDS[backend]()
    g1, g2, g3 = B.generator(5), B.generator(5), B.generator(5)
    one = np.asarray(B.sample_uniform(777 + 5 + 1000, g1))
    buf = B.empty(5, "float64", like=np.zeros(1, np.float32) if backend == "numpy"
                  else torch.zeros(1))
    parts = [np.asarray(B.sample_uniform(777, g2)), np.asarray(B.sample_uniform(5, g2, buf)).copy(),
             np.asarray(B.sample_uniform(1000, g2))]
    assert np.array_equal(one, np.concatenate(parts))
    assert one.dtype == np.float64 and one.min() >= 0.0 and one.max() < 1.0
    for n in (1, 2, 1000, 2 ** 31 - 1):
        pos = sample_positions(np.asarray(B.sample_uniform(300, g3)), n)
        assert pos.min() >= 0 and pos.max() < n
    x = np.arange(1000, dtype=np.float32)
    got = np.asarray(B.sample(x if backend == "numpy" else torch.from_numpy(x), 300,
                              B.generator(9)))
    assert np.array_equal(got, x[sample_positions(np.asarray(
        B.sample_uniform(300, B.generator(9))), 1000)])
    edge = sample_positions(np.array([0.0, np.nextafter(1.0, 0.0), 0.5]), 2 ** 31 - 1)
    assert edge.tolist() == [0, 2 ** 31 - 2, (2 ** 31 - 1) // 2]


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_batch_draws_come_before_a_tensor_op_entry_in_between(backend):
    # a bucket whose middle tensor runs on tensor ops (its plan refused): the batch rows before
    # it draw their samples first, so every tensor gets the draws one compress() per tensor gives
    B = BACKENDS[backend]()
    rng = np.random.default_rng(3)
    data = {name: rng.standard_normal(n).astype(np.float32)
            for name, n in (("a", 50_000), ("mid", 40_000), ("b", 30_000), ("c", 20_000))}
    conv = (lambda x: x.copy()) if backend == "numpy" else (lambda x: torch.from_numpy(x.copy()))
    cores = [DGCCore(DGCConfig(warmup_epochs=0, seed=4), B) for _ in range(2)]
    for core in cores:
        core.compress("mid", conv(data["mid"]), 2)          # creates its state (and one draw)
        core.states["mid"].plan = False                    # tensor ops only for this one
    for step in range(3):
        grads = {name: rng.standard_normal(x.size).astype(np.float32) for name, x in data.items()}
        many = cores[0].compress_many([(n, conv(g), None) for n, g in grads.items()], 2)
        one = [cores[1].compress(n, conv(g), 2) for n, g in grads.items()]
        for (k1, p1, _), (k2, p2, _) in zip(many, one):
            assert k1 == k2 == "sparse" and np.array_equal(np.asarray(p1), np.asarray(p2)), step
        for name in data:
            for attr in ("u", "v"):
                assert np.array_equal(np.asarray(getattr(cores[0].states[name], attr)),
                                      np.asarray(getattr(cores[1].states[name], attr)))


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_density_crossing_the_sampling_limit_between_calls(backend):
    """A warm-up from density 0.6 (k >= n/2: exact top-k, no draws) down to 0.002 (sampled), the
    position set by set_step and set_epoch between calls and even between the two calls of one
    step; small tensors cross the sampled / not-sampled limit at different points."""
    cores = pair(backend, warmup_epochs=3, warmup_initial_density=0.6, compress_ratio=0.002,
                 warmup_per_step=True, min_sparse_numel=1)
    rng = np.random.default_rng(23)
    sizes = [3, 4, 5, 9, 17, 64, 100, 1000, 20_000, SMALL + 1]
    names = [f"w{n}" for n in sizes]
    for step in range(10):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        half = len(sizes) // 2

        def entries():
            return [(n, convert(backend, g), None) for n, g in zip(names, grads)]
        ea, eb = entries(), entries()
        for c in cores:
            c.set_step(step, 3)
        got = cores[0].compress_many(ea[:half], 2)
        want = [cores[1].compress(n, g, 2) for n, g, _ in eb[:half]]
        for c in cores:
            c.set_epoch(step / 3 + 0.17)         # the density moves within the step
        got += cores[0].compress_many(ea[half:], 2)
        want += [cores[1].compress(n, g, 2) for n, g, _ in eb[half:]]
        check(cores[0], cores[1], got, want, names, f"step {step}")


# ============================================================================= 3. non-finite values
@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_nonfinite_small_and_large_for_several_steps_then_finite(backend):
    """The same tensors non-finite for three steps in a row (small: NaN, large: Inf), then
    finite: their draws are consumed every step, their state never changes meanwhile."""
    cores = pair(backend, warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.01)
    rng = np.random.default_rng(5)
    sizes = [SMALL, 5000, SMALL + 1, 70_000, 64]
    names = [f"n{i}" for i in range(len(sizes))]
    for step in range(7):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        if 1 <= step <= 3:
            grads[0][-1] = np.nan
            grads[2][0] = np.inf
            grads[4][step] = -np.inf
        before = {n: raw(cores[0].states[n].v) for n in names} if step else None

        def entries():
            return [(n, convert(backend, g), None) for n, g in zip(names, grads)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"step {step}")
        if 1 <= step <= 3:
            for i in (0, 2, 4):
                assert raw(cores[0].states[names[i]].v) == before[names[i]]
    assert cores[0].total_stats.nonfinite_tensors == 9


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_velocity_overflowing_to_inf(backend):
    """Finite gradients whose accumulated velocity overflows float32 (u, v = inf, and inf sent):
    the batch kernel's threshold, block maxima and selection must treat inf as the backend does.
    (One huge entry per tensor so that the torch tensor-op path's sum-based finiteness check does
    not overflow.)"""
    rng = np.random.default_rng(3)
    cores = path_cores(backend, warmup_epochs=0, min_sparse_numel=1, momentum_masking=False)
    sizes = [5000, 100_000, 3000, 70_000]
    names = [f"w{i}" for i in range(len(sizes))]
    for step in range(5):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        grads[1][7] = 2.5e38
        grads[2][:] = 0.0
        grads[2][3] = 3.0e38

        def entries():
            return [(n, convert(backend, g, ""), None) for n, g in zip(names, grads)]
        batch, single, ops, ops_many = step_all(cores, entries)
        compare(single, batch, cores[1], cores[0], names, f"step {step} batch vs single")
        compare(single, ops, cores[1], cores[2], names, f"step {step} ops vs single")
        compare(single, ops_many, cores[1], cores[3], names, f"step {step} ops buckets vs single")
    assert np.isinf(to_np(cores[0].states["w1"].u)).any()     # the overflow did happen
    compare_stats(cores, "overflow")


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("bad", ["nan-param", "overflow"])
def test_weight_decay_nonfinite_only_after_adding_decay_small_tensor(backend, bad):
    """A finite gradient whose weight-decayed gradient g + wd·param is not finite (a NaN in the
    parameter, or a sum overflowing float32). compress() checks the gradient itself (finite) and
    accumulates; compress_many must do the same for a small tensor (<= SMALL_NUMEL), whose
    check the batch kernel makes."""
    cores = pair(backend, warmup_epochs=0, weight_decay=0.5)
    rng = np.random.default_rng(2)
    sizes = [5000, SMALL + 1]
    names = ["small", "large"]
    for step in range(2):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        params = [rng.standard_normal(n).astype(F32) for n in sizes]
        if step == 1:
            for g, p in zip(grads, params):
                if bad == "nan-param":
                    p[7] = np.nan
                else:
                    g[7], p[7] = 3.0e38, 3.0e38          # 3e38 + 0.5 * 3e38 = inf
            assert all(np.isfinite(g).all() for g in grads)

        def entries():
            return [(n, convert(backend, g), convert(backend, p))
                    for n, g, p in zip(names, grads, params)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"{bad} step {step}")


@needs_kernels
def test_nan_in_the_residual_threshold_overshoot_torch():
    """A NaN in a large tensor's residual v (here: a NaN parameter with weight decay, which both
    paths accumulate for a tensor > SMALL_NUMEL). When the sampled threshold overshoots
    (candidates < k/2), compress() takes torch.topk over |v| (NaN counts as largest) and drops
    the NaN: k - 1 entries; the batch kernel lowers the threshold / takes its own top-k
    (comparisons with NaN are false): k entries."""
    conf = DGCConfig(warmup_epochs=0, weight_decay=1e-2)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    rng = np.random.default_rng(0)
    sizes = [300_000, 100_000]
    names = ["t0", "t1"]
    params = [rng.standard_normal(n).astype(F32) for n in sizes]
    params[0][7] = np.nan
    for step in range(8):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]

        def entries():
            return [(n, torch.from_numpy(g.copy()), torch.from_numpy(p.copy()))
                    for n, g, p in zip(names, grads, params)]
        got, want, nm = run_step(cores, entries, world=2)
        check(cores[0], cores[1], got, want, nm, f"step {step}")


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", [dict(), dict(momentum=0.0, momentum_masking=False),
                                 dict(momentum_masking=False), dict(wire_index="int32")],
                         ids=["defaults", "m0", "nomask", "int32"])
def test_decompress_after_nonfinite_rank_restores_batch_contexts(backend, cfg):
    """Another rank's non-finite gradient: decompress restores what this rank sent from the
    batch context's lazy views (indices, values, u_sent of the shared batch buffers) exactly as
    from compress()'s contexts, for every tensor of the bucket, in any order."""
    rng = np.random.default_rng(8)
    conf = DGCConfig(**dict(dict(warmup_epochs=0, min_sparse_numel=1), **cfg))
    cores = [DGCCore(conf, BACKENDS[backend]()) for _ in range(2)]
    sizes = [3000, 70_001, 5, 4099, 1000]
    names = [f"d{i}" for i in range(len(sizes))]
    B = cores[0].B
    for step in range(3):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        a = cores[0].compress_many([(n, convert(backend, g, ""), None)
                                    for n, g in zip(names, grads)], 2)
        b = [cores[1].compress(n, convert(backend, g, ""), 2) for n, g in zip(names, grads)]
        compare(b, a, cores[1], cores[0], names, f"step {step}")
        order = list(range(len(names)))[::-1] if step % 2 else list(range(len(names)))
        for i in order:
            n = names[i]
            nonfinite = wire.encode(B, sizes[i], B.empty_indices(like=a[i][1]),
                                    B.zeros(0, like=cores[0].states[n].v), wire.FLAG_NONFINITE,
                                    conf.wire_index, conf.wire_values)
            outs = []
            for core, res in ((cores[0], a[i]), (cores[1], b[i])):
                gathered = B.cat([res[1], nonfinite]) if step != 1 else B.cat([nonfinite, res[1]])
                outs.append(core.decompress(gathered, res[2], 2))
            assert np.isnan(to_np(outs[0])).all() and np.isnan(to_np(outs[1])).all()
            for attr in ("u", "v"):
                assert raw(getattr(cores[0].states[n], attr)) == \
                    raw(getattr(cores[1].states[n], attr)), (step, n, attr)
        # the kernel finished (and compacted) some of the rows whose contexts were restored
        assert any(isinstance(r[2], _BatchContext) for r in a) == (conf.wire_index != "int32")


# ==================================================================================== 4. statistics
@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_one_call_vs_several_calls_per_step_statistics(backend):
    """Statistics with buckets cut at every possible point, and calls that start a new step in
    their middle (a name already seen), all entries fused or some dense / non-finite."""
    cores = pair(backend, warmup_epochs=0, min_sparse_numel=100)
    rng = np.random.default_rng(17)
    sizes = {"A": 5000, "B": 30, "C": 4000, "D": SMALL + 1, "E": 700, "F": 3000}
    calls = [["A", "C"], ["E", "F", "A"], ["C", "D"], ["B", "A", "E"], ["F"], ["D", "C", "B", "A"],
             ["E", "F", "D"], ["A", "B", "C", "D", "E", "F"], ["A", "B"]]
    for i, call in enumerate(calls):
        grads = [rng.standard_normal(sizes[n]).astype(F32) for n in call]
        if i % 3 == 1:
            grads[-1][0] = np.nan

        def entries():
            return [(n, convert(backend, g), None) for n, g in zip(call, grads)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"call {i} {call}")


@needs_kernels
def test_statistics_of_split_buckets_and_repeated_names_all_fused():
    """Buckets of one step in several calls; a name coming back in a later call starts a new
    step, exactly as with compress() per tensor (every entry fused here)."""
    rng = np.random.default_rng(2)
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    calls = [["A", "B"], ["C", "D", "E"], ["A", "C"], ["B", "F"], ["D", "E", "A"], ["B", "C"]]
    for call in calls:
        grads = [rng.standard_normal(4000).astype(F32) for _ in call]
        cores[0].compress_many([(n, torch.from_numpy(g), None) for n, g in zip(call, grads)], 2)
        for n, g in zip(call, grads):
            cores[1].compress(n, torch.from_numpy(g), 2)
        compare_stats(cores, call)


@needs_kernels
@pytest.mark.parametrize("nonbatched", ["nonfinite", "dense"])
def test_statistics_when_a_step_starts_inside_a_call_with_a_nonbatched_entry(nonbatched):
    """Entries outside the batch (non-finite, dense) are counted in entry order with the
    batched ones (a regression test: they used to be counted before them)."""
    rng = np.random.default_rng(1)
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=100)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    calls = [[("A", 5000), ("B", 5000)], [("A", 5000), ("C", 5000 if nonbatched ==
                                                           "nonfinite" else 10)]]
    for call in calls:
        grads = []
        for name, n in call:
            g = rng.standard_normal(n).astype(F32)
            if name == "C" and nonbatched == "nonfinite":
                g[3] = np.nan
            grads.append(g)
        cores[0].compress_many([(n, torch.from_numpy(g), None)
                                for (n, _), g in zip(call, grads)], 2)
        for (n, _), g in zip(call, grads):
            cores[1].compress(n, torch.from_numpy(g), 2)
    # per tensor: the second A starts step 2, which then holds A and C
    assert cores[1].step_stats.tensors == 2
    compare_stats(cores, "step started inside a call")


@pytest.mark.parametrize("many", [False, True], ids=["compress", "compress_many"])
def test_step_statistics_of_the_first_step_after_a_resume(many):
    """(Not specific to compress_many.) A checkpoint taken between steps and loaded into a new
    core: the first step after the resume must have the step statistics of that step alone, as in
    the uninterrupted run. load_state_dict empties the set of names seen in the step but keeps
    the saved step_stats, so the resumed core adds the new step onto the saved one."""
    conf = DGCConfig(warmup_epochs=0)
    g = np.ones(5000, F32)
    a, b = DGCCore(conf, NumpyBackend()), DGCCore(conf, NumpyBackend())

    def step(c):
        if many:
            c.compress_many([("A", g.copy(), None), ("B", g.copy(), None)], 1)
        else:
            c.compress("A", g.copy(), 1)
            c.compress("B", g.copy(), 1)
    for c in (a, b):
        step(c)
    resumed = DGCCore(conf, NumpyBackend())
    resumed.load_state_dict(b.state_dict())
    for c in (a, resumed):
        step(c)
    assert a.step_stats.tensors == 2
    check_stats(resumed, a, "first step after the resume", ("resumed", "uninterrupted"))


# =================================================================== 5. state changes between calls
@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_state_dict_into_fresh_cores_between_calls(backend):
    """Mid-run checkpoints: (step 1) both cores are replaced by brand-new cores loaded from their
    state_dicts, and the per-tensor core's candidate buffers are then grown (as a higher warm-up
    density would have left them) so that the two cores' plans differ; (step 3) the cores swap
    checkpoints, each resuming the other's; (step 5) both reload their own checkpoint between
    the two calls of a step."""
    cfg = dict(warmup_epochs=2, min_sparse_numel=10, weight_decay=1e-3)
    cores = pair(backend, **cfg)
    rng = np.random.default_rng(31)
    sizes = [5, 3000, SMALL, SMALL + 1, 64]
    names = [f"c{i}" for i in range(len(sizes))]
    params = [rng.standard_normal(n).astype(F32) for n in sizes]

    def fresh(state):
        c = DGCCore(DGCConfig(**cfg), BACKENDS[backend]())
        c.load_state_dict(state, world_size=4, rank=0)
        return c
    for step in range(7):
        for c in cores:
            c.set_epoch(step * 0.5)
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        if step == 4:
            grads[2][5] = np.nan

        def entries():
            return [(n, convert(backend, g), convert(backend, p))
                    for n, g, p in zip(names, grads, params)]

        def reload_mid_step(lo, hi):
            if step == 5 and lo == 0:
                for c in cores:
                    c.load_state_dict(c.state_dict(world_size=4, rank=0), world_size=4, rank=0)
                check_stats(cores[0], cores[1], "after the mid-step reload")
        got, want, nm = run_step(cores, entries, splits=(2,) if step % 2 else (),
                                 each_call=reload_mid_step)
        check(cores[0], cores[1], got, want, nm, f"step {step}")
        if step == 1:
            cores = [fresh(c.state_dict(world_size=4, rank=0)) for c in cores]
        elif step == 2:                  # grow the per-tensor core's candidate buffers only
            c = cores[1]
            for st in c.states.values():
                if st.plan:
                    st.plan.set_density(c.B, st.numel, c.config, 0.45)
                    st.plan.set_density(c.B, st.numel, c.config, c.density)
            assert any(st.plan and st.plan.cap > cores[0].states[n].plan.cap
                       for n, st in c.states.items())
        elif step == 3:
            sd = [c.state_dict(world_size=4, rank=0) for c in cores]
            cores = [fresh(sd[1]), fresh(sd[0])]


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_load_state_dict_between_calls_replays_bit_identically(backend):
    """A state_dict taken between two compress_many calls and loaded back (new u / v tensors,
    the plans' cached pointers now stale) replays the second call bit for bit, and matches the
    per-tensor path doing the same."""
    rng = np.random.default_rng(4)
    conf = DGCConfig(warmup_epochs=1, min_sparse_numel=1)
    cores = [DGCCore(conf, BACKENDS[backend]()) for _ in range(2)]
    sizes = [10, 5000, 70_001, 300]
    names = [f"s{i}" for i in range(len(sizes))]
    steps = [[rng.standard_normal(n).astype(F32) for n in sizes] for _ in range(3)]

    def go(i, which):
        e = [(n, convert(backend, g, ""), None) for n, g in zip(names, steps[i])]
        if which == 0:
            return cores[0].compress_many(e, 2)
        return [cores[1].compress(n, g, 2) for n, g, _ in e]
    for w in (0, 1):
        go(0, w)
    snaps = [c.state_dict() for c in cores]
    for c in cores:
        c.set_epoch(0.5)                                   # density changes too
    first = [go(1, w) for w in (0, 1)]
    first_state = [{n: (raw(c.states[n].u), raw(c.states[n].v)) for n in names} for c in cores]
    compare(first[1], first[0], cores[1], cores[0], names, "before reload")
    for c, s in zip(cores, snaps):
        old_v = c.states[names[1]].v
        c.load_state_dict(s)
        assert c.states[names[1]].v is not old_v
        c.set_epoch(0.5)
    again = [go(1, w) for w in (0, 1)]
    for w in (0, 1):
        compare(first[w], again[w], cores[w], cores[w], names, f"replay {w}", check_state=False)
        assert {n: (raw(cores[w].states[n].u), raw(cores[w].states[n].v))
                for n in names} == first_state[w]
    compare(go(2, 1), go(2, 0), cores[1], cores[0], names, "after the reload")
    compare_stats(cores, "reload")


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_use_kernels_switched_between_calls(backend):
    """use_kernels turned off and on again between steps, on the batch core only (its plans
    go stale: densities move on meanwhile) or on both."""
    cores = pair(backend, warmup_epochs=2, warmup_per_step=True, min_sparse_numel=1)
    rng = np.random.default_rng(61)
    sizes = [3000, SMALL + 1, 17, 70_000]
    names = [f"k{i}" for i in range(len(sizes))]
    for step in range(8):
        cores[0].use_kernels = step % 3 != 1
        cores[1].use_kernels = step not in (4, 5)
        for c in cores:
            c.set_step(step, 3)
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]

        def entries():
            return [(n, convert(backend, g), None) for n, g in zip(names, grads)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"step {step}")


# ========================================================================= 6. threads and processes
@needs_kernels
def test_batch_with_many_threads_matches_single_with_one_thread():
    """The kernels' results must not depend on the thread count: compress_many with 4 threads
    against compress() per tensor with 1 thread (no clipping: torch's norm may round
    differently with other thread counts)."""
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.01)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    rng = np.random.default_rng(41)
    sizes = [SMALL + 1, 2 ** 20 + 3, 5000, 64, SMALL, 131_073, 7]
    names = [f"p{i}" for i in range(len(sizes))]
    for step in range(4):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        if step == 2:
            grads[1][-1] = np.nan
            grads[3][0] = np.inf
        torch.set_num_threads(70 if step == 3 else 4)      # 70: above the pool's 64
        got = cores[0].compress_many([(n, torch.from_numpy(g.copy()), None)
                                      for n, g in zip(names, grads)], 2)
        torch.set_num_threads(1)
        want = [cores[1].compress(n, torch.from_numpy(g.copy()), 2) for n, g in zip(names, grads)]
        check(cores[0], cores[1], got, want, names, f"step {step}")


def _bucket(rng, sizes):
    return [rng.standard_normal(n).astype(F32) for n in sizes]


@needs_kernels
def test_compress_many_from_several_python_threads_on_different_cores():
    """Several Python threads, each with its own DGCCore, call compress_many at the same time
    (the kernels release the GIL; one gets the pool, the others run inline): every core ends
    exactly where a serial run ends."""
    torch.set_num_threads(2)
    sizes = [200_000, 70_001, 3000, 64, 150_000, 9]
    names = [f"c{i}" for i in range(len(sizes))]
    rng = np.random.default_rng(12)
    steps = [_bucket(rng, sizes) for _ in range(6)]
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.01)

    def run(core, out):
        for grads in steps:
            out.append(core.compress_many([(n, torch.from_numpy(g), None)
                                           for n, g in zip(names, grads)], 2))
    ref_core, ref = DGCCore(conf, TorchBackend()), []
    run(ref_core, ref)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(4)]
    outs = [[] for _ in cores]
    errors = []

    def target(c, o):
        try:
            run(c, o)
        except BaseException as e:                       # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=target, args=(c, o)) for c, o in zip(cores, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    for core, out in zip(cores, outs):
        for s, (a, b) in enumerate(zip(ref, out)):
            compare(a, b, ref_core, core, names, f"step {s}", check_state=False)
        for n in names:
            assert raw(core.states[n].v) == raw(ref_core.states[n].v)
            assert raw(core.states[n].u) == raw(ref_core.states[n].u)


@needs_kernels
def test_compress_many_from_several_python_threads_on_one_core():
    """Python threads sharing one DGCCore (disjoint tensors; exact top-k, so no random draws
    whose order would depend on the interleaving): the core's lock serialises them and each
    tensor ends as in a serial run."""
    torch.set_num_threads(2)
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.01, exact_topk=True)
    rng = np.random.default_rng(13)
    groups = [[f"g{j}_{i}" for i in range(4)] for j in range(3)]
    sizes = [100_000, 5000, 70_001, 17]
    data = {j: [_bucket(rng, sizes) for _ in range(4)] for j in range(3)}
    ref = DGCCore(conf, TorchBackend())
    for j in range(3):
        for grads in data[j]:
            ref.compress_many([(n, torch.from_numpy(g), None)
                               for n, g in zip(groups[j], grads)], 2)
    core = DGCCore(conf, TorchBackend())
    errors = []

    def target(j):
        try:
            for grads in data[j]:
                core.compress_many([(n, torch.from_numpy(g), None)
                                    for n, g in zip(groups[j], grads)], 2)
        except BaseException as e:                       # pragma: no cover
            errors.append(e)
    threads = [threading.Thread(target=target, args=(j,)) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    for names in groups:
        for n in names:
            assert raw(core.states[n].v) == raw(ref.states[n].v), n
            assert raw(core.states[n].u) == raw(ref.states[n].u), n
    assert core.total_stats.tensors == ref.total_stats.tensors == 48
    assert core.total_stats.selected == ref.total_stats.selected


class _ThreadedNumpy(NumpyBackend):
    """NumPy backend whose kernels use `threads` threads of the pool (no torch involved)."""

    def __init__(self, threads):
        self.threads = threads

    def kernel_threads(self):
        return self.threads


@needs_kernels
def test_fork_after_the_pool_was_used():
    """fork() after the pool has run with 4 threads, while another Python thread keeps it busy:
    the child checks tensors with all_finite and computes compress_many with 2 threads correctly
    and exits; nothing hangs.
    (NumPy tensors: a forked child's torch ops can hang in torch's own OpenMP pool when a parent
    thread used it, whatever DGC does.)"""
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1)
    rng = np.random.default_rng(0)
    grads = _bucket(rng, [300_000, 200_000, 5000, 70_000, 3])
    names = [f"f{i}" for i in range(len(grads))]

    def entries():
        return [(n, g.copy(), None) for n, g in zip(names, grads)]
    expected = [r[1].copy() for r in DGCCore(conf, NumpyBackend()).compress_many(entries(), 2)]
    busy = DGCCore(conf, _ThreadedNumpy(4))
    busy.compress_many(entries(), 2)
    stop = threading.Event()

    def keep_busy():
        while not stop.is_set():
            busy.compress_many(entries(), 2)
    bg = threading.Thread(target=keep_busy)
    bg.start()
    try:
        for attempt in range(8):
            time.sleep(0.003 * attempt)
            pid = os.fork()
            if pid == 0:                                      # the child: never returns
                code = 4
                try:
                    xs = [np.ones(140_000, F32) for _ in range(6)]   # 2 chunks each
                    xs[4][-1] = np.nan
                    ok = [kernels.all_finite(x.size, x.ctypes.data, 2) for x in xs]
                    results = []
                    for _ in range(3):
                        got = DGCCore(conf, _ThreadedNumpy(2)).compress_many(entries(), 2)
                        results.append(all(np.array_equal(r[1], e)
                                           for r, e in zip(got, expected)))
                    code = 0 if all(results) and ok == [True] * 4 + [False, True] else 3
                finally:
                    os._exit(code)
            deadline = time.time() + 20
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.time() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    pytest.fail(f"forked child {attempt} hung")
                time.sleep(0.005)
            assert os.waitstatus_to_exitcode(status) == 0, f"child {attempt}: wrong result"
    finally:
        stop.set()
        bg.join(60)


_POOL_RACE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from dgc_horovod.core import kernels
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    # regions of the pool with few tasks (all_finite of 2 chunks: 1 worker wanted) alternating
    # with regions of many tasks (64 chunks of 4 x 65,536: 63 workers); a chunk not checked when
    # all_finite returns reads as not finite, so a region that ends early makes a finite tensor
    # look bad
    small = np.ones(2 << 16, np.float32)
    wide = np.ones(256 << 16, np.float32)
    t0, it = time.time(), 0
    while time.time() - t0 < float(sys.argv[1]):
        kernels.all_finite(small.size, small.ctypes.data, 64)
        ok = kernels.all_finite(wide.size, wide.ctypes.data, 64)
        it += 1
        if not ok:
            print(f"iteration {it}: a finite tensor reported not finite")
            sys.exit(1)
    print(f"{it} iterations, all correct")
""")


@needs_kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_thread_pool_regions_of_alternating_width():
    """Regression test of a pool race: a worker left out of a region must not join the next,
    wider region as if it were the old one (P.gen now carries the wanted count)."""
    proc = subprocess.run([sys.executable, "-c", _POOL_RACE, "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr


_DENORMAL = textwrap.dedent("""
    import numpy as np, torch
    from dgc_horovod.core import DGCConfig, DGCCore
    from dgc_horovod.backends.torch_backend import TorchBackend
    torch.set_num_threads(2)
    # the kernels' thread pool starts here, with the default floating-point mode
    DGCCore(DGCConfig(warmup_epochs=0), TorchBackend()).compress_many(
        [(f"w{i}", torch.randn(300_000), None) for i in range(4)], 2)
    torch.set_flush_denormal(True)          # denormals are zero, on this thread
    rng = np.random.default_rng(0)
    grads = [rng.integers(1, 2 ** 23, 200_000).astype(np.int32).view(np.float32)
             for _ in range(30)]                                    # denormal gradients
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1)
    a, b = DGCCore(conf, TorchBackend()), DGCCore(conf, TorchBackend())
    ra = a.compress_many([(f"t{i}", torch.from_numpy(g), None) for i, g in enumerate(grads)], 2)
    rb = [b.compress(f"t{i}", torch.from_numpy(g), 2) for i, g in enumerate(grads)]
    same_v = [torch.equal(a.states[f"t{i}"].v.view(torch.int32),
                          b.states[f"t{i}"].v.view(torch.int32)) for i in range(30)]
    same_p = [torch.equal(x[1], y[1]) for x, y in zip(ra, rb)]
    print(sum(same_v), sum(same_p))
""")


@needs_kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_flush_denormal_set_after_the_kernel_pool_started():
    """torch.set_flush_denormal(True) after the kernels' pool threads were started: the calling
    thread flushes denormals, the pool workers do not, so the result depends on which thread ran
    a row (compress_many and compress() spread work differently)."""
    proc = subprocess.run([sys.executable, "-c", _DENORMAL], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["30", "30"], \
        f"tensors with equal v / equal payload out of 30: {proc.stdout.strip()}"


# ================================================================ 7. the tensor-op path in buckets
# compress_many on tensor ops (use_kernels = False; CUDA tensors, TensorFlow): bucket_ops runs the
# steps over the bucket's flat state, with O(1) backend calls per bucket. Same results as one
# compress() per tensor on tensor ops (cores[1] here), and so as the kernels (sections 1 and 3).
def ops_pair(backend, **cfg):
    conf = DGCConfig(**dict(dict(warmup_epochs=0, min_sparse_numel=1), **cfg))
    B = backend() if isinstance(backend, type) else BACKENDS[backend]()
    cores = [DGCCore(conf, B) for _ in range(2)]
    for c in cores:
        c.use_kernels = False
    return cores


def ops_step(cores, names, grads, conv, params=None, world=4, splits=()):
    """cores[0]: compress_many over the bucket cut at splits; cores[1]: compress() per tensor
    (with global clipping, the step's clip_scale is 0.7)."""
    params = params or [None] * len(names)
    scale = 0.7 if cores[0].needs_clip_scale else None
    e = [(n, conv(g), None if p is None else conv(p)) for n, g, p in zip(names, grads, params)]
    cuts = [0, *splits, len(e)]
    got = [r for lo, hi in zip(cuts, cuts[1:])
           for r in cores[0].compress_many(e[lo:hi], world, clip_scale=scale)]
    want = [cores[1].compress(n, conv(g), world, param=None if p is None else conv(p),
                              clip_scale=scale) for n, g, p in zip(names, grads, params)]
    return got, want


def _conv(backend):
    if backend == "numpy":
        return lambda a: np.array(a, dtype=F32)
    if backend == "torch":
        return lambda a: torch.from_numpy(np.array(a, dtype=F32))
    import tensorflow as tf
    return lambda a: tf.constant(np.array(a, dtype=F32))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", CONFIGS + [
    dict(warmup_epochs=0, weight_decay=0.5),
    dict(warmup_epochs=0, clip_norm=0.5, clip_scope="global", weight_decay=0.5),
    dict(warmup_epochs=0, clip_norm=0.5, clip_scope="global", weight_decay=0.5,
         weight_decay_mode="separate")],
    ids=CFG_IDS + ["wd", "global-clip-wd", "global-clip-wd-separate"])
def test_bucket_ops_matches_per_tensor_ops(backend, cfg):
    """Sizes around the sampling limits (n < 64 samples, k >= n/2: no sampling), ties, NaN/Inf in
    the first / middle / last / every tensor, new tensors joining, the bucket cut differently
    from step to step (its flat state is rebuilt), weight decay (accumulated: the module's
    setting; separate) and clipping (per tensor: the module's setting; global); results, state,
    generator and statistics bit for bit."""
    rng = np.random.default_rng(11)
    cores = ops_pair(backend, **cfg)
    sizes = [1, 3, 64, 129, 1000, 4099, 70_001, 5, 20_000]
    names = [f"b{i}" for i in range(len(sizes))]
    for step in range(8):
        n_tensors = len(sizes) - (2 if step < 2 else 0)           # two tensors join at step 2
        grads = _boundary_grads(rng, sizes, step)[:n_tensors]
        params = [rng.standard_normal(n).astype(F32) for n in sizes[:n_tensors]]
        splits = [(), (4,), (2, 6), ()][step % 4]
        got, want = ops_step(cores, names[:n_tensors], grads, _conv(backend), params,
                             splits=splits)
        check(cores[0], cores[1], got, want, names[:n_tensors], f"step {step}")


def test_bucket_ops_on_tensorflow():
    """The same on the TensorFlow backend (tf.Variable state: no views, the bucket's flat
    buffers are copied in and out), NaN in one step, weight decay."""
    from dgc_horovod.backends.tf_backend import TFBackend
    rng = np.random.default_rng(12)
    for cfg in (dict(), dict(weight_decay=1e-2, weight_decay_mode="accumulated", nesterov=True,
                             clip_norm=1.0)):
        cores = ops_pair(TFBackend, **cfg)
        sizes = [3000, 64, 70_001, 7]
        names = [f"f{i}" for i in range(len(sizes))]
        for step in range(4):
            grads = _boundary_grads(rng, sizes, step)
            params = [rng.standard_normal(n).astype(F32) for n in sizes]
            got, want = ops_step(cores, names, grads, _conv("tensorflow"), params)
            check(cores[0], cores[1], got, want, names, f"{cfg} step {step}")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kind", ["ties", "zeros", "nan-residual", "inf-residual", "spiky"])
def test_bucket_ops_settle_rule_edge_cases(backend, kind):
    """The segments the bucket cannot settle by comparison go to the per-tensor rule
    (sparsify.select_above / top-k): ties at the k-th magnitude, a zero k-th magnitude (mostly
    zero tensors), NaN / inf in the residual, too few candidates (a few spikes)."""
    rng = np.random.default_rng(13)
    cores = ops_pair(backend, momentum_masking=False)
    sizes = [10_000, 3000, 50_000]
    names = ["x", "y", "z"]
    conv = _conv(backend)
    for step in range(4):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        if kind == "ties":
            grads[step % 3] = np.round(grads[step % 3]).astype(F32)
        elif kind == "zeros":
            grads[1][:] = 0.0
            grads[1][:3] = 1.0
            grads[2][rng.random(sizes[2]) < 0.999] = 0.0
        elif kind == "spiky":
            grads[0] = (rng.random(sizes[0]) < 0.0005).astype(F32) * 100.0
        if step == 1 and kind in ("nan-residual", "inf-residual"):
            bad = np.nan if kind == "nan-residual" else np.inf
            for core in cores:                     # a residual gone bad (e.g. a loaded state)
                v = to_np(core.states["y"].v)
                v[::7] = bad
                core.B.copy_(core.states["y"].v, conv(v))
        got, want = ops_step(cores, names, grads, conv)
        check(cores[0], cores[1], got, want, names, f"{kind} step {step}")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_bucket_ops_state_is_one_flat_buffer_and_checkpoints(backend):
    """After compress_many on tensor ops a bucket's u and v are segments of one buffer each; a
    state_dict holds copies of them, loads into a fresh core (state rebuilt at its next call) and
    continues bit-identically; switching to the kernels and back keeps them in step; decompress
    puts back what was sent (another rank non-finite) into the segments."""
    rng = np.random.default_rng(14)
    sizes = [4000, 70_001, 300]
    names = ["p", "q", "r"]
    cores = ops_pair(backend)
    conv = _conv(backend)
    B = cores[0].B

    def base(x):                                   # the buffer x is a view of
        return id(x.base) if backend == "numpy" else x.untyped_storage().data_ptr()

    for step in range(6):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        if step == 2:
            saved = cores[0].state_dict()
            fresh = DGCCore(cores[0].config, BACKENDS[backend]())
            fresh.use_kernels = False
            fresh.load_state_dict(saved)
            cores[0] = fresh
        if step == 4 and kernels.available():
            cores[0].use_kernels = True            # the kernels on the flat state's views
        got, want = ops_step(cores, names, grads, conv)
        check(cores[0], cores[1], got, want, names, f"step {step}")
        cores[0].use_kernels = False
        sts = [cores[0].states[n] for n in names]
        assert len({base(st.v) for st in sts}) == len({base(st.u) for st in sts}) == 1
        assert sts[0].u.base is not None if backend == "numpy" else True
        if step == 1:
            copy = cores[0].state_dict()["tensors"]["p"]["v"]
            assert not np.shares_memory(copy, sts[0].v) if backend == "numpy" else \
                base(copy) != base(sts[0].v)
        for i, n in enumerate(names):              # another rank's gradient was non-finite
            flag = wire.encode(B, sizes[i], B.empty_indices(like=conv([0.0])),
                               B.zeros(0, like=conv([0.0])), wire.FLAG_NONFINITE)
            for core, res in ((cores[0], got[i]), (cores[1], want[i])):
                out = core.decompress(B.cat([res[1], flag]), res[2], 2)
                assert np.isnan(to_np(out)).all()
        check(cores[0], cores[1], got, want, names, f"step {step}, after the restore")


class _Counting:
    """Stands in for a backend and counts the calls of its methods (but the metadata ones: the
    per-entry argument checks read numel, ndim and dtype of every gradient)."""

    def __init__(self, B):
        self.B, self.calls = B, 0

    def __getattr__(self, name):
        attr = getattr(self.B, name)
        if not callable(attr) or name in ("numel", "ndim", "is_floating"):
            return attr

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)
        return counted


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_bucket_ops_backend_calls_do_not_grow_with_the_bucket(backend):
    """compress_many on tensor ops makes about the same number of backend calls (metadata reads
    aside) for a bucket of 8 and of 64 tensors (default settings, steady state); one compress()
    per tensor makes them per tensor."""
    rng = np.random.default_rng(15)
    conv = _conv(backend)
    calls = {}
    for count in (8, 64):
        for many in (True, False):
            B = _Counting(BACKENDS[backend]())
            core = DGCCore(DGCConfig(warmup_epochs=0), B)
            core.use_kernels = False
            entries = [(f"w{i}", conv(rng.standard_normal((50, 40 + i))), None)
                       for i in range(count)]
            for _ in range(2):                     # the first call builds the flat state
                B.calls = 0
                if many:
                    core.compress_many(entries, 4)
                else:
                    for e in entries:
                        core.compress(e[0], e[1], 4)
            calls[count, many] = B.calls
    # (data-dependent, but not per tensor: ~25 calls more when some segment has too few
    # candidates and select compares its blocks again, a few more for a tie)
    assert max(calls[8, True], calls[64, True]) <= min(calls[8, True], calls[64, True]) + 40
    assert calls[64, True] < calls[8, False] < calls[64, False] / 7, calls


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_encode_many_and_bucket_draws_match_per_tensor(backend):
    """wire.encode_many = wire.encode per tensor (empty tensors, gaps needing escapes, one entry
    at the last position); the bucket's sample draws and positions = sample() per tensor."""
    from dgc_horovod.core.sparsify import sample_positions
    conv = _conv(backend)
    B = BACKENDS[backend]()
    rng = np.random.default_rng(16)
    numels = [10, 200_000, 1, 70_000, 5, 3 * 65_536 + 7]
    picks = [[], [0, 65_535, 65_536, 199_999], [0], sorted(rng.choice(70_000, 300, False)),
             [4], [3 * 65_536 + 6]]
    local = B.int64_tensor([int(i) for p in picks for i in p], like=conv([0.0]))
    vals = conv(rng.standard_normal(sum(map(len, picks))))
    payloads, words = wire.encode_many(B, numels, [len(p) for p in picks], local, vals)
    start = 0
    for n, p, pay, w in zip(numels, picks, payloads, words):
        want = wire.encode(B, n, B.int64_tensor([int(i) for i in p], like=vals),
                           B.slice(vals, start, start + len(p)), index="delta16")
        assert raw(pay) == raw(want) and B.numel(pay) == w, (n, p)
        start += len(p)
    sizes, counts = [1000, 7, 2 ** 31 - 1, 64], [64, 0, 300, 5]
    u = B.sample_uniform_many([c for c in counts if c], B.generator(3), vals)
    pos = to_np(B.sample_positions_many(u, sizes, counts, [0, 1000, 1007, 2 ** 31 + 1006],
                                        vals))
    g = B.generator(3)
    want = []
    for n, c, off in zip(sizes, counts, [0, 1000, 1007, 2 ** 31 + 1006]):
        if c:
            want.append(sample_positions(to_np(B.sample_uniform(c, g)), n) + off)
    assert np.array_equal(pos, np.concatenate(want))
