"""Warm-up training: the exponential sparsity schedule of DGC (Lin et al. 2018, §3.3)."""
import math

__all__ = ["density_at", "density_at_step", "STAGES"]

#: Stages of the step-counted warm-up: the paper's four (75%, 93.75%, 98.4375%, 99.6%).
STAGES = 4


def density_at(epoch, final_density, warmup_epochs=4.0, initial_density=0.25, per_step=False):
    """Density (fraction of elements sent) at a given epoch of the warm-up.

    The paper raises sparsity exponentially over the first epochs: 75%, 93.75%, 98.4375%, 99.6%,
    then 99.9% (§3.3). Here the density falls geometrically from ``initial_density`` at epoch 0 to
    ``final_density`` at ``warmup_epochs``::

        density(e) = initial · (final / initial) ** (e / warmup_epochs)   for e < warmup_epochs
        density(e) = final                                                 afterwards

    With the defaults and final 0.001 this gives 0.25, 0.0629, 0.0158, 0.00398, 0.001 for epochs
    0..4: the paper's densities within 1.2%, its sparsities within 0.1%.

    Args:
        epoch (float): epochs completed so far (>= 0); fractional with ``per_step``.
        final_density (float): density after warm-up, in (0, 1] (the compress ratio).
        warmup_epochs (float): length of the warm-up in epochs; 0 disables it.
        initial_density (float): density at epoch 0, in (0, 1]. If it is below ``final_density``
            the warm-up is skipped (the schedule never sends less than the final density... nor
            more than the initial one).
        per_step (bool): False: the epoch is floored (density changes once per epoch, as in the
            paper). True: the fractional epoch is used (smooth decay).

    Returns:
        float: the density in (0, 1].

    Raises:
        ValueError: a negative or non-finite epoch.
    """
    epoch = float(epoch)
    if not (epoch >= 0.0) or math.isinf(epoch):
        raise ValueError(f"epoch must be a finite number >= 0, got {epoch!r}")
    if warmup_epochs <= 0 or initial_density <= final_density:
        return final_density
    e = epoch if per_step else math.floor(epoch)
    if e >= warmup_epochs:
        return final_density
    return initial_density * (final_density / initial_density) ** (e / warmup_epochs)


def density_at_step(step, final_density, warmup_steps=1000, initial_density=0.25,
                    per_step=False):
    """Density at optimizer step ``step`` (0-based) of a warm-up of ``warmup_steps`` steps.

    The paper's schedule of §3.3 in :data:`STAGES` equal stages instead of epochs:
    ``density_at(STAGES * step / warmup_steps, final, STAGES, initial, per_step)``, i.e. the
    densities 0.25, 0.0629, 0.0158, 0.00398 for final 0.001, each for a quarter of the warm-up,
    then ``final_density`` from step ``warmup_steps`` on (``per_step``: a smooth fall).
    ``warmup_steps`` 0 disables the warm-up.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if warmup_steps <= 0:
        return final_density
    return density_at(STAGES * step / warmup_steps, final_density, float(STAGES),
                      initial_density, per_step)
