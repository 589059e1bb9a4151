"""Runs under `horovodrun -np N` (N = 2, 3): DGC(exchange="regions") with the stock
horovod.torch.DistributedOptimizer.

Each scenario trains the small model of torch_worker.py with real Horovod collectives (alltoall
and allgather) and records facts that tests/test_torch_regions.py asserts on. Rank 0 writes them
as JSON to --out.
"""
import argparse
import json

import horovod.torch as hvd
import torch

from dgc_horovod.torch import DGC
from torch_worker import (LR, flat_params, identical_across_ranks, make, nonfinite_facts, train,
                          train_with_nan)

#: The exchange modes: DGC settings (bucketed with the default bucket, several small buckets,
#: one exchange per tensor, the gated exchange of global clipping) and train() arguments.
MODES = {
    "bucketed": (dict(), dict()),
    "small_buckets": (dict(bucket_numel=1500, min_sparse_numel=1), dict()),
    "per_tensor": (dict(bucket_numel=0), dict()),
    "gated": (dict(clip_norm=0.05), dict(bpps=2)),
    "float16": (dict(wire_values="float16"), dict()),
    "int32_index": (dict(wire_index="int32", bucket_numel=0), dict()),
}


def dgc_for(mode, **kw):
    settings = dict(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=1024,
                    min_sparse_ndim=1, exchange="regions")
    settings.update(MODES[mode][0])
    settings.update(kw)
    return DGC(**settings)


def opt_kwargs(mode):
    return dict(backward_passes_per_step=2) if MODES[mode][1].get("bpps") else {}


def scenario_identical(results):
    """Parameters bit-identical across ranks after 20 steps (aux has no gradient on odd steps:
    Horovod sends zeros for it at synchronize)."""
    out = {}
    for mode in MODES:
        dgc = dgc_for(mode)
        model, opt = make(f"id.{mode}", dgc, **opt_kwargs(mode))
        before = flat_params(model).clone()
        train(model, opt, **MODES[mode][1])
        st = dgc.total_stats
        out[mode] = {"identical": identical_across_ranks(model),
                     "changed": bool((flat_params(model) != before).any()),
                     "finite": bool(torch.isfinite(flat_params(model)).all()),
                     "steps_counted": st.steps,
                     "sparse": sorted(n for n, s in dgc.states.items() if s.sparse),
                     "selected": st.selected, "nonfinite_tensors": st.nonfinite_tensors}
    results["identical"] = out


def scenario_equivalence(results):
    """compress_ratio=1.0: every region's owner keeps every non-zero sum, so DGC (without
    momentum masking) with plain SGD equals momentum SGD with Horovod's dense allreduce."""
    out = {}
    for mode in ("bucketed", "per_tensor", "gated"):
        dgc = dgc_for(mode, compress_ratio=1.0, momentum_masking=False, min_sparse_numel=1,
                      **({"clip_norm": 1e6} if mode == "gated" else {}))
        m_dgc, o_dgc = make(f"eq.{mode}.dgc", dgc)
        m_ref, o_ref = make(f"eq.{mode}.ref", hvd.Compression.none, momentum=0.9)
        train(m_dgc, o_dgc, steps=8, aux_every=1)
        train(m_ref, o_ref, steps=8, aux_every=1)
        out[mode] = float((flat_params(m_dgc) - flat_params(m_ref)).abs().max())
    results["equivalence"] = out


def scenario_conservation(results):
    """Nothing is lost (momentum 0, plain SGD with lr LR, Average): for each sparsified tensor,
    Σ_r Σ_t g_r,t = Σ_r v_r + N·(w_0 − w_T)/LR, every step's gradient either applied or in some
    rank's residual (the region owners' dropped sums included). In the "_nan" variants rank 1's
    loss is NaN at step 3: every rank sees NaN, the step is skipped (as GradScaler does) and
    nothing of that step may be applied; rank 1's NaN gradient is not accumulated."""
    out = {}
    for mode in ("bucketed", "per_tensor", "small_buckets", "gated"):
        for nan in (False, True):
            name = mode + ("_nan" if nan else "")
            dgc = dgc_for(mode, momentum=0.0, **({"clip_norm": 1e6} if mode == "gated" else {}))
            count_dropped(dgc)
            model, opt = make(f"cons.{name}", dgc)
            named = {f"cons.{name}.{n}": p for n, p in model.named_parameters()}
            w0 = {n: p.detach().clone().double() for n, p in named.items()}
            total = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in named.items()}

            def accumulate(step):               # this rank's gradients, where finite
                for n, p in named.items():
                    g = p.grad.detach().reshape(-1).double()
                    if torch.isfinite(g).all():
                        total[n] += g

            skipped = train_with_nan(model, opt, steps=10, seed=500,
                                     nan_step=3 if nan else None, after_backward=accumulate)
            world = hvd.size()
            worst, scale = 0.0, 0.0
            for n, p in named.items():
                st = dgc.states[n]
                if not st.sparse:
                    continue
                sent = hvd.allreduce(total[n], op=hvd.Sum, name=f"cons.check.g.{n}")
                kept = hvd.allreduce(st.v.double(), op=hvd.Sum, name=f"cons.check.v.{n}")
                applied = world * (w0[n] - p.detach().double()).reshape(-1) / LR
                worst = max(worst, float((sent - kept - applied).abs().max()))
                scale = max(scale, float(sent.abs().max()))
            out[name] = {"worst": worst, "scale": scale, "skipped": skipped,
                         "identical": identical_across_ranks(model),
                         "states_finite": all(bool(torch.isfinite(s.v).all())
                                              for s in dgc.states.values() if s.v is not None),
                         "dropped": dgc.dropped_entries}
    results["conservation"] = out


def count_dropped(dgc):
    """Count, in ``dgc.dropped_entries``, the entries this rank's region reduces dropped (the
    sums D_j that must come back into its residual)."""
    core, reduce_region = dgc._core, dgc._core.reduce_region
    dgc.dropped_entries = 0

    def counted(*args, **kwargs):
        payload, dropped = reduce_region(*args, **kwargs)
        if dropped is not None:
            dgc.dropped_entries += int(dropped[0].numel())
        return payload, dropped

    core.reduce_region = counted


def scenario_nonfinite(results):
    """Rank 1's loss is NaN at step 3 (momentum 0.9): every rank gets NaN for every gradient,
    sparsified ones included, and skips that step alike; states stay finite, the replicas
    bit-identical."""
    out = {}
    for mode in ("bucketed", "per_tensor", "gated"):
        dgc = dgc_for(mode)
        model, opt = make(f"nf.{mode}", dgc)
        all_nan = []
        out[mode] = nonfinite_facts(dgc, model, train_with_nan(model, opt, all_nan=all_nan))
        out[mode]["all_nan"] = hvd.allgather_object(all_nan)
    results["nonfinite"] = out


class Recorder:
    """Wraps horovod.torch's alltoall_async, allgather_async and synchronize (what
    dgc_horovod.torch.exchange calls) to count the int32 words DGC's collectives really moved
    on this rank: sent to other ranks and received from them."""

    def __init__(self):
        self.handles, self.calls = {}, {"alltoall": 0, "allgather": 0}
        self.sent, self.received = dict(self.calls), dict(self.calls)
        self._a2a, self._ag, self._sync = hvd.alltoall_async, hvd.allgather_async, hvd.synchronize

    def __enter__(self):
        def alltoall_async(tensor, splits=None, name=None, process_set=hvd.global_process_set):
            h = self._a2a(tensor, splits=splits, name=name, process_set=process_set)
            s = [int(v) for v in splits]
            self.sent["alltoall"] += sum(s) - s[process_set.rank()]
            self.handles[h] = ("alltoall", process_set.rank())
            self.calls["alltoall"] += 1
            return h

        def allgather_async(tensor, name=None, process_set=hvd.global_process_set):
            h = self._ag(tensor, name=name, process_set=process_set)
            if name.startswith("dgc."):
                self.sent["allgather"] += tensor.numel()
                self.handles[h] = ("allgather", tensor.numel())
                self.calls["allgather"] += 1
            return h

        def synchronize(handle):
            kind = self.handles.pop(handle, None)
            result = self._sync(handle)
            if kind is not None and kind[0] == "alltoall":
                out, received = result
                self.received["alltoall"] += out.numel() - int(received[kind[1]])
            elif kind is not None:
                self.received["allgather"] += result.numel() - kind[1]
            return result

        hvd.alltoall_async, hvd.allgather_async, hvd.synchronize = (
            alltoall_async, allgather_async, synchronize)
        return self

    def __exit__(self, *exc):
        hvd.alltoall_async, hvd.allgather_async, hvd.synchronize = self._a2a, self._ag, self._sync


def scenario_wire(results):
    """Per-rank statistics against the words DGC's collectives moved (Recorder), 5 steps."""
    out = {}
    for mode in ("bucketed", "small_buckets", "per_tensor", "gated"):
        dgc = dgc_for(mode)
        model, opt = make(f"wire.{mode}", dgc)
        with Recorder() as rec:
            train(model, opt, steps=5, aux_every=1)
        st = dgc.total_stats
        out[mode] = hvd.allgather_object({
            "wire_bytes": st.wire_bytes, "received_bytes": st.received_bytes,
            "steps": st.steps, "sent_words": rec.sent, "received_words": rec.received,
            "calls": rec.calls, "last_step": [dgc.stats.wire_bytes, dgc.stats.received_bytes],
            # what Horovod's own allreduce (and, gated, DGC's dense allreduce) carries per step
            "tensors": {n: [s.numel, s.sparse] for n, s in dgc.states.items()}})
    results["wire"] = out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    hvd.init()
    torch.set_num_threads(1)
    results = {"size": hvd.size()}
    for scenario in (scenario_identical, scenario_equivalence, scenario_conservation,
                     scenario_nonfinite, scenario_wire):
        scenario(results)
    if hvd.rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
