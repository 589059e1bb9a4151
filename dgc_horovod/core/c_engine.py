"""The C engine: the engine contract (:mod:`dgc_horovod.core.engine`) on CPU tensors, in the
compiled extension ``dgc_horovod.core._kernels`` (``_kernels.c``, built by ``pip install``).

One call into C per bucket: it checks every gradient for NaN/Inf, accumulates (momentum
correction), samples, selects, masks, rounds and encodes every segment of the bucket's flat
buffers, spread over a persistent pool of threads (as many as the backend's
``kernel_threads()``: torch's intra-op threads, 1 on NumPy). Its results are the reference's
(:class:`~dgc_horovod.core.engine.OpsEngine`), bit for bit, including every tie, too few
candidates, NaN and float16 case: the C code follows the same rule
(:mod:`~dgc_horovod.core.sparsify`) and hands nothing back. Decode and the bucket walk of
:func:`~dgc_horovod.core.wire.split_bucket` are one call each too; on a malformed payload the
reference's function runs on the same words to raise its error (naming tensor and rank).

Every constant of the wire format and of the selection rule comes from :mod:`wire` and
:mod:`sparsify` through one ``_kernels.configure`` call at import; the sizes (k, samples, ranks,
capacity, payload words, where each result goes) from the :class:`~dgc_horovod.core.engine.Step`.
``engine.BLOCK`` is compiled into the C code (its loops vectorise on it): when the two differ, the
extension is refused (:func:`available` is False, with a warning).

Set ``DGC_KERNELS=0`` in the environment to keep the C engine off (read at import).
"""
import os
import struct
import warnings
from array import array

from dgc_horovod.core import engine, sparsify, wire
from dgc_horovod.core.engine import Result

try:
    from dgc_horovod.core import _kernels
except ImportError:          # not built (e.g. a source tree without a C compiler)
    _kernels = None

__all__ = ["available", "CEngine", "ENABLED"]

#: ``DGC_KERNELS=0`` (or false / no) keeps the C engine off.
ENABLED = os.environ.get("DGC_KERNELS", "1").strip() not in ("0", "false", "False", "no")

if _kernels is not None and _kernels.BLOCK != engine.BLOCK:
    warnings.warn(f"dgc_horovod: the C engine was compiled for BLOCK = {_kernels.BLOCK}, "
                  f"engine.BLOCK is {engine.BLOCK}: rebuild it (pip install .); it is off")
    _kernels = None
if _kernels is not None:
    _kernels.configure({
        "MAGIC_V3": wire.MAGIC_V3, "BUCKET_MAGIC": wire.BUCKET_MAGIC,
        "HEADER_WORDS": wire.HEADER_WORDS, "ESCAPE": wire.ESCAPE,
        "FLAG_NONFINITE": wire.FLAG_NONFINITE,
        "INDEX_CODES": len(wire.INDEX_ENCODINGS),
        "INDEX_INT32": wire.INDEX_ENCODINGS.index("int32"),
        "INDEX_DELTA16": wire.INDEX_ENCODINGS.index("delta16"),
        "VALUE_CODES": len(wire.VALUE_DTYPES),
        "VALUES_FP32": wire.VALUE_DTYPES.index("float32"),
        "VALUES_FP16": wire.VALUE_DTYPES.index("float16"),
        "MIX_M1": sparsify.MIX_M1, "MIX_M2": sparsify.MIX_M2, "GOLDEN": sparsify.GOLDEN,
        "MIN_BITS": sparsify.MIN_BITS})


def available():
    """True when the compiled C engine is importable and not switched off by ``DGC_KERNELS=0``."""
    return _kernels is not None and ENABLED


# A segment's row of _kernels.compress (R_* in _kernels.c): 13 inputs, then 5 outputs.
_NR, _COUNT, _FINITE, _OVER, _FLUSH, _DROP = 18, 13, 14, 15, 16, 17
_ROW = struct.Struct(f"{_NR}q")


class CEngine:
    """The engine contract on host memory (NumPy arrays, CPU torch tensors), in C."""

    name = "c"
    flat = True

    def __init__(self, B):
        self.B = B

    def _ptr(self, x, what):
        p = self.B.kernel_ptr(x)
        if p is None:
            raise TypeError(f"CEngine: {what} is not a contiguous tensor in host memory")
        return p

    def compress(self, step, us, vs, grads, scales, flat):
        """Steps 1–6 of every segment of a bucket in one C call: the arguments and the
        :class:`~dgc_horovod.core.engine.Result` of :meth:`OpsEngine.compress
        <dgc_horovod.core.engine.OpsEngine.compress>`; ``flat`` = (u, v), the bucket's flat
        buffers (u None with momentum 0), which us and vs are views of."""
        B = self.B
        u, v = flat
        up = 0 if u is None else self._ptr(u, "u")
        vp = self._ptr(v, "v")
        parts, keep, pack, index, bases = [], [], _ROW.pack, step.index, step.bases
        for j, g in enumerate(grads):
            gp = B.kernel_grad_ptr(g)
            if gp is None:                      # not float32 contiguous: a copy that is
                g = B.float32_flat(g)
                keep.append(g)
                gp = self._ptr(g, "a gradient")
            p = step.plans[j]
            parts.append(pack(gp, step.offsets[j], p.n, p.k, p.s, p.ks1, p.ks2, p.cap,
                              bases[j], step.pstarts[j], step.words[j],
                              wire.index_words(p.n, p.k, index), step.starts[j], 0, 0, 0, 0, 0))
        rows = array("q")
        rows.frombytes(b"".join(parts))
        nwords, nentries = step.pstarts[-1], step.starts[-1]
        payload = B.empty(nwords, "int32", like=v)
        sel = B.empty(nentries, "int64", like=v)
        vals = B.empty(nentries, "float32", like=v)
        usent = B.empty(nentries, "float32", like=v) if step.masking else None
        mode = 0 if step.momentum == 0.0 else (2 if step.nesterov else 1)
        scales = array("d", scales)
        _kernels.compress(rows.buffer_info()[0], len(grads), scales.buffer_info()[0], up, vp,
                          B.numel(v), step.momentum, mode, step.masking, step.index == "delta16",
                          step.values == "float16", B.kernel_ptr(payload), nwords,
                          B.kernel_ptr(sel), B.kernel_ptr(vals),
                          0 if usent is None else B.kernel_ptr(usent), nentries,
                          B.kernel_threads())
        return Result(payloads=list(B.split(payload, step.words)),
                      counts=rows[_COUNT::_NR].tolist(),
                      finite=[bool(f) for f in rows[_FINITE::_NR]], sel=sel, vals=vals,
                      usent=usent, fp16=list(zip(rows[_OVER::_NR], rows[_FLUSH::_NR])),
                      dropped=[bool(d) for d in rows[_DROP::_NR]])

    def decode(self, gathered, numel, ranks, out, inv=None, name="<tensor>"):
        """:meth:`OpsEngine.decode <dgc_horovod.core.engine.OpsEngine.decode>` in one C call
        (``gathered``: contiguous int32 words, ``out``: contiguous float32, in host memory).
        Returns True when the step is non-finite (``out`` is then to be discarded); raises the
        reference's :class:`~dgc_horovod.core.wire.WireFormatError` on a malformed payload."""
        B = self.B
        wp, op = B.kernel_words_ptr(gathered), B.kernel_grad_ptr(out)
        if wp is None or op is None:
            raise TypeError("CEngine.decode: the words (int32) and out (float32) must be "
                            "contiguous tensors in host memory")
        if B.numel(out) != numel:               # the reference's ValueError, out untouched
            _reraise(lambda: wire.decode_sum(B, gathered, numel, ranks, name, out=out))
        rc = _kernels.decode(wp, B.numel(gathered), numel, ranks, op, inv is not None,
                             1.0 if inv is None else inv)
        if rc < 0:
            _reraise(lambda: wire.decode_sum(B, gathered, numel, ranks, name))
        return rc == 1

    def split_bucket(self, gathered, world_size, members, name="<bucket>"):
        """:func:`wire.split_bucket <dgc_horovod.core.wire.split_bucket>` (same arguments but
        the backend, same result: views of ``gathered``) from one C walk over the segments."""
        B = self.B
        wp = B.kernel_words_ptr(gathered)
        if wp is None:
            raise TypeError("CEngine.split_bucket: the words must be a contiguous int32 tensor "
                            "in host memory")
        spans = array("q", bytes(24 * max(1, world_size * members)))
        n = _kernels.split_bucket(wp, B.numel(gathered), world_size, members,
                                  spans.buffer_info()[0])
        if n < 0:
            _reraise(lambda: wire.split_bucket(B, gathered, world_size, members, name))
        out = [[] for _ in range(members)]
        for e in range(0, 3 * n, 3):
            out[spans[e]].append(B.slice(gathered, spans[e + 1], spans[e + 1] + spans[e + 2]))
        return out


def _reraise(reference):
    """The C check refused its arguments (malformed words): the reference on the same arguments
    raises the error (its message names the tensor and the rank)."""
    reference()
    raise RuntimeError("dgc_horovod: the C engine rejected words that the reference accepts "
                       "(a bug: please report it)")
