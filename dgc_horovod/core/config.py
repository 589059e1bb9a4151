"""Hyper-parameters of Deep Gradient Compression, validated once (`DGCConfig`).

Every option can also be set, Horovod-style, by an environment variable ``HOROVOD_DGC_<OPTION>``
(upper case: ``HOROVOD_DGC_COMPRESS_RATIO``, ``HOROVOD_DGC_MOMENTUM``, ...), which ``horovodrun``
passes on to every rank like Horovod's own ``HOROVOD_*`` variables. Precedence: a keyword
argument given explicitly > the environment variable > the built-in default.
"""
import math
import numbers
import os

__all__ = ["DGCConfig", "config_diff"]

#: Prefix of the environment variables: option ``compress_ratio`` is ``HOROVOD_DGC_COMPRESS_RATIO``.
ENV_PREFIX = "HOROVOD_DGC_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _real(value):
    """A real number that is not a bool (Python's or NumPy's scalars: numpy.float32, numpy.int64
    ... are numbers.Real)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_fraction(name, value):
    if not _real(value):
        raise TypeError(f"{name} must be a float in (0, 1], got {type(value).__name__} {value!r}")
    value = float(value)
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def _check_nonneg(name, value, allow_none=False, upper=None):
    if value is None and allow_none:
        return None
    if not _real(value):
        raise TypeError(f"{name} must be a non-negative number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if upper is not None and not value < upper:
        raise ValueError(f"{name} must be < {upper}, got {value!r}")
    return value + 0.0                  # -0.0 is 0.0


def _check_int(name, value, minimum, maximum=None):
    form = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {form}, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {form}, got {value!r}")
    return value


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _clip_norm(name, value):
    try:
        checked = _check_nonneg(name, value, allow_none=True)
    except ValueError:
        checked = 0.0                       # < 0, inf or NaN: refused as 0 is, in one message
    if checked == 0.0:
        raise ValueError(f"{name} must be a finite number > 0 (or None to disable clipping), "
                         f"got {value!r}")
    return checked


def _parse_bool(text):
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


def _parse_optional_float(text):
    return None if text.lower() == "none" else float(text)


def _warmup_epochs(name, value):
    return _check_nonneg(name, value, allow_none=True)


_BOOL_FORM = "a boolean: 1, true, yes, on or 0, false, no, off"
_INDEX = ("delta16", "int32")
_VALUES = ("float32", "float16")
_CLIP_SCOPES = ("global", "tensor", "sketch")
_WD_MODES = ("separate", "accumulated")
_EXCHANGES = ("allgather", "regions", "hierarchical")
_ENGINES = ("auto", "c", "triton", "ops")
#: Options that change how a rank computes, never what: left out of the comparisons of
#: :func:`config_diff` (checkpoints, ranks of one job).
LOCAL_OPTIONS = ("engine",)
#: Options a checkpoint loaded with ``reset_residuals=True`` may change: they decide how each
#: rank's residuals are laid out (the whole tensor, or its shard of the node's gradient), and
#: those restart at zero; the warm-up position and the statistics mean the same under each.
RESETTABLE_OPTIONS = ("exchange",)

#: The largest seed (a signed 64-bit integer, as earlier versions took; sparsify.seed_key hashes it).
SEED_MAX = 2 ** 63 - 1

# option: (default, check(name, value) -> value, parse(text) -> value, the environment form)
_OPTIONS = {
    "compress_ratio": (0.004, _check_fraction, float, "a float in (0, 1]"),
    "momentum": (0.9, lambda n, v: _check_nonneg(n, v, upper=1.0), float, "a float in [0, 1)"),
    "nesterov": (False, _check_bool, _parse_bool, _BOOL_FORM),
    "momentum_masking": (True, _check_bool, _parse_bool, _BOOL_FORM),
    "clip_norm": (None, _clip_norm, _parse_optional_float,
                  "a finite float > 0, or none to disable clipping"),
    "clip_scope": ("global", lambda n, v: _check_choice(n, v, _CLIP_SCOPES), str.lower,
                   "one of global, tensor, sketch"),
    "weight_decay": (0.0, _check_nonneg, float, "a finite float >= 0"),
    "weight_decay_mode": ("separate", lambda n, v: _check_choice(n, v, _WD_MODES), str.lower,
                          "one of separate, accumulated"),
    "sample_ratio": (0.01, _check_fraction, float, "a float in (0, 1]"),
    "exact_topk": (False, _check_bool, _parse_bool, _BOOL_FORM),
    "min_sparse_numel": (1, lambda n, v: _check_int(n, v, 1), int, "an int >= 1"),
    "min_sparse_ndim": (2, lambda n, v: _check_int(n, v, 1), int, "an int >= 1"),
    "warmup_steps": (1000, lambda n, v: _check_int(n, v, 0), int, "an int >= 0"),
    "warmup_epochs": (None, _warmup_epochs, _parse_optional_float,
                      "a finite float >= 0, or none to count the warm-up in steps"),
    "warmup_initial_density": (0.25, _check_fraction, float, "a float in (0, 1]"),
    "warmup_per_step": (False, _check_bool, _parse_bool, _BOOL_FORM),
    "seed": (0, lambda n, v: _check_int(n, v, 0, SEED_MAX), int, f"an int in [0, {SEED_MAX}]"),
    "wire_index": ("delta16", lambda n, v: _check_choice(n, v, _INDEX), str.lower,
                   "one of delta16, int32"),
    "wire_values": ("float32", lambda n, v: _check_choice(n, v, _VALUES), str.lower,
                    "one of float32, float16"),
    "bucket_numel": (2 ** 22, lambda n, v: _check_int(n, v, 0), int, "an int >= 0"),
    "exchange": ("allgather", lambda n, v: _check_choice(n, v, _EXCHANGES), str.lower,
                 "one of allgather, regions, hierarchical"),
    "engine": ("auto", lambda n, v: _check_choice(n, v, _ENGINES), str.lower,
               "one of auto, c, triton, ops"),
}


class _Default:
    """Marks a keyword argument that was not given; shows as its built-in default."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return "2**22" if self.value == 2 ** 22 else repr(self.value)


_D = {name: _Default(spec[0]) for name, spec in _OPTIONS.items()}


class DGCConfig:
    """Every knob of DGC in one validated, printable object.

    Args:
        compress_ratio (float): target density after warm-up, the fraction of each sparsified
            tensor's elements sent per step, in (0, 1]. Default 0.004 (99.6% sparsity): in our
            convergence study (docs/accuracy.md) the paper's 0.001 (99.9%, Lin et al. 2018, §1)
            cost accuracy at N = 4 on both tasks (MNIST −1.1 points, LM perplexity +4.9% beyond
            what DGC costs at density 1), 0.004 nothing measurable; it sends about 4× the bytes
            (ResNet-50 124× less than dense fp32 instead of 277×). 1.0 sends everything: with
            momentum_masking=False, DGC + plain SGD is then dense momentum SGD (with masking, plain SGD: u is cleared every step).
        momentum (float): momentum m of momentum correction, u ← m·u + g, v ← v + u (§3.1,
            eq. 5–6), in [0, 1). 0 gives plain error feedback (gradient dropping with residual
            accumulation), the mode for optimizers such as Adam. When > 0 the wrapped optimizer
            must not apply momentum itself.
        nesterov (bool): Nesterov variant of momentum correction: v ← v + g + m·u after
            u ← m·u + g (matches `torch.optim.SGD(nesterov=True)` at compress_ratio 1.0).
        momentum_masking (bool): momentum factor masking (§3.2): zero u as well as v at the
            positions that were sent, so stale momentum does not push them again.
        clip_norm (float or None): local gradient clipping (§3.2), None (default) disables it.
            The threshold C is that of dense clipping of the *averaged* gradient
            (``torch.nn.utils.clip_grad_norm_(..., C)`` after Horovod's average). The paper clips
            each node's contribution to the sum, ∇k = (1/(N·b))·Σ∇f, to ‖∇k‖ ≤ C·N^(-1/2);
            Horovod hands DGC the rank's mean gradient g_k = N·∇k, so under ``op=hvd.Average``
            the rule is ‖g_k‖ ≤ C·√N and under ``op=hvd.Sum`` (where g_k itself is the
            contribution) ‖g_k‖ ≤ C/√N. Units: those of the gradient.
        clip_scope (str): "global" (default, the paper): one factor per rank and step from the
            L2 norm over all of the rank's gradients of the step (Pascanu et al.), so every
            tensor is scaled alike and the update keeps its direction; the PyTorch adapter then
            compresses a step's buckets once its last gradient has arrived. "tensor": each
            tensor is clipped by its own norm against the same threshold (no waiting, but the
            update's direction changes). "sketch" (PyTorch, experimental, issue #42): the
            dense rule instead of the paper's: every rank scales its gradient by the same
            factor min(1, C/‖ḡ‖), ‖ḡ‖ the norm of the reduced gradient estimated from a
            CountSketch of each rank's gradients (one allgather of 2 KB per rank and step;
            equations: :mod:`dgc_horovod.core.sketch`), so that what the ranks sum is clipped
            as ``clip_grad_norm_(C)`` clips it in dense training. Waits for the step's last
            gradient as "global" does.
        weight_decay (float): L2 weight decay λ handled by DGC (set the wrapped optimizer's
            weight_decay to 0 when using it). How: ``weight_decay_mode``.
        weight_decay_mode (str): "separate" (default, the authors' reference code, DGCSGD):
            weight decay stays out of the sparse path; after the exchange every element gets
            λ·w through its own momentum buffer, b ← m·b + λ·w, update ← exchanged + b
            (Nesterov: exchanged + λ·w + m·b), exactly what dense momentum SGD does with weight
            decay. "accumulated": λ·w joins the clipped local gradient before momentum
            correction, g ← s·g + λ·w, and is accumulated and sparsified with it.
        sample_ratio (float): fraction of a tensor's elements sampled to estimate the top-k
            threshold, in (0, 1]; the paper samples 0.1%–1% (§5). Default 0.01.
        exact_topk (bool): select by an exact top-k over the whole tensor instead of the sampled
            threshold. Slower on large tensors; same selection whenever the threshold is exact.
        min_sparse_numel (int): tensors with fewer elements are not sparsified. Default 1.
        min_sparse_ndim (int): tensors with fewer dimensions are not sparsified. Default 2, as
            the authors' reference code: biases and normalisation scales (1-D) go dense. A
            tensor that is not sparsified goes through Horovod's dense allreduce as its
            momentum-corrected velocity (clipping applies; no masking, nothing held back), which
            by linearity is exactly momentum SGD on it. 1 sparsifies every tensor (more
            compression: ResNet-50 657x instead of about 280x; see docs/convergence.md for
            what it costs in accuracy).
        warmup_steps (int): length of the exponential sparsity warm-up (§3.3) in optimizer
            steps, counted by DGC itself: four equal stages whose density falls geometrically
            from ``warmup_initial_density`` towards ``compress_ratio`` (0.25, 0.0889, 0.0316,
            0.0112 for the default 0.004; the paper's 0.25, 0.0629, 0.0158, 0.00398 for
            0.001), then ``compress_ratio``. Default
            1000 (the paper warms up over about the first 2.5% of training, 4 of 164 epochs:
            set it to about 2.5% of your run's steps). 0 disables the warm-up. Used when
            ``warmup_epochs`` is None.
        warmup_epochs (float or None): None (default): the warm-up counts steps
            (``warmup_steps``). A number: the warm-up lasts that many epochs instead, as the
            paper's schedule (one stage per epoch), and follows ``set_epoch`` / ``set_step``,
            which must then be called every epoch.
        warmup_initial_density (float): density at the start of the warm-up. Default 0.25
            (75% sparsity); it then falls geometrically to ``compress_ratio``. At or below
            ``compress_ratio``: no warm-up.
        warmup_per_step (bool): False (paper): density changes in stages (each quarter of
            ``warmup_steps``, or each whole epoch). True: it falls smoothly.
        seed (int): seed of the threshold estimate's sampled positions, in [0, 2**63 - 1]
            (a counter-based hash of seed, tensor and step: :mod:`dgc_horovod.core.sparsify`).
        bucket_numel (int): the adapters send the payloads of several tensors in one
            allgather: consecutive parameters are grouped until their dense size reaches this
            many elements (PyTorch: in reverse registration order, roughly the order backward
            produces them, and a bucket's allgather starts as soon as all its gradients are
            compressed, so it still overlaps with backward; TensorFlow in the graph: in the
            order Horovod hands the gradients over, each bucket's ops starting when its
            gradients exist; ``in_graph=False``: one per tensor). 0: one allgather per tensor.
            Default 2**22 (16 MiB of fp32 gradient per bucket).
        wire_index (str): index encoding of the payload (:mod:`dgc_horovod.core.wire`):
            "delta16" (default; the paper's 16-bit run lengths with an escape for long gaps,
            ~2 bytes per entry) or "int32" (4 bytes per entry).
        wire_values (str): "float32" (default, exact) or "float16" (half the value bytes; the
            rounding error stays in the residual, so it is delayed, not lost). A value beyond
            float16's range is sent as ±inf, as a float16 cast makes it: the step's update is
            then non-finite on every rank, so a loss scaler skips the step and backs off, and the
            rank that overflowed drops that tensor's u and v; values below float16's range are
            sent as 0 and stay in the residual. Both are counted (``stats.overflowed_entries``,
            ``stats.flushed_entries``) and warned about once (see
            :mod:`dgc_horovod.core.precision`).
        exchange (str): how the sparsified payloads travel (PyTorch adapter). "allgather"
            (default, the paper's): every rank receives every other rank's selection, (N−1)·k
            entries per step, and applies all of them. "regions": a sparse reduce-scatter by
            Horovod alltoall over N index regions, each region's owner keeps the k/N largest
            entries of the sum, and an allgather shares them: about 2k(N−1)/N entries received
            per rank, whatever N; it applies the k largest of the summed selections and keeps
            the rest in the owners' residuals (:mod:`dgc_horovod.core.regions`), so it needs
            about 16× the density to train as well (measured in docs/scaling.md).
            "hierarchical": the dense gradient is averaged inside each node (hosts with
            several ranks), each rank of a node runs DGC on its shard of the node's average and
            allgathers its payload with the same rank of every other node, and an allgather
            inside the node joins the shards: the nodes are the DGC workers
            (:mod:`dgc_horovod.core.hierarchical`; PyTorch; Horovod started with dynamic
            process sets, ``hvd.init(process_sets="dynamic")``; clipping with
            ``clip_scope="global"`` only, the node's norm against C·√M for M nodes).
        engine (str): what computes the compress and decode steps (:mod:`dgc_horovod.core.engine`;
            every engine gives the same bits): "auto" (default) the C kernels for tensors in host
            memory, the Triton kernels for CUDA tensors (Triton ships with PyTorch's CUDA
            builds), tensor ops otherwise; "c", "triton" (on CPU tensors only under Triton's
            interpreter, ``TRITON_INTERPRET=1``: for tests) or "ops" to choose one. Not compared
            between checkpoints or ranks.

        environ (mapping or None): where the ``HOROVOD_DGC_*`` variables are read; None (the
            default) reads ``os.environ``, ``{}`` ignores the environment.

    Environment variables (Horovod style): every option ``name`` has a variable
    ``HOROVOD_DGC_<NAME>`` (``DGCConfig.ENV_VARS``), used when the keyword argument is not given:
    an explicit keyword argument > the environment variable > the default above. Values are
    text: floats and ints as Python writes them, booleans as 1/0, true/false, yes/no or on/off
    (any case), ``HOROVOD_DGC_CLIP_NORM=none`` for no clipping, the wire encodings by name. An
    empty variable counts as unset. They go through the same checks as keyword arguments.
    ``DGC(config=DGCConfig(...))`` and the adapters' ``DGC(**kwargs)`` read them alike (each
    rank reads its own environment; ``horovodrun`` passes the launching shell's on to every
    rank, with ``--gloo`` and ``--mpi``). :attr:`sources` and ``str(config)`` tell where each
    value came from.

    Raises:
        TypeError / ValueError: an argument of the wrong type or outside its range; the message
            names the argument and the expected form.
        ValueError: an environment variable that does not parse or is out of range (the message
            names the variable, its expected form and its text), or an unknown ``HOROVOD_DGC_*``
            variable (a misspelt option would otherwise be ignored silently).
    """

    #: option name -> its environment variable.
    ENV_VARS = {name: ENV_PREFIX + name.upper() for name in _OPTIONS}
    #: option name -> built-in default.
    DEFAULTS = {name: spec[0] for name, spec in _OPTIONS.items()}

    __slots__ = tuple(_OPTIONS) + ("_sources",)

    def __init__(self, compress_ratio=_D["compress_ratio"], momentum=_D["momentum"],
                 nesterov=_D["nesterov"], momentum_masking=_D["momentum_masking"],
                 clip_norm=_D["clip_norm"], weight_decay=_D["weight_decay"],
                 sample_ratio=_D["sample_ratio"], exact_topk=_D["exact_topk"],
                 min_sparse_numel=_D["min_sparse_numel"], warmup_epochs=_D["warmup_epochs"],
                 warmup_initial_density=_D["warmup_initial_density"],
                 warmup_per_step=_D["warmup_per_step"], seed=_D["seed"],
                 wire_index=_D["wire_index"], wire_values=_D["wire_values"],
                 bucket_numel=_D["bucket_numel"], *, clip_scope=_D["clip_scope"],
                 weight_decay_mode=_D["weight_decay_mode"],
                 min_sparse_ndim=_D["min_sparse_ndim"], warmup_steps=_D["warmup_steps"],
                 exchange=_D["exchange"], engine=_D["engine"], environ=None):
        given = dict(locals())
        env = self._read_environ(os.environ if environ is None else environ)
        sources = {}
        for name, (_, check, parse, form) in _OPTIONS.items():
            value = given[name]
            if not isinstance(value, _Default):
                setattr(self, name, check(name, value))
                sources[name] = "argument"
            elif name in env:
                var, text = self.ENV_VARS[name], env[name]
                try:
                    parsed = check(var, parse(text.strip()))
                except (TypeError, ValueError):
                    raise ValueError(f"{var} must be {form}, got {text!r}") from None
                setattr(self, name, parsed)
                sources[name] = var
            else:
                setattr(self, name, check(name, value.value))
                sources[name] = "default"
        self._sources = sources
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("nesterov=True needs momentum > 0"
                             + self._from("nesterov", "momentum"))
        if self.exchange == "hierarchical" and self.clip_norm is not None \
                and self.clip_scope != "global":
            why = ("each rank holds a shard of a tensor, not its norm"
                   if self.clip_scope == "tensor" else "not implemented for this exchange yet")
            raise ValueError(f"clip_scope={self.clip_scope!r} is not available with "
                             f"exchange='hierarchical' ({why}); use clip_scope='global', the "
                             "paper's rule, or clip_norm=None"
                             + self._from("clip_scope", "exchange"))

    @classmethod
    def _read_environ(cls, environ):
        """{option: text} of the non-empty HOROVOD_DGC_* variables; unknown names refused."""
        known = {var: name for name, var in cls.ENV_VARS.items()}
        out = {}
        for var in sorted(k for k in environ if k.startswith(ENV_PREFIX)):
            if var not in known:
                raise ValueError(f"unknown environment variable {var}: the DGC options are "
                                 + ", ".join(known))
            text = environ[var]
            if not isinstance(text, str):
                raise TypeError(f"{var} must be a str in environ, got {type(text).__name__}")
            if text.strip():
                out[known[var]] = text
        return out

    def _from(self, *names):
        """Where ``names`` came from, for an error message, when any came from the environment."""
        if all(self._sources[n] in ("argument", "default") for n in names):
            return ""
        parts = [f"{n} from {self._sources[n]}" for n in names if self._sources[n] != "default"]
        return f" ({', '.join(parts)})"

    @property
    def sources(self):
        """{option: where its value came from}: "argument", "default", or the name of the
        environment variable (e.g. "HOROVOD_DGC_COMPRESS_RATIO") it was read from."""
        return dict(self._sources)

    def to_dict(self):
        """All settings as a plain dict (for logging and checkpoints)."""
        return {k: getattr(self, k) for k in _OPTIONS}

    def __repr__(self):
        return "DGCConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items()) + ")"

    def __str__(self):
        """One loggable line: every setting, and after each one not left at its default where it
        came from (``[argument]`` or ``[HOROVOD_DGC_...]``)."""
        items = []
        for k, v in self.to_dict().items():
            src = self._sources[k]
            items.append(f"{k}={v!r}" + ("" if src == "default" else f" [{src}]"))
        return "DGCConfig(" + ", ".join(items) + ")"

    def __eq__(self, other):
        return isinstance(other, DGCConfig) and self.to_dict() == other.to_dict()


def config_diff(a, b):
    """The settings in which two ``DGCConfig.to_dict()`` dicts differ, sorted: one rule for the
    checkpoint check (saved vs now) and the elastic check (this rank vs another). A key present
    in only one of them differs."""
    missing = object()
    return sorted(k for k in set(a) | set(b)
                  if k not in LOCAL_OPTIONS and a.get(k, missing) != b.get(k, missing))
