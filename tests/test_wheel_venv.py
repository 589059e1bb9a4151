"""A wheel built from the repository installs into a FRESH virtual environment, together with torch
and the Horovod wheel that scripts/install.sh built, and runs the PyTorch example with DGC under
that environment's own `horovodrun -np 2 --gloo`, from a directory outside the repository.

What goes into the fresh environment, in one `pip install`:

- ``dgc_horovod-<version>-<python>-<platform>.whl[torch,examples]``, built with ``pip wheel`` from a copy
  of the tree (the ``torch`` extra asks for torch and horovod==0.28.1, ``examples`` for mlxtend
  and tqdm);
- ``torch==<the project venv's exact version>`` (2.13.0+cpu here, from local disk through pip's
  configured find-links; pinned, so pip never picks a multi-GB CUDA build). It must be exactly the
  torch the Horovod wheel was compiled against;
- the Horovod wheel cached by scripts/install.sh, in the directory that install.sh records in the
  project venv's ``.dgc-horovod-wheels``. It is never rebuilt here: no record or no wheel means
  `make install` was not run, and the test fails saying so.

The run uses only the fresh environment: PATH starts with its bin/, no PYTHONPATH, cwd a temporary
directory. ``--no-compile`` skips byte-compiling torch's thousands of modules at install time;
pip's own cache is used as configured. The venv (~1.5 GB) is deleted afterwards.
Time on the 2-core machine: see the phase times this test prints (``pytest -s``).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from importlib.metadata import version

import pytest

from conftest import ROOT

pytestmark = pytest.mark.environment

EXAMPLE = os.path.join(ROOT, "examples", "pytorch_mnist.py")
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                     "*.pyc", ".pytest_cache", "data", "*.so")

# Runs in the fresh venv with the example's sys.path[0] (its directory): where do the modules
# the example imports come from?
PROBE = r"""
import json, sys
sys.path[0] = sys.argv[1]
import common, dgc_horovod, horovod, torch, mlxtend, tqdm
from importlib.metadata import distribution
direct = distribution("dgc_horovod").read_text("direct_url.json")
print(json.dumps({"dgc_horovod": dgc_horovod.__file__, "common": common.__file__,
                  "horovod": horovod.__file__, "torch": torch.__file__,
                  "torch_version": torch.__version__, "prefix": sys.prefix,
                  "direct_url": json.loads(direct) if direct else None}))
"""


def _run(cmd, timeout, **kw):
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, (f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """Build the wheel, make the venv, install, run the example; yield what was observed."""
    tmp = tmp_path_factory.mktemp("wheel_venv")
    times = {}
    record = os.path.join(sys.prefix, ".dgc-horovod-wheels")
    if not os.path.exists(record):
        pytest.fail(f"no {record}: run `make install` (scripts/install.sh records where the "
                    "Horovod wheel it installed lies)")
    with open(record) as f:
        wheel_dir = f.read().strip()
    hvd_wheels = sorted(f for f in (os.listdir(wheel_dir) if os.path.isdir(wheel_dir) else [])
                        if f.startswith("horovod-") and f.endswith(".whl"))
    if not hvd_wheels:
        pytest.fail(f"no cached Horovod wheel in {wheel_dir}: run `make install` "
                    "(scripts/install.sh builds and caches it)")
    hvd_wheel = os.path.join(wheel_dir, hvd_wheels[0])

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("HOROVOD_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    # 1. the wheel, from a copy of the tree (setuptools writes build/ next to setup.py)
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=COPY_IGNORE)
    _, times["build wheel"] = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(tmp / "dist"), "."], 300, cwd=src, env=env)
    (wheel,) = (tmp / "dist").glob("dgc_horovod-*.whl")

    # 2. the fresh venv (no pip inside: the project's pip installs into it with --python)
    venv = tmp / "venv"
    vbin = venv / "bin"
    try:
        _, times["create venv"] = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                                       120, env=env)
        torch_pin = f"torch=={version('torch')}"
        (_, times["pip install"]) = _run(
            [sys.executable, "-m", "pip", "--python", str(vbin / "python"), "install", "-q",
             "--no-compile", f"{wheel}[torch,examples]", torch_pin, hvd_wheel],
            1200, cwd=tmp, env=env)

        # 3. run from outside the repository, with nothing but the venv on PATH
        run_dir = tmp / "run"
        run_dir.mkdir()
        venv_env = dict(env, PATH=str(vbin) + os.pathsep + "/usr/local/bin:/usr/bin:/bin",
                        VIRTUAL_ENV=str(venv), TF_CPP_MIN_LOG_LEVEL="3")
        probe, times["import probe"] = _run(
            [str(vbin / "python"), "-c", PROBE, os.path.dirname(EXAMPLE)], 300, cwd=run_dir,
            env=venv_env)
        json_out = run_dir / "result.json"
        cmd = [str(vbin / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
               str(vbin / "python"), EXAMPLE, "--compression", "dgc", "--epochs", "1",
               "--compress-ratio", "0.001", "--warmup-steps", "0", "--json-out", str(json_out)]
        job, times["horovodrun example"] = _run(cmd, 900, cwd=run_dir, env=venv_env)
        result = json.loads(json_out.read_text())
        yield {"venv": str(venv), "wheel": wheel, "probe": json.loads(probe.stdout),
               "stdout": job.stdout, "result": result, "times": times,
               "site": sysconfig.get_path("purelib", vars={"base": str(venv),
                                                           "platbase": str(venv)})}
    finally:
        shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(src, ignore_errors=True)
        print("\nwheel into a fresh venv, seconds: "
              + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))


def test_example_imports_the_installed_wheel(fresh):
    probe, venv = fresh["probe"], fresh["venv"]
    for mod in ("dgc_horovod", "horovod", "torch"):
        assert probe[mod].startswith(fresh["site"] + os.sep), (mod, probe[mod], fresh["site"])
    assert not probe["dgc_horovod"].startswith(ROOT + os.sep)
    assert probe["prefix"] == venv
    assert probe["common"].startswith(os.path.join(ROOT, "examples"))   # the repo's example
    # installed from the wheel file, not editable and not from the tree
    direct = probe["direct_url"]
    assert direct is not None and direct["url"].endswith(fresh["wheel"].name), direct
    assert not direct.get("dir_info", {}).get("editable", False)
    assert probe["torch_version"] == version("torch")


def test_example_trains_with_dgc(fresh):
    out, result = fresh["stdout"], fresh["result"]
    assert "compression: dgc DGC(DGCConfig(" in out
    m = re.search(r"final test accuracy: ([0-9.]+)%", out)
    assert m, out[-3000:]
    assert float(m.group(1)) == pytest.approx(result["test_accuracy"], abs=0.01)
    # one epoch of the 4,000 bundled digits: well above chance (10%)
    assert result["test_accuracy"] > 30.0, result
    assert result["ranks"] == 2 and result["compression"] == "dgc"
    m = re.search(r"wire compression after warm-up: sent ([0-9.]+)x, received ([0-9.]+)x", out)
    assert m, out[-3000:]
    ratio = result["compression_ratio_after_warmup"]
    assert ratio > 1.0
    # 2 ranks: each receives the other's payload, about what it sent
    received = result["received_compression_ratio_after_warmup"]
    assert received == pytest.approx(ratio, rel=0.2), (received, ratio)
    # density 0.001 from step 0 (--warmup-steps 0): far less traffic than dense fp32
    assert ratio > 100.0, ratio
    stats = result["dgc_total_stats"]
    assert 0 < stats["selected"] < stats["elements"] / 100
