"""What the PyTorch and TensorFlow compressors share: settings, warm-up, statistics, checkpoints,
the first-step checks (momentum applied twice, one process, :func:`check_same_model`), the
Horovod-style ``Compression`` namespace (:func:`compression_namespace`), and Horovod Elastic (the
reset rule, and :class:`ElasticHandler`, what an elastic state does with a DGC).

Framework-free: each adapter subclasses :class:`DGCAdapter`, names its Horovod module in ``_hvd``
and adds Horovod's ``compress`` / ``decompress`` for its framework.
"""
import difflib
import functools
import json
import logging
import operator
import os
import threading
import warnings

from dgc_horovod.core import DGCConfig, DGCCore
from dgc_horovod.core.config import config_diff

__all__ = ["DGCAdapter", "DGCFactory", "ElasticHandler", "check_same_config", "check_same_model",
           "under_elastic",
           "compression_namespace"]

_log = logging.getLogger("dgc_horovod")

_RIGHT_LINE = ("create the compressor and keep it: dgc = {name}(compress_ratio=0.004, ...); "
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
                        "call it and keep the object: dgc = Compression.dgc(compress_ratio=0.004, "
                        "...); hvd.DistributedOptimizer(..., compression=dgc)")

    decompress = compress

    def __repr__(self):
        return f"Compression.dgc (makes {self._cls.__module__}.{self._cls.__name__})"


_COMPRESSION_DOC = """Horovod-style namespace of compressors, like ``{horovod}.Compression``.

``Compression.none`` and ``Compression.fp16`` are Horovod's own; ``Compression.dgc(**kwargs)``
returns a new :class:`DGC` with those settings (keyword arguments of
:class:`~dgc_horovod.core.DGCConfig`, or ``config=DGCConfig(...)``)::

    from {module} import Compression
    compression = Compression.dgc(compress_ratio=0.001)
    {usage}

Unlike Horovod's stateless compressors, each call returns a new, stateful object: keep it
(for ``set_epoch``, statistics and checkpoints) and use it with one {user} only.
"""


def compression_namespace(hvd, dgc_class, usage, user):
    """The adapter's ``Compression`` class, like ``hvd.Compression``: ``none`` and ``fp16`` are
    Horovod's own, ``dgc`` is a :class:`DGCFactory` of ``dgc_class``. ``usage``: the docstring
    example's line that passes ``compression``; ``user``: what one DGC serves (e.g. "optimizer")."""
    doc = _COMPRESSION_DOC.format(horovod=hvd.__name__, module=dgc_class.__module__,
                                  usage=usage, user=user)
    return type("Compression", (), {"__doc__": doc, "__module__": dgc_class.__module__,
                                    "none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                                    "dgc": DGCFactory(dgc_class)})


_MODELS_DIFFER = "DGC: the ranks' models differ: "


def under_elastic():
    """Whether Horovod Elastic runs this process (``HOROVOD_ELASTIC=1``, as Horovod itself
    tells: ``horovodrun`` sets it for the workers of an elastic job)."""
    return bool(int(os.environ.get("HOROVOD_ELASTIC", 0) or 0))


def check_same_config(mine, theirs, rank):
    """ValueError naming each setting in which this rank's config (``DGCConfig.to_dict()``)
    and rank ``rank``'s differ."""
    differ = config_diff(mine, theirs)
    if differ:
        detail = "; ".join(f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} on rank {rank}"
                           for k in differ)
        raise ValueError(f"DGC: the ranks' DGC configs differ ({detail}); create DGC with the "
                         "same settings on every rank (HOROVOD_DGC_* variables included: "
                         "str(dgc.config) says where each setting came from)")


def check_same_model(signature, gather, rank, words, config):
    """Every rank must reduce the same tensors (names, sizes, dtypes, order) with the same DGC
    settings: compare the ranks' signatures and configs once and raise a ValueError naming the
    first difference on every rank, rather than hang on collectives that never match (each
    tensor's is named after it; a setting such as ``bucket_numel`` or ``exchange`` changes
    which collectives run) or sum two different tensors.

    Args:
        signature (list): this rank's ``[name, description]`` of each tensor, in its order.
        gather: the adapter's collective, ``gather(data) -> (sizes, every)``: every rank's
            ``len(data)`` and all their bytes, in rank order.
        rank (int): this rank.
        words (tuple): the message's two ``str.format`` templates: a differing tensor (fields
            ``i``, ``a``, ``b``, ``me``, ``rank``) and a differing count (``n``, ``m``, ``me``,
            ``rank``, ``detail``: the first tensor one of the two ranks has alone).
        config (DGCConfig): this rank's settings.
    """
    mine = json.loads(json.dumps(config.to_dict()))     # as the other ranks' arrive
    sizes, data = gather(json.dumps([mine, signature]).encode())
    every, start = [], 0
    for n in sizes:
        every.append(json.loads(data[start:start + n].decode()))
        start += n
    for other, (theirs, _) in enumerate(every):
        check_same_config(mine, theirs, other)
    tensor, count = words
    for other, (_, theirs) in enumerate(every):
        if theirs == signature:
            continue
        if len(theirs) != len(signature):
            longer, shorter, owner = ((signature, theirs, rank) if len(signature) > len(theirs)
                                      else (theirs, signature, other))
            names = {s[0] for s in shorter}
            extra = next((s for s in longer if s[0] not in names), None)
            detail = (f"; {_described(extra)} is reduced on rank {owner} only"
                      if extra is not None else "")
            raise ValueError(_MODELS_DIFFER + count.format(
                n=len(signature), m=len(theirs), me=rank, rank=other, detail=detail))
        for i, (a, b) in enumerate(zip(signature, theirs)):
            if a != b:
                raise ValueError(_MODELS_DIFFER + tensor.format(
                    i=i, a=_described(a), b=_described(b), me=rank, rank=other))


def _described(entry):
    return f"{entry[0]!r} ({entry[1]})"


def _from_core(attr, doc):
    """A read-only property of the adapter that is the core's attribute ``attr``."""
    return property(operator.attrgetter("_core." + attr), doc=doc)


class DGCAdapter:
    """Base of ``dgc_horovod.torch.DGC`` and ``dgc_horovod.tensorflow.DGC``.

    Args:
        config (DGCConfig or None): the settings, or None to build them from ``kwargs``.
        backend (Backend): the framework's tensor operations for the core.
        core_class: :class:`~dgc_horovod.core.DGCCore`, or a subclass of it (the TensorFlow
            adapter's in-graph core).
        **kwargs: keyword arguments of :class:`~dgc_horovod.core.DGCConfig`.
    Raises:
        TypeError: both ``config`` and keyword arguments; TypeError / ValueError from
            DGCConfig for a bad setting (the message names it).
    """

    _hvd = None          # the adapter's Horovod module (horovod.torch / horovod.tensorflow)
    #: the values of ``DGCConfig.exchange`` this adapter implements
    exchanges = ("allgather",)
    #: why an exchange this adapter lacks is not there (appended to the refusal)
    _missing_exchanges = {}
    _own_kwargs = ()     # keyword arguments the adapter takes besides DGCConfig's
    #: the adapter's advice instead of a copy (Horovod Elastic, checkpoints)
    _copy_hint = "to checkpoint, save dgc.state_dict()"

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a {type(self).__module__}.DGC cannot be pickled or copied: its state is "
                        f"per rank. {self._copy_hint}")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ("compress", "decompress"):
            if name in cls.__dict__:
                setattr(cls, name, _InstanceOnly(cls.__dict__[name]))

    def __init__(self, config, backend, core_class=DGCCore, **kwargs):
        self._check_kwargs(config, kwargs)
        if config is not None and kwargs:
            raise TypeError("pass either config=DGCConfig(...) or keyword arguments, not both")
        self.config = config if config is not None else DGCConfig(**kwargs)
        if self.config.exchange not in self.exchanges:
            raise ValueError(f"exchange={self.config.exchange!r}"
                             f"{self.config._from('exchange')} is not available in "
                             f"{type(self).__module__}; it supports "
                             f"{', '.join(map(repr, self.exchanges))}"
                             f"{self._missing_exchanges.get(self.config.exchange, '')}")
        self._core = core_class(self.config, backend)
        hvd = self._hvd
        self._session = self._horovod_session() if hvd.is_initialized() else None
        self._session_lock = threading.Lock()
        self._warned_single = False
        self._warned_decay = False
        self._warned_moments = False
        self._carried = False           # an elastic state's handler holds it (ElasticHandler)
        self._elastic_checked = False
        self.resets = 0

    @classmethod
    def _check_kwargs(cls, config, kwargs):
        """TypeError, with the right line, for a density passed as the first positional argument
        (``DGC(0.01)``: that is ``config``) and for an unknown keyword (listing the valid ones)."""
        name = cls.__name__
        if config is not None and not isinstance(config, DGCConfig):
            hint = (f"; to set the density pass it by keyword: {name}(compress_ratio={config!r})"
                    if isinstance(config, (int, float)) and not isinstance(config, bool) else "")
            raise TypeError(f"{name}'s first argument is config (a DGCConfig or None), got "
                            f"{type(config).__name__} {config!r}{hint}")
        valid = sorted(DGCConfig.DEFAULTS) + ["config", "environ"] + list(cls._own_kwargs)
        for key in kwargs:
            if key not in valid:
                close = difflib.get_close_matches(key, valid, n=1)
                raise TypeError(f"{name}() got an unexpected keyword argument {key!r}"
                                + (f" (did you mean {close[0]!r}?)" if close else "")
                                + f"; the valid ones: {', '.join(valid)}")

    # first-step checks -------------------------------------------------------------------
    def _check_optimizer(self, name, optimizer, momentum, weight_decay=0.0, moments=False):
        """ValueError when both DGC and the wrapped ``optimizer`` apply momentum to ``name``;
        a warning (once) when both apply weight decay (``weight_decay``: the optimizer's for
        ``name``), which decays twice, and (once) when DGC's momentum > 0 meets an Adam-like
        optimizer (``moments``: it keeps its own moment estimates)."""
        if self.config.momentum > 0 and moments and not self._warned_moments:
            self._warned_moments = True
            warnings.warn(
                f"{type(optimizer).__mro__[1].__name__} keeps its own moment estimates; DGC("
                f"momentum={self.config.momentum}) adds momentum correction on top. For "
                "Adam-like optimizers use DGC(momentum=0) (error feedback only).")
        if self.config.weight_decay > 0 and weight_decay and not self._warned_decay:
            self._warned_decay = True
            warnings.warn(
                f"weight decay is applied twice (to {name!r}, and maybe others): "
                f"DGC(weight_decay={self.config.weight_decay}) and the wrapped optimizer "
                f"{type(optimizer).__mro__[1].__name__}'s weight_decay={weight_decay}. Create "
                "the optimizer with weight_decay=0 (DGC's applies it with momentum, as dense "
                "momentum SGD does), or use DGC(weight_decay=0)")
        if self.config.momentum > 0 and momentum > 0:
            raise ValueError(
                f"momentum would be applied twice to {name!r}: DGC(momentum="
                f"{self.config.momentum}) applies momentum correction itself, and the wrapped "
                f"optimizer {type(optimizer).__mro__[1].__name__} has momentum={momentum}. "
                "Create the optimizer with momentum=0 (and nesterov=False), or use "
                "DGC(momentum=0) for plain error feedback.")

    def _warn_single_process(self):
        """Warn (once) that Horovod bypasses DGC when one process runs."""
        if not self._warned_single:
            self._warned_single = True
            warnings.warn("one Horovod process: Horovod skips the gradient reduction, and so DGC "
                          "and its momentum correction; launch 2+ processes, or train with the "
                          "optimizer's own momentum on one")

    #: the adapter's elastic state that carries a DGC, as the warning of
    #: :meth:`_warn_if_not_carried` names it
    _elastic_state = "an elastic state of dgc_horovod"

    def _uncarried_elastic(self):
        """Whether Horovod Elastic runs the job and no elastic state carries this DGC."""
        return not self._carried and under_elastic()

    def _warn_if_not_carried(self):
        """Warn (once, at the first step) when Horovod Elastic runs the job
        (``HOROVOD_ELASTIC=1``, set by ``horovodrun`` for elastic jobs) and no elastic state
        carries this DGC: its velocities and residuals are then neither committed nor restored,
        a joining worker does not take the others' warm-up position, and where DGC's Python
        does not run at each step (TensorFlow's graph) the reset rule never runs."""
        self._elastic_checked = True
        if not self._uncarried_elastic():
            return
        warnings.warn(
            "Horovod Elastic runs this job, but no elastic state carries this DGC object. "
            "Then its velocities and residuals are not committed or restored with the model, "
            "a worker that joins does not get the others' warm-up position, and in "
            "TensorFlow's traced step DGC cannot drop its residuals when workers leave or "
            f"join. Pass it to {self._elastic_state}. (A custom State that calls "
            "dgc.on_reset() at its reset can carry it with "
            "dgc_horovod.adapter.ElasticHandler(dgc): save / restore / sync.)")

    # warm-up and statistics ------------------------------------------------------------
    def set_epoch(self, epoch):
        """Set the warm-up position (epochs completed, float); call on every rank alike."""
        self._core.set_epoch(epoch)

    def set_step(self, step, steps_per_epoch=None):
        """Set the warm-up position from a global step count (e.g. on resume without a DGC
        checkpoint): the next step is step ``step`` (0-based); with ``warmup_epochs`` the epoch
        becomes step / steps_per_epoch (then required)."""
        self._core.set_step(step, steps_per_epoch)

    density = _from_core("density", "The density in force now (float, warm-up schedule).")
    stats = _from_core("step_stats", ":class:`~dgc_horovod.core.CompressionStats` of the most "
                       "recent step, this rank.")
    total_stats = _from_core("total_stats", "Cumulative :class:`~dgc_horovod.core."
                             "CompressionStats` of this rank.")
    states = _from_core("states", "Per-tensor :class:`~dgc_horovod.core.state.TensorState`, "
                        "keyed by name.")

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
        warm-up position (its step count also fixes the threshold's samples), the cumulative
        statistics, the loss scale the
        residuals are in (``loss_scale``; PyTorch's ``loss_scaler``), and the world size and
        rank of ``process_set`` (default: the global one). Copies, safe to keep. Call it between
        steps. PyTorch: ``torch.load(..., weights_only=True)`` can read it back; a RuntimeError
        in the middle of a step (between ``loss.backward()`` and ``optimizer.step()``).
        TensorFlow: eager ``tf.Tensor`` copies (NumPy arrays with ``in_graph=False`` on the C
        kernels, ``device="cpu"``).
        """
        self._between_steps("state_dict() was called", "call it between steps, after "
                            "optimizer.step(), as for the model's and the optimizer's")
        world, rank = self._job(process_set)
        return self._core.state_dict(world_size=world, rank=rank)

    def load_state_dict(self, state_dict, reset_residuals=False, process_set=None):
        """Restore :meth:`state_dict` of the same rank; resuming is then bit-identical.

        Create the DGC with the same settings first, and load between steps. PyTorch tensors
        keep the device they are loaded on (``torch.load(path, map_location=...)``); TensorFlow
        accepts tensors, NumPy arrays or anything ``tf.cast`` accepts.

        Args:
            state_dict (dict): what :meth:`state_dict` returned on this rank.
            reset_residuals (bool): keep config, warm-up position and statistics, but
                drop every u and v (they restart at zero); the way to resume with a different
                number of ranks, or with another ``exchange``. The dropped residual is gradient
                that is never applied: a small one-off perturbation.
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

    # Horovod Elastic: the reset rule and the state handler's three operations -----------------
    # Framework hooks: _horovod_session() identifies the current Horovod initialization;
    # _drop_pending() forgets exchanges in flight (restore and reset); _drop_checks() forgets the
    # first-step checks (reset); _between_steps(what, when) refuses a commit (and state_dict) in
    # the middle of a step; _elastic_sync_more() syncs what else a framework needs (TensorFlow:
    # the model signatures already compared).

    def _horovod_session(self):
        """An object that identifies the current Horovod initialization (default: this rank's
        (size, rank) pair; an adapter with a finer marker overrides it)."""
        hvd = self._hvd
        return (hvd.size(), hvd.rank()) if hvd.is_initialized() else None

    @staticmethod
    def _same_session(a, b):
        return a is b if isinstance(a, dict) else a == b

    def _drop_pending(self):
        pass

    def _drop_checks(self):
        pass

    def _between_steps(self, what, when):
        pass

    def on_reset(self):
        """Apply DGC's elastic reset rule on this rank now (call it on every rank alike).

        The rule: every tensor's velocity u and residual v are dropped (they restart at zero at
        the next step), and so are the bucket plans, the first-step checks (model consistency
        across ranks, momentum) and any exchange still pending; the world size N (clipping
        threshold, averaging) is read again at the next step. Config, warm-up position and
        statistics are kept.

        DGC applies it by itself at every reset of an elastic state that carries it
        (PyTorch: ``hvd.elastic.TorchState(..., dgc=dgc)``, at ``sync`` or, when Horovod skips
        ``sync``, at the first step after the reset; TensorFlow:
        :mod:`dgc_horovod.tensorflow.elastic`, when the state is reset), and otherwise at the
        first step after Horovod was re-initialized (PyTorch sees every re-initialization,
        TensorFlow's ``in_graph=False`` path one that changed this rank's world size or rank;
        in the graph, TensorFlow's default, DGC's Python runs only while the step is traced, so
        there the reset comes from the elastic state or this call). Calling it is only needed
        with a custom elastic State; it can be registered with ``state.register_reset_callbacks([dgc.on_reset])``
        (it then runs once per reset, not twice), and such a State keeps the DGC's commit,
        restore and sync with :class:`ElasticHandler` (``ElasticHandler(dgc)``; without one, DGC
        warns at its first step under Horovod Elastic). Residuals are per rank and not broadcast: after
        a reset every rank, old or new, starts from the same zero state. The dropped residual is
        gradient that is never applied, a one-off perturbation of the size of a few steps'
        unsent gradient (see README, Reliability).
        """
        with self._session_lock:
            self._reset_locked()
            self._session = self._horovod_session()    # published after the reset is complete

    def _reset_locked(self):
        core = self._core
        core.load_state_dict(core.state_dict(), reset_residuals=True)
        self._drop_pending()
        self._drop_checks()
        self.resets += 1
        hvd = self._hvd
        _log.info("DGC: elastic reset #%d: velocities and residuals dropped, world size %s",
                  self.resets, hvd.size() if hvd.is_initialized() else "?")

    def _follow_horovod(self):
        """Apply :meth:`on_reset` once if Horovod was re-initialized since DGC last ran (the
        first time, also :meth:`_warn_if_not_carried`)."""
        if not self._elastic_checked:
            self._warn_if_not_carried()
        now = self._horovod_session()
        if now is None or self._same_session(now, self._session):
            return
        with self._session_lock:
            if self._session is None:
                self._session = now            # first contact: nothing to reset
            elif not self._same_session(now, self._session):
                self._reset_locked()
                self._session = now

    def _elastic_snapshot(self):
        """A copy of this rank's state for an elastic state's commit (between steps)."""
        self._between_steps("the elastic state was committed", "call state.commit() between "
                            "steps, after the optimizer's step")
        return self._core.state_dict()

    def _elastic_restore(self, snapshot):
        """Go back to a snapshot of :meth:`_elastic_snapshot` (undoes uncommitted steps)."""
        self._core.load_state_dict(snapshot)
        self._drop_pending()

    def _elastic_sync(self):
        """Collective: apply the reset rule if Horovod was re-initialized, check that every rank
        has the same config (ValueError on every rank, naming the settings, otherwise) and take
        rank 0's warm-up position (epoch and step count, which also fixes the threshold's
        samples)."""
        hvd = self._hvd
        self._follow_horovod()
        mine = self._core.state_dict()
        configs = hvd.allgather_object(mine["config"], name="dgc.elastic.config")
        for rank, theirs in enumerate(configs):
            check_same_config(mine["config"], theirs, rank)
        root = hvd.broadcast_object({"epoch": mine["epoch"], "steps": mine["steps"]},
                                    root_rank=0, name="dgc.elastic.sync")
        if hvd.rank() != 0:
            mine["epoch"], mine["steps"] = root["epoch"], root["steps"]
            self._core.load_state_dict(mine)
        self._elastic_sync_more()

    def _elastic_sync_more(self):
        pass

    def __repr__(self):
        return f"DGC({self.config!r})"


class ElasticHandler:
    """A DGC object's part in a Horovod elastic state: ``save`` (commit) copies its state,
    ``restore`` goes back to that copy bit for bit, ``sync`` (collective) applies the reset rule
    if due, checks the configs and takes rank 0's warm-up position. The PyTorch
    handler (:mod:`dgc_horovod.torch.elastic`) and the TensorFlow states
    (:mod:`dgc_horovod.tensorflow.elastic`) are built on it.

    Args:
        dgc (DGCAdapter): the compressor; its state is copied now, so a restore before the
            first commit goes back to the state at creation.
    Raises (from save): RuntimeError in the middle of a step. (from sync): ValueError when the
        ranks' DGC configs differ.
    """

    def __init__(self, dgc):
        self.value = dgc
        self._saved = dgc._elastic_snapshot()
        dgc._carried = True

    def save(self):
        """Commit: keep a copy of the DGC's state (refused in the middle of a step)."""
        self._saved = self.value._elastic_snapshot()

    def restore(self):
        """Back to the last commit, bit for bit; exchanges in flight are dropped."""
        self.value._elastic_restore(self._saved)

    def sync(self):
        """Collective: reset rule if due, config check, rank 0's warm-up position."""
        self.value._elastic_sync()
