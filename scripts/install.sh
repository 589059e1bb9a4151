#!/usr/bin/env bash
# The one install path of dgc_horovod: `make install` (and so `make test` / `make demo`) and the
# Docker images run this script. It is idempotent: each step checks a stamp and is skipped when
# nothing changed, so a second run costs seconds.
#
#   1. system packages: OpenMPI (openmpi-bin, libopenmpi-dev), cmake, g++, patch, and for the
#      two-host test bed iproute2 and openssh-server (apt-get);
#   2. a virtual environment ($DGC_VENV, default .venv at the repository root);
#   3. the Python requirements (requirements.txt, then tf-keras with --no-deps);
#   4. Horovod 0.28.1 with PyTorch + TensorFlow + Gloo + MPI: the PyPI sdist, patched with
#      patches/horovod-0.28.1-torch2-tf2.patch, built once into a wheel cached in
#      $DGC_CACHE_DIR/wheels (default ~/.cache/dgc_horovod/wheels), keyed by Horovod version, patch
#      hash, torch and TensorFlow versions, so that a fresh clone installs it in seconds;
#   5. dgc_horovod itself, editable.
#
# Environment: DGC_VENV, DGC_CACHE_DIR, MAKEFLAGS (default -j$(nproc)) for the Horovod build.
# GPU builds (docker/Dockerfile.gpu) also set these; unset or empty, each keeps the CPU default:
#   DGC_PYTHON       the interpreter that creates the virtual environment (default python3);
#   DGC_TORCH_SPEC   pip arguments that install torch instead of requirements.txt's torch line,
#                    e.g. "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128";
#   DGC_TF_SPEC      pip arguments that install TensorFlow instead of requirements.txt's
#                    tensorflow-cpu line, e.g. "tensorflow==2.21.0";
#   DGC_HOROVOD_GPU  NCCL (or MPI): build Horovod with HOROVOD_GPU_OPERATIONS=$DGC_HOROVOD_GPU, NCCL
#                    linked as a shared library unless HOROVOD_NCCL_LINK says otherwise. Needs the
#                    CUDA toolkit (nvcc) and NCCL; Horovod's own HOROVOD_CUDA_HOME, HOROVOD_NCCL_HOME
#                    and HOROVOD_BUILD_CUDA_CC_LIST pass through. The wheel cache key records it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DGC_VENV:-$ROOT/.venv}"
CACHE="${DGC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dgc_horovod}"
HOROVOD_VERSION=0.28.1
TF_KERAS_VERSION=2.21.0
PATCH_FILE="$ROOT/patches/horovod-${HOROVOD_VERSION}-torch2-tf2.patch"
PY="$VENV/bin/python"
TORCH_SPEC="${DGC_TORCH_SPEC:-}"
TF_SPEC="${DGC_TF_SPEC:-}"
HOROVOD_GPU="${DGC_HOROVOD_GPU:-}"
case "$HOROVOD_GPU" in ""|NCCL|MPI) ;; *) echo "DGC_HOROVOD_GPU must be empty, NCCL or MPI, not '$HOROVOD_GPU'" >&2; exit 2;; esac

log() { printf '[install] %s\n' "$*" >&2; }
sha() { sha256sum "$@" | cut -c1-16; }

# 1. System packages -------------------------------------------------------------------------
missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v mpicxx >/dev/null 2>&1 || missing+=(libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v patch >/dev/null 2>&1 || missing+=(patch)
# the two-host test bed (scripts/cluster/): network namespaces + tc (iproute2), sshd in each
command -v tc >/dev/null 2>&1 || missing+=(iproute2)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
# Debian's own python3 (the default interpreter, in /usr/bin) ships its venv module
# (python3-venv) and the headers the Horovod build compiles against (python3-dev) apart;
# DGC_PYTHON, or another python3 (pyenv, the python image's /usr/local/bin), brings its own
if [ -z "${DGC_PYTHON:-}" ]; then
    py="$(command -v python3 || true)"
    if [ -z "$py" ]; then
        missing+=(python3 python3-venv python3-dev)
    elif [[ "$(readlink -f "$py")" == /usr/bin/* ]]; then
        "$py" -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
        "$py" -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
            || missing+=(python3-dev)
    fi
fi
if [ ${#missing[@]} -gt 0 ]; then
    log "installing system packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. Virtual environment ---------------------------------------------------------------------
if [ ! -x "$PY" ]; then
    log "creating virtual environment $VENV"
    "${DGC_PYTHON:-python3}" -m venv "$VENV"
fi

# 3. Python requirements ---------------------------------------------------------------------
req_key="$(sha "$ROOT/requirements.txt")-tfkeras$TF_KERAS_VERSION"
[ -z "$TORCH_SPEC$TF_SPEC" ] || req_key="$req_key-spec$(printf '%s\n%s' "$TORCH_SPEC" "$TF_SPEC" | sha)"
if [ "$(cat "$VENV/.dgc-requirements" 2>/dev/null)" != "$req_key" ]; then
    log "installing requirements.txt"
    "$PY" -m pip install -q --upgrade pip
    if [ -z "$TORCH_SPEC$TF_SPEC" ]; then
        "$PY" -m pip install -q -r "$ROOT/requirements.txt"
    else
        # each spec (a pip argument list) replaces its line of requirements.txt; another torch
        # brings the Triton it was built with (its CUDA builds), so the triton line goes too
        drop=(-e '^#')
        [ -z "$TORCH_SPEC" ] || drop+=(-e '^triton[=<>~! ]')
        for line in "torch $TORCH_SPEC" "tensorflow-cpu $TF_SPEC"; do
            read -r name spec <<< "$line"
            [ -n "$spec" ] || continue
            read -r -a args <<< "$spec"
            drop+=(-e "^$name[=<>~! ]")
            log "installing ${args[*]}"
            "$PY" -m pip install -q "${args[@]}"
        done
        grep -v "${drop[@]}" "$ROOT/requirements.txt" > "$VENV/.dgc-requirements.txt"
        "$PY" -m pip install -q -r "$VENV/.dgc-requirements.txt"
    fi
    "$PY" -m pip install -q --no-deps "tf-keras==$TF_KERAS_VERSION"
    echo "$req_key" > "$VENV/.dgc-requirements"
fi

# 4. Horovod ---------------------------------------------------------------------------------
versions="$("$PY" -c 'import sys; from importlib.metadata import version as v, PackageNotFoundError
def tf():  # tensorflow-cpu (default), or tensorflow (DGC_TF_SPEC)
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return v(dist)
        except PackageNotFoundError:
            pass
    sys.exit("neither tensorflow-cpu nor tensorflow is installed")
print("torch%s-tf%s-cp%d%d" % (v("torch"), tf(), *sys.version_info[:2]))')"
hvd_key="horovod-${HOROVOD_VERSION}-p$(sha "$PATCH_FILE")-${versions}${HOROVOD_GPU:+-gpu$HOROVOD_GPU}"
if [ "$(cat "$VENV/.dgc-horovod" 2>/dev/null)" != "$hvd_key" ]; then
    wheel_dir="$CACHE/wheels/$hvd_key"
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION (PyTorch + TensorFlow + Gloo + MPI${HOROVOD_GPU:+ + GPU operations: $HOROVOD_GPU}); takes minutes, once per machine"
        build="$(mktemp -d)"
        trap 'rm -rf "$build"' EXIT
        "$PY" -m pip download -q --no-binary :all: --no-deps "horovod==$HOROVOD_VERSION" -d "$build"
        tar xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
        (cd "$build/horovod-$HOROVOD_VERSION" && patch -p1 --forward --quiet < "$PATCH_FILE")
        mkdir -p "$wheel_dir.tmp"
        gpu_env=()
        [ -z "$HOROVOD_GPU" ] || gpu_env=(HOROVOD_GPU_OPERATIONS="$HOROVOD_GPU" HOROVOD_NCCL_LINK="${HOROVOD_NCCL_LINK:-SHARED}")
        (cd "$build/horovod-$HOROVOD_VERSION" && \
         PATH="$VENV/bin:$PATH" MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" env ${gpu_env[@]+"${gpu_env[@]}"} \
         HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
         HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
         "$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$wheel_dir.tmp" > "$build/build.log" 2>&1) || {
            log "Horovod build failed; last lines of $build/build.log:"; tail -n 40 "$build/build.log" >&2
            trap - EXIT; exit 1; }
        rm -rf "$wheel_dir"; mv "$wheel_dir.tmp" "$wheel_dir"
    fi
    log "installing cached wheel $(ls "$wheel_dir"/horovod-*.whl)"
    "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
    # --check-build reports PyTorch even when its extension is missing: check the library itself.
    ls "$VENV"/lib/python*/site-packages/horovod/torch/mpi_lib_v2*.so >/dev/null
    ls "$VENV"/lib/python*/site-packages/horovod/tensorflow/mpi_lib*.so >/dev/null
    echo "$hvd_key" > "$VENV/.dgc-horovod"
fi
# where the wheel of this venv's Horovod lies (tests/test_wheel_venv.py installs it elsewhere)
echo "$CACHE/wheels/$hvd_key" > "$VENV/.dgc-horovod-wheels"

# 5. dgc_horovod itself ----------------------------------------------------------------------
self_key="$(sha "$ROOT/setup.py")-$ROOT"
if [ "$(cat "$VENV/.dgc-self" 2>/dev/null)" != "$self_key" ]; then
    log "installing dgc_horovod (editable)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
    echo "$self_key" > "$VENV/.dgc-self"
fi
