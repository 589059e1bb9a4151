"""The region exchange (``exchange="regions"``): per-rank traffic O(k) instead of O(k·N).

With allgather (the default exchange, the paper's) every rank receives every other rank's k
selected entries, (N−1)·k per step, and decodes N payloads. The region exchange is a sparse
reduce-scatter followed by an allgather of the reduced, re-sparsified sums, built on Horovod's
alltoall and allgather. For one sparsified tensor of n elements, N ranks, density ρ:

    regions     R_j = [⌊j·n/N⌋, ⌊(j+1)·n/N⌋), j = 0..N−1 (contiguous; sizes differ by at most 1)
    1. select   rank r compresses as under allgather (Algorithm 1: momentum correction, top-k of
                |v_r|, encode; u_r and v_r cleared at the sent positions I_r), payload G_r
    2. scatter  (alltoall) rank r sends G_r ∩ R_j to rank j, positions relative to R_j (only
                the non-empty parts: per rank O(k) entries and headers, not O(N) headers)
    3. reduce   rank j: S_j = Σ_r G_r|R_j, summed in rank order (the allgather path's order);
                K_j = the k_j = max(1, ⌈ρ·|R_j|⌉) largest |S_j| (exact top-k over S_j's non-zero
                entries; of equal magnitudes the lowest positions first, so every backend keeps
                the same; only rank j selects, so no rank has to agree with another);
                D_j = S_j − S_j|K_j, what rank j drops
    4. share    (allgather) rank j sends (K_j, S_j[K_j]) with absolute positions (nothing if
                S_j is all zero); every rank decodes the payloads in rank order; the regions
                are disjoint, so the update Δ = (1/N)·Σ_j S_j|K_j (Average; Sum: without 1/N)
                is bit-identical everywhere
    5. keep     after a finite step, rank j: v_j ← v_j + D_j; every rank r puts back the momentum
                of what it sent that was not applied: u_r[I_r \\ K] ← u_r,sent (K = ∪_j K_j)

Nothing is lost: Σ_r v_r + Σ_j S_j|K_j after the step equals Σ_r v_r before the selection (what
was sent is either applied or back in its owner's residual). Momentum factor masking (§3.2)
masks the momentum of *applied* entries, as in the paper, where every sent entry is applied: an
entry sent but dropped at its owner keeps its momentum on every sender, and its value waits in
the owner's residual, where it competes again at the next step like any unsent entry. A
non-finite step (a rank's flag, or a float16 value beyond range in either phase) makes the
owner's phase-2 payload flagged, so every rank returns NaN for the tensor as under allgather;
then every rank puts its own sent entries back into u and v and the owners discard D_j.

Per rank and step: received ≈ (N−1)/N·k entries in the scatter (others' entries in its region)
plus (N−1)/N·k in the allgather (the other regions' kept entries), ≈ 2k(N−1)/N against
allgather's (N−1)·k; it decodes N payloads of about k/N entries twice. A consequence of any
scheme in which every rank must learn the k applied entries that others reduced: from N = 2 to
N → ∞ the received volume grows from k to 2k, never beyond.

The update differs from allgather DGC's, which applies every rank's selection (up to N·k entries
per step, the union); the region exchange applies the k largest entries of the *sum*, as the
global top-k exchanges do (gTop-k, Shi et al. 2019; Ok-Topk, Li & Hoefler, PPoPP 2022). The rest
stays in a residual. Convergence against allgather DGC: docs/scaling.md.
"""
from dgc_horovod.core import wire
from dgc_horovod.core.sparsify import k_for

__all__ = ["bounds", "split_payload", "reduce_region", "keep_unapplied"]


def bounds(numel, world_size):
    """[(lo, hi)] of the N regions of a tensor of ``numel`` elements:
    R_j = [⌊j·n/N⌋, ⌊(j+1)·n/N⌋)."""
    return [(j * numel // world_size, (j + 1) * numel // world_size) for j in range(world_size)]


def split_payload(B, payload, numel, world_size, name="<tensor>"):
    """Step 2: one rank's payload of a tensor (:func:`dgc_horovod.core.wire.encode`) as N
    payloads, the j-th holding the entries in region j with positions relative to its start
    (numel = |R_j|), in the same encodings and with the same flags.

    Returns the list of N flat int32 payloads, rank j's being what this rank sends to rank j,
    or None where it sends nothing: a region without entries, unless the payload is flagged
    (FLAG_NONFINITE goes to every region; those empty payloads of equal size may be one and
    the same tensor: do not write into them). Omitting empty parts keeps a rank's traffic at
    O(entries) rather than O(N) headers per tensor.
    Raises WireFormatError for a malformed payload.
    """
    idx, vals, flags, index, values, end = wire.read_payload(B, payload, 0, numel, name)
    if end != B.numel(payload):
        raise wire.WireFormatError(f"DGC payload of tensor {name!r} has {B.numel(payload) - end}"
                                   " unexpected trailing words")
    spans = bounds(numel, world_size)
    empty = {}                  # region size -> its empty payload (most regions, at large N)
    present = {} if idx is None else _split_entries(B, idx, vals, numel, world_size, spans,
                                                     flags, index, values)
    if not flags:               # an empty part without a flag says nothing: not sent
        return [present.get(j) for j in range(world_size)]
    out = []
    for j, (lo, hi) in enumerate(spans):
        if j not in present and hi - lo not in empty:
            empty[hi - lo] = wire.encode(B, hi - lo, B.empty_indices(like=payload),
                                         B.zeros(0, like=payload), flags, index, values)
        out.append(present[j] if j in present else empty[hi - lo])
    return out


def _split_entries(B, idx, vals, numel, world_size, spans, flags, index, values):
    """{j: the part of region j} for the regions that have entries (split_payload's work).

    Positions come ascending from compress (every engine sends them so), so each region's
    entries are one run of the payload: a handful of backend calls find the runs, then one
    :func:`wire.encode` per part. Positions in another order (a payload the wire format
    allows but no engine writes) take one masked copy per region, in payload order: the same
    parts."""
    # the region of position p: the j with ⌊j·n/N⌋ <= p < ⌊(j+1)·n/N⌋, i.e. ⌊((p+1)·N − 1)/n⌋
    pos = B.to_int64(idx)
    region = ((pos + 1) * world_size - 1) // numel
    c = B.numel(region)
    if c > 1 and B.count_true(B.slice(region, 1, c) < B.slice(region, 0, c - 1)):
        present = {}
        for j in B.to_list(_unique_sorted(B, region)):
            inside = region == j
            lo, hi = spans[j]
            present[j] = wire.encode(B, hi - lo, B.mask(idx, inside) - lo, B.mask(vals, inside),
                                     flags, index, values)
        return present
    first = region != B.cat([B.int64_tensor([-1], like=region), B.slice(region, 0, c - 1)])
    js = B.to_list(B.mask(region, first))
    starts = B.to_list(B.mask(B.arange(c, like=region), first)) + [c]
    counts = [b - a for a, b in zip(starts, starts[1:])]
    return {j: wire.encode(B, spans[j][1] - spans[j][0], B.slice(idx, a, a + n) - spans[j][0],
                           B.slice(vals, a, a + n), flags, index, values)
            for j, a, n in zip(js, starts, counts)}


def _unique_sorted(B, idx):
    """The distinct values of an int tensor, ascending."""
    s = B.sort(idx)
    c = B.numel(s)
    if c < 2:
        return s
    first = s != B.cat([B.int64_tensor([-1], like=s), B.slice(s, 0, c - 1)])
    return B.mask(s, first)


def reduce_region(B, gathered, numel, region, count, density, name="<tensor>",
                  index="delta16", value_dtype="float32", scratch=None):
    """Steps 3 and 4 on the region's owner: sum the N ranks' payloads for its region (what the
    alltoall brought, in rank order), keep the k_j largest magnitudes of the sum.

    Args:
        B: backend. gathered: flat int32, the payloads of :func:`split_payload` for this region
            that were sent (not None), concatenated in rank order. numel (int): elements of the
            whole tensor. region (tuple): (lo, hi), this rank's region (:func:`bounds`).
        count (int): payloads in ``gathered`` (0 to N).
        density (float): ρ of the step (the warm-up's). name (str): for error messages.
        index, value_dtype: the encodings of the payload this returns.
        scratch: None, or a flat float32 tensor of hi − lo zeros to sum into; it is all zeros
            again on return (only the positions written are cleared), so a caller that keeps it
            sums a region in O(entries) instead of allocating and zeroing hi − lo elements.
    Returns:
        (payload, dropped): the flat int32 payload of (K_j, S_j[K_j]) with absolute positions
        (numel = the whole tensor; flagged FLAG_NONFINITE and empty when any contribution was
        non-finite; None when there is nothing to share: no non-zero sum), and (absolute
        positions, values) of D_j, the non-zero sums not kept, plus,
        with float16 values, the kept sums' rounding error (None when nothing was dropped or the
        step is non-finite).
    Raises:
        WireFormatError: a malformed payload (names tensor and rank).
    """
    lo, hi = region
    positions = []
    try:
        s, nonfinite = wire.decode_sum(B, gathered, hi - lo, count, name, positions, scratch,
                                       out_is_zero=scratch is not None)
    except BaseException:
        if scratch is not None:             # a malformed payload after some were summed
            B.zero_(scratch)
        raise
    empty = B.empty_indices(like=gathered)
    touched = _unique_sorted(B, B.cat(positions)) if positions else empty
    try:
        if nonfinite:
            return wire.encode(B, numel, empty, B.zeros(0, like=gathered), wire.FLAG_NONFINITE,
                               index, value_dtype), None
        return _keep(B, s, touched, numel, lo, hi, density, index, value_dtype)
    finally:
        if scratch is not None and B.numel(touched):
            B.fill_at_(scratch, touched, 0.0)


def _keep(B, s, touched, numel, lo, hi, density, index, value_dtype):
    """Step 3's selection on the region's sum ``s`` (non-zero only at ``touched``)."""
    cand = B.drop_zeros(touched, B.abs(B.take(s, touched)))
    if not B.numel(cand):
        return None, None
    k = k_for(hi - lo, density)
    dropped = None
    if B.numel(cand) > k:
        mag = B.abs(B.take(s, cand))
        t = B.kth_largest(mag, k)                   # ties at t: the lowest positions first
        ties = B.mask(cand, mag == t)
        keep = B.sort(B.cat([B.mask(cand, mag > t), B.slice(ties, 0, k - B.count_true(mag > t))]))
        kept_vals = B.take(s, keep)
        B.fill_at_(s, keep, 0.0)
        rest = B.drop_zeros(cand, B.abs(B.take(s, cand)))
        dropped = (rest + lo, B.take(s, rest))     # copies: s may be a scratch buffer
    else:
        keep, kept_vals = cand, B.take(s, cand)
    if value_dtype == "float16":    # the rounding error stays in the residual, as on the sender
        err = kept_vals - B.to_fp16_and_back(kept_vals)
        off = err != 0
        if B.count_true(off):
            lost = (B.mask(keep, off) + lo, B.mask(err, off))
            dropped = lost if dropped is None else (B.cat([dropped[0], lost[0]]),
                                                    B.cat([dropped[1], lost[1]]))
    return wire.encode(B, numel, keep + lo, kept_vals, 0, index, value_dtype), dropped


def keep_unapplied(B, u, v, summed, indices, u_sent, dropped):
    """Step 5 on one rank after a finite step: its dropped sums back into its residual
    (v ← v + D_j) and the momentum of what it sent but was not applied put back
    (u[I \\ K] ← u_sent).

    Args:
        B: backend. u, v: the tensor's flat state on this rank (u None without momentum).
        summed: the decoded phase-2 sum before any 1/N (non-zero exactly at K: each kept sum is
            non-zero and the regions are disjoint). indices, u_sent: this rank's sent positions I
            and their momentum before masking (None when it sent nothing or did not mask).
        dropped: (positions, values) of D_j, or None.
    """
    if dropped is not None:
        B.index_add_(v, dropped[0], dropped[1])
    if u is None or u_sent is None or indices is None or not B.numel(indices):
        return
    unapplied = B.take(summed, indices) == 0
    if B.count_true(unapplied):
        B.scatter_(u, B.mask(indices, unapplied), B.mask(u_sent, unapplied))
