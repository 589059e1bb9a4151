"""Shared helpers: launching real `horovodrun -np 2` jobs from tests."""
import json
import os

# tf-keras, not Keras 3, for every TensorFlow import in the test process (before the first one)
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes tens of minutes (make docker-test); part of "
                                       "`make test`, deselect with -m 'not slow'")
    config.addinivalue_line("markers", "root: needs root (or a running Docker engine); skips "
                                       "otherwise and says why")


def horovodrun(script_args, np=2, launcher="gloo", env=None, timeout=600):
    """Run `horovodrun -np N -H localhost:N --gloo|--mpi python ...`; return CompletedProcess."""
    cmd = [os.path.join(BIN, "horovodrun"), "-np", str(np), "-H", f"localhost:{np}",
           "--" + launcher, sys.executable] + list(script_args)
    full_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT,
                    PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
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


#: The settings the unit tests of the sparse path's mechanics (test_core, test_kernels, the batch
#: tests, test_checkpoint, test_wire_fuzz) were written for: they feed flat 1-D gradients and
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
