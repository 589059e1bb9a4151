"""How the PyTorch adapter moves payloads: Horovod allgather, one per tensor or one per bucket.

Buckets (``DGCConfig.bucket_numel > 0``): the optimizer's parameters, in reverse registration
order (roughly the order backward produces their gradients), are cut into consecutive groups of
about ``bucket_numel`` dense elements. The plan depends only on the model, so it is the same on
every rank. A bucket's allgather (named ``dgc.bucket.<first member's name>``) starts as soon as
all its members are compressed, overlapping with the rest of backward; a bucket still incomplete
when Horovod synchronizes (a parameter without a compressed gradient this step) starts then.
The framing is :func:`dgc_horovod.core.wire.frame_bucket`. When the plan is made (the first
step), the ranks compare their trainable parameters once and raise a ValueError naming the first
difference, instead of hanging on collectives that never match.
"""
import json
import threading

import horovod.torch as hvd
import torch

from dgc_horovod.core import wire

__all__ = ["Exchange"]


class _Launch:
    """One bucket's payloads of one step, and its allgather once started."""

    __slots__ = ("entries", "handle", "parts")

    def __init__(self):
        self.entries, self.handle, self.parts = {}, None, None


class _Bucket:
    __slots__ = ("name", "members", "current")

    def __init__(self, name, members):
        self.name, self.members, self.current = name, members, _Launch()


def _check_same_model(opt, params):
    """Every rank must reduce the same parameters (names, sizes, dtypes, order): compare once,
    with one allgather, and raise a ValueError naming the first difference on every rank, rather
    than hang on collectives that never match or sum two different tensors."""
    mine = [[opt._parameter_names[p], p.numel(), str(p.dtype)] for p in params]
    blob = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
    sizes = hvd.allgather(torch.tensor([blob.numel()]), name="dgc.check_model.sizes",
                          process_set=opt.process_set).tolist()
    data = hvd.allgather(blob, name="dgc.check_model", process_set=opt.process_set)
    every = [json.loads(bytes(chunk.tolist()).decode()) for chunk in data.split(sizes)]
    for rank, theirs in enumerate(every):
        if theirs == mine:
            continue
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                raise ValueError(
                    f"DGC: the ranks' models differ: trainable parameter #{i} (from the last) "
                    f"is {a[0]!r} ({a[1]} elements, {a[2]}) on rank {opt.process_set.rank()} "
                    f"but {b[0]!r} ({b[1]} elements, {b[2]}) on rank {rank}")
        raise ValueError(
            f"DGC: the ranks' models differ: rank {opt.process_set.rank()} has {len(mine)} "
            f"trainable parameters, rank {rank} has {len(theirs)} (a parameter frozen or "
            "missing on one rank?)")


class Exchange:
    """Sends each rank's payloads by Horovod allgather and hands back what every rank sent.

    Args:
        core (DGCCore): for the backend and to count framing bytes in the statistics.
        bucket_numel (int): dense elements per bucket; 0 = one allgather per tensor.
    """

    def __init__(self, core, bucket_numel):
        self._core, self._bucket_numel = core, bucket_numel
        self._plans = {}                 # id(optimizer) -> (optimizer, {name: (bucket, member)})
        self._lock = threading.Lock()
        self._outstanding = 0            # payloads sent whose result was not received yet

    def busy(self):
        """True between a payload's send and its receive (a step in progress)."""
        return self._outstanding > 0

    def _plan(self, opt):
        entry = self._plans.get(id(opt))
        if entry is None or entry[0] is not opt:
            params = [p for group in opt.param_groups for p in group["params"]
                      if p.requires_grad][::-1]
            _check_same_model(opt, params)
            plan, members, size = {}, [], 0
            for i, p in enumerate(params):
                members.append(opt._parameter_names[p])
                size += p.numel()
                if size >= self._bucket_numel or i == len(params) - 1:
                    bucket = _Bucket("dgc.bucket." + members[0], members)
                    plan.update({n: (bucket, m) for m, n in enumerate(members)})
                    members, size = [], 0
            entry = self._plans[id(opt)] = (opt, plan)
        return entry[1]

    def send(self, opt, name, payload, process_set):
        """Start (or join a bucket for) the allgather of ``payload``; returns a ticket."""
        if self._bucket_numel == 0:
            handle = hvd.allgather_async(payload, name="dgc." + name, process_set=process_set)
            with self._lock:
                self._outstanding += 1
            return handle
        bucket, member = self._plan(opt)[name]
        with self._lock:
            self._outstanding += 1
            launch = bucket.current
            launch.entries[member] = payload
            self._core.add_wire_bytes(4)                    # the member word
            if len(launch.entries) == len(bucket.members):
                self._start(bucket, process_set)
        return bucket, member, launch, process_set

    def _start(self, bucket, process_set):
        launch, bucket.current = bucket.current, _Launch()
        entries = sorted(launch.entries.items())
        segment = wire.frame_bucket(self._core.B, entries, like=entries[0][1])
        launch.handle = hvd.allgather_async(segment, name=bucket.name, process_set=process_set)
        self._core.add_wire_bytes(wire.BUCKET_HEADER_BYTES)

    def receive(self, ticket, world_size):
        """(every rank's payloads for this tensor concatenated in rank order, how many)."""
        if not isinstance(ticket, tuple):
            with self._lock:
                self._outstanding -= 1
            return hvd.synchronize(ticket), world_size
        bucket, member, launch, process_set = ticket
        with self._lock:
            self._outstanding -= 1
            if launch.handle is None:                       # incomplete at synchronize time
                if launch is bucket.current:
                    self._start(bucket, process_set)
            if launch.parts is None:
                launch.parts = wire.split_bucket(self._core.B, hvd.synchronize(launch.handle),
                                                 world_size, len(bucket.members), bucket.name)
        parts = launch.parts[member]
        return (self._core.B.cat(parts) if parts else parts), len(parts)
