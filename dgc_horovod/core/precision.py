"""Mixed precision in DGC, in the order a gradient meets it: the loss scale the state follows
(:func:`rescale`, before a step's first compress, from :meth:`DGCCore.set_loss_scale`), and
float16 wire values (:func:`round_to_fp16`, at encode, ``wire_values="float16"``).

Loss scaling (mixed precision; the PyTorch adapter's ``DGC(loss_scaler=...)`` calls
:meth:`DGCCore.set_loss_scale` once per step, before the step's first compress). Under a loss
scaler the gradient handed to DGC at step t is S_t·g_t (S_t: the step's loss scale, g_t: the
gradient of the loss itself), and the optimizer receives the exchanged update divided by S_t
(GradScaler.unscale_). DGC keeps every tensor's state in the units of the scale it was
accumulated at, :attr:`DGCCore.loss_scale` S: with u, v, b the state of the unscaled algorithm
(b: the separate weight decay's buffer), the core holds S·u, S·v, S·b. At a step whose scale
differs, set_loss_scale first multiplies each of them by S_t/S; then, with c_t the clipping
factor and T the clipping threshold,

    S_t·u_t = m·(S_t·u_{t−1}) + c_t·(S_t·g_t) + (λ·S_t)·w    =  S_t·(m·u_{t−1} + c_t·g_t + λ·w)
    S_t·v_t = S_t·v_{t−1} + S_t·u_t                           =  S_t·(v_{t−1} + u_t)
    c_t     = min(1, T / (‖S_t·g_t‖/S_t + ε))                  (the threshold is T·S_t)
    S_t·b_t = m·(S_t·b_{t−1}) + (λ·S_t)·w                     (weight_decay_mode "separate")

(λ·w only with weight decay, in the mode's place). Momentum correction, the residual, top-k of
|v|, the exchange and the average are linear or scale-invariant, so every value sent and the
decoded update are S_t times the unscaled algorithm's, and after the division by S_t the
optimizer receives the update DGC would give without a loss scaler. GradScaler's scales are
powers of two (init 2**16, halved or doubled), so each of these products is exact in floating
point (barring float32 over/underflow) and the update is bit-identical to training without a
scaler. Why the state follows the scale instead of being kept unscaled (each gradient divided
by S_t on entry): the rescaling pass runs only when the scale changes (a back-off, or a growth
every growth_interval steps), not every step, and the values sent stay those of the scaled
gradient, so float16 wire values overflow exactly when the scale is too large for float16, as a
dense float16 exchange would, and the scaler sees it. A tensor whose state the rescaling makes
non-finite (float32 overflow after a growth) is dropped (u, v, b restart at zero, one warning),
as on a float16 overflow, so no NaN/Inf enters u or v. Without set_loss_scale, S = 1.

float16 wire values (``wire_values="float16"``) overflow as a dense float16 exchange does: the
selected values are cast to float16 as they are, so one beyond float16's range (|v| >= 65520)
is sent as ±inf (not clamped: a loss scaler must see it). Every rank then decodes a non-finite
value, so the step is non-finite on every rank alike, as for a NaN gradient
(:mod:`~dgc_horovod.core.compressor`): each rank gets NaN for that tensor, and the ranks that
did not overflow put back the entries they sent. The rank that overflowed drops the tensor's
state instead: its u and v restart at zero, as after an elastic reset (a one-off loss of that
tensor's unsent gradient on that rank). A loss scaler (torch.amp
GradScaler, Keras LossScaleOptimizer) therefore skips the step and backs off, and no NaN/Inf
enters u or v. Why drop: backing off shrinks the next gradients, but (without
:meth:`DGCCore.set_loss_scale`) u and v hold what was accumulated at the old scale; kept (even
with only the overflowed entries removed), they overflow again at the next steps whatever the
new scale (momentum decays by m per step only), and the scaler backs off step after step while
training stands still. (With set_loss_scale the other tensors' states follow the scale down;
the overflowed tensor's state is still dropped on the rank that overflowed.) Values
that float16 rounds to 0 (|v| <= 2**-25) are sent as 0 and stay in the residual. Both are
counted in the statistics (``overflowed_entries``, ``flushed_entries``), each with a one-time
warning naming the tensor. On the other ranks a skipped step's accumulation is kept (u and v
hold this step's gradient; only the sent entries are put back): their state is not rolled back
to before the step.
"""

__all__ = ["FP16_OVERFLOW", "rescale", "round_to_fp16", "warning"]

#: The smallest magnitude a float16 cast rounds to ±inf (float16's largest value is 65504).
FP16_OVERFLOW = 65520.0


def rescale(B, states, ratio):
    """Bring every tensor's state (u, v and wd of each TensorState in ``states``) from loss scale
    S to S_t: multiply it by ``ratio`` = S_t/S. A tensor whose state becomes non-finite (float32
    overflow) is dropped (zeroed) and yielded, as it goes: its owner warns then."""
    for st in states:
        kept = [t for t in (st.u, st.v, st.wd) if t is not None]
        for t in kept:
            B.mul_(t, ratio)
        if not all(B.all_finite(t) for t in kept):
            for t in kept:
                B.zero_(t)
            yield st


def round_to_fp16(B, u, v, idx, vals):
    """``wire_values="float16"``, after clear_sent (step 5 of :mod:`~dgc_horovod.core.engine`):
    the values sent are ``vals`` rounded through float16 as a plain cast rounds them (±inf beyond
    its range). The rounding error stays in the residual: v[idx] ← vals − sent (float32). If a
    value overflowed, the tensor's u and v are zeroed instead (see the module docstring).

    Returns (sent, (overflowed, flushed), dropped): the float32 values of the float16 payload;
    how many overflowed and how many non-zero values became 0; whether u and v were zeroed.
    The caller warns (:func:`warning`)."""
    sent = B.to_fp16_and_back(vals)
    overflowed = B.numel(vals) - B.count_true(B.abs(sent) != float("inf"))
    flushed = B.count_true((sent == 0.0) & (vals != 0.0))
    if overflowed:
        for t in (u, v):
            if t is not None:
                B.zero_(t)
        return sent, (overflowed, flushed), True
    B.scatter_(v, idx, vals - sent)
    return sent, (overflowed, flushed), False


def warning(name, overflowed, flushed):
    """[(key, message)] of the one-time warnings for a tensor's float16 counts."""
    out = []
    if flushed:
        out.append(("fp16_flush", (
            f"DGC: wire_values='float16': {flushed} selected non-zero value(s) of "
            f"{name!r} are below float16's range (|v| <= 2**-25) and are sent as 0 (they "
            "stay in the residual). Further ones are counted in stats.flushed_entries. A "
            "larger loss scale, or wire_values='float32', sends them")))
    if overflowed:
        out.append(("fp16_overflow", (
            f"DGC: wire_values='float16': {overflowed} selected value(s) of {name!r} "
            f"exceed float16's range (|v| >= {FP16_OVERFLOW:g}; its largest value is 65504) "
            "and are sent as ±inf, as a float16 cast does: every rank gets a non-finite "
            "update for this step, which a loss scaler skips (then backing off its scale), "
            "and this rank drops the tensor's DGC state (u and v restart at zero). Further "
            "overflows are counted in stats.overflowed_entries. Use a smaller loss scale, "
            "or wire_values='float32'")))
    return out
