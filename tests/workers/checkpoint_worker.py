"""Runs under `horovodrun -np 2`: checkpoint DGC + model + optimizer per rank, exit, resume.

tests/test_checkpoint.py launches it twice per controller, plus once as a single process:

  --mode first   trains one model 12 steps without interruption (the reference) and saves its
                 final parameters and DGC state per rank; then trains a second, identical model
                 6 steps and saves model + optimizer + DGC state per rank to ckpt.rank{r}.pt.
                 The processes exit.
  --mode resume  a fresh job: every rank loads its own ckpt.rank{r}.pt, trains the 6 remaining
                 steps and compares its parameters and DGC state with the reference bit for bit
                 (torch.equal); it also records the errors of a wrong config, a wrong world size
                 and a wrong rank, and of a checkpoint that does not fit the model (loaded into
                 a model whose parameters Horovod names 'module.*', as a wrapped module's are;
                 with one tensor's state missing; and into a model whose hidden layer is
                 narrower, where the step's first gradient, fc2.bias, still fits). Rank 0 writes everything as JSON to --out.
  --mode single  one process (world size 1) loads ckpt.rank0.pt of the 2-rank job: refused, then
                 accepted with reset_residuals=True.

--bucket-numel selects the exchange: one allgather per bucket (default) or per tensor (0).
Both runs see the same data per step per rank; the warm-up epoch is set at epoch boundaries
only (every STEPS_PER_EPOCH steps), so the resumed run's first steps rely on the restored epoch.
"""
import argparse
import json
import os
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from dgc_horovod.torch import DGC

LR = 0.05
N_FIRST, N_TOTAL = 6, 12
STEPS_PER_EPOCH = 4
DGC_KW = dict(compress_ratio=0.01, momentum=0.9, warmup_epochs=2, warmup_initial_density=0.25,
              min_sparse_numel=1, min_sparse_ndim=1)


class Net(torch.nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)     # 8192 weights: sampled threshold selection
        self.fc2 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(N_TOTAL)]


def make(prefix="", hidden=128, **dgc_kw):
    torch.manual_seed(1234)
    model = Net(hidden)
    dgc = DGC(**dict(DGC_KW, **dgc_kw))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0)
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=[(prefix + n, p) for n, p in model.named_parameters()],
        compression=dgc)
    return model, opt, dgc


def train(model, opt, dgc, first, last):
    data = batches(hvd.rank())
    for step in range(first, last):
        if step % STEPS_PER_EPOCH == 0:
            dgc.set_epoch(step // STEPS_PER_EPOCH)
        x, y = data[step]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def ckpt_path(d, rank):
    return os.path.join(d, f"ckpt.rank{rank}.pt")


def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def mode_first(d):
    r = hvd.rank()
    model, opt, dgc = make()
    train(model, opt, dgc, 0, N_TOTAL)
    torch.save({"params": model.state_dict(), "dgc": dgc.state_dict()},
               os.path.join(d, f"reference.rank{r}.pt"))
    model, opt, dgc = make()
    train(model, opt, dgc, 0, N_FIRST)
    torch.save({"step": N_FIRST, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "dgc": dgc.state_dict()}, ckpt_path(d, r))
    return None


def compare_state(a, b):
    """True when two DGC state dicts hold bit-identical tensors and warm-up positions."""
    if set(a["tensors"]) != set(b["tensors"]):
        return False
    for name, ta in a["tensors"].items():
        tb = b["tensors"][name]
        for key in ("u", "v"):
            if (ta[key] is None) != (tb[key] is None):
                return False
            if ta[key] is not None and not torch.equal(ta[key], tb[key]):
                return False
    return a["steps"] == b["steps"]


def mode_resume(d):
    r = hvd.rank()
    ref = torch.load(os.path.join(d, f"reference.rank{r}.pt"), weights_only=True)
    ckpt = torch.load(ckpt_path(d, r), weights_only=True)
    sd = ckpt["dgc"]
    out = {"saved_world_size": sd["world_size"], "saved_rank": sd["rank"],
           "saved_epoch": sd["epoch"], "saved_steps": sd["total_stats"]["steps"],
           "saved_tensors": sorted(sd["tensors"]),
           "saved_sparse": sorted(n for n, t in sd["tensors"].items() if t["sparse"])}

    # the documented errors, each on a fresh DGC (nothing is trained with these)
    out["config_error"] = error_of(
        lambda: DGC(**dict(DGC_KW, compress_ratio=0.02, seed=5)).load_state_dict(sd))
    out["world_size_error"] = error_of(
        lambda: DGC(**DGC_KW).load_state_dict(dict(sd, world_size=4)))
    other = torch.load(ckpt_path(d, 1 - r), weights_only=True)["dgc"]
    out["rank_error"] = error_of(lambda: DGC(**DGC_KW).load_state_dict(other))

    model, opt, dgc = make()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    dgc.load_state_dict(sd)
    out["loaded_epoch"] = dgc._core.epoch
    out["loaded_density"] = dgc.density
    train(model, opt, dgc, ckpt["step"], N_TOTAL)
    ref_params = ref["params"]
    out["params_equal"] = {n: torch.equal(p, ref_params[n]) for n, p in model.state_dict().items()}
    out["dgc_state_equal"] = compare_state(dgc.state_dict(), ref["dgc"])
    out["steps_counted"] = dgc.total_stats.steps
    out["selected_equal"] = dgc.total_stats.selected == ref["dgc"]["total_stats"]["selected"]

    # negative control: the same resume without the residuals does not reproduce the reference
    model2, opt2, dgc2 = make()
    model2.load_state_dict(ckpt["model"])
    dgc2.load_state_dict(sd, reset_residuals=True)
    out["reset_states_after_load"] = len(dgc2.states)
    out["reset_epoch"] = dgc2._core.epoch
    train(model2, opt2, dgc2, ckpt["step"], N_TOTAL)
    out["reset_params_equal"] = all(torch.equal(p, ref_params[n])
                                    for n, p in model2.state_dict().items())
    out.update(misfit(ckpt, sd))
    return hvd.allgather_object(out)


def misfit(ckpt, sd):
    """A checkpoint that does not fit the model: accepted by load_state_dict (it cannot know
    the model), refused at the first step, state untouched; reset_residuals=True is the way out
    and no stale state reaches a later checkpoint."""
    out = {}
    for key, prefix, hidden, state in (
            ("renamed", "module.", 128, sd),
            ("missing", "", 128, dict(sd, tensors={
                n: t for n, t in sd["tensors"].items() if n != "fc2.bias"})),
            ("resized", "", 96, sd)):
        model, opt, dgc = make(prefix, hidden)
        if hidden == 128:
            model.load_state_dict(ckpt["model"])
        dgc.load_state_dict(state)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            train(model, opt, dgc, ckpt["step"], ckpt["step"] + 1)
            out[key + "_error"] = None
        except ValueError as e:
            out[key + "_error"] = str(e)
        out[key + "_params_unchanged"] = all(torch.equal(p, before[n])
                                             for n, p in model.named_parameters())
        out[key + "_states_after_error"] = sorted(dgc.states)
        out[key + "_steps_after_error"] = dgc._core.steps
        # the way out, on the same optimizer (the refused step left Horovod's usable), trains
        # as a new model, optimizer and DGC do
        dgc.load_state_dict(state, reset_residuals=True)
        train(model, opt, dgc, ckpt["step"], ckpt["step"] + 2)
        out[key + "_reset_saved_tensors"] = sorted(dgc.state_dict()["tensors"])
        model2, opt2, dgc2 = make(prefix, hidden)
        if hidden == 128:
            model2.load_state_dict(ckpt["model"])
        dgc2.load_state_dict(state, reset_residuals=True)
        train(model2, opt2, dgc2, ckpt["step"], ckpt["step"] + 2)
        out[key + "_reset_as_new"] = all(torch.equal(p, q) for p, q in
                                         zip(model.parameters(), model2.parameters()))
    return out


def mode_single(d):
    sd = torch.load(ckpt_path(d, 0), weights_only=True)["dgc"]
    dgc = DGC(**DGC_KW)
    out = {"size": hvd.size(), "error": error_of(lambda: dgc.load_state_dict(sd))}
    out["states_after_refusal"] = len(dgc.states)
    out["epoch_after_refusal"] = dgc._core.epoch
    dgc.load_state_dict(sd, reset_residuals=True)
    out["states_after_reset"] = len(dgc.states)
    out["epoch_after_reset"] = dgc._core.epoch
    out["steps_after_reset"] = dgc.total_stats.steps
    return [out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["first", "resume", "single"], required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out")
    ap.add_argument("--bucket-numel", type=int, default=2 ** 22,
                    help="DGC bucket_numel (0: one allgather per tensor)")
    args = ap.parse_args()
    DGC_KW["bucket_numel"] = args.bucket_numel
    hvd.init()
    torch.set_num_threads(1)
    result = {"first": mode_first, "resume": mode_resume, "single": mode_single}[args.mode](
        args.dir)
    if hvd.rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"size": hvd.size(), "ranks": result}, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
