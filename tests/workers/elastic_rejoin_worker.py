"""Runs under elastic `horovodrun -np 3 --min-np 2 --max-np 3` (Gloo): a worker leaves and its host
comes back. The discovery script prints DIR's hosts file, `localhost:2` and `127.0.0.1:1` at the
start; at step LEAVE rank 0 removes 127.0.0.1 (Horovod stops that worker, the two others go on),
at step BACK it lists it again (Horovod starts a new worker there, which joins at the reset).

    python tests/workers/elastic_rejoin_worker.py --framework torch|tf \
        --compression dgc|none|dgc-horovod-state --out DIR --hosts-file F

``dgc``: the state carries DGC (PyTorch ``TorchState(..., dgc=dgc)``, TensorFlow
``dgc_horovod.tensorflow.elastic.TensorFlowKerasState``); ``none``: dense, Horovod's own
compression; ``dgc-horovod-state``: DGC left out of Horovod's own state class.

Every process that finishes writes DIR/<host>.<pid>.json: its entries into the training function
(world size, rank, step, DGC's resets, density and step count) and the final parameters (finite,
bit-identical on every rank of the last world). tests/test_elastic.py asserts.
"""
import argparse
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402

from elastic_common import remove_host, update_hosts  # noqa: E402

STEPS, LEAVE, BACK = 10, 3, 6
# a warm-up that is still running when the worker joins: its density must follow rank 0's
KW = dict(compress_ratio=0.05, momentum=0.9, warmup_steps=12,
          min_sparse_numel=16, min_sparse_ndim=1, bucket_numel=600)

ap = argparse.ArgumentParser()
ap.add_argument("--framework", choices=["torch", "tf"], required=True)
ap.add_argument("--compression", choices=["dgc", "none", "dgc-horovod-state"], required=True,
                help="dgc-horovod-state: DGC, but left out of the elastic state (Horovod's own "
                "class, as Horovod's examples write it)")
ap.add_argument("--out", required=True)
ap.add_argument("--hosts-file", required=True)
args = ap.parse_args()
use_dgc = args.compression != "none"
carried = args.compression == "dgc"


def data(step, rank):
    rng = np.random.default_rng(1000 * step + rank)
    return (rng.standard_normal((32, 20)).astype(np.float32),
            rng.integers(0, 4, 32).astype(np.int64))


if args.framework == "torch":
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    from dgc_horovod.torch import DGC

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    dgc = DGC(**KW) if use_dgc else None
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.0 if use_dgc else 0.9),
        named_parameters=model.named_parameters(),
        compression=dgc if use_dgc else hvd.Compression.none)
    extra = {"dgc": dgc} if carried else {}
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0, **extra)

    def train_step(step):
        x, y = data(step, hvd.rank())
        opt.zero_grad()
        F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()

    def final():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = hvd.allgather(flat.unsqueeze(0), name="rejoin.final")
        return (bool(torch.isfinite(flat).all()), all(torch.equal(every[0], r) for r in every),
                float(flat.double().norm()))
else:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from dgc_horovod.tensorflow import DGC
    from dgc_horovod.tensorflow import elastic as dgc_elastic

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="relu", input_shape=(20,)),
                                 tf.keras.layers.Dense(4)])
    opt = tf.keras.optimizers.SGD(0.5, momentum=0.0 if use_dgc else 0.9)
    opt.build(model.trainable_variables)
    dgc = DGC(**KW) if use_dgc else None
    compression = dgc if use_dgc else hvd.Compression.none
    if carried:
        state = dgc_elastic.TensorFlowKerasState(model, opt, dgc=dgc, step=0)
    else:
        state = hvd.elastic.TensorFlowKerasState(model, opt, step=0)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    def train_step(step):
        step_fn(*data(step, hvd.rank()))

    def final():
        flat = tf.concat([tf.reshape(v, [-1]) for v in model.variables], 0)
        every = hvd.allgather(flat[None], name="rejoin.final")
        return (bool(tf.reduce_all(tf.math.is_finite(flat))),
                bool(tf.reduce_all(every == every[0])),
                float(np.linalg.norm(flat.numpy().astype(np.float64))))

host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
record = {"host": host, "entries": []}


@hvd.elastic.run
def train(state):
    entry = {"size": hvd.size(), "rank": hvd.rank(), "step": state.step}
    if use_dgc:
        entry.update(resets=dgc.resets, density=dgc.density, dgc_steps=dgc.total_stats.steps)
    record["entries"].append(entry)
    print(f"entry on {host}: world size {hvd.size()}, step {state.step}", flush=True)
    while state.step < STEPS:
        if state.step == LEAVE and hvd.size() == 3:
            remove_host(hvd, state, args.hosts_file)
        if state.step == BACK and hvd.size() == 2:
            update_hosts(hvd, state, args.hosts_file, ["localhost:2", "127.0.0.1:1"],
                         "host 127.0.0.1 listed again")
        train_step(state.step)
        state.step += 1
        state.commit()
    finite, identical, norm = final()
    record["final"] = {"size": hvd.size(), "finite": finite, "identical": identical,
                       "norm": norm}
    if use_dgc:
        record["final"].update(resets=dgc.resets, density=dgc.density)


train(state)
with open(os.path.join(args.out, f"{host}.{os.getpid()}.json"), "w") as f:
    json.dump(record, f)
print(f"finished on {host}: world size {hvd.size()}", flush=True)
