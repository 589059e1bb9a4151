"""DGC(exchange="hierarchical") with the stock horovod.torch.DistributedOptimizer under
`horovodrun --gloo -np 4 -H localhost:2,127.0.0.1:2`: Horovod places ranks by host name, so the
job has two nodes of two ranks (local size 2, cross size 2) on one machine.

One launch runs the scenarios of tests/workers/hierarchical_worker.py (``--mode train``); the
tests below assert on what it recorded. Short launches check the errors of a layout DGC
cannot use and of Horovod started without dynamic process sets, the process sets passed to
``hvd.init``, Horovod's reduce-scatter against the core's split and sum order, and the
degenerate layouts: one rank per node (Gloo) and one node (MPI, where one
machine is one node whatever the host names). Tensor fusion is off in the training job (``HOROVOD_FUSION_THRESHOLD=0``): with it,
where Gloo's ring cuts a fused buffer depends on which tensors were ready together, and so the
order in which 4 ranks' dense tensors are summed, which would make the resumed run differ from
the uninterrupted one in the last bit (the replicas are identical either way).
"""
import json

import pytest

from conftest import check_loss_scaler_saw_fp16_overflow, horovodrun

pytestmark = pytest.mark.horovodrun

TWO_NODES = "localhost:2,127.0.0.1:2"


def _run(tmp_path, mode, np=4, hosts=TWO_NODES, env=None):
    out = tmp_path / f"{mode}.json"
    horovodrun(["tests/workers/hierarchical_worker.py", "--mode", mode, "--out", str(out)],
               np=np, hosts=hosts, env=env)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = _run(tmp_path_factory.mktemp("hier"), "train", env={"HOROVOD_FUSION_THRESHOLD": "0"})
    assert (r["size"], r["local_size"], r["cross_size"]) == (4, 2, 2)
    return r


@pytest.mark.parametrize("exchange", ["hierarchical", "allgather"])
def test_replicas_bit_identical_and_loss_falls(run, exchange):
    r = run["train"][exchange]
    assert r["identical"] and r["changed"] and r["finite"]
    assert r["steps"] == 60
    first, last = r["loss"]
    assert last < 0.6 * first, r["loss"]


def test_hierarchical_trains_like_flat_dgc(run):
    """The same model, data and density: the loss after 60 steps within 10% of flat DGC's."""
    hier, flat = run["train"]["hierarchical"]["loss"][1], run["train"]["allgather"]["loss"][1]
    assert abs(hier - flat) < 0.1 * flat, (hier, flat)


def test_each_rank_keeps_its_shard(run):
    """Every weight sparsified under both exchanges; a rank's state is half of each (L = 2)."""
    hier = dict(run["train"]["hierarchical"]["sparse"])
    flat = dict(run["train"]["allgather"]["sparse"])
    assert {n.split(".", 2)[2]: k for n, k in hier.items()} == \
        {n.split(".", 2)[2]: k // 2 for n, k in flat.items()}


def test_bytes_across_nodes_at_most_one_over_L_of_flat(run):
    """Per step and node, the sparse payloads that came from the other node: at most 1/L of
    flat DGC's at the same density (about 1/L² of it: each node sends one selection, not L)."""
    hier = run["train"]["hierarchical"]["node_cross_received"]
    flat = run["train"]["allgather"]["node_cross_received"]
    assert 0 < hier <= flat / 2, (hier, flat)


def test_cost_model_predicts_the_measured_bytes(run):
    """dgc_horovod/core/cost.py from the model's shapes and DGC's settings alone: the bytes a
    node received from the other node per step (816 hierarchical, 2,976 allgather when
    measured), and rank 0's own counts across and inside the node."""
    from dgc_horovod.core import DGCConfig, cost
    L, M = run["local_size"], run["cross_size"]
    for exchange, model_of in (("hierarchical", cost.hierarchical_dgc_bytes),
                               ("allgather", cost.flat_dgc_bytes)):
        r = run["train"][exchange]
        cfg = DGCConfig(exchange=exchange, environ={}, **run["settings"])
        model = model_of([tuple(t) for t in r["tensors"]], cfg, cfg.compress_ratio, L, M)
        assert model["node_cross_received"] == r["node_cross_received"], (exchange, model)
        if exchange == "hierarchical":      # rank 0 is local rank 0: shard 0
            st = r["stats"]
            assert model["cross"][0] == st["cross_node_bytes"]
            assert model["cross_received"][0] == st["cross_node_received_bytes"]
            assert model["node"][0] == (st["node_bytes"], st["node_received_bytes"])
        else:
            assert model["frame"] == r["payload_bytes"]


def test_statistics_split_inside_and_across(run):
    h = run["train"]["hierarchical"]
    st = h["stats"]
    # this rank's payload went to the other node's rank of its shard; that rank's came back
    assert st["cross_node_bytes"] == h["payload_bytes"] > 0
    assert st["cross_node_received_bytes"] > 0
    # inside the node (L = 2, shards of k elements): the reduce-scatter of each sharded tensor
    # (the other shard out, the other rank's part of this one in: k each way), one int32 flag
    # per tensor each way, the decoded shards' allgather (k each way)
    k = [k for _, k in h["sparse"]]
    assert st["node_bytes"] == 4 * sum(k) + 4 * len(k) + 4 * sum(k)
    assert st["node_received_bytes"] == st["node_bytes"]        # L = 2: as much in as out
    assert st["node_bytes"] <= st["wire_bytes"]
    flat = run["train"]["allgather"]["stats"]
    assert flat["node_bytes"] == flat["cross_node_bytes"] == 0


def test_ratio_one_equals_dense_momentum_sgd(run):
    assert run["dense_max_diff"] < 1e-6


@pytest.mark.parametrize("op", ["average", "sum"])
def test_clipping_uses_the_nodes_norm_with_N_the_nodes(run, op):
    """clip_norm at density 1, momentum 0: every step's update is the paper's with the nodes as
    the workers (each node's averaged gradient clipped at C·√M, C/√M under Sum), to float32
    rounding, on bit-identical replicas; the clipping triggers on both nodes, and the wrong
    rules (N = L·M, no clipping, every rank clipping its own gradient) are far off."""
    r = run["clip"][op]
    assert r["identical"] and r["states_finite"]
    assert all(s < 0.9 for scales in r["scales"] for s in scales), r["scales"]
    assert max(r["err"]) < 1e-5, r["err"]
    for wrong in ("wrong_n", "unclipped", "per_rank"):
        assert min(r[wrong]) > 100 * max(r["err"]) and min(r[wrong]) > 1e-3, (wrong, r[wrong])


@pytest.mark.parametrize("key", ["nonfinite", "nonfinite_clip"])
def test_nonfinite_step_poisons_nothing(run, key):
    r = run[key]
    assert r["skipped"] == [step == 3 for step in range(8)]
    assert r["identical"] and r["params_finite"] and r["states_finite"]
    assert r["nonfinite_tensors"] > 0


def test_nonfinite_element_in_one_shard_is_agreed_by_the_node(run):
    """One NaN element in rank 1's gradient, in shard 1: after the reduce-scatter only rank 1
    sees it, the node's flags make rank 0 (its shard finite) skip the tensor too: that step
    accumulated nothing into u or v on node 0 (ranks 0, 1; without the flags rank 0 does), while
    node 1, whose gradient was finite, accumulated it as any worker does (what it sent put
    back); the update is NaN everywhere."""
    r = run["nonfinite_shard"]
    assert r["skipped"] == [step == 3 for step in range(8)]
    assert r["identical"] and r["params_finite"] and r["states_finite"]
    assert r["unchanged"] == [True, True, False, False] and r["changed_before"] == [True] * 4


def test_fp16_overflow_skips_the_step_everywhere(run):
    """A float16 value beyond range in one shard makes the whole update non-finite on every
    rank: the loss scaler skips the step alike everywhere and backs off."""
    _, overflowed = check_loss_scaler_saw_fp16_overflow(run["fp16_overflow"])
    assert sum(overflowed) > 0


def test_checkpoint_holds_the_shard_and_refuses_another_layout(run):
    r = run["checkpoint"]
    assert r["layout"] == {"local_size": 2, "nodes": 2, "shard": 0, "shards": "reducescatter"}
    assert r["numels"] == {"ck.fc1.weight": 4096, "ck.fc2.weight": 640, "ck.aux.weight": 640}
    assert "node layout" in r["refused"] and "reset_residuals=True" in r["refused"]
    assert r["resumed_equal"]
    # a flat exchange's checkpoint: refused for its config (not its missing layout), with the
    # switch named; loaded with reset_residuals=True, the step count goes on and replicas agree
    assert "exchange differ" in r["flat_refused"] and "node layout" not in r["flat_refused"]
    assert "to change exchange and keep the warm-up position" in r["flat_refused"]
    assert r["switched"]["steps"] == 2 + 3 and r["switched"]["finite"]
    assert r["switched"]["identical"]


@pytest.mark.parametrize("L", [3, 4])
def test_reducescatter_splits_and_adds_as_the_core_says(tmp_path, L):
    """Horovod's reduce-scatter over L ranks (one host, Gloo) of a tensor L does not divide:
    each rank gets shard_bounds' shard, summed bit for bit as node_sum adds (L = 4: not in rank
    order), and op=Average is that sum times 1/L."""
    out = tmp_path / "rs.json"
    horovodrun(["tests/workers/reducescatter_worker.py", "--out", str(out)], np=L)
    facts = json.loads(out.read_text())
    assert len(facts) == L
    for f in facts:
        assert f["numel"] == f["shard"] and f["node_sum"] and f["average"], f
    assert [f["shard"] for f in facts] == [4097] * (L - 1) + [4096]
    assert all(f["rank_order"] for f in facts) == (L == 3)


def test_unequal_nodes_clear_error(tmp_path):
    r = _run(tmp_path, "plain", np=3, hosts="localhost:2,127.0.0.1:1")
    assert (r["local_size"], r["cross_size"]) == (2, 2)
    assert len(set(r["errors"])) == 1
    assert "same number of ranks" in r["errors"][0] and "ranks [2] on nodes of 1" in r["errors"][0]


def test_without_dynamic_process_sets_clear_error(tmp_path):
    r = _run(tmp_path, "static")
    assert len(set(r["errors"])) == 1
    assert "process_sets='dynamic'" in r["errors"][0]


def test_one_rank_on_another_exchange_clear_error(tmp_path):
    """Rank 0 hierarchical, the others allgather: the ranks compare their settings before the
    hierarchical exchange makes its first collective, so every rank raises, none hangs."""
    r = _run(tmp_path, "mismatch")
    assert "exchange: 'hierarchical' here, 'allgather' on rank 1" in r["errors"][0]
    for e in r["errors"][1:]:
        assert "exchange: 'allgather' here, 'hierarchical' on rank 0" in e


def test_process_sets_given_to_init(tmp_path):
    r = _run(tmp_path, "given")
    assert r["errors"] == [None] * 4
    assert r["identical"] and r["changed"]


@pytest.mark.parametrize("launcher,hosts,layout", [
    ("gloo", "localhost:1,127.0.0.1:1", (1, 2)),     # one rank per node: DGC across nodes only
    ("mpi", "localhost:2", (2, 1)),                  # one node: no traffic across nodes
], ids=["gloo-1x2", "mpi-2x1"])
def test_degenerate_layouts_train(tmp_path, launcher, hosts, layout):
    out = tmp_path / "plain.json"
    horovodrun(["tests/workers/hierarchical_worker.py", "--mode", "plain", "--out", str(out)],
               np=2, hosts=hosts, launcher=launcher)
    r = json.loads(out.read_text())
    assert (r["local_size"], r["cross_size"]) == layout
    assert r["errors"] == [None, None] and r["identical"] and r["changed"]
