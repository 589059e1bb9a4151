"""The environment the README promises: Horovod with PyTorch, TensorFlow, Gloo and MPI; an
install script that does nothing when nothing changed."""
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import BIN, ROOT


@pytest.mark.environment
def test_check_build_lists_frameworks_and_controllers():
    out = subprocess.run([os.path.join(BIN, "horovodrun"), "--check-build"], capture_output=True,
                         text=True, check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")).stdout
    for item in ("TensorFlow", "PyTorch", "MPI", "Gloo"):
        assert re.search(r"\[X\] " + item, out), f"{item} missing from --check-build:\n{out}"
    # --check-build reports PyTorch even when its extension is missing: check the libraries too
    site = os.path.dirname(os.path.dirname(__import__("horovod").__file__))
    assert glob.glob(os.path.join(site, "horovod", "torch", "mpi_lib_v2*.so"))
    assert glob.glob(os.path.join(site, "horovod", "tensorflow", "mpi_lib*.so"))


@pytest.mark.environment
def test_install_script_is_a_no_op_when_installed():
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "install.sh")],
                          capture_output=True, text=True, check=True,
                          env=dict(os.environ, DGC_VENV=os.path.dirname(BIN)))
    assert "[install]" not in proc.stderr + proc.stdout, proc.stderr


@pytest.mark.environment
def test_patch_explains_every_hunk():
    text = open(os.path.join(ROOT, "patches", "horovod-0.28.1-torch2-tf2.patch")).read()
    hunks = text.count("\n@@ ")
    assert hunks == 3
    for i in range(1, hunks + 1):
        assert f"Hunk {i} (" in text


@pytest.mark.unit
def test_core_imports_no_framework():
    code = ("import sys, dgc_horovod, dgc_horovod.core; "
            "bad = [m for m in ('torch', 'tensorflow', 'horovod') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
