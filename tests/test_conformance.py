"""The one conformance suite of the engine contract (dgc_horovod/core/engine.py): every engine —
the tensor ops on the NumPy, PyTorch and TensorFlow backends, the C kernels on NumPy and PyTorch
CPU tensors, the Triton kernels (on CPU tensors under ``TRITON_INTERPRET=1``) — against the NumPy
reference (``OpsEngine(NumpyBackend())``), bit for bit, step after step: payload words, counts,
the finite flags, the entries sent (padding included), the float16 counts, and u and v after
every step. The reference itself is held to a plain NumPy transcription of the selection rule
(sparsify's module docstring) and of Algorithm 1's accumulation.

Public behaviour only: each engine is driven through ``compress`` / ``decode`` as the core
drives it.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")     # before anything imports triton

import numpy as np
import pytest

from dgc_horovod.core import DGCConfig, sparsify, wire
from dgc_horovod.core.backend import NumpyBackend
from dgc_horovod.core.engine import OpsEngine, make_step
from helpers import to_np

pytestmark = pytest.mark.unit

F32 = np.float32


# ----------------------------------------------------------------------------- the engines
def _torch_backend():
    from dgc_horovod.backends.torch_backend import TorchBackend
    return TorchBackend()


def _c(backend):
    def make():
        from dgc_horovod.core import c_engine
        if not c_engine.available():
            pytest.skip("the C kernels are not built")
        B = NumpyBackend() if backend == "numpy" else _torch_backend()
        return B, c_engine.CEngine(B)
    return make


def _triton():
    pytest.importorskip("triton")
    from dgc_horovod.backends import triton_engine
    B = _torch_backend()
    return B, triton_engine.TritonEngine(B)


ENGINES = {
    "ops-numpy": lambda: (NumpyBackend(), OpsEngine(NumpyBackend())),
    "ops-torch": lambda: (lambda B: (B, OpsEngine(B)))(_torch_backend()),
    "ops-tensorflow": lambda: (lambda B: (B, OpsEngine(B)))(_tf_backend()),
    "c-numpy": _c("numpy"),
    "c-torch": _c("torch"),
    "triton": _triton,
}


def _tf_backend():
    from dgc_horovod.backends.tf_backend import TFBackend
    return TFBackend()


def _tensor(B, a):
    a = np.ascontiguousarray(a)
    if B.name == "torch":
        import torch
        return torch.from_numpy(a.copy())
    if B.name == "tensorflow":
        import tensorflow as tf
        return tf.constant(a)
    return a.copy()


def _list(x):
    """A Result field (list, or a tensor of the engine) as a plain list."""
    return [v.item() if hasattr(v, "item") else v for v in
            (to_np(x).tolist() if not isinstance(x, (list, tuple)) else x)]


class Run:
    """One engine's state of a bucket driven step by step: flat u, v with per-segment views for
    the engines that work on them (``flat``), the tensors' own u, v for the others."""

    def __init__(self, make, config, sizes, names=None):
        self.B, self.engine = make()
        self.config, self.sizes = config, list(sizes)
        self.names = names or [f"t{j}" for j in range(len(sizes))]
        step = make_step(config, self.names, sizes, 0.5, 1)
        B = self.B
        momentum = config.momentum > 0
        if self.engine.flat:
            total = step.offsets[-1]
            self.u = _tensor(B, np.zeros(total, F32)) if momentum else None
            self.v = _tensor(B, np.zeros(total, F32))
            cut = lambda flat: [B.slice(flat, a, a + n) for a, n in zip(step.offsets, sizes)]
            self.us = [None] * len(sizes) if self.u is None else cut(self.u)
            self.vs = cut(self.v)
        else:
            self.u = self.v = None     # (TensorFlow: variables, which the ops update in place)
            zeros = (lambda n: B.zeros(n)) if B.name == "tensorflow" else (
                lambda n: _tensor(B, np.zeros(n, F32)))
            self.us = [zeros(n) if momentum else None for n in sizes]
            self.vs = [zeros(n) for n in sizes]

    def step(self, t, density, grads, scales=None):
        B = self.B
        step = make_step(self.config, self.names, self.sizes, density, t)
        scales = scales or [1.0] * len(self.sizes)
        r = self.engine.compress(step, self.us, self.vs, [_tensor(B, g) for g in grads],
                                 scales, flat=(self.u, self.v) if self.engine.flat else None)
        return step, r

    def snapshot(self, step, r):
        """Everything the contract fixes, as NumPy arrays and lists."""
        return {
            "payloads": [to_np(p).view(np.int32).tolist() for p in r.payloads],
            "counts": _list(r.counts), "finite": [bool(f) for f in _list(r.finite)],
            "sel": to_np(r.sel).tolist(), "vals": to_np(r.vals).view(np.int32).tolist(),
            "usent": None if r.usent is None else to_np(r.usent).view(np.int32).tolist(),
            "fp16": [tuple(int(x) for x in f) for f in
                     (to_np(r.fp16).tolist() if not isinstance(r.fp16, list) else r.fp16)],
            "dropped": [bool(d) for d in _list(r.dropped)],
            "u": [None if u is None else to_np(u).view(np.int32).tolist() for u in self.us],
            "v": [to_np(v).view(np.int32).tolist() for v in self.vs],
        }


def _grads(rng, sizes, kind, t):
    out = []
    for j, n in enumerate(sizes):
        g = rng.standard_normal(n).astype(F32)
        if kind == "ties":                      # few distinct magnitudes: ties at the k-th
            g = np.round(g * 2).astype(F32) / F32(2)
        elif kind == "sparse":                  # mostly zeros (fewer non-zeros than k)
            g[rng.random(n) < 0.995] = 0
        elif kind == "nan" and j == 0 and t == 2:
            g[n // 2] = np.nan
        elif kind == "inf" and j == len(sizes) - 1 and t == 1:
            g[0] = -np.inf
        elif kind == "huge":                    # float16 overflow (and flush below)
            g *= F32(3e4) if t == 2 else F32(1e-8)
        elif kind == "heavy":                   # heavy tails: a few entries dominate
            g = (rng.standard_cauchy(n) * 3).astype(F32)
        out.append(g)
    return out


CONFIGS = {
    "default": {},
    "nesterov": {"nesterov": True},
    "no-momentum": {"momentum": 0.0},
    "no-masking": {"momentum_masking": False},
    "int32": {"wire_index": "int32"},
    "fp16": {"wire_values": "float16"},
    "int32-fp16": {"wire_index": "int32", "wire_values": "float16"},
    "exact": {"exact_topk": True},
    "coarse-samples": {"sample_ratio": 0.001},
}
SIZES = [1, 7, 64, 65, 1000, 4099, 70001]


def _case(engine, config, kind, density=0.01, sizes=SIZES, steps=3, scales=None, seed=0):
    cfg = DGCConfig(**CONFIGS[config], seed=seed)
    ref, run = Run(ENGINES["ops-numpy"], cfg, sizes), Run(ENGINES[engine], cfg, sizes)
    rng = np.random.default_rng(seed)
    for t in range(1, steps + 1):
        grads = _grads(rng, sizes, kind, t)
        want = ref.snapshot(*ref.step(t, density, grads, scales))
        got = run.snapshot(*run.step(t, density, grads, scales))
        for key in want:
            assert got[key] == want[key], f"{engine} {config} {kind} step {t}: {key} differs"


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "ops-numpy"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_matches_the_reference(engine, config):
    _case(engine, config, "normal")


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "ops-numpy"])
@pytest.mark.parametrize("kind", ["ties", "sparse", "nan", "inf", "huge", "heavy"])
def test_engine_matches_the_reference_on_hard_gradients(engine, kind):
    _case(engine, "fp16" if kind == "huge" else "default", kind)


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "ops-numpy"])
@pytest.mark.parametrize("density", [1.0, 0.6, 0.25, 0.001])
def test_engine_matches_the_reference_at_warm_up_densities(engine, density):
    _case(engine, "default", "normal", density=density)


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "ops-numpy"])
def test_engine_matches_the_reference_with_clipping_scales(engine):
    _case(engine, "nesterov", "normal", scales=[0.5, 1.0, 0.25, 1.0, 0.75, 0.125, 0.3])


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("index,values", [("delta16", "float32"), ("int32", "float32"),
                                          ("delta16", "float16"), ("int32", "float16")])
def test_decode_sums_in_rank_order(engine, index, values):
    """Every engine's decode of three ranks' payloads equals the reference's: rank-ordered sums,
    times float32(1/3); a flagged rank makes the step non-finite."""
    B0, ref = ENGINES["ops-numpy"]()
    B, eng = ENGINES[engine]()
    cfg = DGCConfig(wire_index=index, wire_values=values)
    n = 200000
    rng = np.random.default_rng(1)
    payloads = []
    for r in range(3):
        run = Run(ENGINES["ops-numpy"], cfg, [n], names=["w"])
        _, res = run.step(1, 0.01, [rng.standard_normal(n).astype(F32) * F32(r + 1)])
        payloads.append(to_np(res.payloads[0]))
    gathered = np.concatenate(payloads)
    want = np.zeros(n, F32)
    assert not ref.decode(gathered, n, 3, want, 1.0 / 3, "w")
    got = B.float32_flat(_tensor(B, np.full(n, 7.0, F32)))   # (TensorFlow: a variable)
    assert not eng.decode(_tensor(B, gathered), n, 3, got, 1.0 / 3, "w")
    assert to_np(got).view(np.int32).tolist() == want.view(np.int32).tolist()
    flagged = wire.encode(B0, n, np.zeros(0, np.int64), np.zeros(0, F32), wire.FLAG_NONFINITE,
                          index, values, sparsify.k_for(n, 0.01))
    assert eng.decode(_tensor(B, np.concatenate([payloads[0], flagged])), n, 2,
                      B.float32_flat(_tensor(B, np.zeros(n, F32))), 0.5, "w")


# ----------------------------------------------------------------------------- the reference
def _rule(v, p, base):
    """A plain NumPy transcription of the selection rule (sparsify's module docstring)."""
    bits = np.abs(v).view(np.int32).astype(np.int64)
    t1 = t2 = 1
    if p.s:
        i = np.arange(p.s, dtype=np.uint64)
        h = (base + i * np.uint64(sparsify.GOLDEN)) & np.uint64(0xFFFFFFFF)
        h ^= h >> np.uint64(16)
        h = (h * np.uint64(sparsify.MIX_M1)) & np.uint64(0xFFFFFFFF)
        h ^= h >> np.uint64(15)
        h = (h * np.uint64(sparsify.MIX_M2)) & np.uint64(0xFFFFFFFF)
        h ^= h >> np.uint64(16)
        sampled = np.sort(bits[((h * np.uint64(p.n)) >> np.uint64(32)).astype(np.int64)])
        t1, t2 = max(int(sampled[-p.ks1]), 1), max(int(sampled[-p.ks2]), 1)
    level = t1 if np.count_nonzero(bits >= t1) >= p.k else t2
    cand = np.flatnonzero(bits >= level)
    order = sorted(cand.tolist(), key=lambda i: (-bits[i], i))     # magnitude, then position
    return np.array(sorted(order[:p.k]), dtype=np.int64)


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "heavy"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.3, 1.0])
def test_reference_selection_is_the_rule(kind, density):
    rng = np.random.default_rng(3)
    cfg = DGCConfig()
    for n in (1, 50, 3000, 100003):
        v = _grads(rng, [n], kind, 1)[0]
        p = sparsify.plan(n, density, cfg)
        base = sparsify.sample_base(sparsify.seed_key(0), sparsify.tensor_key("x"), 5)
        got = sparsify.select(NumpyBackend(), v, p, base)
        assert got.tolist() == _rule(v, p, base).tolist()


def test_selection_is_the_exact_top_k_when_k_entries_reach_the_lower_threshold():
    """Nearly always: Algorithm 1's top-k of |v|, ties to the lower position."""
    rng = np.random.default_rng(4)
    cfg = DGCConfig()
    exact = 0
    for t in range(200):
        v = rng.standard_normal(20000).astype(F32)
        p = sparsify.plan(v.size, 0.001, cfg)
        got = sparsify.select(NumpyBackend(), v, p, sparsify.sample_base(1, 2, t))
        want = np.sort(np.argsort(-np.abs(v), kind="stable")[:p.k])
        exact += got.tolist() == want.tolist()
    assert exact >= 195, exact


def test_sample_positions_are_a_counter_hash_of_seed_tensor_and_step():
    B = NumpyBackend()
    like = np.zeros(1, np.int64)
    a = sparsify.sample_positions(B, sparsify.sample_base(7, 11, 3), 1000, 5000, like)
    assert a.min() >= 0 and a.max() < 5000 and len(set(a.tolist())) > 850   # ~uniform
    for other in ((8, 11, 3), (7, 12, 3), (7, 11, 4)):
        b = sparsify.sample_positions(B, sparsify.sample_base(*other), 1000, 5000, like)
        assert (a != b).mean() > 0.99
    again = sparsify.sample_positions(B, sparsify.sample_base(7, 11, 3), 1000, 5000, like)
    assert a.tolist() == again.tolist()


def test_reference_accumulates_as_algorithm_1():
    """u ← m·u + s·g, v ← v + u (Nesterov: v + s·g + m·u), each product and sum rounded to
    float32 on its own; the entries sent leave v (and u with masking)."""
    rng = np.random.default_rng(5)
    for nesterov in (False, True):
        cfg = DGCConfig(nesterov=nesterov)
        run = Run(ENGINES["ops-numpy"], cfg, [5000])
        u = np.zeros(5000, F32)
        v = np.zeros(5000, F32)
        m, s = F32(0.9), F32(0.75)
        for t in range(1, 4):
            g = rng.standard_normal(5000).astype(F32)
            step, r = run.step(t, 0.01, [g], [0.75])
            u = m * u + s * g
            v = (v + s * g) + m * u if nesterov else v + u
            idx = to_np(r.sel)[:r.counts[0]]
            assert to_np(r.vals)[:r.counts[0]].tolist() == v[idx].tolist()
            v[idx] = 0
            u[idx] = 0
            assert to_np(run.vs[0]).tolist() == v.tolist()
            assert to_np(run.us[0]).tolist() == u.tolist()
