"""Robustness of the batch path (`DGCCore.compress_many`, `kernels.Batch`, `_kernels.step_many`,
`_kernels.finite_many` and the kernels' persistent thread pool).

The contract under test: ``compress_many(entries, N)`` returns exactly what one ``compress()`` per
entry, in order, returns (payloads, indices / values / u_sent, u and v, generator state,
statistics) on the NumPy and PyTorch backends, and the tensor-op path (``use_kernels = False``)
agrees bit for bit; whatever the dtypes, layouts, thread counts, Python threads, fork()s and
state changes between calls.
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

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend, kernels, wire
from dgc_horovod.core.compressor import _BatchContext
from dgc_horovod.backends.torch_backend import TorchBackend
from batch_helpers import (convert, raw, restore_torch_threads,  # noqa: F401 (the fixture)
                           same_gen, to_np)

# these tests are of the sparse path's mechanics on flat gradients (see conftest)
pytestmark = pytest.mark.usefixtures("sparse_mechanics")

F32 = np.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = {"numpy": NumpyBackend, "torch": TorchBackend}
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels not built/disabled")
STATS = ("tensors", "sparse_tensors", "selected", "wire_bytes", "nonfinite_tensors", "elements",
         "dense_bytes", "steps", "density")



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


def three_cores(backend, **cfg):
    conf = DGCConfig(**cfg)
    cores = [DGCCore(conf, BACKENDS[backend]()) for _ in range(3)]
    cores[2].use_kernels = False
    assert cores[0].use_kernels and cores[1].use_kernels
    return cores


def step_all(cores, entries_fn, split=None, world=4):
    """Batch (core 0, in one or two compress_many calls), per tensor (1), tensor ops (2)."""
    e = entries_fn()
    if split:
        batch = cores[0].compress_many(e[:split], world) + cores[0].compress_many(e[split:], world)
    else:
        batch = cores[0].compress_many(e, world)
    single = [cores[1].compress(n, g, world, param=p) for n, g, p in entries_fn()]
    ops = [cores[2].compress(n, g, world, param=p) for n, g, p in entries_fn()]
    return batch, single, ops


# ----------------------------------------------------------------- bit-identity on odd inputs
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
    cores = three_cores(backend, **dict(dict(warmup_epochs=2, min_sparse_numel=1), **cfg))
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
        batch, single, ops = step_all(cores, entries, split=6 if step % 2 else None)
        compare(single, batch, cores[1], cores[0], names, f"step {step} batch vs single")
        compare(single, ops, cores[1], cores[2], names, f"step {step} ops vs single")
        compare_stats(cores, f"step {step}")


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_velocity_overflowing_to_inf(backend):
    """Finite gradients whose accumulated velocity overflows float32 (u, v = inf, and inf sent):
    the batch kernel's threshold, block maxima and selection must treat inf as the backend does.
    (One huge entry per tensor so that the torch tensor-op path's sum-based finiteness check does
    not overflow.)"""
    rng = np.random.default_rng(3)
    cores = three_cores(backend, warmup_epochs=0, min_sparse_numel=1, momentum_masking=False)
    sizes = [5000, 100_000, 3000, 70_000]
    names = [f"w{i}" for i in range(len(sizes))]
    for step in range(5):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        grads[1][7] = 2.5e38
        grads[2][:] = 0.0
        grads[2][3] = 3.0e38

        def entries():
            return [(n, convert(backend, g, ""), None) for n, g in zip(names, grads)]
        batch, single, ops = step_all(cores, entries)
        compare(single, batch, cores[1], cores[0], names, f"step {step} batch vs single")
        compare(single, ops, cores[1], cores[2], names, f"step {step} ops vs single")
    assert np.isinf(to_np(cores[0].states["w1"].u)).any()     # the overflow did happen
    compare_stats(cores, "overflow")


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
def test_finished_and_unfinished_rows_interleave():
    """Rows the kernel finishes and rows it leaves to the backend (ties at the k-th magnitude,
    all zeros) alternate inside one call: the compaction of the batch
    buffers must still hand every finished row its own indices / values / u_sent / payload."""
    rng = np.random.default_rng(21)
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.01)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    seen = []
    run = kernels.Batch.run

    def spy(self, like):
        run(self, like)
        done = self.finished()
        seen.append([r in done for r in range(len(self.rows))])
    names = [f"r{i}" for i in range(12)]
    kernels.Batch.run = spy
    try:
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
            b = [cores[1].compress(n, torch.from_numpy(g), 2) for n, g in zip(names, grads)]
            compare(b, a, cores[1], cores[0], names, f"step {step}")
            for (kind, payload, ctx), n in zip(a, names):   # valid payloads that decode
                wire.decode_sum(cores[0].B, payload, cores[0].states[n].numel, 1, n)
    finally:
        kernels.Batch.run = run
    # in one call: a finished row after an unfinished one after a finished one
    assert any(any(f[i] and not f[i + 1] and f[i + 2] for i in range(len(f) - 2)) for f in seen)
    compare_stats(cores, "interleave")


# ----------------------------------------------------------------- state changes between calls
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


# ----------------------------------------------------------------- statistics
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


# ----------------------------------------------------------------- threads
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
    the child computes compress_many with 2 threads correctly and exits; nothing hangs.
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
                    xs = [np.ones(70_000, F32) for _ in range(6)]
                    xs[4][-1] = np.nan
                    ok = kernels.finite_many([(x.ctypes.data, x.size) for x in xs], 2)
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
    # regions of the pool with few tasks (1 worker wanted) alternating with regions of many
    # tasks (63 workers): every tensor of the second kind holds a NaN
    small = [np.ones(1000, np.float32) for _ in range(2)]
    bad = [np.ones(65536, np.float32) for _ in range(256)]
    for x in bad:
        x[-1] = np.nan
    ts = [(x.ctypes.data, x.size) for x in small]
    tb = [(x.ctypes.data, x.size) for x in bad]
    t0, it = time.time(), 0
    while time.time() - t0 < float(sys.argv[1]):
        kernels.finite_many(ts, 64)
        got = kernels.finite_many(tb, 64)
        it += 1
        if any(got):
            print(f"iteration {it}: {sum(got)} tensors with a NaN reported finite")
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
