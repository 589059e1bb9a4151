"""Make Horovod's timeline complete before a worker exits.

Horovod 0.28.1's timeline writer is a thread that drains a queue of records into a buffered
file; at shutdown it stops without draining what is still queued (``TimelineWriter::Shutdown``),
so under load the last collectives of a job can be missing from ``HOROVOD_TIMELINE``'s file
(seen: 4 of 10 allgathers). :func:`flush_timeline` runs a marker collective until rank 0 (the
one that writes the file) sees its name in the file: the queue is first in, first out, so every
record before the first marker is written by then (the markers' own records fill the file's
buffer until it is flushed to disk).
"""
import os
import time

__all__ = ["flush_timeline"]

MARKER = "timeline_flush_marker"


def flush_timeline(rank, collective, timeout=120.0):
    """``collective(name, value)``: an allreduce (sum) of the float ``value`` named ``name`` on
    every rank, returning the sum (the worker's framework). No-op without ``HOROVOD_TIMELINE``."""
    path = os.environ.get("HOROVOD_TIMELINE")
    if not path:
        return
    deadline = time.monotonic() + timeout
    while True:     # rank 0 decides: 0 go on, 1 the marker is there, 2 out of time
        code = 0.0
        if rank == 0:
            code = 1.0 if MARKER in open(path).read() else 2.0 * (time.monotonic() > deadline)
        code = collective(MARKER, code)
        if code == 1.0:
            return
        if code == 2.0:
            raise RuntimeError(f"Horovod's timeline {path} did not show the marker collective "
                               f"within {timeout:.0f} s")
