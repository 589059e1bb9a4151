"""Shared by the tests: the layer markers and the check that every test carries one, launching
real `horovodrun -np 2` (and plain `mpirun`) jobs, reading Horovod timelines, the
sparse_mechanics fixture."""
import json
import os

# tf-keras, not Keras 3, for every TensorFlow import in the test process (before the first one)
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The Triton engine's kernels run on CPU tensors under Triton's interpreter here (it is read when
# triton is imported). And triton is imported before anything imports TensorFlow: TensorFlow
# loads its LLVM with global symbols, and a Triton loaded after it (torch._dynamo imports it, e.g.
# from torch.optim) registers LLVM's options a second time and aborts the process ("LLVM ERROR:
# inconsistency in registered CommandLine options"); loaded first, each keeps its own.
os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton  # noqa: E402,F401
except ImportError:
    pass
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


#: The test layers (docs/testing.md). Every test carries exactly one of these markers (a module's
#: ``pytestmark``, or a test's own where a module mixes layers); collection fails otherwise.
#: `make test-fast` runs ``-m unit``; `make test` runs them all.
LAYERS = {
    "unit": "the core in this process (NumPy, torch and TF backends, kernels, wire format, "
            "simulated cluster): no launcher, no framework adapter; `make test-fast`",
    "adapter": "the torch / TensorFlow adapters (dgc_horovod.torch, dgc_horovod.tensorflow) "
               "in process, or in one child process without a launcher",
    "horovodrun": "launches real `horovodrun` jobs (Gloo and MPI), or plain `mpirun` ones",
    "environment": "the environment: install, wheel, Docker, two-host cluster, scripts run end "
                   "to end; some need root or are slow",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes tens of minutes (make docker-test); part of "
                                       "`make test`, deselect with -m 'not slow'")
    config.addinivalue_line("markers", "root: needs root (or a running Docker engine); skips "
                                       "otherwise and says why")
    for name, text in LAYERS.items():
        config.addinivalue_line("markers", f"{name}: layer: {text}")


@pytest.hookimpl(tryfirst=True)            # before -m deselects anything
def pytest_collection_modifyitems(config, items):
    """Every collected test must carry exactly one layer marker (see LAYERS)."""
    bad = []
    for item in items:
        layers = sorted({m.name for m in item.iter_markers() if m.name in LAYERS})
        if len(layers) != 1:
            bad.append(f"  {item.nodeid}: {', '.join(layers) or 'no layer marker'}")
    if bad:
        raise pytest.UsageError(
            f"{len(bad)} test(s) without exactly one layer marker ({', '.join(LAYERS)}); add "
            "`pytestmark = pytest.mark.<layer>` to the module, or mark the test itself where "
            "a module mixes layers (tests/conftest.py, docs/testing.md):\n" + "\n".join(bad))


def horovodrun(script_args, np=2, launcher="gloo", env=None, timeout=600, hosts=None):
    """Run `horovodrun -np N -H localhost:N --gloo|--mpi python ...`; return CompletedProcess.
    ``hosts``: another -H argument, e.g. "localhost:2,127.0.0.1:2" (with Gloo, two nodes of two
    ranks as Horovod sees them: it places ranks by host name)."""
    cmd = [os.path.join(BIN, "horovodrun"), "-np", str(np), "-H", hosts or f"localhost:{np}",
           "--" + launcher, sys.executable] + list(script_args)
    return launch(cmd, dict(job_env(), **(env or {})), timeout)


def job_env(environ=os.environ):
    """``environ`` with what a launched job needs: this repository's dgc_horovod, the venv's
    executables, TensorFlow quiet."""
    return dict(environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT,
                PATH=BIN + os.pathsep + environ.get("PATH", ""))


def launch(cmd, env, timeout=600):
    """Run a launcher's command line ``cmd`` in the repository root; the test fails with its
    output unless it exits 0. Returns the CompletedProcess."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-4000:]}")
    return proc


def read_timeline(path):
    """Horovod timeline (Chrome trace JSON) → list of (tensor name, dtype, shape) per end event."""
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    events = json.loads(text)
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and "name" in e.get("args", {})}
    out = []
    for e in events:
        if e.get("ph") == "E" and "shape" in e.get("args", {}):
            shape = json.loads(e["args"]["shape"])
            out.append((names[e["pid"]], e["args"]["dtype"], shape))
    return out


def check_warned_once(warned, on, off, *texts):
    """A worker's record of a first-step warning ({setting: [messages]}): exactly one message
    with setting ``on``, containing every one of ``texts``, and none with ``off``."""
    assert len(warned[on]) == 1, warned
    for text in texts:
        assert text in warned[on][0], warned[on][0]
    assert warned[off] == [], warned


def check_loss_scaler_saw_fp16_overflow(r):
    """What the fp16_overflow scenario of tests/workers/torch_worker.py and tf_worker.py recorded
    (wire_values="float16", a framework loss scaler starting at 2**24): a step was skipped
    exactly when some rank's selected values overflowed (sent as ±inf), the scale fell alike on
    every rank and training resumed, the replicas are bit-identical and finite, u and v finite,
    and a rank that overflowed warned once."""
    ranks = r["ranks"]
    assert r["identical"] and r["params_finite"]
    assert all(rr["states_finite"] for rr in ranks)
    scales, stepped = ranks[0]["scales"], ranks[0]["stepped"]
    assert all(rr["scales"] == scales and rr["stepped"] == stepped for rr in ranks)
    overflowed = [sum(step) for step in zip(*(rr["overflowed"] for rr in ranks))]
    assert stepped == [n == 0 for n in overflowed]
    assert not stepped[0] and any(stepped)                 # backs off, then trains
    assert scales[0] == 2.0 ** 23 and scales == sorted(scales, reverse=True)
    for rr in ranks:
        assert len(rr["warnings"]) == (1 if sum(rr["overflowed"]) else 0)
        assert all("±inf" in w for w in rr["warnings"])
    return ranks, overflowed


#: The settings the unit tests of the sparse path's mechanics (test_core, test_checkpoint,
#: test_wire_fuzz) were written for: they feed flat 1-D gradients and
#: expect them sparsified, drive the warm-up with set_epoch, clip per tensor, and accumulate weight
#: decay. DGCConfig reads HOROVOD_DGC_* wherever a test does not pass the option itself; a test
#: that passes environ={} or the option explicitly is not affected.
SPARSE_MECHANICS_ENV = {
    "HOROVOD_DGC_MIN_SPARSE_NDIM": "1",
    "HOROVOD_DGC_WARMUP_EPOCHS": "4",
    "HOROVOD_DGC_CLIP_SCOPE": "tensor",
    "HOROVOD_DGC_WEIGHT_DECAY_MODE": "accumulated",
}


@pytest.fixture
def sparse_mechanics(monkeypatch):
    """Pin the settings of :data:`SPARSE_MECHANICS_ENV` for one test (module-wide with
    ``pytestmark = pytest.mark.usefixtures("sparse_mechanics")``)."""
    for k, v in SPARSE_MECHANICS_ENV.items():
        monkeypatch.setenv(k, v)
