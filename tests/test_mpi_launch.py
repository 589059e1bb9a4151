"""DGC in jobs started without horovodrun: a plain `mpirun -np N` (as Slurm and other schedulers
start jobs), Horovod initialized by ``hvd.init()``, by ``hvd.init(comm=MPI.COMM_WORLD)`` with an
mpi4py communicator, and two independent jobs in one launch (a split communicator, a list of
ranks, process sets). The same with DGC(exchange="hierarchical") and dynamic process sets: on
one machine a plain `mpirun` makes one node of all its ranks (M = 1; across two hosts:
tests/test_cluster.py). The worker is tests/workers/mpi_worker.py; docs/usage.md, "Launching
without horovodrun", shows the same launches.
"""
import json
import os
import sys

import pytest

from conftest import job_env, launch
from dgc_horovod.core import hierarchical

pytestmark = pytest.mark.horovodrun

WORKER = os.path.join("tests", "workers", "mpi_worker.py")


def mpirun_flags(np):
    """What Open MPI's mpirun needs here beyond ``-np``: ``--allow-run-as-root`` as root (it
    refuses otherwise), ``--oversubscribe`` for more ranks than cores (it refuses otherwise)."""
    flags = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return flags + (["--oversubscribe"] if np > (os.cpu_count() or 1) else [])


def mpirun(tmp_path, np, init, framework="torch", timeout=600, exchange="allgather"):
    """`mpirun -np N python mpi_worker.py --init INIT`: the ranks' records by world rank."""
    cmd = (["mpirun"] + mpirun_flags(np) +
           ["-np", str(np), sys.executable, WORKER, "--framework", framework, "--init", init,
            "--exchange", exchange, "--out", str(tmp_path)])
    # nothing of a launcher's in the environment: what a bare shell gives mpirun
    env = job_env({k: v for k, v in os.environ.items()
                   if not k.startswith(("HOROVOD_", "OMPI_", "PMIX_"))})
    launch(cmd, dict(env, TF_USE_LEGACY_KERAS="1"), timeout)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(np)]


def check_job(records, size, fall=0.9):
    """One job's ranks (in its own rank order): bit-identical replicas (the job's allgather
    and the parameters' digests), every rank's loss fell (below ``fall`` × its first), DGC
    sparsified every step, and the state_dict records the job's size and the rank in it."""
    assert [r["rank"] for r in records] == list(range(size))
    assert all(r["size"] == size for r in records)
    assert all(r["identical"] for r in records), "replicas differ"
    assert len({r["params"] for r in records}) == 1, "replicas differ"
    for r in records:
        assert r["steps"] == 20 and r["selected"] > 0
        assert r["losses"][-1] < fall * r["losses"][0], r["losses"]
        assert (r["state_world_size"], r["state_rank"]) == (size, r["rank"])


@pytest.mark.parametrize("framework,init", [("torch", "plain"), ("torch", "comm"),
                                            ("tf", "comm")])
def test_plain_mpirun_trains_identical_replicas(tmp_path, framework, init):
    """`mpirun -np 2` with hvd.init() or hvd.init(comm=MPI.COMM_WORLD): one job of 2 ranks,
    no HOROVOD_* variable set."""
    records = mpirun(tmp_path, 2, init, framework)
    assert all(r["hvd_size"] == 2 and r["group"] == 0 for r in records)
    check_job(records, 2)


@pytest.mark.parametrize("init", ["split", "ranks", "process_set"])
def test_two_jobs_in_one_launch_train_independently(tmp_path, init):
    """`mpirun -np 4`, the even and the odd world ranks training a model each on data of their
    own: as Horovod jobs of their own (hvd.init(comm=MPI.COMM_WORLD.Split(...)), or
    hvd.init(comm=[ranks])) or as two process sets of one job (hvd.init(comm=MPI.COMM_WORLD,
    process_sets=[hvd.ProcessSet(half)]), the optimizer's process_set=). Each half's replicas
    are bit-identical and its loss falls; the halves differ (the same initial model, other
    data), so neither took part in the other's exchange. (TensorFlow: the same as
    test_plain_mpirun_trains_identical_replicas[tf-comm] inside each half; 4 TensorFlow
    processes on 2 cores take minutes on a busy machine.)"""
    records = mpirun(tmp_path, 4, init)
    halves = [[r for r in records if r["group"] == g] for g in (0, 1)]
    assert [[r["world_rank"] for r in h] for h in halves] == [[0, 2], [1, 3]]
    for half in halves:
        check_job(half, 2)
        assert all(r["hvd_size"] == (4 if init == "process_set" else 2) for r in half)
    assert halves[0][0]["params"] != halves[1][0]["params"], "the two jobs trained alike"
    assert halves[0][0]["losses"] != halves[1][0]["losses"]


def check_one_node(records, size):
    """The hierarchical exchange on one machine under MPI: one node of every rank of the job
    (Horovod's local size = size, cross size 1), the layout a DGC checkpoint records says so,
    and nothing came from another node (at M = 1 the cross-node allgather is over a set of one
    rank: nothing crosses, cross_node_bytes is 0 too)."""
    for r in records:
        assert (r["local_size"], r["cross_size"]) == (size, 1), r
        assert r["layout"] == {"local_size": size, "nodes": 1, "shard": r["rank"],
                               "shards": hierarchical.SHARD_RULE}, r
        assert r["cross_node_received_bytes"] == r["cross_node_bytes"] == 0, r
        assert r["node_bytes"] > 0, r


@pytest.mark.parametrize("np", [2, 4])
def test_hierarchical_plain_mpirun_with_comm_trains_identical_replicas(tmp_path, np):
    """`mpirun -np N` with hvd.init(comm=MPI.COMM_WORLD, process_sets="dynamic") and
    DGC(exchange="hierarchical"): one node of N ranks (M = 1, a legal layout: each rank runs DGC
    on its 1/N shard of the node's gradient); replicas bit-identical, loss falls. One node is
    one DGC worker (N = M = 1): a step applies one selection of the node's average gradient
    where flat DGC applies N, so in 20 steps the loss falls less than with flat DGC (np 4:
    rank 1's 2.38 -> 2.15, 0.90x; each rank's by at least 5% here)."""
    records = mpirun(tmp_path, np, "comm", exchange="hierarchical")
    assert all(r["error"] is None and r["hvd_size"] == np for r in records), records
    check_job(records, np, fall=0.95)
    check_one_node(records, np)


@pytest.mark.parametrize("init", ["split", "ranks"])
def test_hierarchical_two_jobs_in_one_launch(tmp_path, init):
    """`mpirun -np 4`, hvd.init(comm=MPI.COMM_WORLD.Split(...), process_sets="dynamic") (or
    comm=[ranks]): the even and the odd world ranks are two Horovod jobs of one node of 2
    ranks each, each with its own hierarchical DGC; each half's replicas are bit-identical, its
    loss falls, and the halves train apart."""
    records = mpirun(tmp_path, 4, init, exchange="hierarchical")
    assert all(r["error"] is None for r in records), records
    halves = [[r for r in records if r["group"] == g] for g in (0, 1)]
    assert [[r["world_rank"] for r in h] for h in halves] == [[0, 2], [1, 3]]
    for half in halves:
        check_job(half, 2)
        check_one_node(half, 2)
    assert halves[0][0]["params"] != halves[1][0]["params"], "the two jobs trained alike"


def test_hierarchical_refuses_a_process_set(tmp_path):
    """One Horovod job over MPI_COMM_WORLD with each half a process set (the optimizer's
    process_set=): the hierarchical exchange runs on the global process set only, and every
    rank gets the same ValueError at the first step, saying what to do (no hang)."""
    records = mpirun(tmp_path, 4, "process_set", exchange="hierarchical")
    errors = {r["error"] for r in records}
    assert len(errors) == 1 and "runs on Horovod's global process set" in errors.pop(), records
