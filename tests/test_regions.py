"""The region exchange (``exchange="regions"``, dgc_horovod/core/regions.py) against a NumPy
transcription of its equations: N ranks in one process, one DGCCore each; Horovod's alltoall is
"rank j receives part j of every rank's split, in rank order", its allgather the concatenation.
"""
import numpy as np
import pytest

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend, wire
from dgc_horovod.core import regions
from dgc_horovod.backends.torch_backend import TorchBackend
from helpers import to_backend, to_np

pytestmark = pytest.mark.unit

F32 = np.float32
BACKENDS = {"numpy": NumpyBackend(), "torch": TorchBackend()}


def exchange(cores, grads, name="w", average=True):
    """One step of the region exchange over N cores, as the adapter runs it.
    Returns (update on every rank, [ctx], [split payloads], [phase-2 payloads])."""
    N, B = len(cores), cores[0].B
    ctxs, splits = [], []
    for core, g in zip(cores, grads):
        kind, payload, ctx = core.compress(name, g, N, average=average)
        assert kind == "sparse"
        ctxs.append(ctx)
        splits.append(regions.split_payload(B, payload, B.numel(g), N, name))
    numel = B.numel(grads[0])
    reduced = []
    for j in range(N):
        gathered, count = sent(B, [splits[r][j] for r in range(N)])
        reduced.append(cores[j].reduce_region(gathered, name, numel, j, N, count))
    gathered, count = sent(B, [p for p, _ in reduced])
    outs = [core.decompress(gathered, ctx, N, average, count, dropped=dropped)
            for core, ctx, (_, dropped) in zip(cores, ctxs, reduced)]
    return outs, ctxs, splits, [p for p, _ in reduced]


def sent(B, payloads):
    """(the payloads that were sent, concatenated in rank order; how many): None is not sent."""
    ps = [p for p in payloads if p is not None]
    return (B.cat(ps) if ps else B.int32_tensor([], like=B.zeros(1, like=None))), len(ps)


def words(B, p):
    return 0 if p is None else B.numel(p)


def reference(sent, numel, N, density, average=True, fp16=False):
    """NumPy transcription: S_j = Σ_r sent_r|R_j (rank order), K_j = top-k_j of |S_j| among its
    non-zero entries, update = Σ_j S_j|K_j (/ N), D_j = S_j − S_j|K_j (+ float16 rounding error
    of the kept sums). ``sent``: per rank (positions, float32 values)."""
    update, dropped = np.zeros(numel, F32), []
    for j in range(N):
        lo, hi = j * numel // N, (j + 1) * numel // N
        s = np.zeros(hi - lo, F32)
        for idx, vals in sent:
            m = (idx >= lo) & (idx < hi)
            np.add.at(s, idx[m] - lo, vals[m])
        nz = np.flatnonzero(s)
        k = max(1, int(np.ceil(density * (hi - lo)))) if hi > lo else 0
        keep = nz[np.argsort(-np.abs(s[nz]), kind="stable")[:k]] if len(nz) > k else nz
        kept = np.zeros(hi - lo, F32)
        kept[keep] = s[keep]
        d = s - kept
        if fp16:
            rounded = kept.astype(np.float16).astype(F32)
            d += kept - rounded
            kept = rounded
        update[lo:hi] = kept
        dropped.append(d)
    if average and N > 1:
        nz = update != 0
        update[nz] *= F32(1.0 / N)
    return update, np.concatenate(dropped)


def make_cores(N, B, **kw):
    kw.setdefault("warmup_steps", 0)
    kw.setdefault("compress_ratio", 0.05)
    kw.setdefault("min_sparse_ndim", 1)
    return [DGCCore(DGCConfig(exchange="regions", environ={}, **kw), B) for _ in range(N)]


def grads_for(N, n, seed, B):
    rng = np.random.default_rng(seed)     # distinct magnitudes: no ties in any top-k
    return [to_backend(B, (rng.standard_normal(n) * (1 + np.arange(n) % 7)).astype(F32))
            for _ in range(N)]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("N", [2, 3, 4, 8])
@pytest.mark.parametrize("fmt", [("delta16", "float32"), ("int32", "float32"),
                                 ("delta16", "float16")])
def test_update_residual_and_momentum_follow_the_equations(backend, N, fmt):
    B = BACKENDS[backend]
    n, momentum = 1001, 0.9
    cores = make_cores(N, B, momentum=momentum, wire_index=fmt[0], wire_values=fmt[1])
    u_prev = [np.zeros(n, F32) for _ in range(N)]
    v_prev = [np.zeros(n, F32) for _ in range(N)]
    for step in range(3):
        grads = grads_for(N, n, 10 * step + N, B)
        outs, ctxs, _, _ = exchange(cores, grads)
        # every rank the same bits
        for o in outs[1:]:
            assert to_np(o).tobytes() == to_np(outs[0]).tobytes()
        # what each rank sent: its selection of v after momentum correction (u ← m·u + g,
        # v ← v + u), the values as they went on the wire
        sent, before = [], []
        for r, (core, ctx, g) in enumerate(zip(cores, ctxs, grads)):
            u = momentum * u_prev[r] + to_np(g)
            v = v_prev[r] + u
            idx = np.asarray(to_np(ctx.indices), dtype=np.int64)
            vals = to_np(ctx.values)            # v[idx], as the core rounded it (FMA or not)
            np.testing.assert_allclose(vals, v[idx], rtol=1e-6)
            v[idx] = vals
            if fmt[1] == "float16":
                vals = vals.astype(np.float16).astype(F32)
            sent.append((idx, vals))
            before.append((u, v, idx))
        want, dropped = reference(sent, n, N, cores[0].density, fp16=fmt[1] == "float16")
        np.testing.assert_array_equal(to_np(outs[0]), want)
        applied = want != 0
        for r, (core, (u, v, idx)) in enumerate(zip(cores, before)):
            st = core.states["w"]
            # v: the sent part left (the float16 rounding error stays: vals − fp16(vals)),
            # the owner gets back what its region dropped
            v_exp = v.copy()
            v_exp[idx] = v[idx] - sent[r][1]
            lo, hi = r * n // N, (r + 1) * n // N
            v_exp[lo:hi] += dropped[lo:hi]
            np.testing.assert_allclose(to_np(st.v), v_exp, rtol=1e-6, atol=1e-5)
            # u: masked where the entry was applied, kept where it was sent but dropped
            u_exp = u.copy()
            u_exp[idx[applied[idx]]] = 0.0
            np.testing.assert_allclose(to_np(st.u), u_exp, rtol=1e-6, atol=1e-5)
            assert (to_np(st.u)[idx[applied[idx]]] == 0).all()
            assert (to_np(st.u)[idx[~applied[idx]]] != 0).all()
            u_prev[r], v_prev[r] = to_np(st.u), to_np(st.v)


@pytest.mark.parametrize("N", [2, 4, 8])
def test_nothing_is_lost(N):
    """Σ_r v_r(after) + N · update == Σ_r v_r(after momentum correction, before selection)."""
    B = NumpyBackend()
    n = 4096
    cores = make_cores(N, B, momentum=0.0)
    grads = grads_for(N, n, N, B)
    total_before = np.sum([to_np(g) for g in grads], axis=0, dtype=np.float64)
    outs, _, _, _ = exchange(cores, grads)
    after = np.sum([to_np(c.states["w"].v) for c in cores], axis=0, dtype=np.float64)
    np.testing.assert_allclose(after + N * to_np(outs[0]).astype(np.float64), total_before,
                               rtol=1e-5, atol=1e-5)
    # it applied about k entries of the sum, not N·k
    k = max(1, int(np.ceil(cores[0].density * n)))
    assert k <= np.count_nonzero(to_np(outs[0])) <= k + N


def test_traffic_per_rank_does_not_grow_with_N():
    """Entries a rank receives: allgather (N−1)·k; regions ≈ 2k(N−1)/N."""
    B = NumpyBackend()
    n = 1 << 16
    received = {}
    for N in (2, 8):
        cores = make_cores(N, B, momentum=0.0, compress_ratio=0.01, wire_index="int32")
        _, _, splits, phase2 = exchange(cores, grads_for(N, n, 1, B))
        received[N] = sum(words(B, splits[r][0]) for r in range(1, N)) + \
            sum(words(B, p) for p in phase2[1:])
    assert received[8] / received[2] < 1.9          # ≈ 1.75 + headers; allgather: 7


def test_nonfinite_step_restores_every_rank_and_discards_the_dropped_sums():
    B = NumpyBackend()
    N, n = 4, 512
    cores = make_cores(N, B, momentum=0.9)
    exchange(cores, grads_for(N, n, 3, B))                  # some state first
    before = [(to_np(c.states["w"].u), to_np(c.states["w"].v)) for c in cores]
    grads = grads_for(N, n, 4, B)
    bad = to_np(grads[2]).copy()
    bad[7] = np.nan
    grads[2] = bad
    outs, _, _, _ = exchange(cores, grads)
    for o in outs:
        assert np.isnan(to_np(o)).all()
    # the finite ranks accumulated this step (u, v hold it) and put back what they sent; the
    # NaN rank did not accumulate: in total nothing of the step was applied
    for r, c in enumerate(cores):
        u, v = to_np(c.states["w"].u), to_np(c.states["w"].v)
        assert np.isfinite(u).all() and np.isfinite(v).all()
        if r == 2:
            np.testing.assert_array_equal(u, before[r][0])
            np.testing.assert_array_equal(v, before[r][1])
        else:
            u_exp = 0.9 * before[r][0] + to_np(grads[r])
            np.testing.assert_allclose(u, u_exp, rtol=1e-6)
            np.testing.assert_allclose(v, before[r][1] + u_exp, rtol=1e-6)


@pytest.mark.parametrize("fmt", [("delta16", "float32"), ("int32", "float16")])
def test_split_payload_keeps_every_entry_once(fmt):
    B = NumpyBackend()
    rng = np.random.default_rng(0)
    n = 70000                                   # gaps beyond 65535: delta16 escapes
    idx = np.sort(rng.choice(n, 300, replace=False)).astype(np.int64)
    idx[-1] = n - 1
    vals = rng.standard_normal(300).astype(F32)
    payload = wire.encode(B, n, idx, vals, 0, *fmt)
    for N in (1, 3, 5):
        parts = regions.split_payload(B, payload, n, N, "t")
        assert len(parts) == N
        got = np.zeros(n, F32)
        for (lo, hi), part in zip(regions.bounds(n, N), parts):
            assert (part is None) == (not ((idx >= lo) & (idx < hi)).any())
            if part is not None:
                dense, nonfinite = wire.decode_sum(B, part, hi - lo, 1, "t")
                assert not nonfinite
                got[lo:hi] += dense
        want = np.zeros(n, F32)
        want[idx] = vals if fmt[1] == "float32" else vals.astype(np.float16).astype(F32)
        np.testing.assert_array_equal(got, want)
    flagged = wire.encode(B, n, idx[:0], vals[:0], wire.FLAG_NONFINITE, *fmt)
    for (lo, hi), part in zip(regions.bounds(n, 3), regions.split_payload(B, flagged, n, 3, "t")):
        assert wire.decode_sum(B, part, hi - lo, 1, "t")[1]          # still flagged


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("fmt", [("delta16", "float32"), ("delta16", "float16"),
                                 ("int32", "float32"), ("int32-unsorted", "float32")])
def test_split_payload_parts_are_the_regions_entries_encoded_word_for_word(backend, fmt):
    """Each part is, word for word, wire.encode of the payload's entries in that region (in
    payload order, positions relative to the region), and None for a region without entries:
    whichever way split_payload finds the runs (ascending positions: one call for every part;
    int32 positions in any order: one mask per region)."""
    B = BACKENDS[backend]
    rng = np.random.default_rng(1)
    n = 70000
    idx = np.sort(rng.choice(n, 200, replace=False)).astype(np.int64)
    index = fmt[0].split("-")[0]
    if fmt[0] == "int32-unsorted":
        idx = rng.permutation(idx)
    vals = rng.standard_normal(200).astype(F32)
    payload = wire.encode(B, n, to_backend(B, idx), to_backend(B, vals), 0, index, fmt[1])
    _, vals_read, _, _, _, _ = wire.read_payload(B, payload, 0, n, "t")
    vals_read = to_np(vals_read)                  # float16 payloads carry rounded values
    for N in (1, 2, 7, 64, 300):
        parts = regions.split_payload(B, payload, n, N, "t")
        assert len(parts) == N
        for (lo, hi), part in zip(regions.bounds(n, N), parts):
            inside = (idx >= lo) & (idx < hi)
            if not inside.any():
                assert part is None
                continue
            want = wire.encode(B, hi - lo, to_backend(B, idx[inside] - lo),
                               to_backend(B, vals_read[inside]), 0, index, fmt[1])
            np.testing.assert_array_equal(to_np(part), to_np(want))


def test_regions_cover_the_tensor_and_tolerate_fewer_elements_than_ranks():
    assert regions.bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert regions.bounds(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]
    B = NumpyBackend()
    cores = make_cores(4, B, momentum=0.0, compress_ratio=1.0)
    grads = [to_backend(B, np.array([1.0, -2.0], F32) * (r + 1)) for r in range(4)]
    outs, _, _, _ = exchange(cores, grads)
    np.testing.assert_allclose(to_np(outs[0]), np.array([10.0, -20.0], F32) / 4)


def test_a_malformed_region_payload_names_tensor_and_rank():
    B = NumpyBackend()
    good = wire.encode(B, 10, np.array([1], np.int64), np.array([1.0], F32))
    bad = good.copy()
    bad[0] = 123
    with pytest.raises(wire.WireFormatError, match=r"'w' from rank 1"):
        regions.reduce_region(B, np.concatenate([good, bad]), 20, (0, 10), 2, 0.1, "w")


def test_a_region_nobody_sent_to_shares_nothing():
    B = NumpyBackend()
    payload, dropped = regions.reduce_region(B, np.zeros(0, np.int32), 20, (10, 20), 0, 0.1, "w")
    assert payload is None and dropped is None


def test_exchange_option():
    assert DGCConfig(environ={}).exchange == "allgather"
    assert DGCConfig(environ={"HOROVOD_DGC_EXCHANGE": "Regions"}).exchange == "regions"
    with pytest.raises(ValueError, match="exchange must be one of 'allgather', 'regions'"):
        DGCConfig(exchange="ring", environ={})


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_kept_scratch_gives_the_same_result_and_is_left_zero(backend):
    B = BACKENDS[backend]
    rng = np.random.default_rng(5)
    n, lo, hi = 5000, 2000, 3000
    parts = []
    for r in range(3):
        idx = np.sort(rng.choice(np.arange(hi - lo), 40, replace=False)).astype(np.int64)
        parts.append(wire.encode(B, hi - lo, to_backend(B, idx),
                                 to_backend(B, rng.standard_normal(40).astype(F32))))
    gathered = B.cat(parts)
    scratch = B.zeros(hi - lo, like=gathered)
    for _ in range(2):
        want = regions.reduce_region(B, gathered, n, (lo, hi), 3, 0.01, "w")
        got = regions.reduce_region(B, gathered, n, (lo, hi), 3, 0.01, "w", scratch=scratch)
        assert to_np(got[0]).tobytes() == to_np(want[0]).tobytes()
        for a, b in zip(got[1], want[1]):
            np.testing.assert_array_equal(to_np(a), to_np(b))
        assert not to_np(scratch).any()
    flagged = wire.encode(B, hi - lo, B.empty_indices(like=gathered), B.zeros(0, like=gathered),
                          wire.FLAG_NONFINITE)
    regions.reduce_region(B, B.cat([parts[0], flagged]), n, (lo, hi), 2, 0.01, "w",
                          scratch=scratch)
    assert not to_np(scratch).any()
    bad = to_np(parts[1]).copy()
    bad[0] = 7
    with pytest.raises(wire.WireFormatError):
        regions.reduce_region(B, B.cat([parts[0], to_backend(B, bad)]), n, (lo, hi), 2, 0.01,
                              "w", scratch=scratch)
    assert not to_np(scratch).any()
