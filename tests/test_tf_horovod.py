"""DGC with stock horovod.tensorflow under `horovodrun -np 2` (Gloo and MPI), tf-keras.

One launch per controller runs the scenarios of tests/workers/tf_worker.py; a separate Gloo launch
runs the wire scenario alone so that Horovod's timeline holds only its collectives.
"""
import json
import math

import pytest

from conftest import (check_loss_scaler_saw_fp16_overflow, check_warned_once, horovodrun,
                      read_timeline)

pytestmark = pytest.mark.horovodrun

TF_ENV = {"TF_USE_LEGACY_KERAS": "1"}


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tf_" + request.param) / "results.json"
    horovodrun(["tests/workers/tf_worker.py", "--out", str(out)], launcher=request.param,
               env=TF_ENV)
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["eager", "function", "function_host", "function_tf_ops"])
def test_variables_identical_after_20_steps(run, mode):
    r = run["identical"][mode]
    assert r["identical"] and r["changed"] and r["steps"] == 20
    assert r["states"] == ["fc1/bias:0", "fc1/kernel:0", "fc2/bias:0", "fc2/kernel:0"]
    assert r["sparse"] == ["fc1/kernel:0", "fc2/kernel:0"]


@pytest.mark.parametrize("case", ["momentum_correction", "nesterov", "masking_equals_plain_sgd",
                                  "momentum_correction_host", "momentum_correction_tf_ops"])
def test_ratio_one_equals_dense_sgd(run, case):
    assert run["equivalence"][case] < 1e-6


def test_indexed_slices_keep_horovods_path_unless_sparse_as_dense(run):
    plain, dense = run["indexed_slices"]["False"], run["indexed_slices"]["True"]
    assert plain["identical"] and dense["identical"]
    assert "emb/embeddings:0" not in plain["states"]      # Horovod's own allgather path
    assert "emb/embeddings:0" in dense["sparse"]          # sparse_as_dense: DGC compresses it


def test_nonfinite_step_skipped_on_every_rank_state_clean(run):
    r = run["nonfinite"]
    assert r["skipped"] == [False, False, False, True, False, False, False, False]
    assert r["states_finite"] and r["identical"]


def test_fp16_overflow_makes_loss_scale_optimizer_back_off_on_every_rank(run):
    """The same rule as PyTorch's (one core): tf-keras's LossScaleOptimizer skips exactly the
    steps where some rank's float16 values overflowed, backs off, and training resumes."""
    ranks, _ = check_loss_scaler_saw_fp16_overflow(run["fp16_overflow"])
    assert all("'fc" in w for rr in ranks for w in rr["warnings"])       # names the tensor


def test_checkpoint_of_other_names_is_refused_at_the_first_step(run):
    r = run["checkpoint_misfit"]
    msg = r["error_False"]
    assert msg is not None and "does not fit" in msg and "reset_residuals=True" in msg, msg
    assert "'fc1/bias:0', 'fc1/kernel:0', 'fc2/bias:0' and 1 more" in msg
    assert "'head1/bias:0'" in msg
    assert not r["changed_False"]
    assert r["saved_False"] == ["fc1/bias:0", "fc1/kernel:0", "fc2/bias:0", "fc2/kernel:0"]
    assert r["error_True"] is None and r["changed_True"]
    assert r["saved_True"] == ["head1/bias:0", "head1/kernel:0", "head2/bias:0", "head2/kernel:0"]
    assert r["same_objects_changed"] and r["same_objects_saved"] == r["saved_True"]
    for in_graph in (True, False):     # a resized hidden layer: every size named at once
        msg = r[f"resized_error_{in_graph}"]
        assert msg is not None and "3 saved tensor state(s) have another size than the " \
            "parameter ('fc1/bias:0': 128 elements saved, 96 now, 'fc1/kernel:0': 8192 " \
            "elements saved, 6144 now, 'fc2/kernel:0': 1280 elements saved, 960 now)" in msg, msg


def test_keras_weight_decay_in_dgc_and_the_optimizer_warns_once(run):
    check_warned_once(run["keras_weight_decay_twice"], "0.0001", "None",
                      "DGC(weight_decay=0.0001)", "SGD's weight_decay=0.0001",
                      "to 'fc1/kernel:0'", "weight_decay=0")


def test_keras_adam_with_dgc_momentum_warns_once(run):
    """As in PyTorch (tests/test_torch_horovod.py): one warning per rank, none with
    DGC(momentum=0)."""
    check_warned_once(run["keras_adam_warning"], "0.9", "0.0",
                      "Adam keeps its own moment estimates", "DGC(momentum=0)")


def test_keras_fit_with_warmup_callback(run):
    r = run["keras_fit"]
    assert r["identical"] and r["steps"] == 3 * 128 // 16
    assert r["density"] == pytest.approx([0.25, 0.05, 0.01])     # 0.25 → 0.01 over 2 epochs
    assert r["ratio"][0] < r["ratio"][1] < r["ratio"][2]
    assert r["sparse"] == ["fc1/kernel:0", "fc2/kernel:0"]


def test_global_clipping_and_separate_weight_decay_match_dense_transcriptions(run):
    r = run["semantics"]
    assert r["clipped_steps"] >= 4                  # the threshold C·√N clips in most steps
    assert r["clip_global"] < 1e-6
    assert r["weight_decay_separate"] < 1e-6
    assert r["sparse"] == ["fc1/kernel:0", "fc2/kernel:0"]        # biases (1-D) go dense
    assert r["wd_buffers"] == ["fc1/bias:0", "fc1/kernel:0", "fc2/bias:0", "fc2/kernel:0"]


@pytest.mark.parametrize("case", ["default", "nesterov_wd"])
def test_buckets_equal_one_allgather_per_tensor_bit_for_bit(run, case):
    """bucket_numel=0 (one allgather per tensor), the default (one bucket here) and 5000 (two
    buckets): the same parameters and states bit for bit, a NaN step skipped alike; each
    bucket's framing costs 12 bytes per step for its first member, 4 for each other one."""
    r = run["buckets"][case]
    for b in ("0", "4194304", "5000"):
        assert r[b]["same_params"] and r[b]["same_states"] and r[b]["identical"], b
        assert r[b]["skipped"] == [False, False, False, True, False, False, False, False]
        assert r[b]["selected"] == r["0"]["selected"]
    steps = 8
    for b, framing in (("4194304", 12 + 4), ("5000", 12 + 12)):
        assert r[b]["wire"] - r["0"]["wire"] == steps * framing
        assert r[b]["received"] - r["0"]["received"] == steps * framing


def test_keras_momentum_in_both_places_is_an_error(run):
    for key in ("", "_legacy"):     # tf.keras.optimizers.legacy.SGD too (it crashed)
        msg = run[f"keras_momentum{key}_0.9"]
        assert msg is not None and "momentum would be applied twice" in msg, msg
        assert run[f"keras_momentum{key}_0.0"] is None


@pytest.mark.parametrize("scenario", ["wire", "wire_per_tensor", "wire_host"])
def test_wire_bytes_match_statistics(tmp_path, scenario):
    """The statistics count exactly the bytes of Horovod's collectives in its timeline. In the
    graph (default) a sparsified tensor's placeholder allreduce is pruned by TensorFlow (its
    result is unused), so only its allgather runs: one per bucket (this model's two sparsified
    tensors share one, named after the first), or with bucket_numel=0 one per tensor; with
    in_graph=False (wire_host) one per tensor, and the placeholder goes through Horovod's
    allreduce, 4 bytes each way."""
    out, timeline = tmp_path / "results.json", tmp_path / "timeline.json"
    horovodrun(["tests/workers/tf_worker.py", "--out", str(out), "--scenarios", scenario],
               env=dict(TF_ENV, HOROVOD_TIMELINE=str(timeline)))
    w = json.loads(out.read_text())[scenario]
    events = read_timeline(timeline)
    steps = 5
    # named HorovodAllgather_DGC_<variable>: hvd.elastic.run must recognize a failure of it
    gathered = [(n, s) for n, d, s in events if "HorovodAllgather_DGC_" in n]
    if scenario == "wire":
        assert all(n.endswith("HorovodAllgather_DGC_bucket.fc1_kernel_0") for n, _ in gathered)
        assert len(gathered) == steps
    else:
        assert len(gathered) == steps * len(w["sparse"])
    reduced = [(n, s) for n, d, s in events
               if "DistributedGradientTape_Allreduce" in n and "HorovodAllreduce" in n]
    placeholders = [s for _, s in reduced if s == [1]]
    with_placeholders = scenario == "wire_host"
    assert len(placeholders) == steps * len(w["sparse"]) * with_placeholders  # O(1) per tensor
    assert len(reduced) == steps * (len(w["numel"]) - len(w["sparse"]) * (not with_placeholders))
    dense = sorted(math.prod(s) for _, s in reduced if s != [1])
    small = [n for n in w["numel"] if n not in w["sparse"]]
    assert dense == sorted(w["numel"][n] for n in small for _ in range(steps))
    allgather_bytes = 4 * sum(math.prod(s) for _, s in gathered)
    allreduce_bytes = 4 * sum(math.prod(s) for _, s in reduced)
    assert sum(r["wire_bytes"] for r in w["per_rank"]) == allgather_bytes + 2 * allreduce_bytes
    # received: the other rank's payloads (the allgather's output but the own input) and the
    # allreduce's output; with 2 ranks exactly what the other rank sent
    assert sum(r["received_bytes"] for r in w["per_rank"]) == allgather_bytes + 2 * allreduce_bytes
    for me, other in ((0, 1), (1, 0)):
        a, b = w["per_rank"][me], w["per_rank"][other]
        assert a["received_bytes"] == b["wire_bytes"] > 0
        assert a["last_step"][1] == b["last_step"][0]


def test_dgc_made_inside_the_traced_step_is_refused_and_the_pattern_trains(run):
    """Horovod's GradientTape example with its compressor chosen inside the tf.function: a clear
    error at the first step on every rank (not TensorFlow's words, not one DGC per trace);
    made once outside, the same step, traced twice, trains one DGC with identical replicas."""
    inside, outside = run["made_in_trace"]["inside"], run["made_in_trace"]["outside"]
    assert inside["done"] == 0 and "inside a tf.function" in inside["error"], inside
    assert "compression=dgc" in inside["error"] and not inside["changed"]
    assert outside["error"] is None and outside["done"] == 6 and outside["traces"] >= 2
    assert outside["steps"] == 6 and outside["identical"] and outside["changed"]
    assert outside["states"] == ["fc1/bias:0", "fc1/kernel:0", "fc2/bias:0", "fc2/kernel:0"]
    # tf.config.run_functions_eagerly(True), a debugging switch: the in-graph path says what to
    # do at the first step (it failed with TensorFlow's 'Tensor.graph is undefined'), and
    # in_graph=False, which that message names, trains
    eagerly, host = run["made_in_trace"]["eagerly"], run["made_in_trace"]["eagerly_host"]
    assert eagerly["done"] == 0 and "run_functions_eagerly(True)" in eagerly["error"], eagerly
    assert "in_graph=False" in eagerly["error"] and not eagerly["changed"]
    assert host["error"] is None and host["done"] == 6 and host["steps"] == 6
    assert host["identical"] and host["changed"]
