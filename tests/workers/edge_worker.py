"""Runs under `horovodrun -np 2`: DGC with the stock horovod.torch.DistributedOptimizer on edge
shapes and dtypes, and with torch.amp.GradScaler.

Scenarios (each its own model and DGC, default DGC settings but warmup_epochs=0 and
compress_ratio=0.01; every parameter is sparsified, min_sparse_numel=1):

* edge: a scalar parameter (shape ()), a 1-element parameter, an embedding tied to the output
  projection (one Parameter used twice in forward), a layer used on even steps only.
* fp16 / bf16: the same model converted with .half() / .to(torch.bfloat16), plain SGD.
* sparse: nn.Embedding(sparse=True): Horovod's own sparse allreduce bypasses compress and calls
  decompress(output, None); sparse_as_dense: the same with sparse_as_dense=True (DGC compresses).
* amp: the documented GradScaler pattern; rank 1's loss overflows at step 3.

Rank 0 writes what it saw as JSON to --out; tests/test_edge_cases.py asserts on it.
"""
import argparse
import json
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from dgc_horovod.torch import DGC

STEPS = 10
VOCAB, DIM = 50, 16


class TiedNet(torch.nn.Module):
    def __init__(self, sparse=False):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.9))            # shape ()
        self.gain = torch.nn.Parameter(torch.ones(1))                 # 1 element
        self.emb = torch.nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.fc = torch.nn.Linear(DIM, DIM)
        self.rare = torch.nn.Linear(DIM, DIM)                         # even steps only
        self.out_bias = torch.nn.Parameter(torch.zeros(VOCAB))
        self.tied = not sparse     # a sparse embedding's weight cannot also get a dense gradient
        if sparse:
            self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, use_rare):
        h = self.emb(tokens).mean(1) * self.scale * self.gain
        h = torch.tanh(self.fc(h))
        if use_rare:
            h = h + self.rare(h)
        if self.tied:                                                 # the same Parameter again
            return F.linear(h, self.emb.weight, self.out_bias)
        return self.head(h) + self.out_bias


def batches(steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (8, 5), generator=g), torch.randint(0, VOCAB, (8,), generator=g))
            for _ in range(steps)]


def flat(model):
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def identical(model, name):
    mine = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
    gathered = hvd.allgather(mine.unsqueeze(0), name="check." + name)
    return bool((gathered == gathered[0]).all())


def states_finite(dgc):
    return all(bool(torch.isfinite(t).all()) for s in dgc.states.values()
               for t in (s.u, s.v) if t is not None)


def make(prefix, dtype=torch.float32, sparse=False, **opt_kw):
    torch.manual_seed(1234)
    model = TiedNet(sparse=sparse).to(dtype)
    dgc = DGC(compress_ratio=0.01, warmup_epochs=0)
    named = [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=named, compression=dgc, **opt_kw)
    return model, opt, dgc


def record(model, dgc, before, name, extra=None):
    per_param = {n: bool((p.detach().float() != b).any())
                 for (n, p), b in zip(model.named_parameters(), before)}
    out = {"identical": identical(model, name), "finite": bool(torch.isfinite(flat(model)).all()),
           "changed": per_param, "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
           "states": {n: s.numel for n, s in dgc.states.items()},
           "states_finite": all(hvd.allgather_object(states_finite(dgc))),   # every rank's
           "steps_counted": dgc.total_stats.steps,
           "nonfinite_tensors": sum(hvd.allgather_object(dgc.total_stats.nonfinite_tensors))}
    out.update(extra or {})
    return out


def scenario_train(name, dtype=torch.float32, sparse=False, **opt_kw):
    model, opt, dgc = make(name, dtype, sparse, **opt_kw)
    before = [p.detach().float().clone() for p in model.parameters()]
    grad_kinds = set()
    for step, (x, y) in enumerate(batches(STEPS, 100 + hvd.rank())):
        opt.zero_grad()
        loss = F.cross_entropy(model(x, use_rare=(step % 2 == 0)).float(), y)
        loss.backward()
        opt.synchronize()
        grad_kinds.update("sparse" if p.grad.is_sparse else "dense"
                          for p in model.parameters() if p.grad is not None)
        with opt.skip_synchronize():
            opt.step()
    return record(model, dgc, before, name, {"grad_kinds": sorted(grad_kinds)})


def scaler_step(model, opt, scaler, loss):
    """One step of the documented GradScaler pattern (README); True when the parameters moved."""
    scaler.scale(loss).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    before = flat(model).clone()
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    return bool((flat(model) != before).any())


def scenario_amp(name):
    """scaler.scale(loss).backward(); opt.synchronize(); scaler.unscale_(opt);
    with opt.skip_synchronize(): scaler.step(opt); scaler.update() -- rank 1 overflows at step 3."""
    model, opt, dgc = make(name)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales, stepped = [], []
    for step, (x, y) in enumerate(batches(STEPS, 200 + hvd.rank())):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x, use_rare=True)
        loss = F.cross_entropy(logits.float(), y)
        if step == 3 and hvd.rank() == 1:
            loss = loss * 1e38                   # scaled by 2**10: inf gradients on rank 1 only
        stepped.append(scaler_step(model, opt, scaler, loss))
        scales.append(float(scaler.get_scale()))
    every = hvd.allgather_object({"scales": scales, "stepped": stepped})
    before0 = [p.detach().float() for p in model.parameters()]     # only for the record's shape
    out = record(model, dgc, before0, name, {"scales": scales, "stepped": stepped,
                                             "same_on_every_rank": all(e == every[0] for e in every)})
    out.pop("changed")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    results = {"size": hvd.size()}
    for name, fn in [
        ("edge", lambda: scenario_train("edge")),
        ("fp16", lambda: scenario_train("fp16", torch.float16)),
        ("bf16", lambda: scenario_train("bf16", torch.bfloat16)),
        ("sparse", lambda: scenario_train("sparse", sparse=True)),
        ("sparse_as_dense", lambda: scenario_train("sad", sparse=True, sparse_as_dense=True)),
        ("amp", lambda: scenario_amp("amp")),
    ]:
        try:
            results[name] = fn()
        except Exception as e:          # record, so one failure does not hide the others
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"rank {hvd.rank()} {name}: {type(e).__name__}: {e}", file=sys.stderr)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
