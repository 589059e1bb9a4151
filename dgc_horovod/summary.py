"""TensorBoard scalars from any framework: :class:`EventWriter`, :func:`write_stats` and
:func:`log_stats`.

:class:`EventWriter` is a thin wrapper around the ``tensorboard`` package's own framework-free
writer (``tensorboard.summary.Writer``), with the ``add_scalar(tag, value, step)`` call of
``torch.utils.tensorboard.SummaryWriter``, so the examples and user loops log the same way under
PyTorch and TensorFlow. It needs ``pip install tensorboard`` (in requirements.txt; TensorFlow 2.21
no longer installs it).

Usage::

    from dgc_horovod.summary import EventWriter, write_stats
    writer = EventWriter("runs/dgc")                    # on rank 0 only
    writer.add_scalar("train/loss", 0.31, step=1)
    write_stats(writer, dgc.total_stats.since(epoch_start), step=1)   # dgc/ratio, dgc/received_ratio, ...
    writer.close()

:func:`write_stats` takes any writer with ``add_scalar(tag, value, step)``, e.g. also
``torch.utils.tensorboard.SummaryWriter``; :func:`log_stats` (also
``dgc_horovod.torch.log_stats``) writes a DGC's own statistics.
"""

__all__ = ["EventWriter", "write_stats", "log_stats", "STATS_SCALARS"]

#: CompressionStats fields written by :func:`write_stats` (tag ``prefix + name``).
STATS_SCALARS = ("density", "ratio", "received_ratio", "selected", "wire_bytes",
                 "received_bytes", "dense_bytes", "compress_seconds", "nonfinite_tensors",
                 "overflowed_entries", "flushed_entries", "node_bytes", "node_received_bytes",
                 "cross_node_bytes", "cross_node_received_bytes")


class EventWriter:
    """Append scalars to a new TensorBoard event file in ``log_dir`` (created if missing).

    Raises ModuleNotFoundError (naming ``tensorboard``) when the package is not installed.
    :meth:`flush` (or :meth:`close`, or leaving a ``with`` block) makes records visible.
    """

    def __init__(self, log_dir):
        from tensorboard.summary import DirectoryOutput, Writer
        self.log_dir = log_dir
        self._writer = Writer(DirectoryOutput(log_dir))

    def add_scalar(self, tag, value, step, walltime=None):
        """Record ``value`` (a number; stored as float32) under ``tag`` at ``step`` (int)."""
        self._writer.add_scalar(str(tag), float(value), int(step), wall_time=walltime)

    def flush(self):
        self._writer.flush()

    def close(self):
        self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_stats(writer, stats, step, prefix="dgc/"):
    """Write :data:`STATS_SCALARS` of ``stats`` (a :class:`~dgc_horovod.core.CompressionStats`,
    e.g. ``dgc.stats`` for the last step or ``dgc.total_stats.since(start)`` for an epoch) as
    scalars ``prefix + name`` at ``step`` to ``writer`` (anything with
    ``add_scalar(tag, value, step)``). Returns the dict of values written."""
    d = stats.to_dict()
    values = {name: d[name] for name in STATS_SCALARS}
    for name, value in values.items():
        writer.add_scalar(prefix + name, value, step)
    return values


def log_stats(writer, dgc, step, since=None, prefix="dgc/"):
    """Write DGC's statistics as TensorBoard scalars (call it on rank 0 in your training loop).

    Args:
        writer: anything with ``add_scalar(tag, value, step)``: a
            ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package) or the
            framework-free :class:`EventWriter` (it needs the ``tensorboard`` package too).
        dgc (DGC): the compressor (``dgc_horovod.torch.DGC`` or ``dgc_horovod.tensorflow.DGC``).
        step (int): the global step (or epoch) to record the values at.
        since (CompressionStats or None): None writes the most recent step's counters
            (``dgc.stats``); a copy of ``dgc.total_stats`` taken earlier (e.g. at the start of the
            epoch) writes the counters accumulated since then (``dgc.total_stats.since(since)``).
        prefix (str): tag prefix.

    Writes ``prefix + name`` for name in :data:`STATS_SCALARS` (density, ratio and
    received_ratio (dense bytes over the bytes sent / received), selected, wire_bytes,
    received_bytes, dense_bytes, compress_seconds, nonfinite_tensors, overflowed_entries,
    flushed_entries, and the hierarchical exchange's node_bytes, node_received_bytes,
    cross_node_bytes, cross_node_received_bytes: 0 with the other exchanges); returns the
    dict of values written. Example::

        start = dgc.total_stats.copy()
        ...train one epoch...
        if hvd.rank() == 0:
            log_stats(writer, dgc, epoch, since=start)
    """
    stats = dgc.stats if since is None else dgc.total_stats.since(since)
    return write_stats(writer, stats, step, prefix=prefix)
