# Shared names of the two-host test bed (sourced by up.sh, down.sh, run.sh, counters.sh).
# Every name the test bed creates starts with $DGC_CLUSTER_NAME (default "dgc") so that down.sh
# finds and removes it. Overridable from the environment, e.g. to run a second, independent test
# bed next to a running one (tests/test_cluster.py does):
#   DGC_CLUSTER_NAME    prefix of namespaces, root-namespace veth names and the state directory
#                       (1-8 lowercase letters/digits, default dgc)
#   DGC_CLUSTER_SUBNET  the first three octets of the link's /24 (default 10.77.0)
#   DGC_CLUSTER_STATE   state directory (default /run/$DGC_CLUSTER_NAME-cluster)
NAME="${DGC_CLUSTER_NAME:-dgc}"
[[ "$NAME" =~ ^[a-z0-9]{1,8}$ ]] || { echo "cluster: DGC_CLUSTER_NAME must be 1-8 lowercase letters or digits, not '$NAME'" >&2; exit 2; }
NS_A=$NAME-hostA                   # network namespace of "hostA" (the launcher, rank 0)
NS_B=$NAME-hostB                   # network namespace of "hostB"
HOST_A=hostA
HOST_B=hostB
SUBNET="${DGC_CLUSTER_SUBNET:-10.77.0}"
[[ "$SUBNET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || { echo "cluster: DGC_CLUSTER_SUBNET must be three octets such as 10.77.0, not '$SUBNET'" >&2; exit 2; }
IP_A="$SUBNET.1"
IP_B="$SUBNET.2"
IFACE=dgc0                         # the veth end's name inside each namespace (same on both hosts,
                                   # like eth0 on a cluster, so --network-interface dgc0 fits both)
TMP_A=$NAME-vethA                  # the pair's names in the root namespace, only while creating it
TMP_B=$NAME-vethB
STATE="${DGC_CLUSTER_STATE:-/run/$NAME-cluster}"
KEY="$STATE/id_ed25519"            # the client key pair horovodrun/mpirun log in with
NETNS_ETC=/etc/netns               # `ip netns exec NS` bind-mounts /etc/netns/NS/<entry> on /etc/<entry>

die() { echo "cluster: $*" >&2; exit 1; }
log() { echo "[cluster] $*" >&2; }
ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }
need_root() { [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, tc, sshd)"; }
