"""The fused CPU kernels (`dgc_horovod.core.kernels`, `_kernels.c`) against the tensor-op path.

Both paths of `DGCCore.compress` must give bit-identical payloads, selections, sent values, state
(u, v) and generator state for the same inputs and seed, on the NumPy and the PyTorch backend,
for every setting that changes the arithmetic or the selection. The kernel's momentum correction
is also checked bit for bit against a NumPy transcription of the paper's equations (§3.1).
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend, kernels, wire
from dgc_horovod.backends.torch_backend import TorchBackend
from helpers import to_np

# these tests are of the sparse path's mechanics on flat gradients (see conftest)
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("sparse_mechanics")]

F32 = np.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = {"numpy": NumpyBackend, "torch": TorchBackend}
needs_kernels = pytest.mark.skipif(not kernels.ENABLED, reason="DGC_KERNELS=0 in the environment")


def to_backend(name, a):
    a = np.array(a, dtype=F32, copy=True)
    return torch.from_numpy(a) if name == "torch" else a


def gradient(rng, kind, n):
    if kind == "gaussian":
        g = rng.standard_normal(n)
    elif kind == "ties":                             # few distinct magnitudes, many exact ties
        g = rng.integers(-3, 4, n).astype(float)
    elif kind == "sparse":                           # 99.8% zeros: the threshold is often 0
        g = rng.standard_normal(n) * (rng.random(n) < 0.002)
    elif kind == "cauchy":
        g = rng.standard_cauchy(n)
    elif kind == "zero":
        g = np.zeros(n)
    else:                                            # the two ends carry the largest entries
        g = rng.standard_normal(n) * 1e-3
        g[0], g[-1] = 50.0, -60.0
    return g.astype(F32)


def bits(x):
    return None if x is None else to_np(x).view(np.int32)


def assert_same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), what


# ----------------------------------------------------------------- the extension itself
@needs_kernels
def test_extension_is_built_and_calibrated():
    # `pip install -e .` (scripts/install.sh) builds it; without it the fused path silently
    # never runs, so a missing build must fail here
    assert kernels._kernels is not None, "dgc_horovod.core._kernels is not built (pip install -e .)"
    assert NumpyBackend().kernel_fma() is False           # NumPy rounds m*u and + g separately
    assert TorchBackend().kernel_fma() in (True, False)   # torch: fused multiply-add on AVX2/512
    if kernels.ENABLED:
        assert DGCCore(DGCConfig(), TorchBackend()).use_kernels


def test_environment_switch_disables_kernels():
    code = ("from dgc_horovod.core import DGCCore, DGCConfig, NumpyBackend, kernels;"
            "print(kernels.available(), DGCCore(DGCConfig(), NumpyBackend()).use_kernels)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, DGC_KERNELS="0", PYTHONPATH=ROOT), check=True)
    assert out.stdout.split() == ["False", "False"]


@needs_kernels
@pytest.mark.parametrize("values", [
    [1.0, 2.0, 3.0], [3.0e38, 3.0e38, -3.0e38],           # finite (even if their sum overflows)
    [np.nan], [1.0] * 1000 + [np.inf], [-np.inf] + [0.0] * 999, [0.0] * 64 + [np.nan] + [1.0] * 7])
def test_all_finite_is_exact(values):
    a = np.array(values, dtype=F32)
    assert kernels.all_finite(a.size, a.ctypes.data) == bool(np.isfinite(a).all())


# ----------------------------------------------------------------- kernel vs NumPy transcription
@needs_kernels
@pytest.mark.parametrize("m,nesterov,scale", [(0.0, False, 1.0), (0.0, False, 0.3),
                                              (0.9, False, 1.0), (0.9, False, 0.3),
                                              (0.9, True, 1.0), (0.5, True, 0.3)])
def test_kernel_momentum_correction_matches_paper_in_numpy(m, nesterov, scale):
    # §3.1, eq. 5–6 with the clipping scale s, in float32 with NumPy's two roundings:
    #   u ← m·u + s·g ;  v ← v + u  (classic)  or  v ← v + s·g + m·u  (Nesterov);  m = 0: v ← v + s·g
    rng = np.random.default_rng(3)
    n = 10_007
    g, u, v = (rng.standard_normal(n).astype(F32) for _ in range(3))
    sg = g if scale == 1.0 else F32(scale) * g
    if m == 0.0:
        u_ref, v_ref = u, v + sg
    else:
        u_ref = F32(m) * u + sg
        v_ref = (v + sg) + F32(m) * u_ref if nesterov else v + u_ref
    uk, vk = u.copy(), v.copy()
    mode = 0 if m == 0.0 else (2 if nesterov else 1)
    kernels._kernels.step(g.ctypes.data, uk.ctypes.data if mode else 0, vk.ctypes.data, n, mode,
                          False, m, scale, 0, 0, 0, 0, 0, 0)
    assert np.array_equal(uk.view(np.int32), u_ref.view(np.int32))
    assert np.array_equal(vk.view(np.int32), v_ref.view(np.int32))


@needs_kernels
def test_kernel_threshold_and_candidates_match_numpy():
    # the sampled threshold is the ks-th largest |v| over the sampled positions; the candidates
    # are every position with |v| >= threshold, ascending, with their magnitudes
    rng = np.random.default_rng(4)
    for n, s, ks in [(1000, 64, 3), (100_000, 1000, 13), (70_001, 700, 700), (5000, 64, 1)]:
        g = rng.standard_cauchy(n).astype(F32)
        g[rng.random(n) < 0.3] = 0.0
        u, v = np.zeros(n, F32), np.zeros(n, F32)
        uni = rng.random(s)
        uni[:2] = 0.0, np.nextafter(1.0, 0.0)               # the first and the last position
        pos = np.minimum((uni * n).astype(np.int64), n - 1)   # sparsify.sample_positions, inline
        assert pos[0] == 0 and pos[1] == n - 1
        cap = n
        cidx, cmag = np.empty(cap, np.int64), np.empty(cap, F32)
        thr, cnt, _ = kernels._kernels.step(g.ctypes.data, u.ctypes.data, v.ctypes.data, n, 1,
                                         False, 0.9, 1.0, uni.ctypes.data, s, ks,
                                         cidx.ctypes.data, cmag.ctypes.data, cap)
        expected_thr = np.sort(np.abs(g[pos]))[::-1][ks - 1]
        assert thr == expected_thr
        expected = np.flatnonzero(np.abs(g) >= expected_thr)
        assert cnt == expected.size
        assert np.array_equal(cidx[:cnt], expected) and np.array_equal(cmag[:cnt], np.abs(g[expected]))


@needs_kernels
def test_kernel_rejects_sample_draws_outside_unit_interval():
    n = 100
    g, u, v = np.ones(n, F32), np.zeros(n, F32), np.zeros(n, F32)
    buf = np.empty(n, np.int64)
    for bad in (1.0, -0.25, np.nan, np.inf):
        uni = np.array([0.5, bad])
        with pytest.raises(ValueError, match=r"sample draw outside \[0, 1\)"):
            kernels._kernels.step(g.ctypes.data, u.ctypes.data, v.ctypes.data, n, 1, False, 0.9,
                                  1.0, uni.ctypes.data, 2, 1, buf.ctypes.data, buf.ctypes.data, n)
        assert not v.any() and not u.any()


# ----------------------------------------------------------------- fused vs tensor-op path
CONFIGS = [
    dict(),                                                             # the defaults
    dict(wire_index="int32"),
    dict(wire_values="float16"),
    dict(wire_index="int32", wire_values="float16", momentum_masking=False),
    dict(momentum=0.0, momentum_masking=False),
    dict(nesterov=True, clip_norm=0.5),
    dict(weight_decay=1e-2, momentum_masking=False),
    dict(exact_topk=True, nesterov=True),
    dict(compress_ratio=0.01, sample_ratio=0.1, warmup_epochs=2, warmup_per_step=True),
]
SIZES = [1, 2, 3, 64, 1000, 4099, 70_000, 300_000]


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
                         or "defaults")
def test_fused_path_is_bit_identical_to_tensor_ops(backend, cfg):
    rng = np.random.default_rng(11)
    cores = [DGCCore(DGCConfig(**dict(dict(min_sparse_numel=1, warmup_epochs=0), **cfg)),
                     BACKENDS[backend]()) for _ in range(2)]
    cores[1].use_kernels = False
    assert cores[0].use_kernels
    kinds = ["gaussian", "ties", "sparse", "cauchy", "zero", "ends"]
    for step in range(5):
        cores[0].set_epoch(step * 0.5)
        cores[1].set_epoch(step * 0.5)
        for i, n in enumerate(SIZES):
            name = f"t{i}"
            g = gradient(rng, kinds[(i + step) % len(kinds)], n)
            if step == 3 and i % 3 == 0:
                g[rng.integers(n)] = np.nan if i % 2 else np.inf     # a skipped (non-finite) step
            p = rng.standard_normal(n).astype(F32)
            overflowed = cores[0].total_stats.overflowed_entries
            outs = [core.compress(name, to_backend(backend, g), 4, param=to_backend(backend, p))
                    for core in cores]
            what = f"step {step}, tensor {name} ({n} elements)"
            assert outs[0][0] == outs[1][0] == "sparse", what
            assert_same(bits(outs[0][1]), bits(outs[1][1]), what + ": payload")
            c0, c1 = outs[0][2], outs[1][2]
            for attr in ("indices", "values", "u_sent"):
                a, b = getattr(c0, attr), getattr(c1, attr)
                assert_same(None if a is None else to_np(a), None if b is None else to_np(b),
                            f"{what}: {attr}")
            for attr in ("u", "v"):
                assert_same(bits(getattr(cores[0].states[name], attr)),
                            bits(getattr(cores[1].states[name], attr)), f"{what}: state {attr}")
            # the payload is a valid DGC v2 payload that the receivers decode
            dense, nonfinite = wire.decode_sum(cores[0].B, outs[0][1], n, 1, name)
            # non-finite: a NaN/Inf gradient, or (float16 values) a value beyond float16's range
            overflowed = cores[0].total_stats.overflowed_entries > overflowed
            assert nonfinite == (not np.isfinite(g).all() or overflowed)
    assert all(cores[0].states[f"t{i}"].plan for i in range(len(SIZES)))   # fused path ran
    assert not any(cores[1].states[f"t{i}"].plan for i in range(len(SIZES)))
    B = cores[0].B
    s0, s1 = (B.generator_state(c._generator) for c in cores)
    assert (s0 == s1) if isinstance(s0, dict) else torch.equal(s0, s1)
    for attr in ("tensors", "selected", "wire_bytes", "nonfinite_tensors", "elements",
                 "overflowed_entries", "flushed_entries"):
        assert getattr(cores[0].total_stats, attr) == getattr(cores[1].total_stats, attr), attr


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_fused_path_big_gaps_and_both_ends(backend):
    # k = 3 of 300,000: positions 0 and n-1 are sent, the gap between them needs escape tokens
    n = 300_000
    core = DGCCore(DGCConfig(compress_ratio=1e-5, warmup_epochs=0), BACKENDS[backend]())
    g = np.zeros(n, F32)
    g[[0, 150_000, n - 1]] = [3.0, -2.0, 1.0]
    kind, payload, ctx = core.compress("w", to_backend(backend, g), 1)
    words = to_np(payload)
    assert words[2] == 3 and words[4] == 3 + 2 + 2      # 3 entries, 2 escapes per 150k gap
    assert sorted(to_np(ctx.indices).tolist()) == [0, 150_000, n - 1]
    dense, _ = wire.decode_sum(core.B, payload, n, 1, "w")
    assert np.array_equal(to_np(dense), g)
    assert not to_np(core.states["w"].v).any()                  # everything sent was cleared


@needs_kernels
def test_which_tensors_take_the_fused_path():
    # float64 gradients go through their float32 copy: fused; use_kernels=False and CUDA
    # tensors (no host pointer): tensor ops; TensorFlow has no kernel hooks at all
    B = TorchBackend()
    core = DGCCore(DGCConfig(warmup_epochs=0), B)
    core.compress("w", torch.randn(5000, dtype=torch.float64), 1)
    assert core.states["w"].plan
    core = DGCCore(DGCConfig(warmup_epochs=0), B)
    core.use_kernels = False
    core.compress("w", torch.randn(5000), 1)
    assert core.states["w"].plan is None
    if torch.cuda.is_available():
        core = DGCCore(DGCConfig(warmup_epochs=0), B)
        core.compress("w", torch.randn(5000, device="cuda"), 1)
        assert core.states["w"].plan is False
    from dgc_horovod.backends.tf_backend import TFBackend
    assert not DGCCore(DGCConfig(), TFBackend()).use_kernels


@needs_kernels
def test_replaced_state_tensors_get_a_new_plan():
    # the plan caches raw pointers of u and v: replacing them (e.g. a reset) must not leave the
    # kernel writing into the old buffers
    core = DGCCore(DGCConfig(warmup_epochs=0, compress_ratio=0.01), TorchBackend())
    core.compress("w", torch.randn(5000), 1)
    st = core.states["w"]
    old_v = st.v
    st.u, st.v = torch.zeros(5000), torch.zeros(5000)
    g = torch.zeros(5000)
    g[7] = 3.0
    _, payload, ctx = core.compress("w", g, 1)
    assert st.plan.v is st.v and ctx.indices.tolist() == [7]
    assert float(st.v.abs().sum()) == 0.0 and float(st.u[7]) == 0.0   # sent, cleared, masked
    assert float(old_v.abs().sum()) > 0                                 # untouched


# ----------------------------------------------------------------- compress_many (batch kernel)
def _compare(outs_a, outs_b, core_a, core_b, names, what):
    for name, a, b in zip(names, outs_a, outs_b):
        w = f"{what}, tensor {name}"
        assert a[0] == b[0], w
        assert_same(bits(a[1]), bits(b[1]), w + ": payload")
        if a[0] == "sparse":
            for attr in ("indices", "values", "u_sent"):
                x, y = getattr(a[2], attr), getattr(b[2], attr)
                assert_same(None if x is None else to_np(x), None if y is None else to_np(y),
                            f"{w}: {attr}")
        for attr in ("u", "v"):
            assert_same(bits(getattr(core_a.states[name], attr)),
                        bits(getattr(core_b.states[name], attr)), f"{w}: state {attr}")


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
                         or "defaults")
def test_compress_many_is_bit_identical_to_compress(backend, cfg):
    """One batch-kernel call per bucket gives what one compress() per tensor gives, fused or on
    tensor ops: payloads, selections, state, random draws, statistics; with dense (small)
    tensors, non-finite gradients and several threads in the same bucket."""
    rng = np.random.default_rng(5)
    conf = DGCConfig(**dict(dict(min_sparse_numel=60, warmup_epochs=0), **cfg))
    cores = [DGCCore(conf, BACKENDS[backend]()) for _ in range(3)]
    cores[2].use_kernels = False                   # the tensor-op reference
    assert cores[0].use_kernels
    kinds = ["gaussian", "ties", "sparse", "cauchy", "zero", "ends"]
    names = [f"t{i}" for i in range(len(SIZES))] + ["big"]
    sizes = SIZES + [1_200_000]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for step in range(5):
            for core in cores:
                core.set_epoch(step * 0.5)
            entries = []
            for i, (name, n) in enumerate(zip(names, sizes)):
                g = gradient(rng, kinds[(i + step) % len(kinds)], n)
                if step == 3 and i % 3 == 0:
                    g[rng.integers(n)] = np.nan if i % 2 else np.inf
                p = rng.standard_normal(n).astype(F32)
                entries.append((name, g, p))
            def args():
                return [(n, to_backend(backend, g), to_backend(backend, p)) for n, g, p in entries]
            a = args()
            if step % 2:                             # two buckets in this step
                batch = cores[0].compress_many(a[:4], 4) + cores[0].compress_many(a[4:], 4)
            else:
                batch = cores[0].compress_many(a, 4)
            single = [cores[1].compress(n, g, 4, param=p) for n, g, p in args()]
            ops = [cores[2].compress(n, g, 4, param=p) for n, g, p in args()]
            _compare(batch, single, cores[0], cores[1], names, f"step {step} (batch vs single)")
            _compare(batch, ops, cores[0], cores[2], names, f"step {step} (batch vs tensor ops)")
    finally:
        torch.set_num_threads(threads)
    B = cores[0].B
    states = [B.generator_state(c._generator) for c in cores]
    for s in states[1:]:
        assert (states[0] == s) if isinstance(s, dict) else torch.equal(states[0], s)
    for stats in ("total_stats", "step_stats"):
        for attr in ("tensors", "sparse_tensors", "selected", "wire_bytes", "nonfinite_tensors",
                     "elements", "dense_bytes", "steps", "density"):
            got = [getattr(getattr(core, stats), attr) for core in cores]
            assert got[0] == got[1] == got[2], (stats, attr, got)


def test_compress_many_checks_every_entry_before_any_change():
    core = DGCCore(DGCConfig(warmup_epochs=0), TorchBackend())
    core.compress("a", torch.randn(1000), 2)
    before = core.states["a"].v.clone()
    core.compress("b", torch.randn(6), 2)
    before_b = core.states["b"].u.clone()
    with pytest.raises(ValueError, match="'b' has 5 elements"):
        core.compress_many([("a", torch.randn(1000), None), ("b", torch.randn(5), None)], 2)
    assert torch.equal(core.states["b"].u, before_b)
    assert torch.equal(core.states["a"].v, before)
    with pytest.raises(TypeError, match="'c' must be a floating-point tensor"):
        core.compress_many([("a", torch.randn(1000), None),
                            ("c", torch.ones(3, dtype=torch.int64), None)], 2)
    with pytest.raises(ValueError, match="'a' appears twice"):
        core.compress_many([("a", torch.randn(1000), None), ("a", torch.randn(1000), None)], 2)
    assert torch.equal(core.states["a"].v, before)
    assert core.compress_many([], 2) == []


@needs_kernels
def test_batch_kernel_rejects_bad_rows_without_touching_state():
    n = 1000
    g, u, v = np.ones(n, F32), np.zeros(n, F32), np.zeros(n, F32)
    uni = np.array([0.5, 1.5])                              # 1.5 is outside [0, 1)
    buf, mag = np.empty(n, np.int64), np.empty(n, F32)
    out, vals, pay = np.empty(4, np.int64), np.empty(4, F32), np.empty(64, np.int32)
    from array import array
    row = [g.ctypes.data, u.ctypes.data, v.ctypes.data, n, 1, 0, 0, 2, 1,
           buf.ctypes.data, mag.ctypes.data, n, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]
    d, f = array("q", row), array("d", [0.9, 1.0, 0.0])

    def run(nuni=2, nk=4):
        kernels._kernels.step_many(d.buffer_info()[0], f.buffer_info()[0], 1, 2, out.ctypes.data,
                                   vals.ctypes.data, 0, pay.ctypes.data, nk, 64,
                                   uni.ctypes.data, nuni)
    with pytest.raises(ValueError, match=r"sample draw outside \[0, 1\)"):
        run()
    assert not v.any() and not u.any()
    uni[1] = 0.25
    with pytest.raises(ValueError, match="bad batch row"):
        run(nuni=1)                                         # its draws lie past the buffer
    d[12], d[18] = 2, 16                                    # k = 2, 16 payload words
    with pytest.raises(ValueError, match="bad batch row"):
        run(nk=1)                                           # its k entries lie past the buffer
    run()                                                   # a valid row runs
    assert (d[6], d[13], d[17]) == (0, 0, 0)                # its offsets, written by the kernel
    assert v.any()
    v[:], u[:] = 0.0, 0.0
    d[1] = 0                                                # mode 1 without u
    with pytest.raises(ValueError, match="bad batch row"):
        run()
    assert not v.any()


@needs_kernels
def test_all_finite_is_exact_in_every_threads_chunk():
    """all_finite splits a tensor over the pool (4 threads for 300,001 elements): a NaN or an Inf
    at the first or last element of any thread's chunk makes it False, and the largest finite
    values, -0.0 and subnormals do not."""
    n, threads = 300_001, 4
    x = np.ones(n, F32)
    x[[0, 7, 150_000, n - 1]] = [np.finfo(F32).max, -np.finfo(F32).max, -0.0,
                                 np.finfo(F32).smallest_subnormal]
    assert kernels.all_finite(n, x.ctypes.data, threads)
    edges = sorted({p for t in range(threads) for p in (n * t // threads,
                                                        n * (t + 1) // threads - 1)})
    for p in edges:
        for bad in (np.nan, np.inf, -np.inf):
            keep = x[p]
            x[p] = bad
            assert not kernels.all_finite(n, x.ctypes.data, threads), (p, bad)
            assert not kernels.all_finite(n, x.ctypes.data, 1), (p, bad)
            x[p] = keep
    assert kernels.all_finite(n, x.ctypes.data, threads)


@needs_kernels
def test_batch_kernel_settles_too_few_and_too_many_candidates_like_the_backend():
    """Rows whose sampled threshold finds fewer than k/2 candidates (the backend then takes the
    exact top-k over v) or more than the buffers hold are finished by the batch kernel itself,
    with the backend's selection; checked bit for bit against the tensor-op path."""
    rng = np.random.default_rng(3)
    conf = DGCConfig(compress_ratio=0.001, warmup_epochs=0, min_sparse_numel=1)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    cores[1].use_kernels = False
    seen = {"too_few": 0, "over_cap": 0}
    run = kernels.Batch.run

    def spy(self, like):
        run(self, like)
        for r, row in enumerate(self.rows):
            plan, cnt = row[1], self.desc[r * 24 + 21]
            if r in self.finished() and plan.sampled:
                seen["too_few"] += 2 * cnt < plan.k
                seen["over_cap"] += cnt > plan.cap
    kernels.Batch.run = spy
    try:
        names = [f"w{i}" for i in range(150)]
        for step in range(4):
            grads = [rng.standard_normal(5000).astype(F32) for _ in names]
            a = cores[0].compress_many([(n, torch.from_numpy(g.copy()), None)
                                        for n, g in zip(names, grads)], 2)
            b = [cores[1].compress(n, torch.from_numpy(g.copy()), 2) for n, g in zip(names, grads)]
            _compare(a, b, cores[0], cores[1], names, f"step {step}")
    finally:
        kernels.Batch.run = run
    assert seen["too_few"] > 0 and seen["over_cap"] > 0, seen


@pytest.mark.parametrize("many", [True, False])
def test_weight_decay_without_param_is_refused_before_any_change(many):
    core = DGCCore(DGCConfig(warmup_epochs=0, weight_decay=1e-4), TorchBackend())
    p = torch.randn(5000)
    core.compress("a", torch.randn(5000), 2, param=p)
    v, gen = core.states["a"].v.clone(), core.B.generator_state(core._generator).clone()
    with pytest.raises(ValueError, match="needs the parameter of 'b'"):
        if many:
            core.compress_many([("a", torch.randn(5000), p), ("b", torch.randn(5000), None)], 2)
        else:
            core.compress("b", torch.randn(5000), 2)
    assert torch.equal(core.states["a"].v, v) and "b" not in core.states
    assert torch.equal(core.B.generator_state(core._generator), gen)


@needs_kernels
def test_finish_checks_everything_before_it_clears_the_sent_positions():
    # a payload buffer too small or repeated positions raise, and v / u keep their values (the
    # batch kernel relies on it to leave a row it cannot finish to the caller)
    n = 1000
    v = np.arange(1, n + 1, dtype=F32)
    u = -v
    vals, usent = np.empty(3, F32), np.empty(3, F32)
    for idx, cap in ((np.array([900, 10, 500], np.int64), 6),          # needs 5 + 2 + 3 words
                     (np.array([10, 500, 10], np.int64), 64)):         # 10 twice
        payload = np.empty(64, np.int32)
        with pytest.raises(ValueError, match="payload buffer too small|not unique"):
            kernels._kernels.finish(idx.ctypes.data, 3, v.ctypes.data, u.ctypes.data, 1, 1,
                                    vals.ctypes.data, usent.ctypes.data, payload.ctypes.data, cap,
                                    n, 0)
        assert np.array_equal(v, np.arange(1, n + 1, dtype=F32)) and np.array_equal(u, -v)
