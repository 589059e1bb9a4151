"""The cost model (dgc_horovod/core/cost.py) against what DGC counts: the simulated cluster's
statistics for flat and hierarchical DGC on M nodes of L ranks (tensors that do not split evenly
into L shards included), and its time equations in the cases that have a closed form. The
check against a real Horovod job (816 / 2,976 bytes across nodes) is in
tests/test_torch_hierarchical.py."""
import math

import pytest

from dgc_horovod.core import DGCConfig, cost

pytestmark = pytest.mark.unit

DENSITY = 0.05


def _model():
    import torch
    torch.manual_seed(0)
    # 38·49 = 1,862 elements: 3 shards of 621, 621 and 620, whose payloads differ at density
    # 0.05 (k = 32, 32, 31); 49·7 = 343: no L here splits it evenly
    return torch.nn.Sequential(torch.nn.Linear(38, 49), torch.nn.ReLU(), torch.nn.Linear(49, 7))


def _counted(exchange, L, M, steps=3):
    """The simulated cluster's per-worker statistics of the last of ``steps`` steps, and the
    model's tensors in plan order (what the cost model takes)."""
    import torch
    from dgc_horovod.simulate import SimulatedCluster
    cfg = DGCConfig(exchange=exchange, compress_ratio=DENSITY, warmup_steps=0,
                    min_sparse_numel=64, environ={})
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    N = L * M
    cluster = SimulatedCluster(model, opt, N, cfg, local_size=L if exchange ==
                               "hierarchical" else 1)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        xs = [torch.randn(8, 38, generator=g) for _ in range(N)]
        cluster.backward([lambda x=x: model(x).square().mean() for x in xs])
        opt.step()
    tensors = [(n, p.numel(), p.dim()) for n, p in cluster.params]
    return cfg, tensors, [c.step_stats for c in cluster.cores]


@pytest.mark.parametrize("L,M", [(2, 2), (3, 2), (4, 3), (2, 1)])
def test_hierarchical_bytes_are_what_the_simulated_cluster_counts(L, M):
    """The cost model's bytes are the statistics' (M = 1: one node, nothing crosses)."""
    cfg, tensors, stats = _counted("hierarchical", L, M)
    model = cost.hierarchical_dgc_bytes(tensors, cfg, DENSITY, L, M)
    assert (sum(model["cross"]) == 0) == (M == 1) and min(model["payload"]) > 0
    if L == 3:                                          # shards of unequal payloads
        assert len(set(model["cross"])) > 1, model["cross"]
    for c in range(M):
        for j in range(L):
            st = stats[c * L + j]
            assert st.cross_node_bytes == model["cross"][j]
            assert st.cross_node_received_bytes == model["cross_received"][j]
            assert (st.node_bytes, st.node_received_bytes) == model["node"][j]
            assert st.wire_bytes == model["payload"][j] + model["allreduce"] + model["node"][j][0]
    node = sum(stats[j].cross_node_received_bytes for j in range(L))
    assert node == model["node_cross_received"] == (M - 1) * sum(model["payload"])


@pytest.mark.parametrize("L,M", [(2, 2), (4, 3)])
def test_flat_bytes_are_what_the_simulated_cluster_counts(L, M):
    cfg, tensors, stats = _counted("allgather", L, M)
    model = cost.flat_dgc_bytes(tensors, cfg, DENSITY, L, M)
    for st in stats:
        assert st.wire_bytes == model["frame"] + model["allreduce"]
        assert st.received_bytes - model["allreduce"] == model["received"]
    assert model["node_cross_received"] == L * (L * M - L) * model["frame"]


def test_hierarchical_sends_one_selection_per_node():
    """Across nodes a node receives about 1/L² of flat DGC's at the same density (L = 4: the
    payloads of one selection of the tensor, not of L)."""
    tensors = [("w", 1 << 20, 2), ("b", 1024, 1)]
    cfg = DGCConfig(compress_ratio=0.001, environ={})
    for L, M in [(4, 4), (8, 16)]:
        flat = cost.flat_dgc_bytes(tensors, cfg, 0.001, L, M)
        hier = cost.hierarchical_dgc_bytes(tensors, cfg, 0.001, L, M)
        ratio = hier["node_cross_received"] / flat["node_cross_received"]
        assert 0.9 / L ** 2 < ratio < 1.2 / L ** 2, ratio


def test_time_equations():
    tensors = [("w", 1 << 20, 2)]
    cfg = DGCConfig(compress_ratio=0.001, environ={})
    D = 4 << 20
    beta, alpha = 1e9 / 8, 50e-6
    # one rank per node: the hierarchical dense allreduce is the flat ring
    t = cost.step_seconds(tensors, cfg, 0.001, 1, 8, beta, 1e11, alpha, 5e-6)
    assert t["dense_ring"] == pytest.approx(t["dense_hierarchical"])
    assert t["dense_ring"] == pytest.approx(2 * 7 / 8 * D / beta + 14 * alpha)
    # 8 ranks per node, 4 nodes: the card carries 2·(M − 1)/M·D of the hierarchical allreduce
    t = cost.step_seconds(tensors, cfg, 0.001, 8, 4, beta, math.inf, alpha, 0.0)
    assert t["dense_hierarchical"] == pytest.approx(2 * 3 / 4 * D / beta + 6 * alpha)
    hier = cost.hierarchical_dgc_bytes(tensors, cfg, 0.001, 8, 4)
    assert t["dgc_hierarchical"] == pytest.approx(
        cost.ring_allreduce_seconds(4, hier["allreduce"], beta, alpha)
        + 3 * sum(hier["cross"]) / beta + 3 * alpha)
    flat = cost.flat_dgc_bytes(tensors, cfg, 0.001, 8, 4)
    assert t["dgc"] == pytest.approx(
        cost.ring_allreduce_seconds(4, flat["allreduce"], beta, alpha)
        + 31 * flat["frame"] / beta + 31 * alpha)
    assert set(t) == set(cost.SCHEMES)


def test_projection_script_prints_every_scheme_and_writes_the_png(tmp_path, capsys):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import hierarchical_cost
    png = tmp_path / "p.png"
    assert hierarchical_cost.main(["--png", str(png)]) == 0
    out = capsys.readouterr().out
    for label in hierarchical_cost.LABELS.values():
        # 3 links × 2 models in the time tables, 2 models in the bytes tables
        assert out.count(f"| {label} |") == 8 and out.count(f"s | {label} |") == 6, label
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
