"""Local accumulation with momentum correction, clipping and momentum factor masking.

Each function is one technique of Lin et al. 2018 and works on flat float32 tensors of any
backend (see :mod:`dgc_horovod.core.backend`), updating state in place. Notation of the paper:
g gradient, u velocity (momentum buffer), v accumulated velocity (the residual, error feedback).
"""
import math

__all__ = ["CLIP_EPS", "clip_threshold", "clip_factor", "clip_by_local_norm", "squared_norm",
           "global_norm", "add_weight_decay", "weight_decay_momentum", "momentum_correction",
           "clear_sent", "restore_sent"]

#: What clip_factor adds to the norm (as torch.nn.utils.clip_grad_norm_ does).
CLIP_EPS = 1e-6


def clip_threshold(clip_norm, world_size, average=True, sqrt=math.sqrt):
    """The local clipping threshold of §3.2 for the gradient Horovod hands one rank.

    Algorithm 1 clips the local contribution that nodes *sum*, ∇k = (1/(N·b))·Σ∇f, to
    ‖∇k‖ ≤ C·N^(-1/2) (the sum of N independent contributions has about √N times their norm, so
    this matches a dense clip of the sum at C). Horovod hands DGC the rank's mean gradient:

    * ``op=hvd.Average``: g_k = N·∇k and the update is (1/N)·Σ g_k, so the rule is
      ‖g_k‖ ≤ C·N^(-1/2)·N = C·√N;
    * ``op=hvd.Sum``: g_k is itself the summed contribution, so ‖g_k‖ ≤ C·N^(-1/2).

    Args: clip_norm (float): C, the threshold of a dense clip of the reduced gradient.
        world_size (int, or a float64 scalar tensor with ``sqrt`` its square root op): N >= 1.
        average (bool): op=Average (True) or op=Sum (False).
    Returns: float (a tensor of ``sqrt``'s), the threshold on ‖g_k‖.
    """
    root = sqrt(world_size)           # correctly rounded: math.sqrt and tf.sqrt alike
    return clip_norm * root if average else clip_norm * (1.0 / root)


def clip_factor(norm, threshold, minimum=min):
    """s = min(1, threshold / (norm + CLIP_EPS)), the factor of
    ``torch.nn.utils.clip_grad_norm_``, for a float norm (or, with ``minimum`` the framework's,
    a float64 scalar tensor: the TensorFlow graph's)."""
    return minimum(1.0, threshold / (norm + CLIP_EPS))


def squared_norm(B, grads):
    """Σ ‖g‖² over the finite tensors of ``grads``, each ‖g‖ the float32 norm, squared and
    summed in float64 (a Python float) in the order given; inf when a finite tensor's float32
    norm overflows. A tensor with NaN/Inf is left out: it is not accumulated at all (see
    compressor), so it must not turn every other tensor's factor into NaN."""
    total = 0.0
    for g in grads:
        g = B.float32_view(g)
        n = float(B.norm(g))
        if n == float("inf") and B.all_finite(g):
            return n                        # finite but its float32 norm overflows
        if n == n and n != float("inf"):
            total += n * n
    return total


def global_norm(B, grads):
    """sqrt(Σ ‖g‖²) over the finite tensors of ``grads`` (Pascanu et al.'s global norm, as the
    paper clips: "the sum of their L2-norms" over all parameters): the square root of
    :func:`squared_norm`, whose rules it follows."""
    return math.sqrt(squared_norm(B, grads))


def clip_by_local_norm(B, g, clip_norm, world_size, average=True, loss_scale=1.0):
    """Per-tensor local clipping (``clip_scope="tensor"``): the factor that brings g to
    ‖g‖/S ≤ :func:`clip_threshold` (S: the loss scale g carries, 1.0 without a loss scaler;
    see :meth:`~dgc_horovod.core.compressor.DGCCore.set_loss_scale`). 1.0 when clip_norm is
    None. g is not modified."""
    if clip_norm is None:
        return 1.0
    return clip_factor(float(B.norm(g)) / loss_scale,
                       clip_threshold(clip_norm, world_size, average))


def add_weight_decay(B, g, w, weight_decay, scale=1.0):
    """``weight_decay_mode="accumulated"``: a new tensor s·g + λ·w (weight decay joins the
    clipped gradient before momentum correction and is accumulated and sparsified with it)."""
    out = B.float32_flat(g)
    if scale != 1.0:
        B.mul_(out, scale)
    B.add_(out, w, alpha=weight_decay)
    return out


def weight_decay_momentum(B, update, buf, w, weight_decay, momentum, nesterov=False):
    """``weight_decay_mode="separate"`` (the authors' DGCSGD): weight decay with its own momentum,
    added densely to the exchanged update, in place:

        b ← m·b + λ·w ;  update ← update + b          (Nesterov: update + λ·w + m·b)

    With b starting at 0 this is torch.optim.SGD's treatment of the λ·w part of the gradient, so
    DGC at density 1 with it equals dense momentum SGD with weight decay. buf is None when m = 0
    (then update ← update + λ·w). Returns update.

    This is :func:`momentum_correction` with u = b, v = update, g = w and s = λ.
    """
    momentum_correction(B, buf, update, w, momentum if buf is not None else 0.0, nesterov,
                        weight_decay)
    return update


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
