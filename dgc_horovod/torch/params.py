"""Which parameter is this? How :class:`dgc_horovod.torch.DGC` finds the parameter a gradient
belongs to, and the optimizer settings that apply to it.

Horovod's ``compress`` receives only the gradient. Horovod calls it from
``DistributedOptimizer._allreduce_grad_async(p)`` (or ``_grouped_allreduce_grad_async(ps)``)
when a gradient is ready, so :func:`find_parameter` looks one to three frames up the call stack
for the calling Horovod optimizer (``self``) and the parameter being reduced (its local ``p``),
and verifies ``p.grad is tensor`` before using it; if the parameter in that frame does not own
the tensor, it searches the optimizer's parameters for the one whose ``.grad`` is the tensor.
State (velocity u, residual v) is keyed by the parameter's name from ``named_parameters``: the
same name Horovod uses for its collectives, so it is identical on every rank. This does not
depend on the gradient object: it works with ``zero_grad(set_to_none=True)`` (a new ``.grad``
every step) and ``False``, with ``backward_passes_per_step > 1`` (compress runs once, on the
accumulated gradient), and for parameters without a gradient in a step (Horovod hands DGC zeros;
DGC then only decays the velocity). Called from anywhere else, DGC raises a RuntimeError saying
how to use it.

At the first gradient :class:`OptimizerChecks` then checks the optimizer it was found in: one
optimizer per DGC, and momentum not applied twice to any parameter it reduces. When DGC refuses a
step's first gradient, :func:`undo_refused_step` leaves Horovod's optimizer usable.
"""
import sys
import weakref

import horovod.torch as hvd
import torch

__all__ = ["find_parameter", "check_one_synchronize", "reduced_parameters", "param_group",
           "OptimizerChecks", "undo_refused_step"]

_HINT = ("pass it to horovod.torch.DistributedOptimizer(..., compression=DGC(...)); "
         "DGC keeps per-parameter state and must know which parameter a gradient belongs to")


def find_parameter(tensor, compressor):
    """(optimizer, parameter, name) of the Horovod call that is compressing ``tensor``; call it
    from ``compressor.compress`` itself (it reads the caller's caller's frames)."""
    frame = sys._getframe(2)
    candidates = []
    for _ in range(4):
        if frame is None:
            break
        local = frame.f_locals
        if isinstance(local.get("p"), torch.Tensor):
            candidates.append(local["p"])
        opt = local.get("self")
        if isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_parameter_names"):
            if getattr(opt, "_compression", None) is not compressor:
                raise RuntimeError("this DGC object is not the compression of the Horovod "
                                   "optimizer calling it; " + _HINT)
            if getattr(opt, "op", None) not in (hvd.Average, hvd.Sum):
                # (Horovod's Adasum optimizer has no op attribute and compresses parameters)
                raise RuntimeError("DGC supports hvd.DistributedOptimizer with op=hvd.Average or "
                                   "op=hvd.Sum, not op=hvd.Adasum")
            for p in candidates:
                if _owns(p, tensor):
                    return opt, p, opt._parameter_names[p]
            for p in opt._parameter_names:      # fallback: search (e.g. a changed call site)
                if _owns(p, tensor):
                    return opt, p, opt._parameter_names[p]
            raise RuntimeError("DGC could not find the parameter whose gradient it was given "
                               f"(shape {tuple(tensor.shape)}) among the optimizer's parameters")
        frame = frame.f_back
    raise RuntimeError("dgc_horovod.torch.DGC was called outside horovod.torch."
                       "DistributedOptimizer; " + _HINT)


def check_one_synchronize(opt):
    """RuntimeError when Horovod's ``synchronize()`` hands DGC the gradients a second time in a
    step: ``optimizer.step()`` after ``optimizer.synchronize()`` without ``with
    optimizer.skip_synchronize():`` (Horovod only warns), or ``synchronize()`` twice. The
    gradients are then already averaged, and DGC would take them as the next step's: momentum
    correction applied twice, the warm-up counting two steps (dense Horovod only repeats an
    allreduce of equal tensors). Recognised as a call from ``synchronize()`` (not from a gradient
    hook) after a finished ``synchronize()`` with no gradient hook since (``opt._synchronized``
    and no handle); a step that ``GradScaler`` skipped, followed by a backward, is not one.
    Call it from ``compress`` itself (it reads the caller's caller's frames), before any state
    changes."""
    if not opt._synchronized or opt._handles:
        return
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return
        if frame.f_code.co_name == "hook":
            return
        if frame.f_code.co_name == "synchronize" and frame.f_locals.get("self") is opt:
            raise RuntimeError(
                "DGC: optimizer.synchronize() ran a second time in this step (optimizer.step() "
                "after optimizer.synchronize() without `with optimizer.skip_synchronize():`, or "
                "synchronize() called twice). The gradients are already averaged; DGC would "
                "accumulate them again as a new step's gradient (momentum correction twice, the "
                "warm-up counting two steps). After synchronize(), call step() inside `with "
                "optimizer.skip_synchronize():`.")
        frame = frame.f_back


def reduced_parameters(opt):
    """The parameters Horovod's optimizer ``opt`` reduces, in ``param_groups`` order: those that
    required a gradient when it was built (its ``_requires_update``: Horovod hooked them then
    and hands zeros at ``synchronize()`` for any without a gradient), whatever their
    ``requires_grad`` is now (a layer frozen after the optimizer was wrapped is still reduced;
    one unfrozen later never is)."""
    hooked = {id(p) for p in opt._requires_update}
    return [p for group in opt.param_groups for p in group["params"] if id(p) in hooked]


def _owns(p, tensor):
    g = p.grad
    return g is tensor or (g is not None and g.is_sparse and g.shape == tensor.shape)


def param_group(opt, p):
    """The parameter group of ``opt`` that holds ``p`` (its momentum, betas, ...), or None."""
    for group in opt.param_groups:
        if any(q is p for q in group["params"]):
            return group
    return None


class OptimizerChecks:
    """The checks of a step's first gradient with one DGC (call it with (optimizer, parameter,
    name) at every compress; once passed, a call costs a set lookup): one optimizer per DGC (a
    second one is refused, its per-parameter residuals would mix the two models' gradients),
    momentum not applied twice to any parameter the optimizer reduces, and warnings for weight
    decay applied twice and for Adam-like optimizers (a parameter group with ``betas``) under
    DGC's momentum (``check_optimizer(name, optimizer, momentum, weight_decay, moments)``, the
    adapter's). Every reduced parameter is checked at the first
    gradient, so a refusal comes before anything of the step is sent (:func:`undo_refused_step`
    then leaves Horovod's optimizer usable)."""

    def __init__(self, check_optimizer):
        self._check_optimizer = check_optimizer
        self._checked = set()       # the parameters checked
        self._optimizer = None      # weak reference to the one optimizer this DGC serves

    def __call__(self, opt, p, name):
        if name in self._checked:
            return
        owner = self._optimizer() if self._optimizer is not None else None
        if owner is None:
            self._optimizer = weakref.ref(opt)
        elif owner is not opt:
            raise ValueError("one DGC object is the compression of two DistributedOptimizers; "
                             "its per-parameter residuals would mix the two models' gradients. "
                             "Create one DGC(...) per optimizer.")
        named = [(q, opt._parameter_names.get(q)) for q in reduced_parameters(opt)]
        todo = [(q, q_name) for q, q_name in named
                if q_name is not None and q_name not in self._checked]
        if not any(q is p for q, _ in todo):
            todo.append((p, name))
        groups = [(q_name, param_group(opt, q)) for q, q_name in todo]
        groups = [(q_name, group) for q_name, group in groups if group is not None]
        for q_name, group in groups:
            self._check_optimizer(q_name, opt, group.get("momentum", 0.0) or 0.0,
                                  group.get("weight_decay", 0.0) or 0.0, "betas" in group)
        self._checked.update(q_name for _, q_name in todo)

    def optimizer(self):
        """The optimizer this DGC serves (None before its first gradient)."""
        return self._optimizer() if self._optimizer is not None else None

    def forget_parameters(self):
        """Check every parameter again at its next step (the elastic reset rule); the optimizer
        this DGC serves stays."""
        self._checked = set()


def undo_refused_step(opt):
    """After DGC refused a step's first gradient (raising from ``compress``, before anything
    was sent): put Horovod's optimizer ``opt`` back as it was before the step's first backward,
    so that the same optimizer can go on once the cause is fixed (e.g.
    ``dgc.load_state_dict(sd, reset_residuals=True)``, then ``opt.zero_grad()`` and a new
    backward). Horovod's hook counts a backward pass down (``_allreduce_delay``) before it calls
    ``compress`` and records the parameter's handle after it; with ``groups=`` it also counts a
    group's ready members (``_group_counts``). Left so, its next backward fails an assertion or
    reduces a group before all its gradients exist, and ``zero_grad()`` refuses. Returns False,
    changing nothing, when a collective of the step is already in flight (a handle that is not
    None): that step cannot be taken back. Call it only when DGC took nothing of the step
    either (its exchange idle)."""
    if any(handle is not None for handle, _ in opt._handles.values()):
        return False
    opt._handles.clear()
    for q in opt._allreduce_delay:
        opt._allreduce_delay[q] = opt.backward_passes_per_step
    counts = getattr(opt, "_group_counts", None) or {}
    for group in counts:
        counts[group] = 0
    return True
