"""The simulated cluster (dgc_horovod.simulate) makes the same DGC calls as a real job: with the
same seed, data shards and buckets, SimulatedCluster at N = 2 (3) and `horovodrun -np 2` (3)
(Gloo and MPI) give bit-identical parameters and the same byte counts after 30 steps, with
either exchange."""
import json
import os
import sys

import pytest
import torch

from conftest import ROOT, horovodrun
from dgc_horovod.core import DGCConfig
from dgc_horovod.simulate import SimulatedCluster

sys.path.insert(0, os.path.join(ROOT, "tests", "workers"))
import simulate_worker as W  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "workers", "simulate_worker.py")

CONFIGS = {
    # the default pipeline: global clipping (gated exchange), 1-D tensors dense, separate weight
    # decay, the step-counted warm-up reaching its final density within the 30 steps
    "global_clip": dict(compress_ratio=0.01, clip_norm=0.3, weight_decay=1e-3, warmup_steps=12),
    # several buckets, every tensor sparsified, per-tensor clipping, Nesterov
    "buckets": dict(compress_ratio=0.02, bucket_numel=1500, min_sparse_ndim=1, clip_norm=0.1,
                    clip_scope="tensor", nesterov=True, warmup_steps=8),
    # the dense clip from the ranks' sketches (issue #42): an allgather of the sketches, every
    # rank's factor from the rows in rank order
    "sketch_clip": dict(compress_ratio=0.01, clip_norm=0.05, clip_scope="sketch",
                        weight_decay=1e-3, warmup_steps=12),
}
# the same with the region exchange, and once with one exchange per tensor
REGION_CONFIGS = {"regions_" + k: dict(v, exchange="regions") for k, v in CONFIGS.items()}
REGION_CONFIGS["regions_per_tensor"] = dict(REGION_CONFIGS["regions_buckets"], bucket_numel=0)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def simulated(kwargs, world_size=2, local_size=1):
    model = W.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    cluster = SimulatedCluster(model, opt, world_size, DGCConfig(environ={}, **kwargs),
                               local_size=local_size)
    for step in range(W.STEPS):
        cluster.backward([lambda k=k: W.loss_of(model, k, step) for k in range(world_size)])
        opt.step()
    return model, cluster


@pytest.mark.horovodrun
@pytest.mark.parametrize("launcher,name,np", [
    ("gloo", "global_clip", 2), ("mpi", "global_clip", 2), ("gloo", "buckets", 2),
    ("gloo", "sketch_clip", 2), ("mpi", "sketch_clip", 2), ("gloo", "regions_sketch_clip", 2),
    # 3 ranks only where every tensor is sparsified: Horovod's dense allreduce of 3 tensors
    # adds in another order than the simulator's rank order (the last bit differs)
    ("gloo", "regions_global_clip", 2), ("mpi", "regions_buckets", 3),
    ("gloo", "regions_per_tensor", 3)])
def test_simulated_cluster_matches_horovodrun_bit_for_bit(tmp_path, one_thread, launcher, name,
                                                          np):
    out = tmp_path / "params.pt"
    config = CONFIGS.get(name) or REGION_CONFIGS[name]
    horovodrun([WORKER, "--config", json.dumps(config), "--out", str(out)], np=np,
               launcher=launcher, env={k: "" for k in os.environ if k.startswith("HOROVOD_DGC_")})
    real = torch.load(out, weights_only=True)
    model, cluster = simulated(config, np)
    assert real["steps"] == cluster.cores[0].steps == W.STEPS
    assert real["density"] == cluster.density
    moved = 0
    for n, p in model.named_parameters():
        assert torch.equal(real["params"][n], p.detach()), n
        moved += int(not torch.equal(p.detach(), dict(W.make_model().named_parameters())[n]))
    assert moved == len(real["params"])          # every parameter was trained
    assert real["wire_bytes"] == cluster.cores[0].total_stats.wire_bytes
    assert real["received_bytes"] == cluster.cores[0].total_stats.received_bytes


#: the hierarchical exchange with clipping that triggers on some steps (the node's factor
#: 0.61–1.0 here) and not on others; every tensor sharded (min_sparse_ndim=1), so no dense
#: allreduce over the 4 ranks, whose ring sums in another order than the simulator's
HIER_CLIP = dict(exchange="hierarchical", compress_ratio=0.05, clip_norm=0.2, weight_decay=1e-3,
                 warmup_steps=12, min_sparse_ndim=1, min_sparse_numel=4)


#: bucket_numel for the hierarchical cases: one bucket of all six tensors (the default), two
#: buckets (the test model's tensors in plan order, 10 + 320 + 32 + 2048 | 64 + 1280 elements),
#: a bucket per tensor
HIER_BUCKETS = {"one_bucket": None, "two_buckets": 1500, "per_tensor": 0}


@pytest.mark.horovodrun
@pytest.mark.parametrize("buckets", list(HIER_BUCKETS))
def test_simulated_hierarchical_clipping_matches_horovodrun_2x2(tmp_path, one_thread, buckets):
    """SimulatedCluster(local_size=2) and `horovodrun --gloo -np 4 -H localhost:2,127.0.0.1:2`
    (two nodes of two ranks): the same bits after 30 steps with the node's clipping factor,
    and the same byte counts inside and across the nodes, with the shards' payloads sent
    across in one bucket, two, or one per tensor (a frame each: the bytes across the nodes
    tell the number of buckets)."""
    from dgc_horovod.core import cost, hierarchical
    config = dict(HIER_CLIP)
    if HIER_BUCKETS[buckets] is not None:
        config["bucket_numel"] = HIER_BUCKETS[buckets]
    tensors = [(n, p.numel(), p.dim()) for n, p in list(W.make_model().named_parameters())[::-1]]
    plan = hierarchical.cross_buckets([t[1] for t in tensors], DGCConfig(
        environ={}, **config).bucket_numel)
    assert [len(g) for g in plan] == {"one_bucket": [6], "two_buckets": [4, 2],
                                      "per_tensor": [1] * 6}[buckets]
    out = tmp_path / "params.pt"
    env = {k: "" for k in os.environ if k.startswith("HOROVOD_DGC_")}
    env.update(HOROVOD_DYNAMIC_PROCESS_SETS="1", HOROVOD_FUSION_THRESHOLD="0")
    horovodrun([WORKER, "--config", json.dumps(config), "--out", str(out)], np=4,
               hosts="localhost:2,127.0.0.1:2", env=env)
    real = torch.load(out, weights_only=True)
    model, cluster = simulated(config, 4, local_size=2)
    # after the warm-up a step's frames across the nodes are what the cost model says
    cfg = DGCConfig(environ={}, **config)
    step = cluster.cores[0].step_stats
    assert step.cross_node_bytes == cost.shard_payload_bytes(tensors, cfg, cluster.density, 2)[0]
    assert real["steps"] == cluster.cores[0].steps == W.STEPS
    for n, p in model.named_parameters():
        assert torch.equal(real["params"][n], p.detach()), n
    sim = cluster.cores[0].total_stats.to_dict()
    for st in (real["stats"], sim):
        del st["compress_seconds"]              # a time, not a count
    assert real["stats"] == sim
    assert real["stats"]["cross_node_bytes"] > 0 and real["stats"]["node_bytes"] > 0
    # the clipping mattered: without it the parameters differ
    unclipped, _ = simulated(dict(config, clip_norm=None), 4, local_size=2)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                     unclipped.parameters()))


@pytest.mark.unit
def test_hierarchical_buckets_change_no_bits(one_thread):
    """How the shards' payloads are bucketed across the nodes changes what the wire carries
    (a frame per bucket), not what is selected or applied: the same parameters after 30 steps
    with one bucket, two, or one per tensor; only the frames' bytes differ."""
    runs = {}
    for name, numel in HIER_BUCKETS.items():
        config = dict(HIER_CLIP) if numel is None else dict(HIER_CLIP, bucket_numel=numel)
        model, cluster = simulated(config, 4, local_size=2)
        runs[name] = ([p.detach() for p in model.parameters()],
                      cluster.cores[0].total_stats.cross_node_bytes)
    one, _ = runs["one_bucket"]
    for name, (params, _) in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(one, params)), name
    cross = [runs[n][1] for n in ("one_bucket", "two_buckets", "per_tensor")]
    assert cross[0] < cross[1] < cross[2], cross


@pytest.mark.unit
def test_simulated_hierarchical_clipping_factors(one_thread):
    """With HIER_CLIP the node's factor is below 1 on some steps, 1 on others, the same for
    the two workers of a node; with clip_norm=None it is never computed."""
    model = W.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    cluster = SimulatedCluster(model, opt, 4, DGCConfig(environ={}, **HIER_CLIP), local_size=2)
    seen = []
    for c, core in enumerate(cluster.cores[::2]):
        orig = core.clip_scale_of_squares

        def spy(*a, orig=orig, c=c, **k):
            seen.append((c, orig(*a, **k)))
            return seen[-1][1]
        core.clip_scale_of_squares = spy
    for step in range(W.STEPS):
        cluster.backward([lambda k=k: W.loss_of(model, k, step) for k in range(4)])
        opt.step()
    assert len(seen) == 2 * W.STEPS
    scales = [s for _, s in seen]
    assert min(scales) < 0.7 and max(scales) == 1.0


@pytest.mark.unit
def test_workers_stay_replicas_and_dense_mode_is_the_average(one_thread):
    model, cluster = simulated(CONFIGS["global_clip"])
    a, b = cluster.cores
    for name, st in a.states.items():
        other = b.states[name]
        assert st.sparse == other.sparse
        assert (st.v is None) == (other.v is None)
    # the workers' residuals differ (their own gradients), their step counts do not
    assert a.steps == b.steps and a.density == b.density
    assert any(not torch.equal(st.v, b.states[n].v) for n, st in a.states.items() if st.sparse)
    # dense: p.grad is the rank-order sum / N of the workers' gradients
    m = W.make_model()
    ref = {}
    for k in range(2):
        m.zero_grad()
        W.loss_of(m, k, 0).backward()
        ref[k] = {n: p.grad.clone() for n, p in m.named_parameters()}
    m2 = W.make_model()
    dense2 = SimulatedCluster(m2, torch.optim.SGD(m2.parameters(), lr=W.LR), 2)
    dense2.backward([lambda k=k: W.loss_of(m2, k, 0) for k in range(2)])
    for n, p in m2.named_parameters():
        assert torch.equal(p.grad, (ref[0][n] + ref[1][n]) * 0.5)


@pytest.mark.unit
def test_bad_arguments_are_named():
    m = W.make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="world_size"):
        SimulatedCluster(m, opt, 0)
    with pytest.raises(TypeError, match="config"):
        SimulatedCluster(m, opt, 2, config={"compress_ratio": 0.01})
    cluster = SimulatedCluster(m, opt, 2)
    with pytest.raises(ValueError, match="one closure per worker"):
        cluster.backward([lambda: W.loss_of(m, 0, 0)])
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not parameters of the model"):
        SimulatedCluster(m, torch.optim.SGD(other.parameters(), lr=0.1), 2)


@pytest.mark.unit
def test_a_nonfinite_worker_is_skipped_by_all_and_nothing_is_lost(one_thread):
    model, cluster = simulated(dict(CONFIGS["buckets"], clip_norm=None))
    a, b = cluster.cores
    name = "0.weight"
    ua, va = a.states[name].u.clone(), a.states[name].v.clone()
    ub, vb = b.states[name].u.clone(), b.states[name].v.clone()
    grads = []
    for k in range(2):
        model.zero_grad()
        W.loss_of(model, k, 99).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    grads[1][name][0, 0] = float("nan")
    cluster.reduce(grads)
    p = dict(model.named_parameters())[name]
    assert torch.isnan(p.grad).all()                            # every rank sees NaN
    assert torch.isfinite(dict(model.named_parameters())["2.weight"].grad).all()
    assert torch.equal(b.states[name].u, ub) and torch.equal(b.states[name].v, vb)  # skipped
    m = 0.9
    g = grads[0][name].reshape(-1)
    u = ua * m + g                                              # worker 0 accumulated, sent,
    torch.testing.assert_close(a.states[name].u, u)             # and got it all back
    torch.testing.assert_close(a.states[name].v, va + g + m * u)   # Nesterov: v += g + m·u


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_received_bytes_are_the_other_workers_payloads(one_thread, name):
    """Each worker receives every other worker's bucket segments (as Horovod's allgather returns
    them) and the allreduce's output (one placeholder per sparsified tensor, the dense tensors
    and, with the gated exchange of global clipping, a placeholder per dense tensor too)."""
    N, steps = 3, 3
    model = W.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    config = DGCConfig(environ={}, **CONFIGS[name])
    cluster = SimulatedCluster(model, opt, N, config)
    for step in range(steps):
        cluster.backward([lambda k=k: W.loss_of(model, k, step) for k in range(N)])
        opt.step()
    gated = config.clip_norm is not None and config.clip_scope in ("global", "sketch")
    # (the sketches' allgather, clip_scope="sketch", counts as the buckets' allgathers do)
    allreduced = steps * sum(4 if st.sparse else 4 * st.numel + 4 * gated
                             for st in cluster.cores[0].states.values())
    allgathered = [c.total_stats.wire_bytes - allreduced for c in cluster.cores]
    assert all(a > 0 for a in allgathered)
    for k, core in enumerate(cluster.cores):
        assert core.total_stats.received_bytes == sum(allgathered) - allgathered[k] + allreduced
        assert core.total_stats.received_ratio == pytest.approx(
            core.total_stats.dense_bytes / core.total_stats.received_bytes)


@pytest.mark.unit
@pytest.mark.parametrize("bucket_numel", [0, 1500, 2 ** 22])
def test_region_exchange_is_the_cores_exchange(one_thread, bucket_numel):
    """exchange="regions": the simulated cluster (framed buckets, alltoall and allgather as
    concatenations) gives the bits of the core's exchange run tensor by tensor (compress →
    regions.split_payload → reduce_region on each owner → decompress with its dropped sums),
    with the workers' states alike, over steps with momentum."""
    from dgc_horovod.core import DGCCore, regions
    from dgc_horovod.backends.torch_backend import TorchBackend
    N, steps = 3, 4
    kw = dict(compress_ratio=0.05, min_sparse_ndim=1, warmup_steps=0, exchange="regions",
              environ={})
    model = W.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=W.LR)
    cluster = SimulatedCluster(model, opt, N, DGCConfig(bucket_numel=bucket_numel, **kw))
    B = TorchBackend()
    cores = [DGCCore(DGCConfig(**kw), B) for _ in range(N)]
    ref = W.make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=W.LR)
    names = [n for n, _ in ref.named_parameters()][::-1]           # the plan order
    for step in range(steps):
        cluster.backward([lambda k=k: W.loss_of(model, k, step) for k in range(N)])
        grads = []
        for k in range(N):
            ref.zero_grad()
            W.loss_of(ref, k, step).backward()
            grads.append({n: p.grad.detach().reshape(-1).clone()
                          for n, p in ref.named_parameters()})
        params = dict(ref.named_parameters())
        for n in names:
            ctxs, parts = [], []
            for core, g in zip(cores, grads):
                _, payload, ctx = core.compress(n, g[n], N)
                ctxs.append(ctx)
                parts.append(regions.split_payload(B, payload, g[n].numel(), N, n))
            red = []
            for j in range(N):
                ps = [parts[k][j] for k in range(N) if parts[k][j] is not None]
                gathered = B.cat(ps) if ps else torch.zeros(0, dtype=torch.int32)
                red.append(cores[j].reduce_region(gathered, n, g[n].numel(), j, N, len(ps)))
            ps = [p for p, _ in red if p is not None]
            gathered = B.cat(ps) if ps else torch.zeros(0, dtype=torch.int32)
            outs = [core.decompress(gathered, ctx, N, True, len(ps), dropped=d)
                    for core, ctx, (_, d) in zip(cores, ctxs, red)]
            assert torch.equal(outs[0].view_as(params[n]),
                               dict(model.named_parameters())[n].grad), n
            params[n].grad = outs[0].view_as(params[n]).clone()
        opt.step()
        ref_opt.step()
        for core, simulated_core in zip(cores, cluster.cores):
            for n in names:
                a, b = core.states[n], simulated_core.states[n]
                assert torch.equal(a.u, b.u) and torch.equal(a.v, b.v), n


@pytest.mark.unit
def test_region_exchange_traffic_per_worker_hardly_grows_with_N(one_thread):
    """Bytes received per worker per step: allgather grows with N − 1, regions stay below 2×
    those at N = 2 (about 2k(N − 1)/N entries)."""
    torch.manual_seed(0)
    received = {}
    for exchange in ("allgather", "regions"):
        for N in (2, 8):
            model = torch.nn.Linear(256, 256, bias=False)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            cluster = SimulatedCluster(model, opt, N, DGCConfig(
                compress_ratio=0.01, warmup_steps=0, exchange=exchange, environ={}))
            x = torch.randn(N, 8, 256)
            cluster.backward([lambda k=k: model(x[k]).square().mean() for k in range(N)])
            received[exchange, N] = cluster.cores[0].total_stats.received_bytes
    assert received["allgather", 8] / received["allgather", 2] > 6
    assert received["regions", 8] / received["regions", 2] < 2
