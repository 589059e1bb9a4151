"""What DGC put on the wire: per-step and cumulative counters (`CompressionStats`)."""

__all__ = ["CompressionStats"]


class CompressionStats:
    """Counters of one step (or of a run, when cumulative), for the calling rank.

    Attributes:
        steps (int): training steps counted (1 for a per-step object).
        tensors (int): gradient tensors compressed; sparse_tensors: of which sparsified.
        elements (int): gradient elements, dense count.
        selected (int): elements sent sparsely (top-k entries), summed over tensors.
        wire_bytes (int): bytes this rank put on the wire: sparse payloads (allgather input),
            the 4-byte placeholders of Horovod's allreduce, and the dense allreduce of small tensors.
        dense_bytes (int): bytes a dense fp32 allreduce of the same gradients would carry.
        nonfinite_tensors (int): tensors whose local gradient had NaN/Inf (not accumulated).
        compress_seconds (float): wall time spent in compress (accumulate + select + encode), s.
        density (float): the target density in force at the last compress call.
    """

    __slots__ = ("steps", "tensors", "sparse_tensors", "elements", "selected", "wire_bytes",
                 "dense_bytes", "nonfinite_tensors", "compress_seconds", "density")

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)
        self.compress_seconds = 0.0
        self.density = 1.0

    @property
    def ratio(self):
        """Compression ratio dense_bytes / wire_bytes (float; 0.0 before anything was sent)."""
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else 0.0

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
        return d

    def __repr__(self):
        if not self.steps and not self.tensors:
            return "CompressionStats(no step yet)"      # not "density 1, ratio 0.0x"
        return (f"CompressionStats(steps={self.steps}, tensors={self.tensors}, "
                f"selected={self.selected}/{self.elements}, wire_bytes={self.wire_bytes}, "
                f"dense_bytes={self.dense_bytes}, ratio={self.ratio:.1f}x, "
                f"density={self.density:.6g}, nonfinite_tensors={self.nonfinite_tensors})")
