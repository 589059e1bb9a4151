"""The fused CPU path of DGC's compress step (one C kernel call instead of ~40 tensor ops), and
of its decode.

:class:`dgc_horovod.core.compressor.DGCCore` calls :func:`accumulate_select` and :func:`finish`
for a sparsified tensor when the compiled extension ``dgc_horovod.core._kernels`` (``_kernels.c``, built by
``pip install``) is present and the backend hands out raw pointers for the tensors
(:meth:`Backend.kernel_ptr`: CPU, contiguous; the state and the float32 view of the gradient
always are on CPU). Otherwise — CUDA or TensorFlow tensors, extension not built, or
``DGC_KERNELS=0`` in the environment — the tensor-op path of :mod:`accumulate` and
:mod:`sparsify` runs. Both paths give bit-identical state, selections and payloads for the same
inputs and seed: the kernel repeats the backend's float32 arithmetic (with or without fused
multiply-add, as :func:`calibrate` finds the backend doing), draws the same sample positions from
the same generator, and leaves the order-dependent steps (top-k among more than k candidates)
to the backend's own top-k.

Per step and tensor of n elements the kernel reads g once to check that it is finite (a NaN/Inf
gradient never enters u or v), then in one pass updates u and v (momentum correction, §3.1) and
records the largest |v| of every 64-element block; the sampled threshold (§5) is the ks-th
largest |v| over the s sampled positions; only blocks whose maximum reaches it are read again for
the candidates. Encoding (delta16 or int32 indices, float32 values), the gather of the sent
values and the clearing of the sent positions (momentum factor masking, §3.2) are a second call.

:meth:`DGCCore.compress_many` (a bucket of tensors; what the PyTorch adapter calls) uses the batch
entry point instead: :class:`Batch` draws the bucket's sample uniforms in one generator call and
runs one ``step_many`` call that checks every gradient for NaN/Inf and updates, selects and
encodes them all, spreading the work over a persistent pool of threads (a tensor of at most
:data:`SMALL_NUMEL` = 262,144 elements is one task that checks it and does the rest while it is
in cache; larger ones are checked first, then cut in chunks of 65,536 elements). Same arithmetic,
same results.

The receive side has one kernel too: :func:`decode_sum` checks every rank's payload of a tensor,
zeroes the output, adds the entries in rank order and scales the sent positions by 1/N in one
call, the same float32 operations as :func:`wire.decode_sum` and ``Backend.scale_at_``;
:meth:`DGCCore.decompress` calls it and runs the tensor ops only when it declines (a malformed
payload, whose error they raise, or a non-finite step). :func:`split_bucket` cuts an allgathered
bucket into its members' payloads with one kernel call for the walk over the segments.

The glue takes what it uses, not the core: the backend, the config, the generator the sample
draws come from, and the density in force (a tensor's :class:`Plan` is refreshed when it changed).
"""
import math
import os
from array import array
from itertools import accumulate

from dgc_horovod.core import wire
from dgc_horovod.core.sparsify import FALLBACK, TOPK, select_topk, settle, threshold_rank

try:
    from dgc_horovod.core import _kernels
except ImportError:          # not built (e.g. a source tree without a C compiler)
    _kernels = None

__all__ = ["available", "calibrate", "Plan", "usable_plan", "all_finite", "accumulate_select",
           "select_rest", "finish", "Batch", "decode_sum", "DECODE_ZERO",
           "DECODE_ADD", "DECODE_SCALE", "split_spans", "split_bucket"]

#: Set ``DGC_KERNELS=0`` to force the tensor-op path everywhere (read at import).
ENABLED = os.environ.get("DGC_KERNELS", "1").strip() not in ("0", "false", "False", "no")


def available():
    """True when the compiled kernels are importable and not disabled by ``DGC_KERNELS=0``."""
    return _kernels is not None and ENABLED


def calibrate(B, u, g):
    """Which float32 arithmetic the backend's momentum-correction ops use.

    Runs the backend's ops (:func:`accumulate.momentum_correction` equivalents: unit and
    non-unit scale, classic and Nesterov) and the kernel, with and without fused multiply-add, on
    copies of the probe tensors ``u`` and ``g`` (flat float32, a few thousand random values), and
    compares them bit for bit.

    Returns:
        True (the backend rounds a·b + c once), False (twice, as NumPy), or None (neither
        matches, or the kernel is unavailable: the kernel must not be used with this backend).
    """
    if not available() or B.kernel_ptr(u) is None or B.kernel_ptr(g) is None:
        return None
    from dgc_horovod.core.accumulate import momentum_correction
    n = B.numel(u)
    expected = []
    for nesterov, scale in ((False, 1.0), (False, 0.75), (True, 1.0), (True, 0.75)):
        uu, vv = B.state_copy(u), B.state_copy(g)
        momentum_correction(B, uu, vv, g, 0.9, nesterov, scale)
        vv0 = B.state_copy(g)
        momentum_correction(B, None, vv0, u, 0.0, False, scale)
        expected.append((nesterov, scale, B.to_list(B.float32_bits(uu)),
                         B.to_list(B.float32_bits(vv)), B.to_list(B.float32_bits(vv0))))
    for fma in (True, False):
        ok = True
        for nesterov, scale, eu, ev, ev0 in expected:
            uu, vv, vv0 = B.state_copy(u), B.state_copy(g), B.state_copy(g)
            _kernels.step(B.kernel_ptr(g), B.kernel_ptr(uu), B.kernel_ptr(vv), n,
                          2 if nesterov else 1, fma, 0.9, scale, 0, 0, 0, 0, 0, 0)
            _kernels.step(B.kernel_ptr(u), 0, B.kernel_ptr(vv0), n, 0, fma, 0.0, scale,
                          0, 0, 0, 0, 0, 0)
            if (B.to_list(B.float32_bits(uu)) != eu or B.to_list(B.float32_bits(vv)) != ev
                    or B.to_list(B.float32_bits(vv0)) != ev0):
                ok = False
                break
        if ok:
            return fma
    return None


class Plan:
    """What one sparsified tensor's fused compress reuses from step to step.

    Attributes: fma (bool, from :func:`calibrate`), mode (0: momentum 0, 1: classic,
    2: Nesterov), density (float, the density k was computed for), k (int), s (samples),
    ks (rank of the threshold among the samples), cap (candidate buffer size), cidx / cmag
    (int64 / float32 candidate buffers of cap entries), pointers of u, v and the buffers.
    """

    __slots__ = ("fma", "mode", "density", "k", "s", "ks", "sampled", "cap", "cidx", "cmag",
                 "u", "v", "up", "vp", "cidx_p", "cmag_p", "max_tokens", "uni", "uni_p",
                 "finish_here", "masking", "row", "k_fin", "cap_words")

    def __init__(self, B, st, config, fma, density):
        self.fma = fma
        self.mode = 0 if config.momentum == 0.0 else (2 if config.nesterov else 1)
        self.u, self.v = st.u, st.v
        self.up = 0 if st.u is None else B.kernel_ptr(st.u)
        self.vp = B.kernel_ptr(st.v)
        n = st.numel
        self.max_tokens = n // wire._ESCAPE + 1     # escape tokens of a delta16 payload, at most
        self.cidx = self.cmag = None
        self.uni = None             # float64 buffer the sample draws go to (one tensor per call)
        # the batch kernel may finish the tensor itself (delta16 indices, float32 values)
        self.finish_here = config.wire_index == "delta16" and config.wire_values == "float32"
        self.masking = config.momentum_masking and st.u is not None
        self.set_density(B, n, config, density)

    def use_density(self, B, n, config, density):
        """Refresh the plan for the density in force (nothing to do when it has not changed)."""
        if density != self.density:
            self.set_density(B, n, config, density)

    def set_density(self, B, n, config, density):
        from dgc_horovod.core.sparsify import k_for, sample_count
        self.density = density
        k = self.k = k_for(n, density)
        s = self.s = sample_count(n, k, config.sample_ratio, config.exact_topk)
        self.sampled = s > 0
        if not self.sampled:
            self.s = self.ks = self.cap = self.k_fin = self.cap_words = 0
            self.row = array("q", (0, self.up, self.vp, n, self.mode, self.fma) + (0,) * 13
                             + (1, 0, 0, 0, 0))
            return
        if self.uni is None or B.numel(self.uni) != s:
            self.uni = B.empty(s, "float64", like=self.v)
            self.uni_p = B.kernel_ptr(self.uni)
        self.ks = threshold_rank(n, k, s)
        # about ks·n/s candidates are expected; more than 2x that is rare and only costs a rescan
        cap = min(n, 2 * math.ceil(self.ks * n / s) + 2 * k + 64)
        if self.cidx is None or B.numel(self.cidx) < cap:
            self.cidx = B.empty(cap, "int64", like=self.v)
            self.cmag = B.empty(cap, "float32", like=self.v)
            self.cidx_p, self.cmag_p = B.kernel_ptr(self.cidx), B.kernel_ptr(self.cmag)
        self.cap = B.numel(self.cidx)
        # the static part of this tensor's row of the batch kernel (Batch.add fills in the rest)
        kf = self.k_fin = k if self.finish_here else 0
        self.cap_words = (wire.HEADER_WORDS + kf + (kf + self.max_tokens + 1) // 2) if kf else 0
        mask_u = int(self.masking and kf > 0)
        self.row = array("q", (0, self.up, self.vp, n, self.mode, self.fma, 0, s, self.ks,
                               self.cidx_p, self.cmag_p, self.cap, kf, 0, 0, mask_u, mask_u, 0,
                               self.cap_words, 1, 0, 0, 0, 0))


def usable_plan(B, st, g, config, density, enabled=True):
    """st's :class:`Plan` when the fused path applies to it now (made, and kept in ``st.plan``,
    when it has none yet or its state tensors were replaced), else False (tensor ops: not built,
    not in host memory, ``enabled`` False: the core's ``use_kernels``) or None (a dense tensor).
    g: the float32 view of its gradient; density: the density in force."""
    plan = st.plan if enabled else False
    if plan and (plan.u is not st.u or plan.v is not st.v):
        plan = None                           # the state tensors were replaced
    if plan is None and st.sparse:
        plan = False
        if (available() and B.kernel_fma() is not None
                and B.kernel_ptr(st.v) is not None and B.kernel_ptr(g) is not None
                and (st.u is None or B.kernel_ptr(st.u) is not None)):
            plan = Plan(B, st, config, B.kernel_fma(), density)
        st.plan = plan
    return plan


def all_finite(n, gp, threads=1):
    """True if the float32 tensor of n elements at address gp has no NaN or Inf (exact).

    Large tensors are split over up to ``threads`` threads (one per 65,536 elements)."""
    return _kernels.all_finite(gp, n, threads)


def accumulate_select(B, config, generator, st, plan, density, g, gp, scale, threads=1):
    """Accumulate a finite gradient into st.u / st.v and select what to send (fused path).

    The kernel twin of :func:`accumulate.momentum_correction` → :func:`sparsify.select_topk` in
    :meth:`DGCCore.compress` (which has applied weight decay, checked that g is finite and that
    the kernels apply to this tensor). Args: B (Backend), config (DGCConfig), generator (the
    backend's, for the sample draws), st (TensorState), plan (Plan), density (float, in force
    now), g (flat float32 gradient, read only) and gp (its pointer), scale (float, the clipping
    factor still to apply to g), threads (int, for the kernel). Returns the int64 index
    tensor of the positions to send (unique, a new tensor that the caller may sort in place;
    unordered, or ascending for delta16).

    With the delta16 wire format the payload lists the positions in ascending order whatever
    order the selection produced, so the kernel itself takes the top-k among the candidates
    when that set is unique (no tie at the k-th largest magnitude); otherwise, and always for
    int32 indices (whose payload keeps the selection's order), the backend's top-k does.
    """
    c, n = config, st.numel
    plan.use_density(B, n, c, density)
    if not plan.sampled:
        _kernels.step(gp, plan.up, plan.vp, n, plan.mode, plan.fma, c.momentum, scale,
                      0, 0, 0, 0, 0, 0, threads)
        return select_rest(B, c, generator, st, plan, 0.0, 0, -1, None)
    uni = B.sample_uniform(plan.s, generator, plan.uni)
    k = plan.k
    out = B.empty(k, "int64", like=st.v) if c.wire_index == "delta16" else None
    thr, cnt, nsel = _kernels.step(gp, plan.up, plan.vp, n, plan.mode, plan.fma, c.momentum,
                                   scale, B.kernel_ptr(uni), plan.s, plan.ks, plan.cidx_p,
                                   plan.cmag_p, plan.cap, threads, k,
                                   0 if out is None else B.kernel_ptr(out))
    return select_rest(B, c, generator, st, plan, thr, cnt, nsel, out)


def select_rest(B, config, generator, st, plan, thr, cnt, nsel, out):
    """The selection after the kernel's step: the kernel's own (nsel >= 0: ``out`` holds it) or,
    from its threshold ``thr`` and candidate count ``cnt``, the backend's exact top-k among the
    candidates (count > k, or ties), over v (fewer than k/2 candidates), or a rescan of v (more
    candidates than the plan's buffers hold). Returns the int64 index tensor (see
    :func:`accumulate_select`)."""
    k = plan.k
    if not plan.sampled:
        return select_topk(B, st.v, k, config.sample_ratio, True, generator)
    if nsel >= 0 and out is not None:                  # the kernel selected (ascending)
        return out if nsel == k else B.slice(out, 0, nsel)
    if cnt > plan.cap:                                 # too many to keep: find them again
        mag = B.abs(st.v)
        idx = B.indices_where_ge(mag, thr)
        cand_mag = B.take(mag, idx)
    else:
        idx, cand_mag = B.slice(plan.cidx, 0, cnt), B.slice(plan.cmag, 0, cnt)
    rule = settle(cnt, k)
    if rule == TOPK:                                   # exact top-k among the candidates
        sel = B.topk_indices(cand_mag, k)
        idx, mags = B.take(idx, sel), B.take(cand_mag, sel)
    elif rule == FALLBACK:                             # too few: exact top-k over v
        mag = B.abs(st.v)
        idx = B.topk_indices(mag, k)
        mags, thr = B.take(mag, idx), 0.0
    else:
        idx, mags = B.copy(idx), cand_mag
    if thr <= 0.0:                                     # zeros may be among them: never sent
        idx = B.drop_zeros(idx, mags)
    return idx


def finish(B, config, st, plan, idx):
    """Gather, clear and encode the sent positions idx (float32 values only; fused path).

    The kernel twin of sort (delta16) → take v, u → :func:`accumulate.clear_sent` →
    :func:`wire.encode` in :meth:`DGCCore.compress`; idx (int64, from
    :func:`accumulate_select`) is sorted in place for delta16.
    Returns (payload, vals, u_sent): the flat int32 payload, the float32 values sent, and the
    velocity at the sent positions before momentum factor masking (None without masking).
    """
    c = config
    count = B.numel(idx)
    masking = c.momentum_masking and st.u is not None
    vals = B.empty(count, "float32", like=st.v)
    u_sent = B.empty(count, "float32", like=st.v) if masking else None
    delta = c.wire_index == "delta16"
    cap_words = (wire.HEADER_WORDS + count
                 + ((count + plan.max_tokens + 1) // 2 if delta else count))
    payload = B.empty(cap_words, "int32", like=st.v)
    words = _kernels.finish(B.kernel_ptr(idx), count, plan.vp, plan.up, masking, delta,
                            B.kernel_ptr(vals), 0 if u_sent is None else B.kernel_ptr(u_sent),
                            B.kernel_ptr(payload), cap_words, st.numel, 0)
    return B.slice(payload, 0, words), vals, u_sent


#: mode bits of :func:`decode_sum` (DEC_* in _kernels.c)
DECODE_ZERO, DECODE_ADD, DECODE_SCALE = 1, 2, 4


def decode_sum(B, gathered, numel, ranks, out, mode, inv=1.0):
    """The receive side in one kernel call: check the ``ranks`` payloads in ``gathered`` (the
    int32 words of :func:`wire.decode_sum`) as :func:`wire.read_payload` does and, by the bits of
    ``mode``, zero the float32 tensor ``out`` of ``numel`` elements (DECODE_ZERO), add every
    rank's entries in rank order (DECODE_ADD: out[i] + value, as the backend's index_add_), then
    multiply every sent position once by ``inv`` rounded to float32 (DECODE_SCALE: as
    ``Backend.scale_at_``). Same arithmetic, so the same bits as the tensor ops.

    Returns True when done; False when ``out`` was left untouched and the caller must run the
    tensor ops instead: the kernels are not available, a tensor is not in host memory (or not
    int32 / float32 contiguous), a payload is malformed (:func:`wire.decode_sum` raises the
    error), a rank flagged a non-finite gradient or a value is not finite (the NaN path).
    """
    if not available() or not ranks:
        return False
    wp, op = B.kernel_words_ptr(gathered), B.kernel_grad_ptr(out)
    if wp is None or op is None or B.numel(out) != numel:
        return False
    return _kernels.decode_sum(wp, B.numel(gathered), numel, ranks, op, mode, inv)


def split_spans(B, gathered, world_size, members):
    """[(member, start, words)] of every payload in an allgathered bucket (the walk of
    :func:`wire.split_bucket`) from one kernel call, or None: the kernels are not available,
    ``gathered`` is not contiguous host int32, or a segment is malformed."""
    if not available():
        return None
    wp = B.kernel_words_ptr(gathered)
    if wp is None:
        return None
    cap = world_size * members
    spans = array("q", [0]) * (3 * cap or 1)
    n = _kernels.split_bucket(wp, B.numel(gathered), world_size, members, spans.buffer_info()[0],
                              cap)
    return None if n < 0 else [tuple(spans[3 * e:3 * e + 3]) for e in range(n)]


def split_bucket(B, gathered, world_size, members, name="<bucket>"):
    """:func:`wire.split_bucket` (the same arguments and result): its walk over the segments in
    one kernel call (:func:`split_spans`), then a view per payload; :func:`wire.split_bucket`
    itself when that declines (it raises the error of a malformed segment)."""
    spans = split_spans(B, gathered, world_size, members)
    if spans is None:
        return wire.split_bucket(B, gathered, world_size, members, name)
    out = [[] for _ in range(members)]
    for m, start, words in spans:
        out[m].append(B.slice(gathered, start, start + words))
    return out


#: Tensors of at most this many elements are one task of the batch kernel (checked for NaN/Inf,
#: updated and finished while in cache); larger ones are checked in a first phase, then cut in
#: chunks.
SMALL_NUMEL = _kernels.SMALL_NUMEL if _kernels is not None else 0
NONFINITE = _kernels.NONFINITE if _kernels is not None else -2

# the row layout of _kernels.step_many (the F_* and D_* enums of _kernels.c)
_NF, _F_NPOS, _F_K, _F_CAPW = 24, 7, 12, 18
_F_COUNT, _F_NSEL, _F_WORDS = 21, 22, 23
_ND, _D_THR = 3, 2


class Batch:
    """One call of the batch kernel for the sparsified tensors of a bucket (fused path).

    :meth:`add` a row per tensor (in the order of compress_many's entries), then :meth:`run`:
    the kernel updates every tensor's u and v, estimates each threshold, selects and, for the
    rows it can finish (delta16 indices, float32 values, a unique top-k set), gathers, clears and
    encodes — the same arithmetic as :func:`accumulate_select` + :func:`finish` per tensor, so the
    same results. Work is spread over up to ``threads`` threads: a tensor of at most
    :data:`SMALL_NUMEL` elements is one task (checked for NaN/Inf, updated and finished while in
    cache), larger ones are cut in chunks of 65,536 elements.

    The rows' sample draws (s float64 uniforms each, :func:`sparsify.sample_positions`) are made
    by one generator call for all rows added since the last :meth:`draw` — the same values as one
    call per row, in row order — so the caller calls :meth:`draw` before anything else draws from
    the generator. The kernel lays the rows' regions of the batch buffers (draws, selected
    positions, payload words) out one after the other.

    After :meth:`run`: ``all_finished`` (bool) tells whether the kernel finished every row; if so,
    ``payloads``, ``starts``, ``counts`` and ``words`` list per row its payload, where its
    selected positions, values and velocities start in the batch buffers ``out``, ``vals`` and
    ``usent`` (see :meth:`views`), how many there are, and the payload's length in int32 words.
    :meth:`finished` gives the same per finished row in any case.
    """

    def __init__(self, B, config, generator, density, threads):
        self.B, self.generator, self.density, self.threads = B, generator, density, threads
        self.config = config
        self.masking = config.momentum_masking and config.momentum > 0
        self.momentum = config.momentum
        self.rows = []          # (st, plan, g) per row: kept alive until the kernel ran
        self.gps = array("q")   # the gradients' addresses
        self.desc, self.fdesc = array("q"), array("d")
        self.drawn = 0          # rows whose sample draws are made
        self.uniforms = []      # the draws, one tensor per draw() call
        self.all_finished = False

    def add(self, st, plan, g, gp, scale):
        """A finite gradient (flat float32 data at address gp, kept alive by g) of st, clipping
        scale already applied for weight decay (see accumulate_select); the plan is refreshed for
        the batch's density."""
        plan.use_density(self.B, st.numel, self.config, self.density)
        self.desc.extend(plan.row)
        self.gps.append(gp)
        self.fdesc.extend((self.momentum, scale, 0.0))
        self.rows.append((st, plan, g))

    def draw(self):
        """Draw the sample uniforms of the rows added since the last call (one generator call)."""
        s = sum(self.desc[self.drawn * _NF + _F_NPOS::_NF])
        self.drawn = len(self.rows)
        if s:
            self.uniforms.append(self.B.sample_uniform(s, self.generator))

    def run(self, like):
        """Draw what is left to draw and run the kernel (state changes here). Raises
        ValueError/MemoryError on a kernel error (bad arguments: a bug, not a user error)."""
        B = self.B
        self.draw()
        uni = self.uniforms
        uni = (uni[0] if len(uni) == 1 else B.cat(uni)) if uni else B.empty(1, "float64", like)
        d = self.desc
        d[0::_NF] = self.gps
        ks = d[_F_K::_NF]
        kt, wt, nu = sum(ks), sum(d[_F_CAPW::_NF]), sum(d[_F_NPOS::_NF])
        self.out = B.empty(max(kt, 1), "int64", like=like)
        self.vals = B.empty(max(kt, 1), "float32", like=like)
        self.usent = B.empty(max(kt, 1), "float32", like=like) if self.masking else None
        self.payload = B.empty(max(wt, 1), "int32", like=like)
        ptr = B.kernel_ptr
        _kernels.step_many(d.buffer_info()[0], self.fdesc.buffer_info()[0], len(self.rows),
                           self.threads, ptr(self.out), ptr(self.vals),
                           ptr(self.usent) if self.masking else 0, ptr(self.payload), kt, wt,
                           ptr(uni), nu)
        self.uniforms = None
        nsel = d[_F_NSEL::_NF]
        if kt and min(ks) > 0 and min(nsel) >= 0:   # the kernel finished every row
            self.all_finished = True
            self.counts, self.words = nsel.tolist(), d[_F_WORDS::_NF].tolist()
            self.starts = list(accumulate(self.counts, initial=0))
            self.payloads = B.split(self.payload, self.words + [max(wt, 1) - sum(self.words)])

    def finished(self):
        """{row: (payload, start, count, words)} for the rows the kernel finished."""
        if self.all_finished:
            return {r: (p, a, c, w) for r, (p, a, c, w) in enumerate(
                zip(self.payloads, self.starts, self.counts, self.words))}
        d = self.desc
        done, words, start = [], [], 0
        for r, (k, nsel, w) in enumerate(zip(d[_F_K::_NF], d[_F_NSEL::_NF], d[_F_WORDS::_NF])):
            if k and nsel >= 0:
                done.append((r, start, nsel))
                words.append(w)
                start += nsel
        if not done:
            return {}
        B = self.B
        pays = B.split(self.payload, words + [B.numel(self.payload) - sum(words)])
        return {r: (pays[j], a, cnt, words[j]) for j, (r, a, cnt) in enumerate(done)}

    def release(self):
        """Drop the gradients; :meth:`views`, :meth:`result` and the payloads stay valid."""
        self.rows = [row[:2] for row in self.rows]
        self.gps = None

    def views(self, start, count, masked):
        """(indices, values, u_sent) of a finished row: views of the batch buffers."""
        B = self.B
        end = start + count
        return (B.slice(self.out, start, end), B.slice(self.vals, start, end),
                B.slice(self.usent, start, end) if masked else None)

    def result(self, r):
        """(st, plan, thr, cnt): thr, the row's threshold, and cnt, its candidate count, for
        :func:`select_rest` when the kernel did not finish it; cnt is None when the row's
        gradient has NaN/Inf (a small row, checked by the kernel: its state is untouched)."""
        st, plan = self.rows[r][:2]
        if self.desc[r * _NF + _F_NSEL] == NONFINITE:
            return st, plan, 0.0, None
        return st, plan, self.fdesc[r * _ND + _D_THR], self.desc[r * _NF + _F_COUNT]
