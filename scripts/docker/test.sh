#!/usr/bin/env bash
# make docker-test: build docker/Dockerfile for real and run it.
#
#   1. engine: uses the Docker engine that answers; if none does (root only), installs Debian's
#      docker.io if dockerd is missing and starts one of its own (overlay2 storage where an overlay
#      mount works, else vfs; data in $DGC_DOCKER_DATA, its own socket; no default bridge, no
#      iptables rules), stopped at the end;
#   2. base image: $BASE_IMAGE (default the Dockerfile's public python:3.11.7-slim-bookworm) if it
#      is there or can be pulled; otherwise a local Debian bookworm with Python 3.11
#      ($DGC_LOCAL_BASE), made once with debootstrap from this machine's Debian mirror and
#      `docker import`;
#   3. this machine's pip configuration (scripts/docker/host_pkg_config.py), if it has one, as an
#      image of its own that the build mounts while install.sh runs (PKG_CONFIG_IMAGE); none of it
#      is in the image, checked below;
#   4. the build: docker build -f docker/Dockerfile -t $DGC_DOCKER_IMAGE (default dgc_horovod:cpu);
#   5. in a container: `horovodrun --check-build` (PyTorch, TensorFlow, MPI and Gloo built) and no
#      pip configuration left; in another, `make demo` (MNIST with DGC, 2 ranks; DEMO_ARGS are
#      its ARGS) with one plain line per epoch;
#   6. two containers, sshd in each: from the first,
#      `horovodrun -np 2 -H <a>:1,<b>:1` over ssh, as on a cluster: `hostname` (one rank in each
#      container), then the PyTorch drop-in (examples/pytorch_mnist.py --compression dgc,
#      CLUSTER_ARGS, default --epochs 1).
# Every container runs on a user-defined Docker network ($DGC_DOCKER_NAME-net), which also puts its
# hostname in its /etc/hosts (Gloo's rendezvous resolves it: without that, as with --network none,
# horovodrun's workers crash in hvd.init()). At the end (also on failure or interrupt) it removes
# its containers, network and temporary files and stops the engine it started. Images stay, so a
# second run rebuilds only what changed. One run at a time per machine: a second one waits
# (flock on $DGC_DOCKER_LOCK, default /run/lock/dgc_horovod-docker-test.lock).
# Times and the image size are printed as "docker-test: ..." lines.
#
# Environment: DOCKER (client, default docker), BASE_IMAGE, DGC_LOCAL_BASE, DGC_DOCKER_IMAGE,
# DGC_DOCKER_DATA (default /var/lib/dgc_horovod-docker), DGC_DOCKER_STORAGE (storage driver of an
# engine started here: overlay2 or vfs; default: probed), DGC_DOCKER_NAME (prefix of containers
# and network, default dgc-docker-test), BUILD_JOBS (default nproc), DEMO_ARGS, CLUSTER_ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DOCKER="${DOCKER:-docker}"
BASE_IMAGE="${BASE_IMAGE:-$(sed -n 's/^ARG BASE_IMAGE=//p' "$ROOT/docker/Dockerfile")}"
LOCAL_BASE="${DGC_LOCAL_BASE:-dgc_horovod/debian-python:bookworm}"
IMAGE="${DGC_DOCKER_IMAGE:-dgc_horovod:cpu}"
DATA="${DGC_DOCKER_DATA:-/var/lib/dgc_horovod-docker}"
NAME="${DGC_DOCKER_NAME:-dgc-docker-test}"
BUILD_JOBS="${BUILD_JOBS:-$(nproc)}"
DEMO_ARGS="${DEMO_ARGS:-}"
CLUSTER_ARGS="${CLUSTER_ARGS:---epochs 1}"
PKG_IMAGE="$NAME-host-pkg-config:local"
SUITE=bookworm

log() { printf '[docker-test] %s\n' "$*" >&2; }
die() { printf 'docker-test: %s\n' "$*" >&2; exit 1; }
report() { printf 'docker-test: %s\n' "$*"; }
since() { echo "$((SECONDS - $1)) s"; }

# One run at a time on this machine (the engine's socket, data and container names are fixed):
# a second `make docker-test` (another checkout's `make test`) waits for the first.
exec 9> "${DGC_DOCKER_LOCK:-/run/lock/dgc_horovod-docker-test.lock}"
if ! flock -n 9; then
    log "another make docker-test runs on this machine: waiting for it"
    flock 9
fi
T0=$SECONDS

TMP="$(mktemp -d /tmp/dgc-docker-test.XXXXXX)"
DOCKERD_PID=""
RUN_DIR=""
KEY_EXISTED=""
cleanup() {
    local rc=$?
    set +e
    if $DOCKER info >/dev/null 2>&1; then
        for c in "$NAME-a" "$NAME-b" "$NAME-demo" "$NAME-check"; do
            $DOCKER rm -f "$c" >/dev/null 2>&1
        done
        $DOCKER network rm "$NAME-net" >/dev/null 2>&1
    fi
    if [ -n "$DOCKERD_PID" ]; then
        log "stopping the engine this run started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 120); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$DOCKERD_PID" 2>/dev/null && kill -9 "$DOCKERD_PID"
        wait "$DOCKERD_PID" 2>/dev/null
        rm -rf "$RUN_DIR"
        # dockerd 20.10 writes a trust key there at its first start
        [ -n "$KEY_EXISTED" ] || { rm -f /etc/docker/key.json; rmdir /etc/docker 2>/dev/null; }
    fi
    # debootstrap mounts /proc and /sys in its target; a failed one may leave them there
    awk -v t="$TMP/" 'index($2, t) == 1 { print $2 }' /proc/mounts | sort -r | xargs -r umount -l
    rm -rf "$TMP"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

apt_install() {
    [ "$(id -u)" -eq 0 ] || die "needs root to install $* (apt-get)"
    log "installing $* (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. engine ------------------------------------------------------------------------------------
t=$SECONDS
if ! $DOCKER info >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || die "no Docker engine answers and starting one needs root"
    command -v dockerd >/dev/null 2>&1 || apt_install docker.io
    command -v "$DOCKER" >/dev/null 2>&1 || DOCKER=/usr/bin/docker
    RUN_DIR=/run/dgc_horovod-docker
    mkdir -p "$DATA" "$RUN_DIR"
    export DOCKER_HOST="unix://$RUN_DIR/docker.sock"
    storage="${DGC_DOCKER_STORAGE:-}"
    if [ -z "$storage" ]; then      # overlay2 if this kernel mounts overlay here, else vfs (a copy per layer)
        p="$TMP/overlay-probe"; mkdir -p "$p/l" "$p/u" "$p/w" "$p/m"
        if mount -t overlay overlay -o "lowerdir=$p/l,upperdir=$p/u,workdir=$p/w" "$p/m" 2>/dev/null; then
            umount "$p/m"; storage=overlay2
        else
            storage=vfs
        fi
        rm -rf "$p"
    fi
    [ ! -e /etc/docker/key.json ] || KEY_EXISTED=1
    log "starting dockerd ($storage storage in $DATA, socket $RUN_DIR/docker.sock)"
    dockerd --storage-driver="$storage" --data-root "$DATA" --exec-root "$RUN_DIR/exec" \
        --pidfile "$RUN_DIR/dockerd.pid" --host "$DOCKER_HOST" --bridge=none --iptables=false \
        > "$TMP/dockerd.log" 2>&1 9>&- &     # (not holding the lock: it must end with this run)
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        $DOCKER info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -n 20 "$TMP/dockerd.log" >&2; die "dockerd exited"; }
        sleep 0.5
    done
    $DOCKER info >/dev/null 2>&1 || { tail -n 20 "$TMP/dockerd.log" >&2; die "dockerd did not answer in 60 s"; }
fi
# The client must build with BuildKit (the Dockerfile's RUN --mount): a client of Docker >= 23
# does that only through its buildx plugin; Debian's docker.io client (20.10) does it by itself.
if ! $DOCKER buildx version >/dev/null 2>&1; then
    client="$($DOCKER version --format '{{.Client.Version}}' 2>/dev/null || echo 0)"
    if [ "${client%%.*}" -ge 23 ] 2>/dev/null; then
        [ -x /usr/bin/docker ] || apt_install docker.io
        DOCKER=/usr/bin/docker
    fi
fi
report "engine: $($DOCKER version --format 'server {{.Server.Version}}, client {{.Client.Version}}'), storage $($DOCKER info --format '{{.Driver}}'), ready in $(since $t)"

# 2. base image --------------------------------------------------------------------------------
t=$SECONDS
if $DOCKER image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
   || timeout 120 $DOCKER pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
    base="$BASE_IMAGE"
else
    base="$LOCAL_BASE"
    if ! $DOCKER image inspect "$base" >/dev/null 2>&1; then
        [ "$(id -u)" -eq 0 ] || die "$BASE_IMAGE cannot be pulled, and making $base needs root"
        command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
        # this machine's Debian mirror (the first apt source with a $SUITE release), else Debian's
        mirror="$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Identifier: Packages' 2>/dev/null \
                  | awk -v s="$SUITE" '$2 == s { print $1; exit }')"
        mirror="${mirror:-http://deb.debian.org/debian/}"
        log "$BASE_IMAGE cannot be pulled: making $base (debootstrap $SUITE from $mirror)"
        debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
            "$SUITE" "$TMP/rootfs" "$mirror" > "$TMP/debootstrap.log" 2>&1 \
            || { tail -n 20 "$TMP/debootstrap.log" >&2; die "debootstrap failed"; }
        security="${mirror%/debian/}/debian-security"
        printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
            "$mirror" "$SUITE" "$SUITE" "$security/" "$SUITE" > "$TMP/rootfs/etc/apt/sources.list.d/debian.sources"
        rm -f "$TMP/rootfs/etc/apt/sources.list"
        chroot "$TMP/rootfs" apt-get clean
        rm -rf "$TMP/rootfs/var/lib/apt/lists/"*
        tar -C "$TMP/rootfs" -c . | $DOCKER import --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["bash"]' - "$base" >/dev/null
        rm -rf "$TMP/rootfs"
    fi
fi
report "base image: $base ($(since $t))"

# 3. this machine's pip configuration ----------------------------------------------------------
build_args=(--build-arg "BASE_IMAGE=$base" --build-arg "BUILD_JOBS=$BUILD_JOBS")
if python3 "$ROOT/scripts/docker/host_pkg_config.py" "$TMP/pkg" --python python3; then
    printf 'FROM scratch\nCOPY . /\n' > "$TMP/pkg.Dockerfile"
    DOCKER_BUILDKIT=1 $DOCKER build -q -f "$TMP/pkg.Dockerfile" -t "$PKG_IMAGE" "$TMP/pkg" >/dev/null
    build_args+=(--build-arg "PKG_CONFIG_IMAGE=$PKG_IMAGE")
fi
rm -rf "$TMP/pkg"

# 4. the image ---------------------------------------------------------------------------------
t=$SECONDS
previous="$($DOCKER image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
log "building $IMAGE from docker/Dockerfile (log: $TMP/build.log while it runs)"
# --network host: an engine started here has no default bridge; elsewhere it changes nothing
DOCKER_BUILDKIT=1 $DOCKER build --progress plain --network host -f "$ROOT/docker/Dockerfile" \
    "${build_args[@]}" -t "$IMAGE" "$ROOT" > "$TMP/build.log" 2>&1 \
    || { tail -n 40 "$TMP/build.log" >&2; die "docker build failed"; }
$DOCKER image rm "$PKG_IMAGE" >/dev/null 2>&1 || true
# so that repeated runs do not pile up 3 GB layers: the image this build replaced (untagged now)
# goes, and in an engine of our own the build cache keeps only its most recently used 6 GB
now="$($DOCKER image inspect --format '{{.Id}}' "$IMAGE")"
[ -z "$previous" ] || [ "$previous" = "$now" ] || $DOCKER image rm "$previous" >/dev/null 2>&1 || true
# (housekeeping only: a prune that fails, e.g. on a cache an interrupted build left inconsistent,
# "failed to get usage for ...: snapshot ... not found", is reported and does not fail the test)
if [ -n "$DOCKERD_PID" ] && ! $DOCKER builder prune -f --keep-storage 6GB > "$TMP/prune.log" 2>&1; then
    log "warning: pruning the build cache failed (the image is built; the cache may grow): $(tail -n 1 "$TMP/prune.log")"
fi
size="$($DOCKER image inspect --format '{{.Size}}' "$IMAGE")"
report "build: $(since $t); image $IMAGE: $((size / 1000000)) MB ($size bytes)"

# 5. one container at a time --------------------------------------------------------------------
t=$SECONDS
$DOCKER network create "$NAME-net" >/dev/null
run=($DOCKER run --rm --network "$NAME-net")
"${run[@]}" --name "$NAME-check" "$IMAGE" sh -c 'horovodrun --check-build 2>/dev/null;
    echo "pip config: $(python -m pip config list) $(ls -A /run/host-pkg-config 2>/dev/null)"' \
    > "$TMP/check.log" 2>&1 || { cat "$TMP/check.log" >&2; die "horovodrun --check-build failed"; }
grep -A20 '^Horovod v' "$TMP/check.log" >&2 || true
for fw in PyTorch TensorFlow MPI Gloo; do
    grep -Eq "\[X\] $fw\b" "$TMP/check.log" || die "horovodrun --check-build: $fw is not built"
done
grep -qx 'pip config:  ' "$TMP/check.log" \
    || die "the image holds pip configuration of the build machine: $(grep '^pip config' "$TMP/check.log")"
report "check-build: PyTorch, TensorFlow, MPI, Gloo; no pip configuration in the image ($(since $t))"

t=$SECONDS
"${run[@]}" --name "$NAME-demo" "$IMAGE" make demo ARGS="$DEMO_ARGS" > "$TMP/demo.log" 2>&1 \
    || { tail -n 40 "$TMP/demo.log" >&2; die "make demo failed in the container"; }
grep -v '^\[install\]' "$TMP/demo.log" | grep -E '^(\[0\]<stdout>:)?(epoch|final|wire|wall|Horovod)' >&2 || true
grep -q 'final test accuracy' "$TMP/demo.log" || die "make demo printed no final accuracy"
! grep -q $'\r' "$TMP/demo.log" || die "make demo's output has carriage returns (a progress bar in a pipe)"
report "make demo $DEMO_ARGS: $(grep -o 'final test accuracy: [0-9.]*%' "$TMP/demo.log") ($(since $t))"

# 6. two containers, horovodrun over ssh -------------------------------------------------------
t=$SECONDS
mkdir -m 700 "$TMP/ssh"
ssh-keygen -q -t ed25519 -N '' -C "$NAME" -f "$TMP/ssh/id_ed25519"
cp "$TMP/ssh/id_ed25519.pub" "$TMP/ssh/authorized_keys"
printf 'Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n' > "$TMP/ssh/config"
chmod 600 "$TMP/ssh/"*
for h in a b; do
    $DOCKER run -d --name "$NAME-$h" --hostname "$NAME-$h" --network "$NAME-net" \
        -v "$TMP/ssh:/root/.ssh:ro" "$IMAGE" /usr/sbin/sshd -D -e >/dev/null
done
for _ in $(seq 60); do
    $DOCKER exec "$NAME-a" ssh -o BatchMode=yes "$NAME-b" true 2>/dev/null && break
    sleep 1
done
$DOCKER exec "$NAME-a" ssh -o BatchMode=yes "$NAME-b" true || die "no ssh from $NAME-a to $NAME-b"
hosts="$NAME-a:1,$NAME-b:1"
out="$($DOCKER exec "$NAME-a" horovodrun -np 2 -H "$hosts" --gloo hostname 2>&1)" \
    || { printf '%s\n' "$out" >&2; die "horovodrun -H $hosts hostname failed"; }
grep '<stdout>' <<< "$out" >&2 || true
grep -q "\[0\]<stdout>:$NAME-a" <<< "$out" && grep -q "\[1\]<stdout>:$NAME-b" <<< "$out" \
    || die "horovodrun -H $hosts did not run one rank in each container"
# shellcheck disable=SC2086
$DOCKER exec "$NAME-a" horovodrun -np 2 -H "$hosts" --gloo python examples/pytorch_mnist.py \
    --compression dgc $CLUSTER_ARGS > "$TMP/cluster.log" 2>&1 \
    || { tail -n 40 "$TMP/cluster.log" >&2; die "the PyTorch example across two containers failed"; }
grep -E '^(\[0\]<stdout>:)?(Horovod|epoch|final)' "$TMP/cluster.log" >&2 || true
grep -q 'Horovod: 2 ranks' "$TMP/cluster.log" && grep -q 'final test accuracy' "$TMP/cluster.log" \
    || die "the PyTorch example across two containers printed no result"
report "two containers ($hosts, ssh, Gloo): pytorch_mnist.py --compression dgc $CLUSTER_ARGS: $(grep -o 'final test accuracy: [0-9.]*%' "$TMP/cluster.log") ($(since $t))"
report "passed in $(since $T0)"
