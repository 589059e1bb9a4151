"""What DGC put on and took off the wire: per-step and cumulative counters (`CompressionStats`)."""

__all__ = ["CompressionStats", "ADDED_FIELDS"]

#: Counters added after checkpoint format version 2 was first written: a state dict without them
#: (saved by an earlier dgc_horovod) loads with them at 0.
ADDED_FIELDS = ("received_bytes", "overflowed_entries", "flushed_entries")


class CompressionStats:
    """Counters of one step (or of a run, when cumulative), for the calling rank.

    Attributes:
        steps (int): training steps counted (1 for a per-step object).
        tensors (int): gradient tensors compressed; sparse_tensors: of which sparsified.
        elements (int): gradient elements, dense count.
        selected (int): elements sent sparsely (top-k entries), summed over tensors.
        wire_bytes (int): bytes this rank put on the wire: sparse payloads (allgather input),
            the 4-byte placeholders of Horovod's allreduce, and the dense allreduce of small tensors.
        received_bytes (int): bytes this rank took off the wire: the other ranks' payloads (and
            bucket framing) as Horovod's allgather returns them, plus what Horovod's allreduce
            returns (the placeholders, the dense tensors), counted at the reduced tensor's size
            as wire_bytes counts its input. With N ranks about (N - 1) times the sparse part of
            wire_bytes.
        dense_bytes (int): bytes a dense fp32 allreduce of the same gradients would carry.
        nonfinite_tensors (int): tensors whose local gradient had NaN/Inf (not accumulated).
        overflowed_entries (int): with ``wire_values="float16"``, selected values beyond
            float16's range (|v| >= 65520, which a float16 cast makes ±inf): sent as ±inf, so
            the step's update is non-finite on every rank (see :mod:`dgc_horovod.core.compressor`).
        flushed_entries (int): with ``wire_values="float16"``, non-zero selected values that
            float16 rounds to 0 (|v| <= 2**-25): sent as 0, the value stays in the residual.
        compress_seconds (float): wall time spent in compress (accumulate + select + encode), s.
        density (float): the target density in force at the last compress call.
    """

    __slots__ = ("steps", "tensors", "sparse_tensors", "elements", "selected", "wire_bytes",
                 "dense_bytes", "nonfinite_tensors", "compress_seconds", "density") + ADDED_FIELDS

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)
        self.compress_seconds = 0.0
        self.density = 1.0

    @property
    def ratio(self):
        """Compression ratio of what this rank sent, dense_bytes / wire_bytes (float; 0.0 before
        anything was sent)."""
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else 0.0

    @property
    def received_ratio(self):
        """Compression ratio of what this rank received, dense_bytes / received_bytes (float; 0.0
        before anything was received). With N ranks about ratio / (N - 1) once the sparse
        payloads dominate: size a job's incoming traffic by this one."""
        return self.dense_bytes / self.received_bytes if self.received_bytes else 0.0

    def copy(self):
        out = CompressionStats()
        for k in self.__slots__:
            setattr(out, k, getattr(self, k))
        return out

    def since(self, earlier):
        """Counters accumulated between ``earlier`` (a copy of a cumulative object) and now."""
        out = self.copy()
        for k in self.__slots__:
            if k != "density":
                setattr(out, k, getattr(self, k) - getattr(earlier, k))
        return out

    def to_dict(self):
        d = {k: getattr(self, k) for k in self.__slots__}
        d["ratio"] = self.ratio
        d["received_ratio"] = self.received_ratio
        return d

    def __repr__(self):
        if not self.steps and not self.tensors:
            return "CompressionStats(no step yet)"      # not "density 1, ratio 0.0x"
        fp16 = (f", overflowed_entries={self.overflowed_entries}, "
                f"flushed_entries={self.flushed_entries}"
                if self.overflowed_entries or self.flushed_entries else "")
        return (f"CompressionStats(steps={self.steps}, tensors={self.tensors}, "
                f"selected={self.selected}/{self.elements}, wire_bytes={self.wire_bytes}, "
                f"received_bytes={self.received_bytes}, dense_bytes={self.dense_bytes}, "
                f"ratio={self.ratio:.1f}x, received_ratio={self.received_ratio:.1f}x, "
                f"density={self.density:.6g}, nonfinite_tensors={self.nonfinite_tensors}{fp16})")
