"""Local accumulation with momentum correction, clipping and momentum factor masking.

Each function is one technique of Lin et al. 2018 and works on flat float32 tensors of any
backend (see :mod:`dgc_horovod.core.backend`), updating state in place. Notation of the paper:
g gradient, u velocity (momentum buffer), v accumulated velocity (the residual, error feedback).
"""

__all__ = ["clip_by_local_norm", "add_weight_decay", "momentum_correction", "clear_sent",
           "restore_sent"]

_EPS = 1e-6


def clip_by_local_norm(B, g, clip_norm, world_size):
    """Local gradient clipping (§3.2): the factor that brings g to L2 norm ≤ clip_norm · N^(-1/2).

    Clipping happens on each worker before its gradient is accumulated; the threshold is scaled by
    N^(-1/2) because the sum of N independent local gradients has about √N times their norm.

    Args:
        B: backend. g: flat float32 gradient (not modified).
        clip_norm (float or None): the global threshold; None means no clipping.
        world_size (int): N, number of workers (>= 1).
    Returns:
        float: the scale s in (0, 1] to apply to g (1.0 without clipping).
    """
    if clip_norm is None:
        return 1.0
    threshold = clip_norm * world_size ** -0.5
    return min(1.0, threshold / (float(B.norm(g)) + _EPS))


def add_weight_decay(B, g, w, weight_decay, scale=1.0):
    """A new tensor scale·g + λ·w (weight decay joins the clipped gradient before momentum
    correction, as in the paper's implementation)."""
    out = B.float32_flat(g)
    if scale != 1.0:
        B.mul_(out, scale)
    B.add_(out, w, alpha=weight_decay)
    return out


def momentum_correction(B, u, v, g, momentum, nesterov=False, scale=1.0):
    """Momentum correction (§3.1, eq. 5–6): accumulate velocity, not raw gradient.

    Classic:   u ← m·u + s·g ;  v ← v + u
    Nesterov:  u ← m·u + s·g ;  v ← v + s·g + m·u
    With m = 0 this is plain error feedback: v ← v + s·g. s is the clipping factor.

    Args:
        B: backend. u, v: flat float32 state (updated in place). g: flat float32 gradient
        (read only). momentum (float): m in [0, 1). nesterov (bool). scale (float): s.
    Returns: (u, v).
    """
    if momentum == 0.0:
        B.add_(v, g, alpha=scale)
        return u, v
    B.scale_add_(u, momentum, g, scale)
    if nesterov:
        B.add_(v, g, alpha=scale)
        B.add_(v, u, alpha=momentum)
    else:
        B.add_(v, u)
    return u, v


def clear_sent(B, u, v, indices, momentum_masking):
    """Reset the state at the positions that were sent.

    v ← v ⊙ ¬mask always (the sent part of the residual has left this worker); with momentum
    factor masking (§3.2) also u ← u ⊙ ¬mask, so the stale momentum of a just-sent coordinate does
    not keep pushing it.
    """
    B.fill_at_(v, indices, 0.0)
    if momentum_masking and u is not None:
        B.fill_at_(u, indices, 0.0)


def restore_sent(B, u, v, indices, v_sent, u_sent):
    """Undo :func:`clear_sent` (used when the step's exchange is discarded, e.g. non-finite)."""
    B.scatter_(v, indices, v_sent)
    if u_sent is not None and u is not None:
        B.scatter_(u, indices, u_sent)
