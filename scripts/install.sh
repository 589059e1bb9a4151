#!/usr/bin/env bash
# The one install path of dgc_horovod: `make install` (and so `make test` / `make demo`) and the
# Docker images run this script. It is idempotent: each step checks a stamp and is skipped when
# nothing changed, so a second run costs seconds.
#
#   1. system packages: OpenMPI (openmpi-bin, libopenmpi-dev), cmake, g++, patch (apt-get);
#   2. a virtual environment ($DGC_VENV, default .venv at the repository root);
#   3. the Python requirements (requirements.txt, then tf-keras with --no-deps);
#   4. Horovod 0.28.1 with PyTorch + TensorFlow + Gloo + MPI: the PyPI sdist, patched with
#      patches/horovod-0.28.1-torch2-tf2.patch, built once into a wheel cached in
#      $DGC_CACHE_DIR/wheels (default ~/.cache/dgc_horovod/wheels), keyed by Horovod version, patch
#      hash, torch and TensorFlow versions, so that a fresh clone installs it in seconds;
#   5. dgc_horovod itself, editable.
#
# Environment: DGC_VENV, DGC_CACHE_DIR, MAKEFLAGS (default -j$(nproc)) for the Horovod build.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DGC_VENV:-$ROOT/.venv}"
CACHE="${DGC_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dgc_horovod}"
HOROVOD_VERSION=0.28.1
TF_KERAS_VERSION=2.21.0
PATCH_FILE="$ROOT/patches/horovod-${HOROVOD_VERSION}-torch2-tf2.patch"
PY="$VENV/bin/python"

log() { printf '[install] %s\n' "$*" >&2; }
sha() { sha256sum "$@" | cut -c1-16; }

# 1. System packages -------------------------------------------------------------------------
missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v mpicxx >/dev/null 2>&1 || missing+=(libopenmpi-dev)
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v patch >/dev/null 2>&1 || missing+=(patch)
if [ ${#missing[@]} -gt 0 ]; then
    log "installing system packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. Virtual environment ---------------------------------------------------------------------
if [ ! -x "$PY" ]; then
    log "creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi

# 3. Python requirements ---------------------------------------------------------------------
req_key="$(sha "$ROOT/requirements.txt")-tfkeras$TF_KERAS_VERSION"
if [ "$(cat "$VENV/.dgc-requirements" 2>/dev/null)" != "$req_key" ]; then
    log "installing requirements.txt"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -r "$ROOT/requirements.txt"
    "$PY" -m pip install -q --no-deps "tf-keras==$TF_KERAS_VERSION"
    echo "$req_key" > "$VENV/.dgc-requirements"
fi

# 4. Horovod ---------------------------------------------------------------------------------
versions="$("$PY" -c 'from importlib.metadata import version as v; import sys; print("torch%s-tf%s-cp%d%d" % (v("torch"), v("tensorflow-cpu"), *sys.version_info[:2]))')"
hvd_key="horovod-${HOROVOD_VERSION}-p$(sha "$PATCH_FILE")-${versions}"
if [ "$(cat "$VENV/.dgc-horovod" 2>/dev/null)" != "$hvd_key" ]; then
    wheel_dir="$CACHE/wheels/$hvd_key"
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $HOROVOD_VERSION (PyTorch + TensorFlow + Gloo + MPI); takes minutes, once per machine"
        build="$(mktemp -d)"
        trap 'rm -rf "$build"' EXIT
        "$PY" -m pip download -q --no-binary :all: --no-deps "horovod==$HOROVOD_VERSION" -d "$build"
        tar xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
        (cd "$build/horovod-$HOROVOD_VERSION" && patch -p1 --forward --quiet < "$PATCH_FILE")
        mkdir -p "$wheel_dir.tmp"
        (cd "$build/horovod-$HOROVOD_VERSION" && \
         PATH="$VENV/bin:$PATH" MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" \
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

# 5. dgc_horovod itself ----------------------------------------------------------------------
self_key="$(sha "$ROOT/setup.py")-$ROOT"
if [ "$(cat "$VENV/.dgc-self" 2>/dev/null)" != "$self_key" ]; then
    log "installing dgc_horovod (editable)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
    echo "$self_key" > "$VENV/.dgc-self"
fi
