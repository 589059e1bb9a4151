"""The bucket driver: :meth:`DGCCore.compress_many` (and so :meth:`DGCCore.compress`, a bucket of
one), the core's steps around an engine (:mod:`dgc_horovod.core.engine`).

In order, for a bucket of entries (name, gradient, parameter):

1. check every entry (what :meth:`DGCCore.check_entry` raises) before any state changes;
2. the step begins (:meth:`DGCCore._begin`: warm-up position, step statistics);
3. the dense entries (not sparsified, :func:`~dgc_horovod.core.sparsify.is_sparse`) run the
   core's dense path (their momentum-corrected velocity goes to Horovod's allreduce);
4. the sparsified ones: clipping factor and accumulated weight decay applied
   (:meth:`DGCCore._accumulated`), then ONE engine call for all of them (:meth:`BucketDriver.
   engine_for` chooses the engine; the engines that work on flat buffers get the bucket's
   :class:`~dgc_horovod.core.engine.FlatState`, kept from step to step);
5. the results, their contexts (:class:`EntryContext`, what decompress puts back after a
   non-finite step) and the statistics rows, in entry order.
"""
import time

from dgc_horovod.core import precision
from dgc_horovod.core.engine import FlatState, OpsEngine, make_step
from dgc_horovod.core.state import SparseContext
from dgc_horovod.core.stats import StatsRecorder

__all__ = ["BucketDriver", "EntryContext"]


class BucketDriver:
    """The bucket path of one :class:`~dgc_horovod.core.compressor.DGCCore` (``core``): its
    engines and the flat state of its buckets."""

    def __init__(self, core):
        self.core = core
        self._flats = {}        # names of a bucket's sparsified tensors -> FlatState
        self._steps = {}        # the same names -> (density, Step, the tensors' sample seeds)
        self._checked = set()   # the buckets decode_bucket has decoded once (checked then)
        self._deferred = {}     # bucket name -> its last unread decode check (check_deferred)

    # ------------------------------------------------------------------ engines
    def engine_for(self, like, out=None):
        """The engine for a bucket whose tensors are like ``like`` (config ``engine``): "auto"
        takes the C kernels for tensors in host memory (:meth:`Backend.kernel_ptr`), the
        Triton kernels for device tensors (:meth:`Backend.device_engine`), tensor ops
        otherwise. ``out``: a second tensor the engine must reach as well (decode's output)."""
        core = self.core
        B, choice = core.B, core.config.engine
        if choice == "ops":
            return core._engines.setdefault("ops", OpsEngine(B))
        host = B.kernel_ptr(like) is not None and (out is None or B.kernel_ptr(out) is not None)
        if choice in ("auto", "c") and host:
            from dgc_horovod.core import c_engine
            if c_engine.available():
                return core._engines.setdefault("c", c_engine.CEngine(B))
            if choice == "c":
                raise ValueError("DGC(engine='c'): the C kernels (dgc_horovod.core._kernels) "
                                 "are not built or DGC_KERNELS=0 disabled them; reinstall "
                                 "with a C compiler, or use engine='auto'")
        if choice == "c":
            raise ValueError("DGC(engine='c') runs on tensors in host memory; these are on "
                             f"{B.device_name(like)}: use engine='auto'")
        if choice == "triton" or (choice == "auto" and not host):
            engine = core._engines.get("triton")
            if engine is None:
                engine = B.device_engine(like, required=choice == "triton")
                if engine is not None:
                    core._engines["triton"] = engine
            if engine is not None:
                return engine
        return core._engines.setdefault("ops", OpsEngine(B))

    def flat_state(self, sts):
        """The FlatState of these tensors (made, and the tensors' state moved into it, when they
        are new or their state was replaced)."""
        key = tuple(st.name for st in sts)
        fs = self._flats.get(key)
        if fs is None or not fs.holds(sts):
            fs = FlatState(self.core.B, sts)
            self._flats = {k: f for k, f in self._flats.items() if set(key).isdisjoint(k)}
            self._flats[key] = fs
        return fs

    # ------------------------------------------------------------------ compress
    def compress_many(self, entries, world_size, average, clip_scale):
        """:meth:`DGCCore.compress_many` (see there)."""
        core = self.core
        entries = list(entries)
        if len(entries) > 1 and len({e[0] for e in entries}) != len(entries):
            seen = set()
            for name, _, _ in entries:
                if name in seen:
                    raise ValueError(f"compress_many: the tensor {name!r} appears twice")
                seen.add(name)
        for name, grad, param in entries:                                   # 1.
            core.check_entry(name, grad, param)
        core._check_scale(clip_scale)
        t0 = time.perf_counter()
        with core._lock:
            core._begin(entries[0][0])                                      # 2.
            sts = [core._state(name, grad) for name, grad, _ in entries]
            if not any(st.sparse for st in sts):        # counted as they come: entry order
                return [core._compress_dense(st, grad, world_size, param, time.perf_counter(),
                                             average, clip_scale)
                        for st, (_, grad, param) in zip(sts, entries)]
            results = [None] * len(entries)
            sparse = []
            with core._stats.entry_order(len(entries)) as rows:
                for i, (st, (name, grad, param)) in enumerate(zip(sts, entries)):
                    if st.sparse:
                        sparse.append(i)
                        continue
                    results[i] = core._compress_dense(st, grad, world_size, param,   # 3.
                                                      time.perf_counter(), average, clip_scale)
                    rows[i] = core._stats.take()
                deferred = self._compress_sparse(entries, sparse, results, rows, world_size,
                                                 average, clip_scale, t0)
            if deferred:
                core._stats.defer(*deferred)
        return results

    def _compress_sparse(self, entries, sparse, results, rows, world_size, average, clip_scale,
                         t0):
        """Step 4–5 for the sparsified entries (indices ``sparse``): fills results[i], rows[i].
        Returns the arguments of StatsRecorder.defer when the engine left its counts on a
        device, else None."""
        core = self.core
        B = core.B
        sts = [core.states[entries[i][0]] for i in sparse]
        grads, scales = [], []
        for i in sparse:
            g, s = core._accumulated(B.float32_view(entries[i][1]), entries[i][2], world_size,
                                     average, clip_scale)
            grads.append(g)
            scales.append(float(s))
        engine = self.engine_for(sts[0].v)
        if engine.flat:
            fs = self.flat_state(sts)
            us, vs, flat = fs.segments() + ((fs.u, fs.v),)
        else:
            us, vs, flat = [st.u for st in sts], [st.v for st in sts], None
        density = core.density
        step = self._step(sts, density)
        res = engine.compress(step, us, vs, grads, scales, flat)
        share = (time.perf_counter() - t0) / sum(step.sizes)
        row = StatsRecorder.row
        # an engine on a device leaves its counts there: the statistics get them when they are
        # read (returned for StatsRecorder.defer); the float16 warnings need theirs now
        lazy = not isinstance(res.counts, list)
        fp16 = res.fp16
        if not isinstance(fp16, list):
            pairs = B.to_list(fp16.reshape(-1)) if step.values == "float16" else None
            fp16 = (list(zip(pairs[0::2], pairs[1::2])) if pairs is not None
                    else [(0, 0)] * len(sts))
        for j, (i, st) in enumerate(zip(sparse, sts)):
            for key, message in precision.warning(st.name, *fp16[j]):
                core._warn_once(key, message)
            results[i] = ("sparse", res.payloads[j],
                          EntryContext(st.name, st.numel, B, res, step, j))
            rows[i] = (row(st, 0 if lazy else res.counts[j], 4 * step.words[j],
                           not lazy and not res.finite[j], share * st.numel, density, fp16[j]),)
        if not lazy:
            return None
        return B, res.counts, res.finite

    # ------------------------------------------------------------------ decompress
    def decompress_bucket(self, gathered, world_size, name, contexts, average):
        """:meth:`DGCCore.decompress_bucket` on an engine that decodes a whole bucket on its
        device (``decode_bucket``), or None when it does not apply: another engine, another
        exchange than allgather, or contexts of more than one engine call."""
        core = self.core
        ctxs = [c for c, _ in contexts.values()]
        if (not ctxs or core.config.exchange != "allgather"
                or not all(isinstance(c, EntryContext) for c in ctxs)):
            return None
        res, step = ctxs[0]._res, ctxs[0]._step
        engine = self.engine_for(gathered)
        order = sorted(contexts)
        if (not hasattr(engine, "decode_bucket") or any(c._res is not res for c in ctxs)
                or [contexts[m][0]._j for m in order] != list(range(len(step.sizes)))):
            return None
        B = core.B
        fs = self._flats.get(step.names)
        flat = (fs.u, fs.v) if fs is not None else None
        out = B.empty(step.offsets[-1], "float32", like=gathered)
        inv = 1.0 / world_size if average and world_size > 1 else None
        args = (step, gathered, world_size, out)
        kw = dict(inv=inv, members=order, result=res, flat=flat, name=name)
        nonfinite, error = engine.decode_bucket(*args, **kw)
        check = (lambda: engine.check_bucket(*args, error, **kw))
        if name not in self._checked or core.skip_nonfinite_steps:     # read now
            self._checked.add(name)
            redone = check()
            if redone is not None:
                nonfinite = redone
        else:                                 # read when DGC next reads its device counters
            self._deferred[name] = check
        dense = {m: B.slice(out, a, a + n)
                 for m, a, n in zip(order, step.offsets, step.sizes)}
        if core.skip_nonfinite_steps:         # a loss scaler: it reads the step's flags anyway
            flags = nonfinite if isinstance(nonfinite, list) else B.to_list(nonfinite)
            if any(flags):
                with core._lock:
                    core._skip_step()
            for m, bad in zip(order, flags):
                if not bad:
                    core._keep_sent(contexts[m][0], dense[m])
        return dense

    def check_deferred(self):
        """Run the decode checks :meth:`decompress_bucket` deferred (reads the device)."""
        checks, self._deferred = self._deferred, {}
        for check in checks.values():
            check()

    def _step(self, sts, density):
        """The engine's Step for these tensors at ``density`` and the core's step count: its
        sizes are kept while the density stays (the warm-up changes it a few times), the
        samples' bases follow the step."""
        core = self.core
        key = tuple(st.name for st in sts)
        kept = self._steps.get(key)
        if kept is None or kept[0] != density:
            kept = self._steps[key] = (density, make_step(
                core.config, key, [st.numel for st in sts], density, 0, [st.key for st in sts]))
        return kept[1].at(core.steps)


class EntryContext(SparseContext):
    """A SparseContext of :meth:`DGCCore.compress_many` whose indices, values and u_sent are
    views of an engine Result's buffers, made when first read (decompress reads them only to put
    the entries back after a non-finite step: an engine on a device keeps its counts there until
    then). indices is None when nothing can be put back: the tensor's gradient was non-finite
    (nothing was sent) or its state was dropped (a float16 overflow)."""

    __slots__ = ("_B", "_res", "_step", "_j", "_views")

    def __init__(self, name, numel, B, res, step, j):
        self.name, self.numel = name, numel
        self._B, self._res, self._step, self._j = B, res, step, j
        self._views = None

    def _get(self, i):
        if self._views is None:
            res, j = self._res, self._j
            if not res.finite[j] or res.dropped[j]:
                self._views = (None, None, None)
            else:
                self._views = res.entries(self._B, self._step, j, int(res.counts[j]))
        return self._views[i]

    indices = property(lambda self: self._get(0))
    values = property(lambda self: self._get(1))
    u_sent = property(lambda self: self._get(2))
