"""DGC(exchange="regions") with the stock horovod.torch.DistributedOptimizer under
`horovodrun -np 2` and `-np 3` (regions of uneven sizes), Gloo and MPI.

One launch per (controller, N) runs every scenario of tests/workers/regions_worker.py; the tests
below assert on what it recorded.
"""
import json

import pytest

from conftest import horovodrun

pytestmark = pytest.mark.horovodrun

JOBS = [("gloo", 2), ("gloo", 3), ("mpi", 2), ("mpi", 3)]
MODES = ["bucketed", "small_buckets", "per_tensor", "gated", "float16", "int32_index"]


@pytest.fixture(scope="module", params=JOBS, ids=[f"{c}-np{n}" for c, n in JOBS])
def run(request, tmp_path_factory):
    launcher, np = request.param
    out = tmp_path_factory.mktemp(f"{launcher}{np}") / "results.json"
    horovodrun(["tests/workers/regions_worker.py", "--out", str(out)], np=np, launcher=launcher)
    results = json.loads(out.read_text())
    assert results["size"] == np
    return results


@pytest.mark.parametrize("mode", MODES)
def test_parameters_bit_identical_after_20_steps(run, mode):
    r = run["identical"][mode]
    assert r["identical"], "ranks diverged"
    assert r["changed"] and r["finite"]
    assert r["steps_counted"] == 20 and r["nonfinite_tensors"] == 0
    weights = [f"id.{mode}.{t}.weight" for t in ("aux", "fc1", "fc2")]
    if mode == "small_buckets":           # min_sparse_numel=1: biases too (10 elements, 3 ranks)
        weights += [f"id.{mode}.{t}.bias" for t in ("aux", "fc1", "fc2")]
    assert r["sparse"] == sorted(weights)


@pytest.mark.parametrize("mode", ["bucketed", "per_tensor", "gated"])
def test_ratio_one_equals_dense_momentum_sgd(run, mode):
    """Density 1: each owner keeps every non-zero sum of its region, so the update is the full
    average, as with Horovod's dense allreduce."""
    assert run["equivalence"][mode] < 1e-6


@pytest.mark.parametrize("variant", ["bucketed", "per_tensor", "small_buckets", "gated",
                                     "bucketed_nan", "per_tensor_nan", "small_buckets_nan",
                                     "gated_nan"])
def test_nothing_is_lost(run, variant):
    """Σ over ranks and steps of the gradients = Σ_r v_r + N·(w_0 − w_T)/lr: what an owner drops
    is back in its residual, what a NaN step carried is back where it came from."""
    r = run["conservation"][variant]
    assert r["dropped"] > 0, "no owner dropped anything: the check would be trivial"
    assert r["worst"] <= 1e-5 * r["scale"], r
    assert r["identical"] and r["states_finite"]
    assert r["skipped"] == [variant.endswith("_nan") and step == 3 for step in range(10)]


@pytest.mark.parametrize("mode", ["bucketed", "per_tensor", "gated"])
def test_nonfinite_step_skipped_on_every_rank_state_clean(run, mode):
    r = run["nonfinite"][mode]
    assert r["skipped"] == [False, False, False, True, False, False, False, False]
    assert all(every == r["skipped"] for every in r["all_nan"])     # every tensor, every rank
    assert r["states_finite"] and r["params_finite"] and r["identical"]


def _allreduced_bytes(tensors, gated):
    """Bytes per step that Horovod's allreduce carries each way for DGC's tensors (a sparsified
    tensor's 1-element float32 placeholder, a dense tensor's velocity; gated: DGC allreduces
    the dense ones itself and Horovod's allreduce carries a placeholder for them too)."""
    return sum(4 if sparse else 4 * numel + (4 if gated else 0)
               for numel, sparse in tensors.values())


@pytest.mark.parametrize("mode", ["bucketed", "small_buckets", "per_tensor", "gated"])
def test_wire_bytes_match_what_the_collectives_moved(run, mode):
    """wire_bytes = what this rank's alltoall sent to the other ranks + its allgather input
    (+ the allreduce); received_bytes = the alltoall's output but its own part + the allgather's
    output but its own input (+ the allreduce), counted from the collectives' real inputs and
    outputs on each rank."""
    ranks, size = run["wire"][mode], run["size"]
    steps = ranks[0]["steps"]
    assert steps == 5
    buckets = {"small_buckets": 2, "per_tensor": 3}.get(mode, 1)
    for r in ranks:
        assert r["calls"] == {"alltoall": steps * buckets, "allgather": steps * buckets}
        dense = steps * _allreduced_bytes(r["tensors"], mode == "gated")
        assert r["wire_bytes"] == 4 * sum(r["sent_words"].values()) + dense
        assert r["received_bytes"] == 4 * sum(r["received_words"].values()) + dense
        assert 0 < r["last_step"][0] < r["wire_bytes"]
    # the collectives agree across ranks: the alltoall delivers what was sent, the allgather
    # hands every input to the N − 1 other ranks
    assert sum(r["sent_words"]["alltoall"] for r in ranks) == \
        sum(r["received_words"]["alltoall"] for r in ranks) > 0
    assert sum(r["received_words"]["allgather"] for r in ranks) == \
        (size - 1) * sum(r["sent_words"]["allgather"] for r in ranks) > 0
