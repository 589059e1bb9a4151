"""Wall time of ``examples/tensorflow2_mnist.py`` with DGC against ``--compression none``, side by
side in one run (issue #14's TensorFlow goal: DGC at most 1.3x dense, same accuracy).

Each round launches the example under ``horovodrun -np 2 -H localhost:2 --gloo`` once per
variant, in turn, and reads its last lines ("final test accuracy", "wall time": the training
loop's wall clock as the example measures it, rank 0):

- ``none``: dense fp32 allreduce;
- ``dgc``: DGC with its defaults: its per-step work traced into the step as TensorFlow ops
  (``in_graph=True``, :mod:`dgc_horovod.tensorflow.graph`);
- ``dgc-host``: ``DGC(in_graph=False)``, the work in ``tf.py_function`` ops running the core
  eagerly; on a machine without a GPU on the NumPy backend and the fused C kernels
  (:mod:`dgc_horovod.tensorflow.host`), the default before 2026-12-05;
- ``dgc-tf-ops`` (``--tf-ops``): ``DGC(in_graph=False, device="gpu")``, the same on eager
  TensorFlow ops (what a GPU machine ran before 2026-12-05; here on the CPU);
- ``dgc-per-tensor`` (``--per-tensor``): ``DGC(bucket_numel=0)``, in the graph with one
  allgather per tensor instead of one per bucket (the in-graph default before 2026-12-06).

The example is run unchanged; the last two through this script with ``DGC``'s defaults patched.
Prints one line per run and, per variant, the median wall time and its ratio to ``none``.

    python benchmarks/tf_mnist_wall.py [--rounds 1] [--epochs 10] [--tf-ops] [--per-tensor]
"""
import argparse
import os
import re
import runpy
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "tensorflow2_mnist.py")


#: the DGC keyword arguments each variant patches in (None: the example runs unchanged)
VARIANTS = {"none": None, "dgc": None, "dgc-host": {"in_graph": False},
            "dgc-tf-ops": {"in_graph": False, "device": "gpu"},
            "dgc-per-tensor": {"bucket_numel": 0}}


def _inner(variant, argv):
    """Run the example in this process with DGC's defaults patched for ``variant``."""
    import dgc_horovod.tensorflow as dgc_tf
    init = dgc_tf.DGC.__init__

    def patched(self, config=None, **kwargs):
        init(self, config, **dict(kwargs, **VARIANTS[variant]))
    dgc_tf.DGC.__init__ = patched
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    sys.argv = [EXAMPLE] + argv
    runpy.run_path(EXAMPLE, run_name="__main__")


def _run(variant, epochs):
    bindir = os.path.dirname(sys.executable)
    horovodrun = os.path.join(bindir, "horovodrun")
    args = ["--compression", "none" if variant == "none" else "dgc", "--epochs", str(epochs)]
    if VARIANTS[variant]:
        cmd = [sys.executable, os.path.abspath(__file__), "--inner", variant, "--"] + args
    else:
        cmd = [sys.executable, EXAMPLE] + args
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3",
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo"] + cmd,
                          cwd=ROOT, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    wall = re.search(r"\[0\]<stdout>:wall time: ([\d.]+) s", out)
    acc = re.search(r"\[0\]<stdout>:final test accuracy: ([\d.]+)%", out)
    if proc.returncode != 0 or wall is None or acc is None:
        raise SystemExit(f"{variant}: the example failed (exit {proc.returncode}):\n{out[-3000:]}")
    return float(wall.group(1)), float(acc.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="runs of each variant, interleaved")
    ap.add_argument("--epochs", type=int, default=10, help="the example's --epochs")
    ap.add_argument("--tf-ops", action="store_true", help="also run DGC on eager TF ops")
    ap.add_argument("--per-tensor", action="store_true",
                    help="also run DGC in the graph with one allgather per tensor")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        return _inner(args.inner, args.rest)
    variants = (["none", "dgc", "dgc-host"] + (["dgc-tf-ops"] if args.tf_ops else [])
                + (["dgc-per-tensor"] if args.per_tensor else []))
    walls = {v: [] for v in variants}
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"{os.getloadavg()[0]:.1f}, {args.epochs} epochs, 2 ranks (Gloo)")
    for r in range(args.rounds):
        for v in variants:
            wall, acc = _run(v, args.epochs)
            walls[v].append(wall)
            print(f"round {r + 1} {v:>10}: wall {wall:7.1f} s, final test accuracy {acc:.2f}%",
                  flush=True)
    base = statistics.median(walls["none"])
    for v in variants:
        m = statistics.median(walls[v])
        print(f"{v:>10}: median wall {m:7.1f} s, {m / base:.2f}x none")
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
