"""How the PyTorch adapter moves payloads: Horovod allgather (or, with ``exchange="regions"``,
an alltoall and an allgather), one per tensor or one per bucket.

Buckets (``DGCConfig.bucket_numel > 0``): the optimizer's parameters, in reverse registration
order (roughly the order backward produces their gradients), are cut into consecutive groups of
about ``bucket_numel`` dense elements. The plan depends only on the model, so it is the same on
every rank. A sparsified gradient is recorded in its bucket when Horovod hands it to
``compress``; when the bucket's last sparsified member has arrived (members below
``min_sparse_numel`` go through Horovod's dense allreduce and are not waited for), the recorded
gradients are compressed in one ``DGCCore.compress_many`` call, in member order, and the
bucket's allgather (named ``dgc.bucket.<first member's name>``) starts, overlapping with the
rest of backward. A bucket still incomplete when Horovod synchronizes (a parameter without a
compressed gradient this step) is compressed and started then.
The plan is :func:`dgc_horovod.core.buckets.plan_buckets`; the framing is
:func:`dgc_horovod.core.wire.frame_bucket`.

Global clipping (``clip_norm`` with ``clip_scope="global"``, the paper's rule) needs the norm over
all of a rank's gradients of the step before any of them is accumulated. The exchange is then
*gated*: every gradient of the step, dense ones included, is recorded; when the last one
arrives (or at synchronize), the rank's clipping factor is computed over all of them in plan
order (``DGCCore.clip_scale``; with ``clip_scope="sketch"`` from every rank's ``DGCCore.sketch``
allgathered as ``dgc.clip.sketch``, ``DGCCore.clip_scale_of_sketches``: the same factor on every
rank), the buckets are compressed in plan order and allgathered, and
the dense tensors' velocities go out by DGC's own ``hvd.allreduce_async`` (Horovod's allreduce
then carries a 1-element placeholder for them too). The cost: no bucket starts before backward
ends, so exchange no longer overlaps with backward. When the plan is made (the first
step), the ranks compare their trainable parameters once and raise a ValueError naming the first
difference, instead of hanging on collectives that never match.

The region exchange (``exchange="regions"``, the algorithm and its equations:
:mod:`dgc_horovod.core.regions`) replaces each allgather by two collectives, with the same
bucket plan, the same compress calls and the same gated mode:

1. scatter: each payload is cut into N region payloads (``regions.split_payload``: None where
   the rank has no entry in a region); rank j is sent, by one ``hvd.alltoall_async`` with splits
   (named like the allgather it replaces), the frame (``wire.frame_bucket``) of the members'
   parts j that exist, or nothing. Per-tensor mode frames too (a bucket of one tensor).
2. reduce and share: when the first result of a step is asked for, every alltoall started so
   far is waited for in the order they started; for each one this rank reduces its region of
   every member some rank sent a part of (``DGCCore.reduce_region``, the parts in rank order),
   frames the reduced payloads that are not empty (the frame goes out even when it holds none)
   and starts their allgather (``dgc.kept.<bucket or tensor name>``) before it waits for the
   next alltoall, so the second phases of all buckets overlap.
3. every rank decodes the owners' payloads of a tensor (``DGCCore.decompress`` with the
   ``dropped`` sums of the region it owns), bit-identical everywhere.

Waiting: every result of DGC's own collectives is waited for by :func:`_wait`, which polls
and sleeps (:data:`WAIT_SLEEP`) instead of spinning in ``hvd.synchronize``.

Statistics: ``wire_bytes`` counts what this rank sent to the other ranks in the alltoall plus its
allgather input (instead of its whole payload), ``received_bytes`` the alltoall's output but this
rank's own part plus the allgather's output but its own input (and Horovod's allreduce, as
always).
"""
import os
import threading
import time
import weakref

import horovod.torch as hvd
import torch

from dgc_horovod.adapter import check_same_model
from dgc_horovod.core import PLACEHOLDER_BYTES, regions, wire
from dgc_horovod.core.buckets import plan_buckets
from dgc_horovod.torch.params import reduced_parameters

__all__ = ["Exchange", "Pending"]

#: Seconds DGC sleeps between polls of one of its own collectives that is still in flight
#: (``DGC_WAIT_SLEEP=<seconds>`` in the environment, read at import; 0: wait in Horovod's
#: ``hvd.synchronize`` from the start, as before 2026-12-03).
def wait_sleep(environ=os.environ):
    """:data:`WAIT_SLEEP` from ``DGC_WAIT_SLEEP`` in ``environ`` (default 0.0002 s); a ValueError
    that names the variable for anything but a finite number of seconds >= 0."""
    text = environ.get("DGC_WAIT_SLEEP", "0.0002")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise ValueError(f"DGC_WAIT_SLEEP must be a number of seconds >= 0 (0: wait in "
                         f"hvd.synchronize), got {text!r}")
    return value


WAIT_SLEEP = wait_sleep()


def _wait(handle):
    """``hvd.synchronize(handle)``, but while the collective is in flight poll it and sleep
    :data:`WAIT_SLEEP` seconds between polls: Horovod 0.28's wait loops on
    ``std::this_thread::yield()``, so a rank that waits keeps a CPU busy that the other ranks
    (and Horovod's background thread, which does the work) may need. The result, and any error,
    still come from ``hvd.synchronize`` (a poll that raises, e.g. on a handle a reset cleared,
    leaves it to synchronize to raise Horovod's error)."""
    if WAIT_SLEEP > 0:
        poll, sleep = hvd.poll, time.sleep
        try:
            while not poll(handle):
                sleep(WAIT_SLEEP)
        except Exception:
            pass
    return hvd.synchronize(handle)


class Pending:
    """ctx of a sparsified tensor between compress and decompress (and, in gated mode, of a
    dense one: ``dense=True``).

    In bucketed mode ``handle`` (the exchange ticket) and ``core_ctx`` (the core's
    SparseContext) are filled in by the exchange, the latter when the bucket is compressed.
    ``out``: the gradient itself when decompress may write the result into its storage (float32,
    contiguous, sparsified; compress has consumed it by then), else None.
    """

    __slots__ = ("handle", "core_ctx", "shape", "dtype", "world_size", "average", "name",
                 "param", "dense", "out")

    def __init__(self, handle, core_ctx, shape, dtype, world_size, average, name=None,
                 param=None, dense=False, out=None):
        self.handle, self.core_ctx, self.shape, self.dtype = handle, core_ctx, shape, dtype
        self.world_size, self.average = world_size, average
        self.name, self.param, self.dense, self.out = name, param, dense, out


class _Launch:
    """One bucket's sparsified gradients of one step, and its allgather once started.

    ``entries`` maps a member index to (name, gradient, parameter, [pending ctxs]) until the
    launch is compressed (the tensors are kept alive until then); ``contexts`` then maps it to
    (the core's context, the gradient's storage for the result or None); ``handle`` is the
    allgather; ``decoded`` {member: update} once received (``DGCCore.decompress_bucket``);
    ``error`` what compressing or starting it raised, if it failed.
    """

    __slots__ = ("entries", "contexts", "world_size", "average", "handle", "decoded", "error",
                 "words")

    def __init__(self):
        self.entries, self.world_size, self.average = {}, None, True
        self.contexts = self.handle = self.decoded = self.error = None
        self.words = 0          # int32 words of this rank's segment (the allgather's input)


class _Regions:
    """One region exchange (``exchange="regions"``) of a bucket (in per-tensor mode, a bucket of
    one tensor): its alltoall (``scatter``), then its allgather (``share``).

    ``names`` / ``numels``: every member of the bucket (the frames' member indices refer to
    them); ``dropped``: {member: what this rank's reduce dropped}; ``parts``: per member, the
    owners' reduced payloads in rank order, once the allgather is received (``empty``: a
    0-word tensor for a member no owner sent); ``words``: int32 words of this rank's allgather
    input; ``error``: what advancing it raised, if it failed.
    """

    __slots__ = ("name", "names", "numels", "process_set", "scatter", "share", "words",
                 "dropped", "parts", "empty", "error")

    def __init__(self, name, names, numels, process_set):
        self.name, self.names, self.numels = name, names, numels
        self.process_set = process_set
        self.scatter = self.share = self.parts = self.empty = self.error = None
        self.words, self.dropped = 0, {}


class _Gate:
    """One step's gradients in gated mode (global clipping): ``arrived`` names; ``dense`` the
    dense tensors' (name, grad, param, pending) until the step is launched; ``launched``."""

    __slots__ = ("arrived", "dense", "launched", "process_set", "average", "opt")

    def __init__(self):
        self.arrived, self.dense, self.launched = {}, [], False
        self.process_set, self.average, self.opt = None, True, None


class _Bucket:
    """``members``: every trainable parameter of the bucket, by name (the plan, what the frame's
    member indices refer to); ``expected``: how many of them are sparsified, i.e. send a payload
    (the others go through Horovod's dense allreduce and never join the bucket)."""

    __slots__ = ("name", "members", "expected", "current", "numels")

    def __init__(self, name, members, expected, numels):
        self.name, self.members, self.expected = name, members, expected
        self.numels = numels            # the members' elements, for the region exchange
        self.current = _Launch()


_MISMATCH = ("trainable parameter #{i} (from the last) is {a} on rank {me} but {b} on rank {rank}",
             "rank {me} has {n} trainable parameters, rank {rank} has {m}{detail} (a parameter "
             "frozen or missing on one rank?)")


def _check_same_model(opt, params, config):
    """:func:`dgc_horovod.adapter.check_same_model` for the trainable parameters (name, size,
    dtype; in plan order) and the DGC ``config``, with two allgathers."""
    ps = opt.process_set

    def gather(data):
        sizes = hvd.allgather(torch.tensor([len(data)]), name="dgc.check_model.sizes",
                              process_set=ps).tolist()
        every = hvd.allgather(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                              name="dgc.check_model", process_set=ps)
        return sizes, bytes(every.tolist())

    signature = [[opt._parameter_names[p], f"{p.numel()} elements, {p.dtype}"] for p in params]
    check_same_model(signature, gather, ps.rank(), _MISMATCH, config)


class Exchange:
    """Sends each rank's payloads by Horovod allgather and hands back what every rank sent.

    Per-tensor mode (``bucket_numel=0``): :meth:`send` starts the allgather of a payload the
    caller compressed. Bucketed mode: :meth:`defer` records a sparsified gradient in its bucket;
    when the bucket's last sparsified member arrives, or when :meth:`receive` finds the bucket
    incomplete at synchronize time, the recorded gradients are compressed in one
    ``DGCCore.compress_many`` call (in member order), framed and allgathered.

    Args:
        core (DGCCore): compresses the buckets; its backend; counts framing bytes in the stats.
        bucket_numel (int): dense elements per bucket; 0 = one allgather per tensor.
    """

    def __init__(self, core, bucket_numel):
        self._core, self._bucket_numel = core, bucket_numel
        self._plans = {}     # id(optimizer) -> (optimizer, {name: (bucket, member)}, [names])
        self._compared = weakref.WeakSet()      # the optimizers whose models were compared
        self._lock = threading.Lock()
        self._outstanding = 0            # tensors sent or deferred whose result was not received
        self.gated = core.needs_clip_scale
        self._gate = _Gate()
        self.regions = core.config.exchange == "regions"
        self._scattering = []            # region exchanges whose alltoall is not received yet

    @property
    def bucketed(self):
        """True when sparsified tensors travel in buckets (bucket_numel > 0, or gated: with
        bucket_numel 0 every tensor is then a bucket of its own)."""
        return self._bucket_numel > 0 or self.gated

    def check_between_steps(self, what, when):
        """RuntimeError when a step is in progress, i.e. between a tensor's send (or defer, or
        :meth:`hold`) and its receive (or :meth:`release`); from backward() to optimizer.step()
        the residuals already hold this step's accumulation, the model not."""
        if not self.idle:
            raise RuntimeError(f"DGC: {what} in the middle of a step (between loss.backward() and "
                               f"optimizer.step(): the residuals already hold this step's "
                               f"gradient, the parameters do not yet); {when}")

    @property
    def idle(self):
        """True between steps: every tensor sent (or deferred, or held) has been received."""
        return self._outstanding == 0

    def hold(self):
        """A dense tensor was compressed (its velocity updated) and is on Horovod's allreduce."""
        with self._lock:
            self._outstanding += 1

    def release(self):
        """That dense tensor's result was received."""
        with self._lock:
            self._outstanding -= 1

    def check_model(self, opt):
        """At ``opt``'s first gradient, in every mode: the ranks' models and DGC settings
        compared (:func:`_check_same_model`), once per optimizer."""
        if opt not in self._compared:
            _check_same_model(opt, reduced_parameters(opt)[::-1], self._core.config)
            self._compared.add(opt)

    def _plan(self, opt):
        entry = self._plans.get(id(opt))
        if entry is None or entry[0] is not opt:
            params = reduced_parameters(opt)[::-1]      # compared by check_model already
            names = [opt._parameter_names[p] for p in params]
            plan, numel = {}, {n: p.numel() for n, p in zip(names, params)}
            for members, sparse in plan_buckets([(n, p.numel(), p.dim())
                                                 for n, p in zip(names, params)],
                                                self._bucket_numel, self._core.config):
                bucket = _Bucket("dgc.bucket." + members[0], members, sum(sparse),
                                 [numel[n] for n in members])
                plan.update({n: (bucket, m) for m, n in enumerate(members)})
            entry = self._plans[id(opt)] = (opt, plan, names)
        return entry[1]

    def send(self, name, payload, process_set, numel):
        """Per-tensor mode: start the allgather (or the region exchange's alltoall) of
        ``payload``, the compressed tensor ``name`` of ``numel`` elements; returns the ticket
        for receive."""
        if self.regions:
            with self._lock:
                flight = self._scatter(_Regions("dgc." + name, [name], [numel], process_set),
                                       [0], [payload])
                self._outstanding += 1
            return ("regions", flight)
        handle = hvd.allgather_async(payload, name="dgc." + name, process_set=process_set)
        with self._lock:
            self._outstanding += 1
        return ("tensor", handle, payload.numel())

    # ------------------------------------------------------------- the region exchange
    def _scatter(self, flight, members, payloads):
        """Phase 1 (lock held): cut each member's payload into N region payloads and start the
        alltoall that sends rank j the frame of its parts j (nothing when it has none for rank
        j). Returns ``flight``."""
        core, B = self._core, self._core.B
        ps = flight.process_set
        world, me = ps.size(), ps.rank()
        split = [regions.split_payload(B, payload, flight.numels[m], world, flight.names[m])
                 for m, payload in zip(members, payloads)]
        pieces = []
        for j in range(world):
            entries = [(m, parts[j]) for m, parts in zip(members, split) if parts[j] is not None]
            if entries:
                pieces.append(wire.frame_bucket(B, entries, like=payloads[0]))
            else:
                pieces.append(B.int32_tensor([], like=payloads[0]))
        sizes = [B.numel(p) for p in pieces]
        flight.scatter = hvd.alltoall_async(B.cat(pieces),
                                            splits=torch.tensor(sizes, dtype=torch.int32),
                                            name=flight.name, process_set=ps)
        self._scattering.append(flight)
        # compress counted each whole payload as sent: what left this rank is the frames for the
        # other ranks; the one for itself never goes on the wire
        core.add_wire_bytes(4 * (sum(sizes) - sizes[me] - sum(B.numel(p) for p in payloads)))
        return flight

    def _share(self, flight):
        """Phase 2's start (lock held): wait for the alltoall, reduce this rank's region of each
        tensor some rank sent a part of, start the allgather of the reduced payloads' frame
        (sent even when empty: every rank receives one frame per owner)."""
        core, B = self._core, self._core.B
        ps = flight.process_set
        world, me = ps.size(), ps.rank()
        out, received = _wait(flight.scatter)
        flight.scatter = None
        received = received.tolist()
        core.add_wire_bytes(0, received=4 * (B.numel(out) - received[me]))
        senders = sum(1 for words in received if words)   # the frames, in rank order
        entries = []
        for m, parts in enumerate(core.split_bucket(out, senders, len(flight.names),
                                                    flight.name)):
            if not parts:                   # no rank has entries of this tensor in the region
                continue
            payload, flight.dropped[m] = core.reduce_region(
                B.cat(parts), flight.names[m], flight.numels[m], me, world, len(parts))
            if payload is not None:
                entries.append((m, payload))
        segment = wire.frame_bucket(B, entries, like=out)
        flight.words = B.numel(segment)
        flight.share = hvd.allgather_async(segment, name="dgc.kept." + flight.name[len("dgc."):],
                                           process_set=ps)
        core.add_wire_bytes(4 * flight.words)

    def _regions_result(self, flight, member):
        """(the owners' reduced payloads of ``member`` in rank order, how many, what this rank
        dropped of it) (lock held). The first call of a step ends phase 1 of every region
        exchange started so far, in the order they started, each one's allgather started before
        the next alltoall is waited for (so no rank waits for a collective that another rank
        starts only later)."""
        if flight.share is None:
            while self._scattering:
                head = self._scattering.pop(0)
                try:
                    self._share(head)
                except BaseException as e:
                    head.error = e          # the tensor's other members raise it too
                    raise
            if flight.error is not None:
                raise flight.error
        B = self._core.B
        if flight.parts is None:
            gathered = _wait(flight.share)
            self._core.count_allgather(gathered.numel(), flight.words)
            flight.parts = self._core.split_bucket(gathered, flight.process_set.size(),
                                                   len(flight.names), flight.name)
            flight.empty = B.int32_tensor([], like=gathered)
        parts = flight.parts[member]
        return (B.cat(parts) if parts else flight.empty), len(parts), flight.dropped.get(member)

    def defer(self, opt, name, grad, param, process_set, pending):
        """Bucketed mode: record a sparsified gradient (checked already) in its bucket.

        ``pending`` is the tensor's ctx: its ``handle`` is set to the ticket for :meth:`receive`
        now, its ``core_ctx`` when the bucket is compressed. ``grad`` and ``param`` are kept
        until then. May compress and start the bucket (when this is its last member).

        Deferring is safe: Horovod calls compress from the gradient hook once the gradient is
        final (with backward_passes_per_step > 1 on the last pass, after accumulation; with
        zero_grad(set_to_none=True) or False alike, the .grad it hands over is not written again
        before synchronize(), which decompresses, and so compresses, it first). The tensor (a
        to_dense() copy for sparse_as_dense) is kept in the launch.
        """
        bucket, member = self._plan(opt)[name]
        with self._lock:
            self._outstanding += 1
            launch = bucket.current
            pending.handle = (bucket, member, launch, process_set)
            previous = launch.entries.get(member)
            pendings = (previous[3] if previous is not None else []) + [pending]
            launch.entries[member] = (name, grad, param, pendings)
            launch.world_size, launch.average = process_set.size(), pending.average
            if self.gated:
                self._arrive(opt, name, grad, process_set, pending.average)
            elif len(launch.entries) >= bucket.expected:
                self._start(bucket, process_set)

    def defer_dense(self, opt, name, grad, param, process_set, pending):
        """Gated mode: record a dense (not sparsified) gradient; it is compressed with the step's
        clipping factor and allreduced by DGC when the step is launched. ``pending.handle``
        becomes the ticket for :meth:`receive`."""
        self._plan(opt)
        with self._lock:
            self._outstanding += 1
            gate = self._gate
            pending.handle = ("dense", gate, pending)
            gate.dense.append((name, grad, param, pending))
            self._arrive(opt, name, grad, process_set, pending.average)

    def _arrive(self, opt, name, grad, process_set, average):
        """Gated mode (lock held): count ``name``'s gradient in the step; launch the step when
        every trainable parameter's gradient has arrived."""
        gate = self._gate
        gate.arrived[name] = grad
        gate.process_set, gate.average, gate.opt = process_set, average, opt
        if len(gate.arrived) >= len(self._plans[id(opt)][2]):
            self._launch_step()

    def _launch_step(self):
        """Gated mode (lock held): the rank's clipping factor over all of the step's gradients
        (in plan order), then every bucket in plan order and the dense tensors."""
        gate, self._gate = self._gate, _Gate()
        gate.launched = True
        opt, plan, names = self._plans[id(gate.opt)]
        core, ps = self._core, gate.process_set
        world = ps.size()
        if core.needs_sketch:           # the dense clip: the ranks' sketches, allgathered
            mine = core.sketch([(n, gate.arrived[n]) for n in names if n in gate.arrived])
            rows = hvd.allgather(mine.view(1, -1), name="dgc.clip.sketch", process_set=ps)
            scale = core.clip_scale_of_sketches(rows.tolist(), world, gate.average)
        else:
            grads = [gate.arrived[n] for n in names if n in gate.arrived]
            scale = core.clip_scale(grads, world, gate.average)
        started = set()
        for n in names:
            bucket = plan[n][0]
            if id(bucket) not in started:
                started.add(id(bucket))
                if bucket.current.entries:
                    self._start(bucket, ps, scale)
        op = hvd.Average if gate.average else hvd.Sum
        for name, grad, param, pending in gate.dense:
            kind, out, _ = core.compress(name, grad, world, param, gate.average, scale)
            pending.core_ctx = hvd.allreduce_async(out, name="dgc.dense." + name, op=op,
                                                   process_set=ps)
        # Horovod's own allreduce carried (both ways) a placeholder for each of them too
        placeholders = PLACEHOLDER_BYTES * len(gate.dense)
        core.add_wire_bytes(placeholders, received=placeholders)
        gate.dense = None

    def _start(self, bucket, process_set, clip_scale=None):
        """Compress the bucket's current launch, frame its payloads and start its allgather.

        Runs under the lock: a concurrent defer or receive of the same bucket waits for it.
        """
        launch, bucket.current = bucket.current, _Launch()
        try:
            self._compress_and_send(bucket, launch, process_set, clip_scale)
        except BaseException as e:
            launch.error = e        # the other members' receive raises it too (the same type:
            raise                   # e.g. HorovodInternalError for hvd.elastic)

    def _compress_and_send(self, bucket, launch, process_set, clip_scale):
        members = sorted(launch.entries)
        entries = [launch.entries[m] for m in members]
        launch.entries = None                              # the gradients are not needed now
        results = self._core.compress_many([(n, g, p) for n, g, p, _ in entries],
                                           launch.world_size, launch.average, clip_scale)
        payloads, launch.contexts = [], {}
        for m, (kind, payload, core_ctx), (name, _, _, pendings) in zip(members, results,
                                                                        entries):
            if kind != "sparse":
                raise RuntimeError(f"DGC: {name!r} was compressed as a dense tensor in bucket "
                                   f"{bucket.name!r}")
            for pending in pendings:
                pending.core_ctx = core_ctx
            out = pendings[-1].out
            launch.contexts[m] = (core_ctx, None if out is None else out.view(-1))
            payloads.append(payload)
        if self.regions:
            launch.handle = self._scatter(_Regions(bucket.name, bucket.members, bucket.numels,
                                                   process_set), members, payloads)
            return
        framed = list(zip(members, payloads))
        segment = wire.frame_bucket(self._core.B, framed, like=payloads[0])
        launch.handle = hvd.allgather_async(segment, name=bucket.name, process_set=process_set)
        launch.words = segment.numel()
        # the member words and the header, counted after the payloads (compress_many counts a
        # step's first tensor, which starts the step's statistics)
        self._core.add_wire_bytes(wire.frame_overhead_bytes(len(framed)))

    def receive(self, ticket, world_size):
        """(every rank's payloads for this tensor concatenated in rank order, how many, the
        ``dropped`` argument of ``DGCCore.decompress``: None but with ``exchange="regions"``);
        or, for a member of a bucket of the allgather exchange, (its update, None, None): the
        first member received decodes the whole bucket (``DGCCore.decompress_bucket``).

        In bucketed mode, compresses and starts the tensor's bucket first if it is still
        incomplete (a member without a gradient this step, e.g. a sparse-gradient embedding).
        """
        if ticket[0] == "tensor":                           # per-tensor mode
            _, handle, words = ticket
            with self._lock:
                self._outstanding -= 1
            gathered = _wait(handle)
            self._core.count_allgather(gathered.numel(), words)
            return gathered, world_size, None
        if ticket[0] == "regions":                          # per-tensor region exchange
            with self._lock:
                self._outstanding -= 1
                return self._regions_result(ticket[1], 0)
        if ticket[0] == "dense":                            # gated: DGC's own allreduce
            _, gate, pending = ticket
            with self._lock:
                self._outstanding -= 1
                if not gate.launched:
                    self._launch_step()
            return _wait(pending.core_ctx), world_size, None
        bucket, member, launch, process_set = ticket
        with self._lock:
            self._outstanding -= 1
            if self.gated and launch.handle is None and launch.error is None \
                    and self._gate.arrived:
                self._launch_step()                         # incomplete step at synchronize
            if launch.handle is None:                       # incomplete at synchronize time
                if launch.error is not None:               # compressing or sending it failed
                    raise launch.error
                self._start(bucket, process_set)
            if self.regions:
                return self._regions_result(launch.handle, member)
            if launch.decoded is None:
                gathered = _wait(launch.handle)
                self._core.count_allgather(gathered.numel(), launch.words)
                launch.decoded = self._core.decompress_bucket(
                    gathered, world_size, len(bucket.members), bucket.name, launch.contexts,
                    launch.average)
                launch.contexts = None
        return launch.decoded[member], None, None
