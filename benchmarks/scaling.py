"""The region exchange against allgather as the number of workers grows (issue #16).

Two parts:

``convergence``: does ``exchange="regions"`` train as well as allgather DGC? Full DGC (density
0.001, the sparsity warm-up over 4% of the run, local clipping, momentum correction and masking
for MNIST) with each exchange on the two tasks of the convergence study
(benchmarks/convergence.py: MNIST digits with momentum SGD, the Shakespeare LSTM LM with vanilla
SGD), N = 16 and 64 simulated workers (dgc_horovod.simulate.SimulatedCluster), the study's
ablation lengths (MNIST 1,040 steps, LM 520). The LM runs 64 parallel streams instead of the
study's 32, so that 64 workers each own one. Every finished run is one JSON line in
``<out-dir>/runs.jsonl`` (``--resume`` skips those); ``report`` prints the table.

``model``: the cost model of both exchanges and of a dense ring allreduce, its check against
what the simulated cluster counts, and its projection to N = 16 … 256 for ResNet-50's and the
LSTM-LM's gradients at 1 and 10 Gbit/s (a PNG).

    python benchmarks/scaling.py convergence [--seeds 0 1] [--sizes 16 64] [--jobs 2]
                                             [--steps mnist=520 lm=260] [--resume]
    python benchmarks/scaling.py report
    python benchmarks/scaling.py model [--png docs/scaling.png]
"""
import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import convergence as C  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "runs", "scaling")
VARIANTS = ("dgc", "dgc_regions")
STEPS = {"mnist": 1040, "lm": 520}


def settings(task):
    s = dict(C.SETTINGS[task]["full"])
    if task == "lm":
        s["global_streams"] = 64
    return s


def plan(tasks, sizes, seeds, steps=None, variants=VARIANTS, compress_ratio=None):
    steps = {**STEPS, **(steps or {})}
    extra = {} if compress_ratio is None else {"compress_ratio": compress_ratio}
    return [dict(task=t, world_size=N, variant=v, seed=sd, steps=steps[t], mode="full",
                 settings=settings(t), **extra)
            for sd in seeds for t in tasks for N in sizes for v in variants]


def read_runs(out_dir):
    path = os.path.join(out_dir, "runs.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def convergence(args):
    os.makedirs(args.out_dir, exist_ok=True)
    done = {C.run_key(r) for r in read_runs(args.out_dir)} if args.resume else set()
    if not args.resume and os.path.exists(os.path.join(args.out_dir, "runs.jsonl")):
        os.remove(os.path.join(args.out_dir, "runs.jsonl"))
    steps = dict((t, int(n)) for t, n in (kv.split("=") for kv in args.steps or []))
    todo = [j for j in plan(args.tasks, args.sizes, args.seeds, steps, args.variants,
                            args.compress_ratio) if C.run_key(j) not in done]
    C.log(f"[scaling] {len(todo)} runs, {args.jobs} at a time, out-dir {args.out_dir}")
    t0 = time.time()

    def finished(rec):
        with open(os.path.join(args.out_dir, "runs.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
        C.log(f"[scaling] {rec['task']} N={rec['world_size']} {rec['variant']} seed "
              f"{rec['seed']}: {C.METRIC[rec['task']][0]} {rec['final_metric']:.2f}, "
              f"{rec['seconds']:.0f} s ({time.time() - t0:.0f} s so far)")
    if args.jobs == 1:
        for job in todo:
            finished(C.train(job))
    else:
        import concurrent.futures as cf
        import multiprocessing as mp
        with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex:
            for fut in cf.as_completed([ex.submit(C.train, job) for job in todo]):
                finished(fut.result())
    print(report_table(read_runs(args.out_dir)))
    return 0


def report_table(runs):
    """Markdown: per task and N, each exchange's final metric (mean ± std over seeds), the
    difference, and bytes received per worker per step (over the run; in brackets after the
    warm-up, for runs that recorded it)."""
    rows = ["| task (metric) | N | allgather DGC | region exchange | regions − allgather | "
            "received per worker per step, allgather → regions | seeds |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["task"], r["world_size"]) for r in runs})
    for task, N in keys:
        got = {}
        for v in VARIANTS:
            rs = [r for r in runs if (r["task"], r["world_size"], r["variant"]) == (task, N, v)]
            if rs:
                got[v] = rs
        if len(got) < 2:
            continue

        def cell(rs):
            m, sd = C.mean_std([r["final_metric"] for r in rs])
            return f"{m:.2f}" + ("" if sd is None else f" ± {sd:.2f}")

        def received(rs):       # over the run (the warm-up's denser steps included), and
            r = rs[0]           # in brackets over the steps after the warm-up, where recorded
            whole = r["wire"]["received_bytes"] / r["world_size"] / r["steps_run"]
            after = r["wire"].get("received_after_warmup")
            steps = r["steps_run"] - r["warmup_steps"]
            return f"{whole:,.0f}" + (f" ({after / r['world_size'] / steps:,.0f})"
                                      if after is not None and steps > 0 else "")
        ma = C.mean_std([r["final_metric"] for r in got["dgc"]])[0]
        mr = C.mean_std([r["final_metric"] for r in got["dgc_regions"]])[0]
        seeds = sorted({r["seed"] for v in got for r in got[v]})
        rows.append(f"| {task} ({C.METRIC[task][0]}) | {N} | {cell(got['dgc'])} | "
                    f"{cell(got['dgc_regions'])} | {mr - ma:+.2f} | "
                    f"{received(got['dgc'])} → {received(got['dgc_regions'])} B | "
                    f"{', '.join(map(str, seeds))} |")
    return "\n".join(rows)


# ============================================================================ the cost model
ENTRY = 6            # bytes per entry: a delta16 index token (2) and a float32 value (4)
PAYLOAD = 20 + 4     # a payload's header, and its member word in a bucket frame
FRAME = 8            # a bucket frame's header
DENSITY = 0.004      # the library's default
#: per-message latency assumed for the projection (a TCP round of Gloo's ring on a LAN)
ALPHA = 50e-6


def model_shapes(name):
    """[(name, shape)] of a model's gradients in registration order (benchmarks/shapes.py)."""
    import shapes
    return {"resnet50": shapes.resnet50, "lstm_lm": shapes.lstm_lm}[name]()


def model_tensors(name):
    """[(name, numel, ndim)] of a model's gradients, in plan order."""
    return [(n, math.prod(s), len(s)) for n, s in model_shapes(name)][::-1]


def _buckets(ts):
    from dgc_horovod.core import DGCConfig
    from dgc_horovod.core.buckets import plan_buckets
    cfg = DGCConfig(environ={})
    return [[ts_[1] for ts_, s in zip([t for t in ts if t[0] in members], flags) if s]
            for members, flags in plan_buckets(ts, cfg.bucket_numel, cfg)]


def predicted(ts, N, rho=DENSITY):
    """What one rank receives and decodes per step, by exchange, for the sparsified tensors
    (the dense 1-D tensors' allreduce is the same for both DGC exchanges): (bytes received
    {exchange: bytes}, decode work {exchange: (output elements zeroed, entries decoded,
    payloads parsed, candidates selected)}).

    allgather: (N − 1) × its own bucket frames; it decodes N payloads per tensor. regions: from
    each other rank the non-empty parts of its region (an entry lands in a region with
    probability 1/N, so a tensor of k entries has 1 − (1 − 1/N)^k non-empty parts per region),
    then from each other owner its kept ⌈ρ·n/N⌉ entries of every tensor (at most k); it sums
    its region into a kept scratch (decodes ≈ k entries, selects among ≈ k candidates) and
    decodes every owner's kept entries into the output (zeroes n elements). dense: ring allreduce, 2(N − 1)/N × the model.
    """
    out = {"allgather": 0.0, "regions": 0.0, "dense": 2 * (N - 1) / N * 4 * sum(
        n for _, n, _ in ts)}
    work = {"allgather": [0.0] * 4, "regions": [0.0] * 4}
    for bucket in _buckets(ts):
        if not bucket:
            continue
        own = FRAME + sum(PAYLOAD + ENTRY * math.ceil(rho * n) for n in bucket)
        out["allgather"] += (N - 1) * own
        frames1 = 1 - (1 - 1 / N) ** sum(math.ceil(rho * n) for n in bucket)
        out["regions"] += (N - 1) * FRAME * (1 + frames1)
        for n in bucket:
            k = math.ceil(rho * n)
            parts = 1 - (1 - 1 / N) ** k                  # P(a rank sends to a given region)
            kept = min(math.ceil(rho * n / N), k)
            shares = 1 - (1 - 1 / N) ** (N * k)           # P(an owner's sum is non-zero)
            out["regions"] += (N - 1) * (parts * PAYLOAD + ENTRY * k / N
                                         + shares * PAYLOAD + ENTRY * kept)
            work["allgather"] = [w + a for w, a in zip(work["allgather"], (n, N * k, N, 0))]
            work["regions"] = [w + a for w, a in zip(work["regions"], (
                n, k + N * shares * kept, N * parts + N * shares, k))]
    return out, work


def decode_costs(repeats=7):
    """Seconds per unit of decode work on this machine (torch backend, 1 thread), medians of
    ``repeats``: (per output element zeroed; per entry decoded; per payload parsed; per
    candidate selected by reduce_region into its kept scratch, beyond decoding: unique,
    top-k, gathers, encode, clearing the scratch)."""
    import statistics
    import numpy as np
    import torch
    from dgc_horovod.backends.torch_backend import TorchBackend
    from dgc_horovod.core import regions, wire
    torch.set_num_threads(1)
    B = TorchBackend()
    n, k = 1 << 24, 1 << 16
    rng = np.random.default_rng(0)
    idx = torch.from_numpy(np.sort(rng.choice(n, k, replace=False)).astype(np.int64))
    vals = torch.from_numpy(rng.standard_normal(k).astype(np.float32))
    full = wire.encode(B, n, idx, vals, 0, "delta16", "float32")
    empty = wire.encode(B, n, idx[:0], vals[:0], 0, "delta16", "float32")
    out = torch.empty(n)
    parts = regions.split_payload(B, full, n, 1, "t")

    def med(fn):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    zero = med(lambda: B.zero_(out))
    decode = med(lambda: wire.decode_sum(B, full, n, 1, "t", [], out))
    header = med(lambda: [wire.read_payload(B, empty, 0, n, "t") for _ in range(100)]) / 100
    scratch = torch.zeros(n)                # what DGCCore keeps per tensor for its region
    reduce = med(lambda: regions.reduce_region(B, parts[0], n, (0, n), 1, k / n / 2, "t",
                                               scratch=scratch))
    per_entry = max(decode - zero, 0.0) / k
    per_select = max(reduce - (decode - zero), 0.0) / k
    return zero / n, per_entry, header, per_select


def decode_seconds(work, costs):
    return sum(w * c for w, c in zip(work, costs))


def measured(tsname, sizes, steps=2):
    """Bytes received per worker per step (the simulated cluster's counters, worker 0) and
    the decode time of worker 0 per step (allgather: its decompress of every tensor; regions:
    its reduce_region of its regions and its decompress), on random gradients with the shapes
    of ``tsname``, density 0.004 from the first step."""
    import torch
    from dgc_horovod.core import DGCConfig
    from dgc_horovod.simulate import SimulatedCluster
    torch.set_num_threads(1)
    ts = model_tensors(tsname)
    rows = []
    for N in sizes:
        for exchange in ("allgather", "regions"):
            params = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.zeros(shape)) for _, shape in model_shapes(tsname)])
            model = torch.nn.Module()
            model.p = params
            opt = torch.optim.SGD(params, lr=0.0)
            cluster = SimulatedCluster(model, opt, N, DGCConfig(
                compress_ratio=DENSITY, warmup_steps=0, exchange=exchange, environ={}))
            core0 = cluster.cores[0]
            spent = [0.0]

            def timed(fn):
                def run(*a, **k):
                    t0 = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        spent[0] += time.perf_counter() - t0
                return run
            core0.decompress = timed(core0.decompress)
            core0.reduce_region = timed(core0.reduce_region)
            g = torch.Generator().manual_seed(0)
            for step in range(steps):
                grads = [{n: torch.randn(p.numel(), generator=g).view_as(p)
                          for n, p in model.named_parameters()} for _ in range(N)]
                cluster.reduce(grads)
            st = core0.total_stats
            sparse_dense = sum(4 * t.numel * steps for t in core0.states.values() if not t.sparse)
            rows.append(dict(model=tsname, N=N, exchange=exchange,
                             received=(st.received_bytes - sparse_dense) / steps,
                             decode_s=spent[0] / steps))
            del cluster, grads
    return rows


def model_cmd(args):
    sys.path.insert(0, HERE)
    costs = decode_costs()
    print(f"Decode costs on this machine (torch, 1 thread; {os.getloadavg()[0]:.1f} load): "
          f"{costs[0] * 1e9:.2f} ns per output element zeroed, {costs[1] * 1e9:.1f} ns per "
          f"entry decoded, {costs[2] * 1e6:.1f} µs per payload parsed, {costs[3] * 1e9:.1f} ns "
          "per candidate selected")
    rows = measured("resnet50", args.check_sizes)
    ts = model_tensors("resnet50")
    print("\nCheck on ResNet-50's shapes, density "
          f"{DENSITY}: bytes received per rank per step (the simulated cluster's counters) and "
          "worker 0's decode time per step, against the model")
    print("| N | exchange | bytes counted | model | ratio | decode ms measured | model | ratio |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b, work = predicted(ts, r["N"])
        p, d = b[r["exchange"]], decode_seconds(work[r["exchange"]], costs)
        print(f"| {r['N']} | {r['exchange']} | {r['received']:,.0f} | {p:,.0f} | "
              f"{p / r['received']:.3f} | {r['decode_s'] * 1e3:.1f} | {d * 1e3:.1f} | "
              f"{d / r['decode_s']:.2f} |")
    print(f"\nProjection (α = {ALPHA * 1e6:.0f} µs per message; ring allgather, pairwise "
          "alltoall, ring allreduce; decode at this machine's costs): exchange time per step "
          "in ms, and bytes received per rank per step")
    sizes = [16, 32, 64, 128, 256]
    table = {}
    print("| model | link | exchange | " + " | ".join(f"N={n}" for n in sizes) + " |")
    print("|---|---|---|" + "---:|" * len(sizes))
    for name in ("resnet50", "lstm_lm"):
        ts = model_tensors(name)
        nb = len([b for b in _buckets(ts) if b])
        for gbit in (1, 10):
            beta = gbit * 1e9 / 8
            for ex in ("dense", "allgather", "regions"):
                vals = []
                for N in sizes:
                    b, work = predicted(ts, N)
                    msgs = {"dense": 2 * (N - 1), "allgather": (N - 1) * nb,
                            "regions": 2 * (N - 1) * nb}[ex]
                    dec = decode_seconds(work[ex], costs) if ex in work else 0.0
                    vals.append((b[ex] / beta + msgs * ALPHA + dec) * 1e3)
                table[name, gbit, ex] = vals
                print(f"| {name} | {gbit} Gbit/s | {ex} | " +
                      " | ".join(f"{v:,.0f}" for v in vals) + " |")
        for ex in ("dense", "allgather", "regions"):
            print(f"| {name} | bytes | {ex} | " +
                  " | ".join(f"{predicted(ts, N)[0][ex] / 1e6:,.2f} MB" for N in sizes) + " |")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, name in zip(axes, ("resnet50", "lstm_lm")):
            for ex, color in (("dense", "gray"), ("allgather", "tab:red"),
                              ("regions", "tab:blue")):
                for gbit, style in ((1, "-"), (10, "--")):
                    ax.plot(sizes, table[name, gbit, ex], style, color=color, marker="o",
                            label=f"{ex}, {gbit} Gbit/s")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("workers N")
            ax.set_ylabel("exchange time per step (ms, model)")
            ax.set_title({"resnet50": "ResNet-50 gradients (25.6M)",
                          "lstm_lm": "LSTM-LM gradients (66.0M)"}[name])
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle(f"Dense ring allreduce vs DGC allgather vs DGC region exchange "
                     f"(density {DENSITY}, α = {ALPHA * 1e6:.0f} µs, this CPU's decode)",
                     fontsize=10)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"\nwrote {args.png}")
    return 0

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convergence", help="train allgather and region DGC side by side")
    c.add_argument("--tasks", nargs="+", default=["mnist", "lm"], choices=["mnist", "lm"])
    c.add_argument("--sizes", nargs="+", type=int, default=[16, 64])
    c.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    c.add_argument("--jobs", type=int, default=1)
    c.add_argument("--out-dir", default=DEFAULT_OUT)
    c.add_argument("--resume", action="store_true", help="skip the runs already in runs.jsonl")
    c.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    c.add_argument("--compress-ratio", type=float, default=None,
                   help="DGC's density instead of the study's 0.001")
    c.add_argument("--steps", nargs="+", metavar="TASK=STEPS",
                   help="run lengths other than the study's ablation lengths, e.g. mnist=520")
    r = sub.add_parser("report", help="print the convergence table of <out-dir>")
    r.add_argument("--out-dir", default=DEFAULT_OUT)
    m = sub.add_parser("model", help="the cost model: its check and its projection")
    m.add_argument("--check-sizes", nargs="+", type=int, default=[2, 4, 8])
    m.add_argument("--png", default=None, help="write the projection's plot here")
    args = p.parse_args(argv)
    if args.cmd == "model":
        return model_cmd(args)
    if args.cmd == "convergence":
        return convergence(args)
    if args.cmd == "report":
        print(report_table(read_runs(args.out_dir)))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
