"""Step time of Horovod (dense, fp16, DGC) and PyTorch DDP (dense, fp16, PowerSGD), side by side.

In the spirit of Horovod's synthetic benchmarks: a training loop over parameters with the shapes
of ResNet-50 (161 tensors, 25.6M parameters) or of the paper's PTB language model (2-layer LSTM,
1500 units, 10k vocabulary, 66.0M parameters), both from ``benchmarks/shapes.py``, trained with the
stock ``hvd.DistributedOptimizer`` and, in turn, ``--compression none``, ``fp16`` and ``dgc``, all in
one run, so that the numbers are measured side by side on the same link and the same load. The same
job then trains the same parameters with the peers a user would pick instead, **PyTorch DDP** over
gloo (a ``torch.distributed`` process group of its own, on the same interface): dense
(``ddp``), the fp16 compress hook (``ddp-fp16``) and PowerSGD of rank 1 and 4 (``ddp-powersgd1``,
``ddp-powersgd4``: ``powerSGD_hook`` with error feedback and warm start, compressing from step
2 on, inside the untimed steps; in one DDP bucket, as PowerSGD over gloo hangs or fails with
several, see ``ddp_run``).

``--compression dgc-hier`` is ``DGC(exchange="hierarchical")`` (several ranks per host: dense inside
the host, DGC across hosts; not in the default list); ``--link-table`` adds a table of the bytes the
interface sent and received per step, on the two-host bed with 2 ranks per host all that crossed
the link (``make cluster-bench``'s last table, docs/scaling.md).

``--model resnet18`` is the real thing instead: ResNet-18 (``benchmarks/resnet18.py``, 11.7M
parameters) with real convolutions on a fixed batch of random images per rank (``--batch-size``,
``--image-size``, default 32 of 64 × 64) and a cross-entropy loss, so that what DGC gains is
measured against real compute.

**For the other models the compute is synthetic.** There is no convolution and no LSTM: backward hands every parameter a
gradient ``a_p·cos(t) + b_p·sin(t)`` (fixed Gaussian tensors a_p, b_p with a per-tensor standard
deviation of 0.01/√fan_in, rotated each step t so that the gradient changes), through one autograd
node per parameter, so Horovod's per-parameter hooks fire one by one during backward as in real
training. Local compute (forward + backward + the SGD update, without Horovod) is measured on its
own first, with every rank computing at once, and enters the ideal bound. Real models compute far
longer per step; on this benchmark communication dominates, which is the case DGC is for.

Per compression it prints, over ``--steps`` timed steps after ``--warmup-steps`` untimed ones:

- step time (ms, mean ± std over the timed steps, rank 0); DGC runs at its final density from the
  first step (``warmup_epochs=0``; ``--compress-ratio``, default the library's), i.e. as after
  the warm-up;
- throughput: images/s (ResNet-50, nominal ``--batch-size`` images per rank per step, default 32)
  or tokens/s (LSTM: nominal batch 20 × 35 steps of BPTT = 700 tokens per rank per step), over all
  ranks: size × per-rank batch / step time;
- bytes per step per rank: dense fp32 size (none), half of it (fp16), and for DGC what this rank
  actually sent, from the compressor's statistics (payloads + placeholders + any dense tensors);
  PowerSGD's from its own state (P and Q, plus the tensors it leaves uncompressed); with
  ``--iface`` (default: $HOROVOD_GLOO_IFACE) also the bytes the interface really sent (tx);
- link time: the bytes one rank must push through its link per step at ``--bandwidth``: ring
  allreduce 2(N−1)/N × its size (dense, fp16, PowerSGD), allgather (N−1) × payload (both
  equal the size for N = 2);
- ideal bound = local compute + link time, and step / ideal;
- speedup of each compression over dense allreduce (step time of none / step time);
- where the time goes: backward (incl. Horovod hooks, DGC's compress), synchronize (waiting for the
  collectives, DGC's decompress) and the update, each in ms per step of wall time and of the main
  thread's CPU time, and the whole step's CPU time over all of rank 0's threads (Horovod's
  background thread and Gloo/MPI included). DDP communicates inside backward (its reducer waits
  for the last bucket there), so its synchronize is 0. On a loaded machine CPU time shows what a phase costs
  by itself, wall time what it cost there.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/synthetic_benchmark.py
    scripts/cluster/run.sh --gloo python benchmarks/synthetic_benchmark.py --bandwidth 1gbit
    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/synthetic_benchmark.py \
        --compression dgc,ddp-powersgd1
    make cluster-bench RATE=1gbit

Per-collective detail: set ``HOROVOD_TIMELINE=/path/timeline.json`` in the environment of horovodrun
(one file, written by rank 0's Horovod background thread) and open it in chrome://tracing.
"""
import argparse
import gc
import json
import math
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODELS = {
    # name: (unit, per-rank batch in that unit given the arguments)
    "resnet50": ("images", lambda args: args.batch_size),
    "lstm_lm": ("tokens", lambda args: 20 * 35),
    "resnet18": ("images", lambda args: args.batch_size),          # real convolutions
}
#: The peers a user would pick instead, in the same job: PyTorch DDP over gloo (torch.distributed,
#: its own process group beside Horovod's) with DDP's communication hooks. Value: the hook (None:
#: DDP's own dense fp32 allreduce; "fp16": the fp16 compress hook; an int: PowerSGD of that rank).
DDP_PEERS = {"ddp": None, "ddp-fp16": "fp16", "ddp-powersgd1": 1, "ddp-powersgd4": 4}
COMPRESSIONS = ("none", "fp16", "dgc", "dgc-hier") + tuple(DDP_PEERS)
#: PowerSGD allreduces the gradients densely for its first iterations (its state's
#: start_powerSGD_iter, default 1,000); here it compresses from this step on, within the untimed ones.
POWERSGD_START = 2


def parse_rate(text):
    """tc-style rate ('1gbit', '100mbit', '2.5gbit', '800kbit', or bits/s as a number) → bits/s.

    Raises ValueError naming --bandwidth and the expected form.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(bit|kbit|mbit|gbit)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"--bandwidth must look like 1gbit, 100mbit or a number of bits/s, "
                         f"not {text!r}")
    scale = {"bit": 1, None: 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
    value = float(m.group(1)) * scale
    if value <= 0:
        raise ValueError(f"--bandwidth must be positive, not {text!r}")
    return value


def iface_tx_bytes(iface, way="tx"):
    """Bytes the network interface ``iface`` has sent (``way="rx"``: received; Linux sysfs
    counter, the one scripts/cluster/counters.sh prints), or None."""
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/{way}_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def stats_line(values):
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(1, len(values) - 1))
    return mean, std


def worker(args):
    import horovod.torch as hvd
    import torch

    from shapes import lstm_lm, resnet50

    from dgc_horovod.torch import DGC

    # dgc-hier: DGC(exchange="hierarchical") registers its process sets at its first step
    hvd.init(process_sets="dynamic" if "dgc-hier" in args.compression else None)
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()
    unit, batch_fn = MODELS[args.model]
    per_rank_batch = batch_fn(args)

    class SyntheticGrad(torch.autograd.Function):
        """forward: a scalar 0 that depends on p; backward: d/dp = a·cos(t) + b·sin(t)."""

        @staticmethod
        def forward(ctx, p, a, b, c, s):
            ctx.sources = (a, b, c, s)
            return p.new_zeros(())

        @staticmethod
        def backward(ctx, grad_out):
            a, b, c, s = ctx.sources
            return a.mul(c).add_(b, alpha=s), None, None, None, None

    class SyntheticModel(torch.nn.Module):
        """Parameters of the model's shapes; forward(step) a loss whose backward hands each one
        its rotating synthetic gradient, through one autograd node per parameter."""

        def __init__(self, shapes, sources):
            super().__init__()
            self.names = [n for n, _ in shapes]
            self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(shape))
                                                 for _, shape in shapes)
            self.sources = sources

        def named_for_horovod(self):
            return list(zip(self.names, self.params))

        def forward(self, step):
            c, s = math.cos(0.1 * step), math.sin(0.1 * step)
            return sum(SyntheticGrad.apply(p, a, b, c, s)
                       for p, (a, b) in zip(self.params, self.sources))

    class RealModel(torch.nn.Module):
        """ResNet-18 with real convolutions on a fixed batch of random images (labels too), a
        different one on each rank; forward(step) the cross-entropy loss."""

        def __init__(self):
            super().__init__()
            from resnet18 import ResNet18
            torch.manual_seed(0)                              # the same initial weights everywhere
            self.net = ResNet18()
            gen = torch.Generator().manual_seed(1000 + rank)
            self.x = torch.randn(per_rank_batch, 3, args.image_size, args.image_size,
                                 generator=gen)
            self.y = torch.randint(0, 1000, (per_rank_batch,), generator=gen)

        def named_for_horovod(self):
            return list(self.net.named_parameters())

        def forward(self, step):
            return torch.nn.functional.cross_entropy(self.net(self.x), self.y)

    if args.model == "resnet18":
        def new_model():
            return RealModel()
    else:
        shapes = {"resnet50": resnet50, "lstm_lm": lstm_lm}[args.model]()
        # fixed gradient sources, identical for every compression (different on each rank)
        gen = torch.Generator().manual_seed(1000 + rank)
        sources = []
        for _, shape in shapes:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
            std = 0.01 / math.sqrt(fan_in)
            sources.append((torch.randn(shape, generator=gen) * std,
                            torch.randn(shape, generator=gen) * std))

        def new_model():
            return SyntheticModel(shapes, sources)

    def barrier():
        hvd.allreduce(torch.zeros(1), name="bench.barrier")

    hosts = hvd.allgather_object(os.uname().nodename)
    iface = args.iface if args.iface is not None else os.environ.get("HOROVOD_GLOO_IFACE", "")
    if iface_tx_bytes(iface) is None:
        iface = ""
    total_steps = args.warmup_steps + args.steps

    # 1. local compute alone: every rank at once, no Horovod hooks
    model = new_model()
    dense_bytes = 4 * sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    barrier()
    compute, compute_cpu = [], []
    for step in range(total_steps):
        c0, t0 = time.process_time(), time.perf_counter()
        opt.zero_grad()
        model(step).backward()
        opt.step()
        if step >= args.warmup_steps:
            compute.append(time.perf_counter() - t0)
            compute_cpu.append(time.process_time() - c0)
    compute = hvd.allreduce(torch.tensor(compute, dtype=torch.float64), op=hvd.Average,
                            name="bench.compute").tolist()
    del opt, model
    gc.collect()

    results = {"model": args.model, "size": size, "hosts": hosts, "iface": iface,
               "bandwidth_bps": args.bandwidth_bps, "unit": unit,
               "per_rank_batch": per_rank_batch, "dense_bytes": dense_bytes,
               "warmup_steps": args.warmup_steps, "steps": args.steps, "threads": args.threads,
               "compute_s": stats_line(compute), "compute_cpu_s": stats_line(compute_cpu)[0],
               "loadavg_start": os.getloadavg(), "runs": {}}

    def ddp_run(name):
        """One DDP peer (``DDP_PEERS[name]``) over the process group made by ``ddp_group``: the
        same timed loop as Horovod's (zero_grad, forward + backward, SGD step with momentum 0.9),
        no synchronize phase (DDP's reducer waits for its last bucket inside backward)."""
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        hook = DDP_PEERS[name]
        # PowerSGD over gloo hangs or fails ("Received data size doesn't match") with several DDP
        # buckets (its callbacks issue collectives in a different order on each rank); one bucket
        # works. The others keep DDP's default buckets, as a user would.
        cap = {"bucket_cap_mb": dense_bytes / 2 ** 20 + 1} if isinstance(hook, int) else {}
        ddp = DistributedDataParallel(new_model(), **cap)
        state = None
        if hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif isinstance(hook, int):
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=hook,
                                                start_powerSGD_iter=POWERSGD_START)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-6, momentum=0.9)
        phases = {"step": [], "backward": [], "synchronize": [], "update": []}
        cpu = {"step": [], "backward": [], "synchronize": [], "update": []}
        warmup = max(args.warmup_steps, POWERSGD_START) if state else args.warmup_steps
        tx0 = numel0 = None
        for step in range(warmup + args.steps):
            if step == warmup:
                dist.barrier()
                tx0 = iface_tx_bytes(iface)
                numel0 = state.total_numel_after_compression if state else None
            c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
            opt.zero_grad()
            ddp(step).backward()
            c1, t1 = time.thread_time(), time.perf_counter()
            opt.step()
            c2, p2, t2 = time.thread_time(), time.process_time(), time.perf_counter()
            if step >= warmup:
                for k, v in (("step", t2 - t0), ("backward", t1 - t0), ("synchronize", 0.0),
                             ("update", t2 - t1)):
                    phases[k].append(v)
                for k, v in (("step", p2 - p0), ("backward", c1 - c0), ("synchronize", 0.0),
                             ("update", c2 - c1)):
                    cpu[k].append(v)
        tx1 = iface_tx_bytes(iface)
        run = {k: stats_line(v) for k, v in phases.items()}
        run["cpu"] = {k: stats_line(v)[0] for k, v in cpu.items()}
        run["step_all"] = phases["step"]
        if state:       # what PowerSGD allreduced: P, Q and the tensors it left uncompressed
            run["bytes"] = 4 * (state.total_numel_after_compression - numel0) / args.steps
        else:
            run["bytes"] = dense_bytes if hook is None else dense_bytes / 2
        run["link_bytes"] = 2 * (size - 1) / size * run["bytes"]        # ring allreduce
        run["iface_tx_bytes"] = (tx1 - tx0) / args.steps if iface else None
        # the replicas agree (a checksum of the trained parameters on every rank)
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).double()
        run["param_checksums"] = hvd.allgather_object(float(flat.abs().sum()) + float(flat.sum()))
        del opt, ddp, state
        gc.collect()
        return run

    for name in args.compression:
        if name in DDP_PEERS:
            if not ddp_group(hvd, iface, args):
                continue
            results["runs"][name] = ddp_run(name)
            continue
        model = new_model()
        params, named = list(model.parameters()), model.named_for_horovod()
        dgc = None
        if name in ("dgc", "dgc-hier"):
            ratio = {} if args.compress_ratio is None else {"compress_ratio": args.compress_ratio}
            exchange = "hierarchical" if name == "dgc-hier" else "allgather"
            dgc = DGC(momentum=0.9, warmup_epochs=0, exchange=exchange, **ratio)
            compression, momentum = dgc, 0.0          # DGC applies the momentum itself
        else:
            compression = hvd.Compression.none if name == "none" else hvd.Compression.fp16
            momentum = 0.9
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=1e-6, momentum=momentum),
                                       named_parameters=named, compression=compression)
        barrier()
        phases = {"step": [], "backward": [], "synchronize": [], "update": []}
        cpu = {"step": [], "backward": [], "synchronize": [], "update": []}
        tx0 = rx0 = start_stats = profiler = None
        for step in range(total_steps):
            if step == args.warmup_steps:
                barrier()
                tx0, rx0 = iface_tx_bytes(iface), iface_tx_bytes(iface, "rx")
                start_stats = dgc.total_stats.copy() if dgc else None
                if args.profile and rank == 0 and name == args.compression[-1]:
                    import cProfile
                    profiler = cProfile.Profile()
                    profiler.enable()
            c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
            opt.zero_grad()
            model(step).backward()
            c1, t1 = time.thread_time(), time.perf_counter()
            opt.synchronize()
            c2, t2 = time.thread_time(), time.perf_counter()
            with opt.skip_synchronize():
                opt.step()
            c3, p3, t3 = time.thread_time(), time.process_time(), time.perf_counter()
            if step >= args.warmup_steps:
                for k, v in (("step", t3 - t0), ("backward", t1 - t0), ("synchronize", t2 - t1),
                             ("update", t3 - t2)):
                    phases[k].append(v)
                # CPU seconds: the main thread per phase; the whole process (Horovod's background
                # thread and Gloo/MPI included) per step. Less sensitive to other load than wall time.
                for k, v in (("step", p3 - p0), ("backward", c1 - c0), ("synchronize", c2 - c1),
                             ("update", c3 - c2)):
                    cpu[k].append(v)
        tx1, rx1 = iface_tx_bytes(iface), iface_tx_bytes(iface, "rx")
        if profiler:
            import pstats
            profiler.disable()
            print(f"# cProfile of rank 0's main thread, {name}, {args.steps} timed steps "
                  f"(Horovod's background thread is not included):")
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(args.profile_sort).print_stats(
                args.profile)
        run = {k: stats_line(v) for k, v in phases.items()}
        run["cpu"] = {k: stats_line(v)[0] for k, v in cpu.items()}
        run["step_all"] = phases["step"]
        if dgc:
            st = dgc.total_stats.since(start_stats)
            run["bytes"] = st.wire_bytes / st.steps
            run["compress_s"] = st.compress_seconds / st.steps
            run["density"] = st.selected / st.elements
            link_bytes = (size - 1) * run["bytes"]                  # allgather: to N-1 ranks
            if name == "dgc-hier":      # what leaves the node: DGC across nodes, dense allreduce
                run["node_bytes"] = st.node_bytes / st.steps
                run["bytes"] -= run["node_bytes"]
                link_bytes = (hvd.cross_size() - 1) * run["bytes"]
        else:
            run["bytes"] = dense_bytes if name == "none" else dense_bytes / 2
            link_bytes = 2 * (size - 1) / size * run["bytes"]       # ring allreduce
        run["link_bytes"] = link_bytes
        run["iface_tx_bytes"] = (tx1 - tx0) / args.steps if iface else None
        run["iface_rx_bytes"] = (rx1 - rx0) / args.steps if iface else None
        results["runs"][name] = run
        del opt, model, params, named, dgc, compression
        gc.collect()

    if any(name in DDP_PEERS for name in args.compression) and ddp_group.made:
        import torch.distributed as dist
        dist.destroy_process_group()
    results["loadavg_end"] = os.getloadavg()
    if rank == 0:
        report(results, args)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(results, f, indent=1)


def iface_ipv4(iface):
    """The IPv4 address of network interface ``iface`` (Linux ioctl SIOCGIFADDR), or None."""
    import fcntl
    import socket
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def ddp_group(hvd, iface, args):
    """Make torch.distributed's default gloo process group once, for the DDP peers: rank 0 opens a
    TCPStore on its address on ``iface`` (Horovod's interface on the bed; loopback when every
    rank runs on one host) and Horovod broadcasts where it listens. True when the group exists,
    False (with a note on rank 0) when no address to meet at can be found."""
    import socket

    import torch.distributed as dist
    if ddp_group.made:
        return True
    single_host = hvd.local_size() == hvd.size()
    if iface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    elif single_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    addr = None
    if hvd.rank() == 0:
        addr = (iface_ipv4(iface) if iface else
                "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname()))
    addr = hvd.broadcast_object(addr, 0, name="bench.ddp.addr")
    if addr is None:
        if hvd.rank() == 0:
            print(f"# DDP peers left out: no IPv4 address on interface {iface!r} for the "
                  f"TCPStore (pass --iface)")
        return False
    store, port = None, None
    if hvd.rank() == 0:
        store = dist.TCPStore(addr, 0, hvd.size(), True, wait_for_workers=False)
        port = store.port
    port = hvd.broadcast_object(port, 0, name="bench.ddp.port")
    if store is None:
        store = dist.TCPStore(addr, port, hvd.size(), False)
    dist.init_process_group("gloo", store=store, rank=hvd.rank(), world_size=hvd.size())
    ddp_group.made = True
    return True


ddp_group.made = False


def report(r, args):
    bw = r["bandwidth_bps"]
    compute = r["compute_s"][0]
    runs = r["runs"]
    base = runs.get("none", {}).get("step", (None,))[0]
    link = (f"link {bw / 1e6:g} Mbit/s per direction (nominal)" if bw else
            "no --bandwidth given: no ideal bound")
    print(f"# {r['model']}: {r['dense_bytes'] / 2**20:.1f} MiB of fp32 gradients; {r['size']} "
          f"ranks on hosts {', '.join(r['hosts'])}; {link}")
    print(f"# {r['warmup_steps']} warm-up + {r['steps']} timed steps, {r['threads']} torch thread(s) "
          f"per rank, nominal {r['per_rank_batch']} {r['unit']} per rank per step; load average "
          f"{r['loadavg_start'][0]:.2f} at start, {r['loadavg_end'][0]:.2f} at end")
    kind = "real" if r["model"] == "resnet18" else "synthetic"
    print(f"# local compute alone ({kind} forward+backward+SGD update, all ranks at once): "
          f"{1e3 * compute:.1f} ± {1e3 * r['compute_s'][1]:.1f} ms wall, "
          f"{1e3 * r['compute_cpu_s']:.1f} ms CPU (rank 0)")
    head = (f"{'compression':>13} | {'step ms':>15} | {r['unit'] + '/s':>10} | {'bytes/step/rank':>15} | "
            f"{'measured tx':>11} | {'link ms':>8} | {'ideal ms':>8} | {'step/ideal':>10} | "
            f"{'speedup':>7}")
    print(head)
    print("-" * len(head))
    for name, run in runs.items():
        step, std = run["step"]
        thr = r["size"] * r["per_rank_batch"] / step
        link = 8 * run["link_bytes"] / bw if bw else None
        ideal = compute + link if bw else None
        tx = run["iface_tx_bytes"]
        print(f"{name:>13} | {1e3 * step:8.1f} ± {1e3 * std:5.1f} | {thr:10.0f} | "
              f"{run['bytes']:15,.0f} | {(f'{tx:,.0f}' if tx is not None else 'n/a'):>11} | "
              f"{(f'{1e3 * link:.1f}' if bw else 'n/a'):>8} | {(f'{1e3 * ideal:.1f}' if bw else 'n/a'):>8} | "
              f"{(f'{step / ideal:.2f}x' if bw else 'n/a'):>10} | "
              f"{(f'{base / step:.2f}x' if base else 'n/a'):>7}")
    peers = [n for n in runs if n.startswith("ddp-powersgd")]
    if "dgc" in runs and peers:
        print("# DGC against PowerSGD (step time of PowerSGD / step time of DGC): " + ", ".join(
            f"{n[4:]} {runs[n]['step'][0] / runs['dgc']['step'][0]:.2f}x" for n in peers))
    print("where the time goes, rank 0, ms per step (mean), wall / CPU of the main thread: "
          "backward incl. hooks | synchronize (wait + decompress) | update | whole step, CPU of "
          "all threads | DGC compress (inside backward, wall)")
    for name, run in runs.items():
        extra = (f" | {1e3 * run['compress_s']:.1f} (density {run['density']:.4f})"
                 if "compress_s" in run else "")
        c = run["cpu"]
        print(f"{name:>13}: {1e3 * run['backward'][0]:.1f} / {1e3 * c['backward']:.1f} | "
              f"{1e3 * run['synchronize'][0]:.1f} / {1e3 * c['synchronize']:.1f} | "
              f"{1e3 * run['update'][0]:.1f} / {1e3 * c['update']:.1f} | "
              f"{1e3 * run['step'][0]:.1f} / {1e3 * c['step']:.1f}{extra}")
    if args.markdown:
        print(f"\n| {r['model']} | step (ms) | {r['unit']}/s | bytes/step/rank (tx measured) | "
              f"ideal (ms) | step / ideal | speedup vs none |")
        print("|---|---|---|---|---|---|---|")
        for name, run in runs.items():
            step, std = run["step"]
            ideal = compute + 8 * run["link_bytes"] / bw if bw else None
            tx = run["iface_tx_bytes"]
            print(f"| {name} | {1e3 * step:.0f} ± {1e3 * std:.0f} | "
                  f"{r['size'] * r['per_rank_batch'] / step:,.0f} | {run['bytes']:,.0f}"
                  f"{f' ({tx:,.0f})' if tx is not None else ''} | "
                  f"{f'{1e3 * ideal:.0f}' if bw else 'n/a'} | {f'{step / ideal:.1f}x' if bw else 'n/a'} | "
                  f"{f'{base / step:.2f}x' if base else 'n/a'} |")
    if args.link_table:
        link_table(r)
    sys.stdout.flush()


def link_table(r):
    """The Markdown table of ``--link-table``: per compression, the step time and the bytes the
    interface carried per step both ways (on the bed: hostA's side of the link, i.e. all that
    crossed it), beside what DGC counted (this rank's bytes to other nodes)."""
    runs = r["runs"]
    base = runs.get("none", {}).get("step", (None,))[0]
    hosts = sorted(set(r["hosts"]))
    print(f"\n| {r['model']}, {r['size']} ranks on {len(hosts)} hosts | step (ms) | "
          f"link bytes/step, both ways (measured) | of which {hosts[0]} sent | "
          f"bytes/step/rank sent (counted; dgc-hier: less inside the node) | speedup vs none |")
    print("|---|---|---|---|---|---|")
    for name, run in runs.items():
        step, std = run["step"]
        tx, rx = run.get("iface_tx_bytes"), run.get("iface_rx_bytes")
        both = f"{tx + rx:,.0f}" if tx is not None and rx is not None else "n/a"
        print(f"| {name} | {1e3 * step:.0f} ± {1e3 * std:.0f} | {both} | "
              f"{f'{tx:,.0f}' if tx is not None else 'n/a'} | {run['bytes']:,.0f} | "
              f"{f'{base / step:.2f}x' if base else 'n/a'} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="resnet50",
                    help="gradient shapes (benchmarks/shapes.py)")
    ap.add_argument("--compression", default=",".join(c for c in COMPRESSIONS
                                                      if c != "dgc-hier"),
                    help="comma-separated, run in this order in one job: Horovod's none, fp16 "
                         "and dgc, then DDP's ddp, ddp-fp16, ddp-powersgd1, ddp-powersgd4 "
                         "(default: all of these); dgc-hier: DGC(exchange='hierarchical'), for "
                         "several ranks per host")
    ap.add_argument("--link-table", action="store_true",
                    help="also print, as Markdown, the bytes the interface (--iface) sent and "
                         "received per step: on the two-host bed with rank 0 on hostA, the "
                         "inter-host link's bytes, whatever the ranks per host")
    ap.add_argument("--warmup-steps", type=int, default=2, help="untimed steps per compression")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per compression")
    ap.add_argument("--batch-size", type=int, default=32,
                    help="images per rank per step (nominal for resnet50, real for resnet18)")
    ap.add_argument("--image-size", type=int, default=64,
                    help="side of resnet18's random images in pixels (default 64)")
    ap.add_argument("--bandwidth", default=None,
                    help="link rate per direction for the ideal bound, e.g. 1gbit or 100mbit")
    ap.add_argument("--compress-ratio", type=float, default=None,
                    help="DGC's final density (default: the library's, DGCConfig().compress_ratio)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--iface", default=None,
                    help="network interface whose tx bytes to count (default $HOROVOD_GLOO_IFACE)")
    ap.add_argument("--json-out", default=None, help="rank 0 writes all numbers here")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile rank 0's timed steps of the last compression; print the top N")
    ap.add_argument("--profile-sort", default="tottime", choices=["tottime", "cumulative"],
                    help="order of --profile's rows: own time (default) or time including callees")
    args = ap.parse_args(argv)
    args.compression = [c.strip() for c in args.compression.split(",") if c.strip()]
    bad = [c for c in args.compression if c not in COMPRESSIONS]
    if bad or not args.compression:
        ap.error(f"--compression takes a comma-separated list of {', '.join(COMPRESSIONS)}, "
                 f"not {bad or args.compression}")
    if args.steps < 1 or args.warmup_steps < 0:
        ap.error("--steps must be >= 1 and --warmup-steps >= 0")
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    if args.batch_size < 1 or args.image_size < 32:
        ap.error("--batch-size must be >= 1 and --image-size >= 32")
    if args.compress_ratio is not None and not 0 < args.compress_ratio <= 1:
        ap.error(f"--compress-ratio must be in (0, 1], not {args.compress_ratio}")
    try:
        args.bandwidth_bps = parse_rate(args.bandwidth) if args.bandwidth else None
    except ValueError as e:
        ap.error(str(e))
    worker(args)


if __name__ == "__main__":
    main()
