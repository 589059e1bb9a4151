"""Long run: memory and live-tensor counts over many DGC steps (looking for leaks).

Launches itself under ``horovodrun -np 2 --gloo`` and trains the small Net of
tests/workers/torch_worker.py (fc1 64x128, fc2 128x10, aux 128x10, 10,122 parameters) with the
stock ``hvd.DistributedOptimizer`` and DGC (compress_ratio=0.01, momentum=0.9, warmup_epochs=0,
default buckets). Every ``--every`` steps rank 0 records its resident memory (psutil) and the
number of live ``torch.Tensor`` objects (gc.get_objects()), and prints them; at the end it prints
the growth from the first record to the last.

    python benchmarks/long_run.py [--steps 10000] [--every 1000]
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def live_tensors():
    import gc
    import warnings

    import torch
    gc.collect()
    with warnings.catch_warnings():          # isinstance on deprecated torch module attributes
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def worker(args):
    import time

    import horovod.torch as hvd
    import psutil
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
    from torch_worker import Net

    from dgc_horovod.torch import DGC

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=dgc)
    g = torch.Generator().manual_seed(hvd.rank())
    data = [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(64)]
    proc, records, start = psutil.Process(), [], time.time()
    for step in range(1, args.steps + 1):
        x, y = data[step % len(data)]
        opt.zero_grad()
        F.cross_entropy(model(x, use_aux=(step % 2 == 0)), y).backward()
        opt.step()
        if step % args.every == 0 and hvd.rank() == 0:
            rss, tensors = proc.memory_info().rss / 2 ** 20, live_tensors()
            records.append((step, rss, tensors))
            print(f"step {step:6d}  rss {rss:8.1f} MiB  live tensors {tensors:6d}  "
                  f"{time.time() - start:7.1f} s", flush=True)
    if hvd.rank() == 0 and records:
        (s0, r0, t0), (s1, r1, t1) = records[0], records[-1]
        print(f"growth step {s0} -> {s1}: rss {r1 - r0:+.1f} MiB, live tensors {t1 - t0:+d}; "
              f"{args.steps} steps in {time.time() - start:.1f} s; "
              f"finite: {all(bool(torch.isfinite(p).all()) for p in model.parameters())}",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    cmd = [os.path.join(bindir, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
           sys.executable, os.path.abspath(__file__), "--worker",
           "--steps", str(args.steps), "--every", str(args.every)]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=True).returncode


if __name__ == "__main__":
    sys.exit(main())
