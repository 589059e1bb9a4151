"""Mixed precision for :class:`dgc_horovod.torch.DGC`: the loss scaler it follows, in the order a
step meets it: :func:`check_loss_scaler` when the DGC is made (``DGC(loss_scaler=scaler)``), and
:func:`read_loss_scale` at each step's first gradient.

Pass the loss scaler, ``DGC(..., loss_scaler=scaler)`` with ``scaler = torch.amp.GradScaler()``
(or any object whose ``get_scale()`` returns the current loss scale as a number), and use the
GradScaler pattern of docs/usage.md. DGC then reads the scale once per step, at the step's first
gradient, and keeps its velocities and residuals in the units of that scale: when the scaler
backs off or grows, they are rescaled by new / old, clipping compares the unscaled norm with
``clip_norm`` and weight decay adds λ·scale·w, so that after ``scaler.unscale_(opt)`` the update
is the one DGC gives without a loss scaler (bit-identical with GradScaler's power-of-two scales;
the equations: :mod:`dgc_horovod.core.precision`). Without ``loss_scaler`` DGC works on the
scaled gradients as they come: its state is then wrong by old / new after every change of scale.
"""

__all__ = ["check_loss_scaler", "read_loss_scale"]


def check_loss_scaler(loss_scaler):
    """TypeError unless ``loss_scaler`` is None or has a ``get_scale()`` method."""
    if loss_scaler is not None and not callable(getattr(loss_scaler, "get_scale", None)):
        raise TypeError(f"loss_scaler must be a loss scaler with a get_scale() method (e.g. "
                        f"torch.amp.GradScaler()) or None, got {type(loss_scaler).__name__}")


def read_loss_scale(core, loss_scaler):
    """Hand the loss scaler's current scale to the core (which rescales the state when it
    changed): once per step, before the step's first gradient is accumulated."""
    scale = loss_scaler.get_scale()
    try:
        core.set_loss_scale(scale)
    except ValueError:
        raise ValueError(f"DGC: loss_scaler.get_scale() must return a finite number > 0, "
                         f"got {scale!r}") from None
