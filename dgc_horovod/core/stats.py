"""What DGC put on and took off the wire: per-step and cumulative counters (`CompressionStats`),
and :class:`StatsRecorder`, which counts them for :class:`~dgc_horovod.core.compressor.DGCCore`.

Statistics observe Algorithm 1 and change nothing in it.
"""

import contextlib

__all__ = ["CompressionStats", "ADDED_FIELDS", "StatsRecorder", "PLACEHOLDER_BYTES"]

#: Bytes of the 1-element float32 placeholder a sparsified tensor sends through the stock allreduce.
PLACEHOLDER_BYTES = 4

#: Counters added after checkpoint format version 2 was first written: a state dict without them
#: (saved by an earlier dgc_horovod) loads with them at 0.
ADDED_FIELDS = ("received_bytes", "overflowed_entries", "flushed_entries", "node_bytes",
                "node_received_bytes", "cross_node_bytes", "cross_node_received_bytes")


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
        nonfinite_tensors (int): tensors whose local gradient had NaN/Inf (not accumulated); with
            ``exchange="hierarchical"``, whose node gradient did (every rank of the node counts
            it, as each compresses its shard of it).
        overflowed_entries (int): with ``wire_values="float16"``, selected values beyond
            float16's range (|v| >= 65520, which a float16 cast makes ±inf): sent as ±inf, so
            the step's update is non-finite on every rank (see :mod:`dgc_horovod.core.precision`).
        flushed_entries (int): with ``wire_values="float16"``, non-zero selected values that
            float16 rounds to 0 (|v| <= 2**-25): sent as 0, the value stays in the residual.
        node_bytes, node_received_bytes (int): ``exchange="hierarchical"``: bytes this rank
            sent and received in DGC's collectives inside its node (the dense allreduce of the
            node's gradient, counted each way at the tensor's size as for Horovod's allreduce,
            and the allgather of the decoded shards: its shard out, the others' in). 0 with the
            other exchanges.
        cross_node_bytes, cross_node_received_bytes (int): ``exchange="hierarchical"``: bytes
            this rank sent to and received from the other nodes: its shard's payloads (the
            allgather input) and the other nodes' payloads of its shard. 0 with the other
            exchanges (there every byte of an allgather crosses nodes or not depending on
            where the ranks run). Both pairs are also in wire_bytes and received_bytes, which
            with this exchange count elements, selected and dense_bytes for this rank's shards;
            Horovod's own allreduce (placeholders, dense tensors) is in those only.
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
        hier = (f", node_bytes={self.node_bytes}/{self.node_received_bytes} (sent/received), "
                f"cross_node_bytes={self.cross_node_bytes}/{self.cross_node_received_bytes}"
                if self.node_bytes or self.cross_node_bytes or self.cross_node_received_bytes
                else "")
        return (f"CompressionStats(steps={self.steps}, tensors={self.tensors}, "
                f"selected={self.selected}/{self.elements}, wire_bytes={self.wire_bytes}, "
                f"received_bytes={self.received_bytes}, dense_bytes={self.dense_bytes}, "
                f"ratio={self.ratio:.1f}x, received_ratio={self.received_ratio:.1f}x, "
                f"density={self.density:.6g}, nonfinite_tensors={self.nonfinite_tensors}, "
                f"compress_seconds={self.compress_seconds:.6g}{fp16}{hier})")


def _allreduced_bytes(st):
    """Bytes Horovod's allreduce carries for tensor st in a step, each way: the 1-element float32
    placeholder of a sparsified tensor, the whole float32 velocity of a dense one."""
    return PLACEHOLDER_BYTES if st.sparse else 4 * st.numel


class StatsRecorder:
    """Counts one worker's compress calls into ``step`` (the current step's CompressionStats) and
    ``total`` (cumulative). Not thread-safe: its owner (DGCCore) holds its lock around every call.

    A row is one compressed tensor: ``(st, selected, wire_bytes, nonfinite, seconds, density,
    (overflowed, flushed))`` with st the TensorState (name, numel, sparse are read). A tensor
    counted again within a step begins a new step; ``names`` holds the tensors counted in the
    current step (the core's warm-up step count follows it too, :meth:`starts_step`).

    Inside :meth:`entry_order` (compress_many) the rows passed to :meth:`count` are kept back;
    :meth:`take` hands them out, so that the caller counts them in entry order.

    An engine on a device leaves its counts there (reading them would make the host wait for the
    device): :meth:`defer` keeps them, and :meth:`resolve` adds them to the statistics they
    belong to when the statistics are read.
    """

    __slots__ = ("step", "total", "names", "_held", "_deferred")

    def __init__(self, step=None, total=None):
        self.step = CompressionStats() if step is None else step
        self.total = CompressionStats() if total is None else total
        self.names = set()      # the tensors counted in the current step
        self._held = None       # compress_many: rows waiting for entry order
        self._deferred = []     # (B, selected, finite, fp16 tensors, the step's CompressionStats)

    def defer(self, B, selected, finite):
        """Counts still on a device, of rows already counted with 0 selected and finite: the
        selected entries and the finite flags of T tensors (1-D tensors), added to the current
        step's and the total statistics by :meth:`resolve`. (Float16 counts are read at once
        for their warnings, and are 0 without float16 wire values.)"""
        self._deferred.append((B, selected, finite, self.step))

    def resolve(self):
        """Add the deferred counts (:meth:`defer`) to the statistics (reads them: waits for the
        device). Returns self."""
        deferred, self._deferred = self._deferred, []
        for B, selected, finite, step in deferred:
            sel, nonfinite = sum(B.to_list(selected)), sum(1 - f for f in B.to_list(finite))
            for s in (step, self.total):
                s.selected += sel
                s.nonfinite_tensors += nonfinite
        return self

    def starts_step(self, name):
        """True when compressing ``name`` now begins a step: it was already counted in this step,
        or nothing was since the recorder was made or :meth:`restart`."""
        return not self.names or name in self.names

    def restart(self):
        """Forget the tensors of the current step: the next one counted begins a new step."""
        self.names = set()

    # ------------------------------------------------------------- rows kept back
    @contextlib.contextmanager
    def entry_order(self, n):
        """Keep back the rows passed to :meth:`count` while the block runs; it receives a list
        of n entries' rows (``()`` each) to fill, from :meth:`take` or :meth:`row`, and
        they are counted, entry after entry, when it ends without an exception."""
        rows = [()] * n
        self._held = []
        try:
            yield rows
        finally:
            self._held = None
        self.count_rows([row for entry in rows for row in entry])

    def take(self):
        """The rows kept back since :meth:`entry_order` began or the last take (and keep back
        the next)."""
        rows, self._held = self._held, []
        return rows

    @staticmethod
    def row(st, selected, payload_bytes, nonfinite, seconds, density, fp16=(0, 0)):
        """The row of a sparsified tensor sent in a payload of ``payload_bytes`` (with the
        placeholder of Horovod's allreduce)."""
        return (st, selected, payload_bytes + PLACEHOLDER_BYTES, nonfinite, seconds, density,
                fp16)

    # ------------------------------------------------------------- counting
    def count(self, st, selected, wire_bytes, nonfinite, seconds, density, fp16=(0, 0)):
        """Count one compressed tensor (kept back while held)."""
        row = (st, selected, wire_bytes, nonfinite, seconds, density, fp16)
        if self._held is not None:           # inside compress_many: counted in entry order
            self._held.append(row)
        else:
            self.count_rows((row,))

    def count_dense(self, st, seconds, density):
        """:meth:`count` of a finite dense tensor (its velocity allreduced: ``4 * numel`` bytes
        each way, nothing selected), the same sums without the general path's per-row work."""
        if self._held is not None:
            self._held.append((st, 0, 4 * st.numel, False, seconds, density, (0, 0)))
            return
        self._enter(st.name)
        n = st.numel
        self._add_totals(1, 0, n, 0, 4 * n, 0, seconds, density, 4 * n, 0, 0)

    def count_rows(self, rows):
        """Add rows (see the class), in order, to the statistics: a tensor seen again in this step
        starts a new step."""
        seg = []
        for row in rows:
            if row[0].name in self.names:          # the rows so far belong to the step before
                self._add_rows(seg)
                seg = []
            self._enter(row[0].name)
            seg.append(row)
        self._add_rows(seg)

    def _enter(self, name):
        """The step rule for one more tensor: a tensor seen again in this step has begun a new
        step; the first tensor of a step starts its statistics."""
        names = self.names
        if name in names:
            names.clear()
        if not names:
            self._new_step()
        names.add(name)

    def add_wire_bytes(self, nbytes, received=0):
        """Bytes sent (and received) outside a tensor's payload (see DGCCore.add_wire_bytes)."""
        for s in (self.step, self.total):
            s.wire_bytes += nbytes
            s.received_bytes += received

    def count_hierarchical(self, node=(0, 0), cross=(0, 0)):
        """Bytes (sent, received) of the hierarchical exchange inside the node and across nodes
        (see DGCCore.count_hierarchical); added to wire_bytes and received_bytes too, but the
        payload sent across nodes, which compress counted there already."""
        for s in (self.step, self.total):
            s.node_bytes += node[0]
            s.node_received_bytes += node[1]
            s.cross_node_bytes += cross[0]
            s.cross_node_received_bytes += cross[1]
            s.wire_bytes += node[0]         # the payload sent across: counted by compress
            s.received_bytes += node[1] + cross[1]

    def count_allgather(self, output_words, input_words):
        """What one allgather of int32 words brought in (see DGCCore.count_allgather)."""
        for s in (self.step, self.total):
            s.received_bytes += 4 * (output_words - input_words)

    def _new_step(self):
        """Statistics for a step that begins now (a fresh ``step``: after a checkpoint load the
        loaded one describes the step before)."""
        self.step = CompressionStats()
        self.step.steps = 1
        self.total.steps += 1

    def _add_rows(self, seg):
        if not seg:
            return
        self._add_totals(len(seg), sum(int(r[0].sparse) for r in seg),
                         sum(r[0].numel for r in seg), sum(r[1] for r in seg),
                         sum(r[2] for r in seg), sum(int(r[3]) for r in seg),
                         sum(r[4] for r in seg), seg[-1][5],
                         sum(_allreduced_bytes(r[0]) for r in seg),
                         sum(r[6][0] for r in seg), sum(r[6][1] for r in seg))

    def _add_totals(self, tensors, sparse, elements, selected, wire_bytes, nonfinite, seconds,
                    density, received, overflowed=0, flushed=0):
        """Add a run of tensors of the current step to ``step`` and ``total`` (received: what
        Horovod's allreduce returns for them, :func:`_allreduced_bytes`)."""
        for s in (self.step, self.total):
            s.tensors += tensors
            s.sparse_tensors += sparse
            s.elements += elements
            s.selected += selected
            s.wire_bytes += wire_bytes
            s.received_bytes += received
            s.dense_bytes += 4 * elements
            s.nonfinite_tensors += nonfinite
            s.overflowed_entries += overflowed
            s.flushed_entries += flushed
            s.compress_seconds += seconds
            s.density = density
