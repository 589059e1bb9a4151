"""Measure the test bed's link: one TCP stream from hostA to hostB, payload Mbit/s.

    python scripts/cluster/throughput.py [--mib 200]

Run as root with the bed up (scripts/cluster/up.sh). It starts a receiver inside hostB's namespace
and a sender inside hostA's (both this same file, via `ip netns exec`), and prints the receiver's
payload rate, the bytes hostA's dgc0 sent meanwhile, and the tc rate in force. The payload rate of
a shaped link is at most ~95.6% of the rate (1448 bytes of TCP payload per 1514-byte frame).
"""
import argparse
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PORT = 5999


def receive(addr, nbytes):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, PORT))
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    got, t0 = 0, None
    while got < nbytes:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        if t0 is None:
            t0 = time.perf_counter()
        got += len(chunk)
    dt = time.perf_counter() - t0
    print(f"{got * 8 / dt / 1e6:.1f} Mbit/s payload ({got / 2**20:.0f} MiB in {dt:.2f} s)", flush=True)


def send(host, nbytes):
    conn = socket.create_connection((host, PORT))
    block = b"\0" * (1 << 20)
    for _ in range(nbytes >> 20):
        conn.sendall(block)
    conn.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=200, help="MiB to send (default 200)")
    ap.add_argument("--role", choices=["receive", "send"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mib < 1:
        ap.error("--mib must be >= 1")
    nbytes = args.mib << 20
    if args.role == "receive":
        return receive(socket.gethostbyname("hostB"), nbytes)
    if args.role == "send":
        return send("hostB", nbytes)
    env = dict(os.environ)
    names = subprocess.run(["bash", "-c", f". {HERE}/common.sh; echo $NS_A $NS_B $IFACE"],
                           capture_output=True, text=True, check=True).stdout.split()
    ns_a, ns_b, iface = names

    def tx():
        return int(subprocess.run(["ip", "netns", "exec", ns_a, "cat",
                                   f"/sys/class/net/{iface}/statistics/tx_bytes"],
                                  capture_output=True, text=True, check=True).stdout)
    rate = subprocess.run(["tc", "-n", ns_a, "class", "show", "dev", iface],
                          capture_output=True, text=True).stdout.strip()
    rx = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, __file__, "--role",
                           "receive", "--mib", str(args.mib)], stdout=subprocess.PIPE, text=True,
                          env=env)
    assert rx.stdout.readline().strip() == "ready"
    before = tx()
    subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, __file__, "--role", "send",
                    "--mib", str(args.mib)], check=True, env=env)
    result = rx.stdout.read().strip()
    rx.wait()
    print(f"{result}; {iface} of {ns_a} sent {tx() - before:,} bytes; tc: {rate}")


if __name__ == "__main__":
    main()
