"""Tests of the framework-agnostic DGC core (`dgc_horovod.core`) and its PyTorch backend.

Expected values come from the plain NumPy transcription of Lin et al. 2018 ("Deep Gradient
Compression", ICLR 2018, arXiv:1712.01887) written at the top of this file, never from the core's
own functions. N ranks are simulated in one process with one `DGCCore` per rank: Horovod's
allgather is the concatenation of the ranks' payloads in rank order, its allreduce-average the
rank-ordered sum divided by N.
"""
import math
import re

import numpy as np
import pytest
import tensorflow as tf
import torch

from dgc_horovod.core import (CompressionStats, DGCConfig, DGCCore, NumpyBackend,
                              WireFormatError, density_at)
from dgc_horovod.core import accumulate, sparsify, wire
from dgc_horovod.backends.torch_backend import TorchBackend
from dgc_horovod.backends.tf_backend import TFBackend
from helpers import to_backend, to_np

# these tests are of the sparse path's mechanics on flat gradients (see conftest)
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("sparse_mechanics")]

F32 = np.float32
BACKENDS = {"numpy": NumpyBackend(), "torch": TorchBackend(), "tensorflow": TFBackend()}
BACKEND_NAMES = sorted(BACKENDS)
# DGCCore runs the C engine (dgc_horovod/core/_kernels.c) on NumPy and CPU torch tensors;
# "<backend>-ops" forces the tensor-op engine there, so that both meet the references
CORE_PATHS = BACKEND_NAMES + ["numpy-ops", "torch-ops"]

# Wire format "DGC v3", as documented: 6 header words [magic, numel, count,
# flags | index_code << 8 | value_code << 16, tokens, k], then the index section and the value
# section, each of a size fixed by (numel, k), zero padded.
MAGIC = 0x44474303
HEADER_WORDS = 6
FORMATS = [("int32", "float32"), ("delta16", "float32"), ("int32", "float16"),
           ("delta16", "float16")]
PLACEHOLDER = 4          # bytes of the 1-element fp32 placeholder a sparse tensor allreduces


# ============================================================ NumPy transcription of the paper
def ref_clip(g, clip_norm, world_size, average=True):
    """Local gradient clipping (§3.2): the paper clips the contribution nodes sum, ∇k = g/N under
    Horovod's Average, at clip_norm·N^(-1/2); so g ← g · min(1, clip_norm·√N / ‖g‖₂) under
    Average, and min(1, clip_norm·N^(-1/2) / ‖g‖₂) under Sum (g is then the contribution)."""
    if clip_norm is None:
        return g.astype(F32)
    threshold = clip_norm * math.sqrt(world_size) if average else clip_norm / math.sqrt(world_size)
    norm = float(np.linalg.norm(g.astype(np.float64)))
    return (g * F32(min(1.0, threshold / norm))).astype(F32) if norm > 0 else g.astype(F32)


def ref_momentum_correction(u, v, g, m, nesterov=False):
    """Momentum correction (§3.1, eq. 5–6), returns new (u, v):

    m = 0:     v ← v + g                       (plain error feedback)
    classic:   u ← m·u + g ;  v ← v + u
    Nesterov:  u ← m·u + g ;  v ← v + g + m·u
    """
    if m == 0:
        return u, (v + g).astype(F32)
    u = (F32(m) * u + g).astype(F32)
    v = (v + g + F32(m) * u) if nesterov else (v + u)
    return u, v.astype(F32)


def ref_clear_sent(u, v, idx, masking):
    """Sent positions: v[idx] ← 0 always; momentum factor masking (§3.2): u[idx] ← 0 too."""
    v = v.copy()
    v[idx] = 0
    if masking and u is not None:
        u = u.copy()
        u[idx] = 0
    return u, v


def ref_density(epoch, final, warmup_epochs=4, initial=0.25, per_step=False):
    """Warm-up (§3.3): density(e) = initial·(final/initial)^(e/W) for e < W, final afterwards;
    e = floor(epoch) (paper: once per epoch) or the fractional epoch (per_step)."""
    e = epoch if per_step else math.floor(epoch)
    if warmup_epochs == 0 or e >= warmup_epochs:
        return final
    return initial * (final / initial) ** (e / warmup_epochs)


def ref_k(numel, density):
    """Entries to send: k = ceil(density·numel), at least 1 (float noise near integers ignored)."""
    x = density * numel
    r = round(x)
    return max(1, min(numel, r if abs(x - r) < 1e-6 else math.ceil(x)))


def ref_topk(v, k):
    """Exact top-k of |v| among its non-zero entries (ties to the lower position)."""
    order = np.argsort(-np.abs(v), kind="stable")[:k]
    return order[v[order] != 0]


def ref_delta16_tokens(idx):
    """Paper's run lengths: per entry its gap d = idx_i - idx_(i-1) (idx_(-1) = -1); gaps above
    65535 first emit escape tokens 0, each worth 65535 positions."""
    tokens, prev = [], -1
    for i in sorted(int(i) for i in idx):
        gap = i - prev
        while gap > 65535:
            tokens.append(0)
            gap -= 65535
        tokens.append(gap)
        prev = i
    return np.array(tokens, dtype=np.int64)


def _words16(a, dtype):
    a = np.asarray(a).astype(dtype)
    if a.size % 2:
        a = np.concatenate([a, np.zeros(1, dtype)])
    return a.view(np.int32)


def _pad(words, size):
    return np.concatenate([words, np.zeros(size - words.size, np.int32)])


def ref_payload(numel, idx, vals, flags=0, index="int32", values="float32", k=None):
    """One rank's payload in the documented v3 layout (entries in ascending order), with room
    for k entries (default: as many as it has)."""
    idx, vals = np.asarray(idx, dtype=np.int64), np.asarray(vals, dtype=F32)
    order = np.argsort(idx, kind="stable")
    idx, vals = idx[order], vals[order]
    k = idx.size if k is None else k
    if index == "delta16":
        toks = ref_delta16_tokens(idx)
        iw, ntok = _words16(toks, np.uint16), toks.size
        iw_size = (k + (numel - 1) // 65535 + 1) // 2
    else:
        iw, ntok, iw_size = idx.astype(np.int32), idx.size, k
    vw = vals.view(np.int32) if values == "float32" else _words16(vals, np.float16)
    vw_size = k if values == "float32" else (k + 1) // 2
    word3 = flags | ["int32", "delta16"].index(index) << 8 | ["float32", "float16"].index(values) << 16
    head = np.array([MAGIC, numel, idx.size, word3, ntok, k], dtype=np.int64).astype(np.int32)
    return np.concatenate([head, _pad(iw.astype(np.int32), iw_size),
                           _pad(vw.astype(np.int32), vw_size)]).astype(np.int32)


def ref_parse(words):
    """Inverse of ref_payload for one rank: (numel, count, flags, indices int64, values f32)."""
    words = np.asarray(words, dtype=np.int32)
    magic, numel, c, word3, ntok, k = (int(x) for x in words[:HEADER_WORDS])
    assert magic == MAGIC
    index, values = ("int32", "delta16")[(word3 >> 8) & 0xFF], ("float32", "float16")[word3 >> 16]
    body = words[HEADER_WORDS:]
    if index == "int32":
        idx, n_iw = body[:c].astype(np.int64), k
    else:
        n_iw = (k + (numel - 1) // 65535 + 1) // 2
        toks, pos, idx = body[:n_iw].view(np.uint16)[:ntok].astype(np.int64), -1, []
        for t in toks:
            pos += 65535 if t == 0 else int(t)
            if t:
                idx.append(pos)
        idx = np.array(idx, dtype=np.int64)
    vw = body[n_iw:]
    vals = vw.view(F32)[:c] if values == "float32" else vw.view(np.float16)[:c].astype(F32)
    assert vals.size == c and idx.size == c
    return numel, c, word3 & 0xFF, idx, vals


def ref_rank_order_sum(numel, contributions):
    """Σ over ranks, rank 0 first, of each rank's sparse (idx, vals), in float32."""
    out = np.zeros(numel, dtype=F32)
    for idx, vals in contributions:
        out[idx] += vals
    return out


def ref_sgd(w, buf, grad, lr, m=0.0, nesterov=False, weight_decay=0.0):
    """Dense (momentum) SGD, as torch.optim.SGD: d ← g + λw; b ← m·b + d;
    step = d + m·b (Nesterov) or b; w ← w − lr·step. Returns (w, buf)."""
    d = grad + F32(weight_decay) * w
    if m == 0:
        return (w - F32(lr) * d).astype(F32), buf
    buf = (F32(m) * buf + d).astype(F32)
    step = d + F32(m) * buf if nesterov else buf
    return (w - F32(lr) * step).astype(F32), buf


class RefRank:
    """One rank of DGC with exact top-k (Algorithm 1 + §3), in NumPy."""

    def __init__(self, numel, m, nesterov, masking, clip_norm, world_size):
        self.u = np.zeros(numel, F32)
        self.v = np.zeros(numel, F32)
        self.m, self.nesterov, self.masking = m, nesterov, masking
        self.clip_norm, self.world_size = clip_norm, world_size

    def step(self, g, k):
        g = ref_clip(np.asarray(g, F32).reshape(-1), self.clip_norm, self.world_size)
        self.u, self.v = ref_momentum_correction(self.u, self.v, g, self.m, self.nesterov)
        idx = ref_topk(self.v, k)
        vals = self.v[idx].copy()
        self.u, self.v = ref_clear_sent(self.u, self.v, idx, self.masking)
        return idx, vals


# ============================================================ simulation helpers
def mutable(B, a):
    """A flat float32 copy that in-place backend methods may update (a tf.Variable on TF)."""
    return B.float32_flat(to_backend(B, np.asarray(a, F32)))


def make_ranks(world_size, backend, **cfg):
    """One DGCCore per rank; backend "numpy-ops" / "torch-ops": the tensor-op engine."""
    cfg.setdefault("warmup_epochs", 0)
    name, _, path = backend.partition("-")
    cfg.setdefault("engine", "ops" if path == "ops" else "auto")
    return [DGCCore(DGCConfig(**cfg), BACKENDS[name]) for _ in range(world_size)]


def exchange(cores, name, grads, params=None, average=True):
    """One step of tensor `name` on every simulated rank.

    Returns (per-rank decompressed updates, per-rank compress outputs as NumPy, kind)."""
    n = len(cores)
    B = cores[0].B
    params = params or [None] * n
    outs = [core.compress(name, to_backend(B, g), n, param=None if p is None else to_backend(B, p))
            for core, g, p in zip(cores, grads, params)]
    kind = outs[0][0]
    assert all(o[0] == kind for o in outs)
    if kind == "sparse":
        gathered = B.cat([o[1] for o in outs])          # allgather = concatenation in rank order
        updates = [to_np(core.decompress(gathered, o[2], n, average))
                   for core, o in zip(cores, outs)]
    else:                                               # dense allreduce (average)
        total = np.zeros_like(to_np(outs[0][1]))
        for o in outs:
            total += to_np(o[1])
        if average:
            total /= F32(n)
        updates = [total.copy() for _ in cores]
    return updates, [to_np(o[1]) for o in outs], kind


def state_np(core, name):
    st = core.states[name]
    return (None if st.u is None else to_np(st.u)), (None if st.v is None else to_np(st.v))


class Quadratic:
    """Per-rank loss ½wᵀA_r w − b_rᵀw on a weight of `shape`: gradient A_r w − b_r (float32)."""

    def __init__(self, world_size, shape, seed):
        rng = np.random.default_rng(seed)
        n = int(np.prod(shape))
        self.shape = shape
        self.A, self.b = [], []
        for _ in range(world_size):
            q = rng.standard_normal((n, n))
            self.A.append((q @ q.T / n + 0.5 * np.eye(n)))
            self.b.append(rng.standard_normal(n))
        self.w0 = rng.standard_normal(shape).astype(F32)

    def grads(self, w):
        w = np.asarray(w, np.float64).reshape(-1)
        return [(A @ w - b).astype(F32).reshape(self.shape) for A, b in zip(self.A, self.b)]


def run_against_sgd(backend, world_size, dgc_cfg, sgd_kwargs, shape=(5, 8), steps=6, lr=0.05,
                    reference="torch", seed=0):
    """Train the Quadratic with DGC (update applied by plain SGD w ← w − lr·update) and with dense
    SGD(**sgd_kwargs) on the averaged gradient; assert the weights agree after every step."""
    prob = Quadratic(world_size, shape, seed)
    cores = make_ranks(world_size, backend, **dgc_cfg)
    wd = sgd_kwargs.get("weight_decay", 0.0)
    w_dgc = prob.w0.copy()
    w_t = torch.nn.Parameter(torch.from_numpy(prob.w0.copy()))
    opt = torch.optim.SGD([w_t], lr=lr, **sgd_kwargs)
    w_np, buf = prob.w0.copy(), np.zeros(shape, F32)
    for _ in range(steps):
        params = [w_dgc] * world_size if wd else None
        updates, _, _ = exchange(cores, "w", prob.grads(w_dgc), params=params)
        for u in updates[1:]:
            assert np.array_equal(u, updates[0])
        w_dgc = (w_dgc - F32(lr) * updates[0].reshape(shape)).astype(F32)
        if reference == "torch":
            opt.zero_grad()
            w_t.grad = torch.from_numpy(np.mean(prob.grads(w_t.detach().numpy()), axis=0))
            opt.step()
            w_ref = w_t.detach().numpy()
        else:
            w_np, buf = ref_sgd(w_np, buf, np.mean(prob.grads(w_np), axis=0), lr,
                                sgd_kwargs.get("momentum", 0.0), sgd_kwargs.get("nesterov", False),
                                wd)
            w_ref = w_np
        np.testing.assert_allclose(w_dgc, w_ref, rtol=2e-5, atol=2e-6)
    # the trajectory moved (a no-op update would not pass for the right reason)
    assert not np.allclose(w_dgc, prob.w0, atol=1e-2)


# ============================================================ DGCConfig: bad input
@pytest.mark.parametrize("value,exc", [(0, ValueError), (0.0, ValueError), (1.5, ValueError),
                                       (-0.1, ValueError), (float("nan"), ValueError),
                                       ("x", TypeError), (None, TypeError)])
def test_config_rejects_bad_compress_ratio(value, exc):
    with pytest.raises(exc, match="compress_ratio"):
        DGCConfig(compress_ratio=value)


@pytest.mark.parametrize("value,exc", [(0, ValueError), (1.01, ValueError), (-0.5, ValueError),
                                       (float("nan"), ValueError), ("0.1", TypeError)])
def test_config_rejects_bad_sample_ratio(value, exc):
    with pytest.raises(exc, match="sample_ratio"):
        DGCConfig(sample_ratio=value)


@pytest.mark.parametrize("value,exc", [(1.0, ValueError), (1.5, ValueError), (-0.1, ValueError),
                                       (float("nan"), ValueError), ("0.9", TypeError)])
def test_config_rejects_bad_momentum(value, exc):
    with pytest.raises(exc, match="momentum"):
        DGCConfig(momentum=value)


def test_config_accepts_boundaries():
    c = DGCConfig(compress_ratio=1.0, sample_ratio=1.0, momentum=0.0)
    assert (c.compress_ratio, c.sample_ratio, c.momentum) == (1.0, 1.0, 0.0)


# ============================================================ warm-up (§3.3)
def test_warmup_reproduces_paper_schedule():
    # Paper: sparsity 75%, 93.75%, 98.4375%, 99.6%, 99.9% over 4 warm-up epochs. The geometric
    # schedule 0.25 → 0.001 matches these densities to ~1% (largest deviation 1.2%, epoch 2).
    paper_density = [1 - s for s in (0.75, 0.9375, 0.984375, 0.996, 0.999)]
    got = [density_at(e, 0.001, warmup_epochs=4) for e in range(5)]
    assert got == pytest.approx(paper_density, rel=0.015)
    assert [1 - d for d in got] == pytest.approx([1 - d for d in paper_density], rel=1e-3)


@pytest.mark.parametrize("epoch", [0, 0.5, 1, 1.99, 2, 3.7, 4, 4.5, 100])
@pytest.mark.parametrize("final,W", [(0.001, 4), (0.01, 2.5), (0.1, 1)])
def test_warmup_formula_floors_epoch(epoch, final, W):
    assert density_at(epoch, final, warmup_epochs=W) == pytest.approx(
        ref_density(epoch, final, W), rel=1e-12)


@pytest.mark.parametrize("epoch", [0.25, 1.5, 2.75, 3.999])
def test_warmup_per_step_uses_fractional_epoch(epoch):
    got = density_at(epoch, 0.001, warmup_epochs=4, per_step=True)
    assert got == pytest.approx(ref_density(epoch, 0.001, 4, per_step=True), rel=1e-12)
    assert got < density_at(epoch, 0.001, warmup_epochs=4)       # strictly below the floored one


def test_warmup_disabled_gives_final_density():
    assert density_at(0, 0.001, warmup_epochs=0) == 0.001
    assert DGCCore(DGCConfig(warmup_epochs=0), BACKENDS["numpy"]).density == 0.004


def test_warmup_rejects_negative_epoch():
    core = DGCCore(DGCConfig(), BACKENDS["numpy"])
    with pytest.raises(ValueError, match="epoch"):
        core.set_epoch(-1)


@pytest.mark.parametrize("per_step", [False, True])
def test_core_density_follows_set_step(per_step):
    core = DGCCore(DGCConfig(compress_ratio=0.001, warmup_per_step=per_step), BACKENDS["numpy"])
    for step in (0, 3, 10, 25, 39, 40, 100):
        core.set_step(step, 10)
        assert core.density == pytest.approx(ref_density(step / 10, 0.001, 4, per_step=per_step),
                                             rel=1e-12)


def test_warmup_position_takes_numpy_scalars():
    """set_epoch / set_step take NumPy scalars (a loop counter from np.arange) as Python's."""
    core = DGCCore(DGCConfig(compress_ratio=0.001, warmup_epochs=4), BACKENDS["numpy"])
    for epoch in (np.int64(2), np.float32(2.0)):
        core.set_epoch(epoch)
        assert core.epoch == 2.0 and type(core.epoch) is float
    core.set_step(np.int64(30), np.int32(10))
    assert core.epoch == 3.0
    with pytest.raises(TypeError, match="step must be an int >= 0, got float64"):
        core.set_step(np.float64(3.0), 10)
    with pytest.raises(TypeError, match="step must be an int >= 0, got str '3'"):
        core.set_step("3", 10)      # the wrong type a TypeError, as set_epoch's
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        core.set_step(-1, 10)
    steps = DGCCore(DGCConfig(compress_ratio=0.001, warmup_epochs=None, warmup_steps=8),
                    BACKENDS["numpy"])
    steps.set_step(np.int64(100))
    assert steps.steps == 100 and type(steps.steps) is int
    for bad, error in ((0, ValueError), (-5, ValueError), (2.5, TypeError)):
        with pytest.raises(error, match="steps_per_epoch must be an int >= 1"):
            steps.set_step(3, bad)      # given, it is checked in either mode
    assert steps.steps == 100


def test_negative_zero_is_zero():
    """HOROVOD_DGC_MOMENTUM=-0.0 printed momentum=-0.0 in str(config)."""
    assert str(DGCConfig(momentum=-0.0).momentum) == "0.0"


def test_seed_range_is_checked_by_name():
    """A seed no backend's generator takes is refused by the config, naming seed."""
    assert DGCConfig(seed=2 ** 63 - 1).seed == 2 ** 63 - 1
    for bad in (2 ** 63, 2 ** 70, -1):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 9223372036854775807\]"):
            DGCConfig(seed=bad)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_sent_count_follows_warmup(backend):
    n = 20000
    core = DGCCore(DGCConfig(compress_ratio=0.001, exact_topk=True, min_sparse_numel=1),
                   BACKENDS[backend])
    rng = np.random.default_rng(0)
    for epoch in range(6):
        core.set_epoch(epoch)
        _, payload, _ = exchange([core], "w", [rng.standard_normal(n).astype(F32)])
        assert ref_parse(payload[0])[1] == ref_k(n, ref_density(epoch, 0.001, 4))


# ============================================================ backend primitives
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_backend_selection_primitives(backend):
    B, rng = BACKENDS[backend], np.random.default_rng(20)
    x = rng.permutation(np.arange(1, 201)).astype(F32)            # distinct values 1..200
    xb = to_backend(B, x)
    for k in (1, 2, 17, 199, 200):
        assert float(B.kth_largest(xb, k)) == np.sort(x)[-k]
        np.testing.assert_array_equal(np.sort(x[to_np(B.topk_indices(xb, k))]), np.sort(x)[-k:])
    np.testing.assert_array_equal(np.sort(to_np(B.indices_where_ge(xb, 190.0))),
                                  np.sort(np.flatnonzero(x >= 190)))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_backend_state_primitives(backend):
    B = BACKENDS[backend]
    x = np.array([1.0, -2.0, 3.0, 0.0, 5.0], F32)
    idx = to_backend(B, np.array([4, 0], np.int64))
    y = mutable(B, x)
    B.fill_at_(y, idx, 0.0)
    np.testing.assert_array_equal(to_np(y), [0, -2, 3, 0, 0])
    B.scatter_(y, idx, to_backend(B, np.array([7.0, 8.0], F32)))
    np.testing.assert_array_equal(to_np(y), [8, -2, 3, 0, 7])
    B.index_add_(y, idx, to_backend(B, np.array([1.0, 1.0], F32)))
    np.testing.assert_array_equal(to_np(y), [9, -2, 3, 0, 8])
    np.testing.assert_array_equal(to_np(B.drop_zeros(to_backend(B, np.arange(5)), B.abs(y))),
                                  [0, 1, 2, 4])
    assert float(B.norm(to_backend(B, x))) == pytest.approx(np.sqrt(39.0), rel=1e-6)
    assert B.min_max(to_backend(B, np.array([3, -1, 9], np.int32))) == (-1, 9)
    assert B.all_finite(to_backend(B, x))
    assert not B.all_finite(to_backend(B, np.array([1.0, np.inf], F32)))
    assert not B.all_finite(to_backend(B, np.array([np.nan, 1.0], F32)))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_backend_float32_bits_round_trip(backend):
    B = BACKENDS[backend]
    x = np.array([0.0, -0.0, 1.5, -3.25e-38, 3.4e38, 1e-45, np.inf, np.nan], F32)
    bits = to_np(B.float32_bits(to_backend(B, x)))
    assert bits.dtype == np.int32
    np.testing.assert_array_equal(bits, x.view(np.int32))
    assert to_np(B.bits_float32(to_backend(B, bits))).tobytes() == x.tobytes()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_torch_backend_accepts_other_float_dtypes(dtype):
    g = torch.randn(300, generator=torch.Generator().manual_seed(21)).to(dtype)
    kw = dict(compress_ratio=0.05, exact_topk=True, min_sparse_numel=1)
    a = make_ranks(1, "torch", **kw)[0].compress("w", g, 1)
    b = make_ranks(1, "torch", **kw)[0].compress("w", g.to(torch.float32), 1)
    assert torch.equal(a[1], b[1])


def test_torch_backend_rejects_integer_and_non_tensor():
    B = BACKENDS["torch"]
    assert not B.is_floating(torch.arange(3)) and not B.is_floating(np.zeros(3, F32))
    assert B.is_floating(torch.zeros(3, dtype=torch.float16))


# ============================================================ accumulation (§3.1, §3.2)
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("m,nesterov", [(0.0, False), (0.9, False), (0.9, True), (0.5, True)])
def test_momentum_correction_matches_equations(backend, m, nesterov):
    B, rng = BACKENDS[backend], np.random.default_rng(1)
    n = 50
    u, v = mutable(B, np.zeros(n, F32)), mutable(B, np.zeros(n, F32))
    ru, rv = np.zeros(n, F32), np.zeros(n, F32)
    for _ in range(5):
        g = rng.standard_normal(n).astype(F32)
        accumulate.momentum_correction(B, u, v, to_backend(B, g), m, nesterov)
        ru, rv = ref_momentum_correction(ru, rv, g, m, nesterov)
        np.testing.assert_allclose(to_np(v), rv, rtol=1e-6, atol=1e-6)
        if m:
            np.testing.assert_allclose(to_np(u), ru, rtol=1e-6, atol=1e-6)
        else:
            assert not to_np(u).any()          # m = 0: no velocity is kept


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("scale", [100.0, 0.01])
def test_local_clipping_threshold(backend, world_size, scale):
    B = BACKENDS[backend]
    g = (np.random.default_rng(2).standard_normal(300) * scale).astype(F32)
    s = accumulate.clip_by_local_norm(B, to_backend(B, g), 3.0, world_size)   # the factor
    got = g * F32(s)
    np.testing.assert_allclose(got, ref_clip(g, 3.0, world_size), rtol=1e-5, atol=1e-9)
    assert np.linalg.norm(got) <= 3.0 * math.sqrt(world_size) * (1 + 1e-5)
    s = accumulate.clip_by_local_norm(B, to_backend(B, g), 3.0, world_size, average=False)
    np.testing.assert_allclose(g * F32(s), ref_clip(g, 3.0, world_size, average=False),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_clipping_happens_before_accumulation(backend):
    # first step, no masking: u = clip(g) exactly as the paper clips before accumulating
    N, g = 4, (np.random.default_rng(3).standard_normal(2000) * 10).astype(F32)
    core = make_ranks(1, backend, clip_norm=1.0, momentum=0.9, momentum_masking=False,
                      min_sparse_numel=1)[0]
    core.compress("w", to_backend(core.B, g), N)
    u, _ = state_np(core, "w")
    np.testing.assert_allclose(u, ref_clip(g, 1.0, N), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("masking", [False, True])
def test_sent_positions_are_cleared(backend, masking):
    rng = np.random.default_rng(4)
    n, m = 400, 0.9
    core = make_ranks(1, backend, compress_ratio=0.05, exact_topk=True, momentum=m,
                      momentum_masking=masking, min_sparse_numel=1)[0]
    ref = RefRank(n, m, False, masking, None, 1)
    for _ in range(3):
        g = rng.standard_normal(n).astype(F32)
        u_before, v_before = ref.u.copy(), ref.v.copy()
        _, payload, _ = exchange([core], "w", [g])
        idx = ref_parse(payload[0])[3]
        u_corr, v_corr = ref_momentum_correction(u_before, v_before, g, m)
        ref.step(g, ref_k(n, 0.05))
        u, v = state_np(core, "w")
        keep = np.setdiff1d(np.arange(n), idx)
        assert not v[idx].any()                                        # v zeroed where sent
        np.testing.assert_allclose(v[keep], v_corr[keep], rtol=1e-6, atol=1e-6)
        if masking:
            assert not u[idx].any()                                    # momentum factor masking
        else:
            np.testing.assert_allclose(u[idx], u_corr[idx], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(u[keep], u_corr[keep], rtol=1e-6, atol=1e-6)


# ============================================================ selection (§5)
def selection_cases():
    rng = np.random.default_rng(1234)
    for i in range(48):
        n = int(rng.integers(100, 4000))
        kind = i % 4
        if kind == 0:
            v = rng.standard_normal(n)
        elif kind == 1:                                   # mostly zeros: nnz may be below k
            v = rng.standard_normal(n) * (rng.random(n) < 0.03)
        elif kind == 2:                                   # heavy ties and zeros
            v = rng.integers(-3, 4, n).astype(float)
        else:                                             # heavy tail
            v = rng.standard_cauchy(n)
        k = int(rng.integers(1, n // 2)) if i % 6 else int(rng.integers(n // 2, n + 1))
        yield v.astype(F32), k, float(rng.choice([0.001, 0.01, 0.1, 1.0])), i


def _select(backend, v, k, sample_ratio, seed, exact=False):
    B = BACKENDS[backend]
    p = sparsify.plan_k(v.size, k, sample_ratio, exact)
    base = sparsify.sample_base(sparsify.seed_key(seed), sparsify.tensor_key("v"), 1)
    return to_np(sparsify.select(B, to_backend(B, v), p, base)).astype(np.int64)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_selection_count_is_k_unless_too_few_candidates(backend):
    """At most min(k, non-zeros); exactly that whenever the rule's level holds k candidates (all
    but a few of these cases)."""
    exact = 0
    for v, k, sr, seed in selection_cases():
        idx = _select(backend, v, k, sr, seed)
        nnz = int(np.count_nonzero(v))
        assert idx.size <= min(k, nnz), (k, nnz, idx.size)
        exact += idx.size == min(k, nnz)
    assert exact >= 44, exact


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_selection_unique_ascending_and_never_zero(backend):
    for v, k, sr, seed in selection_cases():
        idx = _select(backend, v, k, sr, seed)
        assert np.all(np.diff(idx) > 0)
        assert np.all(v[idx] != 0)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_selection_is_a_top_set(backend):
    # every sent magnitude is >= every unsent one, whatever the samples found
    for v, k, sr, seed in selection_cases():
        idx = _select(backend, v, k, sr, seed)
        rest = np.delete(np.abs(v), idx)
        if idx.size and rest.size:
            assert np.abs(v[idx]).min() >= rest.max()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_selection_of_k_is_exact_topk(backend):
    """A selection of k entries is Algorithm 1's top-k of |v|, ties to the lower position."""
    hits = 0
    for v, k, sr, seed in selection_cases():
        idx = _select(backend, v, k, sr, seed)
        if idx.size == k:
            hits += 1
            np.testing.assert_array_equal(idx, np.sort(ref_topk(v, k)))
    assert hits >= 10        # the property was actually exercised


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("exact", [False, True])
def test_selection_with_ties(backend, exact):
    # 10 entries of magnitude 5, 1000 of magnitude 1 (signs mixed), 20 zeros; k = 40: the ten 5s
    # and the 30 lowest positions of magnitude 1
    v = np.concatenate([np.full(10, 5.0), np.full(500, 1.0), np.full(500, -1.0), np.zeros(20)])
    v = np.random.default_rng(5).permutation(v).astype(F32)
    idx = _select(backend, v, 40, 0.05, 0, exact=exact)
    want = np.sort(np.concatenate([np.flatnonzero(np.abs(v) == 5),
                                   np.flatnonzero(np.abs(v) == 1)[:30]]))
    np.testing.assert_array_equal(idx, want)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_exact_topk_mode(backend):
    for v, k, sr, seed in selection_cases():
        idx = _select(backend, v, k, sr, seed, exact=True)
        np.testing.assert_array_equal(idx, np.sort(ref_topk(v, k)))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("exact", [False, True])
def test_all_zero_selects_nothing(backend, exact):
    assert _select(backend, np.zeros(3000, F32), 30, 0.01, 0, exact=exact).size == 0


# ============================================================ wire format
def _rank_contributions(rng, numel, world_size):
    """Random sparse (idx, vals) per rank; overlapping positions, first and last included."""
    out = []
    for r in range(world_size):
        c = int(rng.integers(1, numel + 1))
        idx = rng.choice(numel, size=c, replace=False)
        if r == 0:
            idx = np.unique(np.concatenate([idx, [0, numel - 1]]))
        vals = rng.standard_normal(idx.size).astype(F32)
        vals[: idx.size // 3] = F32(1.5)                   # ties in value
        out.append((idx.astype(np.int64), vals))
    return out


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("shape", [(1,), (7,), (5, 6), (2, 3, 4), (2, 3, 4, 5)])
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("fmt", FORMATS)
def test_wire_round_trip_sums_in_rank_order(backend, shape, world_size, fmt):
    B, rng = BACKENDS[backend], np.random.default_rng(6)
    numel = int(np.prod(shape))
    contrib = [(np.sort(i), v) for i, v in _rank_contributions(rng, numel, world_size)]
    if fmt[1] == "float16":
        contrib = [(i, v.astype(np.float16).astype(F32)) for i, v in contrib]
    payloads = [wire.encode(B, numel, to_backend(B, i), to_backend(B, v), 0, *fmt)
                for i, v in contrib]
    for p, (i, v) in zip(payloads, contrib):
        np.testing.assert_array_equal(to_np(p), ref_payload(numel, i, v, 0, *fmt))
    gathered = B.cat(payloads)
    dense, nonfinite = wire.decode_sum(B, gathered, numel, world_size, "t")
    assert not nonfinite
    np.testing.assert_array_equal(to_np(dense), ref_rank_order_sum(numel, contrib))
    # and the dense tensor reshaped is the N-D sum at the flattened (C-order) positions
    expect = np.zeros(shape, F32)
    for i, v in contrib:
        np.add.at(expect, np.unravel_index(i, shape), v)
    np.testing.assert_allclose(to_np(dense).reshape(shape), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_decode_sum_into_a_given_buffer(backend):
    """out=: the same sum written into the caller's buffer (the gradient's storage), whatever it
    held before (NaN included); a buffer of the wrong size is refused before it is touched."""
    B, rng = BACKENDS[backend], np.random.default_rng(7)
    numel = 50
    contrib = _rank_contributions(rng, numel, 3)
    gathered = B.cat([wire.encode(B, numel, to_backend(B, i), to_backend(B, v), 0)
                      for i, v in contrib])
    expect, _ = wire.decode_sum(B, gathered, numel, 3, "t")
    buf = B.float32_flat(to_backend(B, np.full(numel, np.nan, F32)))
    dense, nonfinite = wire.decode_sum(B, gathered, numel, 3, "t", out=buf)
    assert dense is buf and not nonfinite
    np.testing.assert_array_equal(to_np(buf), to_np(expect))
    small = B.float32_flat(to_backend(B, np.full(numel - 1, 7.0, F32)))
    with pytest.raises(ValueError, match="out has 49 elements, tensor 't' 50"):
        wire.decode_sum(B, gathered, numel, 3, "t", out=small)
    np.testing.assert_array_equal(to_np(small), np.full(numel - 1, 7.0, F32))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_wire_encode_layout(backend):
    B = BACKENDS[backend]
    idx, vals = np.array([0, 4, 9], np.int64), np.array([3.0, 1e-30, -1.25], F32)
    got = to_np(wire.encode(B, 10, to_backend(B, idx), to_backend(B, vals)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ref_payload(10, idx, vals))
    assert got.nbytes == 24 + 8 * 3
    roomy = to_np(wire.encode(B, 10, to_backend(B, idx), to_backend(B, vals), 0, "int32",
                              "float32", k=5))                 # room for 5: zero padded
    np.testing.assert_array_equal(roomy, ref_payload(10, idx, vals, k=5))
    assert roomy.nbytes == wire.payload_bytes(10, 5, "int32") == 24 + 8 * 5


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_wire_big_gaps_first_and_last_positions(backend, fmt):
    """Gaps of exactly 65535, 65536 and far more (escapes), with the first and last element."""
    B = BACKENDS[backend]
    numel = 400_000
    idx = np.array([0, 65535, 131071, 131072, 300_000, numel - 1], np.int64)
    vals = np.array([1.0, -2.0, 3.5, 0.25, -8.0, 6.0], F32)
    p = wire.encode(B, numel, to_backend(B, idx), to_backend(B, vals), 0, *fmt)
    np.testing.assert_array_equal(to_np(p), ref_payload(numel, idx, vals, 0, *fmt))
    assert wire.payload_bytes(numel, 6, *fmt) == to_np(p).nbytes
    dense, _ = wire.decode_sum(B, B.cat([p, p]), numel, 2, "big")
    expect = np.zeros(numel, F32)
    expect[idx] = 2 * vals
    np.testing.assert_array_equal(to_np(dense), expect)


def test_delta16_tokens_escape_exactly_at_65536():
    assert ref_delta16_tokens([65534]).tolist() == [65535]          # gap 65535: no escape
    assert ref_delta16_tokens([65535]).tolist() == [0, 1]           # gap 65536: one escape
    assert ref_delta16_tokens([0, 200_000]).tolist() == [1, 0, 0, 0, 200_000 - 3 * 65535]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_wire_empty_selection_is_header_only(backend, fmt):
    B = BACKENDS[backend]
    empty = to_backend(B, np.zeros(0, np.int64)), to_backend(B, np.zeros(0, F32))
    p = to_np(wire.encode(B, 100, *empty, 0, *fmt))
    assert p.nbytes == 24
    np.testing.assert_array_equal(p, ref_payload(100, [], [], 0, *fmt))
    gathered = B.cat([wire.encode(B, 100, *empty, 0, *fmt), wire.encode(B, 100, *empty, 0, *fmt)])
    dense, nonfinite = wire.decode_sum(B, gathered, 100, 2, "t")
    assert not nonfinite and to_np(dense).shape == (100,) and not to_np(dense).any()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_wire_nonfinite_flag_is_reported(backend):
    B = BACKENDS[backend]
    ok = wire.encode(B, 8, to_backend(B, np.array([3])), to_backend(B, np.array([2.0], F32)))
    bad = wire.encode(B, 8, to_backend(B, np.zeros(0, np.int64)),
                      to_backend(B, np.zeros(0, F32)), flags=1)
    assert to_np(bad)[3] & 1
    assert wire.decode_sum(B, B.cat([ok, bad]), 8, 2, "t")[1] is True
    assert wire.decode_sum(B, B.cat([ok, ok]), 8, 2, "t")[1] is False


def _valid_gathered(numel=12):
    p0 = ref_payload(numel, [0, 5, 11], [1.0, -2.0, 3.0])
    p1 = ref_payload(numel, [2, 7], [4.0, 5.0])
    return np.concatenate([p0, p1]), p0.size


CORRUPTIONS = {
    "wrong_magic": lambda w, o: np.concatenate([w[:o], [0x44474301], w[o + 1:]]),   # v1 header
    "unknown_encoding": lambda w, o: np.concatenate([w[:o + 3], [7 << 8], w[o + 4:]]),
    "tokens_not_count": lambda w, o: np.concatenate([w[:o + 4], [3], w[o + 5:]]),
    "count_over_capacity": lambda w, o: np.concatenate([w[:o + 5], [1], w[o + 6:]]),
    "wrong_numel": lambda w, o: np.concatenate([w[:o + 1], [13], w[o + 2:]]),
    "negative_count": lambda w, o: np.concatenate([w[:o + 2], [-1], w[o + 3:]]),
    "count_over_numel": lambda w, o: np.concatenate([w[:o + 2], [13], w[o + 3:]]),
    "truncated_entries": lambda w, o: w[:-1],
    "truncated_header": lambda w, o: w[:o + 2],
    "index_out_of_range": lambda w, o: np.concatenate([w[:o + 6], [12], w[o + 7:]]),
    "negative_index": lambda w, o: np.concatenate([w[:o + 7], [-1], w[o + 8:]]),
    "trailing_words": lambda w, o: np.concatenate([w, [0]]),
}


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_wire_malformed_payload_raises(backend, kind):
    B = BACKENDS[backend]
    words, o1 = _valid_gathered()
    wire.decode_sum(B, to_backend(B, words), 12, 2, "layer3.weight")        # valid one decodes
    bad = CORRUPTIONS[kind](words, o1).astype(np.int32)
    with pytest.raises(WireFormatError) as info:
        wire.decode_sum(B, to_backend(B, bad), 12, 2, "layer3.weight")
    msg = str(info.value)
    assert "layer3.weight" in msg
    if kind != "trailing_words":          # see test_wire_trailing_words_message_names_rank
        assert re.search(r"\brank 1\b", msg), msg


def test_wire_trailing_words_message_names_rank():
    B = BACKENDS["numpy"]
    words, _ = _valid_gathered()
    with pytest.raises(WireFormatError, match=r"\brank 1\b"):
        wire.decode_sum(B, np.concatenate([words, [0]]).astype(np.int32), 12, 2, "layer3.weight")


def test_wire_format_error_is_value_error():
    assert issubclass(WireFormatError, ValueError)


# ============================================================ DGCCore end to end
@pytest.mark.parametrize("backend", CORE_PATHS)
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("m,nesterov,masking,clip", [(0.0, False, False, None),
                                                     (0.9, False, True, None),
                                                     (0.9, False, False, 2.0),
                                                     (0.9, True, True, 2.0)])
def test_compress_decompress_matches_numpy_reference(backend, world_size, m, nesterov, masking,
                                                     clip):
    rng = np.random.default_rng(7)
    shape, density = (6, 50), 0.05
    n, k = 300, ref_k(300, density)
    cores = make_ranks(world_size, backend, compress_ratio=density, exact_topk=True, momentum=m,
                       nesterov=nesterov, momentum_masking=masking, clip_norm=clip,
                       min_sparse_numel=1)
    refs = [RefRank(n, m, nesterov, masking, clip, world_size) for _ in range(world_size)]
    for _ in range(5):
        grads = [rng.standard_normal(shape).astype(F32) for _ in range(world_size)]
        updates, payloads, kind = exchange(cores, "fc.weight", grads)
        assert kind == "sparse"
        contrib = [ref.step(g, k) for ref, g in zip(refs, grads)]
        expected = ref_rank_order_sum(n, contrib) / F32(world_size)
        for r in range(world_size):
            _, c, flags, idx, vals = ref_parse(payloads[r])
            assert flags == 0 and c == k
            assert set(idx) == set(contrib[r][0])
            np.testing.assert_allclose(updates[r], expected, rtol=1e-5, atol=1e-6)
            u, v = state_np(cores[r], "fc.weight")
            np.testing.assert_allclose(v, refs[r].v, rtol=1e-5, atol=1e-6)
            if m:
                np.testing.assert_allclose(u, refs[r].u, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", CORE_PATHS)
def test_all_ranks_decompress_identically(backend):
    rng = np.random.default_rng(8)
    cores = make_ranks(3, backend, compress_ratio=0.01, min_sparse_numel=1)   # sampled selection
    for _ in range(3):
        grads = [rng.standard_normal((50, 100)).astype(F32) for _ in range(3)]
        updates, _, _ = exchange(cores, "w", grads)
        assert np.any(updates[0])
        for u in updates[1:]:
            np.testing.assert_array_equal(u, updates[0])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_average_divides_by_world_size(backend):
    rng = np.random.default_rng(9)
    N = 3
    grads = [rng.standard_normal(1000).astype(F32) for _ in range(N)]
    kw = dict(compress_ratio=0.02, exact_topk=True, min_sparse_numel=1)
    avg, payloads, _ = exchange(make_ranks(N, backend, **kw), "w", grads, average=True)
    total, _, _ = exchange(make_ranks(N, backend, **kw), "w", grads, average=False)
    contrib = [ref_parse(p)[3:] for p in payloads]
    np.testing.assert_array_equal(total[0], ref_rank_order_sum(1000, contrib))
    np.testing.assert_allclose(avg[0], total[0] / N, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("overlap", ["same_gradients", "different_gradients"])
def test_average_is_the_sum_times_one_over_n_bit_for_bit(backend, overlap):
    """decompress divides only at the gathered positions: the same bits as multiplying the
    whole sum by float32(1/N), and a position sent by several ranks is divided once."""
    rng = np.random.default_rng(19)
    N = 3
    base = rng.standard_normal(2000).astype(F32)
    grads = [base.copy() if overlap == "same_gradients" else rng.standard_normal(2000).astype(F32)
             for _ in range(N)]
    kw = dict(compress_ratio=0.02, min_sparse_numel=1)
    avg, _, _ = exchange(make_ranks(N, backend, **kw), "w", grads, average=True)
    total, _, _ = exchange(make_ranks(N, backend, **kw), "w", grads, average=False)
    expected = total[0] * np.float32(1.0 / N)
    assert expected.dtype == np.float32 and np.count_nonzero(expected) >= 20
    np.testing.assert_array_equal(avg[0].view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("shape", [(840,), (4, 5, 6, 7)])
def test_torch_and_numpy_backends_agree(shape):
    rng = np.random.default_rng(10)
    kw = dict(compress_ratio=0.05, exact_topk=True, momentum=0.9, momentum_masking=True,
              clip_norm=5.0, min_sparse_numel=1)
    np_cores, t_cores = make_ranks(2, "numpy", **kw), make_ranks(2, "torch", **kw)
    for _ in range(4):
        grads = [rng.standard_normal(shape).astype(F32) for _ in range(2)]  # distinct magnitudes
        up_np, pay_np, _ = exchange(np_cores, "conv", grads)
        up_t, pay_t, _ = exchange(t_cores, "conv", grads)
        for r in range(2):
            a, b = ref_parse(pay_np[r]), ref_parse(pay_t[r])
            order_a, order_b = np.argsort(a[3]), np.argsort(b[3])
            np.testing.assert_array_equal(a[3][order_a], b[3][order_b])
            np.testing.assert_allclose(a[4][order_a], b[4][order_b], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(up_np[r], up_t[r], rtol=1e-5, atol=1e-6)
            for x, y in zip(state_np(np_cores[r], "conv"), state_np(t_cores[r], "conv")):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_single_element_tensor(backend):
    cores = make_ranks(2, backend, min_sparse_numel=1, momentum=0.0)
    updates, payloads, kind = exchange(cores, "s", [np.array([2.0], F32), np.array([-0.5], F32)])
    assert kind == "sparse"
    assert [ref_parse(p)[1] for p in payloads] == [1, 1]
    np.testing.assert_array_equal(updates[0], [0.75])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_all_zero_gradient_sends_no_entry(backend):
    cores = make_ranks(2, backend, min_sparse_numel=1)
    updates, payloads, _ = exchange(cores, "w", [np.zeros((4, 8), F32)] * 2)
    room = wire.payload_bytes(32, sparsify.k_for(32, cores[0].density))
    assert [(p.nbytes, ref_parse(p)[1]) for p in payloads] == [(room, 0), (room, 0)]
    assert not updates[0].any() and updates[0].shape == (32,)


# ============================================================ equivalence with dense SGD
@pytest.mark.parametrize("backend", CORE_PATHS)
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("reference", ["torch", "numpy"])
def test_ratio_one_equals_momentum_sgd(backend, world_size, nesterov, reference):
    cfg = dict(compress_ratio=1.0, warmup_epochs=0, min_sparse_numel=1, momentum=0.9,
               nesterov=nesterov, momentum_masking=False)
    run_against_sgd(backend, world_size, cfg, dict(momentum=0.9, nesterov=nesterov),
                    reference=reference)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_ratio_one_with_masking_equals_plain_sgd(backend, world_size):
    cfg = dict(compress_ratio=1.0, warmup_epochs=0, min_sparse_numel=1, momentum=0.9,
               momentum_masking=True)
    run_against_sgd(backend, world_size, cfg, dict(momentum=0.0))


@pytest.mark.parametrize("backend", CORE_PATHS)
def test_ratio_one_weight_decay_equals_sgd_weight_decay(backend):
    cfg = dict(compress_ratio=1.0, min_sparse_numel=1, momentum=0.9, momentum_masking=False,
               weight_decay=0.1)
    run_against_sgd(backend, 2, cfg, dict(momentum=0.9, weight_decay=0.1))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_dense_small_tensor_sends_velocity(backend, nesterov):
    rng = np.random.default_rng(11)
    m = 0.9
    core = make_ranks(1, backend, momentum=m, nesterov=nesterov, min_sparse_numel=1024)[0]
    u = np.zeros(12, F32)
    for _ in range(3):
        g = rng.standard_normal((3, 4)).astype(F32)
        kind, out, ctx = core.compress("bias", to_backend(core.B, g), 2)
        u_new, sent = ref_momentum_correction(u, np.zeros(12, F32), g.reshape(-1), m, nesterov)
        assert kind == "dense" and ctx is None
        np.testing.assert_allclose(to_np(out), sent, rtol=1e-6, atol=1e-6)
        u = u_new
    assert core.states["bias"].v is None        # nothing held back for dense tensors


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_dense_small_tensor_average_is_momentum_sgd(backend, nesterov):
    cfg = dict(momentum=0.9, nesterov=nesterov, min_sparse_numel=1024)     # 12 elements: dense
    run_against_sgd(backend, 2, cfg, dict(momentum=0.9, nesterov=nesterov), shape=(3, 4))


# ============================================================ bad input, non-finite gradients
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_integer_gradient_rejected(backend):
    B = BACKENDS[backend]
    core = DGCCore(DGCConfig(), B)
    with pytest.raises(TypeError, match="layer1.weight"):
        core.compress("layer1.weight", to_backend(B, np.arange(10, dtype=np.int64)), 1)
    assert "layer1.weight" not in core.states


def test_core_requires_config():
    with pytest.raises(TypeError, match="DGCConfig"):
        DGCCore({"compress_ratio": 0.01}, BACKENDS["numpy"])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_changed_numel_rejected_and_state_unchanged(backend):
    rng = np.random.default_rng(12)
    core = make_ranks(1, backend, compress_ratio=0.1, min_sparse_numel=1)[0]
    exchange([core], "w", [rng.standard_normal(100).astype(F32)])
    before = state_np(core, "w")
    with pytest.raises(ValueError, match="'w'"):
        core.compress("w", to_backend(core.B, rng.standard_normal(101).astype(F32)), 1)
    after = state_np(core, "w")
    assert core.states["w"].numel == 100
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)


def _warm_ranks(backend, world_size, rng, n=400, steps=2, **kw):
    cfg = dict(compress_ratio=0.05, exact_topk=True, momentum=0.9, momentum_masking=True,
               min_sparse_numel=1)
    cfg.update(kw)
    cores = make_ranks(world_size, backend, **cfg)
    for _ in range(steps):
        exchange(cores, "w", [rng.standard_normal(n).astype(F32) for _ in range(world_size)])
    return cores


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_gradient_leaves_state_unchanged(backend, bad):
    rng = np.random.default_rng(13)
    core = _warm_ranks(backend, 1, rng)[0]
    u0, v0 = state_np(core, "w")
    g = rng.standard_normal(400).astype(F32)
    g[17] = bad
    kind, payload, _ = core.compress("w", to_backend(core.B, g), 1)
    u1, v1 = state_np(core, "w")
    assert u0.tobytes() == u1.tobytes() and v0.tobytes() == v1.tobytes()     # bit for bit
    numel, count, flags, _, _ = ref_parse(to_np(payload))
    assert kind == "sparse" and numel == 400 and count == 0 and flags & 1


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_nonfinite_step_is_nan_everywhere_and_nothing_is_lost(backend):
    rng = np.random.default_rng(14)
    m = 0.9
    cores = _warm_ranks(backend, 2, rng)
    (u0, v0), (u1, v1) = state_np(cores[0], "w"), state_np(cores[1], "w")
    g0 = rng.standard_normal(400).astype(F32)
    g0[5] = np.nan
    g1 = rng.standard_normal(400).astype(F32)
    u1_corr, v1_corr = ref_momentum_correction(u1, v1, g1, m)   # rank 1 right after correction
    updates, payloads, _ = exchange(cores, "w", [g0, g1])
    assert ref_parse(payloads[0])[2] & 1 and ref_parse(payloads[1])[1] > 0
    for upd in updates:
        assert upd.shape == (400,) and np.all(np.isnan(upd))
    # rank 0: untouched; rank 1: its sent entries are back in v (and u, masking on)
    for x, y in zip((u0, v0), state_np(cores[0], "w")):
        assert x.tobytes() == y.tobytes()
    u1_after, v1_after = state_np(cores[1], "w")
    np.testing.assert_allclose(v1_after, v1_corr, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(u1_after, u1_corr, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_nonfinite_dense_small_tensor(backend):
    core = make_ranks(1, backend, momentum=0.9, min_sparse_numel=1024)[0]
    core.compress("b", to_backend(core.B, np.ones(8, F32)), 1)
    u0 = state_np(core, "b")[0]
    g = np.ones(8, F32)
    g[0] = np.inf
    kind, out, _ = core.compress("b", to_backend(core.B, g), 1)
    assert kind == "dense" and not np.all(np.isfinite(to_np(out)))
    assert state_np(core, "b")[0].tobytes() == u0.tobytes()


# ============================================================ CompressionStats
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_stats_bytes_and_ratio(backend):
    rng = np.random.default_rng(15)
    core = make_ranks(1, backend, compress_ratio=0.01, exact_topk=True, min_sparse_numel=100)[0]
    _, payload, kind = exchange([core], "big", [rng.standard_normal(1000).astype(F32)])
    assert kind == "sparse"
    exchange([core], "small", [rng.standard_normal(10).astype(F32)])
    count = ref_parse(payload[0])[1]
    assert count == ref_k(1000, 0.01)
    s = core.step_stats
    sparse_bytes = ref_payload(1000, ref_parse(payload[0])[3], ref_parse(payload[0])[4], 0,
                               core.config.wire_index, core.config.wire_values).nbytes
    assert sparse_bytes == 24 + 2 * count + 4 * count        # delta16 (even count) + fp32
    assert s.wire_bytes == (sparse_bytes + PLACEHOLDER) + 4 * 10
    assert s.dense_bytes == 4 * (1000 + 10)
    assert s.ratio == pytest.approx(4 * 1010 / ((sparse_bytes + PLACEHOLDER) + 40))
    assert (s.tensors, s.sparse_tensors, s.selected, s.elements) == (2, 1, count, 1010)


def test_stats_ratio_before_anything_sent():
    assert CompressionStats().ratio == 0.0


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_stats_new_step_when_name_repeats(backend):
    rng = np.random.default_rng(16)
    core = make_ranks(1, backend, compress_ratio=0.01, min_sparse_numel=100)[0]
    for name in ("a", "b"):
        exchange([core], name, [rng.standard_normal(500).astype(F32)])
    assert (core.step_stats.tensors, core.total_stats.steps) == (2, 1)
    exchange([core], "a", [rng.standard_normal(500).astype(F32)])
    assert (core.step_stats.tensors, core.step_stats.steps) == (1, 1)
    assert (core.total_stats.steps, core.total_stats.tensors) == (2, 3)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_stats_count_nonfinite(backend):
    core = make_ranks(1, backend, min_sparse_numel=100)[0]
    g = np.zeros(500, F32)
    g[0] = np.nan
    core.compress("a", to_backend(core.B, g), 1)
    s = core.step_stats
    room = wire.payload_bytes(500, sparsify.k_for(500, core.density))   # the fixed size
    assert (s.nonfinite_tensors, s.selected, s.wire_bytes, s.dense_bytes) == (
        1, 0, room + PLACEHOLDER, 2000)


# ============================================================ fp16 values: error feedback
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_fp16_values_keep_rounding_error_in_residual(backend):
    """wire_values='float16': receivers get fp16(v) at the sent positions, and v keeps
    v - fp16(v) there (the quantization error is delayed, not lost)."""
    g = np.zeros(2048, F32)
    g[[3, 700, 2047]] = [1.0 / 3.0, 60000.0, -2.0e-3]
    core = make_ranks(1, backend, compress_ratio=3 / 2048, exact_topk=True, momentum=0.0,
                      wire_values="float16", min_sparse_numel=1)[0]
    updates, payloads, kind = exchange([core], "w", [g])
    assert kind == "sparse"
    sent = g[[3, 700, 2047]].astype(np.float16).astype(F32)
    np.testing.assert_array_equal(updates[0][[3, 700, 2047]], sent)
    v = state_np(core, "w")[1]
    np.testing.assert_array_equal(v[[3, 700, 2047]], g[[3, 700, 2047]] - sent)
    assert ref_parse(payloads[0])[4].tolist() == sent.tolist()
    s = core.step_stats
    assert (s.overflowed_entries, s.flushed_entries, s.nonfinite_tensors) == (0, 0, 0)


FP16_POS = [3, 700, 2047]


@pytest.mark.parametrize("backend", CORE_PATHS)
def test_fp16_overflow_is_sent_as_inf_and_skipped_on_every_rank(backend, recwarn):
    """A value beyond float16's range is sent as ±inf, as a float16 cast makes it (not clamped
    to 65504): every rank decodes a non-finite update (all NaN, as a non-finite gradient gives),
    the rank that did not overflow puts back what it sent, the one that did drops the tensor's
    u and v, and no NaN/Inf enters u or v. Reference: the NumPy transcription."""
    m = 0.9
    g0 = np.zeros(2048, F32)
    g0[FP16_POS] = [0.5, 1000.0, -2.0]
    g1 = np.zeros(2048, F32)
    g1[FP16_POS] = [0.25, -70000.0, 3.0]          # -70000 < -65520: float16 makes it -inf
    cores = make_ranks(2, backend, compress_ratio=3 / 2048, exact_topk=True, momentum=m,
                       wire_values="float16", min_sparse_numel=1)
    updates, payloads, _ = exchange(cores, "w", [g0, g1])
    for up in updates:
        assert np.isnan(up).all()
    sent1 = ref_parse(payloads[1])[4]
    assert sent1.tolist() == [F32(0.25), -np.inf, F32(3.0)]         # in index order
    assert np.isfinite(ref_parse(payloads[0])[4]).all()
    for rank, (core, g) in enumerate(zip(cores, (g0, g1))):
        u_ref, v_ref = ref_momentum_correction(np.zeros(2048, F32), np.zeros(2048, F32), g, m)
        if rank == 1:                              # overflowed: its state is dropped
            u_ref[:] = v_ref[:] = 0.0
        u, v = state_np(core, "w")
        np.testing.assert_array_equal(u, u_ref)
        np.testing.assert_array_equal(v, v_ref)
        s = core.step_stats
        assert (s.overflowed_entries, s.flushed_entries, s.nonfinite_tensors) == (
            rank, 0, 0)
        assert core.total_stats.overflowed_entries == rank
    warned = [str(w.message) for w in recwarn if "float16" in str(w.message)]
    assert len(warned) == 1 and "'w'" in warned[0] and "±inf" in warned[0], warned
    # what a loss scaler does next: skip, back off (here: half the gradient). Rank 1 starts from
    # zero and no longer overflows, so the step goes through; with its entries put back it would
    # overflow for ever (v[700] would be -70000 - 0.9·70000 - 35000 whatever the scale)
    updates, payloads, _ = exchange(cores, "w", [g0 / 2, g1 / 2])
    for up in updates:
        assert np.isfinite(up).all() and up[700] != 0
    assert cores[1].total_stats.overflowed_entries == 1
    assert len([w for w in recwarn if "float16" in str(w.message)]) == 1      # once


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_fp16_flush_to_zero_is_counted_and_kept_in_the_residual(backend, recwarn):
    g = np.zeros(2048, F32)
    g[[5, 9]] = [1e-9, 1.0]                        # 1e-9 <= 2**-25: float16 makes it 0
    core = make_ranks(1, backend, compress_ratio=2 / 2048, exact_topk=True, momentum=0.0,
                      wire_values="float16", min_sparse_numel=1)[0]
    updates, payloads, _ = exchange([core], "w", [g])
    assert updates[0][5] == 0.0 and updates[0][9] == 1.0
    assert ref_parse(payloads[0])[3].tolist() == [5, 9]             # sent, as 0
    assert state_np(core, "w")[1][5] == F32(1e-9)                   # and kept in v
    assert (core.step_stats.flushed_entries, core.step_stats.overflowed_entries) == (1, 0)
    warned = [str(w.message) for w in recwarn if "float16" in str(w.message)]
    assert len(warned) == 1 and "'w'" in warned[0] and "below float16's range" in warned[0]


def test_wire_options_are_validated():
    with pytest.raises(ValueError, match="wire_index"):
        DGCConfig(wire_index="int16")
    with pytest.raises(ValueError, match="wire_values"):
        DGCConfig(wire_values="bfloat16")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("engine", ["auto", "ops"])
def test_weight_decay_with_a_nonfinite_parameter_is_refused_like_a_nonfinite_gradient(
        backend, engine):
    # with weight decay the accumulated gradient is g + λ·param: a NaN/Inf parameter must not
    # reach the residual either (the rank sends the non-finite flag, the state stays)
    B = BACKENDS[backend]
    core = DGCCore(DGCConfig(warmup_epochs=0, weight_decay=1e-2, engine=engine), B)
    rng = np.random.default_rng(5)
    p = rng.standard_normal(5000).astype(F32)
    core.compress("w", to_backend(B, rng.standard_normal(5000).astype(F32)), 2,
                  param=to_backend(B, p))
    u, v = (to_np(x).copy() for x in (core.states["w"].u, core.states["w"].v))
    p[17] = np.inf
    kind, payload, _ = core.compress("w", to_backend(B, rng.standard_normal(5000).astype(F32)),
                                     2, param=to_backend(B, p))
    assert kind == "sparse" and to_np(payload)[3] & wire.FLAG_NONFINITE   # header word 3: flags
    assert np.array_equal(to_np(core.states["w"].u), u)
    assert np.array_equal(to_np(core.states["w"].v), v)
    assert core.step_stats.nonfinite_tensors == 1
