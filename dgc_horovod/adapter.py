"""What the PyTorch and TensorFlow compressors share: settings, warm-up, statistics, checkpoints.

Framework-free: each adapter subclasses :class:`DGCAdapter`, names its Horovod module in ``_hvd``
and adds Horovod's ``compress`` / ``decompress`` for its framework.
"""
import functools

from dgc_horovod.core import DGCConfig, DGCCore

__all__ = ["DGCAdapter", "DGCFactory"]

_RIGHT_LINE = ("create the compressor and keep it: dgc = {name}(compress_ratio=0.001, ...); "
               "hvd.DistributedOptimizer(..., compression=dgc)")


class _InstanceOnly:
    """``compress`` / ``decompress`` looked up on the DGC class itself, i.e. Horovod was given
    ``compression=DGC`` (the class, as one writes ``Compression.fp16``): called that way they
    raise a TypeError that shows the right line, instead of "missing 1 required positional
    argument"."""

    def __init__(self, func):
        self.func = func
        functools.update_wrapper(self, func)

    def __get__(self, obj, objtype=None):
        if obj is not None:
            return self.func.__get__(obj, objtype)
        func = self.func

        @functools.wraps(func)
        def unbound(*args, **kwargs):
            if args and isinstance(args[0], objtype):       # DGC.compress(dgc, tensor)
                return func(*args, **kwargs)
            raise TypeError(f"compression={objtype.__name__} passes the class, not a compressor: "
                            + _RIGHT_LINE.format(name=objtype.__name__))
        return unbound


class DGCFactory:
    """``Compression.dgc``: calling it makes a new DGC compressor (``Compression.dgc(**kwargs)``
    is ``DGC(**kwargs)``); passed to Horovod uncalled (``compression=Compression.dgc``, as one
    writes ``Compression.fp16``), its ``compress`` raises a TypeError that shows the right line."""

    def __init__(self, cls):
        self._cls = cls
        self.__doc__ = f"A new :class:`{cls.__name__}` compressor: ``{cls.__name__}(config=config, **kwargs)``."

    def __call__(self, config=None, **kwargs):
        return self._cls(config=config, **kwargs)

    def compress(self, *args, **kwargs):
        raise TypeError("compression=Compression.dgc passes the factory, not a compressor: "
                        "call it and keep the object: dgc = Compression.dgc(compress_ratio=0.001, "
                        "...); hvd.DistributedOptimizer(..., compression=dgc)")

    decompress = compress

    def __repr__(self):
        return f"Compression.dgc (makes {self._cls.__module__}.{self._cls.__name__})"


class DGCAdapter:
    """Base of ``dgc_horovod.torch.DGC`` and ``dgc_horovod.tensorflow.DGC``.

    Args:
        config (DGCConfig or None): the settings, or None to build them from ``kwargs``.
        backend (Backend): the framework's tensor operations for the core.
        **kwargs: keyword arguments of :class:`~dgc_horovod.core.DGCConfig`.
    Raises:
        TypeError: both ``config`` and keyword arguments; TypeError / ValueError from
            DGCConfig for a bad setting (the message names it).
    """

    _hvd = None          # the adapter's Horovod module (horovod.torch / horovod.tensorflow)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ("compress", "decompress"):
            if name in cls.__dict__:
                setattr(cls, name, _InstanceOnly(cls.__dict__[name]))

    def __init__(self, config, backend, **kwargs):
        if config is not None and kwargs:
            raise TypeError("pass either config=DGCConfig(...) or keyword arguments, not both")
        self.config = config if config is not None else DGCConfig(**kwargs)
        self._core = DGCCore(self.config, backend)

    # warm-up and statistics ------------------------------------------------------------
    def set_epoch(self, epoch):
        """Set the warm-up position (epochs completed, float); call on every rank alike."""
        self._core.set_epoch(epoch)

    def set_step(self, step, steps_per_epoch):
        """Set the warm-up position from a step count: epoch = step / steps_per_epoch."""
        self._core.set_step(step, steps_per_epoch)

    @property
    def density(self):
        """The density in force now (float, warm-up schedule)."""
        return self._core.density

    @property
    def stats(self):
        """:class:`~dgc_horovod.core.CompressionStats` of the most recent step, this rank."""
        return self._core.step_stats

    @property
    def total_stats(self):
        """Cumulative :class:`~dgc_horovod.core.CompressionStats` of this rank."""
        return self._core.total_stats

    @property
    def states(self):
        """Per-tensor :class:`~dgc_horovod.core.compressor.TensorState`, keyed by name."""
        return self._core.states

    # checkpoint and resume ---------------------------------------------------------------
    def _job(self, process_set):
        """(size, rank) of ``process_set`` (default: Horovod's global process set)."""
        hvd = self._hvd
        if not hvd.is_initialized():
            raise RuntimeError("call hvd.init() before DGC.state_dict / load_state_dict: DGC "
                               "state is per rank and records the world size and rank it "
                               "belongs to")
        ps = hvd.global_process_set if process_set is None else process_set
        return ps.size(), ps.rank()

    def state_dict(self, process_set=None):
        """This rank's DGC state, to save in this rank's own checkpoint file.

        A plain dict (see :meth:`dgc_horovod.core.DGCCore.state_dict`): config, warm-up epoch,
        every tensor's velocity u, residual v and sparse flag keyed by its name, the
        threshold-sampling generator state, the cumulative statistics, and the world size and
        rank of ``process_set`` (default: the global one). Copies, safe to keep. Call it between
        steps. PyTorch: ``torch.load(..., weights_only=True)`` can read it back. TensorFlow: the
        tensors are eager ``tf.Tensor`` copies (``.numpy()`` them to pickle).
        """
        world, rank = self._job(process_set)
        return self._core.state_dict(world_size=world, rank=rank)

    def load_state_dict(self, state_dict, reset_residuals=False, process_set=None):
        """Restore :meth:`state_dict` of the same rank; resuming is then bit-identical.

        Create the DGC with the same settings first, and load between steps. PyTorch tensors
        keep the device they are loaded on (``torch.load(path, map_location=...)``); TensorFlow
        accepts tensors, NumPy arrays or anything ``tf.cast`` accepts.

        Args:
            state_dict (dict): what :meth:`state_dict` returned on this rank.
            reset_residuals (bool): keep config, warm-up epoch, generator and statistics, but
                drop every u and v (they restart at zero); the way to resume with a different
                number of ranks. The dropped residual is gradient that is never applied: a small
                one-off perturbation.
            process_set: the Horovod process set DGC runs in (default: the global one).
        Raises:
            ValueError: a different config (names the differing keys); a different world size or
                rank without ``reset_residuals`` (residuals are per rank); a malformed dict.
                At the first step after the load (from ``loss.backward()`` / the gradient
                reduction): a checkpoint that does not fit the model, i.e. saved tensor states
                whose names match none of the optimizer's parameters, or parameters without a
                saved state (e.g. saved under a renamed or wrapped module); the message names a
                few of each. ``reset_residuals=True`` loads such a checkpoint without its
                residuals.
        """
        world, rank = self._job(process_set)
        self._core.load_state_dict(state_dict, world_size=world, rank=rank,
                                   reset_residuals=reset_residuals)

    def __repr__(self):
        return f"DGC({self.config!r})"
