"""Fuzzing the DGC wire decoder with malformed payloads (hypothesis).

Whatever int32 words arrive from the allgather, `wire.decode_sum` (and `wire.split_bucket` for
bucketed allgathers) must either return a result of the right shape or raise `WireFormatError`
(a ValueError) naming the tensor and a rank: never another exception, never a hang, never a write
outside the tensor. Inputs: random word arrays, random headers, and valid payloads (all four
encodings, escapes in the index deltas, NaN/Inf values, non-finite flags) mutated by bit flips,
truncation, extension, inserted/deleted words and random header words. An accepted payload must
decode to exactly what an independent reading of the format (below, from the specification in
dgc_horovod/core/wire.py) gives, so an out-of-range or misplaced write cannot pass silently.

Examples are derandomized (the suite is reproducible); DGC_FUZZ_EXAMPLES=5000 runs a deeper
search.
"""
import contextlib
import math
import os
import re
import signal

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgc_horovod.core import NumpyBackend, WireFormatError, wire
from dgc_horovod.backends.torch_backend import TorchBackend
from helpers import to_np

NAME = "fuzz.layer3.weight"
BUCKET = "dgc.bucket.fuzz"
BACKENDS = {"numpy": NumpyBackend(), "torch": TorchBackend()}
MAGIC, HEADER = 0x44474303, 6
INT32 = st.integers(-2 ** 31, 2 ** 31 - 1)
FORMATS = [(i, v) for i in ("int32", "delta16") for v in ("float32", "float16")]

# NaN/Inf values and fp16 overflow are part of the inputs; NumPy's warnings about them are noise
pytestmark = [pytest.mark.unit,
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.usefixtures("sparse_mechanics")]     # flat gradients (see conftest)

FUZZ = settings(max_examples=int(os.environ.get("DGC_FUZZ_EXAMPLES", "150")), deadline=None,
                database=None, derandomize="DGC_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def time_limit(seconds):
    """Fail instead of hanging (a decode loop that does not terminate)."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"wire decode did not finish within {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ============================================================ the format, read independently
def spec_decode(words, numel, ranks):
    """Sum of every rank's entries as the format specifies, or None if the words do not follow
    it. Pure Python over the header; float32 additions in rank order, then entry order."""
    words = np.asarray(words, np.int32)
    dense, nonfinite, pos = np.zeros(numel, np.float32), False, 0
    for _ in range(ranks):
        if pos + HEADER > words.size:
            return None
        magic, n, c, w3, t, k = (int(x) for x in words[pos:pos + HEADER])
        flags, icode, vcode = w3 & 0xFF, (w3 >> 8) & 0xFF, (w3 >> 16) & 0xFF
        escapes = (numel - 1) // 65535                 # the most a delta16 section holds
        if magic != MAGIC or n != numel or not 0 <= c <= k <= numel or w3 >> 24 or icode > 1 \
                or vcode > 1 or t < c or (icode == 0 and t != c) or t > c + escapes:
            return None
        iw = k if icode == 0 else math.ceil((k + escapes) / 2)      # room for k entries
        vw = k if vcode == 0 else math.ceil(k / 2)
        start, end = pos + HEADER, pos + HEADER + iw + vw
        if end > words.size:
            return None
        if c:
            if icode == 0:
                idx = [int(x) for x in words[start:start + c]]
            else:
                idx, p = [], -1
                for tok in words[start:start + math.ceil(t / 2)].view(np.uint16)[:t]:
                    p += 65535 if tok == 0 else int(tok)
                    if tok:
                        idx.append(p)
                if len(idx) != c:
                    return None
            if not all(0 <= i < numel for i in idx):
                return None
            vwords = words[start + iw:start + iw + (c if vcode == 0 else math.ceil(c / 2))]
            vals = (vwords.view(np.float32) if vcode == 0
                    else vwords.view(np.float16).astype(np.float32))[:c]
            with np.errstate(all="ignore"):
                for i, v in zip(idx, vals):
                    dense[i] += v
            # a float16 ±inf is an overflow every rank must see (NaN: no finite value either)
            nonfinite |= vcode == 1 and not bool(np.isfinite(vals).all())
        nonfinite |= bool(flags & 1)
        pos = end
    return (dense, nonfinite) if pos == words.size else None


def to_backend(B, words):
    words = np.ascontiguousarray(words, np.int32)
    return torch.from_numpy(words.copy()) if B.name == "torch" else words.copy()


def check_decode(B, words, numel, ranks):
    """The property: a correct result or a WireFormatError naming tensor and rank."""
    with time_limit(20):
        try:
            dense, nonfinite = wire.decode_sum(B, to_backend(B, words), numel, ranks, NAME)
        except WireFormatError as e:
            msg = str(e)
            assert NAME in msg and re.search(r"\brank \d+\b", msg), msg
            return None
    dense = to_np(dense)
    assert dense.shape == (numel,) and dense.dtype == np.float32
    want = spec_decode(words, numel, ranks)
    assert want is not None, "decode_sum accepted words that do not follow the format"
    np.testing.assert_array_equal(dense, want[0])
    assert nonfinite == want[1]
    return dense, nonfinite


# ============================================================ strategies
@st.composite
def rank_payload(draw, numel):
    """(indices, values, flags, index encoding, value dtype, room) of one rank's valid payload:
    room for c to c + 3 entries (a payload of fixed size holds fewer than its room)."""
    index, values = draw(st.sampled_from(FORMATS))
    c = draw(st.integers(0, min(numel, 12)))
    idx = sorted(draw(st.lists(st.integers(0, numel - 1), min_size=c, max_size=c, unique=True)))
    vals = draw(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True),
                         min_size=c, max_size=c))
    flags = draw(st.sampled_from([0, 0, 0, wire.FLAG_NONFINITE]))
    room = min(numel, c + draw(st.integers(0, 3)))
    return (np.array(idx, np.int64), np.array(vals, np.float32), flags, index, values, room)


def encode(numel, parts):
    return [wire.encode(BACKENDS["numpy"], numel, *p) for p in parts]


def expected(numel, parts):
    dense, overflow = np.zeros(numel, np.float32), False
    with np.errstate(all="ignore"):
        for idx, vals, _, _, values, _ in parts:
            sent = vals.astype(np.float16).astype(np.float32) if values == "float16" else vals
            overflow |= values == "float16" and not bool(np.isfinite(sent).all())
            for i, v in zip(idx, sent):
                dense[i] += v
    return dense, overflow or any(p[2] & wire.FLAG_NONFINITE for p in parts)


# numel: small, or large enough for 16-bit index gaps with escapes (delta16 token 0)
NUMEL = st.one_of(st.integers(1, 40), st.integers(65530, 300000))


@st.composite
def valid_gathered(draw):
    numel = draw(NUMEL)
    ranks = draw(st.integers(1, 3))
    parts = [draw(rank_payload(numel)) for _ in range(ranks)]
    return numel, parts


def mutate(draw, words):
    """1-3 random corruptions of a flat int32 word list."""
    words = list(int(w) for w in words)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "truncate", "extend", "set", "header", "insert",
                                   "delete"]))
        n = len(words)
        if op == "flip" and n:
            i, bit = draw(st.integers(0, n - 1)), draw(st.integers(0, 31))
            words[i] = int(np.array([words[i]], np.int32).view(np.uint32)[0] ^ (1 << bit))
            words[i] = int(np.array([words[i]], np.uint32).view(np.int32)[0])
        elif op == "truncate":
            words = words[:draw(st.integers(0, n))]
        elif op == "extend":
            words += draw(st.lists(INT32, min_size=1, max_size=8))
        elif op == "set" and n:
            words[draw(st.integers(0, n - 1))] = draw(INT32)
        elif op == "header" and n:
            # a header word of some payload: a plausible small value or any int32
            i = draw(st.integers(0, min(n - 1, HEADER - 1)))
            starts = [j for j in range(n) if words[j] == MAGIC] or [0]
            at = min(n - 1, draw(st.sampled_from(starts)) + i)
            words[at] = draw(st.one_of(st.integers(-3, 70000), INT32))
        elif op == "insert":
            words.insert(draw(st.integers(0, n)), draw(INT32))
        elif op == "delete" and n:
            del words[draw(st.integers(0, n - 1))]
    return np.array(words, np.int64).astype(np.int32)


@st.composite
def random_header_words(draw):
    """Payloads shaped like the format with random header fields and random bodies."""
    numel = draw(st.integers(1, 40))
    ranks = draw(st.integers(1, 3))
    words = []
    for _ in range(ranks):
        words += [draw(st.one_of(st.just(MAGIC), st.just(MAGIC), st.just(MAGIC), INT32)),
                  draw(st.one_of(st.just(numel), st.just(numel), st.integers(-2, 50), INT32)),
                  draw(st.one_of(st.integers(-2, numel + 2), INT32)),
                  draw(st.one_of(st.sampled_from([0, 1, 1 << 8, 1 << 16, (1 << 8) | (1 << 16),
                                                  2 << 8, 2 << 16, 1 << 24]), INT32)),
                  draw(st.one_of(st.integers(-2, 2 * numel + 2), INT32)),
                  draw(st.one_of(st.integers(-2, numel + 2), INT32))]
        words += draw(st.lists(st.one_of(st.integers(-2, 2 * numel), INT32), max_size=2 * numel))
    return numel, ranks, np.array(words, np.int64).astype(np.int32)


# ============================================================ decode_sum
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(data=valid_gathered())
def test_valid_payloads_decode_exactly(backend, data):
    numel, parts = data
    words = np.concatenate(encode(numel, parts))
    got = check_decode(BACKENDS[backend], words, numel, len(parts))
    assert got is not None, "a valid payload was rejected"
    want = expected(numel, parts)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(data=valid_gathered(), draw=st.data())
def test_mutated_payloads_decode_or_raise_wire_format_error(backend, data, draw):
    numel, parts = data
    words = mutate(draw.draw, np.concatenate(encode(numel, parts)))
    check_decode(BACKENDS[backend], words, numel, len(parts))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(numel=st.integers(1, 64), ranks=st.integers(1, 3),
       words=st.lists(INT32, max_size=48).map(lambda w: np.array(w, np.int64).astype(np.int32)))
def test_random_words_decode_or_raise_wire_format_error(backend, numel, ranks, words):
    check_decode(BACKENDS[backend], words, numel, ranks)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(data=random_header_words())
def test_random_headers_decode_or_raise_wire_format_error(backend, data):
    numel, ranks, words = data
    check_decode(BACKENDS[backend], words, numel, ranks)


# ============================================================ split_bucket (bucketed allgather)
def bucket_words(draw, numels, ranks):
    """An allgathered bucket: each rank's frame of valid payloads of a random subset of the
    members (tensors of ``numels`` elements), in rank order; mutated half of the time."""
    NB = BACKENDS["numpy"]
    segments = []
    for _ in range(ranks):
        members = draw.draw(st.lists(st.integers(0, len(numels) - 1), unique=True))
        entries = [(m, wire.encode(NB, numels[m], *draw.draw(rank_payload(numels[m]))))
                   for m in sorted(members)]
        segments.append(wire.frame_bucket(NB, entries, like=None))
    words = np.concatenate(segments)
    if draw.draw(st.booleans()):
        words = mutate(draw.draw, words)
    return words


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@FUZZ
@given(numels=st.lists(st.integers(1, 30), min_size=1, max_size=3), ranks=st.integers(1, 3),
       draw=st.data())
def test_mutated_buckets_split_or_raise_wire_format_error(backend, numels, ranks, draw):
    B = BACKENDS[backend]
    words = bucket_words(draw, numels, ranks)
    with time_limit(20):
        try:
            parts = wire.split_bucket(B, to_backend(B, words), ranks, len(numels), BUCKET)
        except WireFormatError as e:
            assert BUCKET in str(e) and re.search(r"\brank \d+\b", str(e)), str(e)
            return
    assert len(parts) == len(numels)
    for numel, payloads in zip(numels, parts):
        assert len(payloads) <= ranks
        if payloads:
            check_decode(B, np.concatenate([to_np(p) for p in payloads]), numel, len(payloads))


# ============================================================ fixed regressions
def test_escape_gap_payload_round_trips():
    """The largest gap a single escape covers, then one more (delta16 token 0 then 1)."""
    numel = 3 * 65536
    parts = [(np.array([0, 65536, 2 * 65536 + 1], np.int64), np.array([1, 2, 3], np.float32), 0,
              "delta16", "float32", 3)]
    words = np.concatenate(encode(numel, parts))
    got = check_decode(BACKENDS["numpy"], words, numel, 1)
    np.testing.assert_array_equal(got[0], expected(numel, parts)[0])
