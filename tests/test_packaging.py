"""Packaging: the sdist and the wheel install a working dgc_horovod with correct metadata into a
clean virtual environment that has neither torch, tensorflow nor horovod.

The build runs on a copy of the source tree (setuptools writes build/ and *.egg-info next to
setup.py, and other people work in this checkout). The clean environment is `python -m venv
--without-pip`; the project's own pip installs into it with `--python`, which saves the ~10 s
that seeding pip into a new venv costs. It takes about 10 s in all.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from conftest import ROOT

pytestmark = pytest.mark.environment

EXPECTED_EXTRAS = {"torch": {"torch", "horovod"},
                   "tensorflow": {"tensorflow", "tf-keras", "horovod"},
                   "tensorflow-cpu": {"tensorflow-cpu", "horovod"},
                   "test": {"pytest"},
                   "examples": {"mlxtend", "tqdm"}}
# the extra whose requirements an adapter's ModuleNotFoundError must name
ADAPTER_EXTRA = {"dgc_horovod.torch": "torch", "dgc_horovod.tensorflow": "tensorflow"}
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                                     "*.pyc", ".pytest_cache", "data", "*.so")

# Runs inside the clean venv (python -I: no PYTHONPATH, no user site, no cwd on sys.path).
PROBE = r"""
import importlib, importlib.metadata as md, json, sys
out = {}
import dgc_horovod, dgc_horovod.core
out["file"] = dgc_horovod.__file__
out["version_attr"] = dgc_horovod.__version__
out["config_repr"] = repr(dgc_horovod.core.DGCConfig())
out["frameworks_imported"] = sorted(m for m in ("torch", "tensorflow", "horovod")
                                    if m in sys.modules)
out["dists"] = sorted(d.metadata["Name"].lower().replace("_", "-") for d in md.distributions())
m = md.metadata("dgc_horovod")
out["meta"] = {k: m.get_all(k) for k in ("Name", "Version", "Summary", "License",
               "License-Expression", "Requires-Python", "Requires-Dist", "Provides-Extra",
               "Description-Content-Type")}
out["description"] = m.get_payload()[:200]
out["adapters"] = {}
for name in ("dgc_horovod.torch", "dgc_horovod.tensorflow"):
    try:
        importlib.import_module(name)
        out["adapters"][name] = None
    except ModuleNotFoundError as e:
        out["adapters"][name] = {"type": type(e).__name__, "name": e.name, "msg": str(e)}
    except Exception as e:  # anything else is a packaging bug
        out["adapters"][name] = {"type": type(e).__name__, "name": None, "msg": str(e)}
print(json.dumps(out))
"""


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _pip(*args, **kw):
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH", None)
    return _run([sys.executable, "-m", "pip"] + list(args), env=env, **kw)


def _repo_version():
    text = open(os.path.join(ROOT, "dgc_horovod", "__init__.py"), encoding="utf-8").read()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """sdist and wheels built from a copy of the tree; the wheel installed in a clean venv."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=COPY_IGNORE)

    # the sdist (what `python -m build` makes first), through setuptools' PEP 517 backend
    sdist_dir = tmp / "sdist"
    code = ("import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))")
    sdist_name = _run([sys.executable, "-c", code, str(sdist_dir)], cwd=src).stdout.split()[-1]
    sdist = sdist_dir / sdist_name
    with tarfile.open(sdist) as tar:
        sdist_files = sorted(n.split("/", 1)[1] for n in tar.getnames() if "/" in n)
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp / "unpacked", **kw)
    unpacked = tmp / "unpacked" / sdist_name[:-len(".tar.gz")]

    # the wheel from the tree (pip wheel .), and the wheel from the sdist (python -m build)
    wheels = {}
    for label, where in (("tree", src), ("sdist", unpacked)):
        out = tmp / f"wheel-{label}"
        _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), ".", cwd=where)
        (wheel,) = out.glob("dgc_horovod-*.whl")
        wheels[label] = wheel

    # a clean venv: no pip, no torch/tensorflow/horovod; install the wheel with its requirements
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    vpy = venv / "bin" / "python"
    _pip("--python", str(vpy), "install", "-q", str(wheels["tree"]), cwd=tmp)
    probe = json.loads(_run([str(vpy), "-I", "-c", PROBE], cwd=tmp).stdout)
    return {"sdist_files": sdist_files, "wheels": wheels, "probe": probe, "venv": venv}


def test_sdist_carries_what_setup_py_reads(built):
    files = built["sdist_files"]
    for needed in ("setup.py", "README.md", "MANIFEST.in", "dgc_horovod/__init__.py",
                   "dgc_horovod/core/__init__.py", "dgc_horovod/torch/__init__.py",
                   "dgc_horovod/tensorflow/__init__.py", "dgc_horovod/core/_kernels.c"):
        assert needed in files, f"{needed} missing from the sdist: {files}"
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]


def test_wheel_from_sdist_equals_wheel_from_tree(built):
    def listing(path):
        with zipfile.ZipFile(path) as z:
            return sorted(n for n in z.namelist() if not n.endswith("RECORD"))
    tree, sdist = listing(built["wheels"]["tree"]), listing(built["wheels"]["sdist"])
    assert tree == sdist
    # a platform wheel: it carries the compiled fused kernels (dgc_horovod/core/_kernels.c)
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert built["wheels"]["tree"].name.startswith(f"dgc_horovod-{_repo_version()}-{tag}-{tag}-")
    assert [n for n in tree if n.startswith("dgc_horovod/core/_kernels.") and n.endswith(".so")]
    packages = {n.rsplit("/", 1)[0] for n in tree if n.endswith("/__init__.py")}
    assert packages == {"dgc_horovod", "dgc_horovod/core", "dgc_horovod/backends",
                        "dgc_horovod/torch", "dgc_horovod/tensorflow"}, packages  # no tests/, examples/, benchmarks/


def test_clean_venv_imports_core_without_any_framework(built):
    probe = built["probe"]
    assert probe["file"].startswith(str(built["venv"])), probe["file"]  # the wheel, not the tree
    assert probe["frameworks_imported"] == []
    assert probe["version_attr"] == _repo_version()
    assert probe["config_repr"].startswith("DGCConfig(")
    # install_requires pulled in NumPy and nothing else
    assert set(probe["dists"]) == {"dgc-horovod", "numpy"}, probe["dists"]


def test_metadata(built):
    meta = built["probe"]["meta"]
    assert meta["Name"] == ["dgc_horovod"]
    assert meta["Version"] == [_repo_version()]
    assert "Deep Gradient Compression" in meta["Summary"][0]
    assert (meta["License-Expression"] or meta["License"]) == ["Apache-2.0"]
    assert meta["Requires-Python"] == [">=3.9"]
    assert meta["Description-Content-Type"] == ["text/markdown"]
    assert built["probe"]["description"].startswith("# dgc_horovod")  # README.md
    assert set(meta["Provides-Extra"]) == set(EXPECTED_EXTRAS)
    base, extras = set(), {e: set() for e in EXPECTED_EXTRAS}
    for req in meta["Requires-Dist"]:
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower()
        marker = re.search(r'extra\s*==\s*"([^"]+)"', req)
        (extras[marker.group(1)] if marker else base).add(name)
    assert base == {"numpy"}
    for extra, needed in EXPECTED_EXTRAS.items():
        assert needed <= extras[extra], (extra, extras[extra])


@pytest.mark.parametrize("adapter", sorted(ADAPTER_EXTRA))
def test_adapter_without_framework_names_what_to_install(built, adapter):
    err = built["probe"]["adapters"][adapter]
    assert err is not None, f"{adapter} imported without its framework"
    assert err["type"] == "ModuleNotFoundError", err
    # the missing module is one that `pip install dgc_horovod[<extra>]` provides
    assert err["name"].split(".")[0] in EXPECTED_EXTRAS[ADAPTER_EXTRA[adapter]], err
