"""The receive side's kernel (`kernels.decode_sum`, `_kernels.c`) against the tensor-op reference.

`DGCCore.decompress` decodes with one kernel call when it can (host tensors, the kernels built)
and with `wire.decode_sum` plus `Backend.scale_at_` otherwise. The kernel must give the same bits
for every input it accepts, and decline (leaving its output untouched, so the reference runs and
raises or takes the NaN path) for every input the reference rejects or flags: a malformed
payload, a rank's non-finite flag, a non-finite value. Checked on the fuzz inputs of
tests/test_wire_fuzz.py (valid payloads of all four encodings, mutated ones, random headers and
words) and through `DGCCore.decompress` with `use_kernels` on and off: both exchanges, average or
sum, N = 1, 2, 3, 5, fewer payloads than ranks, with or without an output buffer, the NaN path.
"""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend, WireFormatError, kernels, wire
from dgc_horovod.backends.torch_backend import TorchBackend
from helpers import to_np
from test_wire_fuzz import (FUZZ, INT32, bucket_words, encode, mutate, random_header_words,
                            spec_decode, valid_gathered)

pytestmark = [pytest.mark.unit,
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.usefixtures("sparse_mechanics"),
              pytest.mark.skipif(not kernels.available(), reason="kernels not built or disabled")]

BACKENDS = {"numpy": NumpyBackend(), "torch": TorchBackend()}
SENTINEL = np.int32(0x7FC01234)          # a NaN pattern no decode writes: "untouched"
ZERO_ADD = kernels.DECODE_ZERO | kernels.DECODE_ADD


def words_of(B, words):
    words = np.ascontiguousarray(words, np.int32).copy()
    return torch.from_numpy(words) if B.name == "torch" else words


def sentinel_out(B, numel):
    a = np.full(numel, SENTINEL, np.int32).view(np.float32)
    return torch.from_numpy(a.copy()) if B.name == "torch" else a.copy()


def bits(x):
    return to_np(x).view(np.int32)


def kernel_matches_reference(B, words, numel, ranks, inv=None):
    """The property: the kernel either declines with out untouched, or accepts exactly what the
    reference accepts without flagging it and writes the reference's bits. Returns accepted."""
    out = sentinel_out(B, numel)
    mode = ZERO_ADD | (kernels.DECODE_SCALE if inv is not None else 0)
    done = kernels.decode_sum(B, words_of(B, words), numel, ranks, out, mode,
                              1.0 if inv is None else inv)
    if not done:
        assert (bits(out) == SENTINEL).all(), "declined but wrote to out"
        return False
    assert spec_decode(words, numel, ranks) is not None, "kernel accepted malformed words"
    positions = []
    want, nonfinite = wire.decode_sum(B, words_of(B, words), numel, ranks, "t", positions)
    assert not nonfinite, "kernel accepted a flagged or non-finite payload"
    if inv is not None and positions:
        B.scale_at_(want, positions[0] if len(positions) == 1 else B.cat(positions), inv)
    assert np.array_equal(bits(out), bits(want))
    return True


def finite_unflagged(parts):
    with np.errstate(all="ignore"):
        return all(not p[2] & wire.FLAG_NONFINITE and np.isfinite(
            p[1].astype(np.float16) if p[4] == "float16" else p[1]).all() for p in parts)


# ============================================================ the kernel alone, fuzzed
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(data=valid_gathered(), n=st.sampled_from([None, 2, 3, 7]))
def test_valid_payloads_decode_to_the_reference_bits(backend, data, n):
    numel, parts = data
    words = np.concatenate(encode(numel, parts))
    done = kernel_matches_reference(BACKENDS[backend], words, numel, len(parts),
                                    None if n is None else 1.0 / n)
    assert done == finite_unflagged(parts), "declined a valid finite payload (or the reverse)"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(data=valid_gathered(), draw=st.data())
def test_mutated_payloads_decline_or_match(backend, data, draw):
    numel, parts = data
    words = mutate(draw.draw, np.concatenate(encode(numel, parts)))
    kernel_matches_reference(BACKENDS[backend], words, numel, len(parts), 0.5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(data=random_header_words())
def test_random_headers_decline_or_match(backend, data):
    numel, ranks, words = data
    kernel_matches_reference(BACKENDS[backend], words, numel, ranks)


@FUZZ
@given(numel=st.integers(1, 64), ranks=st.integers(1, 3),
       words=st.lists(INT32, max_size=48).map(lambda w: np.array(w, np.int64).astype(np.int32)))
def test_random_words_decline_or_match(numel, ranks, words):
    kernel_matches_reference(BACKENDS["numpy"], words, numel, ranks)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("fmt", [(i, v) for i in ("int32", "delta16")
                                 for v in ("float32", "float16")])
def test_overlapping_ranks_escapes_and_subnormals(backend, fmt):
    """Positions sent by several ranks (added in rank order, scaled once), gaps over 65535
    (escape tokens), float16 subnormals, a rank without entries; N = 5, 1/N inexact."""
    B, NB = BACKENDS[backend], BACKENDS["numpy"]
    rng = np.random.default_rng(3)
    numel = 400_000
    parts = []
    for r in range(5):
        c = 0 if r == 3 else 3000
        idx = np.sort(rng.choice(numel, c, replace=False))
        if c:
            idx[:4] = [0, 70_000, 140_002, numel - 1]
            idx = np.unique(idx)
        vals = (rng.standard_normal(idx.size) * 10.0 ** rng.integers(-7, 3, idx.size))
        vals = vals.astype(np.float32)
        if fmt[0] == "int32":
            rng.shuffle(idx)                    # int32 indices may come in any order
        parts.append(wire.encode(NB, numel, idx, vals, 0, *fmt))
    assert kernel_matches_reference(B, np.concatenate(parts), numel, 5, 1.0 / 5)
    assert kernel_matches_reference(B, np.concatenate(parts), numel, 5)


@pytest.mark.parametrize("index", ["int32", "delta16"])
@pytest.mark.parametrize("bad", ["past the end", "negative", "one entry more", "one entry less"])
def test_boundary_payloads_are_declined(index, bad):
    """Payloads one step off the format (an index at numel or -1, one token with an entry more
    or fewer than the count): the reference raises, the kernel declines without writing."""
    NB, numel = BACKENDS["numpy"], 70_000
    idx = np.array([3, 65_600, numel - 1])
    if bad == "past the end":                 # made for numel + 1 elements, then relabelled
        words = wire.encode(NB, numel + 1, idx + 1, np.ones(3, np.float32), 0, index)
    elif bad == "negative":
        if index == "delta16":
            pytest.skip("delta16 positions are >= 0 by construction")
        words = wire.encode(NB, numel, idx, np.ones(3, np.float32), 0, index)
        words[wire.HEADER_WORDS] = -1
    else:
        words = wire.encode(NB, numel, idx, np.ones(3, np.float32), 0, index)
        if index == "int32":
            pytest.skip("int32 payloads carry exactly count indices")
        words[2] += 1 if bad == "one entry less" else -1     # the header's count
    words[1] = numel
    for B in BACKENDS.values():
        with pytest.raises(WireFormatError):
            wire.decode_sum(B, words_of(B, words), numel, 1, "t")
        out = sentinel_out(B, numel)
        assert not kernels.decode_sum(B, words_of(B, words), numel, 1, out, ZERO_ADD)
        assert (bits(out) == SENTINEL).all()


def test_declines_what_it_cannot_take():
    B = BACKENDS["torch"]
    words = wire.encode(BACKENDS["numpy"], 8, np.array([1, 5]), np.array([1.0, 2.0], np.float32))
    out = torch.zeros(8)
    assert kernels.decode_sum(B, torch.from_numpy(words), 8, 1, out, ZERO_ADD)
    assert out.tolist() == [0, 1, 0, 0, 0, 2, 0, 0]
    for g, o, n in [(torch.from_numpy(words).long(), out, 8),      # not int32 words
                    (torch.from_numpy(words), out.double(), 8),    # not a float32 out
                    (torch.from_numpy(words), torch.zeros(16)[::2], 8),   # not contiguous
                    (torch.from_numpy(words), out, 9)]:             # out of another size
        assert not kernels.decode_sum(B, g, n, 1, o, ZERO_ADD)
    assert not kernels.decode_sum(B, torch.from_numpy(words), 8, 0, out, ZERO_ADD)  # no rank


# ============================================================ split_bucket's walk
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(numels=st.lists(st.integers(1, 30), min_size=1, max_size=3), ranks=st.integers(1, 3),
       draw=st.data())
def test_bucket_split_declines_or_matches(backend, numels, ranks, draw):
    """kernels.split_spans accepts exactly the buckets wire.split_bucket accepts, and cuts
    them at the same words; kernels.split_bucket then returns the same parts."""
    B = BACKENDS[backend]
    words = bucket_words(draw, numels, ranks)
    spans = kernels.split_spans(B, words_of(B, words), ranks, len(numels))
    try:
        want = wire.split_bucket(B, words_of(B, words), ranks, len(numels), "b")
    except WireFormatError:
        assert spans is None, "kernel accepted a malformed bucket"
        with pytest.raises(WireFormatError):
            kernels.split_bucket(B, words_of(B, words), ranks, len(numels), "b")
        return
    assert spans is not None, "kernel declined a bucket the reference accepts"
    got = kernels.split_bucket(B, words_of(B, words), ranks, len(numels), "b")
    assert [[to_np(p).tolist() for p in ps] for ps in got] == \
        [[to_np(p).tolist() for p in ps] for ps in want]


@pytest.mark.parametrize("use_kernels", [True, False])
def test_core_split_bucket_follows_use_kernels(use_kernels, monkeypatch):
    """DGCCore.split_bucket (what the adapter and the simulated cluster call) takes the
    kernel's walk exactly when use_kernels is set, and gives wire.split_bucket's parts."""
    B = BACKENDS["torch"]
    rng = np.random.default_rng(3)
    frames = []
    for _ in range(2):                                   # two ranks, a bucket of two tensors
        core = DGCCore(DGCConfig(warmup_epochs=0, min_sparse_numel=1), B)
        res = core.compress_many([(f"w{m}", torch.from_numpy(rng.standard_normal(500, np.float32)),
                                   None) for m in range(2)], 2)
        assert [r[0] for r in res] == ["sparse", "sparse"]
        frames.append(wire.frame_bucket(B, [(m, r[1]) for m, r in enumerate(res)], like=res[0][1]))
    gathered = B.cat(frames)
    core.use_kernels = use_kernels
    calls, real = [], kernels.split_bucket
    monkeypatch.setattr(kernels, "split_bucket", lambda *a: calls.append(a) or real(*a))
    got = core.split_bucket(gathered, 2, 2, "b")
    want = wire.split_bucket(B, gathered, 2, 2, "b")
    assert [len(ps) for ps in got] == [2, 2]
    assert [[p.tolist() for p in ps] for ps in got] == [[p.tolist() for p in ps] for ps in want]
    assert len(calls) == (1 if use_kernels else 0)


# ============================================================ through DGCCore.decompress
def vec(B, a):
    a = np.array(a, np.float32, copy=True)
    return torch.from_numpy(a) if B.name == "torch" else a


def step(cores, grads):
    """Every rank compresses its gradient of "w"; returns (gathered, contexts)."""
    B, n = cores[0].B, len(cores)
    outs = [core.compress("w", vec(B, g), n) for core, g in zip(cores, grads)]
    assert all(o[0] == "sparse" for o in outs)
    return B.cat([o[1] for o in outs]), [o[2] for o in outs]


def state(core):
    st = core.states["w"]
    return [bits(x) for x in (st.u, st.v) if x is not None]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("cfg", [{}, {"wire_index": "int32"}, {"wire_values": "float16"},
                                 {"exchange": "regions"}])
def test_decompress_is_the_same_with_and_without_the_kernel(backend, world_size, cfg):
    """Two identical sets of ranks, one decoding with the kernel and one with the tensor ops:
    the same updates and the same state, step after step, average and sum, with and without an
    output buffer (filled with garbage first), and with one payload fewer than ranks."""
    B = BACKENDS[backend]
    rng = np.random.default_rng(world_size)
    config = dict(cfg, warmup_epochs=0, compress_ratio=0.01, min_sparse_numel=1, min_sparse_ndim=1)
    sets = [[DGCCore(DGCConfig(**config), B) for _ in range(world_size)] for _ in range(2)]
    for core in sets[1]:
        core.use_kernels = False
    numel = 5000
    for t in range(4):
        grads = [rng.standard_normal(numel).astype(np.float32) for _ in range(world_size)]
        average, with_out = t % 2 == 0, t < 2
        results = []
        for cores in sets:
            gathered, ctxs = step(cores, grads)
            res = []
            for r, (core, ctx) in enumerate(zip(cores, ctxs)):
                out = sentinel_out(B, numel) if with_out else None
                got = core.decompress(gathered, ctx, world_size, average, out=out)
                res.append((bits(got), state(core)))
            if world_size > 1:        # the first rank's payload only (a bucket member omitted)
                first = B.slice(gathered, 0, wire.HEADER_WORDS + int(
                    sum(wire._section_words(*_header(B, gathered)))))
                res.append(bits(cores[0].decompress(first, ctxs[0], world_size, average, 1)))
            results.append(res)
        k, ref = results
        for a, b in zip(k[:world_size], ref[:world_size]):
            assert np.array_equal(a[0], b[0])
            assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))
        if world_size > 1:
            assert np.array_equal(k[-1], ref[-1])


def _header(B, words):
    _, _, c, w3, t = (int(x) for x in to_np(B.slice(words, 0, wire.HEADER_WORDS)))
    return c, wire.INDEX_ENCODINGS[(w3 >> 8) & 0xFF], wire.VALUE_DTYPES[(w3 >> 16) & 0xFF], t


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_nonfinite_step_takes_the_reference_path(backend):
    """A rank's NaN gradient: the kernel declines, decompress returns all NaN and puts the
    sent entries back, exactly as without the kernel."""
    B = BACKENDS[backend]
    rng = np.random.default_rng(7)
    config = dict(warmup_epochs=0, compress_ratio=0.01, min_sparse_numel=1, min_sparse_ndim=1)
    sets = [[DGCCore(DGCConfig(**config), B) for _ in range(2)] for _ in range(2)]
    for core in sets[1]:
        core.use_kernels = False
    results = []
    warm = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    for cores in sets:
        step(cores, warm)
    rng = np.random.default_rng(8)
    grads = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
    grads[0][17] = np.nan
    for cores in sets:
        gathered, ctxs = step(cores, grads)
        res = []
        for core, ctx in zip(cores, ctxs):
            got = core.decompress(gathered, ctx, 2, True, out=sentinel_out(B, 3000))
            assert np.isnan(to_np(got)).all()
            res.append((bits(got), state(core)))
        results.append(res)
    for a, b in zip(*results):
        assert np.array_equal(a[0], b[0])
        assert all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_malformed_payload_raises_the_reference_error(backend):
    B = BACKENDS[backend]
    core = DGCCore(DGCConfig(warmup_epochs=0, compress_ratio=0.01, min_sparse_numel=1,
                             min_sparse_ndim=1), B)
    _, payload, ctx = core.compress("w", vec(B, np.ones(100)), 2)
    words = to_np(B.cat([payload, payload])).copy()
    words[len(words) // 2 + 1] = 99                     # rank 1 describes 99 elements
    with pytest.raises(WireFormatError, match=r"'w' from rank 1 describes 99 elements"):
        core.decompress(words_of(B, words), ctx, 2, True, out=sentinel_out(B, 100))


def test_decode_cost_benchmark_runs_and_finds_the_same_bits(capsys):
    """benchmarks/decode_cost.py (ResNet-50's shapes, 2 ranks): both ways give the same bits."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "benchmarks"))
    import decode_cost
    threads = torch.get_num_threads()
    try:
        assert decode_cost.main(["--repeats", "1"]) == 0          # sets 1 torch thread
    finally:
        torch.set_num_threads(threads)
    assert "same bits, kernel and reference: True" in capsys.readouterr().out
