"""Checkpointing of :class:`~dgc_horovod.core.compressor.DGCCore`: the state dict (format version
:data:`STATE_DICT_VERSION`), its validation on load, and the check that a loaded checkpoint fits
the model (its tensor names and sizes).

Not a step of the paper: resuming a run bit-identically needs every worker's residuals u and v
(Algorithm 1's state), the warm-up position (§3.3: the step count, which with the seed also fixes
the threshold's samples, §5) and the statistics. :meth:`DGCCore.state_dict` and
:meth:`DGCCore.load_state_dict` call :func:`make` and :func:`read`; every check of a load runs
before the core changes anything.
"""
from collections.abc import Mapping

from dgc_horovod.core import wire
from dgc_horovod.core.config import RESETTABLE_OPTIONS, config_diff
from dgc_horovod.core.sparsify import is_sparse
from dgc_horovod.core.stats import ADDED_FIELDS, CompressionStats, StatsRecorder
from dgc_horovod.core.warmup import density_at

__all__ = ["STATE_DICT_VERSION", "STATE_KEYS", "make", "read", "FitCheck"]

#: Version of the dict written by :meth:`DGCCore.state_dict` (checked on load). Version 3 added
#: ``loss_scale``, the loss scale the residuals are in (:meth:`DGCCore.set_loss_scale`); a
#: version-2 dict still loads, its scale unknown: the next set_loss_scale adopts the scale of
#: its step without rescaling (what DGC did before version 3: it kept u and v in the units of
#: the gradients it was handed). Version 4 dropped ``generator``: the samples are a hash of
#: (seed, tensor, step) (:mod:`~dgc_horovod.core.sparsify`); an older dict's generator is
#: ignored. Other versions are refused.
STATE_DICT_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)
#: Options added to DGCConfig since version 2, with the value an older checkpoint (which lacks
#: them) was trained with.
ADDED_OPTIONS = {"exchange": "allgather"}
STATE_KEYS = ("version", "config", "epoch", "steps", "world_size", "rank", "tensors",
              "total_stats", "step_stats", "loss_scale")
#: The keys a version-2 dict lacks.
ADDED_IN_3 = ("loss_scale",)


def _stats_dict(stats):
    return {k: getattr(stats, k) for k in CompressionStats.__slots__}


def _stats_from(d, key):
    fields = set(CompressionStats.__slots__)
    if not isinstance(d, dict) or not fields - set(ADDED_FIELDS) <= set(d) <= fields:
        raise ValueError(f"DGC state_dict {key!r} must be a dict of the CompressionStats fields "
                         f"{', '.join(CompressionStats.__slots__)}")
    out = CompressionStats()
    for k in d:                 # counters added since the checkpoint was written stay 0
        setattr(out, k, d[k])
    return out


def make(B, config, epoch, steps, world_size, rank, states, stats, loss_scale=1.0):
    """The state dict of :meth:`DGCCore.state_dict` (see there), with copies of the tensors:
    B (Backend), config (DGCConfig), epoch (float), steps (int), world_size / rank (int or None),
    states ({name: TensorState}), stats (StatsRecorder), loss_scale (float, or None: unknown)."""
    copy = (lambda t: None if t is None else B.state_copy(t))
    tensors = {name: {"numel": st.numel, "ndim": st.ndim, "sparse": st.sparse,
                      "u": copy(st.u), "v": copy(st.v), "wd": copy(st.wd)}
               for name, st in states.items()}
    return {
        "version": STATE_DICT_VERSION,
        "config": config.to_dict(),
        "epoch": epoch,
        "steps": steps,
        "world_size": world_size,
        "rank": rank,
        "tensors": tensors,
        "total_stats": _stats_dict(stats.total),
        "step_stats": _stats_dict(stats.step),
        "loss_scale": loss_scale,
    }


def read(B, config, state_dict, world_size=None, rank=None, reset_residuals=False):
    """Every check of :meth:`DGCCore.load_state_dict`; changes nothing.

    Returns:
        (tensors, epoch, steps, stats, loss_scale): tensors {name: (numel, sparse, u, v, ndim,
        wd)}, the arguments of a TensorState after its name, with u, v and wd flat float32
        tensors of the backend or None ({} with reset_residuals); epoch (float); steps (int);
        stats (a StatsRecorder holding the saved counters); loss_scale (float, or None for a
        version-2 dict: unknown).
    Raises:
        TypeError, ValueError: as :meth:`DGCCore.load_state_dict`.
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"DGC state_dict must be a dict, got {type(state_dict).__name__}")
    version = state_dict.get("version")
    keys = STATE_KEYS if version != 2 else [k for k in STATE_KEYS if k not in ADDED_IN_3]
    missing = [k for k in keys if k not in state_dict]
    if missing:
        raise ValueError(f"not a DGC state_dict: missing key(s) {', '.join(missing)}")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"DGC state_dict version {version!r} is not supported (this "
                         f"dgc_horovod writes version {STATE_DICT_VERSION} and reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))})")
    loss_scale = state_dict.get("loss_scale")
    if loss_scale is not None and (isinstance(loss_scale, bool)
                                   or not isinstance(loss_scale, (int, float))
                                   or not 0.0 < loss_scale < float("inf")):
        raise ValueError(f"DGC state_dict 'loss_scale' must be a finite number > 0 (or None), "
                         f"got {loss_scale!r}")
    saved, now = state_dict["config"], config.to_dict()
    if not isinstance(saved, dict):
        raise ValueError("DGC state_dict 'config' must be a dict (DGCConfig.to_dict())")
    saved = {**ADDED_OPTIONS, **saved}
    differ = [k for k in config_diff(saved, now)
              if not (reset_residuals and k in RESETTABLE_OPTIONS)]
    if differ:
        detail = "; ".join(f"{k}: saved {saved.get(k, '<absent>')!r}, now "
                           f"{now.get(k, '<absent>')!r}" for k in differ)
        switch = [k for k in differ if k in RESETTABLE_OPTIONS]
        hint = (f"; or, to change {', '.join(switch)} and keep the warm-up position, load with "
                "reset_residuals=True (the residuals restart at zero)"
                if switch and len(switch) == len(differ) else "")
        raise ValueError(f"DGC checkpoint was saved with a different config "
                         f"({', '.join(differ)} differ: {detail}); create DGC with the "
                         "saved settings, "
                         f"DGCConfig(**state_dict['config']){hint}")
    saved_ws, saved_rank = state_dict["world_size"], state_dict["rank"]
    if not reset_residuals:
        if None not in (saved_ws, world_size) and saved_ws != world_size:
            raise ValueError(
                f"DGC checkpoint was saved by a job of {saved_ws} ranks, this job has "
                f"{world_size}: DGC state is per rank (each rank's residuals hold the part of "
                "its own gradients it has not sent yet), so it cannot be mapped onto another "
                "world size. Resume with the same number of ranks, each loading its own file, "
                "or pass reset_residuals=True to keep config and warm-up epoch and restart "
                "the residuals at zero (the dropped residual is lost gradient, a small "
                "one-off perturbation). In a job with Horovod process sets, pass the DGC's "
                "process_set= to state_dict() and load_state_dict() (the default is the "
                "global set)")
        if None not in (saved_rank, rank) and saved_rank != rank:
            raise ValueError(
                f"DGC checkpoint was saved by rank {saved_rank}, loaded on rank {rank}: DGC "
                "state is per rank (residuals differ between ranks); each rank must load the "
                "file it saved itself (or pass reset_residuals=True)")
    density_at(state_dict["epoch"], config.compress_ratio)     # validates the epoch
    steps = state_dict["steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"DGC state_dict 'steps' must be an int >= 0, got {steps!r}")
    tensors = {} if reset_residuals else _tensors_from(B, config, state_dict["tensors"])
    total, step = (_stats_from(state_dict[k], k) for k in ("total_stats", "step_stats"))
    return (tensors, float(state_dict["epoch"]), steps, StatsRecorder(step, total),
            None if loss_scale is None else float(loss_scale))


def _tensors_from(B, c, tensors):
    if not isinstance(tensors, dict):
        raise ValueError("DGC state_dict 'tensors' must be a dict "
                         "{name: {numel, ndim, sparse, u, v, wd}}")
    out = {}
    for name, t in tensors.items():
        try:
            numel, ndim, sparse = t["numel"], t["ndim"], t["sparse"]
            u, v, wd = t["u"], t["v"], t["wd"]
        except (TypeError, KeyError):
            raise ValueError(f"DGC state of {name!r} must be a dict with keys numel, ndim, "
                             "sparse, u, v, wd") from None
        for key, value, low in (("numel", numel, 1), ("ndim", ndim, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DGC state of {name!r} has {key} {value!r}, not an int "
                                 f">= {low}")
        wire.check_numel(numel, name)
        if bool(sparse) != is_sparse(numel, ndim, c):
            raise ValueError(f"DGC state of {name!r} says sparse={sparse!r} for {numel} "
                             f"elements in {ndim} dimension(s), but min_sparse_numel="
                             f"{c.min_sparse_numel} and min_sparse_ndim={c.min_sparse_ndim}")
        for key, tensor, wanted in (("u", u, c.momentum > 0), ("v", v, bool(sparse)),
                                    ("wd", wd, None)):
            if wanted is not None and (tensor is not None) != wanted:
                raise ValueError(f"DGC state of {name!r}: {key} is "
                                 f"{'missing' if wanted else 'present but not expected'}")
            if tensor is not None and B.numel(tensor) != numel:
                raise ValueError(f"DGC state of {name!r}: {key} has {B.numel(tensor)} "
                                 f"elements, expected {numel}")
        flat = (lambda x: None if x is None else B.float32_flat(x))
        out[name] = (numel, bool(sparse), flat(u), flat(v), ndim, flat(wd))
    return out


class FitCheck:
    """After a load with tensor states: the loaded names and sizes, checked against the model's
    until the first step after the load has completed (:meth:`DGCCore.check_fit`)."""

    __slots__ = ("names", "began", "numels")

    def __init__(self, tensors=None):
        """``tensors``: name -> (numel, ...) as :func:`read` returns them; None or empty:
        nothing to check."""
        self.names = frozenset(tensors) if tensors else None     # None: nothing to check
        self.numels = {name: t[0] for name, t in tensors.items()} if tensors else {}
        self.began = False

    @property
    def pending(self):
        return self.names is not None

    def step_begins(self):
        """A step begins: the check ends when the first step after the load has completed."""
        if self.names is not None:
            self.names, self.began = (None if self.began else self.names), True

    def check(self, names):
        """Raise a ValueError if a loaded state matches none of ``names``, or, where ``names``
        maps each name to the model's element count, if a loaded state has another size (no-op
        when nothing is to check). All of them are checked at once, before any gradient of the
        step is sent (a size checked at its own gradient would stop a step partly sent)."""
        fit = self.names
        if fit is None:
            return
        counts = names if isinstance(names, Mapping) else {}
        names = set(names)
        stale = fit - names
        resized = {n: (self.numels[n], counts[n]) for n in fit & names
                   if counts.get(n) is not None and counts[n] != self.numels[n]}
        if stale or resized:
            raise _misfit(stale, names - fit, resized)

    def check_name(self, name):
        """compress of ``name`` in the first step after a load: it must have a loaded state."""
        fit = self.names
        if fit is not None and name not in fit:
            raise _misfit((), [name])


def _misfit(stale, missing, resized=None):
    def few(names, say=repr):
        names = sorted(names)
        shown = ", ".join(say(n) for n in names[:3])
        return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    parts = []
    if resized:
        parts.append(f"{len(resized)} saved tensor state(s) have another size than the "
                     "parameter (" + few(resized, lambda n: f"{n!r}: {resized[n][0]} elements "
                                         f"saved, {resized[n][1]} now") + ")")
    if stale:
        parts.append(f"{len(stale)} saved tensor state(s) match no parameter of the "
                     f"optimizer ({few(stale)})")
    if missing:
        parts.append(f"{len(missing)} parameter(s) have no saved state ({few(missing)})")
    return ValueError(
        "DGC: the loaded checkpoint does not fit this model: " + "; ".join(parts) + ". Was "
        "it saved under other names (a renamed or wrapped module, e.g. a 'module.' prefix) "
        "or by another model (a resized layer)? Resuming from it would start fresh residuals "
        "under the new names and carry the stale ones into every later checkpoint. Load the "
        "matching file, or load this one with dgc.load_state_dict(state_dict, "
        "reset_residuals=True): config and warm-up position are kept, the residuals "
        "restart at zero")
