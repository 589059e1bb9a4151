"""Runs under a plain `mpirun -np N` (no horovodrun): DGC with the stock Horovod optimizer, Horovod
initialized as a job started by `mpirun` (or a scheduler) would do it.

``--init`` picks how (docs/usage.md, "Launching without horovodrun"):

- ``plain``: ``hvd.init()``, the whole of MPI_COMM_WORLD;
- ``comm``: ``hvd.init(comm=MPI.COMM_WORLD)``, an mpi4py communicator;
- ``split``: ``hvd.init(comm=MPI.COMM_WORLD.Split(color=rank % 2))``: the even and the odd world
  ranks are two Horovod jobs of their own, each training its own replicas on its own data;
- ``ranks``: the same halves as ``hvd.init(comm=[world ranks of the half])``;
- ``process_set``: one Horovod job over MPI_COMM_WORLD with each half a process set
  (``hvd.init(comm=MPI.COMM_WORLD, process_sets=[hvd.ProcessSet(half)])``) and the optimizer
  given ``process_set=``.

``--exchange hierarchical`` (PyTorch) trains with ``DGC(exchange="hierarchical")`` and adds
``process_sets="dynamic"`` to each ``hvd.init`` (``process_set``: the set is passed, dynamic
process sets switched on by ``HOROVOD_DYNAMIC_PROCESS_SETS=1``; the exchange refuses a process
set other than the global one, and the record holds the error). On one machine a plain
``mpirun`` makes one node of every rank (local size = the job's size, one node: M = 1).

Every rank trains the small model of torch_worker.py (tf_worker.py's for ``--framework tf``) on a
fixed batch of its own for 20 steps and writes ``rank<world rank>.json`` into ``--out``: its
group (the half; 0 when the job is the whole world), its rank and size in the group, the losses,
a digest of the parameters' bytes, whether the group's replicas are bit-identical (an allgather
over the group), and the world size and rank its DGC state_dict records.
"""
import argparse
import hashlib
import json
import os

from mpi4py import MPI

STEPS = 20


def init(hvd, how, dynamic=False):
    """Initialize Horovod as ``how`` says: (group, process set DGC runs in). ``dynamic``: with
    dynamic process sets (``process_sets="dynamic"``)."""
    world = MPI.COMM_WORLD
    color = world.rank % 2
    sets = {"process_sets": "dynamic"} if dynamic else {}
    if how == "plain":
        hvd.init(**sets)
        return 0, hvd.global_process_set
    if how == "comm":
        hvd.init(comm=world, **sets)
        return 0, hvd.global_process_set
    if how == "split":
        hvd.init(comm=world.Split(color=color, key=world.rank), **sets)
        return color, hvd.global_process_set
    if how == "ranks":
        hvd.init(comm=[r for r in range(world.size) if r % 2 == color], **sets)
        return color, hvd.global_process_set
    if how == "process_set":
        ps = hvd.ProcessSet(world.Split(color=color, key=world.rank))
        if dynamic:     # hvd.init takes a list or "dynamic", not both
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        hvd.init(comm=world, process_sets=[ps])
        return color, ps
    raise ValueError(f"--init {how!r}")


def run_torch(how, exchange):
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    from dgc_horovod.torch import DGC
    from torch_worker import batches, flat_params, make

    group, ps = init(hvd, how, dynamic=exchange == "hierarchical")
    torch.set_num_threads(1)
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, exchange=exchange)
    model, opt = make("mpi", dgc, process_set=ps)
    data = batches(4, 1000 * group + 100 + ps.rank())     # a fixed batch of 64 per rank
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    flat = flat_params(model)
    gathered = hvd.allgather(flat.unsqueeze(0), name="check.params", process_set=ps)
    identical = bool((gathered == gathered[0]).all())
    return hvd, group, ps, dgc, losses, flat.numpy().tobytes(), identical


def run_tf(how, exchange):
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    from dgc_horovod.tensorflow import DGC
    from tf_worker import LR, batches, flat, make_model

    group, ps = init(hvd, how)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    dgc = DGC(compress_ratio=0.01, momentum=0.9, warmup_epochs=0)
    model = make_model()
    opt = tf.keras.optimizers.SGD(LR)
    data = batches(4, 1000 * group + 100 + ps.rank())
    x = tf.constant(np.concatenate([b[0] for b in data]))
    y = tf.constant(np.concatenate([b[1] for b in data]))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True))
        tape = hvd.DistributedGradientTape(tape, compression=dgc, process_set=ps)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [float(step()) for _ in range(STEPS)]
    gathered = hvd.allgather(flat(model)[None], name="check_params", process_set=ps)
    identical = bool(tf.reduce_all(gathered == gathered[0]))
    return hvd, group, ps, dgc, losses, flat(model).numpy().tobytes(), identical


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=("torch", "tf"), default="torch")
    ap.add_argument("--init", required=True,
                    choices=("plain", "comm", "split", "ranks", "process_set"))
    ap.add_argument("--exchange", choices=("allgather", "hierarchical"), default="allgather")
    ap.add_argument("--out", required=True, help="a directory: rank<world rank>.json")
    args = ap.parse_args()
    run = run_torch if args.framework == "torch" else run_tf
    out = os.path.join(args.out, f"rank{MPI.COMM_WORLD.rank}.json")
    try:
        hvd, group, ps, dgc, losses, params, identical = run(args.init, args.exchange)
    except ValueError as e:     # DGC's refusal (hierarchical on a process set): recorded
        with open(out, "w") as f:
            json.dump({"world_rank": MPI.COMM_WORLD.rank, "error": str(e)}, f, indent=1)
        MPI.COMM_WORLD.Barrier()    # Horovod's shutdown would stop the other half (below)
        return
    state = dgc.state_dict(process_set=ps)
    total = dgc.total_stats
    record = {"world_rank": MPI.COMM_WORLD.rank, "world_size": MPI.COMM_WORLD.size,
              "group": group, "rank": ps.rank(), "size": ps.size(),
              "hvd_rank": hvd.rank(), "hvd_size": hvd.size(), "losses": losses,
              "local_size": hvd.local_size(), "cross_size": hvd.cross_size(),
              "params": hashlib.sha256(params).hexdigest(), "identical": identical,
              "steps": int(total.steps), "selected": int(total.selected),
              "state_world_size": state["world_size"], "state_rank": state["rank"],
              "layout": state.get("layout"), "error": None,
              "cross_node_bytes": int(total.cross_node_bytes),
              "cross_node_received_bytes": int(total.cross_node_received_bytes),
              "node_bytes": int(total.node_bytes)}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    # Horovod's shutdown is collective over its whole job: a rank that leaves while the other
    # process set still trains stops that set's collectives ("Horovod has been shut down")
    # (horovod.tensorflow 0.28.1 has no barrier: MPI's)
    if args.init == "process_set":
        hvd.barrier() if hasattr(hvd, "barrier") else MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
