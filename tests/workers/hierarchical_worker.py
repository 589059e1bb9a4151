"""Runs under `horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo` (2 nodes of 2 ranks as
Horovod sees them), and under `--mpi -H hostA:2,hostB:2` across the two-host bed
(tests/test_cluster.py): DGC(exchange="hierarchical") with the stock
horovod.torch.DistributedOptimizer.

``--mode train`` (Horovod with dynamic process sets) records what tests/test_torch_hierarchical.py
asserts on; rank 0 writes it as JSON to --out. ``--mode static`` starts Horovod without dynamic
process sets, ``--mode given`` with the 2 × 2 job's four process sets passed to ``hvd.init``, and
``--mode plain`` (dynamic) is for any layout (e.g. unequal nodes), ``--mode mismatch`` has rank 0
alone on the hierarchical exchange: each trains two steps and records the error DGC raised, if
any.

``--init comm`` initializes Horovod with ``hvd.init(comm=MPI.COMM_WORLD, process_sets=...)`` (an
mpi4py communicator), as a job started by a plain `mpirun` would: scripts/cluster/mpirun.sh
across the bed (tests/test_cluster.py); the default, ``hvd.init(process_sets=...)``.
"""
import argparse
import json
import socket
import sys

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from dgc_horovod.torch import DGC
from torch_worker import (batches, flat_params, scenario_fp16_overflow, identical_across_ranks,
                          make, nonfinite_facts, train, train_with_nan)

SETTINGS = dict(compress_ratio=0.01, momentum=0.9, warmup_epochs=0, min_sparse_numel=512)


def teacher_batches(steps, seed):
    """A learnable task: labels from a fixed random linear teacher of the inputs."""
    w = torch.randn(64, 10, generator=torch.Generator().manual_seed(4321))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def train_teacher(model, opt, steps, seed):
    for x, y in teacher_batches(steps, seed):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def loss_of(model):
    """The loss on 8 fixed batches of the teacher's task, the same on every rank."""
    with torch.no_grad():
        return sum(float(F.cross_entropy(model(x), y))
                   for x, y in teacher_batches(8, 999)) / 8


def payload_bytes(dgc):
    """The last step's bytes this rank put into DGC's allgather (wire_bytes less what Horovod's
    allreduce carried: a placeholder per sparsified tensor, the velocity of a dense one, and
    the hierarchical exchange's traffic inside the node)."""
    st = dgc.stats
    allreduce = sum(4 if s.sparse else 4 * s.numel for s in dgc.states.values())
    return st.wire_bytes - allreduce - st.node_bytes


def across_nodes(value):
    """Σ over the ranks of the other nodes of ``value`` (per rank), for this rank."""
    rows = hvd.allgather(torch.tensor([[hvd.cross_rank(), hvd.local_rank(), value]],
                                      dtype=torch.int64), name="check.across").tolist()
    return sum(v for c, _, v in rows if c != hvd.cross_rank())


def node_sum(value):
    rows = hvd.allgather(torch.tensor([[hvd.cross_rank(), value]], dtype=torch.int64),
                         name="check.node").tolist()
    return sum(v for c, v in rows if c == hvd.cross_rank())


def scenario_train(results):
    out = {}
    for exchange in ("hierarchical", "allgather"):
        dgc = DGC(exchange=exchange, **SETTINGS)
        model, opt = make(f"tr.{exchange}", dgc)
        before = flat_params(model).clone()
        loss0 = loss_of(model)
        train_teacher(model, opt, 60, 100 + hvd.rank())
        st = dgc.stats
        facts = {"identical": identical_across_ranks(model),
                 "changed": bool((flat_params(model) != before).any()),
                 "finite": bool(torch.isfinite(flat_params(model)).all()),
                 "loss": [loss0, loss_of(model)], "steps": dgc.total_stats.steps,
                 "sparse": sorted((n, s.numel) for n, s in dgc.states.items() if s.sparse),
                 "stats": st.to_dict(),
                 # (name, numel, ndim) in plan order, for the cost model (core/cost.py)
                 "tensors": [(n, p.numel(), p.dim()) for n, p in
                             reversed(list(model.named_parameters()))]}
        facts["payload_bytes"] = payload_bytes(dgc)
        if exchange == "hierarchical":
            received = st.cross_node_received_bytes
        else:   # what this rank received from the ranks of the other node
            received = across_nodes(payload_bytes(dgc))
        facts["node_cross_received"] = node_sum(received)
        out[exchange] = facts
    results["train"] = out


def scenario_dense(results):
    """Density 1 without warm-up: the update is the global average, as Horovod's dense
    allreduce with momentum SGD gives."""
    dgc = DGC(exchange="hierarchical", **dict(SETTINGS, compress_ratio=1.0,
                                              momentum_masking=False))
    model, opt = make("eq.dgc", dgc)
    ref, ropt = make("eq.ref", hvd.Compression.none, momentum=0.9)
    train(model, opt, steps=8, aux_every=1)
    train(ref, ropt, steps=8, aux_every=1)
    results["dense_max_diff"] = float((flat_params(model) - flat_params(ref)).abs().max())


def clipped_update(rows, nodes, clip_norm, world, average):
    """The paper's update with local clipping at density 1 and momentum 0, in float64, from
    every rank's raw gradient (``rows``, rank order) and the nodes (lists of ranks): each
    worker's gradient G_w (its ranks' average, or sum under op=Sum) clipped at C·√N (C/√N) with
    N = ``world``, then averaged (summed) over the workers. Returns (update, the factors)."""
    M = len(nodes)
    T = clip_norm * world ** 0.5 if average else clip_norm / world ** 0.5
    total, scales = torch.zeros_like(rows[0]), []
    for node in nodes:
        G = sum(rows[r] for r in node)
        G = G / len(node) if average else G
        s = min(1.0, T / (float(G.norm()) + 1e-6))
        scales.append(s)
        total += s * G
    return (total / M if average else total), scales


def scenario_clip(results):
    """clip_norm with the hierarchical exchange at density 1, momentum 0: each step's update
    (p.grad after synchronize) against the paper's with the nodes as the workers (N = M = 2),
    and against what a wrong rule gives: N = L·M, no clipping, every rank a worker."""
    out = {}
    for average in (True, False):
        C = 0.05
        dgc = DGC(exchange="hierarchical", compress_ratio=1.0, momentum=0.0, warmup_epochs=0,
                  min_sparse_numel=512, clip_norm=C)
        model, opt = make(f"clip.{int(average)}", dgc, op=hvd.Average if average else hvd.Sum)
        where = hvd.allgather(torch.tensor([[hvd.rank(), hvd.cross_rank()]]),
                              name="check.where").tolist()
        nodes = [[r for r, c in where if c == k] for k in sorted({c for _, c in where})]
        facts = {"err": [], "wrong_n": [], "unclipped": [], "per_rank": [], "scales": [],
                 "identical": True}
        for step, (x, y) in enumerate(batches(3, 500 + hvd.rank())):
            opt.zero_grad()
            F.cross_entropy(model(x, use_aux=step != 1), y).backward()
            raw = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                             .detach().reshape(-1) for p in model.parameters()])
            rows = hvd.allgather(raw.unsqueeze(0).double(), name=f"check.raw.{average}.{step}")
            opt.synchronize()
            got = torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]).double()
            with opt.skip_synchronize():
                opt.step()
            want, scales = clipped_update(rows, nodes, C, len(nodes), average)
            scale = float(want.abs().max())
            facts["scales"].append(scales)
            facts["err"].append(float((got - want).abs().max()) / scale)
            for key, alt in (("wrong_n", clipped_update(rows, nodes, C, hvd.size(), average)),
                             ("unclipped", clipped_update(rows, nodes, 1e30, 1, average)),
                             ("per_rank", clipped_update(rows, [[r] for r in range(hvd.size())],
                                                         C, hvd.size(), average))):
                facts[key].append(float((alt[0] - want).abs().max()) / scale)
            facts["identical"] &= identical_across_ranks(model)
        facts["states_finite"] = all(t is None or bool(torch.isfinite(t).all())
                                     for st in dgc.states.values() for t in (st.u, st.v))
        out["average" if average else "sum"] = facts
    results["clip"] = out


def scenario_nonfinite(results):
    """Rank 1's loss is NaN at step 3: the update is NaN everywhere, no state is poisoned;
    without clipping and with clipping that triggers (the node's norm leaves the NaN out)."""
    for key, clip in (("nonfinite", None), ("nonfinite_clip", 0.05)):
        dgc = DGC(exchange="hierarchical", clip_norm=clip, **SETTINGS)
        model, opt = make(key, dgc)
        seen = train_with_nan(model, opt)
        results[key] = nonfinite_facts(dgc, model, seen)


def scenario_nonfinite_shard(results):
    """At step 3 one element of rank 1's fc1.weight gradient is NaN, in shard 1: after the
    reduce-scatter only rank 1 sees it. The node's flags make rank 0 (its shard finite) treat
    the tensor as non-finite too: the update is NaN everywhere, and no rank of node 0
    accumulates anything of that step (u and v of fc1.weight unchanged by it, per rank)."""
    dgc = DGC(exchange="hierarchical", **SETTINGS)
    model, opt = make("nanshard", dgc)
    name, step = "nanshard.fc1.weight", [0]
    last = model.fc1.weight.numel() - 1             # in shard 1 (the second half)

    def poison(g):
        if step[0] == 3 and hvd.rank() == 1:
            g = g.clone()
            g.view(-1)[last] = float("nan")
        return g
    model.fc1.weight.register_hook(poison)
    snaps = {}

    def before_sync(k):
        step[0] = k + 1                             # the hook runs in the next backward
        st = dgc.states.get(name)
        if st is not None and st.u is not None:
            snaps[k] = (st.u.clone(), st.v.clone())
    seen = train_with_nan(model, opt, nan_step=None, after_backward=before_sync)
    facts = nonfinite_facts(dgc, model, seen)
    # before step 3's synchronize against before step 4's: what step 3 accumulated
    facts["unchanged"] = hvd.allgather_object(
        all(torch.equal(a, b) for a, b in zip(snaps[3], snaps[4])), name="check.unchanged")
    facts["changed_before"] = hvd.allgather_object(
        not all(torch.equal(a, b) for a, b in zip(snaps[2], snaps[3])), name="check.changed")
    results["nonfinite_shard"] = facts


def scenario_checkpoint(results):
    """state_dict holds this rank's shards and the layout; another layout is refused; the same
    layout loads and training goes on bit-identically."""
    dgc = DGC(exchange="hierarchical", **SETTINGS)
    model, opt = make("ck", dgc)
    train(model, opt, steps=4)
    sd = dgc.state_dict()
    out = {"layout": sd["layout"],
           "numels": {n: t["numel"] for n, t in sd["tensors"].items() if t["sparse"]}}
    other = DGC(exchange="hierarchical", **SETTINGS)
    try:
        other.load_state_dict(dict(sd, layout=dict(sd["layout"], local_size=4, nodes=1)))
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    other.load_state_dict(sd)
    twin, topt = make("ck", other)
    twin.load_state_dict(model.state_dict())
    train(model, opt, steps=3, data_seed=7 + hvd.rank())
    train(twin, topt, steps=3, data_seed=7 + hvd.rank())
    out["resumed_equal"] = bool((flat_params(model) == flat_params(twin)).all())
    # a checkpoint of the allgather exchange (a job moving to multi-GPU nodes): the config's
    # refusal with the way to switch, then that way (residuals restart at zero)
    flat = DGC(**SETTINGS)
    fmodel, fopt = make("ck", flat)
    train(fmodel, fopt, steps=2)
    fsd = flat.state_dict()
    moved = DGC(exchange="hierarchical", **SETTINGS)
    try:
        moved.load_state_dict(fsd)
        out["flat_refused"] = None
    except ValueError as e:
        out["flat_refused"] = str(e)
    moved.load_state_dict(fsd, reset_residuals=True)
    mmodel, mopt = make("ck", moved)
    mmodel.load_state_dict(fmodel.state_dict())
    losses = train(mmodel, mopt, steps=3)
    out["switched"] = {"steps": int(moved.total_stats.steps), "finite": bool(all(
        torch.isfinite(p).all() for p in mmodel.parameters())),
        "identical": identical_across_ranks(mmodel), "losses": losses}
    results["checkpoint"] = out


def one_step(results, exchange="hierarchical"):
    dgc = DGC(exchange=exchange, **SETTINGS)
    model, opt = make("one", dgc)
    try:
        before = flat_params(model).clone()
        train(model, opt, steps=2)
        results["error"] = None
        results["identical"] = identical_across_ranks(model)
        results["changed"] = bool((flat_params(model) != before).any())
    except ValueError as e:
        results["error"] = str(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("train", "static", "given", "plain", "mismatch"),
                    default="train")
    ap.add_argument("--init", choices=("default", "comm"), default="default")
    args = ap.parse_args()
    if args.mode == "given":        # the node sets and the sets across nodes of 2 × 2 ranks
        sets = [hvd.ProcessSet(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]
    else:
        sets = "dynamic" if args.mode != "static" else None
    if args.init == "comm":
        from mpi4py import MPI
        hvd.init(comm=MPI.COMM_WORLD, process_sets=sets)
    else:
        hvd.init(process_sets=sets)
    torch.set_num_threads(1)
    results = {"init": args.init, "size": hvd.size(), "local_size": hvd.local_size(),
               "cross_size": hvd.cross_size(), "settings": SETTINGS,
               # which controller Horovod runs on, and each rank's host (the two-host bed's MPI
               # test asserts that the job is MPI across hostA and hostB)
               "controller": "mpi" if hvd.mpi_enabled() else "gloo",
               "hosts": hvd.allgather_object(socket.gethostname(), name="check.hosts")}
    if args.mode == "train":
        for scenario in (scenario_train, scenario_dense, scenario_clip, scenario_nonfinite,
                         scenario_nonfinite_shard, scenario_checkpoint):
            scenario(results)
        # float16 values that overflow in one shard: the whole update is non-finite everywhere
        scenario_fp16_overflow(results, "fp16", exchange="hierarchical", min_sparse_numel=512)
    else:
        one_step(results, "allgather" if args.mode == "mismatch" and hvd.rank() else
                 "hierarchical")
        errors = hvd.allgather_object(results["error"], name="check.errors")
        results["errors"] = errors
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
