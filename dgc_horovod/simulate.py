"""A simulated cluster: N DGC workers in one process, for convergence studies (PyTorch).

Each simulated worker owns a :class:`~dgc_horovod.core.DGCCore` (its residuals, velocities,
warm-up position, statistics) and makes, per step, the same core calls as the PyTorch adapter
under ``horovodrun`` (:mod:`dgc_horovod.torch`, :mod:`dgc_horovod.torch.exchange`):

1. its local gradients (the caller's backward on the worker's own batch);
2. with ``clip_norm`` and ``clip_scope="global"``: ``core.clip_scale`` over all of them, in plan
   order; with ``clip_scope="sketch"``: ``core.sketch`` of all of them in plan order, every
   worker's factor ``core.clip_scale_of_sketches`` from the N sketches in rank order;
3. every bucket of :func:`~dgc_horovod.core.buckets.plan_buckets`, in plan order:
   ``core.compress_many`` of its sparsified members, framed by ``wire.frame_bucket``; every
   dense member: ``core.compress`` (its momentum-corrected velocity);
4. the exchange: a bucket's frames concatenated in rank order (what Horovod's allgather
   returns), decoded by each worker's ``core.decompress_bucket`` (sum in rank order, divided by
   N for Average); dense velocities summed in rank order and
   divided by N (Horovod's Average);
5. ``core.apply_weight_decay`` (``weight_decay_mode="separate"``), then ``p.grad`` is set to the
   result and the caller runs the wrapped optimizer's step.

The parameters are one replica (every worker would hold the same bits); only the DGC state is
per worker. So N workers cost N backward passes and N compressions per step, about what one
dense run with an N times larger batch costs. With N = 2 this reproduces a real
``horovodrun -np 2`` job bit for bit (tests/test_simulate.py) when the model has no per-rank
buffers (batch-norm statistics would be per rank there) and both run with one intra-op thread.
Dense training (``config=None``) averages the raw gradients the same way. With
``DGCConfig(exchange="regions")`` step 4 is the region exchange instead
(:mod:`dgc_horovod.core.regions`): each worker's payloads split by region and framed per
destination (Horovod's alltoall), each region's owner reduces it, and the owners' payloads are
concatenated (the allgather) and decoded; the frames' bytes are counted, not built. With
``DGCConfig(exchange="hierarchical")`` and ``local_size=L`` the N = L·M workers are M nodes of L
(workers c·L … c·L+L−1 form node c) and step 1–4 are the hierarchical exchange
(:mod:`dgc_horovod.core.hierarchical`), bucket by bucket as the PyTorch adapter
(:mod:`dgc_horovod.torch.hierarchical`) runs it: each node's gradient summed in the order of
Horovod's reduce-scatter (``hierarchical.node_sum``; × 1/L for Average), the node's finiteness
flags counted, worker (c, j) compresses shard j of each tensor of the bucket with N = M
(``compress_many``) and frames the payloads, the M frames of shard index j concatenated in node
order and decoded, the shards joined; the other tensors' velocities
averaged over all N workers (Horovod's allreduce). With clipping every node's factor s_c comes
first, from its workers' parts of the node's squared norm (``hierarchical.clip_part`` in plan
order, summed in shard order by ``core.clip_scale_of_squares`` with N = M), and every worker of
node c compresses with it.
"""
import torch

from dgc_horovod.core import PLACEHOLDER_BYTES, DGCConfig, DGCCore, hierarchical, regions, wire
from dgc_horovod.core.buckets import plan_buckets
from dgc_horovod.backends.torch_backend import TorchBackend

__all__ = ["SimulatedCluster"]


class SimulatedCluster:
    """N simulated data-parallel workers around one model and its (wrapped) optimizer.

    Args:
        model (torch.nn.Module): the replica; its parameter names are Horovod's
            (``named_parameters``).
        optimizer (torch.optim.Optimizer): the optimizer ``hvd.DistributedOptimizer`` would wrap
            (no momentum when DGC has momentum > 0); its param_groups give the plan order.
        world_size (int): N >= 1.
        config (DGCConfig or None): DGC's settings; None trains dense (Horovod's plain average).
        average (bool): ``op=hvd.Average`` (True) or ``op=hvd.Sum``.
        local_size (int): L, workers per node, with ``exchange="hierarchical"`` (world_size a
            multiple of it); 1 otherwise.

    Use::

        cluster = SimulatedCluster(model, opt, 4, DGCConfig(compress_ratio=0.001))
        for step in ...:
            losses = cluster.backward([lambda k=k: loss_fn(model, batch_of_worker(k))
                                       for k in range(4)])
            opt.step()
    """

    def __init__(self, model, optimizer, world_size, config=None, average=True, local_size=1):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        hier = config is not None and getattr(config, "exchange", None) == "hierarchical"
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 \
                or world_size % local_size or (local_size > 1 and not hier):
            raise ValueError(f"local_size must be an int >= 1 that divides world_size "
                             f"({world_size}), and 1 unless config has exchange='hierarchical', "
                             f"got {local_size!r}")
        self.local_size = local_size
        if config is not None and not isinstance(config, DGCConfig):
            raise TypeError(f"config must be a DGCConfig or None, got {type(config).__name__}")
        names = {p: n for n, p in model.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        missing = [p for p in params if p not in names]
        if missing:
            raise ValueError(f"{len(missing)} of the optimizer's parameters are not parameters of "
                             "the model")
        self.params = [(names[p], p) for p in params[::-1]]          # plan order
        self.world_size, self.config, self.average = world_size, config, average
        self.B = TorchBackend()
        self.cores = [] if config is None else [DGCCore(config, self.B)
                                                for _ in range(world_size)]
        if config is not None:
            self.buckets = plan_buckets([(n, p.numel(), p.dim()) for n, p in self.params],
                                        config.bucket_numel, config)
        else:
            self.buckets = []
        #: the clipping factors of the last step, one per worker (clip_scope "global" or
        #: "sketch"; the hierarchical exchange: each node's s_c for its workers), else None
        self.clip_scales = None

    # ------------------------------------------------------------------ one step
    def backward(self, closures):
        """Run each worker's closure (it returns the loss of that worker's batch), backward it,
        and reduce the gradients as Horovod + DGC would; ``p.grad`` then holds the reduced
        gradient of every parameter. Returns the list of losses (floats)."""
        if len(closures) != self.world_size:
            raise ValueError(f"one closure per worker: got {len(closures)} for "
                             f"{self.world_size} workers")
        grads, losses = [], []
        for closure in closures:
            for _, p in self.params:
                p.grad = None
            loss = closure()
            loss.backward()
            losses.append(float(loss.detach()))
            grads.append({n: (p.grad.detach() if p.grad is not None else torch.zeros_like(p))
                          for n, p in self.params})
        self.reduce(grads)
        return losses

    def reduce(self, grads):
        """Set ``p.grad`` of every parameter from the workers' gradients ``grads`` (a list of
        N dicts {name: gradient}) through DGC (or the dense average without a config)."""
        if self.config is None:
            for name, p in self.params:
                p.grad = self._dense_reduce([g[name] for g in grads]).view_as(p)
            return
        out = (self._hier_reduce(grads) if self.config.exchange == "hierarchical"
               else self._dgc_reduce(grads))
        for name, p in self.params:
            p.grad = out[name].view(p.shape).to(p.dtype)

    def _dense_reduce(self, tensors):
        """Horovod's allreduce: the sum in rank order, then / N for Average."""
        acc = tensors[0].detach().reshape(-1).to(torch.float32, copy=True)
        for t in tensors[1:]:
            acc += t.reshape(-1)
        if self.average and self.world_size > 1:
            acc.mul_(1.0 / self.world_size)
        return acc

    def _dgc_reduce(self, grads):
        N, B, avg, cores = self.world_size, self.B, self.average, self.cores
        byname = dict(self.params)
        needs_param = cores[0].needs_param
        regional = self.config.exchange == "regions"
        # 1-3: every worker compresses, as its adapter would
        segments, contexts, dense = [], [], []
        scales = (self._sketch_scales(grads) if cores[0].needs_sketch else
                  [core.clip_scale([g[n] for n, _ in self.params], N, avg)
                   for core, g in zip(cores, grads)] if cores[0].needs_clip_scale else None)
        self.clip_scales = scales
        for k, (core, g) in enumerate(zip(cores, grads)):
            scale = None if scales is None else scales[k]
            segs, ctxs, dense_k = [], {}, {}
            for members, flags in self.buckets:
                sparse = [(m, n) for m, (n, s) in enumerate(zip(members, flags)) if s]
                for n, s in zip(members, flags):
                    if not s:
                        kind, v, _ = core.compress(n, g[n], N, byname[n].detach(), avg, scale)
                        dense_k[n] = v
                if not sparse:
                    segs.append(None)
                    continue
                results = core.compress_many(
                    [(n, g[n], byname[n].detach() if needs_param else None) for _, n in sparse],
                    N, avg, scale)
                payloads = [r[1] for r in results]
                ctxs.update({n: r[2] for (_, n), r in zip(sparse, results)})
                if regional:                # the frames are made in _regions_bucket
                    segs.append([(m, n, pay) for (m, n), pay in zip(sparse, payloads)])
                    continue
                segs.append(wire.frame_bucket(B, [(m, pay) for (m, _), pay in
                                                  zip(sparse, payloads)], like=payloads[0]))
                core.add_wire_bytes(wire.frame_overhead_bytes(len(sparse)))
            if core.needs_clip_scale:       # the adapter's gated exchange: one placeholder each
                core.add_wire_bytes(PLACEHOLDER_BYTES * len(dense_k),
                                    received=PLACEHOLDER_BYTES * len(dense_k))
            segments.append(segs)
            contexts.append(ctxs)
            dense.append(dense_k)
        # 4-5: the exchange. Every worker would decode the same payloads to the same bits, and
        # decompress changes a worker's state only on a non-finite step (it puts back what the
        # worker sent), so worker 0 decodes and the others decode only then. Each worker keeps
        # its own weight decay buffer.
        out = {}
        wd = cores[0].separate_weight_decay
        for b, (members, flags) in enumerate(self.buckets):
            if segments[0][b] is None:
                continue
            if regional:
                results = self._regions_bucket([segments[k][b] for k in range(N)], contexts)
                out.update({n: self._weight_decay(n, res, byname[n], wd)
                            for n, res in results.items()})
                continue
            gathered = B.cat([segments[k][b] for k in range(N)])
            for k in range(N):
                cores[k].count_allgather(B.numel(gathered), B.numel(segments[k][b]))
            name, sparse = "dgc.bucket." + members[0], [(m, n) for m, (n, s) in
                                                        enumerate(zip(members, flags)) if s]
            decoded = cores[0].decompress_bucket(gathered, N, len(members), name,
                                                 {m: (contexts[0][n], None) for m, n in sparse},
                                                 avg)
            for m, n in sparse:
                res = decoded[m]
                if not B.all_finite(res):
                    for k in range(1, N):
                        cores[k].decompress_bucket(gathered, N, len(members), name,
                                                   {m: (contexts[k][n], None)}, avg)
                out[n] = self._weight_decay(n, res, byname[n], wd)
        for n in dense[0]:
            out[n] = self._weight_decay(n, self._dense_reduce([d[n] for d in dense]),
                                        byname[n], wd)
        return out

    def _sketch_scales(self, grads):
        """``clip_scope="sketch"``: every worker's sketch of all of its gradients in plan order,
        "allgathered" (each worker's factor from the N rows in rank order, as the adapter's
        ``dgc.clip.sketch`` allgather gives them; the core counts that allgather's bytes)."""
        N = self.world_size
        rows = [core.sketch([(n, g[n]) for n, _ in self.params]).tolist()
                for core, g in zip(self.cores, grads)]
        return [core.clip_scale_of_sketches(rows, N, self.average) for core in self.cores]

    def _node_gradients(self, grads, name, sharded=True):
        """[G_c for each node c]: the node's reduction of ``name``'s gradients, flat float32
        (× 1/L for Average): a sharded tensor's summed as Horovod's reduce-scatter inside a node
        adds (``hierarchical.node_sum``), another's in rank order, as Horovod's allreduce adds
        for L = 2 (not for L = 3)."""
        L = self.local_size
        nodes = []
        for c in range(self.world_size // L):
            rows = [grads[c * L + j][name].reshape(-1).to(torch.float32) for j in range(L)]
            if sharded:
                G = hierarchical.node_sum(rows)
            else:
                G = rows[0].clone()
                for j in range(1, L):
                    G += rows[j]
            if self.average and L > 1:
                G.mul_(1.0 / L)
            nodes.append(G)
        return nodes

    def _shard(self, G, lo, hi):
        """Shard [lo, hi) of a node gradient, all NaN when G has a NaN/Inf anywhere."""
        return G[lo:hi] if self.B.all_finite(G) else torch.full((hi - lo,), float("nan"))

    def _hier_scales(self, grads, sharded):
        """With clipping, [s_c for each node c] (the core module's equations: each worker's part
        of its node's squared norm, the L parts summed in shard order); [None] * M otherwise."""
        L, M = self.local_size, self.world_size // self.local_size
        if not self.cores[0].needs_clip_scale:
            return [None] * M
        G = {name: self._node_gradients(grads, name, sharded[name]) for name, _ in self.params}
        scales = []
        for c in range(M):
            parts = []
            for j in range(L):
                shards = []
                for name, p in self.params:
                    if sharded[name]:
                        lo, hi = hierarchical.shard_bounds(p.numel(), L)[j]
                        shards.append(self._shard(G[name][c], lo, hi))
                parts.append(hierarchical.clip_part(
                    self.B, shards, [G[n][c] for n, _ in self.params if not sharded[n]], j))
            scales.append(self.cores[c * L].clip_scale_of_squares(parts, M, self.average))
        return scales

    def _hier_reduce(self, grads):
        """``exchange="hierarchical"`` (see the module docstring): {name: the update}."""
        N, L, avg = self.world_size, self.local_size, self.average
        M = N // L
        cores = [self.cores[c * L:(c + 1) * L] for c in range(M)]
        sharded = {name: hierarchical.is_sharded(p.numel(), p.dim(), L, self.config)
                   for name, p in self.params}
        scales = self._hier_scales(grads, sharded)
        clip = scales[0] is not None
        self.clip_scales = [s for s in scales for _ in range(L)] if clip else None
        out, dense = {}, {}
        for name, p in self.params:
            if sharded[name]:
                continue
            n = p.numel()
            flat = hierarchical.dense_flat(name, n, p.dim(), L, self.config)
            dense[name] = [core.compress(name, g[name].reshape(-1) if flat else g[name], M,
                                         p.detach(), avg, scales[k // L])[1]
                           for k, (core, g) in enumerate(zip(self.cores, grads))]
            if clip:                    # reduced inside the node for the norm; a placeholder
                for core in self.cores:
                    core.count_hierarchical(node=hierarchical.node_bytes(n, L))
                    core.add_wire_bytes(PLACEHOLDER_BYTES, received=PLACEHOLDER_BYTES)
        planned = [(name, p) for name, p in self.params if sharded[name]]
        for group in hierarchical.cross_buckets([p.numel() for _, p in planned],
                                                self.config.bucket_numel):
            out.update(self._hier_bucket([planned[i] for i in group], grads, cores, scales))
        flags = hierarchical.finite_bytes(sum(sharded.values()), L)
        for core in self.cores:         # the allreduce of the node's finiteness flags
            core.count_hierarchical(node=flags)
        if clip:                        # the allgather of the clipping parts
            for core in self.cores:
                core.count_hierarchical(node=hierarchical.clip_bytes(L))
        byname = dict(self.params)
        wd = self.cores[0].separate_weight_decay
        for name, vs in dense.items():
            out[name] = self._weight_decay(name, self._dense_reduce(vs), byname[name], wd)
        return out

    def _hier_bucket(self, bucket, grads, cores, scales):
        """Steps 1–4 of the hierarchical exchange for one bucket of sharded tensors
        (:func:`~dgc_horovod.core.hierarchical.cross_buckets`; ``bucket``: [(name, param)] in
        plan order), as the PyTorch adapter runs them: every worker (c, j) compresses its shards
        (``compress_many``) and frames their payloads; the M frames of shard index j meet in
        node order; every node decodes them. {name: the update}."""
        N, L, B, avg = self.world_size, self.local_size, self.B, self.average
        M = N // L
        spans = {name: hierarchical.shard_bounds(p.numel(), L) for name, p in bucket}
        nodes = {name: self._node_gradients(grads, name) for name, _ in bucket}
        frames = [[None] * L for _ in range(M)]
        ctxs = [[None] * L for _ in range(M)]
        for c in range(M):
            for j in range(L):
                core, entries = cores[c][j], []
                for name, p in bucket:
                    lo, hi = spans[name][j]
                    view = (1,) * (p.dim() - 1) + (hi - lo,)
                    entries.append((name, self._shard(nodes[name][c], lo, hi).view(view),
                                    p.detach().reshape(-1)[lo:hi].view(view)))
                results = core.compress_many(entries, M, avg, scales[c])
                for name, p in bucket:
                    lo, hi = spans[name][j]
                    core.count_hierarchical(node=hierarchical.scatter_bytes(p.numel(), hi - lo, L))
                frames[c][j] = wire.frame_bucket(B, [(m, r[1]) for m, r in enumerate(results)],
                                                 like=results[0][1])
                core.add_wire_bytes(wire.frame_overhead_bytes(len(results)))
                core.count_hierarchical(cross=(hierarchical.cross_bytes(
                    4 * B.numel(frames[c][j]), M), 0))
                ctxs[c][j] = [r[2] for r in results]
        shards = {name: [] for name, _ in bucket}
        finite = {name: [] for name, _ in bucket}
        for j in range(L):
            gathered = B.cat([frames[c][j] for c in range(M)])
            first = None
            for c in range(M):                  # every node decodes (and settles its state)
                core = cores[c][j]
                core.count_hierarchical(cross=(0, 4 * (B.numel(gathered)
                                                      - B.numel(frames[c][j]))))
                updates = core.decompress_bucket(gathered, M, len(bucket),
                                                 "dgc.cross." + bucket[0][0],
                                                 {m: (ctx, None)
                                                  for m, ctx in enumerate(ctxs[c][j])}, avg)
                res = []
                for m, (name, p) in enumerate(bucket):
                    lo, hi = spans[name][j]
                    res.append(core.finish_update(name, updates[m],
                                                  p.detach().reshape(-1)[lo:hi]))
                    core.count_hierarchical(node=hierarchical.shards_bytes(p.numel(), hi - lo,
                                                                           L))
                first = res if first is None else first
            for (name, _), upd in zip(bucket, first):
                shards[name].append(upd)
                finite[name].append(B.all_finite(upd))
        out = {}
        for m, (name, _) in enumerate(bucket):
            full = torch.cat(shards[name])
            if not all(finite[name]):           # the whole tensor is skipped, as the adapter's
                for j, ok in enumerate(finite[name]):
                    if ok:
                        for c in range(M):
                            cores[c][j].discard_sent(ctxs[c][j][m])
                full.fill_(float("nan"))
            out[name] = full
        return out

    def _regions_bucket(self, payloads, contexts):
        """``exchange="regions"`` for one bucket (:mod:`dgc_horovod.core.regions`): every
        worker's payloads ([(member index, name, payload)] per worker) split by region (what
        the alltoall carries: worker k's part j goes to worker j), each owner's reduce_region of
        its region's parts in rank order, the owners' payloads decoded by worker 0 (the
        allgather) and settled on every worker (its dropped sums, its unapplied momentum).
        The frames themselves are not built (N² of them per bucket); their bytes are counted as
        the adapter frames them (:func:`~dgc_horovod.core.wire.frame_bucket`: a bucket header,
        then per part sent one word and its payload; a worker sends no frame to a worker it has
        no part for, and every owner's frame, empty or not, goes to every worker).
        Returns {name: update}."""
        N, B, avg, cores = self.world_size, self.B, self.average, self.cores
        members = payloads[0]
        numel = {n: cores[0].states[n].numel for _, n, _ in members}
        parts = [{n: regions.split_payload(B, p, numel[n], N, n) for _, n, p in payloads[k]}
                 for k in range(N)]
        nothing = B.int32_tensor([], like=members[0][2])

        def cat(ps):        # the payloads that were sent, in rank order, and how many
            ps = [p for p in ps if p is not None]
            return (B.cat(ps) if ps else nothing), len(ps)
        reduced = []
        for j in range(N):
            red = {}
            for _, n, _ in members:
                gathered, count = cat(parts[k][n][j] for k in range(N))
                red[n] = cores[j].reduce_region(gathered, n, numel[n], j, N, count)
            reduced.append(red)

        def frame(ps):      # a frame's bytes: header, then a word and the payload per part
            ps = [p for p in ps if p is not None]
            return wire.frame_bytes([4 * B.numel(p) for p in ps]) if ps else 0
        to = [[frame(parts[k][n][j] for _, n, _ in members) for j in range(N)]
              for k in range(N)]
        owner = [frame(reduced[j][n][0] for _, n, _ in members) or wire.BUCKET_HEADER_BYTES
                 for j in range(N)]
        for k, core in enumerate(cores):
            counted = sum(4 * B.numel(p) for _, _, p in payloads[k])   # compress counted these
            sent = sum(to[k][j] for j in range(N) if j != k) + owner[k]
            received = sum(to[j][k] + owner[j] for j in range(N) if j != k)
            core.add_wire_bytes(sent - counted, received=received)
        out = {}
        for _, n, _ in members:
            gathered, count = cat(reduced[j][n][0] for j in range(N))
            summed, nonfinite = wire.decode_sum(B, gathered, numel[n], count, n)
            res = cores[0].decompress(gathered, contexts[0][n], N, avg, count,
                                      dropped=reduced[0][n][1])
            for k in range(1, N):
                if nonfinite:
                    cores[k].decompress(gathered, contexts[k][n], N, avg, count)
                else:
                    cores[k].keep_unapplied(contexts[k][n], summed, reduced[k][n][1])
            out[n] = res
        return out

    def _weight_decay(self, name, update, param, wd):
        """core.apply_weight_decay on every worker (each has its own buffer); worker 0's
        result."""
        if not wd:
            return update
        w = param.detach()
        for core in self.cores[1:]:
            core.apply_weight_decay(name, update.clone(), w)
        return self.cores[0].apply_weight_decay(name, update, w)

    # ------------------------------------------------------------------ reporting
    def wire_ratio(self):
        """Dense bytes / wire bytes sent, over every worker since the start (0.0 before any
        step, or without DGC)."""
        wire_bytes = sum(c.total_stats.wire_bytes for c in self.cores)
        dense = sum(c.total_stats.dense_bytes for c in self.cores)
        return dense / wire_bytes if wire_bytes else 0.0

    @property
    def density(self):
        """The density in force (worker 0's; every worker has the same), 1.0 without DGC."""
        return self.cores[0].density if self.cores else 1.0
