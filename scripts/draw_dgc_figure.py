"""Draw docs/dgc_pipeline.png: one DGC training step on one rank, as this package runs it.

Usage: ``python scripts/draw_dgc_figure.py [OUTPUT]`` (default docs/dgc_pipeline.png;
``make docs``). Matplotlib with the Agg backend; no other dependency.
"""
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt                          # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LOCAL, WIRE, HOROVOD = "#dbe9f6", "#fde2c8", "#e2f0d9"


def box(ax, x, y, w, h, title, body, color):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02",
                                fc=color, ec="#333333", lw=1.2))
    ax.text(x, y + h / 2 - 0.11, title, ha="center", va="top", fontsize=11, weight="bold")
    ax.text(x, y + h / 2 - 0.42, body, ha="center", va="top", fontsize=9.3, linespacing=1.35)


def arrow(ax, a, b, text=None, style="-|>", color="#333333", ls="-", rad=0.0, dx=0.0, dy=0.12):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle=style, mutation_scale=16, color=color, lw=1.6,
                                 ls=ls, connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((a[0] + b[0]) / 2 + dx, (a[1] + b[1]) / 2 + dy, text, ha="center", va="bottom",
                fontsize=8.8, color=color, style="italic")


def draw(out):
    fig, ax = plt.subplots(figsize=(16, 8.2), dpi=110)
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 8.2)
    ax.axis("off")
    ax.text(8, 7.95, "One DGC step on rank r of N (dgc_horovod as a Horovod compressor)",
            ha="center", va="top", fontsize=15, weight="bold")

    w, h, top = 2.88, 1.95, 6.1
    xs = [1.65, 4.75, 7.85, 10.95, 14.05]
    box(ax, xs[0], top, w, h, "1. local gradient",
        "g = ∂loss/∂w  (backward)\nHorovod calls DGC.compress(g)\n"
        "non-finite g: skipped", LOCAL)
    box(ax, xs[1], top, w, h, "2. clip (optional)",
        "clip_norm C: one factor s for all\nof the rank's g, ‖s·G‖ ≤ C·√N\n(op=Average; local clipping)",
        LOCAL)
    box(ax, xs[2], top, w, h, "3. momentum correction",
        "u ← m·u + g      (velocity)\nv ← v + u         (residual)\n"
        "(Nesterov: v ← v + m·u + g)", LOCAL)
    box(ax, xs[3], top, w, h, "4. top-k of |v|",
        "k = density · numel\nthreshold from a 1% sample\n(warm-up by steps: 25% → 0.1%)",
        LOCAL)
    box(ax, xs[4], top, w, h, "5. encode",
        "selected (index, value) pairs\n→ int32 payload\n(delta16 indices, fp32 values)",
        LOCAL)
    for a, b in zip(xs, xs[1:]):
        arrow(ax, (a + w / 2, top), (b - w / 2, top))

    y2 = 2.75
    box(ax, xs[4], y2, w, h, "6. allgather",
        "hvd.allgather of every rank's\npayload (one per bucket);\nHorovod's allreduce carries\n"
        "a 1-element placeholder", WIRE)
    box(ax, xs[3] - 0.35, y2, w + 0.7, h, "7. decompress",
        "sum all N ranks' entries in rank\norder (bit-identical everywhere),\n"
        "÷ N for op=Average, + weight\ndecay with its own momentum", HOROVOD)
    box(ax, xs[1] + 0.2, y2, w + 0.4, h, "8. optimizer step",
        "p.grad ← update\nplain SGD (momentum=0:\nDGC applied it in step 3)\nw ← w − lr · update",
        HOROVOD)
    arrow(ax, (xs[4], top - h / 2), (xs[4], y2 + h / 2), "payload", dx=0.45, dy=-0.05)
    arrow(ax, (xs[4] - w / 2, y2), (xs[3] - 0.35 + (w + 0.7) / 2, y2))
    arrow(ax, (xs[3] - 0.35 - (w + 0.7) / 2, y2), (xs[1] + 0.2 + (w + 0.4) / 2, y2))

    # what stays local
    ax.add_patch(FancyBboxPatch((0.35, 0.25), 5.9, 1.25, boxstyle="round,pad=0.02", fc="#f4f4f4",
                                ec="#777777", lw=1, ls="--"))
    ax.text(0.55, 1.38, "stays on this rank (never sent)", fontsize=10.5, weight="bold",
            va="top")
    ax.text(0.55, 1.02, "• residual v: the unselected part, carried to the next step\n"
                        "• masking: u and v are zeroed at the selected entries\n"
                        "  (momentum_masking), so sent values are not sent twice",
            fontsize=9.3, va="top", linespacing=1.4)
    arrow(ax, (7.7, top - h / 2), (6.3, 1.0), color="#1f5f99", ls="--")
    ax.text(7.75, 4.45, "from steps 3-4: unselected entries stay in v;\n"
            "selected entries: u, v ← 0 (masking)", fontsize=8.8, color="#1f5f99",
            style="italic", va="center")

    # legend
    for i, (c, t) in enumerate([(LOCAL, "local computation (DGC.compress)"),
                                (WIRE, "communication (Horovod collectives)"),
                                (HOROVOD, "after the exchange (DGC.decompress, optimizer)")]):
        y = 1.2 - i * 0.38
        ax.add_patch(FancyBboxPatch((9.0, y - 0.12), 0.4, 0.24, boxstyle="round,pad=0.01", fc=c,
                                    ec="#333333"))
        ax.text(9.55, y, t, va="center", fontsize=9.5)
    ax.text(9.0, 0.05, "1-D tensors (biases, norm scales): dense allreduce of u after step 3",
            fontsize=9, style="italic", color="#555555")

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, bbox_inches="tight", facecolor="white", metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {out}")


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "docs", "dgc_pipeline.png"))
