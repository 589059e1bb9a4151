"""The Docker images. Without a Docker engine: both Dockerfiles are parsed with Docker's own
parser (the `dockerfile` package, which wraps BuildKit's), and checked for pinned base images,
their stages, the one install path (the images run scripts/install.sh, the script that
`make install` runs, and install Python packages nowhere else, with every system package it would
install already there) and the build machine's pip configuration mounted, never copied. The GPU
settings the GPU image gives install.sh are run through install.sh with a stand-in Python (no
download, no build); scripts/docker/host_pkg_config.py runs on a pip configuration of the test's
own.

With one (or root to install and start one): `make docker-test` builds docker/Dockerfile and runs
it (test_make_docker_test, marked slow and root; see README, "Docker")."""
import configparser
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import distributions, version

import pytest

from conftest import ROOT

pytestmark = pytest.mark.environment

dockerfile = pytest.importorskip("dockerfile")

IMAGES = {  # Dockerfile -> its stages, in order (the last one is the image)
    "docker/Dockerfile": ["host-pkg-config", "runtime"],
    "docker/Dockerfile.gpu": ["host-pkg-config", "build", "runtime"],
}
PKG_MOUNT = "--mount=type=bind,from=host-pkg-config,target=/run/host-pkg-config"
# Python packages (Horovod above all) come from scripts/install.sh only
PY_INSTALLS = re.compile(r"\bpip[0-9.]*\s+(install|wheel|download)\b|\beasy_install\b|"
                         r"\bsetup\.py\s+(install|build|bdist_wheel|develop)\b|\bconda\s+install\b")


def _resolve(text, variables):
    """${NAME} and $NAME from ARG/ENV values (which may name others); unknown names stay."""
    for _ in range(5):
        text, before = re.sub(r"\$\{(\w+)\}|\$(\w+)",
                              lambda m: variables.get(m.group(1) or m.group(2), m.group(0)),
                              text), text
        if text == before:
            break
    return text


def _stages(path):
    """[{name, image, args, env, cmds}] with ARG defaults (global ones too) substituted."""
    global_args, stages = {}, []
    for cmd in dockerfile.parse_file(os.path.join(ROOT, path)):
        if cmd.cmd == "FROM":
            value = list(cmd.value)
            name = value[2] if len(value) == 3 and value[1].upper() == "AS" else None
            stages.append({"name": name, "image": _resolve(value[0], global_args), "args": {},
                           "env": {}, "cmds": []})
            continue
        if cmd.cmd == "ARG":
            key, has_default, default = cmd.value[0].partition("=")
            if not stages:
                global_args[key] = _resolve(default, global_args)
            else:
                stages[-1]["args"][key] = default if has_default else global_args.get(key, "")
            continue
        assert stages, f"{path}:{cmd.start_line}: {cmd.cmd} before the first FROM"
        stage = stages[-1]
        if cmd.cmd == "ENV":
            for key, value in zip(cmd.value[::2], cmd.value[1::2]):
                stage["env"][key] = _resolve(" ".join(shlex.split(value)),
                                             {**stage["args"], **stage["env"]})
        stage["cmds"].append(cmd)
    return stages


def _runs(stage):
    return [" ".join(c.value) for c in stage["cmds"] if c.cmd == "RUN"]


def _make_install_script():
    """The script the Makefile's `install:` recipe runs."""
    text = open(os.path.join(ROOT, "Makefile")).read()
    recipe = re.search(r"^install:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.M)
    assert recipe, "no install: target with a recipe in the Makefile"
    scripts = re.findall(r"(\S+\.sh)\b", recipe.group(1))
    assert len(scripts) == 1, recipe.group(1)
    return scripts[0]


def _requirement_pin(name):
    text = open(os.path.join(ROOT, "requirements.txt")).read()
    return re.search(rf"^{re.escape(name)}==(\S+)", text, re.M).group(1)


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_parses_into_the_expected_stages(path):
    stages = _stages(path)
    assert [s["name"] for s in stages] == IMAGES[path]
    assert any(c.cmd == "CMD" for c in stages[-1]["cmds"])


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_every_base_image_is_pinned(path):
    names = set()
    for stage in _stages(path):
        image = stage["image"]
        if image in names:  # FROM an earlier stage
            continue
        names.add(stage["name"])
        if stage["name"] == "host-pkg-config":
            assert image == "scratch", f"{path}: PKG_CONFIG_IMAGE must default to scratch (none)"
            continue
        assert "$" not in image, f"{path}: unresolved variable in FROM {image}"
        ref = image.split("@", 1)
        if len(ref) == 2:  # name@sha256:... is pinned
            assert ref[1].startswith("sha256:"), image
            continue
        repo, _, tag = ref[0].rpartition(":")
        assert repo and "/" not in tag, f"{path}: FROM {image} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{path}: FROM {image} not pinned"


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_image_copies_the_repo_and_runs_the_make_install_script(path):
    script = _make_install_script()
    assert script == "scripts/install.sh"
    runs_script = re.compile(rf"\b(bash|sh)\s+(\./)?{re.escape(script)}\b")
    stages = _stages(path)
    built = set()  # stages that copied the repository and then ran the script
    for stage in stages:
        copied = False
        for cmd in stage["cmds"]:
            from_stage = [f.split("=", 1)[1] for f in cmd.flags if f.startswith("--from=")]
            if cmd.cmd in ("COPY", "ADD") and (cmd.value[0] == "." and not from_stage
                                               or from_stage and from_stage[0] in built):
                copied = True
            if cmd.cmd == "RUN" and runs_script.search(" ".join(cmd.value)):
                assert copied, f"{path}:{cmd.start_line}: runs {script} before copying the repo"
                built.add(stage["name"])
    assert stages[-1]["name"] in built, f"{path}: the image never runs {script}"
    # the build context must not carry a host .venv whose stamps would skip the install
    ignored = open(os.path.join(ROOT, ".dockerignore")).read().split()
    assert ".venv" in ignored and ".git" in ignored


#: What install.sh adds only for Debian's own python3 (DGC_PYTHON unset) when it lacks them; the
#: images bring their interpreter's (test_images_bring_their_python's venv_and_headers).
DEBIAN_PYTHON = {"python3", "python3-venv", "python3-dev"}


def _install_script_system_packages():
    """The Debian packages scripts/install.sh installs when their command is missing (not those
    of Debian's own python3, :data:`DEBIAN_PYTHON`)."""
    text = open(os.path.join(ROOT, "scripts", "install.sh")).read()
    found = set(re.findall(r"missing\+=\(([\w.+ -]+)\)", text))
    packages = {p for group in found for p in group.split()}
    assert DEBIAN_PYTHON <= packages, packages
    return packages - DEBIAN_PYTHON


def test_images_bring_their_pythons_venv_and_headers():
    """install.sh adds python3-venv / python3-dev only for Debian's own python3 with DGC_PYTHON
    unset: the CPU image's base is a python image (its interpreter in /usr/local/bin) or, where
    that cannot be pulled, the local Debian base scripts/docker/test.sh builds with both; every
    GPU stage that runs install.sh sets DGC_PYTHON (deadsnakes' python3.11 and its -venv/-dev)."""
    assert _stages("docker/Dockerfile")[-1]["image"].startswith("python:")
    text = open(os.path.join(ROOT, "scripts", "docker", "test.sh")).read()
    assert re.search(r"--include=[\w,.-]*python3-venv,python3-dev", text)
    runs_script = re.compile(r"\bbash\s+scripts/install\.sh\b")
    for stage in _stages("docker/Dockerfile.gpu"):
        if any(runs_script.search(run) for run in _runs(stage)):
            assert stage["env"].get("DGC_PYTHON") == "python3.11", stage["env"]


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_every_stage_that_runs_install_sh_has_its_system_packages_and_the_pkg_config_mount(path):
    """install.sh installs missing system packages itself (leaving apt lists in the layer, and
    failing the GPU runtime stage's no-op check): each stage that runs it apt-installs them first.
    The RUN that runs it mounts the host-pkg-config stage and uses its pip.conf only if present."""
    wanted = _install_script_system_packages()
    assert {"openmpi-bin", "cmake", "openssh-server", "iproute2"} <= wanted
    runs_script = re.compile(r"\bbash\s+scripts/install\.sh\b")
    for stage in _stages(path):
        runs = _runs(stage)
        if not any(runs_script.search(r) for r in runs):
            continue
        apt = " ".join(r for r in runs if "apt-get install" in r)
        missing = sorted(p for p in wanted if not re.search(rf"(^|\s){re.escape(p)}(\s|$)", apt))
        assert not missing, f"{path} stage {stage['name']}: install.sh would install {missing}"
        for cmd in stage["cmds"]:
            if cmd.cmd == "RUN" and runs_script.search(" ".join(cmd.value)) \
                    and "install.sh 2>&1" not in " ".join(cmd.value):   # the GPU no-op check
                assert PKG_MOUNT in cmd.flags, f"{path}:{cmd.start_line}: {cmd.flags}"
                assert ("if [ -f /run/host-pkg-config/pip.conf ]; then export "
                        "PIP_CONFIG_FILE=/run/host-pkg-config/pip.conf; fi") in cmd.value[0]


def test_base_images_are_build_arguments_with_public_defaults():
    assert _stages("docker/Dockerfile")[-1]["image"] == "python:3.11.7-slim-bookworm"
    text = open(os.path.join(ROOT, "docker", "Dockerfile")).read()
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS runtime$", text, re.M)
    gpu = open(os.path.join(ROOT, "docker", "Dockerfile.gpu")).read()
    assert re.search(r"^FROM \$\{BUILD_IMAGE\} AS build$", gpu, re.M)
    assert re.search(r"^FROM \$\{RUNTIME_IMAGE\} AS runtime$", gpu, re.M)
    for text in (text, gpu):
        assert re.search(r"^ARG PKG_CONFIG_IMAGE=scratch$", text, re.M)
        assert re.search(r"^FROM \$\{PKG_CONFIG_IMAGE\} AS host-pkg-config$", text, re.M)


@pytest.mark.parametrize("path", sorted(IMAGES))
def test_no_python_install_outside_the_install_script(path):
    for stage in _stages(path):
        for run in _runs(stage):
            assert not PY_INSTALLS.search(run), f"{path}: Python install outside install.sh: {run}"


def test_gpu_image_settings():
    _, build, runtime = _stages("docker/Dockerfile.gpu")
    cuda = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-cudnn-devel-ubuntu22\.04", build["image"])
    assert cuda, build["image"]
    assert runtime["image"] == f"nvidia/cuda:{cuda.group(1)}-cudnn-runtime-ubuntu22.04"
    knobs = {k: v for k, v in build["env"].items() if k.startswith("DGC_")}
    assert knobs == {k: v for k, v in runtime["env"].items() if k.startswith("DGC_")}
    assert knobs["DGC_HOROVOD_GPU"] == "NCCL"
    # the CUDA builds of the versions requirements.txt pins for the CPU environment
    assert knobs["DGC_TORCH_SPEC"].split()[0] == f"torch=={_requirement_pin('torch')}"
    cu = re.search(r"/whl/cu(\d+)", knobs["DGC_TORCH_SPEC"]).group(1)
    assert cu[:2] == cuda.group(1).split(".")[0], "torch's CUDA major must match the base image"
    assert knobs["DGC_TF_SPEC"] == f"tensorflow=={_requirement_pin('tensorflow-cpu')}"
    assert "libnccl-dev" in " ".join(_runs(build))


def test_make_docker_target():
    out = subprocess.run(["make", "-n", "docker", "DOCKER=docker"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    for path in IMAGES:
        assert re.search(rf"docker build -f {re.escape(path)} -t \S+ \.(\s|$)", out), out
    # without an engine (`docker info` fails) it says so and fails, before building anything
    proc = subprocess.run(["make", "docker", "DOCKER=false"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "no Docker engine" in proc.stderr and "build -f" not in proc.stdout


STUB_PYTHON = """#!/bin/bash
[ "$1" = "-c" ] && exec "{python}" "$@"
echo "$*" >> "{log}"
"""


def test_install_script_takes_the_gpu_image_settings(tmp_path):
    """install.sh with Dockerfile.gpu's DGC_* settings, on a venv whose python is a stand-in that
    logs pip calls (and runs `python -c` with this interpreter): the specs replace the torch and
    tensorflow-cpu lines of requirements.txt, the Horovod wheel is looked up under a -gpuNCCL key,
    and a second run does nothing."""
    knobs = {k: v for k, v in _stages("docker/Dockerfile.gpu")[1]["env"].items()
             if k.startswith("DGC_") and k not in ("DGC_VENV", "DGC_PYTHON")}
    venv, cache, log = tmp_path / "venv", tmp_path / "cache", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(STUB_PYTHON.format(log=log, python=sys.executable))
    (venv / "bin" / "python").chmod(0o755)
    site = venv / "lib" / "python3.11" / "site-packages" / "horovod"
    for lib in ("torch/mpi_lib_v2.so", "tensorflow/mpi_lib.so"):
        (site / lib).parent.mkdir(parents=True, exist_ok=True)
        (site / lib).touch()
    # the wheel cache entry install.sh should look for (stand-in python = this interpreter)
    patch = glob.glob(os.path.join(ROOT, "patches", "horovod-0.28.1-*.patch"))[0]
    patch_sha = subprocess.run(["sha256sum", patch], capture_output=True, text=True,
                               check=True).stdout[:16]
    tf = [d.version for d in distributions()
          if d.metadata["Name"].lower().replace("_", "-") in ("tensorflow-cpu", "tensorflow")]
    key = "horovod-0.28.1-p%s-torch%s-tf%s-cp%d%d-gpuNCCL" % (
        patch_sha, version("torch"), sorted(tf)[0], *sys.version_info[:2])
    (cache / "wheels" / key).mkdir(parents=True)
    (cache / "wheels" / key / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl").touch()

    env = dict(os.environ, DGC_VENV=str(venv), DGC_CACHE_DIR=str(cache), **knobs)
    script = os.path.join(ROOT, "scripts", "install.sh")
    first = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    calls = log.read_text().splitlines()
    assert f"-m pip install -q {knobs['DGC_TORCH_SPEC']}" in calls
    assert f"-m pip install -q {knobs['DGC_TF_SPEC']}" in calls
    reqs = (venv / ".dgc-requirements.txt").read_text().split()
    assert "numpy" in reqs
    assert not [r for r in reqs if r.startswith(("torch", "tensorflow", "triton"))]
    assert any(c.endswith(f"{key}/horovod-0.28.1-cp311-cp311-linux_x86_64.whl") for c in calls)
    assert (venv / ".dgc-horovod").read_text().strip() == key

    log.write_text("")
    second = subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and second.stdout + second.stderr == "", second.stderr
    assert log.read_text() == ""

    bad = subprocess.run(["bash", script], env=dict(env, DGC_HOROVOD_GPU="CUDA"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "DGC_HOROVOD_GPU" in bad.stderr


def test_host_pkg_config_carries_the_pip_configuration(tmp_path):
    """scripts/docker/host_pkg_config.py on a pip.conf of the test's own (PIP_CONFIG_FILE) plus a
    PIP_* variable: the files it names are copied and their paths rewritten to the mount; local
    indexes are left out; without any configuration it writes nothing and exits 3."""
    wheels, ca = tmp_path / "wheels", tmp_path / "ca.pem"
    wheels.mkdir()
    (wheels / "fake-1.0-py3-none-any.whl").write_bytes(b"wheel")
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\ncert = {ca}\nindex-url = https://example.invalid/simple\n"
                    f"extra-index-url = file://{tmp_path}/index https://other.invalid/simple\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    out = tmp_path / "out"
    script = os.path.join(ROOT, "scripts", "docker", "host_pkg_config.py")
    proc = subprocess.run([sys.executable, script, str(out), "--mount", "/run/x"],
                          env=dict(env, PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS=str(wheels),
                                   PIP_DEFAULT_TIMEOUT="60"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = configparser.ConfigParser()
    written.read(out / "pip.conf")
    got = dict(written["global"])      # (/etc/pip.conf, read by pip whatever is set, may add more)
    assert {k: got.get(k) for k in ("cert", "index-url", "extra-index-url", "find-links",
                                     "default-timeout")} == {
        "cert": "/run/x/cert.pem", "index-url": "https://example.invalid/simple",
        "extra-index-url": "https://other.invalid/simple", "find-links": "/run/x/find-links-1",
        "default-timeout": "60"}
    assert "config-file" not in got and all(v.startswith("/run/x/") for k, v in got.items()
                                            if k in ("cert", "constraint", "find-links"))
    assert (out / "cert.pem").read_text() == ca.read_text()
    assert (out / "find-links-1" / "fake-1.0-py3-none-any.whl").read_bytes() == b"wheel"
    assert f"file://{tmp_path}/index (a local index) left out" in proc.stderr

    none = subprocess.run([sys.executable, script, str(tmp_path / "none")],
                          env=dict(env, PIP_CONFIG_FILE=os.devnull), capture_output=True,
                          text=True, timeout=120)
    assert none.returncode == 3 and not (tmp_path / "none").exists(), none.stderr


def _docker_test_cannot_run():
    """Why `make docker-test` cannot run here, or None."""
    for client in ("docker", "/usr/bin/docker"):
        if shutil.which(client) and subprocess.run([client, "info"], capture_output=True,
                                                   timeout=60).returncode == 0:
            return None
    if os.geteuid() != 0:
        return "no Docker engine answers, and installing and starting one needs root"
    if not shutil.which("dockerd") and not shutil.which("apt-get"):
        return "no Docker engine, no dockerd and no apt-get to install Debian's docker.io"
    with tempfile.TemporaryDirectory() as d:        # dockerd mounts: not in a plain container
        if subprocess.run(["mount", "-t", "tmpfs", "none", d], capture_output=True).returncode:
            return "no Docker engine, and this root cannot mount (an unprivileged container?)"
        subprocess.run(["umount", d], check=True)
    return None


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(_docker_test_cannot_run() is not None, reason=str(_docker_test_cannot_run()))
def test_make_docker_test():
    """docker/Dockerfile built and run for real: `make docker-test` (scripts/docker/test.sh) passes
    its checks (check-build lists the four frameworks, the demo trains with plain output lines,
    one rank in each of two containers over ssh), and afterwards no container or network of it
    is left, and no engine it started runs."""
    proc = subprocess.run(["make", "docker-test"], cwd=ROOT, capture_output=True, text=True,
                          timeout=80 * 60)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    for line in ("docker-test: check-build: PyTorch, TensorFlow, MPI, Gloo",
                 "docker-test: make demo", "docker-test: two containers", "docker-test: passed"):
        assert line in proc.stdout, log[-6000:]
    assert re.search(r"final test accuracy: \d+\.\d+%", proc.stdout)
    left = subprocess.run(["pgrep", "-f", "dockerd .*dgc_horovod-docker"], capture_output=True,
                          text=True).stdout
    assert not left.strip(), f"the engine docker-test started still runs: {left}"
    assert not os.path.exists("/run/dgc_horovod-docker")
    for client in ("docker", "/usr/bin/docker"):
        if shutil.which(client) and subprocess.run([client, "info"], capture_output=True,
                                                   timeout=60).returncode == 0:
            names = subprocess.run([client, "ps", "-a", "--format", "{{.Names}}"],
                                   capture_output=True, text=True).stdout.split()
            nets = subprocess.run([client, "network", "ls", "--format", "{{.Name}}"],
                                  capture_output=True, text=True).stdout.split()
            assert not [n for n in names + nets if n.startswith("dgc-docker-test")]
            break
