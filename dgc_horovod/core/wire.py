"""Wire format of one rank's sparse contribution, and the rank-ordered decode (sum).

Format ``DGC v3``: one flat int32 tensor per gradient tensor per rank, in native byte order
(Horovod allgather concatenates the ranks' tensors in rank order). Its size follows from the
tensor's size n and its target count k alone (:func:`payload_words`), so an engine on a device
knows it before the selection is made::

    word 0   MAGIC_V3 = 0x44474303  ('D' 'G' 'C' + format version 3; any other value is rejected)
    word 1   numel     n, elements of the dense tensor (0 < n < 2**31)
    word 2   count     c, entries sent by this rank (0 <= c <= k)
    word 3   flags | index_encoding << 8 | value_dtype << 16
               flags bit 0 (FLAG_NONFINITE): this rank's gradient had NaN/Inf and sent nothing
               index_encoding: 0 = INDEX_INT32, 1 = INDEX_DELTA16;  value_dtype: 0 = FP32, 1 = FP16
    word 4   tokens    t, number of 16-bit index tokens (delta16), or c (int32)
    word 5   k         the capacity: entries the payload has room for (c <= k <= n)
    then     index section of :func:`index_words` (n, k) words, the used part first, then zeros:
               INDEX_INT32:   c words, the positions in the flattened tensor, ascending
               INDEX_DELTA16: ceil(t/2) words holding t uint16 tokens (two per word, low half
                 first), for the positions in ascending order. Token d in 1..65535 advances the
                 position by d and emits an entry (the first entry's position is d - 1); token 0
                 advances by 65535 without an entry (the escape for gaps > 65535, so any gap,
                 up to 2**31, is encoded exactly; at most (n - 1) // 65535 of them). The paper's
                 "16-bit run lengths of zeros".
    then     value section of :func:`value_words` (k) words, the used part first, then zeros,
             in the order of the indices:
               FP32: c words (IEEE-754 float32 bit patterns);  FP16: ceil(c/2) words, two
               IEEE-754 float16 values per word, low half first (±inf: a value beyond float16's
               range, sent so that every rank sees the overflow: decode_sum reports it non-finite)

Bytes: 24 + 4·(index words + value words); e.g. delta16 + fp32 ≈ 24 + 6k, int32 + fp32 = 24 + 8k,
delta16 + fp16 ≈ 24 + 4k. Every payload describes its own encoding and capacity, so decoding never
depends on the receiver's settings; a payload of another format version is rejected by its magic
word. Padding words are zero, so equal selections give equal payloads on every engine.
"""
__all__ = ["MAGIC_V3", "BUCKET_MAGIC", "frame_bucket", "split_bucket", "BUCKET_HEADER_BYTES",
           "FLAG_NONFINITE", "HEADER_WORDS", "HEADER_BYTES", "MAX_NUMEL", "ESCAPE",
           "INDEX_ENCODINGS", "VALUE_DTYPES", "encode", "decode_sum", "read_payload",
           "payload_words", "payload_bytes", "frame_bytes", "frame_overhead_bytes", "index_words",
           "value_words", "max_escapes", "check_numel", "WireFormatError"]

MAGIC_V3 = 0x44474303
BUCKET_MAGIC = 0x44474342          # 'D' 'G' 'C' 'B'
BUCKET_HEADER_BYTES = 8            # [BUCKET_MAGIC, entries]; then 4 bytes per entry + payload
FLAG_NONFINITE = 1
HEADER_WORDS = 6
HEADER_BYTES = 4 * HEADER_WORDS
MAX_NUMEL = 2 ** 31 - 1
INDEX_ENCODINGS = ("int32", "delta16")
VALUE_DTYPES = ("float32", "float16")
#: The gap advanced by one escape token (token 0) of a delta16 index section.
ESCAPE = 65535


class WireFormatError(ValueError):
    """A received payload does not follow the DGC wire format (names tensor and rank)."""


def max_escapes(numel):
    """The most escape tokens a delta16 index section of a tensor of ``numel`` elements holds:
    the gaps of ascending positions below numel add up to at most numel, so (numel - 1) // 65535."""
    return (numel - 1) // ESCAPE


def index_words(numel, k, index="delta16"):
    """Words of the index section of a payload with room for k entries."""
    return k if index == "int32" else (k + max_escapes(numel) + 1) // 2


def value_words(k, values="float32"):
    """Words of the value section of a payload with room for k entries."""
    return k if values == "float32" else (k + 1) // 2


def payload_words(numel, k, index="delta16", values="float32"):
    """The size in int32 words of every payload of a tensor of ``numel`` elements with room for
    k entries (whatever it holds)."""
    return HEADER_WORDS + index_words(numel, k, index) + value_words(k, values)


def payload_bytes(numel, k, index="delta16", values="float32"):
    """Bytes one rank puts on the wire for a tensor whose payloads have room for k entries."""
    return 4 * payload_words(numel, k, index, values)


def frame_overhead_bytes(members):
    """Bytes a bucket frame adds to its ``members`` payloads: its header and one member word
    each (see :func:`frame_bucket`)."""
    return BUCKET_HEADER_BYTES + 4 * members


def frame_bytes(payload_sizes):
    """Bytes of one rank's bucket frame holding payloads of ``payload_sizes`` bytes."""
    return frame_overhead_bytes(len(payload_sizes)) + sum(payload_sizes)


def check_numel(numel, name):
    """Raise ValueError if a tensor of ``numel`` elements cannot be indexed by the wire format."""
    if numel > MAX_NUMEL:
        raise ValueError(f"tensor {name!r} has {numel} elements; the DGC wire format indexes "
                         f"at most {MAX_NUMEL} (int32), and DGC refuses such a tensor whether it "
                         "would be sent sparse or dense. Split the parameter into smaller ones.")


def _delta16_tokens(B, idx):
    """Ascending int64 positions → int64 tokens in 0..65535 (see the module docstring)."""
    c = B.numel(idx)
    if c == 0:
        return idx
    prev = B.cat([B.int64_tensor([-1], like=idx), B.slice(idx, 0, c - 1)])
    gaps = idx - prev                                   # >= 1
    escapes = (gaps - 1) // ESCAPE
    pos = B.cumsum(escapes + 1) - 1                     # where each entry's token goes
    n_tokens = B.to_list(B.slice(pos, c - 1, c))[0] + 1
    return B.put(B.int64_zeros(n_tokens, like=idx), pos, gaps - escapes * ESCAPE)


def _padded(B, words, size, like):
    """The int32 words followed by zeros up to ``size`` words."""
    pad = size - B.numel(words)
    return words if not pad else B.cat([words, B.to_int32(B.int64_zeros(pad, like=like))])


def encode(B, numel, indices, values, flags=0, index="int32", value_dtype="float32", k=None):
    """Build one rank's payload.

    Args:
        B: backend. numel (int): elements of the dense tensor.
        indices: int64 tensor (c,), unique positions, ascending.
        values: float32 tensor (c,), in the order of ``indices``.
        flags (int): FLAG_* bits. index: "int32" or "delta16". value_dtype: "float32"/"float16".
        k (int or None): the capacity (c <= k <= numel); None: c.
    Returns:
        flat int32 tensor of :func:`payload_words` (numel, k) words.
    """
    c = B.numel(indices)
    k = c if k is None else k
    if index == "int32":
        tokens, idx_words = c, B.to_int32(indices)
    else:
        toks = _delta16_tokens(B, indices)
        tokens, idx_words = B.numel(toks), B.pack16(toks)
    val_words = B.float32_bits(values) if value_dtype == "float32" else B.pack_fp16(values)
    word3 = flags | INDEX_ENCODINGS.index(index) << 8 | VALUE_DTYPES.index(value_dtype) << 16
    header = B.int32_tensor([MAGIC_V3, numel, c, word3, tokens, k], like=values)
    return B.cat([header, _padded(B, idx_words, index_words(numel, k, index), values),
                  _padded(B, val_words, value_words(k, value_dtype), values)])


def _fail(name, rank, what):
    raise WireFormatError(f"DGC payload of tensor {name!r} from rank {rank} {what}")


def _header(B, words, pos, total, name, rank):
    """The checked header fields (n, c, flags, index, values, tokens, k) of the payload at word
    ``pos`` and its length in words (its own size checks only: numel against the receiver's is
    :func:`read_payload`'s)."""
    if pos + HEADER_WORDS > total:
        _fail(name, rank, f"is truncated: no complete header ({total - pos} of "
                          f"{HEADER_WORDS} words left)")
    magic, n, c, word3, tokens, k = B.to_list(B.slice(words, pos, pos + HEADER_WORDS))
    if magic != MAGIC_V3:
        _fail(name, rank, f"has header {magic & 0xFFFFFFFF:#010x}, expected {MAGIC_V3:#010x} "
                          "(DGC wire format v3); are all ranks running the same dgc_horovod "
                          "version?")
    if not 0 < n <= MAX_NUMEL:
        _fail(name, rank, f"describes {n} elements")
    if not 0 <= c <= k <= n:
        _fail(name, rank, f"claims {c} entries with room for {k} in a tensor of {n} elements")
    flags, index_code, value_code = word3 & 0xFF, (word3 >> 8) & 0xFF, (word3 >> 16) & 0xFF
    if index_code >= len(INDEX_ENCODINGS) or value_code >= len(VALUE_DTYPES) or word3 >> 24:
        _fail(name, rank, f"has an unknown encoding word {word3:#010x}")
    index, values = INDEX_ENCODINGS[index_code], VALUE_DTYPES[value_code]
    if (index == "int32" and tokens != c) or not c <= tokens <= c + max_escapes(n):
        _fail(name, rank, f"has {tokens} index tokens for {c} entries")
    return (n, c, flags, index, values, tokens, k), payload_words(n, k, index, values)


def read_payload(B, words, pos, numel, name="<tensor>", rank=0):
    """Check and decode the payload that starts at word ``pos`` of ``words``.

    Returns (indices, values, flags, index encoding, value dtype, end): int32/int64 positions and
    float32 values (None, None when the payload has no entry), the header's flags and encodings
    (names from INDEX_ENCODINGS / VALUE_DTYPES), and the word after the payload.
    Raises WireFormatError (naming tensor and rank) as :func:`decode_sum` describes.
    """
    total = B.numel(words)
    (n, c, flags, index, values, tokens, k), size = _header(B, words, pos, total, name, rank)
    if n != numel:
        _fail(name, rank, f"describes {n} elements, this rank has {numel}: the models differ")
    end = pos + size
    if end > total:
        _fail(name, rank, f"is truncated: room for {k} entries needs {size} words, "
                          f"{total - pos} left")
    if not c:
        return None, None, flags, index, values, end
    start = pos + HEADER_WORDS
    if index == "int32":
        idx = B.slice(words, start, start + c)
    else:
        toks = B.unpack16(B.slice(words, start, start + (tokens + 1) // 2), tokens)
        is_entry = toks != 0
        if B.count_true(is_entry) != c:
            _fail(name, rank, f"has {B.count_true(is_entry)} index tokens with entries, "
                              f"header says {c}")
        idx = B.mask(B.cumsum(B.where(is_entry, toks, ESCAPE)) - 1, is_entry)
    lo, hi = B.min_max(idx)
    if lo < 0 or hi >= numel:
        _fail(name, rank, f"has index {lo if lo < 0 else hi} outside [0, {numel})")
    vstart = start + index_words(n, k, index)
    vw = B.slice(words, vstart, vstart + value_words(c, values))
    vals = B.bits_float32(vw) if values == "float32" else B.unpack_fp16(vw, c)
    return idx, vals, flags, index, values, end


def decode_sum(B, gathered, numel, world_size, name="<tensor>", positions=None, out=None,
               out_is_zero=False):
    """Sum the sparse contributions of all ranks into a dense float32 tensor, in rank order.

    Every rank runs the same additions in the same order (rank 0 first), so the result is
    bit-identical on all ranks.

    Args:
        B: backend. gathered: flat int32 tensor, the allgather of every rank's :func:`encode`.
        numel (int): elements of the dense tensor. world_size (int): ranks in the allgather.
        name (str): tensor name, used in error messages.
        positions (list or None): when given, each rank's decoded index tensor (int32 or int64)
            is appended to it: together they are every position that may be non-zero.
        out: None (a new tensor), or a flat float32 tensor of numel elements to zero and sum
            into (the caller's gradient storage: no allocation); checked before it is touched.
        out_is_zero (bool): ``out`` is all zeros already (a kept scratch buffer): not zeroed
            again, so the decode costs O(entries), not O(numel).
    Returns:
        (dense, nonfinite): flat float32 tensor of numel elements (the sum, not the mean), and
        True if any rank flagged a non-finite gradient or sent a float16 value beyond float16's
        range (±inf).
    Raises:
        WireFormatError: wrong magic/version or encoding code, wrong numel, truncated or
            over-long payload, or an index out of range; the message names tensor and rank.
    """
    total = B.numel(gathered)
    if out is not None and B.numel(out) != numel:
        raise ValueError(f"decode_sum: out has {B.numel(out)} elements, tensor {name!r} {numel}")
    dense = B.zeros(numel, like=gathered) if out is None else (out if out_is_zero
                                                                  else B.zero_(out))
    nonfinite = False
    pos = 0
    for rank in range(world_size):
        idx, vals, flags, _, values, pos = read_payload(B, gathered, pos, numel, name, rank)
        nonfinite |= bool(flags & FLAG_NONFINITE)
        if idx is not None:
            if values == "float16":                 # ±inf: a value beyond float16's range
                nonfinite = nonfinite or not B.all_finite(vals)
            B.index_add_(dense, idx, vals)
            if positions is not None:
                positions.append(idx)
    if pos != total:
        raise WireFormatError(f"DGC payload of tensor {name!r} has {total - pos} unexpected "
                              f"trailing words after the payload of rank {world_size - 1} "
                              f"(the last of {world_size} ranks)")
    return dense, nonfinite


# ----------------------------------------------------------------------------- buckets
# Several tensors' payloads can travel in one allgather ("bucket"). One rank's segment is
#     word 0  BUCKET_MAGIC     word 1  n, entries in this segment
#     then n times: one word, the tensor's position in the bucket (its member index), followed
#     by that tensor's payload in the format above (whose header gives its length).
# A rank that has no payload for a member simply omits it, so ranks may send different members.

def frame_bucket(B, entries, like):
    """One rank's bucket segment from [(member index, payload)] (flat int32 tensors)."""
    parts = [B.int32_tensor([BUCKET_MAGIC, len(entries)], like=like)]
    if entries:         # the member words: one tensor, cut in 1-word views (one call each)
        words = B.split(B.int32_tensor([m for m, _ in entries], like=like), [1] * len(entries))
        for word, (_, payload) in zip(words, entries):
            parts += [word, payload]
    return B.cat(parts)


def split_bucket(B, gathered, world_size, members, name="<bucket>"):
    """Split an allgathered bucket into each member's payloads, in rank order.

    Args:
        B: backend. gathered: flat int32 tensor, the allgather of every rank's frame_bucket().
        world_size (int): ranks in the allgather. members (int): tensors in the bucket.
        name (str): the bucket's name, for error messages.
    Returns:
        list (one per member) of lists of payload tensors, in rank order (a rank that sent
        nothing for a member contributes nothing). Each payload is then checked by decode_sum.
    Raises:
        WireFormatError: a malformed segment (names the bucket and the rank).
    """
    total = B.numel(gathered)
    out = [[] for _ in range(members)]
    pos = 0
    for rank in range(world_size):
        if pos + 2 > total:
            _fail(name, rank, "is truncated: no bucket header")
        magic, n = B.to_list(B.slice(gathered, pos, pos + 2))
        if magic != BUCKET_MAGIC:
            _fail(name, rank, f"has bucket header {magic & 0xFFFFFFFF:#010x}, expected "
                              f"{BUCKET_MAGIC:#010x}; are all ranks running the same version?")
        if not 0 <= n <= members:
            _fail(name, rank, f"claims {n} entries for a bucket of {members} tensors")
        pos += 2
        for _ in range(n):
            if pos + 1 > total:
                _fail(name, rank, "is truncated: missing an entry")
            member = B.to_list(B.slice(gathered, pos, pos + 1))[0]
            if not 0 <= member < members:
                _fail(name, rank, f"names member {member} of a bucket of {members} tensors")
            length = _header(B, gathered, pos + 1, total, name, rank)[1]
            if pos + 1 + length > total:
                _fail(name, rank, "is truncated inside an entry")
            out[member].append(B.slice(gathered, pos + 1, pos + 1 + length))
            pos += 1 + length
    if pos != total:
        raise WireFormatError(f"DGC bucket {name!r} has {total - pos} unexpected trailing words "
                              f"after the segment of rank {world_size - 1}")
    return out
