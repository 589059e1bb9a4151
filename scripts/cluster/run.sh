#!/usr/bin/env bash
# Launch a Horovod job from hostA across the two hosts of the test bed, as on a cluster:
#
#   scripts/cluster/run.sh [--gloo|--mpi] [other horovodrun options] python script.py ...
#
# runs, inside namespace dgc-hostA,
#
#   horovodrun -np 2 -H hostA:1,hostB:1 --ssh-identity-file $STATE/id_ed25519 \
#       --network-interface dgc0 [--mpi] ...       (with --mpi: OMPI_MCA_oob_tcp_if_include=dgc0)
#
# hostA's rank runs locally, hostB's rank is started over ssh (Gloo), or both orted's are started by
# mpirun (MPI). --network-interface dgc0 makes Gloo (HOROVOD_GLOO_IFACE) and MPI's TCP transport
# (btl_tcp_if_include) use the veth; oob_tcp_if_include does the same for MPI's control channel.
# It is set in Open MPI's environment, not with --mpi-args, so that a caller's own --mpi-args
# (horovodrun keeps only the last one) does not silently drop it.
# NP (default 2) and HOSTS (default hostA:1,hostB:1) may be overridden from the environment.
# The commands run in the current directory, which must be visible on both hosts (it is: they share
# the filesystem, like an NFS home on a cluster). Python is the one on PATH (the project's .venv).
# Any command works after the options, e.g. run.sh --gloo python -c "import horovod".
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/common.sh"
need_root
ns_exists "$NS_A" && [ -f "$KEY" ] || die "the test bed is not up: run scripts/cluster/up.sh (make cluster-up)"
for a in "$@"; do [ "$a" = "--mpi" ] && export OMPI_MCA_oob_tcp_if_include="$IFACE"; done
# in hostA's network namespace and, like hostA's sshd, in a UTS namespace named hostA
exec ip netns exec "$NS_A" unshare --uts "$HERE/_as_host.sh" "$HOST_A" horovodrun -np "${NP:-2}" -H "${HOSTS:-$HOST_A:1,$HOST_B:1}" \
    --ssh-identity-file "$KEY" --network-interface "$IFACE" "$@"
