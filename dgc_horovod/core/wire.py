"""Wire format of one rank's sparse contribution, and the rank-ordered decode (sum).

Format ``DGC v1`` — one flat int32 tensor per gradient tensor per rank (native byte order; Horovod
allgather concatenates the ranks' tensors in rank order)::

    word 0              MAGIC_V1 = 0x44474301   ('D' 'G' 'C' + format version 1)
    word 1              numel    elements of the dense tensor (0 < numel < 2**31)
    word 2              count    c, entries sent by this rank (0 <= c <= numel)
    word 3              flags    bit 0 (FLAG_NONFINITE): this rank's gradient had NaN/Inf and
                                 sent nothing; every rank then discards the step for this tensor
    words 4 .. 4+c-1    indices  int32 positions in the flattened tensor, unique, unordered
    words 4+c .. 4+2c-1 values   IEEE-754 float32 bit patterns of the sent entries

Size: HEADER_BYTES + 8·c bytes (16 + 8c). A rank that sends nothing still sends its 16-byte header.
"""

__all__ = ["MAGIC_V1", "FLAG_NONFINITE", "HEADER_WORDS", "HEADER_BYTES", "MAX_NUMEL",
           "encode", "decode_sum", "payload_bytes", "WireFormatError"]

MAGIC_V1 = 0x44474301
FLAG_NONFINITE = 1
HEADER_WORDS = 4
HEADER_BYTES = 4 * HEADER_WORDS
MAX_NUMEL = 2 ** 31 - 1


class WireFormatError(ValueError):
    """A received payload does not follow the DGC wire format (names tensor and rank)."""


def payload_bytes(count):
    """Bytes one rank puts on the wire for a tensor when it sends ``count`` entries."""
    return HEADER_BYTES + 8 * count


def check_numel(numel, name):
    """Raise ValueError if a tensor of ``numel`` elements cannot be indexed by int32 words."""
    if numel > MAX_NUMEL:
        raise ValueError(f"tensor {name!r} has {numel} elements; the DGC v1 wire format indexes "
                         f"at most {MAX_NUMEL} (int32). Split the parameter or keep it dense.")


def encode(B, numel, indices, values, flags=0):
    """Build one rank's payload.

    Args:
        B: backend. numel (int): elements of the dense tensor.
        indices: int64 tensor (c,), unique positions. values: float32 tensor (c,).
        flags (int): FLAG_* bits.
    Returns:
        flat int32 tensor of HEADER_WORDS + 2c words.
    """
    c = B.numel(indices)
    header = B.int32_tensor([MAGIC_V1, numel, c, flags], like=values)
    return B.cat([header, B.to_int32(indices), B.float32_bits(values)])


def decode_sum(B, gathered, numel, world_size, name="<tensor>"):
    """Sum the sparse contributions of all ranks into a dense float32 tensor, in rank order.

    Every rank runs the same additions in the same order (rank 0 first), so the result is
    bit-identical on all ranks.

    Args:
        B: backend. gathered: flat int32 tensor, the allgather of every rank's :func:`encode`.
        numel (int): elements of the dense tensor. world_size (int): ranks in the allgather.
        name (str): tensor name, used in error messages.
    Returns:
        (dense, nonfinite): flat float32 tensor of numel elements (the sum, not the mean), and
        True if any rank flagged a non-finite gradient.
    Raises:
        WireFormatError: wrong magic/version, wrong numel, truncated or over-long payload, or an
            index out of range; the message names the tensor and the rank.
    """
    total = B.numel(gathered)
    dense = B.zeros(numel, like=gathered)
    nonfinite = False
    pos = 0
    for rank in range(world_size):
        if pos + HEADER_WORDS > total:
            raise WireFormatError(f"DGC payload of tensor {name!r} is truncated: rank {rank} has "
                                  f"no complete header ({total - pos} of {HEADER_WORDS} words left)")
        magic, n, c, flags = B.to_list(B.slice(gathered, pos, pos + HEADER_WORDS))
        if magic != MAGIC_V1:
            raise WireFormatError(f"DGC payload of tensor {name!r} from rank {rank} has header "
                                  f"{magic:#010x}, expected {MAGIC_V1:#010x} (DGC wire format v1); "
                                  "are all ranks running the same dgc_horovod version?")
        if n != numel:
            raise WireFormatError(f"DGC payload of tensor {name!r} from rank {rank} describes "
                                  f"{n} elements, this rank has {numel}: the models differ")
        if not 0 <= c <= numel:
            raise WireFormatError(f"DGC payload of tensor {name!r} from rank {rank} claims "
                                  f"{c} entries for a tensor of {numel} elements")
        start, end = pos + HEADER_WORDS, pos + HEADER_WORDS + 2 * c
        if end > total:
            raise WireFormatError(f"DGC payload of tensor {name!r} from rank {rank} is truncated: "
                                  f"{c} entries need {2 * c} words, {total - start} left")
        nonfinite |= bool(flags & FLAG_NONFINITE)
        if c:
            idx = B.slice(gathered, start, start + c)
            lo, hi = B.min_max(idx)
            if lo < 0 or hi >= numel:
                raise WireFormatError(f"DGC payload of tensor {name!r} from rank {rank} has index "
                                      f"{lo if lo < 0 else hi} outside [0, {numel})")
            B.index_add_(dense, idx, B.bits_float32(B.slice(gathered, start + c, end)))
        pos = end
    if pos != total:
        raise WireFormatError(f"DGC payload of tensor {name!r} has {total - pos} unexpected "
                              f"trailing words after the payload of rank {world_size - 1} "
                              f"(the last of {world_size} ranks)")
    return dense, nonfinite
