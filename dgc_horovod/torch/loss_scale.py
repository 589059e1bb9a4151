"""Mixed precision for :class:`dgc_horovod.torch.DGC`: the loss scaler it follows, in the order a
step meets it: :func:`check_loss_scaler` when the DGC is made (``DGC(loss_scaler=scaler)``),
:func:`read_loss_scale` at each step's first gradient and :func:`check_not_unscaled` when the
reduced gradients are handed back.

Pass the loss scaler, ``DGC(..., loss_scaler=scaler)`` with ``scaler = torch.amp.GradScaler()``
(or any object whose ``get_scale()`` returns the current loss scale as a number), and use the
GradScaler pattern of docs/usage.md. DGC then reads the scale once per step, at the step's first
gradient, and keeps its velocities and residuals in the units of that scale: when the scaler
backs off or grows, they are rescaled by new / old, clipping compares the unscaled norm with
``clip_norm`` and weight decay adds λ·scale·w, so that after ``scaler.unscale_(opt)`` the update
is the one DGC gives without a loss scaler (bit-identical with GradScaler's power-of-two scales;
the equations: :mod:`dgc_horovod.core.precision`). A step the scaler skips (a non-finite
gradient on some rank, in some tensor) leaves the residuals holding that step's gradient on
every rank, the tensors whose exchange was finite included (:func:`skips_nonfinite_steps`).
Without ``loss_scaler`` DGC works on the scaled gradients as they come: its state is then wrong
by old / new after every change of scale.
"""

__all__ = ["check_loss_scaler", "skips_nonfinite_steps", "read_loss_scale", "check_not_unscaled"]


def check_loss_scaler(loss_scaler):
    """TypeError unless ``loss_scaler`` is None or has a ``get_scale()`` method."""
    if loss_scaler is not None and not callable(getattr(loss_scaler, "get_scale", None)):
        raise TypeError(f"loss_scaler must be a loss scaler with a get_scale() method (e.g. "
                        f"torch.amp.GradScaler()) or None, got {type(loss_scaler).__name__}")


def skips_nonfinite_steps(loss_scaler):
    """Whether the scaler skips every step that has a non-finite gradient, as an enabled
    ``torch.amp.GradScaler`` does (``scaler.step`` then calls no ``optimizer.step``), the
    finite tensors' updates included: DGC then puts back what their exchanges took out of its
    state (``DGCCore.skip_nonfinite_steps``). True for any scaler but a disabled one
    (``is_enabled()`` False)."""
    return loss_scaler is not None and bool(getattr(loss_scaler, "is_enabled", lambda: True)())


def read_loss_scale(core, loss_scaler):
    """Hand the loss scaler's current scale to the core (which rescales the state when it
    changed): once per step, before the step's first gradient is accumulated."""
    scale = loss_scaler.get_scale()
    try:
        core.set_loss_scale(scale)
    except ValueError:
        raise ValueError(f"DGC: loss_scaler.get_scale() must return a finite number > 0, "
                         f"got {scale!r}") from None


def check_not_unscaled(loss_scaler, opt):
    """RuntimeError when ``loss_scaler`` (a ``torch.amp.GradScaler``) has already unscaled the
    gradients of ``opt`` while Horovod is still reducing them: the plain PyTorch loop,
    ``scaler.step(opt)`` without ``opt.synchronize()`` first, unscales the local gradients and
    then lets ``opt.step()`` reduce, so the update would use gradients still multiplied by the
    loss scale (with dense Horovod the same loop races: benchmarks/amp_plain_loop.py). Other
    scalers (no GradScaler state) are not checked."""
    states = getattr(loss_scaler, "_per_optimizer_states", None)
    state = states.get(id(opt)) if isinstance(states, dict) and opt is not None else None
    if state is not None and getattr(state.get("stage"), "name", None) == "UNSCALED":
        raise RuntimeError(
            "DGC: the loss scaler unscaled the gradients before Horovod reduced them (the plain "
            "`scaler.step(optimizer)` loop): the update would use gradients still multiplied by "
            f"the loss scale ({loss_scaler.get_scale()}). With Horovod reduce first: "
            "optimizer.synchronize(); scaler.unscale_(optimizer); `with "
            "optimizer.skip_synchronize(): scaler.step(optimizer)`; scaler.update() "
            "(docs/usage.md, \"Mixed precision\").")
