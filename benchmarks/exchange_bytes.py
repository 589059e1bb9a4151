"""Bytes sent and received per rank per step, and decode time, of DGC's two exchanges (issue #16).

Runs under horovodrun: ResNet-50's parameter shapes (``benchmarks/shapes.py``, 161 tensors,
25.6M parameters) trained through the stock ``hvd.DistributedOptimizer`` with DGC, once with
``exchange="allgather"`` and once with ``exchange="regions"`` (default buckets, momentum 0.9,
``--compress-ratio`` 0.001 as in the paper for ResNet-50, no warm-up: the density is the final
one from the first step). The compute is synthetic: each step every rank's gradients are fresh
Gaussian tensors (std 0.01/√fan_in, a different stream per rank and step), handed to the
parameters by one backward; one torch thread per rank.

Per exchange, over ``--steps`` timed steps after ``--warmup-steps`` untimed ones, per rank
(mean, min and max over the ranks):

- ``exchange sent`` / ``exchange received``: int32 words DGC's own collectives moved on this
  rank, times 4, per step: counted from the collectives' real inputs and outputs (alltoall: the
  splits for other ranks, the output but this rank's part; allgather: its input, the output but
  its input);
- ``stats sent`` / ``stats received``: DGC's statistics (wire_bytes, received_bytes per step):
  the exchange plus what Horovod's allreduce carries for DGC's tensors (a 4-byte placeholder per
  sparsified tensor, the dense 1-D tensors' velocities at their size);
- ``decode ms``: wall time per step in ``DGCCore.decompress`` (every tensor's update from the
  gathered payloads) plus, with regions, ``DGCCore.reduce_region`` (the owner's sum and
  selection);
- ``step ms``: rank 0's step time (CPU-bound when N ranks share fewer cores: read the bytes).

    horovodrun -np 8 -H localhost:8 --gloo python benchmarks/exchange_bytes.py --json-out r.json
"""
import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


class Recorder:
    """Counts the int32 words DGC's collectives move on this rank (wraps horovod.torch's
    alltoall_async, allgather_async and synchronize, which dgc_horovod.torch.exchange calls)."""

    def __init__(self, hvd):
        self.hvd, self.handles = hvd, {}
        self.sent = self.received = 0
        self._orig = hvd.alltoall_async, hvd.allgather_async, hvd.synchronize
        a2a, ag, sync = self._orig

        def alltoall_async(tensor, splits=None, name=None, process_set=hvd.global_process_set):
            h = a2a(tensor, splits=splits, name=name, process_set=process_set)
            s = [int(v) for v in splits]
            self.sent += sum(s) - s[process_set.rank()]
            self.handles[h] = ("alltoall", process_set.rank())
            return h

        def allgather_async(tensor, name=None, process_set=hvd.global_process_set):
            h = ag(tensor, name=name, process_set=process_set)
            if name and name.startswith("dgc."):
                self.sent += tensor.numel()
                self.handles[h] = ("allgather", tensor.numel())
            return h

        def synchronize(handle):
            kind = self.handles.pop(handle, None)
            result = sync(handle)
            if kind and kind[0] == "alltoall":
                self.received += result[0].numel() - int(result[1][kind[1]])
            elif kind:
                self.received += result.numel() - kind[1]
            return result

        hvd.alltoall_async, hvd.allgather_async, hvd.synchronize = (
            alltoall_async, allgather_async, synchronize)


class Timed:
    """Wall seconds spent in some methods of an object (wrapped on the instance)."""

    def __init__(self, obj, names):
        self.seconds = 0.0
        for name in names:
            setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def worker(args):
    import horovod.torch as hvd
    import torch

    from shapes import resnet50
    from dgc_horovod.torch import DGC

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    shapes = resnet50()
    recorder = Recorder(hvd)
    results = {"size": size, "compress_ratio": args.compress_ratio, "steps": args.steps,
               "warmup_steps": args.warmup_steps, "loadavg_start": os.getloadavg(), "runs": {}}
    for exchange in args.exchange:
        params = [torch.nn.Parameter(torch.zeros(s)) for _, s in shapes]
        named = [(n, p) for (n, _), p in zip(shapes, params)]
        dgc = DGC(compress_ratio=args.compress_ratio, momentum=0.9, warmup_epochs=0,
                  exchange=exchange)
        decode = Timed(dgc._core, ["decompress", "reduce_region"])
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1e-6), named_parameters=named,
                                       compression=dgc)
        gen = torch.Generator().manual_seed(1000 + rank)
        stds = [0.01 / math.sqrt(math.prod(s[1:]) if len(s) > 1 else 1) for _, s in shapes]
        step_s = []
        for step in range(args.warmup_steps + args.steps):
            grads = [torch.randn(p.shape, generator=gen) * std for p, std in zip(params, stds)]
            if step == args.warmup_steps:
                hvd.allreduce(torch.zeros(1), name="bench.barrier")
                start = dgc.total_stats.copy()
                sent0, received0, decode0 = recorder.sent, recorder.received, decode.seconds
            t0 = time.perf_counter()
            opt.zero_grad()
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
            opt.step()
            if step >= args.warmup_steps:
                step_s.append(time.perf_counter() - t0)
        st = dgc.total_stats.since(start)
        n = args.steps
        mine = {"exchange_sent": 4 * (recorder.sent - sent0) / n,
                "exchange_received": 4 * (recorder.received - received0) / n,
                "stats_sent": st.wire_bytes / st.steps, "stats_received": st.received_bytes / st.steps,
                "decode_ms": 1e3 * (decode.seconds - decode0) / n,
                "compress_ms": 1e3 * st.compress_seconds / st.steps,
                "density": st.selected / st.elements, "step_ms": 1e3 * sum(step_s) / n}
        results["runs"][exchange] = hvd.allgather_object(mine)
        del opt, params, named, dgc
    results["loadavg_end"] = os.getloadavg()
    if rank == 0:
        report(results)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(results, f, indent=1)


COLUMNS = [("exchange_sent", "exchange sent B"), ("exchange_received", "exchange recv B"),
           ("stats_sent", "stats sent B"), ("stats_received", "stats recv B"),
           ("decode_ms", "decode ms"), ("compress_ms", "compress ms")]


def report(r):
    print(f"N = {r['size']}, density {r['compress_ratio']}, {r['steps']} timed steps; per rank "
          f"per step, mean [min, max] over ranks; load {r['loadavg_start'][0]:.1f} → "
          f"{r['loadavg_end'][0]:.1f}")
    for exchange, ranks in r["runs"].items():
        cells = []
        for key, label in COLUMNS:
            v = [x[key] for x in ranks]
            fmt = "{:.0f}" if key.endswith(("sent", "received")) else "{:.1f}"
            cells.append(f"{label} {fmt.format(sum(v) / len(v))} "
                         f"[{fmt.format(min(v))}, {fmt.format(max(v))}]")
        print(f"  {exchange:>9}: " + "; ".join(cells) + f"; step ms {ranks[0]['step_ms']:.0f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exchange", default="allgather,regions",
                    help="comma-separated exchanges to run, in turn")
    ap.add_argument("--compress-ratio", type=float, default=0.001)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per exchange")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per exchange")
    ap.add_argument("--json-out", default=None, help="rank 0 writes the numbers here")
    args = ap.parse_args(argv)
    args.exchange = args.exchange.split(",")
    worker(args)


if __name__ == "__main__":
    main()
