"""Projection of the hierarchical exchange's cost (issue #40): 8 GPUs per node, 2 … 64 nodes.

The cost model is dgc_horovod/core/cost.py (its docstring holds the equations and the
assumptions; tests/test_cost.py and tests/test_torch_hierarchical.py check its bytes against what
DGC counts). This script prices one step's gradient exchange for ResNet-50's and the paper's
LSTM LM's gradient shapes (benchmarks/shapes.py) at 1, 10 and 25 Gbit/s between nodes, for
Horovod's hierarchical dense allreduce (``HOROVOD_HIERARCHICAL_ALLREDUCE=1``), flat DGC
(``exchange="allgather"``, every GPU a worker) and hierarchical DGC (``exchange="hierarchical"``,
every node a worker), and, in the table, Horovod's flat dense ring. It prints the table (time
per step, bytes through a node's network card per step) and writes the PNG.

    python benchmarks/hierarchical_cost.py [--png docs/hierarchical.png] [--density 0.001]
"""
import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from scaling import ALPHA, model_tensors  # noqa: E402

from dgc_horovod.core import DGCConfig, cost  # noqa: E402

LOCAL_SIZE = 8
NODES = (2, 4, 8, 16, 32, 64)
GBITS = (1, 10, 25)
#: Assumed links inside a node: bytes/s per GPU each way and latency per ring step (NVLink-class;
#: PCIe 4.0 x16 is about 25 GB/s)
INTRA_BANDWIDTH = 100e9
INTRA_ALPHA = 5e-6
MODELS = {"resnet50": "ResNet-50 (25.6M)", "lstm_lm": "LSTM LM 2×1500 (66.0M)"}
LABELS = {"dense_ring": "dense, flat ring", "dense_hierarchical": "dense, Horovod hierarchical",
          "dgc": "flat DGC (allgather)", "dgc_hierarchical": "hierarchical DGC"}


def card_bytes(tensors, cfg, density, L, M):
    """{scheme: bytes through a node's network card per step, each way} (the ring algorithms of
    core/cost.py: dense 2·(N − 1)/N·D or 2·(M − 1)/M·D; DGC the allreduce of what is not sent
    sparse plus (N − 1)·F, or (M − 1)·Σ_j P_j)."""
    N = L * M
    D = 4 * sum(n for _, n, _ in tensors)
    flat = cost.flat_dgc_bytes(tensors, cfg, density, L, M)
    hier = cost.hierarchical_dgc_bytes(tensors, cfg, density, L, M)
    ar = lambda b: 2 * (M - 1) / M * b     # noqa: E731  (Horovod's hierarchical allreduce)
    return {"dense_ring": 2 * (N - 1) / N * D, "dense_hierarchical": ar(D),
            "dgc": ar(flat["allreduce"]) + (N - 1) * flat["frame"],
            "dgc_hierarchical": ar(hier["allreduce"]) + (M - 1) * sum(hier["cross"])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--png", default=None, help="write the projection's plot here")
    p.add_argument("--density", type=float, default=None,
                   help="DGC's density after warm-up (default: DGCConfig's compress_ratio)")
    args = p.parse_args(argv)
    # flat DGC's bytes (core/cost.py) do not depend on the exchange setting
    cfg = DGCConfig(environ={}, exchange="hierarchical",
                    **({} if args.density is None else {"compress_ratio": args.density}))
    density = cfg.compress_ratio
    print(f"Assumptions: {LOCAL_SIZE} GPUs per node; between nodes one network card per node "
          f"(1, 10, 25 Gbit/s each way), {ALPHA * 1e6:.0f} µs per ring step; inside a node "
          f"{INTRA_BANDWIDTH / 1e9:.0f} GB/s per GPU, {INTRA_ALPHA * 1e6:.0f} µs per ring step; "
          f"DGC density {density} after warm-up, DGCConfig's other defaults; communication "
          "only (no compression, decoding, or overlap with the backward pass).\n")
    table = {}
    for name in MODELS:
        ts = model_tensors(name)
        print(f"{MODELS[name]}: communication ms per step, by nodes M (N = {LOCAL_SIZE}·M GPUs)")
        print("| link | exchange | " + " | ".join(f"M={m}" for m in NODES) + " |")
        print("|---|---|" + "---:|" * len(NODES))
        for gbit in GBITS:
            beta = gbit * 1e9 / 8
            rows = {s: [] for s in cost.SCHEMES}
            for M in NODES:
                t = cost.step_seconds(ts, cfg, density, LOCAL_SIZE, M, beta, INTRA_BANDWIDTH,
                                      ALPHA, INTRA_ALPHA)
                for s in cost.SCHEMES:
                    rows[s].append(t[s] * 1e3)
            for s in cost.SCHEMES:
                table[name, gbit, s] = rows[s]
                print(f"| {gbit} Gbit/s | {LABELS[s]} | "
                      + " | ".join(f"{v:,.1f}" for v in rows[s]) + " |")
        print(f"\n{MODELS[name]}: MB through a node's network card per step (each way)")
        print("| exchange | " + " | ".join(f"M={m}" for m in NODES) + " |")
        print("|---|" + "---:|" * len(NODES))
        per = [card_bytes(ts, cfg, density, LOCAL_SIZE, M) for M in NODES]
        for s in cost.SCHEMES:
            print(f"| {LABELS[s]} | " + " | ".join(f"{b[s] / 1e6:,.2f}" for b in per) + " |")
        h = cost.hierarchical_dgc_bytes(ts, cfg, density, LOCAL_SIZE, 2)
        print(f"\nhierarchical DGC inside a node, per GPU and step: "
              f"{h['node'][0][0] / 1e6:,.1f} MB sent as DGC counts it (node_bytes), "
              f"{h['node_ring'] / 1e6:,.1f} MB over a ring\n")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(len(MODELS), len(GBITS), figsize=(13, 7.5), squeeze=False)
        styles = {"dense_hierarchical": ("gray", "s"), "dgc": ("tab:red", "o"),
                  "dgc_hierarchical": ("tab:blue", "^")}
        for i, name in enumerate(MODELS):
            for j, gbit in enumerate(GBITS):
                ax = axes[i][j]
                for s, (color, marker) in styles.items():
                    ax.plot(NODES, table[name, gbit, s], color=color, marker=marker,
                            label=LABELS[s])
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xticks(NODES)
                ax.set_xticklabels([str(m) for m in NODES])
                ax.set_title(f"{MODELS[name]}, {gbit} Gbit/s between nodes", fontsize=9)
                ax.set_xlabel(f"nodes M ({LOCAL_SIZE} GPUs each)", fontsize=8)
                ax.set_ylabel("communication per step (ms, model)", fontsize=8)
                ax.grid(True, which="both", alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Cost model (dgc_horovod/core/cost.py): density {density}, "
                     f"{ALPHA * 1e6:.0f} µs per ring step between nodes, "
                     f"{INTRA_BANDWIDTH / 1e9:.0f} GB/s and {INTRA_ALPHA * 1e6:.0f} µs inside; "
                     "communication only", fontsize=10)
        fig.tight_layout()
        fig.savefig(args.png, dpi=100)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
