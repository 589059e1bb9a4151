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
