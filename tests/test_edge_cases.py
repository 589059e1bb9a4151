"""Edge shapes, dtypes, sparse embeddings and GradScaler with DGC under `horovodrun -np 2` (Gloo).

One launch runs every scenario of tests/workers/edge_worker.py (10 steps each, default DGC
settings with warmup_epochs=0 and compress_ratio=0.01, so every parameter is sparsified).
"""
import json

import pytest

from conftest import horovodrun

pytestmark = pytest.mark.horovodrun

TRAINED = ["edge", "fp16", "bf16", "sparse", "sparse_as_dense"]
DTYPE = {"edge": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16",
         "sparse": "torch.float32", "sparse_as_dense": "torch.float32"}
PREFIX = {"edge": "edge", "fp16": "fp16", "bf16": "bf16", "sparse": "sparse",
          "sparse_as_dense": "sad"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("edge") / "results.json"
    horovodrun(["tests/workers/edge_worker.py", "--out", str(out)], launcher="gloo")
    return json.loads(out.read_text())


@pytest.mark.parametrize("scenario", TRAINED)
def test_bit_identical_finite_and_trained(results, scenario):
    r = results[scenario]
    assert "error" not in r, r.get("error")
    assert r["identical"], "ranks diverged"
    assert r["finite"] and r["states_finite"]
    assert r["dtypes"] == [DTYPE[scenario]]
    assert r["steps_counted"] == 10 and r["nonfinite_tensors"] == 0
    # every parameter moved: the scalar, the 1-element one, the tied embedding, the layer used on
    # even steps only, and the sparse embedding
    assert all(r["changed"].values()), r["changed"]


@pytest.mark.parametrize("scenario", ["edge", "fp16", "bf16"])
def test_scalar_one_element_tied_and_rare_parameters_have_one_state_each(results, scenario):
    p = PREFIX[scenario]
    states = results[scenario]["states"]
    assert states[f"{p}.scale"] == 1 and states[f"{p}.gain"] == 1     # shape () and (1,)
    assert states[f"{p}.emb.weight"] == 800                           # tied: one state, once
    assert f"{p}.rare.weight" in states                               # no gradient on odd steps
    assert len(states) == 8


def test_sparse_embedding_bypasses_dgc(results):
    r = results["sparse"]
    assert r["grad_kinds"] == ["dense", "sparse"]
    assert "sparse.emb.weight" not in r["states"]       # Horovod's sparse allreduce carried it
    assert len(r["states"]) == 8


def test_sparse_as_dense_embedding_is_compressed(results):
    r = results["sparse_as_dense"]
    assert r["states"]["sad.emb.weight"] == 800
    assert len(r["states"]) == 9


def test_grad_scaler_overflow_on_one_rank_skips_step_everywhere(results):
    r = results["amp"]
    assert "error" not in r, r.get("error")
    assert r["stepped"] == [True, True, True, False] + [True] * 6
    assert r["scales"] == [1024.0] * 3 + [512.0] * 7
    assert r["same_on_every_rank"]                      # scale history and skips, every rank
    assert r["nonfinite_tensors"] > 0                   # the overflow did go through DGC
    assert r["states_finite"] and r["identical"] and r["finite"]
