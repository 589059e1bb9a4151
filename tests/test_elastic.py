"""DGC under Horovod Elastic (PyTorch and TensorFlow, Gloo): a worker leaves mid-training, the
others finish.

Real elastic jobs (tests/workers/elastic_worker.py with hvd.elastic.TorchState,
tests/workers/tf_elastic_worker.py with dgc_horovod.tensorflow.elastic.TensorFlowKerasState and
TensorFlowState, the same job and records): `horovodrun -np 3 --min-np 2 --max-np 3
--host-discovery-script` with the slots `localhost:2` and `127.0.0.1:1` (two names of this
machine: Horovod blacklists the host of a failed worker, so the leaver needs a "host" of its own).
Three workers are needed so that DGC still runs after one leaves: with one process Horovod's
optimizer never calls the compressor. At step 6 of 10 the worker on 127.0.0.1 leaves:

* ``exit``: it calls os._exit(3); the others fail in a collective (HorovodInternalError), restore
  the last commit, and ``sync`` after the reset applies DGC's reset rule;
* ``remove``: rank 0 removes it from the discovery output; the commit raises
  HostsUpdatedInterrupt, Horovod skips ``sync`` (only a removal), and DGC applies the rule at the
  first step after the reset (PyTorch) or when the state is reset (TensorFlow).

The TensorFlow step is one tf.function traced in the world of 3 and kept after the reset, so the
clipping check of the first step after it also shows that DGC reads the world size at run time.

The hierarchical exchange (PyTorch, tests/workers/hierarchical_elastic_worker.py, at the end):
`horovodrun -np 4 --min-np 2 --max-np 4` starting on `localhost:2`, `127.0.0.1:2` (2 nodes × 2
ranks), then a host removed and listed again, one slot per host and two again, unequal nodes,
and a worker that crashes.
"""
import json
import os
import subprocess
import sys

import pytest

from conftest import BIN, ROOT

pytestmark = pytest.mark.horovodrun

EXIT_STEP, STEPS = 6, 10
WORKERS = {"torch": "tests/workers/elastic_worker.py", "tf": "tests/workers/tf_elastic_worker.py"}


@pytest.fixture(scope="module", params=[(fw, mode) for fw in WORKERS for mode in ("exit", "remove")],
                ids=lambda p: "-".join(p))
def job(request, tmp_path_factory):
    framework, mode = request.param
    log, results = elastic_job(tmp_path_factory.mktemp(f"elastic_{framework}_{mode}"),
                               [WORKERS[framework], "--mode", mode], timeout=400)
    return framework, mode, log, results


def elastic_job(tmp, worker_args, timeout, np=3, hosts=("localhost:2", "127.0.0.1:1"), ok=True):
    """Run ``horovodrun -np N --min-np 2 --max-np N --gloo`` with a discovery script that prints
    tmp/hosts (``hosts`` at the start, by default ``localhost:2``, ``127.0.0.1:1``; the worker
    passed ``--hosts-file`` rewrites it) and the worker (``--out`` tmp/out); (log, every process's
    JSON record). The test fails if the job hangs past ``timeout``, or if it exits non-zero
    (``ok=False``: if it exits 0)."""
    hosts_file, discover, out = tmp / "hosts", tmp / "discover.sh", tmp / "out"
    hosts_file.write_text("".join(h + "\n" for h in hosts))
    discover.write_text(f"#!/bin/sh\ncat '{hosts_file}'\n")
    discover.chmod(0o755)
    out.mkdir()
    cmd = [os.path.join(BIN, "horovodrun"), "-np", str(np), "--min-np", "2", "--max-np", str(np),
           "--host-discovery-script", str(discover), "--gloo", sys.executable, *worker_args,
           "--out", str(out), "--hosts-file", str(hosts_file)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1", PYTHONPATH=ROOT,
               PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"") + (e.stderr or b"")
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s (a hang):\n{text[-6000:]}")
    log = proc.stdout + proc.stderr
    if (proc.returncode == 0) != ok:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{log[-6000:]}")
    return log, [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def test_job_finishes_on_the_survivors_after_a_reset(job):
    _, mode, log, results = job
    left = {"exit": f"worker on 127.0.0.1 leaves at step {EXIT_STEP}",
            "remove": f"host 127.0.0.1 removed from discovery at step {EXIT_STEP}"}[mode]
    assert left in log
    assert log.count("elastic reset: world size 2") == 2              # both survivors, logged
    assert log.count("finished on localhost: world size 2, DGC resets 1") == 2
    assert [r["host"] for r in results] == ["localhost", "localhost"]  # the leaver wrote nothing
    for r in results:
        assert r["reset_callbacks"] == [2]
        assert [(e["size"], e["step"]) for e in r["entries"]] == [(3, 0), (2, EXIT_STEP)]


def test_reset_rule_applied_at_sync_or_at_the_first_step(job):
    framework, mode, _, results = job
    for r in results:
        entry = r["entries"][1]
        if mode == "exit":
            failed = r["failed"]
            assert failed["step"] == EXIT_STEP
            assert failed["stat_steps"] == failed["committed_stat_steps"] + 1  # compressed, failed
            assert entry["stat_steps"] == entry["committed_stat_steps"] == EXIT_STEP  # restored
            assert entry["resets"] == 1 and entry["dgc_states"] == 0     # dropped at sync / reset
        elif framework == "torch":
            assert "failed" not in r
            assert entry["resets"] == 0 and entry["dgc_states"] == 4     # no sync: not yet
        else:
            assert "failed" not in r
            assert entry["resets"] == 1 and entry["dgc_states"] == 0     # state.reset() applied it
        assert r["final"]["resets"] == 1                                 # exactly once


def test_first_step_of_each_world_starts_from_zero_state_with_the_new_world_size(job):
    *_, results = job
    for r in results:
        start, after = r["fresh"]
        assert start["world"] == 3 and after["world"] == 2
        for f in (start, after):
            assert f["ok"] and f["tensors"] == 4 and f["sent"] > 0
        assert not after["fits_previous_world"]        # clipping used N = 2, not 3


def test_sync_refuses_a_config_that_differs_on_one_rank_on_every_rank(job):
    *_, results = job
    for r in results:
        msg = r["config_mismatch"]
        assert msg is not None and msg.startswith("DGC: the ranks' DGC configs differ")
        assert "compress_ratio" in msg and "0.1" in msg


def test_explicit_restore_is_bit_identical_to_the_commit(job):
    *_, results = job
    for r in results:
        assert r["restore"] == {"moved": True, "identical_to_commit": True, "step_after": 3}


def test_parameters_finite_and_identical_on_the_remaining_ranks(job):
    *_, results = job
    finals = [r["final"] for r in results]
    assert sorted(f["rank"] for f in finals) == [0, 1]
    for f in finals:
        assert f["size"] == 2 and f["finite"] and f["identical"]
    assert finals[0]["params"] == finals[1]["params"]


def test_carried_dgc_gives_no_elastic_state_warning(job):
    _, _, log, _ = job
    assert "no elastic state carries this DGC" not in log



REJOIN = {"torch-dgc": ("torch", "dgc"), "torch-dense": ("torch", "none"),
          "torch-dgc-horovod-state": ("torch", "dgc-horovod-state"),
          "tf-dgc": ("tf", "dgc"), "tf-dense": ("tf", "none"),
          "tf-dgc-horovod-state": ("tf", "dgc-horovod-state")}


@pytest.fixture(scope="module", params=list(REJOIN))
def rejoin_job(request, tmp_path_factory):
    """tests/workers/elastic_rejoin_worker.py: 3 workers; at step 3 rank 0 removes 127.0.0.1 from
    the discovery output, at step 6 lists it again, and Horovod starts a new worker there that
    joins the two others until step 10 (`dgc-horovod-state`: DGC left out of the elastic state,
    Horovod's own class, as Horovod's examples write it)."""
    framework, compression = REJOIN[request.param]
    log, records = elastic_job(
        tmp_path_factory.mktemp(f"elastic_rejoin_{request.param}"),
        ["tests/workers/elastic_rejoin_worker.py", "--framework", framework,
         "--compression", compression], timeout=240)
    survivors = [r for r in records if r["host"] == "localhost"]
    joiner = [r for r in records if r["host"] == "127.0.0.1"]
    return framework, compression, log, records, survivors, joiner


def test_a_worker_that_comes_back_joins_and_the_job_finishes(rejoin_job):
    """Every world of the job (3, 2, 3 workers) trains; the new worker on 127.0.0.1 enters at
    step 6 and every rank of the last world ends with the same finite parameters. TensorFlow
    with DGC left out of Horovod's own state hung here (the new worker traced the step and
    started DGC's model comparison alone)."""
    _, _, log, records, survivors, joiner = rejoin_job
    assert "host 127.0.0.1 listed again at step 6" in log
    assert len(survivors) == 2 and len(joiner) == 1       # the removed worker wrote nothing
    for r in survivors:
        assert [(e["size"], e["step"]) for e in r["entries"]] == [(3, 0), (2, 3), (3, 6)]
    assert [(e["size"], e["step"]) for e in joiner[0]["entries"]] == [(3, 6)]
    finals = [r["final"] for r in records]
    assert all(f["size"] == 3 and f["finite"] and f["identical"] for f in finals)
    assert len({f["norm"] for f in finals}) == 1


def test_the_joining_worker_takes_dgcs_warm_up_position_and_the_reset_rule(rejoin_job):
    """Carried by its elastic state, DGC gives the new worker rank 0's warm-up position and
    applies the reset rule at both resets, and says nothing; left out of it, every process warns
    once at its first step, naming the state class to use, and the new worker's warm-up starts
    again (what the warning says)."""
    framework, compression, log, records, survivors, (joiner,) = rejoin_job
    if compression == "none":
        pytest.skip("dense: no DGC")
    at_join = {r["entries"][-1]["density"] for r in survivors}
    assert len(at_join) == 1 and at_join != {0.25}        # the warm-up had moved on
    warning = "no elastic state carries this DGC"
    if compression == "dgc":
        assert joiner["entries"][0]["density"] in at_join  # synchronised by the state
        assert {r["final"]["density"] for r in records} == {survivors[0]["final"]["density"]}
        assert [r["final"]["resets"] for r in survivors] == [2, 2]
        assert warning not in log
    else:
        cls = {"torch": "hvd.elastic.TorchState(model=model, optimizer=optimizer, dgc=dgc",
               "tf": "dgc_horovod.tensorflow.elastic.TensorFlowKerasState(model, optimizer, "
                     "dgc=dgc"}[framework]
        assert log.count(warning) == 4 and cls in log     # 3 first workers and the new one
        assert joiner["entries"][0]["density"] == 0.25


# ---------------------------------------------------------------- the hierarchical exchange
HIER_WORKER = "tests/workers/hierarchical_elastic_worker.py"
TWO_NODES = ("localhost:2", "127.0.0.1:2")       # Gloo places ranks by host name: 2 nodes × 2
HIER_WORLDS = {"rejoin": [(2, 2), (2, 1), (2, 2)],   # (local size L, nodes M) of each world
               "slots": [(2, 2), (1, 2), (2, 2)]}


def hier_job(tmp_path_factory, plan, ok=True):
    return elastic_job(tmp_path_factory.mktemp(f"elastic_hier_{plan}"),
                       [HIER_WORKER, "--plan", plan], timeout=400, np=4, hosts=TWO_NODES, ok=ok)


@pytest.fixture(scope="module", params=list(HIER_WORLDS))
def hier(request, tmp_path_factory):
    """tests/workers/hierarchical_elastic_worker.py, DGC(exchange="hierarchical") on 2 nodes × 2
    ranks; at step 4 rank 0 changes the discovery output (``rejoin``: 127.0.0.1 removed, one node
    of 2 ranks; ``slots``: one slot per host, 2 nodes of one rank), at step 8 lists 2 × 2 again
    (Horovod starts new workers for the slots that came back)."""
    log, records = hier_job(tmp_path_factory, request.param)
    survivors = [r for r in records if len(r["entries"]) == 3]
    joiners = [r for r in records if len(r["entries"]) == 1]
    return request.param, log, records, survivors, joiners


def test_hierarchical_job_finishes_through_both_changes_with_identical_replicas(hier):
    plan, log, records, survivors, joiners = hier
    assert "hosts now localhost:2,127.0.0.1:2 at step 8" in log
    assert len(records) == 4 and len(survivors) == 2 and len(joiners) == 2   # the removed: none
    for r in survivors:
        assert [(e["size"], e["step"]) for e in r["entries"]] == [(4, 0), (2, 4), (4, 8)]
        assert [(e["local_size"], e["cross_size"]) for e in r["entries"]] == HIER_WORLDS[plan]
    for r in joiners:
        assert [(e["size"], e["step"]) for e in r["entries"]] == [(4, 8)]
    finals = [r["final"] for r in records]
    assert sorted(f["rank"] for f in finals) == [0, 1, 2, 3]
    assert all(f["size"] == 4 and f["finite"] and f["identical"] for f in finals)
    assert len({f["norm"] for f in finals}) == 1


def test_hierarchical_reset_rebuilds_each_shard_state_for_the_new_layout(hier):
    """After each change every rank's DGC state is that of a first step from zero on its shard
    of the new layout (u = v = its node's gradient on the shard, off the sent positions): a state
    carried over from the previous world would hold m·u_old + G there. Under ``slots`` the shard
    of L = 1 is the whole tensor. The rule runs once per reset: at the first step after the
    removal (Horovod skips sync then: the entry still holds the old states), at sync after the
    addition."""
    plan, _, _, survivors, joiners = hier
    full = {"0.weight": 1280, "2.weight": 512}
    for r in survivors + joiners:
        worlds = HIER_WORLDS[plan][-len(r["fresh"]):]
        assert [(f["layout"]["local_size"], f["layout"]["nodes"]) for f in r["fresh"]] == worlds
        for f, (L, _) in zip(r["fresh"], worlds):
            assert set(f["tensors"]) == set(full)
            for name, t in f["tensors"].items():
                assert t["numel"] == t["expected_numel"] in (full[name] // L, -(-full[name] // L))
                assert t["u_equals_v"] and t["kept_is_G"] and t["sent"] > 0, (name, t)
    for r in survivors:
        assert [(e["resets"], e["nonzero_states"]) for e in r["entries"]] == \
            [(0, 0), (0, 4), (2, 0)]
        assert r["final"]["resets"] == 2
    assert [r["final"]["resets"] for r in joiners] == [0, 0]


def test_hierarchical_explicit_restore_is_bit_identical_to_the_commit(hier):
    *_, survivors, _ = hier
    for r in survivors:
        assert r["restore"] == {"moved": True, "identical_to_commit": True,
                                "layout_dropped": True, "step_after": 2}


def test_hierarchical_unequal_nodes_after_a_change_clear_error_on_every_rank(tmp_path_factory):
    """Discovery lists ``localhost:2``, ``127.0.0.1:1``: Horovod makes a world of 3 ranks on
    nodes of 2 and 1; DGC refuses it at the first step on every rank (a ValueError that names
    the nodes and the discovery script) and the job ends, no hang."""
    log, records = hier_job(tmp_path_factory, "unequal", ok=False)
    assert len(records) == 3
    for r in records:
        e = r["error"]
        assert (e["type"], e["step"], e["size"]) == ("ValueError", 4, 3)
        assert "same number of ranks" in e["message"] and "nodes of 1" in e["message"]
        assert "host discovery script" in e["message"]
        assert "final" not in r
    assert log.count("ValueError: DGC(exchange='hierarchical') needs nodes") == 3


def test_hierarchical_worker_crash_ends_the_job_in_horovods_shutdown(tmp_path_factory):
    """A known limit of Horovod 0.28.1, not DGC's: a worker on 127.0.0.1 exits at step 4. With
    process sets other than the global one (the hierarchical exchange registers them), each
    survivor's Horovod shutdown negotiates their removal over the broken Gloo context, and the
    exception escapes Horovod's background thread (std::terminate): every process ends and the
    job exits non-zero, promptly. Flat DGC recovers from the same crash, and aborts like this
    with one process set of its own added (``--exchange allgather [--process-set]``, measured:
    docs/reliability.md). If Horovod fixes it, this test fails: then assert recovery."""
    log, records = hier_job(tmp_path_factory, "exit", ok=False)
    assert "worker on 127.0.0.1 leaves at step 4" in log
    assert "terminate called after throwing an instance of 'gloo::IoException'" in log
    assert not any("final" in r for r in records)
