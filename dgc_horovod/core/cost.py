"""A cost model of one training step's gradient exchange on M nodes of L ranks: bytes across
nodes and inside a node, and communication time, for Horovod's dense allreduce (a flat ring, and
``HOROVOD_HIERARCHICAL_ALLREDUCE``), flat DGC (``exchange="allgather"``) and hierarchical DGC
(``exchange="hierarchical"``, :mod:`dgc_horovod.core.hierarchical`).

Inputs: the model's gradients as (name, numel, ndim) in plan order, a DGCConfig (which tensors
are sparsified, buckets, wire encodings) and the density ρ in force (after the warm-up:
``compress_ratio``). Every payload size comes from the core's own rules: a tensor of n elements
sends ``wire.payload_bytes(n, k_for(n, ρ))`` bytes whatever it selected (k = max(1, ⌈ρ·n⌉)),
a bucket's frame ``wire.frame_bytes`` of its members' payloads, Horovod's allreduce a
placeholder per sparsified tensor and the velocity of every other one (``stats.PLACEHOLDER_BYTES``),
the hierarchical exchange's collectives inside the node ``hierarchical.scatter_bytes``,
``finite_bytes`` and ``shards_bytes``.

Bytes, per step (:func:`flat_dgc_bytes`, :func:`hierarchical_dgc_bytes`), as DGC's statistics
count them:

    flat DGC      a rank sends its frames F (the allgather input) and receives those of the
                  N − 1 others; the ranks of a node receive L·(N − L)·F bytes from ranks of other
                  nodes (each of its L ranks gets every remote rank's frames: L²·(M − 1)·F)
    hierarchical  local rank j sends its shards' payloads, framed per bucket, P_j across
                  (``cross_node_bytes``) and
                  receives (M − 1)·P_j (``cross_node_received_bytes``); a node receives
                  (M − 1)·Σ_j P_j ≈ (M − 1)·F: one selection per node instead of L. Inside the
                  node rank j counts Σ (4·(n − |S_j|) + 4·|S_j|) = Σ 4·n sent over its T sharded
                  tensors (the reduce-scatter's other shards, its decoded shard) and
                  Σ (4·(L − 1)·|S_j| + 4·(n − |S_j|)) received, plus 4·T each way for the
                  finiteness flags (``node_bytes``, ``node_received_bytes``)

Time, per step (:func:`step_seconds`), communication only (no compression, decoding or overlap
with the backward pass), with the textbook ring algorithms: a ring allreduce of D bytes over P
ranks moves 2·(P − 1)/P·D over every link in 2·(P − 1) steps, a ring allgather of F bytes per
rank (P − 1)·F in P − 1 steps; a step costs ``alpha`` (latency) on a link between nodes and
``intra_alpha`` inside one; a node's network card carries ``inter_bandwidth`` bytes/s each way,
shared by its ranks' collectives that cross nodes, the links inside a node
``intra_bandwidth`` bytes/s per rank. Horovod fuses the collectives of a step into one of each
kind (``HOROVOD_FUSION_THRESHOLD``), so latency counts once per collective kind:

    dense ring    one ring over the N = L·M ranks (a node's card carries 2·(N − 1)/N·D):
                  2·(N − 1)/N·D/β + 2·(N − 1)·α
    dense hier.   reduce-scatter inside the node, L rings of D/L over the M nodes (sharing the
                  card: 2·(M − 1)/M·D in all), allgather inside the node:
                  2·(L − 1)/L·D/β_in + 2·(L − 1)·α_in + 2·(M − 1)/M·D/β + 2·(M − 1)·α
    flat DGC      the allreduce of the dense tensors and placeholders (Horovod's hierarchical
                  allreduce, as above) and one ring allgather of F over the N ranks (every link
                  of it, the card's too, carries (N − 1)·F): (N − 1)·F/β + (N − 1)·α
    hierarchical  the same allreduce of what is not sharded; the node reduction of the sharded
                  tensors S (a ring reduce-scatter inside the node), L rings allgathering P_j
                  over the M nodes (the card carries (M − 1)·Σ_j P_j), the allgather of the
                  shards: 2·(L − 1)/L·S/β_in + 2·(L − 1)·α_in + (M − 1)·Σ_j P_j/β + (M − 1)·α
                  (the flags' allreduce of 4·T bytes left out: latency only, a few µs)

The ring allgather is the kindest assumption for flat DGC (bytes through a card: (N − 1)·F,
not the L·(N − L)·F its ranks receive from other nodes, but N − 1 latency steps).
"""
from dgc_horovod.core import hierarchical, wire
from dgc_horovod.core.buckets import plan_buckets
from dgc_horovod.core.sparsify import is_sparse, k_for
from dgc_horovod.core.stats import PLACEHOLDER_BYTES

__all__ = ["frame_bytes", "allreduce_bytes", "shard_payload_bytes", "flat_dgc_bytes",
           "hierarchical_dgc_bytes", "ring_allreduce_seconds", "ring_allgather_seconds",
           "step_seconds", "SCHEMES"]

#: The exchanges :func:`step_seconds` prices.
SCHEMES = ("dense_ring", "dense_hierarchical", "dgc", "dgc_hierarchical")


def _payload(numel, density, config):
    return wire.payload_bytes(numel, k_for(numel, density), config.wire_index,
                              config.wire_values)


def frame_bytes(tensors, config, density):
    """Bytes one rank puts into flat DGC's allgathers per step: the frame of every bucket
    (:func:`~dgc_horovod.core.buckets.plan_buckets`) with a sparsified member."""
    sizes = {name: numel for name, numel, _ in tensors}
    total = 0
    for members, flags in plan_buckets(tensors, config.bucket_numel, config):
        sparse = [_payload(sizes[n], density, config) for n, s in zip(members, flags) if s]
        if sparse:
            total += wire.frame_bytes(sparse)
    return total


def allreduce_bytes(tensors, config, local_size=1):
    """Bytes one rank hands Horovod's allreduce per step (each way): a placeholder per tensor
    DGC exchanges sparse, the float32 velocity of every other one. ``local_size`` > 1: the
    hierarchical exchange's rule (:func:`~dgc_horovod.core.hierarchical.is_sharded`)."""
    total = 0
    for _, numel, ndim in tensors:
        sparse = (hierarchical.is_sharded(numel, ndim, local_size, config) if local_size > 1
                  else is_sparse(numel, ndim, config))
        total += PLACEHOLDER_BYTES if sparse else 4 * numel
    return total


def _sharded(tensors, config, local_size):
    return [(n, numel) for n, numel, ndim in tensors
            if hierarchical.is_sharded(numel, ndim, local_size, config)]


def shard_payload_bytes(tensors, config, density, local_size):
    """[P_j]: bytes local rank j sends across nodes per step under the hierarchical exchange,
    the frames (``wire.frame_bytes``) of the payloads of its shard S_j of every sharded tensor,
    one frame per bucket (:func:`~dgc_horovod.core.hierarchical.cross_buckets`; j = 0 … L − 1)."""
    sharded = _sharded(tensors, config, local_size)
    out = [0] * local_size
    for group in hierarchical.cross_buckets([numel for _, numel in sharded], config.bucket_numel):
        for j in range(local_size):
            out[j] += wire.frame_bytes([
                _payload(hi - lo, density, config)
                for lo, hi in (hierarchical.shard_bounds(sharded[i][1], local_size)[j]
                               for i in group)])
    return out


def flat_dgc_bytes(tensors, config, density, local_size, nodes):
    """Flat DGC on ``nodes`` nodes of ``local_size`` ranks, per step: dict(frame: F, a rank's
    allgather input; received: (N − 1)·F, what a rank receives of the allgather;
    node_cross_received: L·(N − L)·F, what a node's ranks receive from ranks on other nodes;
    allreduce: :func:`allreduce_bytes`)."""
    L, N = local_size, local_size * nodes
    F = frame_bytes(tensors, config, density)
    return dict(frame=F, received=(N - 1) * F, node_cross_received=L * (N - L) * F,
                allreduce=allreduce_bytes(tensors, config))


def hierarchical_dgc_bytes(tensors, config, density, local_size, nodes):
    """The hierarchical exchange on ``nodes`` nodes of ``local_size`` ranks, per step, as its
    statistics count them: dict(payload: [P_j] bytes of local rank j's frames (in its
    ``wire_bytes``), cross: what of it goes across nodes (``cross_node_bytes``: P_j, 0 with one
    node, :func:`~dgc_horovod.core.hierarchical.cross_bytes`), cross_received: [(M − 1)·P_j] (``cross_node_received_bytes``),
    node_cross_received: (M − 1)·Σ_j P_j, node: [(sent, received)] of rank j inside the node
    (``node_bytes``, ``node_received_bytes``: the reduce-scatter, the flags, the shards' allgather),
    sharded: S, the float32 bytes of the sharded tensors, node_ring: 2·(L − 1)/L·S, what a rank
    moves each way over rings inside the node (the reduce-scatter, the shards' allgather),
    allreduce: :func:`allreduce_bytes`)."""
    L, M = local_size, nodes
    P = shard_payload_bytes(tensors, config, density, L)
    sharded = _sharded(tensors, config, L)
    node = []
    for j in range(L):
        sent, received = hierarchical.finite_bytes(len(sharded), L)
        for _, numel in sharded:
            lo, hi = hierarchical.shard_bounds(numel, L)[j]
            for s, r in (hierarchical.scatter_bytes(numel, hi - lo, L),
                         hierarchical.shards_bytes(numel, hi - lo, L)):
                sent, received = sent + s, received + r
        node.append((sent, received))
    return dict(payload=P, cross=[hierarchical.cross_bytes(p, M) for p in P],
                cross_received=[(M - 1) * p for p in P],
                node_cross_received=(M - 1) * sum(P), node=node,
                sharded=4 * sum(numel for _, numel in sharded),
                node_ring=2 * (L - 1) / L * 4 * sum(numel for _, numel in sharded),
                allreduce=allreduce_bytes(tensors, config, L))


def ring_allreduce_seconds(ranks, nbytes, bandwidth, alpha):
    """A ring allreduce of ``nbytes`` over ``ranks``: 2·(P − 1)/P·D/β + 2·(P − 1)·α."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * alpha


def ring_allgather_seconds(ranks, nbytes, bandwidth, alpha):
    """A ring allgather of ``nbytes`` per rank over ``ranks``: (P − 1)·F/β + (P − 1)·α."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * nbytes / bandwidth + (ranks - 1) * alpha


def _hierarchical_allreduce(L, M, nbytes, inter, intra, alpha, intra_alpha):
    """Horovod's hierarchical allreduce of ``nbytes`` (reduce-scatter inside the node, L rings
    of D/L across the M nodes sharing the card, allgather inside the node)."""
    inside = (2 * ring_allgather_seconds(L, nbytes / L, intra, intra_alpha) if L > 1 else 0.0)
    return inside + ring_allreduce_seconds(M, nbytes, inter, alpha)


def step_seconds(tensors, config, density, local_size, nodes, inter_bandwidth,
                 intra_bandwidth, alpha, intra_alpha):
    """{scheme: seconds of communication per step} for :data:`SCHEMES` (see the module's
    equations). Bandwidths in bytes/s (a node's card each way; a rank's links inside the
    node), latencies in seconds per ring step."""
    L, M = local_size, nodes
    N = L * M
    D = 4 * sum(numel for _, numel, _ in tensors)
    hier_ar = lambda nbytes: _hierarchical_allreduce(L, M, nbytes, inter_bandwidth,  # noqa: E731
                                                     intra_bandwidth, alpha, intra_alpha)
    flat = flat_dgc_bytes(tensors, config, density, L, M)
    hier = hierarchical_dgc_bytes(tensors, config, density, L, M)
    inside = 2 * ring_allgather_seconds(L, hier["sharded"] / L, intra_bandwidth, intra_alpha)
    across = ((M - 1) * sum(hier["cross"]) / inter_bandwidth + (M - 1) * alpha
              if M > 1 else 0.0)
    return {
        "dense_ring": ring_allreduce_seconds(N, D, inter_bandwidth if M > 1 else
                                             intra_bandwidth, alpha if M > 1 else intra_alpha),
        "dense_hierarchical": hier_ar(D),
        "dgc": hier_ar(flat["allreduce"]) + ring_allgather_seconds(
            N, flat["frame"], inter_bandwidth if M > 1 else intra_bandwidth,
            alpha if M > 1 else intra_alpha),
        "dgc_hierarchical": hier_ar(hier["allreduce"]) + inside + across,
    }
