"""The DGC algorithm for one worker, on any backend: per-tensor state, compress, decompress.

One gradient's path (Lin et al. 2018, Algorithm 1 with the techniques of §3):

    compress:   g → [non-finite check] → local clip (§3.2: the step's factor s over all of the
                rank's gradients, :meth:`DGCCore.clip_scale`) → [+ λ·w, weight_decay_mode
                "accumulated"] → momentum correction (§3.1): u ← m·u + s·g, v ← v + u → top-k
                of |v| (§5) → encode → clear sent positions of v (and of u: momentum factor
                masking, §3.2)
    exchange:   the framework adapter allgathers the payload (Horovod allgather)
    decompress: decode every rank's payload and sum in rank order → divide by N
                → [+ b, b ← m·b + λ·w: weight_decay_mode "separate", :meth:`apply_weight_decay`]
                → optimizer

How Horovod's conventions map onto Algorithm 1: the paper's node k adds its contribution
∇k = (1/(N·b))·Σ∇f to a *sum*; Horovod hands DGC the rank's mean gradient g_k = N·∇k (and,
under ``op=hvd.Average``, divides the sum by N). Momentum correction and the residual are
linear, so accumulating g_k instead of ∇k and dividing the decoded sum by N gives exactly the
paper's update; only the clipping threshold depends on the convention
(:func:`~dgc_horovod.core.accumulate.clip_threshold`: C·√N under Average, C/√N under Sum).
The authors' reference code applies a dense tensor's momentum after its allreduce, we before
it (the same by linearity; ours lets Horovod's allreduce carry the velocity).

The warm-up (§3.3) counts the optimizer steps DGC sees (:attr:`DGCCore.steps`, saved in
checkpoints) unless ``warmup_epochs`` makes it follow ``set_epoch``.

The sparsified tensors' steps run in an engine (:mod:`dgc_horovod.core.engine`: the C kernels on
tensors in host memory, the Triton kernels on CUDA tensors, tensor ops otherwise; the same bits
on every one): :meth:`DGCCore.compress_many` hands a bucket of them to one engine call
(:mod:`driver`), :meth:`DGCCore.compress` a bucket of one.

Tensors that are not sparsified (:func:`~dgc_horovod.core.sparsify.is_sparse`: by default
those with fewer than 2 dimensions, biases and normalisation scales, as in the reference code)
skip selection: their momentum-corrected velocity (u, or g + m·u with Nesterov) goes through
Horovod's dense allreduce, which by linearity gives exactly momentum SGD on them.

Non-finite gradients: a tensor whose local gradient has NaN/Inf is not accumulated (u and v stay
as they were); with weight decay the gradient checked is g + λ·param, what would be accumulated.
Its rank sends a payload without entries flagged FLAG_NONFINITE (or, for dense tensors, the
NaN gradient itself); every rank then returns NaN for that tensor — as a dense allreduce would —
and the ranks that had sent entries put them back into their residual, so nothing is lost. A
loss-scaling skip (torch.amp GradScaler) therefore skips the step on every rank alike. The scaler
skips the whole step, the tensors whose update was finite too: with ``skip_nonfinite_steps``
(set by the torch adapter when it is given the scaler) a non-finite update, sparsified or dense,
also puts back the entries every finite exchange of the step sent and the separate weight
decay's buffers, whichever tensor's result comes first. A dense tensor's u ← m·u + g of that
step stays (its result was sent as it was computed; the step's g stays in its momentum). The
threshold's samples depend only on (seed, tensor, step) (:mod:`~dgc_horovod.core.sparsify`), so a
non-finite step changes no later draw.

Mixed precision (:mod:`~dgc_horovod.core.precision`): float16 wire values overflow as a dense
float16 exchange does (sent as ±inf: the step is non-finite on every rank alike, as above, and
the rank that overflowed drops its state of the tensor, u and v restart at zero), and under a
loss scaler (:meth:`DGCCore.set_loss_scale`) every tensor's state follows the step's loss scale,
so that the update after unscaling is bit-identical to training without one.
"""
import math
import numbers
import threading
import time
import warnings

from dgc_horovod.core.accumulate import (add_weight_decay, clip_by_local_norm, clip_factor,
                                         clip_threshold, momentum_correction, restore_sent,
                                         squared_norm, weight_decay_momentum)
from dgc_horovod.core import sketch as _sketch
from dgc_horovod.core.checkpoint import STATE_DICT_VERSION, FitCheck
from dgc_horovod.core.config import DGCConfig
from dgc_horovod.core.driver import BucketDriver
from dgc_horovod.core.sparsify import is_sparse
from dgc_horovod.core.state import SparseContext, TensorState
from dgc_horovod.core.stats import PLACEHOLDER_BYTES, StatsRecorder
from dgc_horovod.core.warmup import density_at, density_at_step
from dgc_horovod.core import checkpoint, precision, regions, wire

__all__ = ["DGCCore", "TensorState", "SparseContext", "PLACEHOLDER_BYTES", "STATE_DICT_VERSION"]

_INF = float("inf")

#: In epoch-driven warm-up (warmup_epochs set), DGC warns once when this many steps ran and
#: set_epoch / set_step was never called: the warm-up would then never advance.
EPOCH_CALL_CHECK_STEPS = 1000


def _check_int(what, value, least, why=""):
    """A TypeError unless ``value`` is an int (NumPy's too, not a bool), a ValueError if it is
    below ``least``: as set_epoch and the options do."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int >= {least}, got {type(value).__name__} "
                        f"{value!r}{why}")
    if value < least:
        raise ValueError(f"{what} must be an int >= {least}, got {value!r}{why}")


class DGCCore:
    """Per-worker DGC: owns the config, the warm-up position, every tensor's state and the stats.

    Args:
        config (DGCConfig): the hyper-parameters.
        backend (Backend): tensor operations (NumPy, PyTorch, TensorFlow).

    Thread-safe: compress may be called from autograd threads. The engine of each bucket follows
    ``config.engine`` (:meth:`BucketDriver.engine_for`).
    """

    def __init__(self, config, backend):
        if not isinstance(config, DGCConfig):
            raise TypeError(f"config must be a DGCConfig, got {type(config).__name__}")
        self.config = config
        self.B = backend
        self.states = {}
        self.epoch = 0.0
        self._lock = threading.Lock()
        self._region_sums = {}      # exchange="regions": name -> zeros of this rank's region
        self._sketch_codes = {}     # clip_scope="sketch": name -> int32 codes (core.sketch)
        self._stats = StatsRecorder()
        self._engines = {}      # name -> engine (BucketDriver.engine_for)
        self._steps = 0         # optimizer steps begun (the warm-up position counts them)
        self._epoch_set = False
        self._warned = set()
        self._fit = FitCheck()  # after load_state_dict: the loaded names (check_fit)
        # the loss scale the state is in (set_loss_scale); None: unknown (a version-2
        # checkpoint), the next set_loss_scale adopts its scale without rescaling
        self._loss_scale = 1.0
        self._driver = BucketDriver(self)   # compress_many
        # a non-finite update makes the whole step one the loss scaler skips (decompress):
        # the torch adapter sets it with loss_scaler=GradScaler
        self.skip_nonfinite_steps = False
        self._new_step_records()

    def _new_step_records(self):
        """skip_nonfinite_steps: forget the step's restore records (a new step, a load)."""
        self._kept = []          # (state, positions, v values, u values): entries sent, applied
        self._kept_wd = []       # (state, wd buffer before this step's update)
        self._skipped = False    # this step has had a non-finite update

    # the statistics, counted by the core's StatsRecorder
    step_stats = property(lambda self: self._read_device().step, doc=(
        "The current (or last) step's :class:`~dgc_horovod.core.stats.CompressionStats`."))
    total_stats = property(lambda self: self._read_device().total, doc=(
        "The cumulative :class:`~dgc_horovod.core.stats.CompressionStats` of this rank."))

    # ----------------------------------------------------------------- warm-up
    @property
    def steps(self):
        """Optimizer steps DGC has seen begin on this rank (a step begins at the first compress
        of a tensor seen in the step before, or the first after a load or set_step)."""
        return self._steps

    @property
    def density(self):
        """Density in force now: the warm-up schedule of §3.3 at the current step (the one in
        progress, or the last one between steps), or at the current epoch with
        ``warmup_epochs``."""
        c = self.config
        if c.warmup_epochs is None:
            return density_at_step(max(self._steps - 1, 0), c.compress_ratio, c.warmup_steps,
                                   c.warmup_initial_density, c.warmup_per_step)
        return density_at(self.epoch, c.compress_ratio, c.warmup_epochs,
                          c.warmup_initial_density, c.warmup_per_step)

    def _read_device(self):
        """What an engine on a device left there until now: the decode checks it deferred
        (:meth:`decompress_bucket`: raises their WireFormatError) and the statistics' counts.
        Returns the StatsRecorder."""
        self._driver.check_deferred()
        return self._stats.resolve()

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def _begin(self, name):
        """Called at each compress / compress_many (lock held) with its first tensor's name:
        counts a new step when that tensor was already compressed in this step (or nothing was
        since the last load / set_step)."""
        if self._stats.starts_step(name):
            self._steps += 1
            self._new_step_records()
            self._fit.step_begins()
            if self._epoch_call_checked() and not self._epoch_set \
                    and self._steps > EPOCH_CALL_CHECK_STEPS:
                self._warn_once("epoch", self._epoch_call_missing(f"{self.density:g}"))

    def _epoch_call_checked(self):
        """Whether a warm-up that never gets set_epoch() is warned about (after
        EPOCH_CALL_CHECK_STEPS steps): ``warmup_epochs`` set, and a warm-up that changes the
        density."""
        c = self.config
        return (c.warmup_epochs is not None and c.warmup_epochs > 0
                and c.warmup_initial_density > c.compress_ratio)

    def _epoch_call_missing(self, density):
        """The warning that set_epoch() was never called (:meth:`_epoch_call_checked`), naming
        ``density``, the density still in force as text (a graph passes the placeholder of
        ``tf.strings.format``)."""
        c = self.config
        return (f"DGC: warmup_epochs={c.warmup_epochs} makes the warm-up follow set_epoch(), "
                f"but after {EPOCH_CALL_CHECK_STEPS} steps it was never called: DGC still "
                f"sends density {density} instead of compress_ratio={c.compress_ratio:g}. "
                "Call dgc.set_epoch(epoch) every epoch, or leave warmup_epochs=None to let DGC "
                "count its own steps (warmup_steps)")

    def set_epoch(self, epoch):
        """Set the warm-up position in epochs (float >= 0); call it on every rank alike.

        Only with ``warmup_epochs`` set: by default DGC counts its own steps (``warmup_steps``)
        and this call changes nothing (it warns once)."""
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Real):
            raise TypeError(f"epoch must be a number >= 0, got {type(epoch).__name__} {epoch!r}")
        density_at(epoch, self.config.compress_ratio)  # validates the value
        self.epoch = float(epoch)
        self._epoch_set = True
        if self.config.warmup_epochs is None:
            self._warn_once("set_epoch", (
                "DGC: set_epoch() has no effect on the warm-up: it counts optimizer steps "
                f"(warmup_steps={self.config.warmup_steps}). Pass warmup_epochs=... to make it "
                "follow set_epoch()"))

    def set_step(self, step, steps_per_epoch=None):
        """Set the warm-up position from a global step count (e.g. on resume without a DGC
        checkpoint): with the default step-counted warm-up the next step is step ``step``
        (0-based); with ``warmup_epochs`` the epoch becomes step / steps_per_epoch."""
        _check_int("step", step, 0)
        step = int(step)
        epochs = self.config.warmup_epochs is not None
        if steps_per_epoch is None and epochs:      # missing where it is needed: a ValueError
            raise ValueError("steps_per_epoch must be an int >= 1, got None (needed with "
                             "warmup_epochs)")
        if steps_per_epoch is not None:
            _check_int("steps_per_epoch", steps_per_epoch, 1,
                       " (needed with warmup_epochs)" if epochs else "")
        if not epochs:
            with self._lock:
                self._steps = step
                self._stats.restart()
            return
        self.set_epoch(step / int(steps_per_epoch))

    # ----------------------------------------------------------------- loss scale
    @property
    def loss_scale(self):
        """The loss scale S the state (u, v, wd) is in and the gradients of the current step
        carry: 1.0 unless :meth:`set_loss_scale` set another (see :mod:`precision`)."""
        s = self._loss_scale
        return 1.0 if s is None else s

    def set_loss_scale(self, scale):
        """Tell DGC the loss scale S_t of the step about to begin (a loss scaler's current
        scale); call it between steps, before the step's first compress, on every rank alike.

        When S_t differs from :attr:`loss_scale` S, every tensor's u, v and wd are multiplied by
        S_t/S (exact when both are powers of two), so the state is in the units of the step's
        gradients; clipping compares the unscaled norm (threshold T·S_t) and weight decay adds
        λ·S_t·w. After a division by S_t (GradScaler.unscale_) the update is then the one DGC
        gives without loss scaling (the equations: :mod:`precision`). A tensor whose state
        becomes non-finite is dropped (zeroed, one warning). After loading a version-2
        checkpoint (no recorded scale) the first call adopts S_t without rescaling.

        Args: scale (float): S_t, a finite number > 0.
        Raises: ValueError: scale is not a finite number > 0 (nothing changes).
        """
        try:
            value = float(scale) if not isinstance(scale, (bool, str)) else None
        except (TypeError, ValueError):
            value = None
        if value is None or not 0.0 < value < _INF:
            raise ValueError(f"DGC: the loss scale must be a finite number > 0, got "
                             f"{type(scale).__name__} {scale!r}")
        scale = value
        with self._lock:
            previous, self._loss_scale = self._loss_scale, scale
            if previous is None or previous == scale:
                return
            for st in precision.rescale(self.B, self.states.values(), scale / previous):
                self._warn_once("rescale_overflow", (
                    f"DGC: rescaling the state of {st.name!r} from loss scale {previous:g} "
                    f"to {scale:g} overflowed float32: its u and v restart at zero (a "
                    "one-off loss of its unsent gradient on this rank)"))

    # ----------------------------------------------------------------- checkpoint / resume
    def state_dict(self, world_size=None, rank=None):
        """Everything needed to resume this worker bit-identically, as a plain dict.

        Call it between steps (not between a compress and its decompress). The dict holds copies,
        so later training does not change it. Its tensors are backend tensors (float32 u and v);
        the rest is Python scalars, strings and dicts, so ``torch.save`` /
        ``torch.load(weights_only=True)`` or pickle can store it.

        Args:
            world_size (int or None), rank (int or None): the job this state belongs to. The
                residuals are per rank, so :meth:`load_state_dict` checks them.
        Returns:
            dict with keys: version (STATE_DICT_VERSION), config (DGCConfig.to_dict()), epoch,
            steps (optimizer steps begun: the warm-up position), loss_scale (the loss scale u, v
            and wd are in, :meth:`set_loss_scale`; None after loading a version-2 checkpoint,
            until the next set_loss_scale), world_size, rank, tensors
            ({name: {numel, ndim, sparse, u, v, wd}}; u is None with momentum 0, v is None for
            dense tensors, wd is the separate weight decay's momentum buffer or None),
            total_stats and step_stats (CompressionStats counters as dicts).
        """
        with self._lock:
            return checkpoint.make(self.B, self.config, self.epoch, self._steps, world_size,
                                   rank, self.states, self._read_device(), self._loss_scale)

    def load_state_dict(self, state_dict, world_size=None, rank=None, reset_residuals=False):
        """Restore what :meth:`state_dict` returned; all checks run before anything changes.

        Args:
            state_dict (dict): from :meth:`state_dict` (possibly through torch.save/torch.load;
                tensors are converted with the backend's ``float32_flat``, on their device).
            world_size (int or None), rank (int or None): the job loading it. When both the
                checkpoint and the caller give them and they differ, loading is refused, since
                a residual belongs to the rank that accumulated it.
            reset_residuals (bool): keep config, warm-up position and statistics but drop
                every tensor's velocity u and residual v (they restart at zero). Allowed with a
                different world size or rank. The dropped residual is gradient that was never
                applied: a small one-off perturbation of training.
        Raises:
            ValueError: a different config (the message names the differing keys), a different
                world size or rank (without reset_residuals), or a malformed state dict.
            TypeError: state_dict is not a dict.

        The tensor names are checked against the model's at the first step after the load (the
        adapter knows the model then): a loaded state whose name matches no parameter, or a
        parameter compressed without a loaded state, raises a ValueError there naming a few of
        each (:meth:`check_fit`), until the checkpoint is loaded with reset_residuals=True.
        """
        tensors, epoch, steps, stats, loss_scale = checkpoint.read(
            self.B, self.config, state_dict, world_size, rank, reset_residuals)
        with self._lock:
            self.states = {name: TensorState(name, *t) for name, t in tensors.items()}
            self._driver = BucketDriver(self)
            self._new_step_records()
            self.epoch = epoch
            self._steps = steps
            self._stats = stats
            self._fit = FitCheck(tensors)
            self._loss_scale = loss_scale

    @property
    def fit_pending(self):
        """True from a :meth:`load_state_dict` with tensor states until the first step after it
        has completed: the adapter then calls :meth:`check_fit`."""
        return self._fit.pending

    def check_fit(self, names):
        """After :meth:`load_state_dict`, until the first step after it has completed: raise a
        ValueError if a loaded tensor state matches none of ``names``, the names of every
        parameter the optimizer reduces (a checkpoint of another model, or saved under other
        names), or, where ``names`` maps each name to its parameter's element count, if a loaded
        state has another size (a resized layer); the adapter calls it at the step's first
        gradient, before anything of the step is sent. A name compressed in that step without a
        loaded state is refused by compress itself. No-op otherwise. Changes nothing."""
        self._fit.check(names)

    # ----------------------------------------------------------------- state and checks
    def _state(self, name, grad):
        """The tensor's state, made at its first compress (after the size checks)."""
        numel = self.B.numel(grad)
        st = self._sized(name, numel)
        if st is None:
            ndim = self.B.ndim(grad)
            sparse = is_sparse(numel, ndim, self.config)
            u = self.B.zeros(numel, like=grad) if self.config.momentum > 0 else None
            v = self.B.zeros(numel, like=grad) if sparse else None
            st = self.states[name] = TensorState(name, numel, sparse, u, v, ndim)
        return st

    def _sized(self, name, numel):
        """The tensor's state, or None for a new one, once its gradient's size (numel) is
        checked: against the state's, or (new) against what the wire format can carry."""
        st = self.states.get(name)
        if st is None:
            wire.check_numel(numel, name)
        elif st.numel != numel:
            raise ValueError(f"gradient of {name!r} has {numel} elements, but its DGC state was "
                             f"created for {st.numel}")
        return st

    def check_floating(self, name, grad):
        """A TypeError naming ``name`` unless ``grad`` is a floating-point tensor."""
        if not self.B.is_floating(grad):
            raise TypeError(f"DGC: the gradient of {name!r} must be a floating-point tensor, "
                            f"got dtype {getattr(grad, 'dtype', type(grad))}")

    def _check_args(self, name, grad, param):
        """The argument checks of :meth:`compress` that need no state: dtype, a parameter when
        weight decay needs it, and after a load, a loaded state (:meth:`check_fit`)."""
        self._fit.check_name(name)
        self.check_floating(name, grad)
        if self.needs_param:
            if param is None:
                raise ValueError(f"DGC: weight_decay={self.config.weight_decay} needs the "
                                 f"parameter of {name!r} (param=...), got None")
            if self.B.numel(param) != self.B.numel(grad):
                raise ValueError(f"DGC: the parameter of {name!r} has {self.B.numel(param)} "
                                 f"elements, its gradient {self.B.numel(grad)}: they must match "
                                 "(weight_decay adds λ·param to the gradient)")

    def check_entry(self, name, grad, param=None):
        """Raise what :meth:`compress` would raise for this entry (the size against the tensor's
        state included) without touching any state: compress_many runs them all before it
        changes anything, and an adapter that defers a tensor to a bucket runs them at once."""
        self._check_args(name, grad, param)
        self._sized(name, self.B.numel(grad))

    def _check_scale(self, clip_scale):
        if not self.needs_clip_scale:
            return
        if clip_scale is None:
            raise ValueError("DGC: clip_scope='global' needs the step's clipping factor: pass "
                             "clip_scale=core.clip_scale(<all of this rank's gradients of the "
                             "step>, world_size, average)")
        if isinstance(clip_scale, bool) or not 0.0 <= float(clip_scale) <= 1.0:
            raise ValueError(f"DGC: clip_scale must be a float in [0, 1], got {clip_scale!r}")

    # ----------------------------------------------------------------- compress
    # the steps in order: check, clip, accumulate, select, mask, encode (then decompress)
    def compress(self, name, grad, world_size, param=None, average=True, clip_scale=None):
        """Accumulate a local gradient and produce what goes on the wire.

        Args:
            name (str): the tensor's name, identical on every rank.
            grad: gradient tensor of the backend, any shape, floating dtype.
            world_size (int): N, ranks taking part (for clipping).
            param: the parameter (same shape), needed only with weight_decay > 0 and
                ``weight_decay_mode="accumulated"``.
            average (bool): the reduction is Horovod's Average (True) or Sum (False): it sets
                the local clipping threshold (:func:`~dgc_horovod.core.accumulate.clip_threshold`).
            clip_scale (float or None): with ``clip_scope="global"`` and clip_norm set, this
                rank's clipping factor of the step, from :meth:`clip_scale` over all of its
                gradients of the step (required then); ignored otherwise.
        Returns:
            ("dense", flat float32 tensor to allreduce, None) for small tensors, or
            ("sparse", flat int32 payload to allgather, SparseContext).
        Raises:
            TypeError: grad is not a floating tensor. ValueError: its size changed, it has more
            than 2**31-1 elements, or param is None with weight_decay > 0. In all these cases no
            state is modified.
        """
        return self._driver.compress_many([(name, grad, param)], world_size, average,
                                          clip_scale)[0]

    def compress_many(self, entries, world_size, average=True, clip_scale=None):
        """Compress several gradients at once (a bucket): the same results and state as
        ``[self.compress(name, grad, world_size, param) for name, grad, param in entries]``
        (a tensor's selection depends only on its own state, seed, name and step), with one
        engine call for all the sparsified ones (:mod:`driver`).

        Args:
            entries: sequence of (name, grad, param) tuples (param None unless weight_decay > 0);
                names must be distinct.
            world_size (int): N, ranks taking part. average, clip_scale: as :meth:`compress`
                (one clip_scale for the whole step).
        Returns:
            list of the :meth:`compress` results, in the order of ``entries``. The statistics'
            compress_seconds of the sparsified tensors is the engine call's time shared by
            element count.
        Raises:
            TypeError / ValueError: as :meth:`compress` (a non-floating gradient, a changed size,
            a repeated name); every entry is checked before any state changes.
        """
        return self._driver.compress_many(entries, world_size, average, clip_scale)

    def _compress_dense(self, st, grad, world_size, param, t0, average, clip_scale):
        """The body of :meth:`compress` for a tensor that is not sparsified (lock held): clip,
        check, then its velocity for the dense allreduce, a new
        tensor v = 0 + u after u ← m·u + s·g (classic; Nesterov v = s·g + m·u). This path
        makes one of these per gradient, many per step (ResNet-50: 107 biases and
        normalisation scales), so it goes straight to these steps."""
        B, c = self.B, self.config
        density = self.density
        g, scale = self._accumulated(B.float32_view(grad), param, world_size, average,
                                     clip_scale)
        if not B.all_finite(g):     # sent as it is: every rank's result is then NaN
            self._stats.count(st, 0, 4 * st.numel, True, time.perf_counter() - t0, density)
            return "dense", B.float32_flat(g), None
        v = B.zeros(st.numel, like=g)
        momentum_correction(B, st.u, v, g, c.momentum, c.nesterov, scale)
        self._stats.count_dense(st, time.perf_counter() - t0, density)
        return "dense", v, None

    @property
    def needs_clip_scale(self):
        """True when compress needs the step's ``clip_scale`` (clip_norm with scope "global" or
        "sketch")."""
        return self.config.clip_norm is not None and self.config.clip_scope != "tensor"

    @property
    def needs_sketch(self):
        """True when the step's ``clip_scale`` comes from the ranks' sketches
        (``clip_scope="sketch"``: :meth:`sketch`, an allgather, :meth:`clip_scale_of_sketches`)."""
        return self.config.clip_norm is not None and self.config.clip_scope == "sketch"

    def sketch(self, named_grads):
        """R_k, this rank's float32 sketch (:data:`~dgc_horovod.core.sketch.WIDTH`,) of the
        step's gradients: ``named_grads`` (name, gradient) of all of them, dense and sparsified,
        in plan order (:func:`~dgc_horovod.core.sketch.sketch`; tensors with NaN/Inf left out).
        Each tensor's codes are computed once and kept (4 bytes per element)."""
        B, entries = self.B, []
        for name, g in named_grads:
            n = B.numel(g)
            c = self._sketch_codes.get(name)
            if c is None or B.numel(c) != n:
                c = B.to_int32(_sketch.codes(B, name, n, g))
                self._sketch_codes[name] = c
            entries.append((g, c))
        return _sketch.sketch(B, entries, named_grads[0][1])

    def clip_scale_of_sketches(self, rows, world_size, average=True):
        """The dense clip factor of the step from the N ranks' sketches ``rows`` (rank order):
        s = min(1, C / (‖ḡ‖/S + 1e-6)) with ‖ḡ‖ = √Q/N under Average, √Q under Sum
        (:func:`~dgc_horovod.core.sketch.estimate`; S the loss scale): the same on every rank.
        Counts the sketches' allgather in the stats
        (:func:`~dgc_horovod.core.sketch.sketch_bytes`). 1.0 when clip_norm is None."""
        c = self.config
        if c.clip_norm is None:
            return 1.0
        sent, received = _sketch.sketch_bytes(world_size)
        self.add_wire_bytes(sent, received=received)
        norm = math.sqrt(_sketch.estimate(rows))
        if average:
            norm /= world_size
        return clip_factor(norm / self.loss_scale, c.clip_norm)

    def clip_scale(self, grads, world_size, average=True):
        """This rank's local clipping factor of the step (§3.2, ``clip_scope="global"``).

        s = min(1, T / (‖G_k‖ + 1e-6)) with ‖G_k‖ the global L2 norm over ``grads`` (all of this
        rank's gradients of the step, dense and sparsified, in a fixed order; tensors with
        NaN/Inf left out, see :func:`~dgc_horovod.core.accumulate.global_norm`) and T the
        threshold of :func:`~dgc_horovod.core.accumulate.clip_threshold` (C·√N under Average,
        C/√N under Sum). On iid gradients this clips as often and as much as a dense
        ``clip_grad_norm_(C)`` of the averaged gradient. 1.0 when clip_norm is None. Under a
        loss scale S (:meth:`set_loss_scale`) the unscaled norm ‖G_k‖/S is compared with T.
        """
        if self.needs_sketch:
            raise ValueError("DGC: clip_scope='sketch' takes its factor from the ranks' "
                             "sketches: core.sketch(...), an allgather, "
                             "core.clip_scale_of_sketches(...), not clip_scale")
        return self.clip_scale_of_squares([squared_norm(self.B, grads)], world_size, average)

    def clip_scale_of_squares(self, squares, world_size, average=True):
        """The factor of :meth:`clip_scale` from squared norms already taken: s = min(1,
        T / (sqrt(Σ squares)/S + 1e-6)), the float ``squares`` summed in the order given (the
        hierarchical exchange's node norm from its ranks' parts,
        :func:`~dgc_horovod.core.hierarchical.clip_part`). 1.0 when clip_norm is None."""
        c = self.config
        if c.clip_norm is None:
            return 1.0
        total = 0.0
        for q in squares:
            total += float(q)
        return clip_factor(math.sqrt(total) / self.loss_scale,
                           clip_threshold(c.clip_norm, world_size, average))

    def _accumulated(self, g, param, world_size, average=True, clip_scale=None):
        """(gradient, clipping scale still to apply) that momentum correction accumulates, from
        the flat float32 gradient g: g with its local clipping factor (§3.2: the step's global
        factor ``clip_scale``, or with ``clip_scope="tensor"`` g's own), or with accumulated
        weight decay the new tensor scale·g + λ·param and 1.0."""
        B, c = self.B, self.config
        if c.clip_norm is None:
            scale = 1.0
        elif c.clip_scope == "tensor":
            scale = clip_by_local_norm(B, g, c.clip_norm, world_size, average, self.loss_scale)
        else:
            scale = float(clip_scale)
        if self.needs_param:
            return add_weight_decay(B, g, B.float32_view(param),
                                    c.weight_decay * self.loss_scale, scale), 1.0
        return g, scale

    @property
    def needs_param(self):
        """True when compress needs each gradient's parameter (weight decay accumulated into the
        gradient, ``weight_decay_mode="accumulated"``)."""
        c = self.config
        return bool(c.weight_decay) and c.weight_decay_mode == "accumulated"

    @property
    def separate_weight_decay(self):
        """True when :meth:`apply_weight_decay` adds weight decay after the exchange
        (weight_decay > 0 with ``weight_decay_mode="separate"``)."""
        c = self.config
        return bool(c.weight_decay) and c.weight_decay_mode == "separate"

    def apply_weight_decay(self, name, update, param):
        """``weight_decay_mode="separate"``: add the weight decay term to the exchanged update of
        ``name`` in place (:func:`~dgc_horovod.core.accumulate.weight_decay_momentum`: its own
        momentum buffer b ← m·b + λ·w, update += b; λ·S·w under a loss scale S,
        :meth:`set_loss_scale`) and return it; a no-op otherwise, and for a non-finite update (a
        step a loss scaler will skip leaves b untouched). Under ``skip_nonfinite_steps`` b is
        kept as it was until the step ends, and put back if the step has a non-finite update
        (:meth:`decompress`); in such a step it is not updated any more.

        Args: name (str): a tensor compressed this step. update: flat float32 tensor (the
            decompressed average, or the dense allreduce result). param: the parameter.
        """
        if not self.separate_weight_decay:
            return update
        c, B = self.config, self.B
        if B.numel(param) != B.numel(update):
            raise ValueError(f"DGC: the parameter of {name!r} has {B.numel(param)} elements, "
                             f"its update {B.numel(update)}")
        if self._skipped or not B.all_finite(update):
            return update
        w = B.float32_view(param)
        with self._lock:
            st = self.states[name]
            if self.skip_nonfinite_steps:       # put back if a later update is non-finite
                self._kept_wd.append((st, None if st.wd is None else B.float32_flat(st.wd)))
            if st.wd is None and c.momentum > 0:
                st.wd = B.zeros(st.numel, like=update)
            return weight_decay_momentum(B, update, st.wd, w, c.weight_decay * self.loss_scale,
                                         c.momentum, c.nesterov)

    def finish_update(self, name, update, param):
        """The adapter's last step on the reduced update of ``name`` (either kind of tensor):
        under ``skip_nonfinite_steps`` a dense tensor's non-finite update makes the step skipped
        (:meth:`decompress` checks the sparsified ones); then :meth:`apply_weight_decay`."""
        if self.skip_nonfinite_steps and not self._skipped:
            st = self.states.get(name)
            if st is not None and not st.sparse and not self.B.all_finite(update):
                with self._lock:
                    self._skip_step()
        return self.apply_weight_decay(name, update, param)

    def _keep_sent(self, ctx, summed):
        """``skip_nonfinite_steps``, after a finite decode of ``ctx``'s tensor: what restores the
        entries this rank sent and the sum applied (all of them; with ``exchange="regions"``
        those where ``summed``, the sum before any 1/N, is non-zero: the others went back in
        keep_unapplied or stay with their region's owner) is kept until the step ends, or
        used at once when the step has already had a non-finite update."""
        if not self.skip_nonfinite_steps or ctx.indices is None:
            return
        B = self.B
        idx, vals, u_sent = ctx.indices, ctx.values, ctx.u_sent
        if self.config.exchange == "regions" and B.numel(idx):
            applied = B.take(summed, idx) != 0
            idx, vals = B.mask(idx, applied), B.mask(vals, applied)
            u_sent = None if u_sent is None else B.mask(u_sent, applied)
        st = self.states[ctx.name]
        with self._lock:
            if self._skipped:
                restore_sent(B, st.u, st.v, idx, vals, u_sent)
            else:
                self._kept.append((st, idx, vals, u_sent))

    def _skip_step(self):
        """(Lock held.) The step has a non-finite update, which the loss scaler skips on every
        rank: put back what this rank's finite exchanges of the step took out of its state (the
        entries sent, their momentum, the separate weight decay's buffers)."""
        for st, idx, vals, u_sent in self._kept:
            restore_sent(self.B, st.u, st.v, idx, vals, u_sent)
        for st, wd in self._kept_wd:
            st.wd = wd
        self._kept, self._kept_wd, self._skipped = [], [], True

    def add_wire_bytes(self, nbytes, received=0):
        """Count bytes sent outside a tensor's payload in the stats: bucket framing, or the
        placeholders of Horovod's allreduce for tensors DGC allreduces itself (which that
        allreduce also returns: pass them as ``received`` too)."""
        with self._lock:
            self._stats.add_wire_bytes(nbytes, received)

    def count_hierarchical(self, node=(0, 0), cross=(0, 0)):
        """``exchange="hierarchical"``: count bytes (sent, received) of DGC's collectives inside
        the node (``node``) and across nodes (``cross``: the payload compress returned, sent to
        the other nodes, and theirs received) in the stats, in the node_* / cross_node_* fields
        and in wire_bytes / received_bytes (where compress counted the payload already)."""
        with self._lock:
            self._stats.count_hierarchical(node, cross)

    def discard_sent(self, ctx):
        """``exchange="hierarchical"``: the whole update of ``ctx``'s tensor is non-finite
        although this rank's shard of it decoded finite (another shard's float16 value
        overflowed): put back what this rank sent, as :meth:`decompress` does for a non-finite
        decode (under ``skip_nonfinite_steps``, with every other exchange of the step)."""
        st = self.states[ctx.name]
        with self._lock:
            if self.skip_nonfinite_steps:
                if not self._skipped:       # restores ctx's entries with the step's others
                    self._skip_step()
            elif ctx.indices is not None:
                restore_sent(self.B, st.u, st.v, ctx.indices, ctx.values, ctx.u_sent)

    def count_allgather(self, output_words, input_words):
        """Count what this rank received by one allgather of int32 words in the stats: Horovod's
        allgather returns every rank's input concatenated, so the rank received the output but
        its own input (``output_words - input_words`` words)."""
        with self._lock:
            self._stats.count_allgather(output_words, input_words)

    def reduce_region(self, gathered, name, numel, rank, world_size, count=None):
        """``exchange="regions"``, steps 3-4 of :mod:`dgc_horovod.core.regions` on the owner of
        region ``rank`` of tensor ``name``: (the payload to allgather or None, the dropped sums
        to hand to :meth:`decompress`). ``gathered``: the ``count`` (default N) payloads the
        ranks sent for the region (alltoall), in rank order."""
        c = self.config
        lo, hi = regions.bounds(numel, world_size)[rank]
        scratch = self._region_sums.get(name)
        if scratch is None or self.B.numel(scratch) != hi - lo:     # kept zero between calls
            scratch = self._region_sums[name] = self.B.zeros(hi - lo, like=gathered)
        return regions.reduce_region(self.B, gathered, numel, (lo, hi),
                                     world_size if count is None else count, self.density, name,
                                     c.wire_index, c.wire_values, scratch)

    def keep_unapplied(self, ctx, summed, dropped):
        """``exchange="regions"``, after a finite step (step 5 of :mod:`dgc_horovod.core.regions`):
        this rank's dropped sums into v, and the momentum of what it sent but was not applied
        back into u. ``summed``: the decoded phase-2 sum of the tensor, before any 1/N.
        :meth:`decompress` calls it; a caller that decodes once for several ranks (the
        simulated cluster) calls it for the others."""
        st = self.states[ctx.name]
        with self._lock:
            regions.keep_unapplied(self.B, st.u, st.v, summed, ctx.indices, ctx.u_sent, dropped)

    def decompress_bucket(self, gathered, world_size, members, name, contexts, average=True):
        """Decode an allgathered bucket: ``world_size`` ranks' frames
        (:func:`wire.frame_bucket`) of a bucket of ``members`` tensors named ``name``, for the
        sparsified members this rank compressed, ``contexts`` = {member index: (ctx, out)}
        (ctx: the :meth:`compress_many` context, out: as :meth:`decompress`'s). Returns
        {member index: the flat float32 update}, each what :meth:`decompress` returns for it.

        An engine that decodes a whole bucket on its device (the Triton engine's
        ``decode_bucket``) does so in one go, reading nothing back: a non-finite member is NaN
        there and this rank's entries go back into its state on the device; a malformed frame
        is NaN too, and raises :class:`~dgc_horovod.core.wire.WireFormatError` at the bucket's
        first decode and otherwise when DGC next reads its device counters (:attr:`step_stats`,
        :attr:`total_stats`, :meth:`state_dict`). Any other engine splits the bucket
        (:meth:`split_bucket`) and decodes member after member (:meth:`decompress`)."""
        decoded = self._driver.decompress_bucket(gathered, world_size, name, contexts, average)
        if decoded is not None:
            return decoded
        B = self.B
        parts = self.split_bucket(gathered, world_size, members, name)
        out = {}
        for m, (ctx, into) in contexts.items():
            got = parts[m]
            out[m] = self.decompress(B.cat(got) if got else B.int32_tensor([], like=gathered),
                                     ctx, world_size, average, len(got), into)
        return out

    def split_bucket(self, gathered, world_size, members, name):
        """An allgathered bucket cut into its members' payloads (:func:`wire.split_bucket`, the
        same arguments after the backend and the same result): the engine's walk where it has
        one (the C kernels), the tensor ops' otherwise."""
        engine = self._driver.engine_for(gathered)
        if hasattr(engine, "split_bucket"):
            return engine.split_bucket(gathered, world_size, members, name)
        return wire.split_bucket(self.B, gathered, world_size, members, name)

    def decompress(self, gathered, ctx, world_size, average=True, ranks=None, out=None,
                   dropped=None):
        """Decode the allgathered payloads of a sparsified tensor into the dense update.

        The engine's decode (:mod:`dgc_horovod.core.engine`: every rank's payload checked and
        added in rank order, then times float32(1/N)); the same bits on every engine.

        Args:
            gathered: flat int32 tensor, Horovod's allgather of every rank's payload.
            ctx (SparseContext): returned by :meth:`compress` for this tensor.
            world_size (int): N, ranks in the job. average (bool): divide the sum by N.
            ranks (int or None): payloads in ``gathered`` (default N; fewer when a rank sent
                nothing for this tensor in a bucket).
            out: None, or a flat float32 tensor of ctx.numel elements that receives the result
                (the gradient's own storage, once compress has consumed it: no allocation).
            dropped: ``exchange="regions"``: what :meth:`reduce_region` dropped on this rank
                (or None). With that exchange, after a finite step the dropped sums join v and
                the momentum of sent but unapplied entries is put back
                (:func:`dgc_horovod.core.regions.keep_unapplied`).
        Returns:
            flat float32 tensor of ctx.numel elements, identical on every rank; all NaN if any
            rank's gradient was non-finite or any rank sent a non-finite value (float16
            overflow); this rank's sent entries are then put back into v (and u), unless it
            overflowed itself (its state of the tensor was dropped, see the module docstring).
            With ``skip_nonfinite_steps`` (the torch adapter under a GradScaler, which then skips
            the whole step) a non-finite result also puts back what every other exchange of
            this step took out of this rank's state, before and after it: the entries sent by
            the tensors whose result was finite, and the separate weight decay's buffers.
        Raises:
            WireFormatError: a malformed payload (names tensor and rank).
        """
        B = self.B
        ranks = world_size if ranks is None else ranks
        scale = average and world_size > 1
        regional = self.config.exchange == "regions"    # keep_unapplied needs the sum first
        # every engine's decode zeroes its output first: no zeros of our own when one runs
        dense = out if out is not None else (B.empty(ctx.numel, "float32", like=gathered)
                                             if ranks else B.zeros(ctx.numel, like=gathered))
        if out is not None and B.numel(out) != ctx.numel:
            raise ValueError(f"decompress: out has {B.numel(out)} elements, tensor "
                             f"{ctx.name!r} {ctx.numel}")
        nonfinite = False
        if ranks:
            engine = self._driver.engine_for(gathered, dense)
            nonfinite = engine.decode(gathered, ctx.numel, ranks, dense,
                                      1.0 / world_size if scale and not regional else None,
                                      ctx.name)
        elif out is not None:
            B.zero_(dense)
        if nonfinite:
            st = self.states[ctx.name]
            with self._lock:
                if ctx.indices is not None:
                    restore_sent(B, st.u, st.v, ctx.indices, ctx.values, ctx.u_sent)
                if self.skip_nonfinite_steps:
                    self._skip_step()
            B.mul_(dense, float("nan"))
            return dense
        if regional:
            self.keep_unapplied(ctx, dense, dropped)
        self._keep_sent(ctx, dense)
        if regional and scale:
            B.mul_(dense, 1.0 / world_size)     # the same bits as only where a rank sent
        return dense
