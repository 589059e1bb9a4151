"""DGC with the stock horovod.torch.DistributedOptimizer under `horovodrun -np 2` (Gloo and MPI).

One launch per controller runs every scenario of tests/workers/torch_worker.py; the tests below
assert on what it recorded and, for Gloo, on Horovod's own timeline of the collectives.
"""
import json
import math
import os

import numpy as np
import pytest

from conftest import (check_loss_scaler_saw_fp16_overflow, check_warned_once, horovodrun,
                      read_timeline)

pytestmark = pytest.mark.horovodrun

DTYPE_BYTES = {"int32": 4, "float32": 4}


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    out, timeline = tmp / "results.json", tmp / "timeline.json"
    horovodrun(["tests/workers/torch_worker.py", "--out", str(out)], launcher=request.param,
               env={"HOROVOD_TIMELINE": str(timeline)})
    return json.loads(out.read_text()), read_timeline(timeline)


@pytest.mark.parametrize("variant", ["set_to_none", "zero_grad_false", "backward_passes_2",
                                     "groups_2", "all_sparse", "per_tensor_allgather",
                                     "small_buckets", "global_clip"])
def test_parameters_bit_identical_after_20_steps(run, variant):
    r = run[0]["identical"][variant]
    assert r["identical"], "ranks diverged"
    assert r["changed"] and r["finite"]
    assert r["steps_counted"] == 20
    # aux.* has no gradient on odd steps; its state exists all the same (Horovod sends zeros)
    assert len(r["states"]) == 6
    if variant in ("all_sparse", "small_buckets"):    # min_sparse_numel=1: biases too
        assert r["sparse"] == r["states"]
        return
    assert [n.rsplit(".", 2)[-2:] for n in r["sparse"]] == [["aux", "weight"], ["fc1", "weight"],
                                                           ["fc2", "weight"]]
    # density 0.01: k = 82 + 13 + 13 = 108, sent unless fewer entries reach the lower sampled
    # threshold (dgc_horovod/core/sparsify.py)
    assert 0 < r["selected_last_step"] <= 108


@pytest.mark.parametrize("layout", ["buckets", "per_tensor", "small"])
def test_every_engine_trains_bit_identically(run, layout):
    """DGC(engine=...) with the C kernels, the Triton kernels (on CPU tensors under Triton's
    interpreter) and tensor ops: the same parameters after 6 steps, bit for bit, on every rank
    (the Triton engine's bucket decode, DGCCore.decompress_bucket, in buckets)."""
    r = run[0]["engines"]
    base = r[f"{layout}.c"]
    assert base["identical"] and base["selected"] > 0
    pytest.importorskip("triton")           # (requirements.txt installs it)
    for engine in ("triton", "ops"):
        got = r[f"{layout}.{engine}"]
        assert got["identical"]
        assert got["params"] == base["params"], f"{engine} differs from the C engine"
        assert got["selected"] == base["selected"]


@pytest.mark.parametrize("variant", ["set_to_none", "zero_grad_false", "per_tensor_allgather",
                                     "all_sparse", "small_buckets"])
def test_sparsified_update_comes_back_in_the_gradients_own_storage(run, variant):
    """decompress writes a sparsified float32 gradient's update into the storage backward filled
    (no new dense tensor per gradient per step); dense tensors keep Horovod's own path."""
    r = run[0]["identical"][variant]["grad_storage"]
    assert r["sparse"] and all(r["sparse"]), r


@pytest.mark.parametrize("case", ["momentum_correction", "nesterov", "masking_equals_plain_sgd"])
def test_ratio_one_equals_dense_sgd(run, case):
    assert run[0]["equivalence"][case] < 1e-6


def test_wire_bytes_match_statistics(run):
    results, timeline = run
    w = results["wire"]
    sparse = set(w["sparse"])
    gathered = [(n, d, s) for n, d, s in timeline if n.startswith("allgather.dgc.bucket.wire.")]
    reduced = [(n, d, s) for n, d, s in timeline if n.startswith("allreduce.wire.")]
    # the default bucket (2**22 elements) holds the whole model: one allgather per step, named
    # after its first member (the last registered parameter)
    assert {n for n, _, _ in gathered} == {"allgather.dgc.bucket.wire.aux.bias"}
    assert len(gathered) == 5
    assert len(reduced) == 5 * len(w["numel"])          # Horovod's own allreduce, every tensor
    for name, dtype, shape in reduced:
        tensor = name[len("allreduce."):]
        if tensor in sparse:
            assert shape == [1], f"{name} carried {shape}, not the 1-element placeholder"
        else:
            assert math.prod(shape) == w["numel"][tensor]
    allgather_bytes = sum(DTYPE_BYTES[d] * math.prod(s) for _, d, s in gathered)
    allreduce_bytes = sum(DTYPE_BYTES[d] * math.prod(s) for _, d, s in reduced)
    size = results["size"]
    # every rank sends its payload once (the allgather output is the concatenation) and its
    # allreduce input once: the per-rank statistics must add up to exactly that
    assert sum(r["wire_bytes"] for r in w["per_rank"]) == allgather_bytes + size * allreduce_bytes
    ratio = w["per_rank"][0]["dense_bytes"] / w["per_rank"][0]["wire_bytes"]
    assert ratio > 20
    # what each rank received: the allgather's output but its own input, and the allreduce's
    # output (the size of its input)
    assert sum(r["received_bytes"] for r in w["per_rank"]) == (
        (size - 1) * allgather_bytes + size * allreduce_bytes)


@pytest.mark.parametrize("mode", ["bucketed", "per_tensor", "gated"])
def test_each_rank_receives_what_the_other_sent(run, mode):
    """2 ranks: a rank receives the other's payloads (as the allgather returns them) and the
    allreduce's result, which is the same size as its own input: so its received_bytes equal
    the other rank's wire_bytes, per step and in total, in every exchange mode."""
    w = run[0]["wire"]
    per_rank = w["per_rank"] if mode == "bucketed" else w[mode]
    for me, other in ((0, 1), (1, 0)):
        a, b = per_rank[me], per_rank[other]
        assert a["steps"] == 5 and a["received_bytes"] > 0
        assert a["received_bytes"] == b["wire_bytes"]
        assert a["last_step"][1] == b["last_step"][0]
        assert a["received_ratio"] == pytest.approx(a["dense_bytes"] / a["received_bytes"])
        assert a["ratio"] == pytest.approx(a["dense_bytes"] / a["wire_bytes"])


def test_nonfinite_step_skipped_on_every_rank_state_clean(run):
    r = run[0]["nonfinite"]
    assert r["skipped"] == [False, False, False, True, False, False, False, False]
    assert r["states_finite"] and r["params_finite"] and r["identical"]


def test_fp16_overflow_makes_grad_scaler_back_off_on_every_rank(run):
    """wire_values="float16" with torch.amp.GradScaler at a loss scale too large for float16:
    a step is skipped exactly when some rank's selected values overflowed (sent as ±inf), the
    scale is halved identically on every rank until DGC's values fit, training then resumes,
    and the replicas stay bit-identical with finite parameters, u and v."""
    ranks, overflowed = check_loss_scaler_saw_fp16_overflow(run[0]["fp16_overflow"])
    assert sum(rr["overflowed_entries"] for rr in ranks) == sum(overflowed) > 0
    assert all(rr["nonfinite_tensors"] == 0 for rr in ranks)     # the gradients were finite
    assert all("'fp16." in w for rr in ranks for w in rr["warnings"])   # names the tensor


def test_momentum_in_both_places_is_an_error_and_the_optimizer_goes_on(run):
    """Refused at the step's first gradient for a parameter whose gradient comes last (every
    reduced parameter is checked then); the same Horovod optimizer trains once it is fixed."""
    for variant in ("", "_passes2", "_groups"):      # 2 backward passes; Horovod's groups=
        key, name = "momentum_twice" + variant, f"'mt{variant}.fc1.weight'"
        msg = run[0][key]
        assert msg is not None and "momentum would be applied twice" in msg
        assert "momentum=0" in msg and name in msg, msg
        assert run[0][key + "_then_trained"] == {"changed": True, "identical": True}


def test_adam_with_dgc_momentum_warns_once(run):
    check_warned_once(run[0]["adam_warning"], "0.9", "0.0", "DGC(momentum=0)")


def test_weight_decay_in_dgc_and_the_optimizer_warns_once(run):
    """Momentum set twice is refused; weight decay set twice decays twice, which a run may mean
    (docs/usage.md): one warning per rank, naming both and what to do."""
    check_warned_once(run[0]["weight_decay_warning"], "0.0001", "0.0",
                      "DGC(weight_decay=0.0001)", "SGD's weight_decay=0.0001", "weight_decay=0",
                      "'adamwd0.0001.")


def test_models_differing_across_ranks_is_a_clear_error(run):
    msg = run[0]["model_mismatch"]
    assert msg is not None and "models differ" in msg and "'mm.aux.weight'" in msg, msg


def test_dgc_settings_differing_across_ranks_is_a_clear_error(run):
    """Not a hang (bucket_numel, exchange), not Horovod's shape error (min_sparse_ndim)."""
    for option, (mine, theirs) in {"bucket_numel": ("4194304", "0"),
                                   "exchange": ("'allgather'", "'regions'"),
                                   "min_sparse_ndim": ("2", "1")}.items():
        errors = run[0]["config_mismatch"][option]
        assert len(errors) == 2 and all(e is not None and "configs differ" in e for e in errors)
        assert f"{option}: {mine} here, {theirs} on rank 1" in errors[0], errors[0]
        assert f"{option}: {theirs} here, {mine} on rank 0" in errors[1], errors[1]


def test_adasum_and_a_shared_dgc_object_are_refused(run):
    r = run[0]["misuse"]
    assert r["adasum"] is not None and "Adasum" in r["adasum"], r["adasum"]
    assert r["shared"] is not None and "two DistributedOptimizers" in r["shared"], r["shared"]


def test_state_dict_in_the_middle_of_a_step_is_refused_with_when_to_save(run):
    r = run[0]["misuse"]
    for key in ("mid_step", "mid_step_dense_only"):     # sparse buckets, or dense tensors only
        assert r[key] is not None and "middle of a step" in r[key], r[key]
        assert "after optimizer.step()" in r[key]
        assert r[key + "_after"]


def test_an_uncalled_factory_or_the_class_as_compression_says_the_right_line(run):
    r = run[0]["misuse"]
    assert r["factory"] is not None and "dgc = Compression.dgc(compress_ratio" in r["factory"]
    assert r["class"] is not None and "dgc = DGC(compress_ratio" in r["class"]


STEP_MODES = ("buckets", "gated", "per_tensor")


def test_step_after_synchronize_without_skip_synchronize_is_refused(run):
    r = run[0]["step_patterns"]
    for mode in STEP_MODES:
        msg = r[f"resync_{mode}"]
        assert msg is not None and "second time" in msg and "skip_synchronize()" in msg, msg
        # a step skipped after synchronize() (GradScaler on inf) is not mistaken for it
        assert r[f"skipped_{mode}"] == {"error": None, "identical": True}, r[f"skipped_{mode}"]


def test_a_layer_frozen_after_wrapping_the_optimizer_trains_as_with_dense_horovod(run):
    r = run[0]["step_patterns"]
    for mode in STEP_MODES:
        assert r[f"freeze_{mode}"] == {"error": None, "identical": True,
                                       "fc1_unchanged": True}, (mode, r[f"freeze_{mode}"])


BUCKETS = {   # the sparsified members of each bucket, in member order (see torch_worker.Net)
    "default": [["aux.weight", "fc2.weight", "fc1.weight"]],         # biases dense, one bucket
    "small_buckets": [["aux.bias", "aux.weight", "fc2.bias", "fc2.weight"],
                      ["fc1.bias", "fc1.weight"]],                    # bucket_numel=1500
}


@pytest.mark.parametrize("variant", sorted(BUCKETS))
def test_each_bucket_is_compressed_in_one_compress_many_call_per_step(run, variant):
    runs = run[0]["compress_many"]
    r = runs[variant]
    per_step = {}
    for call in r["calls"]:
        per_step.setdefault(call["step"], []).append(call["names"])
    assert sorted(per_step) == list(range(20))
    for step, calls in per_step.items():
        assert sorted(calls) == sorted(BUCKETS[variant]), f"step {step}: {calls}"
    # no sparsified tensor is compressed one by one; the dense ones are, once per step each
    assert not set(r["direct"]) & set(r["sparse"]), r["direct"]
    assert r["direct_count"] == 20 * len(r["direct"])
    assert runs[variant + "_per_tensor"]["calls"] == []     # bucket_numel=0: compress per tensor
    # a bucket whose members all have a gradient is compressed (and sent) during backward; aux.*
    # have none on odd steps: Horovod hands DGC their zeros in synchronize, which completes it
    for call in r["calls"]:
        late = call["step"] % 2 == 1 and "aux.weight" in call["names"]
        assert call["where"] == ("synchronize" if late else "backward"), call


@pytest.mark.parametrize("variant", sorted(BUCKETS))
def test_bucketed_training_equals_per_tensor_mode_bit_for_bit(run, variant):
    # exact top-k: the results do not depend on the order tensors are compressed in
    runs = run[0]["compress_many"]
    r = runs[variant]
    assert r["identical"] and runs[variant + "_per_tensor"]["identical"], "ranks diverged"
    assert r["steps_counted"] == 20
    assert r["equals_per_tensor"], f"max |difference| {r['max_diff_per_tensor']}"


def test_bucketed_sampled_selection_trains_identically_on_every_rank(run):
    r = run[0]["compress_many"]["default_sampled"]
    assert r["identical"] and r["steps_counted"] == 20
    assert [len(c["names"]) for c in r["calls"]] == [3] * 20
