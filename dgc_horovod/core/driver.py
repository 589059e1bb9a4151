"""The bucket driver: :meth:`DGCCore.compress_many`, the steps of one compress run over a
bucket of gradients at once (same results, state, random draws and statistics as one
:meth:`~DGCCore.compress` per tensor, in entry order).

In the order a bucket meets it: :meth:`BucketDriver.compress_many` checks every entry before any
state changes and sorts the entries by path. On the fused CPU path (:mod:`kernels`) the
sparsified tensors in host memory become the rows of one :class:`kernels.Batch` (clipping and
weight decay applied as they are added), one kernel call checks, accumulates, selects and encodes
them all, and the rows it left unfinished, the non-finite ones and the other entries run through
the core's per-tensor steps (``_compress_batch`` when every entry is a row, ``_compress_mixed``
otherwise, ``_batch_results`` to collect). On tensor ops (``use_kernels = False``, CUDA tensors,
TensorFlow) with the default wire format, the bucket's sparsified tensors run as one
:func:`bucket_ops.compress` over their flat u and v (``_compress_ops``, ``_bucket_ops``; the flat
state of a bucket is kept between steps, ``_flat_state``). The results' contexts
(:class:`_BatchContext`) are views of the batch's output buffers (:class:`_Selected` on tensor
ops), which decompress reads only to put the sent entries back after a non-finite step.
"""
import time

from dgc_horovod.core.accumulate import momentum_correction
from dgc_horovod.core.state import SparseContext
from dgc_horovod.core.stats import StatsRecorder
from dgc_horovod.core import bucket_ops, kernels

__all__ = ["BucketDriver"]

sparse_row = StatsRecorder.sparse_row


class BucketDriver:
    """The bucket path of one :class:`~dgc_horovod.core.compressor.DGCCore` (``core``): runs
    its per-tensor steps and keeps the flat state of its buckets on tensor ops. Every method but
    :meth:`compress_many` runs with the core's lock held and its entries checked."""

    def __init__(self, core):
        self.core = core
        self._flats = {}        # names of a bucket's sparsified tensors -> bucket_ops.FlatState

    def compress_many(self, entries, world_size, average, clip_scale):
        """:meth:`DGCCore.compress_many` (see there)."""
        core = self.core
        entries = list(entries)
        if len({e[0] for e in entries}) != len(entries):
            seen = set()
            for name, _, _ in entries:
                if name in seen:
                    raise ValueError(f"compress_many: the tensor {name!r} appears twice")
                seen.add(name)
        core._check_scale(clip_scale)
        for name, _, _ in entries:
            core._fit.check_name(name)
        bucket = (len(entries) > 1 and core.config.wire_index == "delta16"
                  and core.config.wire_values == "float32")
        if not core.use_kernels or len(entries) < 2:
            for name, grad, param in entries:
                core.check_entry(name, grad, param)
            if not bucket:
                return [core.compress(name, grad, world_size, param, average, clip_scale)
                        for name, grad, param in entries]
            t0 = time.perf_counter()
            with core._lock:
                core._begin(entries[0][0])
                return self._compress_ops(entries, world_size, average, clip_scale, t0)
        B = core.B
        t0 = time.perf_counter()
        clip = (average, clip_scale)
        with core._lock:
            core._begin(entries[0][0])
            states = core.states
            numel, grad_ptr = B.numel, B.kernel_grad_ptr
            needs_param = core.needs_param
            # the usual entry: a sparsified tensor with its fused plan and a float32 gradient in
            # host memory (kernel_grad_ptr: contiguous float32) of its size. Anything else is
            # checked in full below, before any state changes, and classified then.
            fused, others = {}, []          # entry index -> (st, plan, g, gp); the other entries
            for i, (name, grad, param) in enumerate(entries):
                st = states.get(name)
                plan = st.plan if st is not None else None
                gp = grad_ptr(grad) if plan and st.sparse else None
                if (gp is not None and plan.u is st.u and plan.v is st.v
                        and st.numel == numel(grad)
                        and not (needs_param and (param is None or numel(param) != st.numel))):
                    fused[i] = (st, plan, grad, gp)
                else:
                    others.append(i)
            check = core.check_entry
            for i in others:
                check(*entries[i])
            for i in others:
                name, grad, _ = entries[i]
                st = states.get(name)
                if st is None:
                    st = core._state(name, grad)
                if not st.sparse:
                    continue
                g = B.float32_view(grad)                 # e.g. float16: a float32 copy
                if not kernels.usable_plan(B, st, g, core.config, core.density,
                                           core.use_kernels):
                    continue
                plan, gp = st.plan, B.kernel_ptr(g)
                if gp is not None:
                    fused[i] = (st, plan, g, gp)
            if others:
                fused = dict(sorted(fused.items()))      # in entry order
            if not fused and bucket:                     # e.g. CUDA tensors: tensor ops
                return self._compress_ops(entries, world_size, average, clip_scale, t0)
            threads = B.kernel_threads()
            # (the batch kernel checks each gradient for NaN/Inf before it changes its state)
            if len(fused) == len(entries):
                return self._compress_batch(entries, fused, world_size, clip, threads, t0)
            return self._compress_mixed(entries, fused, world_size, clip, threads, t0)

    def _compress_batch(self, entries, fused, world_size, clip, threads, t0):
        """compress_many when every entry is in the batch (the usual bucket)."""
        core = self.core
        batch = kernels.Batch(core.B, core.config, core._generator, core.density, threads)
        self._add_rows(batch, zip(entries, fused.values()), world_size, clip)
        batch.run(like=batch.rows[0][0].v)
        seconds = time.perf_counter() - t0
        if batch.all_finished:
            masked, ctx = batch.masking, _BatchContext
            sts = [row[0] for row in batch.rows]
            results = [("sparse", pay, ctx(st.name, st.numel, batch, start, cnt, masked))
                       for st, pay, start, cnt in zip(sts, batch.payloads, batch.starts,
                                                      batch.counts)]
            batch.release()
            core._stats.count_batch(sts, batch.counts, batch.words, seconds, core.density)
            return results
        n = len(entries)
        results = [None] * n
        with core._stats.entry_order(n) as counts:
            self._batch_results(batch, list(range(n)), counts, results, seconds)
        return results

    def _compress_mixed(self, entries, fused, world_size, clip, threads, t0):
        """compress_many when some entries run as in compress (dense, non-finite large, ...)."""
        core = self.core
        results = [None] * len(entries)
        batch = kernels.Batch(core.B, core.config, core._generator, core.density, threads)
        rows = []
        t_other = 0.0                   # time spent on the entries outside the batch
        with core._stats.entry_order(len(entries)) as counts:   # statistics rows per entry
            # in entry order, so the random draws come in the order compress() makes them
            for i, (name, grad, param) in enumerate(entries):
                f = fused.get(i)
                if f is None:
                    batch.draw()                 # the batch rows' draws come first
                    t1 = time.perf_counter()
                    results[i] = core._compress_locked(name, grad, world_size, param, t1, *clip)
                    counts[i] = core._stats.take()
                    t_other += time.perf_counter() - t1
                    continue
                rows.append(i)
                self._add_rows(batch, (((name, grad, param), f),), world_size, clip)
            if rows:
                batch.run(like=batch.rows[0][0].v)
                self._batch_results(batch, rows, counts, results,
                                    time.perf_counter() - t0 - t_other)
        return results

    def _add_rows(self, batch, rows, world_size, clip):
        """Add the fused entries rows = [(entry, (st, plan, g, gp))] to batch (which refreshes
        their plans for its density), clipping (clip = (average, clip_scale)) and weight decay
        applied."""
        core = self.core
        B, c = core.B, core.config
        simple = c.clip_norm is None and not core.needs_param
        add = batch.add
        for (_, _, param), (st, plan, g, gp) in rows:
            scale = 1.0
            if not simple:
                g, scale = core._accumulated(B.float32_view(g), param, world_size, *clip)
                gp = B.kernel_ptr(g)
            add(st, plan, g, gp, scale)

    def _batch_results(self, batch, rows, counts, results, seconds):
        """Fill results[i] and counts[i] (statistics rows) for the batch rows (entry indices
        rows, in batch order) after batch.run(); the rows the kernel left finish here. The
        caller keeps the statistics rows back (StatsRecorder.entry_order) and counts them then."""
        core = self.core
        density, masked = core.density, batch.masking
        share = seconds / sum(row[0].numel for row in batch.rows)
        finished = batch.finished()
        for r, i in enumerate(rows):
            done = finished.get(r)
            if done is None:
                st, plan, thr, cnt = batch.result(r)
                if cnt is None:                              # NaN/Inf: state untouched
                    results[i] = core._nonfinite(st, batch.rows[r][2], time.perf_counter(),
                                                 drawn=True)
                else:
                    idx = kernels.select_rest(core.B, core.config, core._generator, st, plan,
                                              thr, cnt, -1, None)
                    results[i] = core._fused_finish(st, plan, idx, time.perf_counter(),
                                                    density)
                counts[i] = core._stats.take()
                continue
            st = batch.rows[r][0]
            payload, start, count, words = done
            counts[i] = (sparse_row(st, count, words, share * st.numel, density),)
            results[i] = ("sparse", payload, _BatchContext(
                st.name, st.numel, batch, start, count, masked))
        batch.release()                  # the contexts keep only the output buffers

    def _compress_ops(self, entries, world_size, average, clip_scale, t0):
        """compress_many on tensor ops, a bucket at a time (:mod:`bucket_ops`: O(1) backend
        calls for the bucket's sparsified tensors); the dense entries run as in compress. The
        entries are checked and the lock is held."""
        core = self.core
        results = [None] * len(entries)
        sparse = []
        with core._stats.entry_order(len(entries)) as rows:    # statistics rows per entry
            for i, (name, grad, param) in enumerate(entries):
                if core._state(name, grad).sparse:
                    sparse.append(i)
                    continue
                results[i] = core._compress_locked(name, grad, world_size, param,
                                                   time.perf_counter(), average, clip_scale)
                rows[i] = core._stats.take()
            if sparse:
                self._bucket_ops(entries, sparse, results, rows, world_size, average,
                                 clip_scale, t0)
        return results

    def _bucket_ops(self, entries, sparse, results, rows, world_size, average, clip_scale, t0):
        """The sparsified entries (indices ``sparse``) of _compress_ops: one bucket_ops.compress
        over their flat state; fills results[i] and rows[i]."""
        core = self.core
        B, c = core.B, core.config
        sts = [core.states[entries[i][0]] for i in sparse]
        fs = self._flat_state(sts)
        fs.load(B, sts)
        grads, block = [entries[i][1] for i in sparse], bucket_ops.BLOCK
        if c.clip_norm is not None and c.clip_scope == "tensor":   # a scale per tensor
            acc = [core._accumulated(B.float32_view(g), entries[i][2], world_size, average)
                   for g, i in zip(grads, sparse)]
            g, scales = B.flat_cat([a for a, _ in acc], block), [s for _, s in acc]
        else:
            params = (B.flat_cat([entries[i][2] for i in sparse], block) if core.needs_param
                      else None)
            g, scale = core._accumulated(B.flat_cat(grads, block, reuse=True), params,
                                         world_size, average, clip_scale)
            scales = [scale]
        segments = [(a, a + n) for a, n in zip(fs.offsets, fs.sizes)]
        finite = ([True] * len(sts) if B.all_finite(g)
                  else [B.all_finite(B.slice(g, a, b)) for a, b in segments])
        if not (all(finite) and len(set(scales)) == 1):   # accumulate segment by segment
            for st, (a, b), ok, s in zip(sts, segments, finite, scales * len(sts)
                                         if len(scales) == 1 else scales):
                if ok:
                    momentum_correction(B, st.u, st.v, B.slice(g, a, b), c.momentum,
                                        c.nesterov, s)
            fs.load(B, sts)
            g = None
        density = core.density
        payloads, words, counts, local, vals, u_sent = bucket_ops.compress(
            B, c, core._generator, density, fs, g, scales[0], finite)
        fs.store(B, sts)
        share = (time.perf_counter() - t0) / sum(fs.sizes)
        selected = _Selected(B, local, vals, u_sent)
        masked = u_sent is not None
        start = 0
        for i, st, payload, w, cnt in zip(sparse, sts, payloads, words, counts):
            if payload is None:                             # NaN/Inf: state untouched
                results[i] = core._nonfinite(st, None, time.perf_counter(), drawn=True)
                rows[i] = core._stats.take()
                continue
            results[i] = ("sparse", payload, _BatchContext(st.name, st.numel, selected, start,
                                                           cnt, masked))
            rows[i] = (sparse_row(st, cnt, w, share * st.numel, density),)
            start += cnt

    def _flat_state(self, sts):
        """The bucket_ops.FlatState of these tensors (made, and the tensors' state moved into
        it, when they are new or their state was replaced)."""
        core = self.core
        key = tuple(st.name for st in sts)
        fs = self._flats.get(key)
        if fs is None or not fs.holds(sts):
            fs = bucket_ops.FlatState(core.B, sts)
            self._flats = {k: f for k, f in self._flats.items() if set(key).isdisjoint(k)}
            self._flats[key] = fs
        return fs


class _BatchContext(SparseContext):
    """A SparseContext of :meth:`DGCCore.compress_many` whose indices, values and u_sent are
    views of the batch's buffers, made when first read (decompress reads them only to restore
    the residual after a non-finite step)."""

    __slots__ = ("_batch", "_start", "_count", "_masked", "_views")

    def __init__(self, name, numel, batch, start, count, masked):
        self.name, self.numel = name, numel
        self._batch, self._start, self._count, self._masked = batch, start, count, masked
        self._views = None

    def _get(self, i):
        if self._views is None:
            self._views = self._batch.views(self._start, self._count, self._masked)
        return self._views[i]

    indices = property(lambda self: self._get(0))
    values = property(lambda self: self._get(1))
    u_sent = property(lambda self: self._get(2))


class _Selected:
    """What the contexts of one bucket_ops call view (see _BatchContext): the positions sent
    (local to each tensor), their values and velocities, segment after segment."""

    __slots__ = ("B", "local", "vals", "usent")

    def __init__(self, B, local, vals, usent):
        self.B, self.local, self.vals, self.usent = B, local, vals, usent

    def views(self, start, count, masked):
        B, end = self.B, start + count
        return (B.slice(self.local, start, end), B.slice(self.vals, start, end),
                B.slice(self.usent, start, end) if masked else None)
