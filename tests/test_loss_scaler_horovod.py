"""DGC(loss_scaler=GradScaler) under `horovodrun -np 2` (Gloo and MPI): the documented GradScaler
pattern trains as DGC does without loss scaling (tests/workers/scaler_worker.py records it).

The unit check of the same rule on DGCCore: tests/test_loss_scale.py.
"""
import json

import pytest

from conftest import horovodrun

pytestmark = pytest.mark.horovodrun

SETTINGS = ["plain", "clip_global", "clip_tensor", "weight_decay_separate",
            "weight_decay_accumulated"]


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "results.json"
    horovodrun(["tests/workers/scaler_worker.py", "--out", str(out)], launcher=request.param)
    return json.loads(out.read_text())


@pytest.mark.parametrize("setting", SETTINGS)
def test_grad_scaler_with_backoff_and_growth_gives_the_unscaled_parameters(run, setting):
    """GradScaler(init_scale=2**10, growth_interval=3), rank 1's loss inf at step 4: the scale
    grows, backs off and grows again; DGC's parameters are bit-identical to those of DGC without
    loss scaling (the same step skipped), with clipping and weight decay too."""
    r = run["equal"][setting]
    scales = r["scales"]
    assert any(b < a for a, b in zip(scales, scales[1:]))          # a back-off
    assert any(b > a for a, b in zip(scales, scales[1:]))          # a growth
    assert r["stepped"] == [step != 4 for step in range(12)]
    assert r["equal"], f"max |difference| {r['max_abs_diff']}"
    assert r["identical"] and r["loss_scale"] == scales[-1]
    assert r["differs_from_plain"] == (setting != "plain")         # the setting is in effect


def test_float16_wire_at_scale_2_24_does_not_diverge(run):
    """The trial's case: wire_values="float16", GradScaler(init_scale=2**24). The scaler backs
    off while DGC's values overflow float16; with loss_scaler the loss then stays where Horovod's
    own float16 compression keeps it (without, the stale state blew it up: docs/reliability.md)."""
    r = run["divergence"]
    dgc, ref = r["with_loss_scaler"], r["horovod_fp16"]
    assert dgc["identical"] and dgc["finite"]
    assert dgc["scales"][-1] < 2.0 ** 20 and not all(dgc["stepped"])   # it backed off
    first = dgc["losses"][0]
    tail = sum(dgc["losses"][-20:]) / 20
    ref_tail = sum(ref["losses"][-20:]) / 20
    assert max(dgc["losses"]) < 1.5 * first, dgc["losses"]
    assert tail < 1.1 * ref_tail, (tail, ref_tail)


@pytest.mark.parametrize("case", ["sparse_bad", "dense_bad", "weight_decay_separate"])
def test_a_skipped_step_with_one_nonfinite_tensor_takes_nothing_out_of_the_others(run, case):
    """Rank 1's gradient of one tensor (fc2.weight, or the dense fc1.bias) has an inf at step 4,
    every other gradient is finite: GradScaler skips the whole step, and on both ranks every
    other sparsified tensor's residual holds the step's gradient with nothing taken out
    (v = v_before + u: what it sent is put back), the separate weight decay's buffers are
    unchanged, and training goes on identically on both ranks. Before DGCCore's
    skip_nonfinite_steps, the finite tensors' sent entries were lost (v was 0 there)."""
    r = run["partial"][case]
    assert r["stepped"] == [step != 4 for step in range(6)]
    assert r["identical"]
    for rank, checks in enumerate(r["checks"]):
        assert checks and all(checks.values()), (rank, checks)
        assert "fc1.weight v = v0 + u" in checks
        if case == "weight_decay_separate":
            assert "fc1.weight wd unchanged" in checks


def test_the_plain_pytorch_amp_loop_is_refused_before_the_parameters_move(run):
    """`scaler.step(opt)` without `opt.synchronize()` first unscales the local gradients and
    then reduces: the step would use gradients still multiplied by the loss scale. Every rank
    gets a RuntimeError that names the pattern to use; the parameters do not move."""
    r = run["plain_loop"]
    assert len(r["errors"]) == 2 and not r["moved"]
    for error in r["errors"]:
        assert error is not None and "loss scaler unscaled the gradients" in error
        assert "optimizer.synchronize(); scaler.unscale_(optimizer)" in error
