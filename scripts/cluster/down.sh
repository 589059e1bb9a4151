#!/usr/bin/env bash
# Remove everything scripts/cluster/up.sh made: every process inside the two namespaces (sshd, and
# any job left running), the namespaces themselves (which deletes the veth pair and its tc
# qdiscs), a half-made veth pair in the root namespace, /etc/netns/<ns>/, the state directory, and
# /run/sshd and /etc/netns if up.sh created them. Idempotent: safe to run when nothing is up.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/common.sh"
need_root

ns_pids() { ip netns pids "$1" 2>/dev/null || true; }
for ns in "$NS_A" "$NS_B"; do
    ns_exists "$ns" || continue
    pids="$(ns_pids "$ns")"
    if [ -n "$pids" ]; then
        log "stopping processes in $ns: $(echo $pids)"
        kill -TERM $pids 2>/dev/null || true
        for i in $(seq 1 30); do [ -z "$(ns_pids "$ns")" ] && break; sleep 0.1; done
        pids="$(ns_pids "$ns")"
        [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
        for i in $(seq 1 30); do [ -z "$(ns_pids "$ns")" ] && break; sleep 0.1; done
    fi
    ip netns del "$ns" || log "could not delete namespace $ns"
done
# sshd processes recorded by up.sh that are somehow outside the namespaces (never expected)
for pidf in "$STATE"/sshd_host*.pid; do
    [ -f "$pidf" ] || continue
    pid="$(cat "$pidf")"
    if [ -n "$pid" ] && [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(command -v sshd || echo /usr/sbin/sshd)" ]; then
        kill -TERM "$pid" 2>/dev/null || true
    fi
done
ip link del "$TMP_A" 2>/dev/null || true
ip link del "$TMP_B" 2>/dev/null || true
rm -rf "${NETNS_ETC:?}/$NS_A" "${NETNS_ETC:?}/$NS_B"
if [ -f "$STATE/created-etc-netns" ]; then rmdir "$NETNS_ETC" 2>/dev/null || true; fi
if [ -f "$STATE/created-run-sshd" ]; then rmdir /run/sshd 2>/dev/null || true; fi
rm -rf "${STATE:?}"
log "down: namespaces, veth, sshd, /etc/netns entries and $STATE removed"
