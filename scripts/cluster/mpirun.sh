#!/usr/bin/env bash
# Launch a job from hostA across the two hosts of the test bed with a plain `mpirun`, no horovodrun,
# as a scheduler's job script would (Slurm's `mpirun` in an allocation); the script initializes
# Horovod itself (hvd.init(), or hvd.init(comm=MPI.COMM_WORLD) with mpi4py):
#
#   scripts/cluster/mpirun.sh [other mpirun options] python script.py ...
#
# runs, inside namespace dgc-hostA (as run.sh does),
#
#   mpirun --allow-run-as-root -np 2 -H hostA:1,hostB:1 -bind-to none -map-by slot \
#       -mca pml ob1 -mca btl ^openib -mca btl_tcp_if_include dgc0 -mca oob_tcp_if_include dgc0 \
#       -x PATH -x PYTHONPATH [-x LD_LIBRARY_PATH] [-x each HOROVOD_*, NCCL_*, TF_* variable set] \
#       [other mpirun options] python script.py ...
#
# the flags `horovodrun --mpi --verbose` prints for the same job (run.sh), less its ssh options:
# Open MPI starts hostB's orted over ssh with the bed's client configuration, which names the key
# (as ~/.ssh/config does on a cluster). btl_tcp_if_include / oob_tcp_if_include keep MPI's data and
# control traffic on the veth. -x passes the variables on to the ranks on hostB (those started on
# hostA inherit mpirun's environment; horovodrun passes every variable with -x).
# NP (default 2) and HOSTS (default hostA:1,hostB:1) may be overridden from the environment.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/common.sh"
need_root
ns_exists "$NS_A" && [ -f "$KEY" ] || die "the test bed is not up: run scripts/cluster/up.sh (make cluster-up)"
fwd=(-x PATH -x PYTHONPATH)
[ -z "${LD_LIBRARY_PATH:-}" ] || fwd+=(-x LD_LIBRARY_PATH)
for v in $(compgen -e | grep -E '^(HOROVOD|NCCL|TF)_' || true); do fwd+=(-x "$v"); done
export PYTHONPATH="${PYTHONPATH:-}"
exec ip netns exec "$NS_A" unshare --uts "$HERE/_as_host.sh" "$HOST_A" mpirun --allow-run-as-root \
    -np "${NP:-2}" -H "${HOSTS:-$HOST_A:1,$HOST_B:1}" -bind-to none -map-by slot \
    -mca pml ob1 -mca btl ^openib -mca btl_tcp_if_include "$IFACE" -mca oob_tcp_if_include "$IFACE" \
    "${fwd[@]}" "$@"
