"""The two-host test bed (scripts/cluster/): set-up, tear-down, and real jobs over ssh across it.

Two network namespaces joined by a tc-shaped veth pair, an sshd in each, and `horovodrun -np 2
-H hostA:1,hostB:1` started from hostA over ssh with Gloo and with MPI; with 2 ranks per host
(-H hostA:2,hostB:2), DGC(exchange="hierarchical") with both, MPI seeing two nodes of two, and
the same under a plain `mpirun` (scripts/cluster/mpirun.sh, no horovodrun) with
hvd.init(comm=MPI.COMM_WORLD). The
tests use their own instance (DGC_CLUSTER_NAME=dgctest, subnet 10.78.0), so they neither see nor
disturb a test bed brought up with `make cluster-up`. They need root, `ip netns`, tc and sshd
(scripts/install.sh installs iproute2 and openssh-server); without them they skip and say which
is missing.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import BIN, ROOT

SCRIPTS = os.path.join(ROOT, "scripts", "cluster")
NAME = "dgctest"
ENV = dict(os.environ, DGC_CLUSTER_NAME=NAME, DGC_CLUSTER_SUBNET="10.78.0",
           PATH=BIN + os.pathsep + os.environ.get("PATH", ""), PYTHONPATH=ROOT,
           TF_CPP_MIN_LOG_LEVEL="3")
STATE = f"/run/{NAME}-cluster"
NS = (f"{NAME}-hostA", f"{NAME}-hostB")


def _prerequisite_missing():
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, sshd)"
    for tool in ("ip", "tc", "unshare", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} not found on PATH"
    if not os.access("/usr/sbin/sshd", os.X_OK):
        return "/usr/sbin/sshd missing: install openssh-server (scripts/install.sh does)"
    probe = subprocess.run(["ip", "netns", "add", f"{NAME}-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns add` is not allowed here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{NAME}-probe"], capture_output=True)
    return None


pytestmark = pytest.mark.skipif(_prerequisite_missing() is not None,
                                reason=str(_prerequisite_missing()))


def sh(script, *args, env=None, timeout=120, check=True):
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, script), *args], cwd=ROOT,
                          env=dict(ENV, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(args)} exited {proc.returncode}:\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def bed_job(launcher, *cmd, env=None, timeout=600):
    """`scripts/cluster/run.sh --gloo|--mpi CMD...` on the bed (``env``: NP, HOSTS, ...); the test
    fails with the job's output unless it exits 0."""
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, "run.sh"), f"--{launcher}", *cmd],
                          cwd=ROOT, env=dict(ENV, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def bed_mpirun(*cmd, env=None, timeout=600):
    """`scripts/cluster/mpirun.sh CMD...`: a plain `mpirun` from hostA across the bed, no
    horovodrun (``env``: NP, HOSTS and what the ranks get with -x); fails as bed_job does."""
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, "mpirun.sh"), *cmd], cwd=ROOT,
                          env=dict(ENV, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True).stdout


def counter(ns, dev, kind):
    out = subprocess.run(["ip", "netns", "exec", ns, "cat",
                          f"/sys/class/net/{dev}/statistics/{kind}"],
                         capture_output=True, text=True, check=True).stdout
    return int(out)


def leftovers():
    """Everything of this test bed's instance that still exists (empty list: nothing)."""
    found = [f"namespace {n}" for n in ip("netns", "list").split() if n.startswith(NAME)]
    found += [f"root-namespace link {line.split(':')[1].strip()}"
              for line in ip("-o", "link", "show").splitlines() if f"{NAME}-" in line]
    found += [f"/etc/netns entry {p}" for p in glob.glob(f"/etc/netns/{NAME}-*")]
    if os.path.exists(STATE):
        found.append(f"state directory {STATE}")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if STATE in cmd:
            found.append(f"process {pid}: {cmd.strip()}")
    return found


@pytest.mark.environment
def test_up_twice_down_twice_leaves_nothing():
    assert not leftovers(), f"left over from an earlier run: {leftovers()}"
    try:
        sh("up.sh", env={"RATE": "100mbit"})
        sh("up.sh", env={"RATE": "100mbit"})                          # idempotent
        # both hosts exist, each with its address on dgc0, the link shaped in both directions
        for ns, addr in zip(NS, ("10.78.0.1/24", "10.78.0.2/24")):
            assert addr in ip("-n", ns, "addr", "show", "dev", "dgc0")
            assert "rate 100Mbit ceil 100Mbit" in subprocess.run(
                ["tc", "-n", ns, "class", "show", "dev", "dgc0"], capture_output=True,
                text=True).stdout
            pids = ip("netns", "pids", ns).split()
            assert len(pids) == 1, f"expected one sshd in {ns}, found {pids}"
            assert os.readlink(f"/proc/{pids[0]}/exe") == "/usr/sbin/sshd"
        # hostA logs in to hostB by name with the test bed's key; hostB has its own host name
        out = subprocess.run(["ip", "netns", "exec", NS[0], "ssh", "hostB", "hostname"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and out.stdout.strip() == "hostB", out.stderr
        # nothing of it is visible outside: no root-namespace links, /etc/hosts untouched
        assert "hostB" not in open("/etc/hosts").read()
        assert not [line for line in ip("-o", "link", "show").splitlines() if f"{NAME}-" in line]
        # a job left running inside a namespace is killed by down.sh too
        job = subprocess.Popen(["ip", "netns", "exec", NS[1], "sleep", "300"])
        for _ in range(50):                                           # wait until it is inside
            if str(job.pid) in ip("netns", "pids", NS[1]).split():
                break
            time.sleep(0.1)
    finally:
        sh("down.sh")
    assert job.wait(timeout=10) == -signal.SIGTERM, "down.sh did not stop the job in hostB"
    sh("down.sh")                                                     # idempotent
    assert leftovers() == []


#: 2 ranks on each host: with either launcher Horovod sees 2 nodes of 2 ranks
TWO_PER_HOST = {"NP": "4", "HOSTS": "hostA:2,hostB:2"}


@pytest.fixture(scope="module")
def bed():
    assert not leftovers(), f"left over from an earlier run: {leftovers()}"
    sh("up.sh", env={"RATE": "1gbit"})
    yield
    sh("down.sh")
    assert leftovers() == []


@pytest.mark.environment
@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_job_over_ssh_goes_over_the_veth(bed, launcher, tmp_path):
    out = tmp_path / "result.json"
    before = {(ns, dev, k): counter(ns, dev, k) for ns in NS for dev in ("dgc0", "lo")
              for k in ("tx_bytes", "rx_bytes")}
    bed_job(launcher, sys.executable, "tests/workers/cluster_worker.py", "--out", str(out),
            timeout=300)
    delta = {k: counter(*k) - v for k, v in before.items()}
    r = json.loads(out.read_text())
    assert r["hosts"] == ["hostA", "hostB"] and r["size"] == 2
    assert r["allreduce_ok"] and r["dgc_identical"]
    assert r["dgc_steps"] == 5 and 0 < r["dgc_wire_bytes"] < r["dgc_dense_bytes"] / 20
    if launcher == "gloo":
        assert r["gloo_iface"] == "dgc0"
    # the 16 MiB allreduce crossed the veth in both directions (ring allreduce, 2 ranks: each rank
    # sends the whole tensor once, half in reduce-scatter and half in allgather) ...
    mib16 = 16 * 2 ** 20
    for ns in NS:
        assert delta[(ns, "dgc0", "tx_bytes")] >= mib16, delta
        assert delta[(ns, "dgc0", "rx_bytes")] >= mib16, delta
    # ... and not over either host's loopback (hostA's rank is launched locally, hostB's over ssh)
    for ns in NS:
        assert delta[(ns, "lo", "tx_bytes")] < 2 * 2 ** 20, delta


@pytest.mark.environment
def test_synthetic_benchmark_bytes_on_the_link(bed, tmp_path):
    """benchmarks/synthetic_benchmark.py across the hosts: its byte accounting against the veth's
    own counter (dense: the whole fp32 gradient set per rank per step; DGC: far less; the DDP
    peers in the same job, dense and PowerSGD, over the same veth)."""
    out = tmp_path / "bench.json"
    proc = bed_job("gloo", sys.executable, "benchmarks/synthetic_benchmark.py", "--model",
                   "resnet50", "--compression", "none,dgc,ddp,ddp-powersgd1", "--compress-ratio",
                   "0.001", "--warmup-steps", "1", "--steps", "1", "--bandwidth", "1gbit",
                   "--json-out", str(out))
    r = json.loads(out.read_text())
    assert r["hosts"] == ["hostA", "hostB"] and r["iface"] == "dgc0"
    dense, dgc = r["runs"]["none"], r["runs"]["dgc"]
    assert dense["bytes"] == r["dense_bytes"] == 4 * 25_557_032
    # dense ring allreduce with 2 ranks: each rank sends the whole gradient set once per step;
    # the veth also carries TCP/IP headers and Horovod's coordination messages
    assert 1.0 <= dense["iface_tx_bytes"] / dense["bytes"] < 1.1, dense
    # DGC at density 0.001: the compressor's count, and the link carries well under 1/10 of dense
    # (the rest of what it carries is mostly Horovod's coordination, ~0.4 MB/s while it waits)
    assert 0.0005 < dgc["density"] <= 0.001
    assert dgc["bytes"] < r["dense_bytes"] / 250       # 1-D tensors dense: about 277x
    assert dgc["iface_tx_bytes"] < r["dense_bytes"] / 10, dgc
    # the DDP peers over the same veth (their own gloo group on dgc0): DDP's ring allreduce
    # carries the whole fp32 gradient set like Horovod's, PowerSGD the P and Q it counts
    ddp, psgd = r["runs"]["ddp"], r["runs"]["ddp-powersgd1"]
    assert ddp["bytes"] == r["dense_bytes"]
    assert 1.0 <= ddp["iface_tx_bytes"] / ddp["bytes"] < 1.1, ddp
    assert psgd["bytes"] < r["dense_bytes"] / 50
    # PowerSGD's payload is small enough that Horovod's idle coordination (~0.3-0.4 MB/s, see
    # DGC above) shows, in proportion to the step's time: measured 878,130 bytes on the veth for
    # 546,444 counted at a 1 s step, 1,137,096 at a 1.43 s step (2026-12-07, loaded machine)
    extra = psgd["iface_tx_bytes"] - psgd["bytes"]
    assert 0 <= extra < 0.1 * psgd["bytes"] + 600_000 * max(psgd["step"]), psgd
    assert psgd["iface_tx_bytes"] < r["dense_bytes"] / 50, psgd
    for run in (ddp, psgd):
        assert run["param_checksums"][0] == run["param_checksums"][1]
    assert "speedup" in proc.stdout and "ideal" in proc.stdout


@pytest.mark.environment
@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_hierarchical_dgc_moves_less_over_the_link_with_two_ranks_per_host(bed, launcher,
                                                                            tmp_path):
    """The last table of `make cluster-bench`: 2 ranks per host (-H hostA:2,hostB:2), flat and
    hierarchical DGC on ResNet-50's shapes. The veth's counters (hostA's side: all that crossed
    the link) show the hierarchical exchange moving less than flat DGC, both far under dense,
    and the table is printed. With MPI too: Open MPI makes each host a node (local size 2,
    cross size 2), the ranks of a host talk through shared memory, the hosts over the veth."""
    out = tmp_path / "bench.json"
    proc = bed_job(launcher, sys.executable, "benchmarks/synthetic_benchmark.py", "--model",
                   "resnet50", "--compression", "dgc,dgc-hier", "--link-table", "--iface", "dgc0",
                   "--warmup-steps", "1", "--steps", "1", "--bandwidth", "1gbit",
                   "--json-out", str(out), env=TWO_PER_HOST)
    r = json.loads(out.read_text())
    assert r["hosts"] == ["hostA", "hostA", "hostB", "hostB"]
    flat, hier = r["runs"]["dgc"], r["runs"]["dgc-hier"]

    def link(run):
        return run["iface_tx_bytes"] + run["iface_rx_bytes"]
    assert 0 < link(hier) < 0.7 * link(flat) < r["dense_bytes"] / 10, (link(hier), link(flat))
    assert hier["node_bytes"] > r["dense_bytes"] / 2        # the dense reduction inside the node
    assert "link bytes/step, both ways (measured)" in proc.stdout


@pytest.fixture(scope="module", params=["horovodrun", "mpirun"])
def hier_mpi(bed, request, tmp_path_factory):
    """tests/workers/hierarchical_worker.py's training job (the one test_torch_hierarchical.py
    runs with Gloo on one machine) under MPI across the two hosts, 2 ranks per host, and the
    bytes each host's veth (dgc0) and loopback sent while it ran. Started by `horovodrun --mpi`
    (scripts/cluster/run.sh) or by a plain `mpirun` (scripts/cluster/mpirun.sh) with the worker
    calling hvd.init(comm=MPI.COMM_WORLD, process_sets="dynamic")."""
    out = tmp_path_factory.mktemp("hier_mpi") / "train.json"
    before = {(ns, dev): counter(ns, dev, "tx_bytes") for ns in NS for dev in ("dgc0", "lo")}
    worker = (sys.executable, "tests/workers/hierarchical_worker.py", "--out", str(out))
    env = dict(TWO_PER_HOST, HOROVOD_FUSION_THRESHOLD="0")
    if request.param == "horovodrun":
        bed_job("mpi", *worker, env=env, timeout=900)
    else:
        bed_mpirun(*worker, "--init", "comm", env=env, timeout=900)
    sent = {k: counter(*k, "tx_bytes") - v for k, v in before.items()}
    r = json.loads(out.read_text())
    assert r["init"] == ("default" if request.param == "horovodrun" else "comm")
    return r, sent


@pytest.mark.environment
def test_hierarchical_dgc_under_mpi_sees_two_nodes_of_two(hier_mpi):
    """`horovodrun --mpi -H hostA:2,hostB:2` across the bed, or a plain `mpirun` of the same
    hosts with hvd.init(comm=MPI.COMM_WORLD): MPI's controller, ranks 0 and 1 on hostA, 2 and 3
    on hostB, one node per host as Horovod sees it (local size 2, cross size 2; on one machine
    MPI makes a single node of 4 whatever the host names). What crossed between the hosts went
    over the veth; inside a host MPI's shared memory carried the node's dense reduction and
    shards (MBs over the run), not TCP over loopback."""
    r, sent = hier_mpi
    assert r["controller"] == "mpi"
    assert r["hosts"] == ["hostA", "hostA", "hostB", "hostB"]
    assert (r["size"], r["local_size"], r["cross_size"]) == (4, 2, 2)
    for ns in NS:
        assert sent[(ns, "dgc0")] > 2 ** 20, sent
        assert sent[(ns, "lo")] < 2 ** 20, sent


def _gloo_checks():
    """test_torch_hierarchical.py's checks of the training job's record, each with its
    arguments, to run on the MPI job's record: the same assertions, not a copy of them."""
    import test_torch_hierarchical as t
    checks = [(t.test_replicas_bit_identical_and_loss_falls, ("hierarchical",)),
              (t.test_replicas_bit_identical_and_loss_falls, ("allgather",)),
              (t.test_hierarchical_trains_like_flat_dgc, ()),
              (t.test_bytes_across_nodes_at_most_one_over_L_of_flat, ()),
              (t.test_cost_model_predicts_the_measured_bytes, ()),
              (t.test_each_rank_keeps_its_shard, ()),
              (t.test_statistics_split_inside_and_across, ()),
              (t.test_ratio_one_equals_dense_momentum_sgd, ()),
              (t.test_clipping_uses_the_nodes_norm_with_N_the_nodes, ("average",)),
              (t.test_clipping_uses_the_nodes_norm_with_N_the_nodes, ("sum",)),
              (t.test_nonfinite_step_poisons_nothing, ("nonfinite",)),
              (t.test_nonfinite_step_poisons_nothing, ("nonfinite_clip",)),
              (t.test_fp16_overflow_skips_the_step_everywhere, ()),
              (t.test_checkpoint_holds_the_shard_and_refuses_another_layout, ())]
    return [pytest.param(f, a, id="-".join([f.__name__[5:], *a])) for f, a in checks]


@pytest.mark.environment
@pytest.mark.parametrize("check,args", _gloo_checks())
def test_hierarchical_dgc_under_mpi_passes_the_gloo_checks(hier_mpi, check, args):
    """Bit-identical replicas and falling loss for both exchanges, a node receiving at most 1/L
    of flat DGC's bytes from the other node (exactly the cost model's), clipping, non-finite
    steps, float16 overflow, checkpoints: every check of the Gloo job, on the MPI job."""
    check(hier_mpi[0], *args)


@pytest.mark.environment
@pytest.mark.parametrize("mode,hosts", [("given", "hostA:2,hostB:2"),
                                        ("static", "hostA:2,hostB:2"),
                                        ("plain", "hostA:2,hostB:1")])
def test_hierarchical_dgc_under_mpi_process_sets_and_errors(bed, mode, hosts, tmp_path):
    """The short launches of test_torch_hierarchical.py under MPI across the hosts: the node
    and cross-node sets passed to hvd.init (MPI communicators made at start) train; without
    dynamic process sets, and with hosts of 2 and 1 ranks, every rank raises the same clear
    error at the first step (none hangs)."""
    out = tmp_path / f"{mode}.json"
    bed_job("mpi", sys.executable, "tests/workers/hierarchical_worker.py", "--mode", mode,
            "--out", str(out), env={"NP": str(sum(int(h[-1]) for h in hosts.split(","))),
                                    "HOSTS": hosts}, timeout=300)
    r = json.loads(out.read_text())
    assert r["controller"] == "mpi" and (r["local_size"], r["cross_size"]) == (2, 2)
    errors = r["errors"]
    if mode == "given":
        assert errors == [None] * 4 and r["identical"] and r["changed"]
    else:
        assert len(errors) == len(r["hosts"]) and len(set(errors)) == 1
        assert ("process_sets='dynamic'" if mode == "static" else
                "ranks [2] on nodes of 1") in errors[0]


@pytest.mark.unit
def test_parse_rate():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from synthetic_benchmark import parse_rate
    assert parse_rate("1gbit") == 1e9 and parse_rate("100mbit") == 1e8
    assert parse_rate("2.5gbit") == 2.5e9 and parse_rate("800") == 800
    for bad in ("fast", "1gbps", "-1gbit", "0mbit"):
        with pytest.raises(ValueError, match="--bandwidth"):
            parse_rate(bad)
