#!/usr/bin/env bash
# Print the byte counters of the link as seen from hostA: "tx_bytes rx_bytes" of dgc0 in dgc-hostA
# (tx = hostA -> hostB, rx = hostB -> hostA).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/common.sh"
ip netns exec "$NS_A" cat "/sys/class/net/$IFACE/statistics/tx_bytes" "/sys/class/net/$IFACE/statistics/rx_bytes" | paste -sd' '
