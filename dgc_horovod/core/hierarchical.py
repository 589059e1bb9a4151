"""The hierarchical exchange (``exchange="hierarchical"``): dense inside a node, DGC across nodes.

A job of M nodes with L ranks each (GPUs joined by fast links inside a node, the nodes by a slow
network). With the other exchanges every rank is a DGC worker; here the nodes are. For one
sparsified tensor of n elements, on node c with ranks r = (c, 0..L−1) (rank j of a node: its
position among the node's global ranks, ascending):

    shards      S_j = [j·q + min(j, m), (j+1)·q + min(j+1, m)) with q, m = divmod(n, L),
                j = 0..L−1 (contiguous; the first m shards one element more: Horovod's
                reduce-scatter split, :func:`shard_bounds`)
    1. node     (reduce-scatter inside the node) rank (c, j) gets shard j of the node's gradient
                G_c = (1/L)·Σ_j g_(c,j) (op=Average; op=Sum: G_c = Σ_j g_(c,j)), the sum in
                Horovod's order (:func:`node_sum`); then the node agrees on whether G_c is
                finite (an allreduce inside the node of one flag per tensor and shard: Σ_j of
                "G_c|S_j has a NaN/Inf", :func:`finite_bytes`)
    2. select   rank (c, j) runs Algorithm 1 on G_c|S_j, its shard, as one worker of M: its own
                u_(c,j), v_(c,j) of |S_j| elements; momentum correction u ← m·u + G_c|S_j,
                v ← v + u; top-k of |v| with k = max(1, ⌈ρ·|S_j|⌉); u, v cleared at the sent
                positions; payload P_(c,j). A node whose G_c has a NaN/Inf anywhere sends every
                shard as non-finite (nothing accumulated on any of its ranks, as one worker of
                the allgather exchange does for the whole tensor)
    3. across   (allgather over the process set X_j = {(0, j), …, (M−1, j)}, the j-th rank of
                every node) every rank (·, j) receives P_(0,j) … P_(M−1,j) and decodes them in
                node order: Δ|S_j = (1/M)·Σ_c P_(c,j) (op=Average; op=Sum without 1/M),
                bit-identical on X_j; then the separate weight decay, on the shard
    4. gather   (allgather inside the node, in shard order) every rank of node c gets
                Δ = Δ|S_0 ‖ … ‖ Δ|S_(L−1), the whole update, bit-identical on every rank

The rank-mean → sum mapping. Horovod hands rank r its mean gradient g_r (Average) and the
update of a dense allreduce is (1/(L·M))·Σ_r g_r. The paper's worker k adds ∇k = (1/(N·b))·Σ∇f
to a sum; here worker k is node c with N = M and contribution G_c/M, and (1/M)·Σ_c G_c =
(1/(L·M))·Σ_r g_r: node averages, then the DGC average over nodes, give Horovod's average, and
density 1 gives dense momentum SGD. Under op=Sum the node sums and the DGC sum over nodes give
Σ_r g_r. So N = M everywhere the core uses the world size (the 1/N of decode, the statistics'
workers, the clipping threshold).

Local clipping (``clip_norm`` with ``clip_scope="global"``, §3.2). Algorithm 1 clips worker k's
contribution by the global norm of all its gradients; worker k is node c and its gradient is
G_c, every tensor t of the step reduced inside the node (step 1; a tensor that is not sharded is
allreduced there, whole, for this norm only). Rank (c, j) holds shard j of each sharded tensor, so

    q_(c,j)   = Σ_t ‖G_c^t|S_j‖² over the sharded tensors, then, on j = 0 only, + Σ_t ‖G_c^t‖²
                over the others (:func:`clip_part`: each norm in float32, squared and summed in
                float64 in plan order; a tensor whose G_c^t has a NaN/Inf anywhere is left out
                on every rank of the node, the rules of
                :func:`~dgc_horovod.core.accumulate.squared_norm`)
    ‖G_c‖     = sqrt(q_(c,0) + … + q_(c,L−1)), the L parts allgathered inside the node and summed
                in shard order: the same bits on every rank of node c
    s_c       = min(1, T / (‖G_c‖/S + 1e-6)) with T = C·√M under Average, C/√M under Sum
                (:func:`~dgc_horovod.core.accumulate.clip_threshold` with N = M;
                :meth:`~dgc_horovod.core.compressor.DGCCore.clip_scale_of_squares`; S the loss
                scale, 1 without a loss scaler)

and step 2 accumulates s_c·G_c|S_j: u ← m·u + s_c·G_c|S_j. A tensor that is not sharded is
accumulated by each rank from its own g_r with its node's s_c, as under every exchange, and its
velocity averaged over all L·M ranks: by linearity that is the average over the nodes of the
momentum of s_c·G_c. This is the paper's rule for worker c: its contribution to the sum,
G_c/M (Average) or G_c (Sum), is clipped at C·M^(−1/2).

Nothing is lost: after a finite step Σ_c v_(c,j) + M·Δ|S_j (Average; Sum: Δ|S_j) equals
Σ_c v_(c,j) before the selection plus Σ_c G_c|S_j, for every shard j: what a shard did not send
stays in that shard's residual. A non-finite update (a node's NaN/Inf gradient, or a float16
value beyond range on the wire) makes the tensor's whole update NaN on every rank, and every
rank puts what it sent back into its u and v, as the allgather exchange does.

Traffic per step and tensor (payload P of about k_j = ρ·n/L entries): across nodes rank (c, j)
sends P once and receives the M−1 other nodes' payloads of its shard, so a node receives about
(M−1)·ρ·n entries, against L²·(M−1)·ρ·n with every rank a worker (allgather exchange). Inside
the node rank j sends the n − |S_j| float32 of the others' shards and receives (L−1)·|S_j| (the
reduce-scatter, :func:`scatter_bytes`: about (L−1)/L·n each way, half an allreduce's
2·(L−1)/L·n), then the allgather of the n float32 of Δ (:func:`shards_bytes`), and once per
step the finiteness flags (:func:`finite_bytes`).

Buckets (:func:`cross_buckets`): step 3 sends a step's shards in buckets, as the allgather
exchange sends its tensors: the sharded tensors in plan order cut by ``bucket_numel`` elements
of the whole tensors (so every shard index cuts alike), each bucket's payloads of this rank's
shards framed together (:func:`~dgc_horovod.core.wire.frame_bucket`: 8 bytes and a member word
per payload more) and sent by one allgather across the nodes. Inside the node every tensor has
its own collectives (Horovod's tensor fusion batches them). ``bucket_numel=0``: a tensor is a
bucket of one (still framed).

Not yet: ``clip_scope="tensor"`` (refused by :class:`~dgc_horovod.core.config.DGCConfig`),
TensorFlow.
"""
from dgc_horovod.core.accumulate import squared_norm
from dgc_horovod.core.buckets import cut
from dgc_horovod.core.sparsify import is_sparse

__all__ = ["shard_bounds", "node_sum", "is_sharded", "dense_flat", "node_layout", "node_bytes",
           "scatter_bytes", "finite_bytes", "cross_bytes", "cross_buckets", "shards_bytes", "clip_part", "clip_bytes",
           "LAYOUT_FIELDS", "SHARD_RULE"]

#: The name of :func:`shard_bounds`'s rule, kept in checkpoints (the layout): a rank's state is
#: its shard, so a checkpoint made with another rule (before it, ⌊j·n/L⌋) does not fit.
SHARD_RULE = "reducescatter"

#: What each rank contributes to :func:`node_layout`: Horovod's own view of where it runs.
LAYOUT_FIELDS = ("rank", "local_rank", "local_size", "cross_rank", "cross_size")


def node_bytes(numel, local_size):
    """(sent, received) bytes of the node's allreduce of a tensor that is not sharded (with
    clipping, for the node's norm) of ``numel`` float32 elements, as Horovod's allreduce is
    counted: its size each way; nothing with one rank per node (no collective crosses a
    link)."""
    return (4 * numel, 4 * numel) if local_size > 1 else (0, 0)


def scatter_bytes(numel, shard, local_size):
    """(sent, received) bytes of step 1, the node's reduce-scatter of a sharded tensor of
    ``numel`` float32 elements on the rank of ``shard`` elements: the other ranks' shards of
    its gradient out (n − |S_j|), their parts of its shard in ((L − 1)·|S_j|); nothing with
    one rank per node."""
    return (4 * (numel - shard), 4 * (local_size - 1) * shard) if local_size > 1 else (0, 0)


def finite_bytes(count, local_size):
    """(sent, received) bytes of the node's allreduce of the step's finiteness flags, one int32
    per sharded tensor (``count``), as Horovod's allreduce is counted; nothing with one rank per
    node or no sharded tensor."""
    return (4 * count, 4 * count) if local_size > 1 and count else (0, 0)


def clip_bytes(local_size):
    """(sent, received) bytes of the allgather of the clipping parts inside the node (one
    float64 each); nothing with one rank per node."""
    return (8, 8 * (local_size - 1)) if local_size > 1 else (0, 0)


def cross_bytes(payload, nodes):
    """Bytes sent across nodes by step 3, the allgather of a shard's payload of ``payload``
    bytes over the M = ``nodes`` ranks of that shard index: the payload once; nothing with one
    node (the allgather is over a set of one rank and no byte leaves the machine; the payload
    still counts in ``wire_bytes``, as what compress produced)."""
    return payload if nodes > 1 else 0


def cross_buckets(numels, bucket_numel):
    """Step 3's buckets: the step's sharded tensors in plan order, ``numels`` the elements of
    each whole tensor, cut by the bucket rule (:func:`~dgc_horovod.core.buckets.cut`); lists of
    indices into ``numels``. Every rank of a shard index across the nodes cuts alike (the same
    tensors, the same sizes), so a bucket's frames meet in one allgather."""
    return cut(numels, bucket_numel)


def shards_bytes(numel, shard, local_size):
    """(sent, received) bytes of step 4, the allgather inside the node: this rank's ``shard``
    elements out, the rest of the tensor's ``numel`` in; nothing with one rank per node."""
    return (4 * shard, 4 * (numel - shard)) if local_size > 1 else (0, 0)


def clip_part(B, shards, others, shard):
    """q_(c,j), rank (c, j)'s part of its node's squared global norm (see the module docstring):
    Σ ‖x‖² over ``shards`` (its shard of each sharded tensor's node gradient, all NaN where that
    node gradient has a NaN/Inf anywhere) and, when ``shard`` (j) is 0, over ``others`` (the
    node gradients of the tensors that are not sharded), in that order
    (:func:`~dgc_horovod.core.accumulate.squared_norm`: a float)."""
    return squared_norm(B, list(shards) + (list(others) if shard == 0 else []))


def shard_bounds(numel, local_size):
    """[(lo, hi)] of the L shards of a tensor of ``numel`` elements:
    S_j = [j·q + min(j, m), (j+1)·q + min(j+1, m)), q, m = divmod(n, L).

    Horovod's reduce-scatter split along dimension 0 of the flat gradient: when L does not
    divide n, the first n mod L ranks of the process set get one element more
    (``ReducescatterOp::ComputeOutputShapeForRank``, horovod/common/ops/
    collective_operations.cc of v0.28.1; measured with Gloo: 5 elements on 2 ranks give 3 and
    2, 11 on 4 give 3, 3, 3, 2). Taking Horovod's split as the rule (rather than ⌊j·n/L⌋, which
    gives the extra elements to the last shards, with a padded reduce-scatter) lets each rank
    receive exactly its shard from the flat gradient as it is, without copy or padding."""
    q, m = divmod(numel, local_size)
    return [(j * q + min(j, m), (j + 1) * q + min(j + 1, m)) for j in range(local_size)]


def node_sum(gradients):
    """Σ_j g_(c,j) of the node's L gradients (flat, in shard order) in the order Horovod's Gloo
    reduce-scatter adds them (``gloo::ReduceScatterHalvingDoubling``): the ranks split into
    blocks of powers of two, largest first (L = 7: 4 + 2 + 1), each block summed as a balanced
    pairwise tree, and the blocks' sums added from the smallest up (L = 7:
    T(g_0..g_3) + (T(g_4, g_5) + g_6)). So L = 2, 3 add in rank order, L = 4 as
    (g_0 + g_1) + (g_2 + g_3). Measured bit for bit against Horovod 0.28.1 under Gloo, float32,
    for L = 2 … 8 (tests/test_torch_hierarchical.py launches L = 3, 4; Horovod's allreduce
    inside the node, the path before, adds in rank order for L = 2, not 3 or 4). Float
    addition is commutative, so the order inside a pair does not matter.
    Returns a new array (``+`` of the inputs: NumPy or torch)."""
    def tree(xs):
        if len(xs) == 1:
            return xs[0]
        half = len(xs) // 2
        return tree(xs[:half]) + tree(xs[half:])
    L = len(gradients)
    if L == 1:
        return gradients[0] * 1
    blocks, start = [], 0
    while start < L:
        size = 1 << ((L - start).bit_length() - 1)
        blocks.append(list(gradients[start:start + size]))
        start += size
    total = tree(blocks[-1])
    for block in reversed(blocks[:-1]):
        total = tree(block) + total
    return total


def is_sharded(numel, ndim, local_size, config):
    """The hierarchical exchange's rule for which tensors are sparsified: those whose every shard
    would be (:func:`~dgc_horovod.core.sparsify.is_sparse` of the smallest shard, ⌊n/L⌋
    elements, with the tensor's dimensions); the others go through Horovod's dense allreduce as
    their momentum-corrected velocity, as under every exchange."""
    return is_sparse(numel // local_size, ndim, config)


def dense_flat(name, numel, ndim, local_size, config):
    """For a tensor that is not sharded (:func:`is_sharded`): whether it must reach
    ``DGCCore.compress`` flattened to 1-D for the core to keep it dense, i.e. whether the core's
    own rule would sparsify it whole (a tensor of fewer than L·min_sparse_numel elements).
    Raises ValueError (naming it) when even flat it would be sparsified
    (``min_sparse_ndim=1``)."""
    if not is_sparse(numel, ndim, config):
        return False
    if is_sparse(numel, 1, config):
        raise ValueError(
            f"DGC(exchange='hierarchical'): {name!r} has {numel} elements, fewer than the "
            f"{local_size} ranks of a node need to share it with min_sparse_numel="
            f"{config.min_sparse_numel} each, and min_sparse_ndim={config.min_sparse_ndim} "
            "sparsifies it whole: raise min_sparse_ndim to 2 or min_sparse_numel")
    return True


def node_layout(rows):
    """The nodes and the cross-node process sets from every rank's Horovod view.

    Args:
        rows: one sequence per rank, in rank order, of the :data:`LAYOUT_FIELDS` values
            (rank, local_rank, local_size, cross_rank, cross_size) as Horovod reports them
            (``hvd.local_rank()`` etc.: ranks on one host share a node).
    Returns:
        (nodes, crosses): nodes[c] the global ranks of node c ascending (the node whose ranks
        have cross_rank c), crosses[j] = [nodes[0][j], …, nodes[M−1][j]], the j-th rank of every
        node. Every rank computes the same from the same rows.
    Raises:
        ValueError: the nodes have different numbers of ranks, or the rows do not describe
            M equal nodes (names the ranks of each node).
    """
    rows = [tuple(int(x) for x in row) for row in rows]
    sizes = {}
    for rank, _, local_size, cross_rank, _ in rows:
        sizes.setdefault(local_size, []).append(rank)
    if len(sizes) > 1:
        detail = "; ".join(f"ranks {ranks} on nodes of {size}" for size, ranks in
                           sorted(sizes.items()))
        raise ValueError("DGC(exchange='hierarchical') needs nodes with the same number of "
                         f"ranks (hvd.local_size()), got {detail}: start the job with the "
                         "same number of slots on every host, or use exchange='allgather'")
    local_size = rows[0][2]
    groups = {}
    for rank, _, _, cross_rank, _ in rows:
        groups.setdefault(cross_rank, []).append(rank)
    nodes = [sorted(groups[c]) for c in sorted(groups)]
    if len(rows) % local_size or [len(n) for n in nodes] != [local_size] * len(nodes) \
            or sorted(groups) != list(range(len(nodes))):
        raise ValueError("DGC(exchange='hierarchical'): Horovod's local and cross ranks do not "
                         f"describe equal nodes (rank, local_rank, local_size, cross_rank, "
                         f"cross_size: {rows}); start the job with the same number of slots on "
                         "every host")
    crosses = [[node[j] for node in nodes] for j in range(local_size)]
    return nodes, crosses
