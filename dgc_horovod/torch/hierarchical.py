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

Per sparsified tensor (:func:`~dgc_horovod.core.hierarchical.is_sharded`), one tensor at a time
(buckets are not used):

1. ``compress``: ``hvd.allreduce_async`` of the float32 gradient inside the node
   (``dgc.node.<name>``; op Average or Sum, as the optimizer's), Horovod's allreduce carries the
   1-element placeholder.
2. at the step's first ``decompress``: for every tensor started, in the order they started, wait
   for its node reduction, compress this rank's shard (``DGCCore.compress`` with N = M nodes) and
   start the allgather of its payload across the nodes (``dgc.cross.<name>``); then, in the same
   order, wait for each, decode it (``DGCCore.decompress``: 1/M under Average), apply the
   separate weight decay to the shard (``DGCCore.finish_update``) and start the allgather of the
   decoded shard inside the node (``dgc.shards.<name>``).
3. each ``decompress`` waits for its tensor's allgather inside the node: the whole update.

Statistics: :meth:`DGCCore.count_hierarchical` (``node_*`` and ``cross_node_*`` fields).
"""
import os
import threading

import horovod.torch as hvd
import torch

from dgc_horovod.core import hierarchical
from dgc_horovod.torch.exchange import _wait

__all__ = ["Hierarchical", "HierarchicalPending"]


class HierarchicalPending:
    """ctx of a sparsified tensor between compress and decompress under the hierarchical
    exchange: its flight, and the gradient's shape and dtype."""

    __slots__ = ("flight", "shape", "dtype")

    def __init__(self, flight, shape, dtype):
        self.flight, self.shape, self.dtype = flight, shape, dtype


class _Flight:
    """One tensor's three collectives: ``node`` (the allreduce inside the node), ``cross`` (the
    allgather across nodes), ``shards`` (the allgather of the decoded shards inside the node);
    ``ctx`` the core's SparseContext; ``update`` the decoded shard; ``error`` what advancing it
    raised."""

    __slots__ = ("name", "param", "average", "ndim", "node", "cross", "shards", "ctx", "words",
                 "update", "error", "bounds")

    def __init__(self, name, param, average, ndim, node):
        self.name, self.param, self.average, self.ndim, self.node = name, param, average, ndim, node
        self.cross = self.shards = self.ctx = self.update = self.error = self.bounds = None
        self.words = 0


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
        return {"local_size": self.local_size, "nodes": self.nodes_count, "shard": self.shard}


def current_layout():
    """The layout as Horovod reports it without a collective (before the first step):
    :meth:`Layout.to_dict`'s keys."""
    return {"local_size": hvd.local_size(), "nodes": hvd.cross_size(),
            "shard": hvd.local_rank()}


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
    nodes, crosses = hierarchical.node_layout(rows)
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
        self._started = []          # flights whose node reduction has not been advanced
        self._crossing = []         # flights whose allgather across nodes has not been advanced
        self._lock = threading.Lock()

    def layout_dict(self):
        """The layout a checkpoint records (:meth:`Layout.to_dict`; before the first step,
        Horovod's view of it: :func:`current_layout`)."""
        return self.layout.to_dict() if self.layout is not None else current_layout()

    def setup(self, opt):
        if self.layout is None:
            self.layout = make_layout(opt.process_set)

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

    def start(self, name, tensor, param, average):
        """Step 1: start the node's reduction of ``tensor``; returns the ctx for decompress."""
        g = tensor.detach().reshape(-1)
        if g.dtype is not torch.float32:
            g = g.float()
        op = hvd.Average if average else hvd.Sum
        handle = hvd.allreduce_async(g, name="dgc.node." + name, op=op,
                                     process_set=self.layout.local)
        flight = _Flight(name, param, average, tensor.dim(), handle)
        with self._lock:
            self._started.append(flight)
        return HierarchicalPending(flight, tensor.shape, tensor.dtype)

    def _select(self, f):
        """Step 2a (lock held): the node's gradient → this rank's shard compressed → its
        allgather across the nodes."""
        core, lay = self._core, self.layout
        G = _wait(f.node)
        f.node = None
        n = G.numel()
        lo, hi = f.bounds = hierarchical.shard_bounds(n, lay.local_size)[lay.shard]
        shard = G[lo:hi]
        if not core.B.all_finite(G):        # the node's gradient is non-finite: every shard
            shard = torch.full_like(shard, float("nan"))
        shape = (1,) * (f.ndim - 1) + (hi - lo,)
        param = None if f.param is None else f.param.reshape(-1)[lo:hi]
        kind, payload, f.ctx = core.compress(f.name, shard.view(shape), lay.nodes_count,
                                             None if param is None else param.view(shape),
                                             f.average)
        if kind != "sparse":
            raise RuntimeError(f"DGC: the shard of {f.name!r} was compressed as a dense tensor")
        core.count_hierarchical(node=hierarchical.node_bytes(n, lay.local_size),
                                cross=(4 * payload.numel(), 0))
        f.words = payload.numel()
        f.cross = hvd.allgather_async(payload, name="dgc.cross." + f.name,
                                      process_set=lay.cross)
        self._crossing.append(f)

    def _decode(self, f):
        """Step 2b (lock held): the nodes' payloads of this shard decoded, weight decay, the
        allgather of the shard inside the node."""
        core, lay = self._core, self.layout
        gathered = _wait(f.cross)
        f.cross = None
        core.count_hierarchical(cross=(0, 4 * (gathered.numel() - f.words)))
        lo, hi = f.bounds
        update = core.decompress(gathered, f.ctx, lay.nodes_count, f.average)
        param = None if f.param is None else f.param.reshape(-1)[lo:hi]
        f.update = core.finish_update(f.name, update, param)
        f.shards = hvd.allgather_async(f.update, name="dgc.shards." + f.name,
                                       process_set=lay.local)

    def _advance(self):
        """Steps 2a and 2b of every tensor started (lock held), each in start order."""
        for queue, step in ((self._started, self._select), (self._crossing, self._decode)):
            while queue:
                f = queue.pop(0)
                try:
                    step(f)
                except BaseException as e:
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
        core.count_hierarchical(node=hierarchical.shards_bytes(
            full.numel(), f.update.numel(), self.layout.local_size))
        if not core.B.all_finite(full):
            if core.B.all_finite(f.update):     # another shard was: the tensor is skipped
                core.discard_sent(f.ctx)
            full.fill_(float("nan"))
        return full
