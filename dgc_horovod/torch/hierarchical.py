"""How the PyTorch adapter runs ``exchange="hierarchical"`` (the algorithm and its equations:
:mod:`dgc_horovod.core.hierarchical`) on Horovod's own collectives and process sets.

At the first gradient DGC sees, every rank allgathers Horovod's view of where it runs
(``hvd.local_rank()``, ``local_size()``, ``cross_rank()``, ``cross_size()``); every rank then
knows the nodes (:func:`~dgc_horovod.core.hierarchical.node_layout`: nodes of different sizes
raise a ValueError on every rank, naming them) and registers, in the same order everywhere,
one process set per node and one per shard index across the nodes (``hvd.add_process_set``,
which needs Horovod started with dynamic process sets: ``hvd.init(process_sets="dynamic")`` or
``HOROVOD_DYNAMIC_PROCESS_SETS=1``; a set that exists already, e.g. passed to
``hvd.init(process_sets=[...])``, or the global one, is used as it is). Without dynamic process
sets, and a set missing, every rank raises a ValueError saying so before any set is added.

Per sparsified tensor (:func:`~dgc_horovod.core.hierarchical.is_sharded`); across the nodes
in buckets (:func:`~dgc_horovod.core.hierarchical.cross_buckets`):

1. ``compress``: ``hvd.reducescatter_async`` of the flat float32 gradient inside the node
   (``dgc.node.<name>``; op Average or Sum, as the optimizer's): this rank receives its shard of
   the node's gradient, Horovod's split being the shard rule
   (:func:`~dgc_horovod.core.hierarchical.shard_bounds`); Horovod's allreduce carries the
   1-element placeholder.
2. at the step's first ``decompress``: every tensor started is waited for, in the order they
   started; the node agrees on which node gradients are non-finite (``dgc.finite.node``: an
   allreduce inside the node of one int32 per sharded tensor, this rank's shard having a
   NaN/Inf; a tensor flagged anywhere is all NaN in every rank's shard); then for each bucket
   of the sharded tensors (plan order), this rank's shards are compressed
   (``DGCCore.compress_many`` with N = M nodes), their payloads framed
   (``wire.frame_bucket``) and one allgather of the frame across the nodes started
   (``dgc.cross.<first tensor's name>``); then, bucket after bucket, wait for it, decode each
   member (``DGCCore.decompress_bucket``: 1/M under Average), apply the separate weight decay
   to the shard (``DGCCore.finish_update``) and start the allgather of the decoded shard inside
   the node (``dgc.shards.<name>``).
3. each ``decompress`` waits for its tensor's allgather inside the node: the whole update.

With clipping (``clip_norm``, ``clip_scope="global"``; the equations: the core module) every
tensor of the step waits for the node's norm: a tensor that is not sharded starts its node
allreduce in ``compress`` too (the whole tensor, for the norm only; Horovod's allreduce carries
a placeholder for it). After the node reductions and the flags of step 2, this rank's part of
the node's squared norm (:func:`~dgc_horovod.core.hierarchical.clip_part`, the tensors in plan
order) is allgathered inside the node (``dgc.clip.node``) and the factor
s_c computed from the L parts (:meth:`DGCCore.clip_scale_of_squares` with N = M: the same bits
on every rank of the node); then each sharded tensor goes on as in step 2 with s_c, and each
other tensor's velocity, from this rank's own gradient with s_c, goes out by DGC's own
``hvd.allreduce_async`` over every rank (``dgc.dense.<name>``).

Statistics: :meth:`DGCCore.count_hierarchical` (``node_*`` and ``cross_node_*`` fields).

Horovod Elastic: every reset (and every restore) replaces the :class:`Hierarchical` of the DGC
(``DGC._drop_pending``), so the first step of the new world makes the layout again: Horovod's
new view allgathered, the process sets registered anew in the new Horovod session (a reset
starts Horovod with the global set only; ``hvd.init(process_sets="dynamic")`` set
``HOROVOD_DYNAMIC_PROCESS_SETS=1``, which every re-initialization reads), and each rank's shard
state, dropped by the reset rule, rebuilt from zero for its shard of the new layout. A world of
unequal nodes (e.g. a discovery script that lists 2 slots on one host and 1 on another) gets the
ValueError at its first step on every rank, saying so. Horovod 0.28.1 itself does not survive a
worker that crashes while process sets other than the global one exist (docs/reliability.md).
"""
import os
import threading

import horovod.torch as hvd
import torch

from dgc_horovod.adapter import under_elastic
from dgc_horovod.core import PLACEHOLDER_BYTES, hierarchical, wire
from dgc_horovod.torch.exchange import _wait
from dgc_horovod.torch.params import reduced_parameters

__all__ = ["Hierarchical", "HierarchicalPending"]


class HierarchicalPending:
    """ctx of a sparsified tensor between compress and decompress under the hierarchical
    exchange: its flight, and the gradient's shape and dtype."""

    __slots__ = ("flight", "shape", "dtype")

    def __init__(self, flight, shape, dtype):
        self.flight, self.shape, self.dtype = flight, shape, dtype


class _Crossing:
    """One bucket's allgather across the nodes: its ``flights`` in plan order, the ``handle``,
    and the ``words`` of this rank's frame."""

    __slots__ = ("flights", "handle", "words")

    def __init__(self, flights, handle, words):
        self.flights, self.handle, self.words = flights, handle, words


class _Flight:
    """One tensor's three collectives: ``node`` (the reduce-scatter inside the node; for a tensor
    that is not sharded, with clipping, the allreduce), ``cross`` (the
    allgather across nodes: its bucket's :class:`_Crossing`), ``shards`` (the allgather of the decoded shards inside the node, or
    for a tensor that is not sharded, with clipping, DGC's allreduce of its velocity);
    ``ctx`` the core's SparseContext; ``update`` the decoded shard; ``error`` what advancing it
    raised; ``own`` (a tensor that is not sharded, with clipping) this rank's gradient as the
    core takes it; ``G`` the node's gradient and ``shard`` this rank's part of it, between the
    node reduction and compress; ``numel`` the tensor's elements."""

    __slots__ = ("name", "param", "average", "ndim", "node", "cross", "shards", "ctx",
                 "update", "error", "bounds", "own", "G", "shard", "sharded", "numel")

    def __init__(self, name, param, average, ndim, numel, node, own=None):
        self.name, self.param, self.average, self.ndim, self.node = name, param, average, ndim, node
        self.numel = numel
        self.cross = self.shards = self.ctx = self.update = self.error = self.bounds = None
        self.G = self.shard = None
        self.own, self.sharded = own, own is None


def _existing_sets():
    """{tuple(ranks): process set id} of the process sets Horovod has now."""
    return {tuple(ranks): i
            for i, ranks in hvd.mpi_ops._basics._get_process_set_ids_and_ranks().items()}


def _process_set(ranks, existing):
    """The process set of ``ranks``: Horovod's global one, one that exists, or a new one."""
    if list(ranks) == list(range(hvd.size())):
        return hvd.global_process_set
    if tuple(ranks) in existing:
        ps = hvd.ProcessSet(list(ranks))
        ps.process_set_id = existing[tuple(ranks)]
        return ps
    return hvd.add_process_set(list(ranks))


def _dynamic():
    return bool(int(os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") or 0))


class Layout:
    """This rank's place: ``nodes`` and ``crosses`` (see ``node_layout``), ``local`` / ``cross``
    its process sets, ``shard`` its index in the node (j), ``local_size`` L, ``nodes_count`` M."""

    def __init__(self, nodes, crosses, local, cross, shard):
        self.nodes, self.crosses, self.local, self.cross = nodes, crosses, local, cross
        self.shard, self.local_size, self.nodes_count = shard, len(crosses), len(nodes)

    def to_dict(self):
        """What a checkpoint records of the layout (:meth:`DGC.state_dict`)."""
        return {"local_size": self.local_size, "nodes": self.nodes_count, "shard": self.shard,
                "shards": hierarchical.SHARD_RULE}


def current_layout():
    """The layout as Horovod reports it without a collective (before the first step):
    :meth:`Layout.to_dict`'s keys."""
    return {"local_size": hvd.local_size(), "nodes": hvd.cross_size(),
            "shard": hvd.local_rank(), "shards": hierarchical.SHARD_RULE}


def make_layout(process_set):
    """Every rank's Horovod view allgathered, the nodes checked, the process sets registered
    (collective: every rank calls it at the same point, its first gradient). Raises ValueError
    (on every rank alike) for nodes of different sizes, a process set other than the global
    one, or missing process sets without dynamic process sets."""
    if process_set.process_set_id != hvd.global_process_set.process_set_id:
        raise ValueError("DGC(exchange='hierarchical') runs on Horovod's global process set: "
                         "create hvd.DistributedOptimizer without process_set=...")
    row = torch.tensor([[hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                         hvd.cross_size()]], dtype=torch.int64)
    rows = hvd.allgather(row, name="dgc.hierarchical.layout").tolist()
    try:
        nodes, crosses = hierarchical.node_layout(rows)
    except ValueError as e:
        if not under_elastic():
            raise
        raise ValueError(
            f"{e}. Under Horovod Elastic the nodes are what the host discovery script lists "
            f"now (this world: {hvd.size()} ranks, after a reset): list the same number of "
            "slots for every host") from None
    existing = _existing_sets()
    everyone = tuple(range(hvd.size()))
    missing = [s for s in nodes + crosses if tuple(s) != everyone and tuple(s) not in existing]
    if missing and not _dynamic():
        raise ValueError(
            "DGC(exchange='hierarchical') needs Horovod process sets for the nodes and across "
            f"them ({missing} missing): start Horovod with hvd.init(process_sets='dynamic') (or "
            "HOROVOD_DYNAMIC_PROCESS_SETS=1 in the environment), or pass them to "
            f"hvd.init(process_sets=[hvd.ProcessSet(r) for r in {nodes + crosses}])")
    me = hvd.rank()
    sets = {}
    for ranks in nodes + crosses:       # the same order on every rank
        if tuple(ranks) not in sets:
            sets[tuple(ranks)] = _process_set(ranks, existing)
    node = next(n for n in nodes if me in n)
    shard = node.index(me)
    return Layout(nodes, crosses, sets[tuple(node)], sets[tuple(crosses[shard])], shard)


class Hierarchical:
    """The hierarchical exchange of one DGC (see the module docstring). ``layout`` is None
    until :meth:`setup` ran (the first gradient of the first step, and again after an elastic
    reset, which makes a new one)."""

    def __init__(self, core):
        self._core = core
        self.layout = None
        self._order = {}            # name -> plan position (reversed registration order)
        self._started = []          # flights whose node reduction has not been advanced
        self._crossing = []         # buckets whose allgather across nodes has not been advanced
        self._lock = threading.Lock()

    def layout_dict(self):
        """The layout a checkpoint records (:meth:`Layout.to_dict`; before the first step,
        Horovod's view of it: :func:`current_layout`)."""
        return self.layout.to_dict() if self.layout is not None else current_layout()

    def setup(self, opt):
        if self.layout is None:
            self.layout = make_layout(opt.process_set)
            self._order = {opt._parameter_names[p]: i
                           for i, p in enumerate(reduced_parameters(opt)[::-1])}

    def sharded(self, tensor):
        """Whether ``tensor`` (a gradient) is sparsified under this exchange."""
        return hierarchical.is_sharded(tensor.numel(), tensor.dim(), self.layout.local_size,
                                       self._core.config)

    def fit_numels(self, opt):
        """{name: the elements of this rank's state of it}, for ``DGCCore.check_fit``: a
        sharded parameter's shard, a dense one's whole."""
        out = {}
        for p, name in opt._parameter_names.items():
            if self.sharded(p):
                lo, hi = hierarchical.shard_bounds(p.numel(), self.layout.local_size)[
                    self.layout.shard]
                out[name] = hi - lo
            else:
                out[name] = p.numel()
        return out

    def dense_input(self, name, tensor, param):
        """(gradient, parameter) of a tensor that is not sharded as the core takes it: flat
        where :func:`~dgc_horovod.core.hierarchical.dense_flat` says so."""
        if hierarchical.dense_flat(name, tensor.numel(), tensor.dim(), self.layout.local_size,
                                   self._core.config):
            return tensor.reshape(-1), param.reshape(-1)
        return tensor, param

    def start(self, name, tensor, param, average, sharded=True):
        """Step 1: start the node's reduction of ``tensor`` (a sharded one: the reduce-scatter;
        one that is not: the allreduce); returns the ctx for decompress.
        ``sharded=False`` (with clipping): a tensor that is not sharded, reduced for the node's
        norm and compressed from this rank's own gradient once the factor is known."""
        own = None
        if not sharded:
            own, param = self.dense_input(name, tensor, param)
            self._core.check_entry(name, own, param)
        g = tensor.detach().reshape(-1)
        if g.dtype is not torch.float32:
            g = g.float()
        op = hvd.Average if average else hvd.Sum
        collective = hvd.reducescatter_async if sharded else hvd.allreduce_async
        handle = collective(g, name="dgc.node." + name, op=op, process_set=self.layout.local)
        flight = _Flight(name, param, average, tensor.dim(), g.numel(), handle, own)
        with self._lock:
            self._started.append(flight)
        return HierarchicalPending(flight, tensor.shape, tensor.dtype)

    def _reduce(self, f):
        """The node's reduction of ``f`` waited for (lock held): for a sharded tensor this
        rank's shard of the node's gradient, for one that is not the whole of it."""
        out = _wait(f.node)
        f.node = None
        if not f.sharded:
            f.G = out
            return
        lo, hi = f.bounds = hierarchical.shard_bounds(f.numel, self.layout.local_size)[
            self.layout.shard]
        if out.numel() != hi - lo:
            raise RuntimeError(
                f"DGC(exchange='hierarchical'): Horovod's reduce-scatter gave this rank "
                f"{out.numel()} elements of {f.name!r} ({f.numel} elements), the shard rule "
                f"[{lo}, {hi}): this Horovod splits differently from the one DGC was written for "
                "(0.28.1)")
        f.shard = out

    def _agree_finite(self, flights):
        """The node's agreement on which sharded tensors' node gradients are non-finite (lock
        held; collective inside the node, with L > 1): one int32 per sharded tensor, this rank's
        shard having a NaN/Inf, summed over the node; a flagged tensor's shard becomes all NaN
        on every rank of the node."""
        core, lay = self._core, self.layout
        sharded = [f for f in flights if f.sharded]
        flags = [not core.B.all_finite(f.shard) for f in sharded]
        if lay.local_size > 1 and sharded:
            flags = hvd.allreduce(torch.tensor(flags, dtype=torch.int32), op=hvd.Sum,
                                  name="dgc.finite.node", process_set=lay.local).tolist()
            core.count_hierarchical(node=hierarchical.finite_bytes(len(sharded),
                                                                   lay.local_size))
        for f, bad in zip(sharded, flags):
            if bad:
                f.shard = torch.full_like(f.shard, float("nan"))

    def _clip_scale(self, flights):
        """The node's clipping factor s_c of the step (lock held; collective inside the node):
        this rank's part of the node's squared norm over ``flights`` (every tensor of the step,
        reduced), the L parts allgathered and summed in shard order."""
        core, lay = self._core, self.layout
        planned = self._in_plan_order(flights)
        part = hierarchical.clip_part(core.B, [f.shard for f in planned if f.sharded],
                                      [f.G for f in planned if not f.sharded], lay.shard)
        parts = hvd.allgather(torch.tensor([part], dtype=torch.float64), name="dgc.clip.node",
                              process_set=lay.local)
        return core.clip_scale_of_squares(parts.tolist(), lay.nodes_count, flights[0].average)

    def _in_plan_order(self, flights):
        """``flights`` sorted by their tensors' plan positions (the same order on every rank)."""
        return sorted(flights, key=lambda f: self._order.get(f.name, len(self._order)))

    def _select_dense(self, f, clip_scale):
        """Step 2a for a tensor that is not sharded, with clipping (lock held): its velocity
        from this rank's own gradient → DGC's allreduce over every rank."""
        core, lay = self._core, self.layout
        f.G = None
        kind, out, _ = core.compress(f.name, f.own, lay.nodes_count, f.param, f.average,
                                     clip_scale)
        f.own = None
        core.count_hierarchical(node=hierarchical.node_bytes(f.numel, lay.local_size))
        # Horovod's own allreduce carries a placeholder for it, both ways
        core.add_wire_bytes(PLACEHOLDER_BYTES, received=PLACEHOLDER_BYTES)
        f.shards = hvd.allreduce_async(out, name="dgc.dense." + f.name,
                                       op=hvd.Average if f.average else hvd.Sum)

    def _send(self, bucket, clip_scale=None):
        """Step 2a for a bucket of sharded tensors (lock held; ``bucket``: their flights in
        plan order): this rank's shards compressed (``DGCCore.compress_many``, N = M), their
        payloads framed (``wire.frame_bucket``) → one allgather across the nodes, named after
        the bucket's first tensor (``dgc.cross.<name>``)."""
        core, lay = self._core, self.layout
        entries = []
        for f in bucket:
            lo, hi = f.bounds
            shape = (1,) * (f.ndim - 1) + (hi - lo,)
            param = None if f.param is None else f.param.reshape(-1)[lo:hi].view(shape)
            entries.append((f.name, f.shard.view(shape), param))
            f.G = None
        results = core.compress_many(entries, lay.nodes_count, bucket[0].average, clip_scale)
        payloads = []
        for f, (kind, payload, ctx) in zip(bucket, results):
            f.shard, f.ctx = None, ctx
            if kind != "sparse":
                raise RuntimeError(f"DGC: the shard of {f.name!r} was compressed as a dense "
                                   "tensor")
            lo, hi = f.bounds
            core.count_hierarchical(node=hierarchical.scatter_bytes(f.numel, hi - lo,
                                                                    lay.local_size))
            payloads.append(payload)
        frame = wire.frame_bucket(core.B, list(enumerate(payloads)), like=payloads[0])
        # the payloads are in wire_bytes already (compress); the frame's own words added
        core.add_wire_bytes(wire.frame_overhead_bytes(len(payloads)))
        core.count_hierarchical(cross=(hierarchical.cross_bytes(4 * frame.numel(),
                                                                lay.nodes_count), 0))
        crossing = _Crossing(bucket, hvd.allgather_async(frame, name="dgc.cross." + bucket[0].name,
                                                         process_set=lay.cross), frame.numel())
        for f in bucket:
            f.cross = crossing
        self._crossing.append(crossing)

    def _decode(self, crossing):
        """Step 2b for a bucket (lock held): the nodes' frames split and each member's payloads
        decoded (``DGCCore.decompress_bucket``: 1/M under Average), weight decay, the allgather
        of each decoded shard inside the node."""
        core, lay = self._core, self.layout
        gathered = _wait(crossing.handle)
        crossing.handle = None
        bucket = crossing.flights
        core.count_hierarchical(cross=(0, 4 * (gathered.numel() - crossing.words)))
        updates = core.decompress_bucket(gathered, lay.nodes_count, len(bucket),
                                         "dgc.cross." + bucket[0].name,
                                         {m: (f.ctx, None) for m, f in enumerate(bucket)},
                                         bucket[0].average)
        for m, f in enumerate(bucket):
            f.cross = None
            lo, hi = f.bounds
            param = None if f.param is None else f.param.reshape(-1)[lo:hi]
            f.update = core.finish_update(f.name, updates[m], param)
            f.shards = hvd.allgather_async(f.update, name="dgc.shards." + f.name,
                                           process_set=lay.local)

    def _advance(self):
        """Steps 2a and 2b of every tensor started (lock held): every node reduction waited
        for (in start order), the node's finiteness flags, with clipping the node's factor;
        then each tensor that is not sharded (clipping) and each bucket of sharded ones
        (:func:`~dgc_horovod.core.hierarchical.cross_buckets`, plan order) sent; then each
        bucket decoded."""
        if self._started:
            flights, self._started = self._started, []
            clip = self._core.needs_clip_scale
            try:
                for f in flights:
                    self._reduce(f)
                self._agree_finite(flights)
                scale = self._clip_scale(flights) if clip else None
                for f in flights:
                    if not f.sharded:
                        self._select_dense(f, scale)
                planned = self._in_plan_order(f for f in flights if f.sharded)
                for group in hierarchical.cross_buckets([f.numel for f in planned],
                                                        self._core.config.bucket_numel):
                    bucket = [planned[i] for i in group]
                    self._send(bucket, scale)
                if clip:
                    self._core.count_hierarchical(node=hierarchical.clip_bytes(
                        self.layout.local_size))
            except BaseException as e:
                for f in flights:           # the tensors not sent (no collective) raise it
                    if f.cross is None and f.shards is None:
                        f.error = e
                raise
        while self._crossing:
            crossing = self._crossing.pop(0)
            try:
                self._decode(crossing)
            except BaseException as e:
                for f in crossing.flights:
                    f.error = e
                raise

    def receive(self, pending):
        """Step 3: the whole update of ``pending``'s tensor (flat float32), bit-identical on
        every rank."""
        f = pending.flight
        with self._lock:
            if f.shards is None and f.error is None:
                self._advance()
            if f.error is not None:
                raise f.error
        full = _wait(f.shards)
        f.shards = None
        core = self._core
        if not f.sharded:               # clipping: a tensor that is not sharded
            return core.finish_update(f.name, full.view(-1), f.param)
        core.count_hierarchical(node=hierarchical.shards_bytes(
            full.numel(), f.update.numel(), self.layout.local_size))
        if not core.B.all_finite(full):
            if core.B.all_finite(f.update):     # another shard was: the tensor is skipped
                core.discard_sent(f.ctx)
            full.fill_(float("nan"))
        return full
