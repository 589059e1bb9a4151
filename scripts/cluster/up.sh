#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces dgc-hostA and dgc-hostB joined by a veth pair
# (dgc0 in each, 10.77.0.1/24 and 10.77.0.2/24), the link shaped with tc in both directions, and an
# sshd in each namespace, so that from hostA
#
#   ip netns exec dgc-hostA horovodrun -np 2 -H hostA:1,hostB:1 --ssh-identity-file KEY \
#       --network-interface dgc0 [--gloo|--mpi] python ...
#
# starts the job over ssh as on a cluster (scripts/cluster/run.sh wraps exactly this).
#
#   RATE=1gbit|100mbit|<tc rate>  link rate per direction (default 1gbit)
#   DELAY=<tc time>               optional one-way delay added with netem (e.g. 100us); default none;
#                                 needs sch_netem in the kernel (this project's CI machine lacks it)
#
# Idempotent: run again to change RATE/DELAY; it (re)creates only what is missing. Undo with
# scripts/cluster/down.sh. Needs root, iproute2 (ip, tc) and openssh-server (sshd); scripts/install.sh
# installs them. State (keys, sshd configs, logs) lives in $DGC_CLUSTER_STATE (default
# /run/dgc-cluster); name resolution and the ssh client configuration of each host live in
# /etc/netns/<ns>/ (hosts, ssh/), which `ip netns exec` bind-mounts over /etc inside the namespace,
# so neither /etc/hosts nor ~/.ssh of the real user is touched.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/common.sh"
RATE="${RATE:-1gbit}"
DELAY="${DELAY:-}"
[[ "$RATE" =~ ^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$ ]] || \
    die "RATE must be a tc rate such as 1gbit or 100mbit, not '$RATE'"
[ -z "$DELAY" ] || [[ "$DELAY" =~ ^[0-9]+(\.[0-9]+)?(us|ms|s)$ ]] || \
    die "DELAY must be a tc time such as 100us or 1ms, not '$DELAY'"
need_root
SSHD="$(command -v sshd || echo /usr/sbin/sshd)"
[ -x "$SSHD" ] || die "sshd not found: install openssh-server (scripts/install.sh does)"
for tool in ip tc ssh ssh-keygen unshare; do command -v $tool >/dev/null || die "$tool not found"; done

# 1. state directory and keys ------------------------------------------------------------------
mkdir -p "$STATE"; chmod 700 "$STATE"
[ -f "$KEY" ] || ssh-keygen -q -t ed25519 -N '' -C dgc-cluster -f "$KEY"
cp "$KEY.pub" "$STATE/authorized_keys"; chmod 600 "$STATE/authorized_keys"
: > "$STATE/known_hosts.tmp"
for h in A B; do
    hk="$STATE/host${h}_ed25519"
    [ -f "$hk" ] || ssh-keygen -q -t ed25519 -N '' -C "dgc-host$h" -f "$hk"
    ip_var="IP_$h"; host_var="HOST_$h"
    echo "${!host_var},${!ip_var} $(cut -d' ' -f1,2 "$hk.pub")" >> "$STATE/known_hosts.tmp"
done
mv "$STATE/known_hosts.tmp" "$STATE/known_hosts"
# sshd's privilege separation directory; remembered so that down.sh removes it only if we made it
if [ ! -d /run/sshd ]; then mkdir -p /run/sshd; chmod 755 /run/sshd; touch "$STATE/created-run-sshd"; fi
[ -d "$NETNS_ETC" ] || { mkdir -p "$NETNS_ETC"; touch "$STATE/created-etc-netns"; }

# 2. namespaces, veth pair, addresses -------------------------------------------------------------
for ns in "$NS_A" "$NS_B"; do ns_exists "$ns" || ip netns add "$ns"; ip -n "$ns" link set lo up; done
if ! ip -n "$NS_A" link show "$IFACE" >/dev/null 2>&1 || ! ip -n "$NS_B" link show "$IFACE" >/dev/null 2>&1; then
    ip -n "$NS_A" link del "$IFACE" 2>/dev/null || true
    ip -n "$NS_B" link del "$IFACE" 2>/dev/null || true
    ip link del "$TMP_A" 2>/dev/null || true
    ip link add "$TMP_A" type veth peer name "$TMP_B"
    ip link set "$TMP_A" netns "$NS_A"
    ip link set "$TMP_B" netns "$NS_B"
    ip -n "$NS_A" link set "$TMP_A" name "$IFACE"
    ip -n "$NS_B" link set "$TMP_B" name "$IFACE"
fi
ip -n "$NS_A" addr replace "$IP_A/24" dev "$IFACE"
ip -n "$NS_B" addr replace "$IP_B/24" dev "$IFACE"
ip -n "$NS_A" link set "$IFACE" up
ip -n "$NS_B" link set "$IFACE" up

# 3. shaping: egress of each end = one direction each ------------------------------------------------
# HTB class at RATE (ceil = RATE) with pfifo, or netem (DELAY) as its leaf. HTB accounts the
# veth's GSO super-packets by their bytes, so the long-run rate holds with offloads on. The bucket
# holds 2 ms at RATE (at least 32 KiB): smaller buckets measured 8-12% below RATE at 1gbit.
BURST="$(echo "$RATE" | awk '{ n = $0 + 0; u = $0; sub(/^[0-9.]+/, "", u);
    m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : 1;
    b = int(n * m * 0.002 / 8); if (b < 32768) b = 32768; print b }')"
for ns in "$NS_A" "$NS_B"; do
    tc -n "$ns" qdisc del dev "$IFACE" root 2>/dev/null || true
    tc -n "$ns" qdisc add dev "$IFACE" root handle 1: htb default 1
    tc -n "$ns" class add dev "$IFACE" parent 1: classid 1:1 htb rate "$RATE" ceil "$RATE" \
        burst "$BURST" cburst "$BURST" quantum 60000
    if [ -n "$DELAY" ]; then
        tc -n "$ns" qdisc add dev "$IFACE" parent 1:1 handle 10: netem delay "$DELAY" limit 100000 || {
            tc -n "$ns" qdisc add dev "$IFACE" parent 1:1 handle 10: pfifo limit 10000
            die "DELAY needs the netem qdisc (sch_netem), which this kernel lacks; run up.sh without DELAY"; }
    else
        tc -n "$ns" qdisc add dev "$IFACE" parent 1:1 handle 10: pfifo limit 10000
    fi
done

# 4. /etc/netns/<ns>: hosts and the ssh client configuration seen inside each namespace ----------
for ns in "$NS_A" "$NS_B"; do
    d="$NETNS_ETC/$ns"
    mkdir -p "$d/ssh"
    printf '127.0.0.1\tlocalhost\n%s\t%s\n%s\t%s\n' "$IP_A" "$HOST_A" "$IP_B" "$HOST_B" > "$d/hosts"
    cp "$STATE/known_hosts" "$d/ssh/ssh_known_hosts"
    cat > "$d/ssh/ssh_config" <<CONF
# dgc test bed (scripts/cluster/up.sh): client configuration inside $ns; replaces /etc/ssh there.
Host $HOST_A $HOST_B $IP_A $IP_B
    IdentityFile $KEY
    IdentitiesOnly yes
    GlobalKnownHostsFile /etc/ssh/ssh_known_hosts
    UserKnownHostsFile /dev/null
    BatchMode yes
    LogLevel ERROR
Host *
    SendEnv LANG LC_*
CONF
done

# 5. sshd in each namespace ------------------------------------------------------------------------
for h in A B; do
    ns_var="NS_$h"; ip_var="IP_$h"; host_var="HOST_$h"
    ns="${!ns_var}"; ip_addr="${!ip_var}"; host="${!host_var}"
    conf="$STATE/sshd_host$h.conf"; pidf="$STATE/sshd_host$h.pid"
    cat > "$conf" <<CONF
# dgc test bed: sshd of host$h ($ns), listening on $ip_addr:22 only.
ListenAddress $ip_addr
Port 22
HostKey $STATE/host${h}_ed25519
PidFile $pidf
AuthorizedKeysFile $STATE/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
X11Forwarding no
PrintMotd no
PrintLastLog no
MaxStartups 64:30:128
MaxSessions 64
LogLevel ERROR
CONF
    if [ -f "$pidf" ] && kill -0 "$(cat "$pidf")" 2>/dev/null && \
       [ "$(ip netns identify "$(cat "$pidf")" 2>/dev/null)" = "$ns" ]; then
        kill -HUP "$(cat "$pidf")"          # running: reread the configuration
    else
        rm -f "$pidf"
        # its own UTS namespace too, so that `hostname` says host$h there, as on a cluster
        # (Gloo resolves the local host name; the machine's real name means nothing inside)
        ip netns exec "$ns" unshare --uts "$HERE/_as_host.sh" "$host" \
            "$SSHD" -f "$conf" -E "$STATE/sshd_host$h.log"
    fi
done

# 6. check: hostA reaches hostB's sshd by name, with the key, over the veth ------------------------
for i in $(seq 1 50); do
    if ip netns exec "$NS_A" ssh -o ConnectTimeout=2 "$HOST_B" true 2>/dev/null && \
       ip netns exec "$NS_B" ssh -o ConnectTimeout=2 "$HOST_A" true 2>/dev/null; then
        echo "$RATE" > "$STATE/rate"; echo "$DELAY" > "$STATE/delay"
        log "up: $HOST_A=$IP_A ($NS_A), $HOST_B=$IP_B ($NS_B), link $IFACE at $RATE${DELAY:+, delay $DELAY} per direction"
        log "run jobs with: scripts/cluster/run.sh [--gloo|--mpi] python ..."
        exit 0
    fi
    sleep 0.1
done
die "sshd does not answer over the link (see $STATE/sshd_host*.log)"
