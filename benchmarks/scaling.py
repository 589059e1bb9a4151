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


def plan(tasks, sizes, seeds):
    return [dict(task=t, world_size=N, variant=v, seed=sd, steps=STEPS[t], mode="full",
                 settings=settings(t))
            for sd in seeds for t in tasks for N in sizes for v in VARIANTS]


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
    todo = [j for j in plan(args.tasks, args.sizes, args.seeds) if C.run_key(j) not in done]
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
    difference, and bytes received per worker per step."""
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

        def received(rs):
            r = rs[0]
            return r["wire"]["received_bytes"] / r["world_size"] / r["steps_run"]
        ma = C.mean_std([r["final_metric"] for r in got["dgc"]])[0]
        mr = C.mean_std([r["final_metric"] for r in got["dgc_regions"]])[0]
        seeds = sorted({r["seed"] for v in got for r in got[v]})
        rows.append(f"| {task} ({C.METRIC[task][0]}) | {N} | {cell(got['dgc'])} | "
                    f"{cell(got['dgc_regions'])} | {mr - ma:+.2f} | "
                    f"{received(got['dgc']):,.0f} → {received(got['dgc_regions']):,.0f} B | "
                    f"{', '.join(map(str, seeds))} |")
    return "\n".join(rows)


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
    r = sub.add_parser("report", help="print the convergence table of <out-dir>")
    r.add_argument("--out-dir", default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.cmd == "convergence":
        return convergence(args)
    if args.cmd == "report":
        print(report_table(read_runs(args.out_dir)))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
