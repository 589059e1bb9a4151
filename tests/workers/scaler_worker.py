"""Runs under `horovodrun -np 2`: DGC(loss_scaler=...) under the documented GradScaler pattern.

* divergence: wire_values="float16" and init_scale=2**24 (the scale backs off many times while
  DGC's float16 values overflow): the loss of DGC with ``loss_scaler``, of DGC without it (the
  pattern as documented before loss_scaler existed: recorded, not asserted on) and of Horovod's
  own float16 compression with momentum SGD (the dense reference).
* equal: for several settings (plain, clip_norm global and per tensor, weight decay separate and
  accumulated), DGC with a GradScaler (power-of-two scales: a back-off forced by an inf loss on
  rank 1 and growths every 3 steps) against DGC without loss scaling whose step at the same
  place is skipped the same way (a NaN loss on rank 1): the parameters must be bit-identical.
* partial: the GradScaler pattern with an inf in one tensor's gradient on rank 1 only (a
  sparsified weight, or a dense bias), every other gradient finite: the scaler skips the step,
  so no tensor's exchange of that step may take anything out of DGC's state; recorded: for every
  sparsified tensor finite on a rank, whether its v after the step is v before + its u after
  (v ← v + u, nothing sent), and whether the separate weight decay's buffers are unchanged.
* plain_loop: the plain PyTorch loop (``scaler.step(opt)`` without ``opt.synchronize()``) is
  refused on every rank with a RuntimeError, before the parameters move (it would step with
  gradients still multiplied by the loss scale).

Rank 0 writes what it recorded as JSON to --out; tests/test_loss_scaler.py asserts on it.
"""
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from edge_worker import scaler_step                   # noqa: E402  the documented pattern
from torch_worker import (batches, flat_params, identical_across_ranks, make,  # noqa: E402
                          run_scenarios)

EQUAL_STEPS, FORCED_STEP = 12, 4
EQUAL_SETTINGS = {
    "plain": {},
    "clip_global": {"clip_norm": 0.5},
    "clip_tensor": {"clip_norm": 0.5, "clip_scope": "tensor"},
    "weight_decay_separate": {"weight_decay": 0.05},
    "weight_decay_accumulated": {"weight_decay": 0.05, "weight_decay_mode": "accumulated"},
}


def dgc(**kwargs):
    from dgc_horovod.torch import DGC
    return DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024,
               **kwargs)


def mean_loss(loss, name):
    return float(hvd.allreduce(loss.detach().float().reshape(1), name=name))


def scenario_divergence(results, prefix, steps=60):
    out = {}
    for kind in ("with_loss_scaler", "without_loss_scaler", "horovod_fp16"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
        if kind == "horovod_fp16":
            model, opt = make(f"{prefix}_{kind}", hvd.Compression.fp16, momentum=0.9)
        else:
            extra = {"loss_scaler": scaler} if kind == "with_loss_scaler" else {}
            model, opt = make(f"{prefix}_{kind}", dgc(wire_values="float16", **extra))
        losses, scales, stepped = [], [], []
        for step, (x, y) in enumerate(batches(steps, 500 + hvd.rank())):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            losses.append(mean_loss(loss, f"{prefix}.{kind}.loss"))
            stepped.append(scaler_step(model, opt, scaler, loss))
            scales.append(float(scaler.get_scale()))
        out[kind] = {"losses": losses, "scales": scales, "stepped": stepped,
                     "identical": identical_across_ranks(model),
                     "finite": bool(torch.isfinite(flat_params(model)).all())}
    results["divergence"] = out


def train_unscaled(model, opt, data):
    """DGC without loss scaling; rank 1's loss is NaN at FORCED_STEP and the step is skipped
    where every gradient is non-finite, as GradScaler skips it."""
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if step == FORCED_STEP and hvd.rank() == 1:
            loss = loss * float("nan")
        loss.backward()
        opt.synchronize()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            with opt.skip_synchronize():
                opt.step()


def train_scaled(model, opt, scaler, data):
    """The GradScaler pattern; rank 1's loss is inf at FORCED_STEP: the scaler backs off."""
    scales, stepped = [], []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if step == FORCED_STEP and hvd.rank() == 1:
            loss = loss * float("inf")
        stepped.append(scaler_step(model, opt, scaler, loss))
        scales.append(float(scaler.get_scale()))
    return scales, stepped


def scenario_equal(results, prefix):
    out = {}
    plain = None
    for name, settings in EQUAL_SETTINGS.items():
        data = batches(EQUAL_STEPS, 700 + hvd.rank())
        # both runs name their parameters alike: the threshold's samples are a hash of the
        # tensor's name (dgc_horovod/core/sparsify.py), and the rare step where fewer than k
        # entries reach the sampled threshold sends what the samples found
        ref_model, ref_opt = make(f"{prefix}_{name}", dgc(**settings))
        train_unscaled(ref_model, ref_opt, data)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        d = dgc(loss_scaler=scaler, **settings)
        model, opt = make(f"{prefix}_{name}", d)
        scales, stepped = train_scaled(model, opt, scaler, data)
        ref, got = flat_params(ref_model), flat_params(model)
        if name == "plain":
            plain = ref
        out[name] = {"scales": scales, "stepped": stepped,
                     "equal": bool(torch.equal(ref, got)),
                     "max_abs_diff": float((ref - got).abs().max()),
                     "differs_from_plain": bool(not torch.equal(ref, plain)),
                     "identical": identical_across_ranks(model),
                     "loss_scale": d._core.loss_scale}
    results["equal"] = out


PARTIAL_CASES = {"sparse_bad": ("fc2.weight", {}), "dense_bad": ("fc1.bias", {}),
                 "weight_decay_separate": ("fc2.weight", {"weight_decay": 0.05})}


def scenario_partial(results, prefix):
    out = {}
    for case, (bad, settings) in PARTIAL_CASES.items():
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        d = dgc(loss_scaler=scaler, **settings)
        model, opt = make(f"{prefix}_{case}", d)
        now = {"step": None}

        def poison(g, now=now):
            if now["step"] == FORCED_STEP and hvd.rank() == 1:
                g = g.clone()
                g.view(-1)[0] = float("inf")
            return g
        dict(model.named_parameters())[bad].register_hook(poison)
        stepped, checks = [], {}
        for step, (x, y) in enumerate(batches(FORCED_STEP + 2, 300 + hvd.rank())):
            now["step"] = step
            opt.zero_grad()
            before = d.state_dict()["tensors"]
            stepped.append(scaler_step(model, opt, scaler, F.cross_entropy(model(x), y)))
            if step != FORCED_STEP:
                continue
            after = d.state_dict()["tensors"]
            for name, st in after.items():
                short = name.split(".", 1)[1]
                if st["sparse"] and not (short == bad and hvd.rank() == 1):
                    checks[f"{short} v = v0 + u"] = bool(torch.equal(
                        st["v"], before[name]["v"] + st["u"]))
                if st["wd"] is not None or before[name]["wd"] is not None:
                    checks[f"{short} wd unchanged"] = bool(
                        st["wd"] is not None and before[name]["wd"] is not None
                        and torch.equal(st["wd"], before[name]["wd"]))
        out[case] = {"stepped": stepped, "checks": hvd.allgather_object(checks),
                     "identical": identical_across_ranks(model)}
    results["partial"] = out


def scenario_plain_loop(results, prefix):
    """Last: the refused step leaves this optimizer mid-step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    model, opt = make(f"{prefix}_plain", dgc(loss_scaler=scaler))
    (x, y), = batches(1, 900 + hvd.rank())
    before = flat_params(model).clone()
    opt.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    try:
        scaler.step(opt)
        error = None
    except RuntimeError as e:
        error = str(e)
    results["plain_loop"] = {"errors": hvd.allgather_object(error),
                             "moved": bool((flat_params(model) != before).any())}


if __name__ == "__main__":
    run_scenarios([(scenario_equal, "eq"), (scenario_divergence, "dv"),
                   (scenario_partial, "pt"), (scenario_plain_loop, "pl")])
