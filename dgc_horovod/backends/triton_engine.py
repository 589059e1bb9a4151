"""The Triton engine: the engine contract (:mod:`dgc_horovod.core.engine`) as a few fused Triton
kernels per bucket, with no host synchronisation and no data-dependent size on the device path.

It runs on CUDA tensors (Triton ships with PyTorch's CUDA builds), and on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before triton is imported: how
the tests check it bit for bit against the NumPy reference). Everything it needs from the host
follows from the :class:`~dgc_horovod.core.engine.Step` (sizes, plans, payload words): per
bucket layout it uploads a small table once (kept while the layout is unchanged), and each step
passes only scalars. Its results are device tensors; nothing is read back.

**Compress** (:meth:`TritonEngine.compress`), per bucket, 5 launches (4 for a bucket of one):

0. ``torch.cat`` of the gradients into one flat buffer (skipped for a bucket of one);
1. ``_k_scan``: one program per segment draws its s samples (the counter hash of
   :mod:`~dgc_horovod.core.sparsify`) of the *updated* v, computed from g, u, v at the sampled
   positions with the accumulate arithmetic, and finds t1 and t2 (the ks1-th and ks2-th largest
   magnitude bits: a binary search over the bit patterns, in registers when the samples fit);
   one program per tile (BLOCK elements of one segment) flags NaN/Inf in its gradient;
2. ``_k_accumulate``: per tile, the segment's finite flag (from the tile flags), then u, v
   updated in place (momentum correction, every product and sum rounded on its own:
   ``enable_fp_fusion=False``; nothing for a non-finite segment) and the tile's counts of
   magnitudes >= t1 and >= t2;
3. ``_k_compact``: per tile, the level (t1 when the segment's count >= t1 reaches k, else t2) and
   the tile's place among the segment's candidates (the sum of the chosen counts of the tiles
   before it: deterministic, no atomics), then the tile's candidates (in-tile prefix sum) into a
   buffer of room ``cap`` (= n: none is dropped) per segment, ascending;
4. ``_k_settle``: per segment, the k-th largest candidate magnitude (binary search over the
   bits), the k largest by (magnitude, lower position) in ascending order, the values and
   velocities sent, the mask (v and, with masking, u cleared), float16 rounding (the error stays
   in v; an overflow zeroes the segment's u and v), and the payload (header, int32 or delta16
   indices with escapes, float32 or float16 values, zero padding) at its host-known place.

**Decode** of a whole bucket (:meth:`TritonEngine.decode_bucket`), 3 launches: ``out.zero_()``;
``_k_decode`` (per segment: every rank's frame checked and its entries added in rank order, the
non-finite flag, this rank's sent entries put back into v and u when the segment is non-finite);
``_k_finish`` (per tile: times float32(1/N), or NaN for a non-finite or malformed segment). The
per-tensor :meth:`TritonEngine.decode` uses the same kernels and reads one flag back.

Bit-identical to :class:`~dgc_horovod.core.engine.OpsEngine` on the NumPy backend
(``tests/test_conformance.py``, ``tests/test_triton_engine.py``). Imports neither Horovod nor
anything of dgc_horovod beyond ``core``.
"""
import itertools
import os

import torch
import triton
import triton.language as tl

from dgc_horovod.core import engine as _engine, sparsify, wire
from dgc_horovod.core.accumulate import restore_sent

__all__ = ["TritonEngine", "check_usable", "interpreted"]

_M32 = 0xFFFFFFFF

# ----------------------------------------------------------------------------- constants
_MIX_M1 = tl.constexpr(sparsify.MIX_M1)
_MIX_M2 = tl.constexpr(sparsify.MIX_M2)
_GOLDEN = tl.constexpr(sparsify.GOLDEN)
_MAGIC = tl.constexpr(wire.MAGIC_V3)
_BMAGIC = tl.constexpr(wire.BUCKET_MAGIC)
_ESC = tl.constexpr(wire.ESCAPE)
_HW = tl.constexpr(wire.HEADER_WORDS)
_NAN_BITS = tl.constexpr(0x7FC00000)

# The columns of a segment table (int64, one row of _NF per segment): the flat offset, numel,
# offset in the gathered gradients, k, s, ks1, ks2, cap, where the segment's samples and
# candidates start in the scratch buffers, its tiles [TSTART, TEND), where its payload and
# entries start, its index and value words, the entries pass B covers (max(k, 2·value words);
# a decode table holds the payload words there), the sample base's delta (see _seed_deltas), and
# (decode) the payload's place in a rank's frame and the member index.
_NCOLS = 20
_NF = tl.constexpr(_NCOLS)
_C_OFF, _C_N, _C_GOFF, _C_K, _C_S, _C_KS1, _C_KS2, _C_CAP = (tl.constexpr(i) for i in range(8))
_C_SSTART, _C_CSTART, _C_TSTART, _C_TEND, _C_PSTART, _C_ESTART = (tl.constexpr(i)
                                                                  for i in range(8, 14))
_C_IW, _C_VW, _C_KE, _C_DELTA, _C_FPOS, _C_MEM = (tl.constexpr(i) for i in range(14, 20))
_C_WORDS = _C_KE


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _mix32(x):
    """sparsify.mix32 on uint32 tensors (the products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * _MIX_M1
    x = x ^ (x >> 15)
    x = x * _MIX_M2
    return x ^ (x >> 16)


@triton.jit
def _update(g, u, v, m, sc, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr):
    """accumulate.momentum_correction, element-wise, each product and sum rounded on its own
    (the kernels are compiled with enable_fp_fusion=False). Returns (u, v) updated."""
    sg = g * sc
    if MOMENTUM:
        u = u * m + sg
        if NESTEROV:
            v = (v + sg) + u * m
        else:
            v = v + u
    else:
        v = v + sg
    return u, v


@triton.jit
def _load_update(g_ptr, u_ptr, v_ptr, idx, live, m, sc, MOMENTUM: tl.constexpr,
                 NESTEROV: tl.constexpr):
    """g, u, v at the positions idx (where live) and :func:`_update` of them."""
    g = tl.load(g_ptr + idx, mask=live, other=0.0)
    v = tl.load(v_ptr + idx, mask=live, other=0.0)
    if MOMENTUM:
        u = tl.load(u_ptr + idx, mask=live, other=0.0)
    else:
        u = v
    return _update(g, u, v, m, sc, MOMENTUM, NESTEROV)


@triton.jit
def _bits(x):
    """|x| as float32 bits (sign cleared), int32."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _kth(src, cnt, r1, r2, TWO: tl.constexpr, RB: tl.constexpr, CH: tl.constexpr):
    """The r1-th (and, with TWO, the r2-th) largest of the cnt non-negative int32 at src
    (1 <= r <= cnt): the largest x with count(>= x) >= r, found bit by bit from bit 30 down.
    In registers when cnt <= RB, else in chunks of CH from memory."""
    p1 = tl.zeros([], tl.int32)
    p2 = tl.zeros([], tl.int32)
    if cnt <= RB:
        o = tl.arange(0, RB)
        x = tl.load(src + o, mask=o < cnt, other=-1)
        for i in range(31):
            bit = 1 << (30 - i)
            c1 = p1 | bit
            n1 = tl.sum((x >= c1).to(tl.int32), axis=0)
            p1 = tl.where(n1 >= r1, c1, p1)
            if TWO:
                c2 = p2 | bit
                n2 = tl.sum((x >= c2).to(tl.int32), axis=0)
                p2 = tl.where(n2 >= r2, c2, p2)
    else:
        for i in range(31):
            bit = 1 << (30 - i)
            c1 = p1 | bit
            c2 = p2 | bit
            n1 = tl.zeros([], tl.int32)
            n2 = tl.zeros([], tl.int32)
            for c0 in range(0, cnt, CH):
                o = c0 + tl.arange(0, CH)
                x = tl.load(src + o, mask=o < cnt, other=-1)
                n1 += tl.sum((x >= c1).to(tl.int32), axis=0)
                if TWO:
                    n2 += tl.sum((x >= c2).to(tl.int32), axis=0)
            p1 = tl.where(n1 >= r1, c1, p1)
            if TWO:
                p2 = tl.where(n2 >= r2, c2, p2)
    return p1, p2


@triton.jit
def _any_flag(ptr, lo, hi, FCH: tl.constexpr):
    """1 if any of the int32 ptr[lo:hi] is non-zero, else 0."""
    bad = tl.zeros([], tl.int32)
    for c0 in range(lo, hi, FCH):
        o = c0 + tl.arange(0, FCH)
        bad = tl.maximum(bad, tl.max(tl.load(ptr + o, mask=o < hi, other=0), axis=0))
    return bad


# ----------------------------------------------------------------------------- compress
@triton.jit
def _k_scan(g_ptr, u_ptr, v_ptr, seg_ptr, tile_ptr, scale_ptr, flag_ptr, thr_ptr, samp_ptr,
            x0, m, sc, T,
            MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, SEG_SCALE: tl.constexpr,
            BLK: tl.constexpr, RB: tl.constexpr, CH: tl.constexpr):
    pid = tl.program_id(0)
    if pid < T:                                     # the samples and thresholds of segment pid
        row = seg_ptr + pid * _NF
        s = tl.load(row + _C_S)
        t1 = tl.full([], 1, tl.int32)
        t2 = tl.full([], 1, tl.int32)
        if s > 0:
            n = tl.load(row + _C_N)
            off = tl.load(row + _C_OFF)
            goff = tl.load(row + _C_GOFF)
            ss = tl.load(row + _C_SSTART)
            if SEG_SCALE:
                sc = tl.load(scale_ptr + pid)
            base = _mix32((x0 + tl.load(row + _C_DELTA)).to(tl.uint32))
            for c0 in range(0, s, CH):
                i = c0 + tl.arange(0, CH)
                live = i < s
                h = _mix32(base + i.to(tl.uint32) * _GOLDEN)
                p = (h.to(tl.int64) * n) >> 32
                u, v = _load_update(g_ptr + goff, u_ptr + off, v_ptr + off, p, live, m, sc,
                                    MOMENTUM, NESTEROV)
                tl.store(samp_ptr + ss + i, _bits(v), mask=live)
            tl.debug_barrier()
            a, b = _kth(samp_ptr + ss, s, tl.load(row + _C_KS1), tl.load(row + _C_KS2), True,
                        RB, CH)
            t1 = tl.maximum(a, 1)
            t2 = tl.maximum(b, 1)
        tl.store(thr_ptr + 2 * pid, t1)
        tl.store(thr_ptr + 2 * pid + 1, t2)
    else:                                           # NaN/Inf in the gradient of tile pid - T
        t = pid - T
        j = tl.load(tile_ptr + t)
        row = seg_ptr + j * _NF
        n = tl.load(row + _C_N)
        local = (t - tl.load(row + _C_TSTART)) * BLK + tl.arange(0, BLK)
        gb = tl.load(g_ptr + tl.load(row + _C_GOFF) + local, mask=local < n, other=0.0)
        gb = gb.to(tl.int32, bitcast=True)
        bad = ((gb >> 23) & 0xFF) == 0xFF
        tl.store(flag_ptr + t, tl.max(bad.to(tl.int32), axis=0))


@triton.jit
def _k_accumulate(g_ptr, u_ptr, v_ptr, seg_ptr, tile_ptr, scale_ptr, flag_ptr, thr_ptr, cnt_ptr,
                  fin_ptr, m, sc,
                  MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, SEG_SCALE: tl.constexpr,
                  BLK: tl.constexpr, FCH: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_ptr + t)
    row = seg_ptr + j * _NF
    tstart = tl.load(row + _C_TSTART)
    bad = _any_flag(flag_ptr, tstart, tl.load(row + _C_TEND), FCH)
    if t == tstart:
        tl.store(fin_ptr + j, 1 - bad)
    c1 = tl.zeros([], tl.int32)
    c2 = tl.zeros([], tl.int32)
    if bad == 0:
        n = tl.load(row + _C_N)
        off = tl.load(row + _C_OFF)
        if SEG_SCALE:
            sc = tl.load(scale_ptr + j)
        local = (t - tstart) * BLK + tl.arange(0, BLK)
        live = local < n
        u, v = _load_update(g_ptr + tl.load(row + _C_GOFF), u_ptr + off, v_ptr + off, local,
                            live, m, sc, MOMENTUM, NESTEROV)
        if MOMENTUM:
            tl.store(u_ptr + off + local, u, mask=live)
        tl.store(v_ptr + off + local, v, mask=live)
        bits = tl.where(live, _bits(v), 0)
        c1 = tl.sum((bits >= tl.load(thr_ptr + 2 * j)).to(tl.int32), axis=0)
        c2 = tl.sum((bits >= tl.load(thr_ptr + 2 * j + 1)).to(tl.int32), axis=0)
    tl.store(cnt_ptr + 2 * t, c1)
    tl.store(cnt_ptr + 2 * t + 1, c2)


@triton.jit
def _k_compact(v_ptr, seg_ptr, tile_ptr, thr_ptr, cnt_ptr, fin_ptr, tot_ptr, cpos_ptr, cbits_ptr,
               BLK: tl.constexpr, FCH: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_ptr + t)
    row = seg_ptr + j * _NF
    tstart = tl.load(row + _C_TSTART)
    tend = tl.load(row + _C_TEND)
    ok = tl.load(fin_ptr + j)
    total = tl.zeros([], tl.int32)
    if ok != 0:
        s1 = tl.zeros([], tl.int32)
        s2 = tl.zeros([], tl.int32)
        q1 = tl.zeros([], tl.int32)
        q2 = tl.zeros([], tl.int32)
        for c0 in range(tstart, tend, FCH):
            o = c0 + tl.arange(0, FCH)
            mk = o < tend
            a = tl.load(cnt_ptr + 2 * o, mask=mk, other=0)
            b = tl.load(cnt_ptr + 2 * o + 1, mask=mk, other=0)
            s1 += tl.sum(a, axis=0)
            s2 += tl.sum(b, axis=0)
            q1 += tl.sum(tl.where(o < t, a, 0), axis=0)
            q2 += tl.sum(tl.where(o < t, b, 0), axis=0)
        first = s1 >= tl.load(row + _C_K)
        level = tl.where(first, tl.load(thr_ptr + 2 * j), tl.load(thr_ptr + 2 * j + 1))
        pre = tl.where(first, q1, q2)
        total = tl.where(first, s1, s2)
        cap = tl.load(row + _C_CAP)
        if pre < cap:
            n = tl.load(row + _C_N)
            local = (t - tstart) * BLK + tl.arange(0, BLK)
            live = local < n
            v = tl.load(v_ptr + tl.load(row + _C_OFF) + local, mask=live, other=0.0)
            bits = _bits(v)
            cand = live & (bits >= level)
            ci = cand.to(tl.int32)
            slot = pre + tl.cumsum(ci, axis=0) - ci
            w = cand & (slot < cap)
            cs = tl.load(row + _C_CSTART)
            tl.store(cpos_ptr + cs + slot, local, mask=w)
            tl.store(cbits_ptr + cs + slot, bits, mask=w)
    if t == tstart:
        tl.store(tot_ptr + j, total)


@triton.jit
def _k_settle(u_ptr, v_ptr, seg_ptr, fin_ptr, tot_ptr, cpos_ptr, cbits_ptr, pay_ptr, pay16_ptr,
              sel_ptr, vals_ptr, usent_ptr, stats_ptr, flags_ptr, T, word3,
              MOMENTUM: tl.constexpr, MASKING: tl.constexpr, DELTA16: tl.constexpr,
              FP16: tl.constexpr, RB: tl.constexpr, CH: tl.constexpr):
    j = tl.program_id(0)
    row = seg_ptr + j * _NF
    n = tl.load(row + _C_N)
    k = tl.load(row + _C_K).to(tl.int32)
    off = tl.load(row + _C_OFF)
    ps = tl.load(row + _C_PSTART)
    es = tl.load(row + _C_ESTART)
    iw = tl.load(row + _C_IW)
    vw = tl.load(row + _C_VW)
    ok = tl.load(fin_ptr + j)
    if DELTA16:                         # zero the index section (tokens are scattered into it)
        for z0 in range(0, iw, CH):
            o = z0 + tl.arange(0, CH)
            tl.store(pay_ptr + ps + _HW + o, tl.zeros([CH], tl.int32), mask=o < iw)
    c = tl.zeros([], tl.int32)
    if ok != 0:                         # settle to k: pass A writes the positions sent
        cs = tl.load(row + _C_CSTART)
        cc = tl.minimum(tl.load(tot_ptr + j), tl.load(row + _C_CAP)).to(tl.int32)
        thr = tl.zeros([], tl.int32)
        need = tl.zeros([], tl.int32)
        if cc > k:
            thr, _unused = _kth(cbits_ptr + cs, cc, k, k, False, RB, CH)
            above = tl.zeros([], tl.int32)
            for a0 in range(0, cc, CH):
                o = a0 + tl.arange(0, CH)
                b = tl.load(cbits_ptr + cs + o, mask=o < cc, other=0)
                above += tl.sum((b > thr).to(tl.int32), axis=0)
            need = k - above
        seen = tl.zeros([], tl.int32)
        for b0 in range(0, cc, CH):
            o = b0 + tl.arange(0, CH)
            mk = o < cc
            b = tl.load(cbits_ptr + cs + o, mask=mk, other=0)
            p = tl.load(cpos_ptr + cs + o, mask=mk, other=0)
            eq = (mk & (b == thr)).to(tl.int32)
            take = (mk & (b > thr)) | ((eq != 0) & (seen + tl.cumsum(eq, axis=0) - eq < need))
            ti = take.to(tl.int32)
            tl.store(sel_ptr + es + c + tl.cumsum(ti, axis=0) - ti, p.to(tl.int64), mask=take)
            seen += tl.sum(eq, axis=0)
            c += tl.sum(ti, axis=0)
    tl.debug_barrier()
    # pass B: entries, mask, float16 rounding, payload (every word of it, padding included)
    ntok = tl.zeros([], tl.int32)
    ovf = tl.zeros([], tl.int32)
    flushed = tl.zeros([], tl.int32)
    vs = ps + _HW + iw
    for d0 in range(0, tl.load(row + _C_KE), CH):
        i = d0 + tl.arange(0, CH)
        live = i < c
        ink = i < k
        p = tl.load(sel_ptr + es + i, mask=live, other=0)
        x = tl.load(v_ptr + off + p, mask=live, other=0.0)
        tl.store(sel_ptr + es + i, tl.zeros([CH], tl.int64), mask=ink & (i >= c))
        tl.store(vals_ptr + es + i, x, mask=ink)
        if MASKING:
            us = tl.load(u_ptr + off + p, mask=live, other=0.0)
            tl.store(usent_ptr + es + i, us, mask=ink)
            tl.store(u_ptr + off + p, tl.zeros([CH], tl.float32), mask=live)
        if FP16:
            h = x.to(tl.float16)
            hb = h.to(tl.int16, bitcast=True)
            mag = hb.to(tl.int32) & 0x7FFF
            ovf += tl.sum((live & (mag == 0x7C00)).to(tl.int32), axis=0)
            flushed += tl.sum((live & (mag == 0) & (_bits(x) != 0)).to(tl.int32), axis=0)
            tl.store(v_ptr + off + p, x - h.to(tl.float32), mask=live)
            tl.store(pay16_ptr + 2 * vs + i, tl.where(live, hb, 0).to(tl.int16),
                     mask=i < 2 * vw)
        else:
            tl.store(v_ptr + off + p, tl.zeros([CH], tl.float32), mask=live)
            tl.store(pay_ptr + vs + i, tl.where(live, x.to(tl.int32, bitcast=True), 0),
                     mask=ink)
        if DELTA16:
            prev = tl.load(sel_ptr + es + i - 1, mask=live & (i > 0), other=-1)
            gap = p - prev
            esc = (gap - 1) // _ESC
            adv = tl.where(live, esc + 1, 0).to(tl.int32)
            pos = ntok + tl.cumsum(adv, axis=0) - 1
            tl.store(pay16_ptr + 2 * (ps + _HW) + pos, (gap - esc * _ESC).to(tl.int16),
                     mask=live)
            ntok += tl.sum(adv, axis=0)
        else:
            tl.store(pay_ptr + ps + _HW + i, tl.where(live, p, 0).to(tl.int32), mask=ink)
    if not DELTA16:
        ntok = c
    dropped = ovf > 0
    if dropped:                         # float16 overflow: the segment's u and v restart at 0
        tl.debug_barrier()
        for f0 in range(0, n, CH):
            o = f0 + tl.arange(0, CH)
            tl.store(v_ptr + off + o, tl.zeros([CH], tl.float32), mask=o < n)
            if MOMENTUM:
                tl.store(u_ptr + off + o, tl.zeros([CH], tl.float32), mask=o < n)
    tl.store(pay_ptr + ps, _MAGIC)
    tl.store(pay_ptr + ps + 1, n.to(tl.int32))
    tl.store(pay_ptr + ps + 2, c)
    tl.store(pay_ptr + ps + 3, word3 | (1 - ok))
    tl.store(pay_ptr + ps + 4, ntok)
    tl.store(pay_ptr + ps + 5, k.to(tl.int32))
    tl.store(stats_ptr + j, c.to(tl.int64))
    tl.store(stats_ptr + T + j, ovf.to(tl.int64))
    tl.store(stats_ptr + 2 * T + j, flushed.to(tl.int64))
    tl.store(flags_ptr + j, ok.to(tl.int8))
    tl.store(flags_ptr + T + j, dropped.to(tl.int8))


@triton.jit
def _value(w_ptr, w16_ptr, vs, e, ok, vcode):
    """The values of entries e (where ok) of a payload whose value section starts at word vs,
    float32 (vcode 0) or float16 (1); and 1 if a float16 one is ±inf, else 0."""
    if vcode == 0:
        val = tl.load(w_ptr + vs + e, mask=ok, other=0).to(tl.float32, bitcast=True)
        inf = tl.zeros([], tl.int32)
    else:
        hb = tl.load(w16_ptr + 2 * vs + e, mask=ok, other=0)
        val = hb.to(tl.float16, bitcast=True).to(tl.float32)
        inf = tl.max((ok & ((hb.to(tl.int32) & 0x7FFF) == 0x7C00)).to(tl.int32), axis=0)
    return val, inf


# ----------------------------------------------------------------------------- decode
@triton.jit
def _add_entries(out_ptr, p, ok, wrong, w_ptr, w16_ptr, vs, e, vcode, err, nf):
    """out[p] += the values of entries e where ok (one rank's, positions distinct); returns
    (err, nf) raised by the wrong entries and by the non-finite values."""
    err = tl.maximum(err, tl.max(wrong.to(tl.int32), axis=0))
    val, inf = _value(w_ptr, w16_ptr, vs, e, ok, vcode)
    o = tl.load(out_ptr + p, mask=ok, other=0.0)
    tl.store(out_ptr + p, o + val, mask=ok)
    return err, tl.maximum(nf, inf)


@triton.jit
def _k_decode(w_ptr, w16_ptr, seg_ptr, out_ptr, nf_ptr, err_ptr, ranks, frame, members,
              v_ptr, u_ptr, sel_ptr, vals_ptr, usent_ptr, cnt_ptr, drop_ptr,
              BUCKET: tl.constexpr, RESTORE: tl.constexpr, MASKING: tl.constexpr,
              CH: tl.constexpr):
    j = tl.program_id(0)
    row = seg_ptr + j * _NF
    n = tl.load(row + _C_N)
    off = tl.load(row + _C_OFF)
    words = tl.load(row + _C_WORDS)
    fpos = tl.load(row + _C_FPOS)
    nf = tl.zeros([], tl.int32)
    err = tl.zeros([], tl.int32)
    for r in range(0, ranks):
        base = (tl.zeros([], tl.int64) + r) * frame
        q = base
        if BUCKET:
            bad_frame = ((tl.load(w_ptr + base) != _BMAGIC) | (tl.load(w_ptr + base + 1) != members)
                         | (tl.load(w_ptr + base + fpos) != tl.load(row + _C_MEM)))
            err = tl.maximum(err, bad_frame.to(tl.int32))
            q = base + fpos + 1
        magic = tl.load(w_ptr + q)
        pn = tl.load(w_ptr + q + 1)
        c = tl.load(w_ptr + q + 2)
        w3 = tl.load(w_ptr + q + 3)
        tok = tl.load(w_ptr + q + 4)
        pk = tl.load(w_ptr + q + 5)
        icode = (w3 >> 8) & 0xFF
        vcode = (w3 >> 16) & 0xFF
        esc = tl.maximum(pn - 1, 0) // _ESC
        kk = tl.maximum(pk, 0)
        iw = tl.where(icode == 0, kk, (kk + esc + 1) // 2)
        vw = tl.where(vcode == 0, kk, (kk + 1) // 2)
        bad = ((magic != _MAGIC) | (pn != n) | (c < 0) | (c > pk) | (pk > pn) | (icode > 1)
               | (vcode > 1) | ((w3 >> 24) != 0) | (c > tok) | (tok > c + esc)
               | ((icode == 0) & (tok != c)) | (_HW + iw + vw != words))
        err = tl.maximum(err, bad.to(tl.int32))
        if bad == 0:
            nf = tl.maximum(nf, w3 & 1)
            vs = q + _HW + iw
            if icode == 0:
                for h0 in range(0, c, CH):
                    i = h0 + tl.arange(0, CH)
                    live = i < c
                    p = tl.load(w_ptr + q + _HW + i, mask=live, other=0)
                    prev = tl.load(w_ptr + q + _HW + i - 1, mask=live & (i > 0), other=-1)
                    wrong = live & ((p < 0) | (p >= n) | (p <= prev))
                    err, nf = _add_entries(out_ptr + off, p, live & ~wrong, wrong, w_ptr,
                                           w16_ptr, vs, i, vcode, err, nf)
            else:
                at = tl.full([], -1, tl.int64)
                e0 = tl.zeros([], tl.int32)
                for k0 in range(0, tok, CH):
                    i = k0 + tl.arange(0, CH)
                    live = i < tok
                    tk = tl.load(w16_ptr + 2 * (q + _HW) + i, mask=live, other=0).to(tl.int32)
                    tk = tk & 0xFFFF
                    ent = live & (tk != 0)
                    adv = tl.where(live, tl.where(tk != 0, tk, _ESC), 0).to(tl.int64)
                    p = at + tl.cumsum(adv, axis=0)
                    ei = ent.to(tl.int32)
                    e = e0 + tl.cumsum(ei, axis=0) - 1
                    wrong = ent & ((p >= n) | (e >= c))
                    err, nf = _add_entries(out_ptr + off, p, ent & ~wrong, wrong, w_ptr,
                                           w16_ptr, vs, e, vcode, err, nf)
                    at += tl.sum(adv, axis=0)
                    e0 += tl.sum(ei, axis=0)
                err = tl.maximum(err, (e0 != c).to(tl.int32))
        tl.debug_barrier()              # rank r's additions before rank r + 1's
    if RESTORE:                         # non-finite: this rank's sent entries go back
        if (nf != 0) & (err == 0):
            if tl.load(drop_ptr + j).to(tl.int32) == 0:
                es = tl.load(row + _C_ESTART)
                cnt = tl.load(cnt_ptr + j)
                for r0 in range(0, cnt, CH):
                    i = r0 + tl.arange(0, CH)
                    live = i < cnt
                    p = tl.load(sel_ptr + es + i, mask=live, other=0)
                    tl.store(v_ptr + off + p, tl.load(vals_ptr + es + i, mask=live), mask=live)
                    if MASKING:
                        tl.store(u_ptr + off + p, tl.load(usent_ptr + es + i, mask=live),
                                 mask=live)
    tl.store(nf_ptr + j, nf.to(tl.int8))
    tl.store(err_ptr + j, err)


@triton.jit
def _k_finish(out_ptr, seg_ptr, tile_ptr, nf_ptr, err_ptr, inv,
              SCALE: tl.constexpr, BLK: tl.constexpr):
    t = tl.program_id(0)
    j = tl.load(tile_ptr + t)
    row = seg_ptr + j * _NF
    local = (t - tl.load(row + _C_TSTART)) * BLK + tl.arange(0, BLK)
    live = local < tl.load(row + _C_N)
    ptr = out_ptr + tl.load(row + _C_OFF) + local
    if (tl.load(nf_ptr + j) != 0) | (tl.load(err_ptr + j) != 0):
        nan = tl.full([BLK], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
        tl.store(ptr, nan, mask=live)
    else:
        if SCALE:
            tl.store(ptr, tl.load(ptr, mask=live, other=0.0) * inv, mask=live)


# ----------------------------------------------------------------------------- host side
def interpreted():
    """Whether Triton runs under its interpreter (TRITON_INTERPRET=1: kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_usable(like, required=False):
    """Whether the Triton engine can run on tensors like ``like``: CUDA tensors, or CPU tensors
    under the interpreter. With ``required`` an unusable case raises ValueError saying why."""
    if like.is_cuda or (like.device.type == "cpu" and interpreted()):
        return True
    if required:
        raise ValueError(f"DGC(engine='triton') runs on CUDA tensors (or on CPU tensors under "
                         f"Triton's interpreter, TRITON_INTERPRET=1); these are on {like.device}")
    return False


def _seed_deltas(step):
    """How the sample bases reach the device without an upload per step: segment j's base is
    mix32(A_j + count·GOLDEN) (:func:`~dgc_horovod.core.sparsify.step_base`, A_j =
    ``step.seeds[j]``), so the layout's table holds the deltas A_j − A_0 (mod 2**32), the same
    at every step (uploaded again only for other names or seed), and each launch passes
    x0 = A_0 + count·GOLDEN: the kernel computes base_j = mix32(x0 + delta_j), exactly the
    host's value. Returns (deltas, x0)."""
    a0 = step.seeds[0]
    x0 = (a0 + (step.count & _M32) * sparsify.GOLDEN) & _M32
    return tuple((a - a0) & _M32 for a in step.seeds), x0


def _upload(values, dtype, device):
    """A host list as a device tensor, without a host synchronisation (pinned, non-blocking
    on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class _Layout:
    """What a bucket layout (sizes, plans, payload words, encodings) needs on the device: the
    segment table, the tile table, and views of the engine's scratch buffers (every kernel of a
    call runs on one stream, in order, and a call's results live in buffers of their own, so
    every layout shares them: the candidates' room alone is the bucket's size)."""

    def __init__(self, step, device, block, deltas, scratch):
        T = len(step.sizes)
        sizes, plans = step.sizes, step.plans
        goffs = list(itertools.accumulate(sizes, initial=0))
        tiles, tstart = _tiles(sizes, block)
        sstart = list(itertools.accumulate((p.s for p in plans), initial=0))
        cstart = list(itertools.accumulate((p.cap for p in plans), initial=0))
        self.T, self.ntiles = T, len(tiles)
        rows = []
        for j, (n, p) in enumerate(zip(sizes, plans)):
            iw = wire.index_words(n, p.k, step.index)
            vw = wire.value_words(p.k, step.values)
            rows += [step.offsets[j], n, goffs[j], p.k, p.s, p.ks1, p.ks2, p.cap, sstart[j],
                     cstart[j], tstart[j], tstart[j + 1], step.pstarts[j],
                     step.starts[j], iw, vw, max(p.k, 2 * vw), deltas[j], 0, 0]
        self.rows = rows
        self.device = device
        self.seg = _upload(rows, torch.int64, device)
        self.tile = _upload(tiles, torch.int32, device)
        self.deltas = tuple(deltas)
        self.gbuf = scratch("g", goffs[-1], torch.float32) if T > 1 else None
        self.flags = scratch("flags", self.ntiles)
        self.cnt = scratch("cnt", 2 * self.ntiles)
        self.thr = scratch("thr", 2 * T)
        self.fin = scratch("fin", T)
        self.tot = scratch("tot", T)
        self.samp = scratch("samp", max(sstart[-1], 1))
        self.cpos = scratch("cpos", max(cstart[-1], 1))
        self.cbits = scratch("cbits", max(cstart[-1], 1))

    def with_deltas(self, deltas):
        """Upload a new base column (another seed or other tensor names: rare)."""
        for j, d in enumerate(deltas):
            self.rows[j * _NCOLS + _C_DELTA.value] = d
        self.seg = _upload(self.rows, torch.int64, self.device)
        self.deltas = tuple(deltas)


def _tiles(sizes, block):
    """The tile table of segments of ``sizes`` elements (each tile's segment, ``block``
    elements a tile) and where each segment's tiles start (T + 1 entries)."""
    tiles, tstart = [], [0]
    for j, n in enumerate(sizes):
        tiles += [j] * -(-n // block)
        tstart.append(len(tiles))
    return tiles, tstart


class _DecodeTable:
    """The decode of a frame layout: per segment its numel, flat offset, payload words, place in
    a rank's frame and member index, and the tiles of the output buffer."""

    def __init__(self, sizes, offsets, words, fpos, members, estarts, device, block):
        tiles, tstart = _tiles(sizes, block)
        rows = []
        for j, n in enumerate(sizes):
            rows += [offsets[j], n, 0, 0, 0, 0, 0, 0, 0, 0, tstart[j], tstart[j + 1], 0,
                     estarts[j], 0, 0, words[j], 0, fpos[j], members[j]]
        self.T, self.ntiles = len(sizes), len(tiles)
        self.seg = _upload(rows, torch.int64, device)
        self.tile = _upload(tiles, torch.int32, device)


class TritonEngine:
    """The engine contract on Triton kernels (module docstring). ``flat = True``: it works on
    the bucket's flat u and v buffers.

    Args: B (TorchBackend). block (int): elements per tile of the element-wise kernels.
        rb (int): the largest sample / candidate count whose k-th largest is searched in
        registers (else bit by bit in chunks from memory, slower). chunk (int): the vector
        width of the per-segment kernels. All powers of two; the results do not depend on
        them (the tests run small ones). tile_warps, seg_warps: warps per program of the
        per-tile and the per-segment kernels (GPU only; at these defaults no kernel spills
        registers on sm_90).
    """

    name = "triton"
    flat = True

    def __init__(self, B, block=4096, rb=32768, chunk=4096, tile_warps=16, seg_warps=32):
        self.B = B
        self.block, self.rb, self.chunk = block, rb, chunk
        self.tile_warps, self.seg_warps = tile_warps, seg_warps
        self._layouts = {}
        self._decodes = {}
        self._scratch = {}      # (device, name) -> a buffer grown to the largest layout's need

    # ------------------------------------------------------------------ launches
    def _launch(self, kernel, grid, *args, per_segment=False, **constexprs):
        """One launch of ``kernel`` on ``grid`` programs, compiled without fused multiply-add
        (the contract rounds every product and sum on its own)."""
        kernel[(grid,)](*args, **constexprs,
                        num_warps=self.seg_warps if per_segment else self.tile_warps,
                        enable_fp_fusion=False)

    def _scratch_buffer(self, device, name, n, dtype):
        """The first n elements of the engine's scratch buffer ``name`` on ``device`` (grown,
        never shrunk; a grown buffer gives the layouts made from then on a new one, and those
        made before keep theirs)."""
        buf = self._scratch.get((device, name))
        if buf is None or buf.numel() < n:
            buf = self._scratch[(device, name)] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]

    def _layout(self, step, device, deltas):
        key = (device, tuple(step.sizes), tuple((p.k, p.s, p.ks1, p.ks2, p.cap)
                                               for p in step.plans),
               step.index, step.values)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) >= 64:
                self._layouts.pop(next(iter(self._layouts)))
            lay = self._layouts[key] = _Layout(step, device, self.block, deltas,
                                               lambda name, n, dtype=torch.int32:
                                               self._scratch_buffer(device, name, n, dtype))
        elif lay.deltas != deltas:
            lay.with_deltas(deltas)
        return lay

    # ------------------------------------------------------------------ compress
    def compress(self, step, us, vs, grads, scales, flat):
        """Steps 1–6 of the engine contract for every segment of the bucket, on the flat
        buffers ``flat`` = (u or None, v). Returns a :class:`~dgc_horovod.core.engine.Result`
        whose fields are device tensors: payloads (views of one int32 buffer), counts (int64,
        T), finite (bool, T), sel / vals / usent (flat, room for k per segment), fp16 (int64,
        (T, 2)), dropped (bool, T). No host synchronisation."""
        u, v = flat
        dev = v.device
        T = len(step.sizes)
        deltas, x0 = _seed_deltas(step)
        lay = self._layout(step, dev, deltas)
        g = grads[0].contiguous() if T == 1 else torch.cat(grads, out=lay.gbuf)
        seg_scale = any(s != scales[0] for s in scales)
        sc = float(scales[0])
        scale_t = _upload(scales, torch.float32, dev) if seg_scale else lay.thr
        mom = step.momentum != 0.0
        masking = bool(step.masking)
        uu = u if (mom and u is not None) else v
        delta16 = step.index == "delta16"
        fp16 = step.values == "float16"
        m = float(step.momentum)
        P, E = step.pstarts[-1], step.starts[-1]
        pay = torch.empty(P, dtype=torch.int32, device=dev)
        sel = torch.empty(E, dtype=torch.int64, device=dev)
        vals = torch.empty(E, dtype=torch.float32, device=dev)
        usent = torch.empty(E, dtype=torch.float32, device=dev) if masking else vals
        stats = torch.empty(3 * T, dtype=torch.int64, device=dev)
        flags = torch.empty(2 * T, dtype=torch.int8, device=dev)
        word3 = (wire.INDEX_ENCODINGS.index(step.index) << 8
                 | wire.VALUE_DTYPES.index(step.values) << 16)
        self._launch(_k_scan, T + lay.ntiles, g, uu, v, lay.seg, lay.tile, scale_t, lay.flags,
                     lay.thr, lay.samp, x0 + (1 << 32), m, sc, T,
                     MOMENTUM=mom, NESTEROV=bool(step.nesterov), SEG_SCALE=seg_scale,
                     BLK=self.block, RB=self.rb, CH=self.chunk, per_segment=True)
        self._launch(_k_accumulate, lay.ntiles, g, uu, v, lay.seg, lay.tile, scale_t,
                     lay.flags, lay.thr, lay.cnt, lay.fin, m, sc,
                     MOMENTUM=mom, NESTEROV=bool(step.nesterov), SEG_SCALE=seg_scale,
                     BLK=self.block, FCH=1024)
        self._launch(_k_compact, lay.ntiles, v, lay.seg, lay.tile, lay.thr, lay.cnt, lay.fin,
                     lay.tot, lay.cpos, lay.cbits, BLK=self.block, FCH=1024)
        self._launch(_k_settle, T, uu, v, lay.seg, lay.fin, lay.tot, lay.cpos, lay.cbits, pay,
                     pay.view(torch.int16), sel, vals, usent, stats, flags, T, word3,
                     MOMENTUM=mom, MASKING=masking, DELTA16=delta16, FP16=fp16,
                     RB=self.rb, CH=self.chunk, per_segment=True)
        st = stats.view(3, T)
        fl = flags.view(2, T).view(torch.bool)
        return _engine.Result(payloads=list(pay.split(step.words)), counts=st[0],
                              finite=fl[0], sel=sel, vals=vals,
                              usent=usent if masking else None, fp16=st[1:].t(),
                              dropped=fl[1])

    # ------------------------------------------------------------------ decode
    def _decode_table(self, key, make):
        tab = self._decodes.get(key)
        if tab is None:
            if len(self._decodes) >= 64:
                self._decodes.pop(next(iter(self._decodes)))
            tab = self._decodes[key] = make()
        return tab

    def decode_bucket(self, step, gathered, ranks, out, inv=None, members=None, result=None,
                      flat=None, name="<bucket>"):
        """The zero-sync receive path of a bucket: the allgather of ``ranks`` frames
        (:func:`~dgc_horovod.core.wire.frame_bucket`, every rank sending every segment, in
        order), summed in rank order into ``out``, then times float32(inv).

        Args:
            step: the bucket's :class:`~dgc_horovod.core.engine.Step` (this rank's: its payload
                words fix where each segment lies in every rank's frame).
            gathered: flat int32 device tensor, ``ranks`` frames of ``2 + sum(1 + words)``
                words each.
            ranks (int): frames in ``gathered``.
            out: flat float32 device tensor of ``step.offsets[-1]`` elements: segment j's
                result at ``step.offsets[j]`` (the gaps are zeroed).
            inv (float or None): the averaging factor 1/N (None: the sum).
            members (list of int or None): each segment's member index in the frames (the
                tensor's position in the bucket; default 0..T-1).
            result (Result or None), flat ((u or None, v) or None): this rank's compress result
                of the step and the bucket's flat state: where a segment is non-finite (a rank
                flagged NaN/Inf or sent a float16 ±inf), the entries this rank sent go back into
                v (and u with masking), unless its own float16 overflow dropped the segment.
            name (str): the bucket's name, for the errors of the generic path.
        Returns:
            (nonfinite, error): bool and int32 device tensors of T entries. A non-finite
            segment's ``out`` is NaN. ``error[j] != 0``: segment j's frames are malformed or
            not laid out as this rank's (other sizes, encodings or members, a repeated int32
            position); its ``out`` is NaN too and nothing was put back. Read ``error`` where
            the caller synchronises anyway and call :meth:`check_bucket` then: it raises the
            reference's :class:`~dgc_horovod.core.wire.WireFormatError`, or redoes the bucket on
            the generic path where the reference accepts the frames.

        Launches: ``out.zero_()``, ``_k_decode`` (one program per segment: the ranks in order),
        ``_k_finish`` (per tile: the scaling, NaN). No host synchronisation.
        """
        T = len(step.sizes)
        dev = out.device
        members = list(range(T)) if members is None else list(members)
        fpos = [2]
        for w in step.words:
            fpos.append(fpos[-1] + 1 + w)
        frame = fpos[-1]
        if ranks <= 0 or gathered.numel() != ranks * frame:     # known here: no device read
            nfs = self._generic_bucket(step, gathered, ranks, out, inv, members, name, result,
                                       flat)
            return (torch.tensor(nfs, dtype=torch.bool, device=dev),
                    torch.zeros(T, dtype=torch.int32, device=dev))
        key = ("bucket", dev, tuple(step.sizes), tuple(step.words), tuple(members),
               tuple(step.starts))
        tab = self._decode_table(key, lambda: _DecodeTable(
            step.sizes, step.offsets, step.words, fpos, members, step.starts, dev, self.block))
        nf = torch.empty(T, dtype=torch.int8, device=dev)
        err = torch.empty(T, dtype=torch.int32, device=dev)
        out.zero_()
        restore = result is not None and flat is not None
        masking = False
        if restore:
            u, v = flat
            masking = result.usent is not None and u is not None
            counts, dropped = result.counts, result.dropped
            if not torch.is_tensor(counts):         # another engine's Result (host lists)
                counts = _upload([int(c) for c in counts], torch.int64, dev)
            if not torch.is_tensor(dropped):
                dropped = _upload([bool(d) for d in dropped], torch.bool, dev)
            args = (v, u if masking else v, result.sel, result.vals,
                    result.usent if masking else result.vals, counts, dropped)
        else:
            args = (out, out, err, out, out, err, nf)
        self._launch(_k_decode, T, gathered, gathered.view(torch.int16), tab.seg, out, nf, err,
                     ranks, frame, T, *args, BUCKET=True, RESTORE=restore, MASKING=masking,
                     CH=self.chunk, per_segment=True)
        self._launch(_k_finish, tab.ntiles, out, tab.seg, tab.tile, nf, err,
                     1.0 if inv is None else float(inv), SCALE=inv is not None, BLK=self.block)
        return nf.view(torch.bool), err

    def check_bucket(self, step, gathered, ranks, out, error, inv=None, members=None,
                     name="<bucket>", result=None, flat=None):
        """After :meth:`decode_bucket`: reads ``error`` (a host synchronisation). Where it is
        set, the bucket is decoded again on the generic path (the reference's
        :func:`~dgc_horovod.core.wire.split_bucket` and per-tensor decode): a malformed frame
        raises its :class:`~dgc_horovod.core.wire.WireFormatError`; frames the reference
        accepts (laid out otherwise than this rank's) give its result in ``out``, with this
        rank's entries put back where a segment is non-finite. Returns None when ``error`` is
        clear, else the generic decode's non-finite flags (a list of bool)."""
        if not bool(error.any()):
            return None
        members = list(range(len(step.sizes))) if members is None else list(members)
        return self._generic_bucket(step, gathered, ranks, out, inv, members, name, result,
                                    flat)

    def _generic_bucket(self, step, gathered, ranks, out, inv, members, name, result, flat):
        """The bucket's decode on the reference's host path (see :meth:`check_bucket`)."""
        B = self.B
        parts = wire.split_bucket(B, gathered, ranks, max(members) + 1, name)
        ref = _engine.OpsEngine(B)
        out.zero_()
        nfs = []
        for j, (a, n) in enumerate(zip(step.offsets, step.sizes)):
            seg = out[a:a + n]
            got = parts[members[j]]
            nonfinite = bool(got) and ref.decode(torch.cat(got), n, len(got), seg, inv,
                                                 f"{name}[{step.names[j]}]")
            if nonfinite:
                seg.fill_(float("nan"))
                if result is not None and flat is not None and not bool(result.dropped[j]):
                    u, v = flat
                    restore_sent(B, None if u is None else u[a:a + n], v[a:a + n],
                                 *result.entries(B, step, j, int(result.counts[j])))
            nfs.append(nonfinite)
        return nfs

    def decode(self, gathered, numel, ranks, out, inv=None, name="<tensor>"):
        """:meth:`OpsEngine.decode <dgc_horovod.core.engine.OpsEngine.decode>` (the per-tensor
        contract) on the device, reading one status back. Payloads not all of one size, and
        malformed ones (raised as the reference raises them), go the reference's way."""
        total = gathered.numel()
        if out.numel() != numel:
            raise ValueError(f"decode_sum: out has {out.numel()} elements, tensor {name!r} "
                             f"{numel}")
        if ranks <= 0 or total % ranks or total // ranks < wire.HEADER_WORDS:
            return _engine.OpsEngine(self.B).decode(gathered, numel, ranks, out, inv, name)
        words = total // ranks
        dev = out.device
        tab = self._decode_table(("tensor", dev, numel, words), lambda: _DecodeTable(
            [numel], [0], [words], [0], [0], [0], dev, self.block))
        status = torch.empty(2, dtype=torch.int32, device=dev)     # [non-finite, error]
        nf, err = status[:1], status[1:]
        gathered = gathered.contiguous()
        out.zero_()
        self._launch(_k_decode, 1, gathered, gathered.view(torch.int16), tab.seg, out, nf, err,
                     ranks, words, 1, out, out, err, out, out, err, nf,
                     BUCKET=False, RESTORE=False, MASKING=False, CH=self.chunk,
                     per_segment=True)
        if inv is not None:
            self._launch(_k_finish, tab.ntiles, out, tab.seg, tab.tile, nf, err, float(inv),
                         SCALE=True, BLK=self.block)
        nonfinite, error = status.tolist()
        if error:
            return _engine.OpsEngine(self.B).decode(gathered, numel, ranks, out, inv, name)
        return bool(nonfinite)
