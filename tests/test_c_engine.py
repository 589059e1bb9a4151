"""What the C engine (dgc_horovod/core/c_engine.py, _kernels.c) adds to the conformance suite
(tests/test_conformance.py, which holds it to the reference on small buckets): large segments
(checked, updated and sampled in chunks over the thread pool), results that do not depend on the
thread count, the pool under several Python threads, fork() and a flush-denormal mode, the
float16 cast on every kind of value, the decode and the bucket walk of malformed words (the
reference's error, naming tensor and rank), and the engine's own error paths.
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import zlib

import numpy as np
import pytest

from dgc_horovod.core import DGCConfig, sparsify, wire
from dgc_horovod.core.backend import NumpyBackend
from dgc_horovod.core.engine import OpsEngine, flat_offsets, make_step
from dgc_horovod.core import c_engine
from helpers import to_np

# (not built: every test fails, test_extension_is_built saying why)
pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not c_engine.ENABLED, reason="DGC_KERNELS=0 in the environment"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

F32 = np.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = 4096 * 64          # the largest segment the C engine does in one task (SMALL_BLOCKS)
REF = OpsEngine(NumpyBackend())


class Threaded(NumpyBackend):
    """NumPy tensors, with the C engine's pool spread over ``threads`` threads."""

    def __init__(self, threads):
        self.threads = threads

    def kernel_threads(self):
        return self.threads


class Bucket:
    """A bucket's flat u, v on backend B (with per-segment views), driven step by step."""

    def __init__(self, B, engine, config, sizes):
        self.B, self.engine, self.config, self.sizes = B, engine, config, list(sizes)
        self.names = [f"t{j}" for j in range(len(sizes))]
        off = flat_offsets(sizes)
        self.u = self._t(np.zeros(off[-1], F32)) if config.momentum > 0 else None
        self.v = self._t(np.zeros(off[-1], F32))
        cut = lambda x: [B.slice(x, a, a + n) for a, n in zip(off, sizes)]
        self.us = [None] * len(sizes) if self.u is None else cut(self.u)
        self.vs = cut(self.v)

    def _t(self, a):
        if self.B.name == "torch":
            import torch
            return torch.from_numpy(np.array(a, copy=True))
        return np.array(a, copy=True)

    def step(self, t, density, grads, scales=None):
        step = make_step(self.config, self.names, self.sizes, density, t)
        r = self.engine.compress(step, self.us, self.vs, [self._t(g) for g in grads],
                                 scales or [1.0] * len(grads), flat=(self.u, self.v))
        as_bits = lambda x: None if x is None else to_np(x).view(np.int32).tolist()
        return {"payloads": [to_np(p).tolist() for p in r.payloads], "counts": list(r.counts),
                "finite": [bool(f) for f in r.finite], "sel": to_np(r.sel).tolist(),
                "vals": as_bits(r.vals), "usent": as_bits(r.usent),
                "fp16": [tuple(int(x) for x in f) for f in r.fp16],
                "dropped": [bool(d) for d in r.dropped], "u": as_bits(self.u),
                "v": as_bits(self.v)}


def compare(make_c, config, sizes, gradients, steps=3, density=0.01, scales=None):
    """The C engine (make_c() -> (B, engine)) against the reference, step after step."""
    ref = Bucket(NumpyBackend(), REF, config, sizes)
    got = Bucket(*make_c(), config, sizes)
    for t in range(1, steps + 1):
        grads = gradients(t)
        want, have = ref.step(t, density, grads, scales), got.step(t, density, grads, scales)
        for key in want:
            assert have[key] == want[key], f"step {t}: {key} differs"


def numpy_c(threads=1):
    return lambda: (lambda B: (B, c_engine.CEngine(B)))(Threaded(threads))


def test_extension_is_built():
    # `pip install -e .` (scripts/install.sh) builds it; without it CPU tensors run on the
    # tensor-op engine, silently slower, so a missing build must fail here
    assert c_engine.available(), "dgc_horovod.core._kernels is not built (pip install -e .)"


# ----------------------------------------------------------------------------- large buckets
LARGE = [SMALL + 1, 2 ** 20 + 3, 300_000, 5000, SMALL, 64, 7, 1]


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "nonfinite"])
@pytest.mark.parametrize("cfg", [{}, {"wire_index": "int32", "wire_values": "float16",
                                      "nesterov": True}])
def test_large_segments_match_the_reference(kind, cfg):
    """Segments above SMALL (chunked over 3 threads) beside small ones: ties at the k-th
    magnitude, fewer non-zeros than k, NaN/Inf gradients in large and small segments."""
    rng = np.random.default_rng(7)

    def grads(t):
        out = []
        for j, n in enumerate(LARGE):
            g = rng.standard_normal(n).astype(F32)
            if kind == "ties":
                g = np.round(g).astype(F32)
            elif kind == "sparse":
                g[rng.random(n) < 0.9995] = 0
            elif kind == "nonfinite" and t == 2 and j in (0, 2, 4):
                g[[n // 3, -1, 0][j // 2]] = [np.nan, np.inf, -np.inf][j // 2]
            out.append(g)
        return out
    compare(numpy_c(3), DGCConfig(**cfg), LARGE, grads, density=0.004)


def test_every_entry_a_candidate_and_the_lower_level_in_a_large_segment():
    """All magnitudes equal but a few: every entry reaches t1 (all are candidates, the top k of
    them by magnitude then position); then a v where fewer than k reach t1 (the lower level
    t2)."""
    n = 2 ** 20
    g1 = np.full(n, 0.5, F32)
    g1[::4099] = 2.0
    rng = np.random.default_rng(3)
    heavy = (rng.standard_cauchy(n) * 1e-3).astype(F32)

    def grads(t):
        return [g1 if t == 1 else heavy, g1[:SMALL - 5]]
    compare(numpy_c(2), DGCConfig(momentum=0.0), [n, SMALL - 5], grads, steps=3, density=0.001)


@pytest.mark.parametrize("n", [100_000, 2 ** 20])
def test_the_lower_level_when_the_samples_overshoot(n):
    """The sampled positions hold the largest magnitudes: fewer than k entries reach t1 (or t2),
    so the level is t2 and fewer than k are sent."""
    cfg = DGCConfig(momentum=0.0)
    step = make_step(cfg, ["t0"], [n], 0.001, 1)
    p = step.plans[0]
    rng = np.random.default_rng(5)
    g = rng.random(n).astype(F32)
    at = sparsify.sample_positions(NumpyBackend(), step.bases[0], p.s, n, np.zeros(1, np.int64))
    g[at] = F32(10) + rng.random(at.size).astype(F32)
    compare(numpy_c(2), cfg, [n], lambda t: [g], steps=1, density=0.001)
    r = Bucket(Threaded(1), c_engine.CEngine(Threaded(1)), cfg, [n]).step(1, 0.001, [g])
    assert p.ks1 < r["counts"][0] <= p.ks2 < p.k


def test_inf_and_nan_arising_in_v():
    """Gradients near float32's largest value: v overflows to ±inf, then inf + -inf is NaN;
    their magnitudes (as bits, NaN above inf) are selected first, in float32 and float16."""
    big = F32(3e38)

    def grads(t):
        g = np.ones(SMALL + 100, F32) * F32(1e-3)
        g[[5, 77, SMALL + 50]] = big if t < 3 else -big
        return [g, g[:1000].copy()]
    for cfg in ({}, {"wire_values": "float16"}, {"momentum": 0.0}):
        compare(numpy_c(2), DGCConfig(**cfg), [SMALL + 100, 1000], grads, steps=4)


def test_big_gaps_use_escape_tokens():
    """A few entries far apart in a large segment (gaps > 65535: escape tokens)."""
    n = 1_000_003
    g = np.zeros(n, F32)
    g[[0, 65_535, 65_536 + 65_535, 500_000, n - 1]] = [1, -2, 3, -4, 5]
    compare(numpy_c(2), DGCConfig(), [n], lambda t: [g * F32(t)], steps=2, density=0.001)


def test_float16_cast_of_every_kind_of_value():
    """Every selected value cast to float16 as NumPy casts it: random bit patterns (normals,
    subnormals of both formats, beyond float16's range) and the rounding boundaries; at density
    1 every entry is sent."""
    rng = np.random.default_rng(11)
    edges = np.array([65504, 65519.996, 65520, 65536, 2 ** -14, 2 ** -24, 2 ** -25,
                      2 ** -25 * 1.0000001, 3 * 2 ** -26, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                      2 ** -15 + 2 ** -25, 6.1e-5, 1e-45, 0.0], np.float64).astype(F32)
    finite = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32).view(F32)
    finite = finite[np.isfinite(finite)]
    small = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-9, 5, 100_000)).astype(F32)
    for vals in (np.concatenate([edges, -edges, small]), finite):
        compare(numpy_c(2), DGCConfig(wire_values="float16", momentum=0.0), [vals.size],
                lambda t: [vals], steps=1, density=1.0)
        words = Bucket(Threaded(1), c_engine.CEngine(Threaded(1)),
                       DGCConfig(wire_values="float16", momentum=0.0, exact_topk=True),
                       [vals.size]).step(1, 1.0, [vals])["payloads"][0]
        idx, got, *_ = wire.read_payload(NumpyBackend(), np.array(words, np.int32), 0,
                                         vals.size)
        want = vals[idx].astype(np.float16).astype(F32)
        assert got.view(np.int32).tolist() == want.view(np.int32).tolist()


# ----------------------------------------------------------------------------- threads
def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(41)
    sizes = [SMALL + 1, 2 ** 20 + 3, 5000, 64, SMALL, 131_073, 7]
    steps = [[rng.standard_normal(n).astype(F32) for n in sizes] for _ in range(3)]
    steps[1][1][-1] = np.nan
    steps[1][3][0] = np.inf
    cfg = DGCConfig(compress_ratio=0.01)
    runs = [Bucket(Threaded(T), c_engine.CEngine(Threaded(T)), cfg, sizes) for T in (1, 2, 4, 70)]
    for t, grads in enumerate(steps, 1):
        results = [run.step(t, 0.01, grads) for run in runs]
        assert all(r == results[0] for r in results[1:]), f"step {t}"


def test_several_python_threads_at_once():
    """Python threads compress their own buckets at the same time (the call releases the GIL;
    one gets the pool, the others run inline): each ends where a serial run ends."""
    sizes = [400_000, 70_001, 3000, 64, 150_000, 9]
    rng = np.random.default_rng(12)
    steps = [[rng.standard_normal(n).astype(F32) for n in sizes] for _ in range(4)]
    cfg = DGCConfig()

    def run(out):
        b = Bucket(Threaded(2), c_engine.CEngine(Threaded(2)), cfg, sizes)
        out += [b.step(t, 0.01, g) for t, g in enumerate(steps, 1)]
    want = []
    run(want)
    outs, errors = [[] for _ in range(4)], []

    def target(o):
        try:
            run(o)
        except BaseException as e:                       # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=target, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert all(o == want for o in outs)


def test_fork_after_the_pool_was_used():
    """fork() after the pool ran with 4 threads, while another Python thread keeps it busy: the
    child compresses correctly with 2 threads and exits; nothing hangs."""
    sizes = [300_000, 200_000, 5000, 70_000, 3]
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(n).astype(F32) for n in sizes]
    cfg = DGCConfig()
    want = Bucket(Threaded(1), c_engine.CEngine(Threaded(1)), cfg, sizes).step(1, 0.01, grads)
    busy = Bucket(Threaded(4), c_engine.CEngine(Threaded(4)), cfg, sizes)
    stop = threading.Event()

    def keep_busy():
        t = 0
        while not stop.is_set():
            t += 1
            busy.step(t, 0.01, grads)
    bg = threading.Thread(target=keep_busy)
    bg.start()
    try:
        for attempt in range(6):
            time.sleep(0.003 * attempt)
            pid = os.fork()
            if pid == 0:                                      # the child: never returns
                code = 4
                try:
                    ok = all(Bucket(Threaded(2), c_engine.CEngine(Threaded(2)), cfg, sizes)
                             .step(1, 0.01, grads) == want for _ in range(3))
                    code = 0 if ok else 3
                finally:
                    os._exit(code)
            deadline = time.time() + 30
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
    from dgc_horovod.core import DGCConfig
    from dgc_horovod.core.backend import NumpyBackend
    from dgc_horovod.core.c_engine import CEngine
    from dgc_horovod.core.engine import make_step
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])

    class B(NumpyBackend):
        def kernel_threads(self):
            return 64
    # regions of the pool with few tasks (the check of a gradient of 5 chunks: 4 workers
    # wanted) alternating with regions of many (256 chunks: 63 workers); the NaN is in the last
    # chunk, so a region that ends before its tasks did reports a finite gradient
    engine, cfg = CEngine(B()), DGCConfig()
    def bucket(n):
        g = np.ones(n, np.float32)
        g[-1] = np.nan
        v = np.zeros(-(-n // 64) * 64, np.float32)
        return make_step(cfg, ["w"], [n], 0.01, 1), [v[:n]], [g], (np.zeros_like(v), v)
    small, wide = bucket((4 << 16) + 1), bucket(256 << 16)
    t0, it = time.time(), 0
    while time.time() - t0 < float(sys.argv[1]):
        for step, vs, gs, flat in (small, wide):
            r = engine.compress(step, [flat[0][:step.sizes[0]]], vs, gs, [1.0], flat)
            it += 1
            if r.finite[0] or flat[1].any():
                print(f"region {it}: a NaN gradient was missed")
                sys.exit(1)
    print(f"{it} regions, all correct")
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_thread_pool_regions_of_alternating_width():
    """Regression test of a pool race: a worker left out of a region must not join the next,
    wider region as if it were the old one (the generation word carries the wanted count)."""
    proc = subprocess.run([sys.executable, "-c", _POOL_RACE, "5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr


_DENORMAL = textwrap.dedent("""
    import numpy as np, torch
    from dgc_horovod.core import DGCConfig
    from dgc_horovod.backends.torch_backend import TorchBackend
    from dgc_horovod.core.c_engine import CEngine
    from dgc_horovod.core.engine import flat_offsets, make_step
    B = TorchBackend()
    def run(threads, grads, sizes):
        torch.set_num_threads(threads)
        off = flat_offsets(sizes)
        u, v = torch.zeros(off[-1]), torch.zeros(off[-1])
        us = [u[a:a + n] for a, n in zip(off, sizes)]
        vs = [v[a:a + n] for a, n in zip(off, sizes)]
        step = make_step(DGCConfig(), [f"t{i}" for i in range(len(sizes))], sizes, 0.01, 1)
        r = CEngine(B).compress(step, us, vs, grads, [0.5] * len(sizes), (u, v))
        return v.view(torch.int32), [p.clone() for p in r.payloads]
    # the pool's threads start here, in the default floating-point mode
    run(2, [torch.randn(300_000) for _ in range(4)], [300_000] * 4)
    torch.set_flush_denormal(True)          # denormals are zero, on this thread only
    rng = np.random.default_rng(0)
    sizes = [200_000] * 30 + [400_000] * 2
    grads = [torch.from_numpy(rng.integers(1, 2 ** 23, n).astype(np.int32).view(np.float32))
             for n in sizes]                                        # denormal gradients
    (va, pa), (vb, pb) = run(2, grads, sizes), run(1, grads, sizes)
    print(int(torch.equal(va, vb)), sum(torch.equal(x, y) for x, y in zip(pa, pb)))
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_flush_denormal_set_after_the_pool_started():
    """torch.set_flush_denormal(True) after the pool's threads started: the workers take the
    calling thread's floating-point mode, so 2 threads give what 1 gives."""
    proc = subprocess.run([sys.executable, "-c", _DENORMAL], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1", "32"], proc.stdout


# ----------------------------------------------------------------------------- decode
def _payloads(rng, numel, ranks, index, values, flagged=()):
    out = []
    for r in range(ranks):
        k = max(1, numel // 50)
        c = 0 if r == 1 else int(rng.integers(1, k + 1))
        idx = np.sort(rng.choice(numel, c, replace=False)).astype(np.int64)
        if c >= 4:
            idx[:2] = [0, numel - 1]
            idx = np.unique(idx)
        vals = (rng.standard_normal(idx.size) * 10.0 ** rng.integers(-8, 3, idx.size))
        out.append(wire.encode(NumpyBackend(), numel, idx, vals.astype(F32),
                               wire.FLAG_NONFINITE if r in flagged else 0, index, values,
                               min(numel, max(k, idx.size))))
    return np.concatenate(out)


def _decode_both(words, numel, ranks, inv, name="w"):
    """(reference, C engine) of one decode: (nonfinite, out bits) or the error message."""
    res = []
    for eng in (REF, c_engine.CEngine(NumpyBackend())):
        out = np.full(numel, 7.0, F32)
        try:
            nonfinite = eng.decode(np.array(words, np.int32), numel, ranks, out, inv, name)
        except wire.WireFormatError as e:
            res.append(("error", str(e)))
            continue
        res.append((nonfinite, None if nonfinite else out.view(np.int32).tolist()))
    return res


FORMATS = [(i, v) for i in wire.INDEX_ENCODINGS for v in wire.VALUE_DTYPES]


@pytest.mark.parametrize("index,values", FORMATS)
def test_decode_matches_the_reference(index, values):
    """Overlapping positions of several ranks (scaled once), escapes, float16 subnormals, a rank
    without entries, a flagged rank, non-finite values (float16: the step is non-finite;
    float32: added as they are)."""
    rng = np.random.default_rng(5)
    numel = 400_000
    words = _payloads(rng, numel, 5, index, values)
    for inv in (None, 1 / 5, 1 / 3):
        a, b = _decode_both(words, numel, 5, inv)
        assert a == b and a[0] is False
    a, b = _decode_both(_payloads(rng, numel, 3, index, values, flagged=(2,)), numel, 3, 0.5)
    assert a == b == (True, None)
    for bad in (np.inf, -np.inf, np.nan):
        w = wire.encode(NumpyBackend(), 100, np.array([3, 9]), np.array([1, bad], F32), 0,
                        index, values, 4)
        a, b = _decode_both(np.concatenate([w, w]), 100, 2, 0.5)
        assert a == b and a[0] is (values == "float16")


def _mutate(rng, words):
    w = np.array(words, np.int64)
    kind = rng.integers(0, 6)
    if kind == 0 and w.size:                                  # a bit flip
        i = rng.integers(0, w.size)
        w[i] ^= 1 << int(rng.integers(0, 32))
    elif kind == 1 and w.size:                                # truncated
        w = w[:rng.integers(0, w.size)]
    elif kind == 2:                                           # extended
        w = np.concatenate([w, rng.integers(-2 ** 31, 2 ** 31, rng.integers(1, 4))])
    elif kind == 3 and w.size:                                # a header field changed
        i = rng.integers(0, min(w.size, wire.HEADER_WORDS + 2))
        w[i] = rng.choice([w[i] + 1, w[i] - 1, 0, -1, 2 ** 31 - 1, rng.integers(0, 70_000)])
    elif kind == 4 and w.size > 1:                            # a word deleted
        w = np.delete(w, rng.integers(0, w.size))
    elif w.size:                                              # a random word
        w[rng.integers(0, w.size)] = rng.integers(-2 ** 31, 2 ** 31)
    return ((w + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)


@pytest.mark.parametrize("index,values", FORMATS)
def test_decode_of_malformed_words_raises_the_reference_error(index, values):
    """Mutated payloads: the C engine accepts exactly what the reference accepts, with the same
    result, and raises the reference's WireFormatError (naming tensor and rank) otherwise."""
    rng = np.random.default_rng(zlib.crc32(f"{index}-{values}".encode()))
    errors = 0
    for trial in range(300):
        numel = int(rng.choice([1, 5, 70_000, 140_000]))
        ranks = int(rng.integers(1, 4))
        words = _payloads(rng, numel, ranks, index, values)
        for _ in range(int(rng.integers(1, 3))):
            words = _mutate(rng, words)
        a, b = _decode_both(words, numel, ranks, 0.5, name="net.w")
        assert a == b, f"trial {trial}"
        errors += a[0] == "error"
    assert errors > 150
    assert a[0] != "error" or "'net.w'" in a[1]


@pytest.mark.parametrize("index", wire.INDEX_ENCODINGS)
@pytest.mark.parametrize("bad", ["past the end", "negative", "one entry more", "one entry less",
                                 "trailing word", "numel differs"])
def test_decode_of_payloads_one_step_off_the_format(index, bad):
    numel = 140_000
    words = wire.encode(NumpyBackend(), numel, np.array([3, 65_600, numel - 1]),
                        np.ones(3, F32), 0, index, "float32", 5)
    H = wire.HEADER_WORDS
    if bad == "past the end":
        if index == "int32":
            words[H + 2] = numel
        else:                       # tokens 4, 0, 62, 0, 8864: the last one, one further
            words[H + 2] += 1
    elif bad == "negative" and index == "int32":
        words[H] = -1
    elif bad in ("one entry more", "one entry less"):
        words[2] += 1 if bad == "one entry more" else -1
    elif bad == "trailing word":
        words = np.concatenate([words, np.zeros(1, np.int32)])
    elif bad == "numel differs":
        numel += 1
    a, b = _decode_both(words, numel, 1, 0.5, name="net.w")
    assert a == b
    assert a[0] == "error" or (bad == "negative" and index == "delta16")
    assert a[0] != "error" or ("'net.w'" in a[1] and "rank 0" in a[1] or "trailing" in a[1])


def test_decode_refuses_what_it_cannot_take():
    import torch
    from dgc_horovod.backends.torch_backend import TorchBackend
    eng = c_engine.CEngine(TorchBackend())
    words = torch.from_numpy(wire.encode(NumpyBackend(), 8, np.array([1, 5]),
                                         np.array([1, 2], F32), k=2))
    out = torch.zeros(8)
    assert not eng.decode(words, 8, 1, out) and out.tolist() == [0, 1, 0, 0, 0, 2, 0, 0]
    for w, o in [(words.long(), out), (words, out.double()), (words, torch.zeros(16)[::2])]:
        with pytest.raises(TypeError):
            eng.decode(w, 8, 1, o)
    with pytest.raises(ValueError, match="out has 9 elements"):
        eng.decode(words, 8, 1, torch.zeros(9))


# ----------------------------------------------------------------------------- bucket walk
def test_split_bucket_matches_the_reference():
    """Frames of random members per rank, mutated half of the time: the same views, or the
    reference's error."""
    NB, eng = NumpyBackend(), c_engine.CEngine(NumpyBackend())
    rng = np.random.default_rng(9)
    errors = 0
    for trial in range(400):
        numels = rng.integers(1, 100_000, rng.integers(1, 4)).tolist()
        ranks = int(rng.integers(1, 4))
        frames = []
        for _ in range(ranks):
            members = sorted(rng.choice(len(numels), rng.integers(0, len(numels) + 1),
                                        replace=False).tolist())
            entries = [(m, _payloads(rng, numels[m], 1, *FORMATS[rng.integers(0, 4)]))
                       for m in members]
            frames.append(wire.frame_bucket(NB, entries, like=None))
        words = np.concatenate(frames)
        if trial % 2:
            words = _mutate(rng, words)
        res = []
        for split in (lambda: wire.split_bucket(NB, words, ranks, len(numels), "b"),
                      lambda: eng.split_bucket(words, ranks, len(numels), "b")):
            try:
                res.append([[p.tolist() for p in ps] for ps in split()])
            except wire.WireFormatError as e:
                res.append(str(e))
        assert res[0] == res[1], f"trial {trial}"
        errors += isinstance(res[0], str)
    assert 50 < errors < 200


# ----------------------------------------------------------------------------- error paths
def test_compress_refuses_bad_buffers():
    B = NumpyBackend()
    eng = c_engine.CEngine(B)
    cfg = DGCConfig()
    step = make_step(cfg, ["w"], [100], 0.01, 1)
    v, g = np.zeros(128, F32), np.ones(100, F32)
    with pytest.raises(ValueError, match="bad arguments"):      # momentum without u
        eng.compress(step, [None], [v[:100]], [g], [1.0], (None, v))
    with pytest.raises(TypeError, match="host memory"):
        eng.compress(step, [None], [v[:100]], [g], [1.0], (np.zeros(256, F32)[::2], v))
    with pytest.raises(ValueError, match="do not fit"):          # v shorter than the segment
        eng.compress(step, [None], [v[:64]], [g], [1.0], (np.zeros(64, F32), v[:64]))
    assert not v.any()
    # a gradient that is not float32 contiguous is copied first: the same result
    r1 = eng.compress(step, [v[:0]], [v[:100]], [np.ones(200, np.float64)[::2]], [1.0],
                      (np.zeros(128, F32), v))
    assert r1.counts == [1] and r1.finite == [True]


_SWITCHED_OFF = textwrap.dedent("""
    import sys, warnings
    if sys.argv[1] == "block":
        from dgc_horovod.core import engine
        engine.BLOCK = 32
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        from dgc_horovod.core import c_engine
    print(c_engine.available(), any("BLOCK" in str(x.message) for x in w))
""")


@pytest.mark.parametrize("how", ["env", "block"])
def test_switched_off_by_the_environment_or_another_block(how):
    env = dict(os.environ, PYTHONPATH=ROOT, **({"DGC_KERNELS": "0"} if how == "env" else {}))
    proc = subprocess.run([sys.executable, "-c", _SWITCHED_OFF, how], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", str(how == "block")]
