"""Checkpoint and resume of DGC state, and tensors beyond the wire format's index range.

* Under `horovodrun -np 2` (Gloo and MPI; tests/workers/checkpoint_worker.py): train 6 steps,
  save model + optimizer + DGC state per rank, exit; a new job loads and trains 6 more steps; its
  parameters must equal those of an uninterrupted 12-step run bit for bit. The documented errors
  (other config, world size, rank) and reset_residuals=True are checked there too.
* In one process, on the NumPy, PyTorch and TensorFlow backends: DGCCore.state_dict /
  load_state_dict resume bit-identically with several simulated ranks, survive
  torch.save/torch.load(weights_only=True), are snapshots, and refuse bad input without changing
  anything.
* A tensor of more than 2**31 - 1 elements is rejected before any state is allocated.
"""
import io
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import torch

from conftest import BIN, ROOT, horovodrun
from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend, wire
from dgc_horovod.core.compressor import STATE_DICT_VERSION
from dgc_horovod.backends.tf_backend import TFBackend
from dgc_horovod.backends.torch_backend import TorchBackend
from helpers import to_backend, to_np

# these tests are of the sparse path's mechanics on flat gradients (see conftest)
pytestmark = pytest.mark.usefixtures("sparse_mechanics")

WORKER = "tests/workers/checkpoint_worker.py"
BACKENDS = {"numpy": NumpyBackend(), "torch": TorchBackend(), "tensorflow": TFBackend()}
BACKEND_NAMES = sorted(BACKENDS)


# ============================================================ horovodrun: save, exit, resume
# Gloo with the default bucketed exchange, MPI with one allgather per tensor
LAUNCHES = {"gloo": ["--bucket-numel", str(2 ** 22)], "mpi": ["--bucket-numel", "0"]}


@pytest.fixture(scope="module", params=sorted(LAUNCHES))
def resumed(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"ckpt_{request.param}")
    extra = LAUNCHES[request.param]
    horovodrun([WORKER, "--mode", "first", "--dir", str(d)] + extra, launcher=request.param)
    files = sorted(os.listdir(d))
    out = d / "resume.json"
    horovodrun([WORKER, "--mode", "resume", "--dir", str(d), "--out", str(out)] + extra,
               launcher=request.param)
    return d, files, json.loads(out.read_text()), extra


@pytest.mark.horovodrun
def test_one_checkpoint_file_per_rank(resumed):
    _, files, r, _ = resumed
    assert files == ["ckpt.rank0.pt", "ckpt.rank1.pt", "reference.rank0.pt", "reference.rank1.pt"]
    for rank, rr in enumerate(r["ranks"]):
        assert (rr["saved_world_size"], rr["saved_rank"]) == (2, rank)
        assert rr["saved_steps"] == 6 and rr["saved_epoch"] == 1.0
        assert rr["saved_tensors"] == rr["saved_sparse"] == ["fc1.bias", "fc1.weight",
                                                              "fc2.bias", "fc2.weight"]


@pytest.mark.horovodrun
def test_resumed_run_is_bit_identical_to_uninterrupted_run(resumed):
    _, _, r, _ = resumed
    assert r["size"] == 2
    for rr in r["ranks"]:
        assert rr["params_equal"] == {"fc1.weight": True, "fc1.bias": True, "fc2.weight": True,
                                      "fc2.bias": True}
        assert rr["dgc_state_equal"], "u, v or the sampling generator differ after resuming"
        assert rr["loaded_epoch"] == 1.0 and rr["loaded_density"] == pytest.approx(0.05)
        assert rr["steps_counted"] == 12 and rr["selected_equal"]


@pytest.mark.horovodrun
def test_resume_without_residuals_is_not_identical(resumed):
    """The negative control: the comparison above is sensitive to the restored residuals."""
    for rr in resumed[2]["ranks"]:
        assert rr["reset_states_after_load"] == 0 and rr["reset_epoch"] == 1.0
        assert not rr["reset_params_equal"]


@pytest.mark.horovodrun
def test_load_errors_under_horovod(resumed):
    for rank, rr in enumerate(resumed[2]["ranks"]):
        msg = rr["config_error"]
        assert msg and "different config" in msg and "compress_ratio" in msg and "seed" in msg
        assert "momentum" not in msg.split("differ")[0]
        msg = rr["world_size_error"]
        assert msg and "4 ranks" in msg and "has 2" in msg and "per rank" in msg
        assert "reset_residuals=True" in msg
        msg = rr["rank_error"]
        assert msg and f"saved by rank {1 - rank}" in msg and f"loaded on rank {rank}" in msg


NAMES = ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]


@pytest.mark.horovodrun
def test_checkpoint_of_other_names_is_refused_at_the_first_step(resumed):
    """Saved under 'fc1.weight', ..., loaded into a model Horovod names 'module.fc1.weight', ...
    (a wrapped module): the first step raises on every rank, naming both kinds, and changes
    nothing; reset_residuals=True is the way out, on the same optimizer (it trains as a new one
    does), and no stale name reaches a later checkpoint."""
    for rr in resumed[2]["ranks"]:
        msg = rr["renamed_error"]
        assert msg is not None, "a checkpoint of other names was accepted"
        assert "does not fit" in msg and "reset_residuals=True" in msg
        assert "4 saved tensor state(s) match no parameter" in msg
        assert "'fc1.bias', 'fc1.weight', 'fc2.bias' and 1 more" in msg
        assert "4 parameter(s) have no saved state ('module.fc1.bias'" in msg
        assert rr["renamed_params_unchanged"]
        assert rr["renamed_states_after_error"] == NAMES and rr["renamed_steps_after_error"] == 6
        assert rr["renamed_reset_saved_tensors"] == ["module." + n for n in NAMES]
        assert rr["renamed_reset_as_new"], "after the refusal, the same optimizer trained " \
            "otherwise than a new one"


@pytest.mark.horovodrun
def test_checkpoint_of_a_resized_layer_is_refused_at_the_first_gradient(resumed):
    """Loaded into a model whose hidden layer is narrower: the step's first gradient (fc2.bias)
    still fits, the later ones do not. Every size is checked at the first gradient, before
    anything of the step is sent, so the refusal names all three and leaves Horovod's optimizer
    usable: reset_residuals=True then trains it as a new one (checked at a later gradient, the
    step was partly sent and the next one failed in Horovod: 'zero_grad() was called after
    loss.backward()')."""
    for rr in resumed[2]["ranks"]:
        msg = rr["resized_error"]
        assert msg is not None, "a checkpoint of other sizes was accepted"
        assert ("3 saved tensor state(s) have another size than the parameter ('fc1.bias': 128 "
                "elements saved, 96 now, 'fc1.weight': 8192 elements saved, 6144 now, "
                "'fc2.weight': 1280 elements saved, 960 now)") in msg
        assert "reset_residuals=True" in msg and "have no saved state" not in msg
        assert rr["resized_params_unchanged"]
        assert rr["resized_states_after_error"] == NAMES and rr["resized_steps_after_error"] == 6
        assert rr["resized_reset_saved_tensors"] == NAMES
        assert rr["resized_reset_as_new"], "after the refusal, the same optimizer trained " \
            "otherwise than a new one"


@pytest.mark.horovodrun
def test_checkpoint_missing_a_parameter_is_refused_at_the_first_step(resumed):
    for rr in resumed[2]["ranks"]:
        msg = rr["missing_error"]
        assert msg is not None, "a checkpoint without fc2.bias's state was accepted"
        assert "1 parameter(s) have no saved state ('fc2.bias')" in msg
        assert "match no parameter" not in msg
        assert rr["missing_params_unchanged"]
        assert rr["missing_states_after_error"] == ["fc1.bias", "fc1.weight", "fc2.weight"]
        assert rr["missing_reset_saved_tensors"] == NAMES
        assert rr["missing_reset_as_new"]


@pytest.mark.horovodrun
def test_other_world_size_refused_then_reset_residuals(resumed):
    """One process (world size 1) loads rank 0's file of the 2-rank job."""
    d, _, _, extra = resumed
    out = d / "single.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT,
               PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    for k in [k for k in env if k.startswith(("HOROVOD_", "OMPI_", "PMI"))]:
        del env[k]
    proc = subprocess.run([sys.executable, WORKER, "--mode", "single", "--dir", str(d),
                           "--out", str(out)] + extra, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())["ranks"][0]
    assert r["size"] == 1
    assert "2 ranks" in r["error"] and "has 1" in r["error"] and "per rank" in r["error"]
    assert r["states_after_refusal"] == 0 and r["epoch_after_refusal"] == 0.0   # nothing changed
    assert r["states_after_reset"] == 0 and r["epoch_after_reset"] == 1.0
    assert r["steps_after_reset"] == 6


# ============================================================ DGCCore in one process
SHAPES = {"w": (40, 100), "b": (100,), "s": (3,)}      # s stays dense (min_sparse_numel=8)
CFG = dict(compress_ratio=0.01, momentum=0.9, warmup_epochs=2, min_sparse_numel=8, seed=3)


def grads(step, rank):
    rng = np.random.default_rng(1000 * step + rank)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def run_steps(cores, first, last):
    """Simulated Horovod steps on every rank (allgather = rank-ordered concatenation, dense
    allreduce = rank-ordered sum); the warm-up epoch is set every 3 steps. Returns the updates."""
    n, B = len(cores), cores[0].B
    history = []
    for step in range(first, last):
        if step % 3 == 0:
            for c in cores:
                c.set_epoch(step // 3)
        gs = [grads(step, r) for r in range(n)]
        for name in SHAPES:
            outs = [c.compress(name, to_backend(B, g[name]), n) for c, g in zip(cores, gs)]
            if outs[0][0] == "sparse":
                gathered = B.cat([o[1] for o in outs])
                ups = [to_np(c.decompress(gathered, o[2], n)) for c, o in zip(cores, outs)]
            else:
                ups = [sum(to_np(o[1]) for o in outs) / np.float32(n)] * n
            history.append(ups)
    return history


def round_trip(B, sd):
    """Through the framework's serializer, as a user would store it."""
    if B.name == "torch":
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)
    if B.name == "numpy":
        return pickle.loads(pickle.dumps(sd))
    return sd


def assert_same_state(a, b):
    assert set(a.states) == set(b.states)
    for name, sa in a.states.items():
        sb = b.states[name]
        assert (sa.numel, sa.sparse) == (sb.numel, sb.sparse)
        for x, y in ((sa.u, sb.u), (sa.v, sb.v)):
            assert (x is None) == (y is None)
            if x is not None:
                assert np.array_equal(to_np(x), to_np(y))


@pytest.mark.unit
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_core_resume_is_bit_identical(backend):
    B, world = BACKENDS[backend], 2
    ref = [DGCCore(DGCConfig(**CFG), B) for _ in range(world)]
    full = run_steps(ref, 0, 10)
    first = [DGCCore(DGCConfig(**CFG), B) for _ in range(world)]
    head = run_steps(first, 0, 5)
    saved = [round_trip(B, c.state_dict(world_size=world, rank=r)) for r, c in enumerate(first)]
    del first
    resumed = [DGCCore(DGCConfig(**CFG), B) for _ in range(world)]
    for r, (c, sd) in enumerate(zip(resumed, saved)):
        c.load_state_dict(sd, world_size=world, rank=r)
        assert c.epoch == 1.0 and c.total_stats.steps == 5
    tail = run_steps(resumed, 5, 10)
    assert len(head) + len(tail) == len(full)
    for got, want in zip(head + tail, full):
        for g, w in zip(got, want):
            assert np.array_equal(g, w)
    for a, b in zip(ref, resumed):
        assert_same_state(a, b)
        assert a.total_stats.selected == b.total_stats.selected
        assert a.total_stats.wire_bytes == b.total_stats.wire_bytes


@pytest.mark.unit
def test_a_version_3_dict_loads_without_its_generator():
    """Version 3 kept the sampling generator's state; the samples are now a hash of (seed,
    tensor, step), so a version-3 dict loads with its generator ignored, and resumes as a
    version-4 dict of the same state does."""
    B = BACKENDS["torch"]
    core = DGCCore(DGCConfig(**CFG), B)
    run_steps([core], 0, 2)
    sd = core.state_dict()
    old = dict(sd, version=3, generator=torch.zeros(5056, dtype=torch.uint8))
    a, b = DGCCore(DGCConfig(**CFG), B), DGCCore(DGCConfig(**CFG), B)
    a.load_state_dict(sd)
    b.load_state_dict(old)
    ha, hb = run_steps([a], 2, 4), run_steps([b], 2, 4)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(ha, hb))


@pytest.mark.unit
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_state_dict_is_a_snapshot(backend):
    B = BACKENDS[backend]
    core = DGCCore(DGCConfig(**CFG), B)
    run_steps([core], 0, 2)
    sd = core.state_dict()
    v_before = to_np(sd["tensors"]["w"]["v"])
    run_steps([core], 2, 4)
    assert np.array_equal(to_np(sd["tensors"]["w"]["v"]), v_before)
    assert not np.array_equal(to_np(core.states["w"].v), v_before)


@pytest.mark.unit
def test_state_dict_contents():
    core = DGCCore(DGCConfig(**CFG), BACKENDS["torch"])
    run_steps([core], 0, 4)
    sd = core.state_dict(world_size=2, rank=1)
    assert set(sd) == {"version", "config", "epoch", "steps", "world_size", "rank", "tensors",
                       "total_stats", "step_stats", "loss_scale"}
    assert sd["loss_scale"] == 1.0
    assert sd["steps"] == 4
    assert set(sd["tensors"]["w"]) == {"numel", "ndim", "sparse", "u", "v", "wd"}
    assert sd["version"] == STATE_DICT_VERSION
    assert sd["config"] == DGCConfig(**CFG).to_dict()
    assert (sd["epoch"], sd["world_size"], sd["rank"]) == (1.0, 2, 1)
    assert {n: (t["numel"], t["sparse"]) for n, t in sd["tensors"].items()} == {
        "w": (4000, True), "b": (100, True), "s": (3, False)}
    assert sd["tensors"]["s"]["v"] is None and sd["tensors"]["s"]["u"].shape == (3,)
    assert sd["total_stats"]["steps"] == 4 and sd["total_stats"]["tensors"] == 12


@pytest.mark.unit
def test_torch_save_load_round_trip_is_exact(tmp_path):
    core = DGCCore(DGCConfig(**CFG), BACKENDS["torch"])
    run_steps([core], 0, 3)
    sd = core.state_dict(world_size=2, rank=0)
    torch.save({"dgc": sd}, tmp_path / "ckpt.rank0.pt")
    back = torch.load(tmp_path / "ckpt.rank0.pt", weights_only=True)["dgc"]
    assert {k: v for k, v in back.items() if k != "tensors"} == \
        {k: v for k, v in sd.items() if k != "tensors"}
    for name, t in sd["tensors"].items():
        for key in ("u", "v"):
            assert (t[key] is None) == (back["tensors"][name][key] is None)
            if t[key] is not None:
                assert torch.equal(t[key], back["tensors"][name][key])
    again = DGCCore(DGCConfig(**CFG), BACKENDS["torch"])
    again.load_state_dict(back, world_size=2, rank=0)
    assert_same_state(core, again)


def trained_state(world_size=2, rank=0, backend="numpy"):
    core = DGCCore(DGCConfig(**CFG), BACKENDS[backend])
    run_steps([core], 0, 4)
    return core.state_dict(world_size=world_size, rank=rank)


def untouched(core):
    return not core.states and core.epoch == 0.0 and core.total_stats.steps == 0


@pytest.mark.unit
def test_load_with_changed_config_names_the_keys():
    sd = trained_state()
    core = DGCCore(DGCConfig(**dict(CFG, compress_ratio=0.02, nesterov=True)), BACKENDS["numpy"])
    with pytest.raises(ValueError, match="different config") as info:
        core.load_state_dict(sd, world_size=2, rank=0)
    msg = str(info.value)
    assert "compress_ratio" in msg and "nesterov" in msg and "0.01" in msg and "0.02" in msg
    assert "seed" not in msg.split("differ")[0]
    assert untouched(core)


@pytest.mark.unit
@pytest.mark.parametrize("exchange", ["hierarchical", "regions"])
def test_another_exchange_loads_only_with_reset_residuals(exchange):
    """A checkpoint of the allgather exchange into a DGC of another exchange (e.g. a job moved
    to multi-GPU nodes): refused with both ways out named; with reset_residuals=True it loads
    (warm-up position and statistics kept, the residuals restart at zero). Another setting
    that differs too still refuses."""
    sd = trained_state()
    core = DGCCore(DGCConfig(**dict(CFG, exchange=exchange)), BACKENDS["numpy"])
    with pytest.raises(ValueError, match=r"exchange differ.*DGCConfig\(\*\*state_dict\['config'\]\); "
                       r"or, to change exchange and keep the warm-up position, load with "
                       r"reset_residuals=True"):
        core.load_state_dict(sd, world_size=2, rank=0)
    assert untouched(core)
    core.load_state_dict(sd, world_size=2, rank=0, reset_residuals=True)
    assert core.states == {} and core.epoch == sd["epoch"] and core.total_stats.steps == 4
    other = DGCCore(DGCConfig(**dict(CFG, exchange=exchange, nesterov=True)), BACKENDS["numpy"])
    with pytest.raises(ValueError, match=r"\(nesterov differ: nesterov: saved False, now True\); "
                       r"create DGC with the saved settings, DGCConfig\(\*\*state_dict\['config'\]\)$"):
        other.load_state_dict(sd, world_size=2, rank=0, reset_residuals=True)
    assert untouched(other)


@pytest.mark.unit
def test_load_with_other_world_size_or_rank_is_refused():
    sd = trained_state(world_size=2, rank=1)
    core = DGCCore(DGCConfig(**CFG), BACKENDS["numpy"])
    with pytest.raises(ValueError, match=r"2 ranks.*has 4.*per rank.*reset_residuals=True.*"
                       r"process_set="):
        core.load_state_dict(sd, world_size=4, rank=1)
    with pytest.raises(ValueError, match=r"saved by rank 1, loaded on rank 0.*per rank"):
        core.load_state_dict(sd, world_size=2, rank=0)
    assert untouched(core)


@pytest.mark.unit
def test_reset_residuals_keeps_config_epoch_and_drops_u_v():
    sd = trained_state(world_size=2, rank=1)
    core = DGCCore(DGCConfig(**CFG), BACKENDS["numpy"])
    core.load_state_dict(sd, world_size=4, rank=3, reset_residuals=True)
    assert core.states == {} and core.epoch == sd["epoch"] == 1.0
    assert core.total_stats.steps == 4
    run_steps([core], 4, 5)                     # residuals restart at zero
    assert set(core.states) == set(SHAPES)


@pytest.mark.unit
@pytest.mark.parametrize("corrupt,match", [
    (lambda sd: sd.pop("steps"), "missing key"),
    (lambda sd: sd.update(version=99), "version 99"),
    (lambda sd: sd["tensors"]["w"].update(v=np.zeros(5, np.float32)), "v has 5 elements"),
    (lambda sd: sd["tensors"]["w"].update(u=None), "u is missing"),
    (lambda sd: sd["tensors"]["s"].update(sparse=True), "min_sparse_numel"),
    (lambda sd: sd["tensors"]["w"].update(numel=0), "numel 0"),
    (lambda sd: sd.update(epoch=-1.0), "epoch"),
    (lambda sd: sd["total_stats"].pop("steps"), "CompressionStats"),
])
def test_malformed_state_dict_is_refused_without_change(corrupt, match):
    sd = trained_state()
    corrupt(sd)
    core = DGCCore(DGCConfig(**CFG), BACKENDS["numpy"])
    with pytest.raises(ValueError, match=match):
        core.load_state_dict(sd, world_size=2, rank=0)
    assert untouched(core)


@pytest.mark.unit
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_loaded_names_are_checked_against_the_model_at_the_first_step(backend):
    """check_fit (what the adapters call with every parameter's name) refuses loaded states that
    match no parameter; compress refuses a tensor without a loaded state; neither changes
    anything; once the first step after the load has completed, nothing is checked any more."""
    B = BACKENDS[backend]
    sd = trained_state(backend=backend)          # tensors w, b, s
    core = DGCCore(DGCConfig(**CFG), B)
    core.load_state_dict(sd, world_size=2, rank=0)
    assert core.fit_pending
    with pytest.raises(ValueError, match=r"3 saved tensor state\(s\) match no parameter of the "
                       r"optimizer \('b', 's', 'w'\); 3 parameter\(s\) have no saved state "
                       r"\('m\.b', 'm\.s', 'm\.w'\).*reset_residuals=True"):
        core.check_fit(["m.w", "m.b", "m.s"])
    core.check_fit(["w", "b", "s", "frozen"])    # a parameter DGC never compresses is fine
    g = grads(4, 0)
    v_before = to_np(core.states["w"].v)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) have no saved state \('new'\)"):
        core.compress("new", to_backend(B, g["w"]), 2)
    with pytest.raises(ValueError, match=r"\('new'\)"):
        core.compress_many([("w", to_backend(B, g["w"]), None),
                            ("new", to_backend(B, g["b"]), None)], 2)
    assert set(core.states) == {"w", "b", "s"} and core.steps == 4
    assert np.array_equal(to_np(core.states["w"].v), v_before)
    run_steps([core], 4, 5)                      # the first step after the load
    assert core.fit_pending                      # (complete once the next one begins)
    run_steps([core], 5, 6)
    assert not core.fit_pending
    core.check_fit(["other"])
    core.compress("new", to_backend(B, g["w"]), 2)   # e.g. a layer trained from now on
    fresh = DGCCore(DGCConfig(**CFG), B)
    fresh.load_state_dict(sd, world_size=2, rank=0, reset_residuals=True)
    assert not fresh.fit_pending
    fresh.check_fit(["m.w"])


@pytest.mark.unit
def test_loaded_sizes_are_checked_at_once_when_the_adapter_gives_them():
    """check_fit with {name: the parameter's element count} (what the adapters pass) also
    refuses a loaded state of another size, naming every one at once, before any tensor of the
    step is compressed; sizes that fit, or a plain list of names, pass."""
    sd = trained_state()
    core = DGCCore(DGCConfig(**CFG), BACKENDS["numpy"])
    core.load_state_dict(sd, world_size=2, rank=0)
    sizes = {n: int(np.prod(s)) for n, s in SHAPES.items()}
    core.check_fit(sizes)
    core.check_fit(list(sizes))
    with pytest.raises(ValueError, match=(
            r"2 saved tensor state\(s\) have another size than the parameter \('b': "
            rf"{sizes['b']} elements saved, 7 now, 'w': {sizes['w']} elements saved, 9 now\); "
            r"1 parameter\(s\) have no saved state \('frozen'\)\. "
            r"Was it .*a resized layer.*reset_residuals=True")):
        core.check_fit(dict(sizes, w=9, b=7, frozen=3))
    assert core.fit_pending and core.steps == 4


@pytest.mark.unit
def test_state_dict_without_the_newer_counters_loads():
    """A checkpoint written before received_bytes / overflowed_entries / flushed_entries existed
    loads with them at 0."""
    sd = trained_state()
    for key in ("total_stats", "step_stats"):
        for field in ("received_bytes", "overflowed_entries", "flushed_entries"):
            del sd[key][field]
    core = DGCCore(DGCConfig(**CFG), BACKENDS["numpy"])
    core.load_state_dict(sd, world_size=2, rank=0)
    assert core.total_stats.received_bytes == 0 and core.total_stats.steps == 4
    assert core.total_stats.wire_bytes == sd["total_stats"]["wire_bytes"]


# ============================================================ beyond the index range
@pytest.mark.unit
def test_check_numel_boundary():
    wire.check_numel(2 ** 31 - 1, "ok")
    with pytest.raises(ValueError, match=r"'emb\.weight' has 2147483648 elements.*at most "
                                         r"2147483647"):
        wire.check_numel(2 ** 31, "emb.weight")


class _HugeGrad:
    """Stands for a gradient of 2**31 float32 elements; it has no data."""
    dtype = np.float32
    size = 2 ** 31


class _NoAllocBackend(NumpyBackend):
    """NumPy backend that knows _HugeGrad's size and fails the test if asked to allocate."""

    def numel(self, x):
        return x.size if isinstance(x, _HugeGrad) else super().numel(x)

    def is_floating(self, x):
        return isinstance(x, _HugeGrad) or super().is_floating(x)

    def zeros(self, n, like=None):
        if n > wire.MAX_NUMEL:
            raise AssertionError(f"allocated {n} elements")
        return super().zeros(n, like)

    def float32_view(self, x):
        if isinstance(x, _HugeGrad):
            raise AssertionError("read the huge gradient")
        return super().float32_view(x)


@pytest.mark.unit
def test_huge_tensor_rejected_before_any_state():
    core = DGCCore(DGCConfig(min_sparse_numel=1), _NoAllocBackend())
    with pytest.raises(ValueError, match=r"'huge' has 2147483648 elements.*int32"):
        core.compress("huge", _HugeGrad(), 2)
    assert core.states == {} and core.total_stats.tensors == 0


@pytest.mark.unit
@pytest.mark.parametrize("min_sparse_numel", [1, 2 ** 40])     # sparsified or dense alike
def test_huge_torch_tensor_rejected_without_allocation(min_sparse_numel):
    """A meta tensor has a shape but no storage: nothing of its size is ever allocated."""
    core = DGCCore(DGCConfig(min_sparse_numel=min_sparse_numel), BACKENDS["torch"])
    huge = torch.empty(2 ** 16, 2 ** 15 + 1, device="meta")
    with pytest.raises(ValueError, match=r"'emb\.weight' has 2147549184 elements"):
        core.compress("emb.weight", huge, 2)
    assert core.states == {}


@pytest.mark.unit
def test_huge_tensor_in_a_state_dict_is_refused():
    sd = trained_state()
    sd["tensors"]["w"]["numel"] = 2 ** 31
    core = DGCCore(DGCConfig(**CFG), BACKENDS["numpy"])
    with pytest.raises(ValueError, match="2147483648 elements"):
        core.load_state_dict(sd, world_size=2, rank=0)
    assert untouched(core)
