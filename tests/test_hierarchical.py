"""The hierarchical exchange (``exchange="hierarchical"``, dgc_horovod/core/hierarchical.py)
against a NumPy transcription of its equations: M nodes of L ranks in one process, one DGCCore
per rank. Horovod's collectives as the PyTorch adapter (dgc_horovod/torch/hierarchical.py) uses
them: the reduce-scatter inside a node is "rank j of the node gets shard j of the node
gradient" (every rank's shard cut from the same node gradient here; the order Horovod adds in:
test_node_sum_adds_in_horovods_order), the
allgather across nodes the concatenation of the M payloads of a shard in node order, the
allgather inside the node the concatenation of the L decoded shards.
"""
import numpy as np
import pytest

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend
from dgc_horovod.core import hierarchical
from dgc_horovod.core.stats import StatsRecorder
from helpers import to_backend, to_np

pytestmark = pytest.mark.unit

F32 = np.float32
B = NumpyBackend()


def make_cores(M, L, **kw):
    kw.setdefault("warmup_steps", 0)
    kw.setdefault("compress_ratio", 0.05)
    cfg = DGCConfig(exchange="hierarchical", environ={}, **kw)
    return [[DGCCore(cfg, B) for _ in range(L)] for _ in range(M)]


def node_gradient(grads, average):
    """The node's reduction: Σ_j g_j in rank order, times 1/L under Average (float32)."""
    total = np.zeros_like(grads[0])
    for g in grads:
        total += g
    return total * F32(1.0 / len(grads)) if average else total


def exchange(cores, grads, name="w", average=True):
    """One step of the hierarchical exchange of one 2-D tensor (shape (rows, cols)) on M × L
    cores; grads[c][j] the gradient rank (c, j) has. Returns (the update every rank gets, per
    rank; the node gradients; the contexts)."""
    M, L = len(cores), len(cores[0])
    shape = grads[0][0].shape
    n = int(np.prod(shape))
    spans = hierarchical.shard_bounds(n, L)
    G = [node_gradient([g.reshape(-1) for g in node], average) for node in grads]
    ctxs = [[None] * L for _ in range(M)]
    payloads = [[None] * L for _ in range(M)]
    for c in range(M):
        for j, (lo, hi) in enumerate(spans):
            shard = G[c][lo:hi]
            if not np.isfinite(G[c]).all():
                shard = np.full_like(shard, np.nan)
            kind, payloads[c][j], ctxs[c][j] = cores[c][j].compress(
                name, to_backend(B, shard.reshape(1, hi - lo)), M, average=average)
            assert kind == "sparse"
    shards = [[None] * L for _ in range(M)]
    for j in range(L):
        gathered = B.cat([payloads[c][j] for c in range(M)])
        for c in range(M):
            shards[c][j] = to_np(cores[c][j].decompress(gathered, ctxs[c][j], M, average))
    updates = [np.concatenate(shards[c]) for c in range(M)]
    return updates, G, ctxs


def grads_for(M, L, shape, seed):
    rng = np.random.default_rng(seed)       # distinct magnitudes: no ties in any top-k
    n = int(np.prod(shape))
    return [[(rng.standard_normal(n) * (1 + np.arange(n) % 7)).astype(F32).reshape(shape)
             for _ in range(L)] for _ in range(M)]


@pytest.mark.parametrize("M,L", [(2, 2), (3, 2), (2, 4), (4, 3)])
@pytest.mark.parametrize("average", [True, False])
def test_update_residual_and_momentum_follow_the_equations(M, L, average):
    shape, momentum = (7, 143), 0.9               # 1001 elements: shards of unequal sizes
    n = 1001
    cores = make_cores(M, L, momentum=momentum)
    spans = hierarchical.shard_bounds(n, L)
    u_prev = {(c, j): np.zeros(hi - lo, F32) for c in range(M) for j, (lo, hi) in
              enumerate(spans)}
    v_prev = {k: v.copy() for k, v in u_prev.items()}
    for step in range(3):
        grads = grads_for(M, L, shape, 10 * step + M + L)
        updates, G, ctxs = exchange(cores, grads, average=average)
        for u_ in updates[1:]:                  # every node (and so every rank) the same bits
            assert u_.tobytes() == updates[0].tobytes()
        want = np.zeros(n, F32)
        for j, (lo, hi) in enumerate(spans):
            total = np.zeros(hi - lo, F32)
            for c in range(M):                  # rank (c, j): Algorithm 1 on G_c|S_j
                u = momentum * u_prev[c, j] + G[c][lo:hi]
                v = v_prev[c, j] + u
                ctx = ctxs[c][j]
                idx = np.asarray(to_np(ctx.indices), dtype=np.int64)
                vals = to_np(ctx.values)
                np.testing.assert_allclose(vals, v[idx], rtol=1e-6)
                rest = np.delete(np.abs(v), idx)
                assert len(idx) >= 1 and np.abs(vals).min() >= rest.max()     # a top set
                k = max(1, int(np.ceil(cores[c][j].density * (hi - lo))))
                assert len(idx) <= k
                total += np.bincount(idx, weights=vals, minlength=hi - lo).astype(F32)
                v[idx] = 0.0                    # sent: out of the residual, momentum masked
                u[idx] = 0.0
                st = cores[c][j].states["w"]
                assert st.numel == hi - lo
                np.testing.assert_allclose(to_np(st.v), v, rtol=1e-6, atol=1e-5)
                np.testing.assert_allclose(to_np(st.u), u, rtol=1e-6, atol=1e-5)
                u_prev[c, j], v_prev[c, j] = to_np(st.u), to_np(st.v)
            want[lo:hi] = total / M if average else total
        np.testing.assert_allclose(updates[0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("M,L", [(2, 2), (3, 4)])
def test_nothing_is_lost(M, L):
    """Per shard: Σ_c v_(c,j)(after) + M·Δ|S_j = Σ_c v_(c,j)(before) + Σ_c G_c|S_j (momentum
    0), so over the tensor Σ_ranks v + M·Δ = Σ_c G_c = (1/L)·Σ_ranks g summed over steps."""
    shape, n = (16, 256), 4096
    cores = make_cores(M, L, momentum=0.0)
    fed = np.zeros(n, np.float64)
    applied = np.zeros(n, np.float64)
    for step in range(4):
        grads = grads_for(M, L, shape, step)
        updates, G, _ = exchange(cores, grads)
        fed += np.sum(G, axis=0, dtype=np.float64)
        applied += M * updates[0].astype(np.float64)
        spans = hierarchical.shard_bounds(n, L)
        left = np.concatenate([np.sum([to_np(cores[c][j].states["w"].v) for c in range(M)],
                                      axis=0, dtype=np.float64) for j in range(L)])
        np.testing.assert_allclose(left + applied, fed, rtol=1e-5, atol=1e-4)
        # each node applied about its k per shard, not L·k: k_j per shard per node at most
        ks = sum(max(1, int(np.ceil(cores[0][0].density * (hi - lo)))) for lo, hi in spans)
        assert np.count_nonzero(updates[0]) <= M * ks


def test_density_one_is_dense_momentum_sgd_on_the_global_average():
    """ρ = 1 without masking: Δ = momentum SGD's velocity of (1/(L·M))·Σ_r g_r, Horovod's."""
    M, L, m = 2, 3, 0.9
    cores = make_cores(M, L, compress_ratio=1.0, momentum=m, momentum_masking=False)
    u = np.zeros(600, np.float64)
    for step in range(4):
        grads = grads_for(M, L, (20, 30), step)
        updates, _, _ = exchange(cores, grads)
        mean = np.mean([g.reshape(-1) for node in grads for g in node], axis=0,
                       dtype=np.float64)
        u = m * u + mean
        np.testing.assert_allclose(updates[0], u, rtol=2e-5, atol=2e-5)


def test_sum_is_the_sum_over_every_rank():
    """op=Sum: the node sums and the DGC sum over nodes give Σ_r g_r at density 1."""
    M, L = 3, 2
    cores = make_cores(M, L, compress_ratio=1.0, momentum=0.0)
    grads = grads_for(M, L, (10, 10), 5)
    updates, _, _ = exchange(cores, grads, average=False)
    total = np.sum([g.reshape(-1) for node in grads for g in node], axis=0, dtype=np.float64)
    np.testing.assert_allclose(updates[0], total, rtol=1e-5, atol=1e-5)


def test_a_nonfinite_node_gradient_makes_the_whole_update_nan_and_enters_no_residual():
    """One rank's NaN makes its node's gradient non-finite: every shard of that node is sent
    as non-finite (nothing accumulated on its ranks), every rank's update is NaN, and the other
    node's ranks put back what they sent: their residuals hold the step's gradient whole, as
    a finite rank's does under the allgather exchange."""
    M, L = 2, 2
    cores = make_cores(M, L, momentum=0.9)
    exchange(cores, grads_for(M, L, (8, 64), 1))
    before = [[(to_np(k.states["w"].u).copy(), to_np(k.states["w"].v).copy()) for k in node]
              for node in cores]
    grads = grads_for(M, L, (8, 64), 2)
    grads[1][0][3, 5] = np.nan                  # one rank, one element, one shard
    updates, G, _ = exchange(cores, grads)
    for u_ in updates:
        assert np.isnan(u_).all()
    for j, (k, (u, v)) in enumerate(zip(cores[1], before[1])):     # the NaN node: untouched
        np.testing.assert_array_equal(to_np(k.states["w"].u), u)
        np.testing.assert_array_equal(to_np(k.states["w"].v), v)
    for j, (k, (u, v)) in enumerate(zip(cores[0], before[0])):     # the other: all kept
        lo, hi = hierarchical.shard_bounds(512, L)[j]
        u = F32(0.9) * u + G[0][lo:hi]
        np.testing.assert_allclose(to_np(k.states["w"].u), u, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(to_np(k.states["w"].v), v + u, rtol=1e-6, atol=1e-5)
    assert sum(k.step_stats.nonfinite_tensors for k in cores[1]) == L


def test_warmup_density_applies_to_every_shard():
    cores = make_cores(2, 2, warmup_steps=4, warmup_initial_density=0.25, compress_ratio=0.01)
    counts = []
    for step in range(5):
        _, _, ctxs = exchange(cores, grads_for(2, 2, (10, 100), step))
        counts.append(sum(len(to_np(c.indices)) for node in ctxs for c in node))
    assert counts[0] > counts[-1] and counts == sorted(counts, reverse=True)
    assert cores[0][0].density == pytest.approx(0.01)


# ------------------------------------------------------------------ clipping
def np_node_scale(shards, others, C, M, average):
    """The module docstring's s_c in NumPy: q_(c,j) = Σ ‖G_c^t|S_j‖² (+ Σ ‖G_c^t‖² of the
    tensors that are not sharded, on j = 0), finite tensors only; ‖G_c‖ = sqrt(Σ_j q_(c,j));
    s_c = min(1, T / (‖G_c‖ + 1e-6)) with T = C·√M (Average) or C/√M (Sum)."""
    def sq(x):
        return float(np.linalg.norm(x.astype(np.float64))) ** 2 if np.isfinite(x).all() else 0.0
    q = [sum(sq(x) for x in node_shards) + (sum(sq(x) for x in others) if j == 0 else 0.0)
         for j, node_shards in enumerate(shards)]
    T = C * np.sqrt(M) if average else C / np.sqrt(M)
    return min(1.0, T / (np.sqrt(sum(q)) + 1e-6))


def clipped_step(cores, grads, bias, C, average=True):
    """One step of the hierarchical exchange with clipping on M × L cores: a sharded 2-D tensor
    "w" (grads[c][j]) and a 1-D tensor "b" that is not sharded (bias[c][j]), as the PyTorch
    adapter runs it. Returns (the update of w, of b; the node gradients of w, of b; the
    factors; the shards as compressed)."""
    M, L = len(cores), len(cores[0])
    n = grads[0][0].size
    spans = hierarchical.shard_bounds(n, L)
    G = [node_gradient([g.reshape(-1) for g in node], average) for node in grads]
    Gb = [node_gradient(node, average) for node in bias]
    shards = [[G[c][lo:hi] if np.isfinite(G[c]).all() else np.full(hi - lo, np.nan, F32)
               for lo, hi in spans] for c in range(M)]
    scales = []
    for c in range(M):
        parts = [hierarchical.clip_part(B, [to_backend(B, shards[c][j])], [to_backend(B, Gb[c])],
                                        j) for j in range(L)]
        mine = {cores[c][j].clip_scale_of_squares(parts, M, average) for j in range(L)}
        assert len(mine) == 1                   # every rank of the node: the same bits
        scales.append(mine.pop())
    payloads = [[None] * L for _ in range(M)]
    ctxs = [[None] * L for _ in range(M)]
    velocities = []
    for c in range(M):
        for j, (lo, hi) in enumerate(spans):
            core = cores[c][j]
            _, vel, _ = core.compress("b", to_backend(B, bias[c][j]), M, average=average,
                                      clip_scale=scales[c])
            velocities.append(to_np(vel))
            kind, payloads[c][j], ctxs[c][j] = core.compress(
                "w", to_backend(B, shards[c][j].reshape(1, hi - lo)), M, average=average,
                clip_scale=scales[c])
            assert kind == "sparse"
    upd = np.zeros(n, F32)
    for j, (lo, hi) in enumerate(spans):
        gathered = B.cat([payloads[c][j] for c in range(M)])
        upd[lo:hi] = to_np(cores[0][j].decompress(gathered, ctxs[0][j], M, average))
        for c in range(1, M):
            cores[c][j].decompress(gathered, ctxs[c][j], M, average)
    ub = np.sum(velocities, axis=0, dtype=F32)          # Horovod's allreduce over L·M ranks
    return upd, (ub / (M * L) if average else ub), G, Gb, scales, shards


@pytest.mark.parametrize("M,L", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("average", [True, False])
def test_clipping_uses_the_nodes_norm_and_N_equals_M(M, L, average):
    """Local clipping (§3.2) with the nodes as the workers: s_c from the norm of the node's
    gradient G_c over every tensor, at C·√M (Average) or C/√M (Sum); rank (c, j) accumulates
    s_c·G_c|S_j, the tensor that is not sharded s_c·g_(c,j); nothing else."""
    shape, m, C = (7, 143), 0.9, 0.5
    n = 1001
    cores = make_cores(M, L, momentum=m, clip_norm=C, compress_ratio=0.1)
    spans = hierarchical.shard_bounds(n, L)
    u = {(c, j): np.zeros(hi - lo, F32) for c in range(M) for j, (lo, hi) in enumerate(spans)}
    v = {k: x.copy() for k, x in u.items()}
    ub = {(c, j): np.zeros(13, F32) for c in range(M) for j in range(L)}
    rng = np.random.default_rng(M * 10 + L)
    for step in range(3):
        grads = grads_for(M, L, shape, 100 * step + M + L)
        bias = [[rng.standard_normal(13).astype(F32) * 3 for _ in range(L)] for _ in range(M)]
        upd, upd_b, G, Gb, scales, shards = clipped_step(cores, grads, bias, C, average)
        want_b = np.zeros(13, np.float64)
        for c in range(M):
            s = np_node_scale(shards[c], [Gb[c]], C, M, average)
            assert scales[c] == pytest.approx(s, rel=1e-6)
            assert s < 0.5                      # it clips, and N = M, not L·M or 1, sets it
            for wrong in (M * L, 1):
                assert abs(np_node_scale(shards[c], [Gb[c]], C, wrong, average) - s) > 0.05 * s
            for j, (lo, hi) in enumerate(spans):
                u[c, j] = F32(m) * u[c, j] + F32(scales[c]) * G[c][lo:hi]
                v[c, j] = v[c, j] + u[c, j]
                idx = np.asarray(to_np(cores[c][j].states["w"].v) == 0).nonzero()[0]
                v[c, j][idx] = 0.0
                u[c, j][idx] = 0.0
                np.testing.assert_allclose(to_np(cores[c][j].states["w"].v), v[c, j],
                                           rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(to_np(cores[c][j].states["w"].u), u[c, j],
                                           rtol=1e-5, atol=1e-5)
                ub[c, j] = F32(m) * ub[c, j] + F32(scales[c]) * bias[c][j]
                want_b += ub[c, j]
        want_b = want_b / (M * L) if average else want_b
        np.testing.assert_allclose(upd_b, want_b, rtol=1e-5, atol=1e-6)
        assert np.isfinite(upd).all() and np.count_nonzero(upd) > 0


def test_clipping_leaves_a_nonfinite_tensor_out_of_the_norm_and_out_of_the_residuals():
    """A NaN in one rank's gradient of w: its node's G_c^w is left out of the node's norm on
    every rank of the node (the factor comes from b alone), w's update is NaN, no residual
    takes a NaN, and b is still clipped with that factor."""
    M, L, C = 2, 2, 0.5
    cores = make_cores(M, L, momentum=0.9, clip_norm=C)
    rng = np.random.default_rng(3)
    bias = [[rng.standard_normal(13).astype(F32) * 3 for _ in range(L)] for _ in range(M)]
    grads = grads_for(M, L, (8, 64), 4)
    grads[1][1][2, 7] = np.nan
    upd, upd_b, G, Gb, scales, shards = clipped_step(cores, grads, bias, C)
    assert np.isnan(upd).all() and np.isfinite(upd_b).all()
    only_b = min(1.0, C * np.sqrt(M) / (float(np.linalg.norm(Gb[1].astype(np.float64))) + 1e-6))
    assert scales[1] == pytest.approx(only_b, rel=1e-6)
    assert scales[0] == pytest.approx(np_node_scale(shards[0], [Gb[0]], C, M, True), rel=1e-6)
    for node in cores:
        for core in node:
            for st in core.states.values():
                assert all(t is None or np.isfinite(to_np(t)).all() for t in (st.u, st.v))


def test_clip_parts_overflow_and_bytes():
    """A finite tensor whose float32 norm overflows makes the node's factor 0, as the flat rule
    does (a float64 part of inf); the parts' allgather moves one float64 per rank."""
    core = make_cores(1, 1, clip_norm=1.0)[0][0]
    huge = to_backend(B, np.full(4, 3e38, F32))
    parts = [hierarchical.clip_part(B, [huge], [], 0), 1.0]
    assert parts[0] == float("inf") and core.clip_scale_of_squares(parts, 2) == 0.0
    assert core.clip_scale_of_squares([1.0, 3.0], 4) == pytest.approx(2.0 / (2.0 + 1e-6))
    assert hierarchical.clip_bytes(4) == (8, 24) and hierarchical.clip_bytes(1) == (0, 0)


# ------------------------------------------------------------------ the pieces
def test_shards_cover_the_tensor():
    for n, L in [(10, 3), (1001, 4), (8, 8), (5, 2)]:
        spans = hierarchical.shard_bounds(n, L)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert max(h - l for l, h in spans) - min(h - l for l, h in spans) <= 1


def test_shard_bounds_are_horovods_split():
    """Horovod's reduce-scatter along dimension 0: the first n mod L ranks one element more
    (measured under Gloo: 5 on 2 ranks → 3, 2; 11 on 4 → 3, 3, 3, 2), not ⌊j·n/L⌋ (2, 3)."""
    assert hierarchical.shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert [h - l for l, h in hierarchical.shard_bounds(11, 4)] == [3, 3, 3, 2]
    assert [h - l for l, h in hierarchical.shard_bounds(7, 3)] == [3, 2, 2]
    assert hierarchical.shard_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert hierarchical.shard_bounds(12, 4) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    for n, L in [(1862, 3), (1001, 4), (5, 7)]:
        q, m = divmod(n, L)
        assert [h - l for l, h in hierarchical.shard_bounds(n, L)] == \
            [q + 1] * m + [q] * (L - m)


def test_node_sum_adds_in_horovods_order():
    """The order Gloo's reduce-scatter adds a node's gradients in (measured with Horovod 0.28.1
    for L = 2 … 8), against the sums written out; values of very different sizes, so that the
    order shows in the bits (L = 4: the pairwise tree is not the rank-order sum; L = 7: the
    blocks 4 + 2 + 1 added from the smallest up, not left to right)."""
    rng = np.random.default_rng(0)
    g = [(rng.standard_normal(4096) * 10.0 ** (3 * (k % 3))).astype(F32) for k in range(8)]
    t4 = (g[0] + g[1]) + (g[2] + g[3])
    want = {1: g[0], 2: g[0] + g[1], 3: (g[0] + g[1]) + g[2], 4: t4, 5: t4 + g[4],
            6: t4 + (g[4] + g[5]), 7: t4 + ((g[4] + g[5]) + g[6]),
            8: t4 + ((g[4] + g[5]) + (g[6] + g[7]))}
    for L, w in want.items():
        got = hierarchical.node_sum(g[:L])
        assert got.dtype == F32 and np.array_equal(got, w), L
    assert hierarchical.node_sum(g[:1]) is not g[0]             # a new array
    rank_order = ((g[0] + g[1]) + g[2]) + g[3]
    assert not np.array_equal(hierarchical.node_sum(g[:4]), rank_order)
    left_to_right = (t4 + (g[4] + g[5])) + g[6]
    assert not np.array_equal(hierarchical.node_sum(g[:7]), left_to_right)


def test_bytes_inside_the_node():
    """The reduce-scatter: the other ranks' shards out, their parts of this rank's shard in
    (about (L − 1)/L·n each way, half an allreduce's 2·(L − 1)/L·n); the flags' allreduce."""
    assert hierarchical.scatter_bytes(11, 3, 4) == (4 * 8, 4 * 3 * 3)
    assert hierarchical.scatter_bytes(11, 2, 4) == (4 * 9, 4 * 3 * 2)
    assert hierarchical.scatter_bytes(10, 10, 1) == (0, 0)
    assert hierarchical.finite_bytes(3, 2) == (12, 12)
    assert hierarchical.finite_bytes(3, 1) == hierarchical.finite_bytes(0, 4) == (0, 0)
    assert hierarchical.node_bytes(10, 2) == (40, 40) and hierarchical.node_bytes(10, 1) == (0, 0)


def test_is_sharded_needs_every_shard_sparsified():
    cfg = DGCConfig(environ={}, exchange="hierarchical", min_sparse_numel=100)
    assert hierarchical.is_sharded(400, 2, 4, cfg)
    assert not hierarchical.is_sharded(399, 2, 4, cfg)      # a shard of 99
    assert not hierarchical.is_sharded(4000, 1, 4, cfg)     # a bias
    assert not hierarchical.is_sharded(3, 2, 4, DGCConfig(environ={}))   # an empty shard


def test_node_layout_from_horovods_ranks():
    # horovodrun's placement: 2 nodes of 2
    rows = [(0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (2, 0, 2, 1, 2), (3, 1, 2, 1, 2)]
    assert hierarchical.node_layout(rows) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # round-robin placement (mpirun --map-by node): node 0 holds ranks 0, 2, 4
    rows = [(r, r // 2, 3, r % 2, 3) for r in range(6)]
    assert hierarchical.node_layout(rows) == ([[0, 2, 4], [1, 3, 5]], [[0, 1], [2, 3], [4, 5]])
    # one rank per node: the cross set is every rank
    assert hierarchical.node_layout([(r, 0, 1, r, 3) for r in range(3)]) == \
        ([[0], [1], [2]], [[0, 1, 2]])


def test_nodes_of_different_sizes_are_refused_naming_them():
    rows = [(0, 0, 2, 0, 2), (1, 1, 2, 0, 1), (2, 0, 1, 1, 2)]
    with pytest.raises(ValueError, match=r"same number of ranks.*ranks \[2\] on nodes of 1; "
                                         r"ranks \[0, 1\] on nodes of 2"):
        hierarchical.node_layout(rows)
    with pytest.raises(ValueError, match="do not describe equal nodes"):
        hierarchical.node_layout([(0, 0, 2, 0, 1), (1, 1, 2, 0, 1), (2, 0, 2, 0, 1),
                                  (3, 1, 2, 0, 1)])


def test_exchange_option_and_what_it_refuses():
    assert DGCConfig(environ={"HOROVOD_DGC_EXCHANGE": "Hierarchical"}).exchange == "hierarchical"
    assert DGCConfig(exchange="hierarchical", clip_norm=1.0, environ={}).clip_norm == 1.0
    with pytest.raises(ValueError, match="clip_scope='tensor' is not available with "
                                         "exchange='hierarchical'.*clip_scope='global'"):
        DGCConfig(exchange="hierarchical", clip_norm=1.0, clip_scope="tensor", environ={})
    with pytest.raises(ValueError, match=r"clip_scope from HOROVOD_DGC_CLIP_SCOPE"):
        DGCConfig(exchange="hierarchical", clip_norm=1.0,
                  environ={"HOROVOD_DGC_CLIP_SCOPE": "tensor"})
    # clip_scope alone (no clip_norm) clips nothing: accepted
    DGCConfig(exchange="hierarchical", environ={"HOROVOD_DGC_CLIP_SCOPE": "tensor"})


def test_statistics_inside_and_across_nodes():
    rec = StatsRecorder()
    rec.count_hierarchical(node=(400, 400), cross=(40, 0))
    rec.count_hierarchical(cross=(0, 120))
    rec.count_hierarchical(node=(200, 200))
    for s in (rec.step, rec.total):
        assert (s.node_bytes, s.node_received_bytes) == (600, 600)
        assert (s.cross_node_bytes, s.cross_node_received_bytes) == (40, 120)
        # the payload sent across was counted by compress: not again in wire_bytes
        assert (s.wire_bytes, s.received_bytes) == (600, 720)
    # print(dgc.stats) shows them (the other exchanges' repr is unchanged)
    rec.total.steps = 1
    assert repr(rec.total).endswith(", node_bytes=600/600 (sent/received), "
                                    "cross_node_bytes=40/120)")
    plain = StatsRecorder().total
    plain.steps = 1
    assert "CompressionStats(steps=1" in repr(plain) and "node_bytes" not in repr(plain)


# ------------------------------------------------------------------ the simulated cluster
def _mlp(seed=0):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))


def _simulate(config, world, local_size, steps, momentum=0.0, nan_at=None, seed=0):
    """Train the MLP ``steps`` steps on ``world`` simulated workers; returns (model, cluster,
    losses of worker 0, [whether every gradient was finite, per step])."""
    import torch
    from dgc_horovod.simulate import SimulatedCluster
    model = _mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    cluster = SimulatedCluster(model, opt, world, config, local_size=local_size)
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(32, 5, generator=g)
    losses, finite = [], []
    for step in range(steps):
        xs = [torch.randn(16, 32, generator=g) for _ in range(world)]

        def closure(k, x=None):
            x = xs[k]
            loss = torch.nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
            return loss * float("nan") if (step, k) == nan_at else loss
        losses.append(cluster.backward([lambda k=k: closure(k) for k in range(world)])[0])
        ok = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        finite.append(ok)
        if ok:
            opt.step()
    return model, cluster, losses, finite


def test_simulated_cluster_at_density_one_is_dense_momentum_sgd():
    """4 workers as 2 nodes of 2 at ρ = 1 without masking: the dense cluster's momentum SGD."""
    import torch
    cfg = DGCConfig(exchange="hierarchical", compress_ratio=1.0, warmup_steps=0,
                    momentum=0.9, momentum_masking=False, environ={})
    hier, cluster, _, _ = _simulate(cfg, 4, 2, 5)
    dense, _, _, _ = _simulate(None, 4, 1, 5, momentum=0.9)
    for a, b in zip(hier.parameters(), dense.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the weights are sharded: each worker holds half of each, the biases whole
    states = cluster.cores[0].states
    assert states["0.weight"].numel == 32 * 64 // 2 and states["0.weight"].sparse
    assert states["0.bias"].numel == 64 and not states["0.bias"].sparse


def test_simulated_cluster_trains_and_counts_both_networks():
    cfg = DGCConfig(exchange="hierarchical", compress_ratio=0.05, warmup_steps=0, environ={})
    _, cluster, losses, finite = _simulate(cfg, 6, 3, 40)
    assert all(finite) and losses[-1] < 0.7 * losses[0]
    for core in cluster.cores:
        st = core.step_stats
        # two other nodes' payloads of this worker's shard, about as large as its own
        assert 0 < st.cross_node_bytes and 0 < st.cross_node_received_bytes
        assert st.cross_node_received_bytes <= 3 * 2 * st.cross_node_bytes
        # inside the node: the reduction each way, then its shard out and the two others in
        assert st.node_received_bytes > st.node_bytes > st.cross_node_bytes


def test_simulated_cluster_nonfinite_worker_skips_the_step_and_poisons_no_state():
    import torch
    cfg = DGCConfig(exchange="hierarchical", compress_ratio=0.05, warmup_steps=0, environ={})
    model, cluster, _, finite = _simulate(cfg, 4, 2, 4, nan_at=(2, 3))
    assert finite == [True, True, False, True]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for core in cluster.cores:
        for st in core.states.values():
            assert all(t is None or bool(torch.isfinite(t).all()) for t in (st.u, st.v))


def test_simulated_cluster_local_size_is_checked():
    import torch
    from dgc_horovod.simulate import SimulatedCluster
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hier = DGCConfig(exchange="hierarchical", environ={})
    for bad, cfg in [(3, hier), (0, hier), (2, DGCConfig(environ={})), (2, None)]:
        with pytest.raises(ValueError, match="local_size must be an int >= 1 that divides"):
            SimulatedCluster(model, opt, 4, cfg, local_size=bad)
