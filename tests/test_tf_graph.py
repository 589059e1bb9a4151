"""The TensorFlow adapter's in-graph path (dgc_horovod/tensorflow/graph.py, ``DGC(in_graph=True)``)
against the eager core's reference engine (dgc_horovod/core/engine.py, ``engine="ops"``), bit
for bit, for every option.

Two simulated ranks run in this process, no launcher: each rank's :class:`GraphCore` traces its
steps into one ``tf.function`` (the allgather is a concatenation in rank order, the dense
allreduce a sum times 1/N), and each rank's eager :class:`DGCCore` with ``engine="ops"`` runs
the same gradients through ``compress`` / ``decompress`` / ``apply_weight_decay`` as the
adapter's ``tf.py_function`` path does: on the TensorFlow backend (whose norms, for clipping,
are the graph's), and where nothing is clipped also on the NumPy backend (the reference of
tests/test_conformance.py). Per step the payloads, the updates, every u, v and weight-decay
buffer and the statistics must be equal (NaN payloads and -0.0 included).

Grappler's arithmetic optimizer is off here: it may re-associate a sum of three tensors (the
Nesterov weight-decay update) into an AddN in another order, which changes the last bit of a few
elements (measured on this test's wd_separate_nesterov case). Every rank traces the same step
and gets the same rewrite, so the replicas stay identical (tests/test_tf_horovod.py checks
that under horovodrun with the optimizer on).
"""
import numpy as np
import pytest

from helpers import raw, to_backend, to_np

pytestmark = pytest.mark.adapter

SHAPES = [("fc1/kernel:0", (300, 70)), ("fc1/bias:0", (70,)), ("fc2/kernel:0", (70, 10)),
          ("big/kernel:0", (3, 70000)), ("fc2/bias:0", (10,))]
N = 2

#: one setting per line: what each changes in the arithmetic or the selection
CASES = {
    "default": dict(),
    "warmup_steps": dict(warmup_steps=4),
    "nesterov": dict(nesterov=True),
    "momentum0": dict(momentum=0.0),
    "no_masking": dict(momentum_masking=False),
    "exact_topk": dict(exact_topk=True),
    "every_tensor_sparse": dict(min_sparse_ndim=1, compress_ratio=0.01),
    "clip_global": dict(clip_norm=0.5),
    "clip_tensor_sum": dict(clip_norm=0.5, clip_scope="tensor", _average=False),
    "wd_separate_nesterov": dict(weight_decay=0.01, nesterov=True),
    "wd_separate_momentum0": dict(weight_decay=0.01, momentum=0.0),
    "wd_accumulated_clip": dict(weight_decay=0.01, weight_decay_mode="accumulated",
                                clip_norm=1.0),
    "int32_index": dict(wire_index="int32"),
    "float16_values": dict(wire_values="float16", _scale=[1.0, 1.0, 3e5, 1.0, 1e-9, 1.0]),
    "warmup_epochs": dict(warmup_epochs=2, _epochs=[0, 0, 1, 1, 2, 3]),
    "warmup_epochs_per_step": dict(warmup_epochs=2, warmup_per_step=True,
                                   _epochs=[0, 0.5, 1.25, 1.5, 1.75, 3]),
    "dense_density": dict(compress_ratio=0.6, warmup_steps=0),
    "sum": dict(_average=False),
    "ties": dict(compress_ratio=0.02, _ties=True),
    "ties_exact_int32": dict(exact_topk=True, wire_index="int32", _ties=True),
    "ties_warmup": dict(warmup_steps=6, _ties=True),
}
STEPS = 6
NAN_STEP, NAN_RANK = 2, 1


@pytest.fixture(autouse=True)
def _no_reassociation():
    import tensorflow as tf
    before = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    yield
    tf.config.optimizer.set_experimental_options(
        {"arithmetic_optimization": before.get("arithmetic_optimization", True)})


def _config(case, **more):
    from dgc_horovod.core import DGCConfig
    kw = {k: v for k, v in CASES[case].items() if not k.startswith("_")}
    kw = dict(dict(compress_ratio=0.004, warmup_steps=2, seed=7, engine="ops"), **kw, **more)
    return DGCConfig(environ={}, **kw)


class _ProcessSet:
    def size(self):
        return N

    def included(self):
        return True


def _data(case):
    """grads[step][rank] (lists in SHAPES order, float32) and the parameters."""
    rng = np.random.default_rng(5)
    scales = CASES[case].get("_scale", [1.0] * STEPS)
    grads = [[[(rng.standard_normal(shape) * scales[t]).astype(np.float32)
               for _, shape in SHAPES] for _ in range(N)] for t in range(STEPS)]
    if CASES[case].get("_ties"):        # a few distinct magnitudes: ties at every k-th largest
        grads = [[[np.round(g * 2) / 2 for g in rank] for rank in step] for step in grads]
    grads[NAN_STEP][NAN_RANK][0][3, 5] = np.nan       # one rank's fc1/kernel non-finite
    grads[NAN_STEP + 1][0][1][7] = np.inf              # a dense tensor's too, another step
    params = [rng.standard_normal(shape).astype(np.float32) for _, shape in SHAPES]
    return grads, params


def _same(a, b):
    return raw(a) == raw(b)


def _stats(s, graph=False):
    """The counters; the graph sends no placeholder through Horovod's allreduce (TensorFlow
    prunes it): 4 bytes less each way per sparsified tensor than the eager core counts."""
    out = {k: getattr(s, k) for k in ("steps", "tensors", "sparse_tensors", "elements",
                                       "selected", "wire_bytes", "received_bytes",
                                       "dense_bytes", "nonfinite_tensors",
                                       "overflowed_entries", "flushed_entries")}
    if graph:
        for k in ("wire_bytes", "received_bytes"):
            out[k] += 4 * out["sparse_tensors"]
    return out


def _eager_step(cores, grads, params, average):
    """One step of the eager core (on its backend), as the adapter's tf.py_function path runs
    it."""
    import tensorflow as tf
    payloads, updates = [], [[None] * len(SHAPES) for _ in range(N)]
    results = []
    for r, core in enumerate(cores):
        B = core.B
        clip = None
        if core.needs_clip_scale:   # the TF adapter hands the factor over as float32
            clip = float(tf.constant(core.clip_scale([to_backend(B, g) for g in grads[r]], N,
                                                     average), tf.float32))
        out = []
        for j, (name, _) in enumerate(SHAPES):
            param = to_backend(B, params[j]) if core.needs_param else None
            out.append(core.compress(name, to_backend(B, grads[r][j]), N, param, average,
                                     clip))
        results.append(out)
    for j, (name, _) in enumerate(SHAPES):
        kinds = [results[r][j][0] for r in range(N)]
        if kinds[0] == "dense":
            total = results[0][j][1]
            for r in range(1, N):
                total = total + results[r][j][1]
            if average:
                total = total * (1.0 / N)
        else:
            payloads.append([results[r][j][1] for r in range(N)])
            gathered = cores[0].B.cat([results[r][j][1] for r in range(N)])
        for r, core in enumerate(cores):
            if kinds[0] == "dense":
                update = core.B.float32_flat(total)
            else:
                core.count_allgather(core.B.numel(gathered), core.B.numel(results[r][j][1]))
                update = core.decompress(gathered, results[r][j][2], N, average)
            if core.separate_weight_decay:
                update = core.apply_weight_decay(name, update, to_backend(core.B, params[j]))
            updates[r][j] = to_np(update)
    return payloads, updates


def _graph_fn(cores, average):
    """The traced step of every rank's GraphCore (allgather: concatenation in rank order)."""
    import tensorflow as tf

    @tf.function
    def step(grads, params):
        ps, steps, ctxs, outs = _ProcessSet(), [], [], []
        for r, core in enumerate(cores):
            steps.append(core.step_ops(grads[r], grads[r][0], ps, average))
            outs.append([core.compress_ops(name, grads[r][j], steps[r], average, params[j])
                         for j, (name, _) in enumerate(SHAPES)])
        payloads, updates = [], [[None] * len(SHAPES) for _ in range(N)]
        for j, (name, _) in enumerate(SHAPES):
            if outs[0][j][0] == "dense":
                total = tf.add_n([outs[r][j][1] for r in range(N)]) if N > 2 else \
                    outs[0][j][1] + outs[1][j][1]
                result = total * (1.0 / N) if average else total
                words = [0] * N
            else:
                payloads.append([outs[r][j][1] for r in range(N)])
                result = tf.concat([outs[r][j][1] for r in range(N)], 0)
                words = [tf.size(outs[r][j][1], out_type=tf.int64) for r in range(N)]
            for r, core in enumerate(cores):
                updates[r][j] = core.decompress_ops(name, result, outs[r][j][2], steps[r],
                                                    words[r], average, params[j])
        return payloads, updates

    return step


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_path_equals_eager_core_bit_for_bit(case):
    import tensorflow as tf
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.core import DGCCore
    from dgc_horovod.core.backend import NumpyBackend
    from dgc_horovod.tensorflow.graph import GraphCore

    config = _config(case)
    average = CASES[case].get("_average", True)
    epochs = CASES[case].get("_epochs")
    grads, params = _data(case)
    # the reference engine on TensorFlow's eager tensors and, without clipping (NumPy's norms
    # differ from TensorFlow's in the last bit), on NumPy arrays
    refs = [[DGCCore(config, B()) for _ in range(N)]
            for B in ([TFBackend] + ([NumpyBackend] if config.clip_norm is None else []))]
    graph = [GraphCore(config, TFBackend()) for _ in range(N)]
    step_fn = _graph_fn(graph, average)
    p_tf = [tf.constant(p) for p in params]
    for t in range(STEPS):
        if epochs is not None:
            for core in sum(refs, graph):
                core.set_epoch(epochs[t])
        g_payloads, g_updates = step_fn([[tf.constant(g) for g in grads[t][r]]
                                          for r in range(N)], p_tf)
        for eager in refs:
            e_payloads, e_updates = _eager_step(eager, grads[t], params, average)
            where = f"{case}, step {t}, {eager[0].B.name}"
            for a, b in zip(e_payloads, g_payloads):
                for r in range(N):
                    assert _same(a[r], b[r]), f"{where}: payload of rank {r} differs"
            for r in range(N):
                for j, (name, _) in enumerate(SHAPES):
                    assert _same(e_updates[r][j], g_updates[r][j]), \
                        f"{where}: update {name} r{r}"
                for name, st in eager[r].states.items():
                    gt = graph[r].states[name]
                    for attr in ("u", "v", "wd"):
                        assert _same(getattr(st, attr), getattr(gt, attr)), \
                            f"{where}: {attr} of {name} on rank {r}"
                assert eager[r].steps == graph[r].steps == t + 1
                assert eager[r].density == graph[r].density
                assert _stats(eager[r].step_stats) == _stats(graph[r].step_stats, True), where
                assert _stats(eager[r].total_stats) == _stats(graph[r].total_stats, True), where
    # the step with NaN on one rank: nothing entered the state, every rank's update is NaN
    for core in graph:
        for st in core.states.values():
            for t_ in (st.u, st.v, st.wd):
                assert t_ is None or np.isfinite(to_np(t_)).all()
    assert graph[0].total_stats.nonfinite_tensors >= 1


def test_graph_momentum_without_the_fused_kernel_is_the_same(monkeypatch):
    """Where TensorFlow sees a GPU, classic momentum correction runs as momentum_correction's
    ops instead of ResourceApplyMomentum (graph.fused_momentum): the same bits, here on the
    CPU."""
    import dgc_horovod.tensorflow.graph as graph
    monkeypatch.setattr(graph, "fused_momentum", lambda: False)
    test_graph_path_equals_eager_core_bit_for_bit("default")


def test_graph_checkpoint_round_trip_resumes_bit_for_bit():
    """state_dict / load_state_dict of a GraphCore whose graph is traced: the variables the graph
    holds take the loaded values, and the resumed run equals the uninterrupted one."""
    import tensorflow as tf
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import GraphCore

    config = _config("default")
    grads, params = _data("default")
    p_tf = [tf.constant(p) for p in params]
    feed = [[[tf.constant(g) for g in grads[t][r]] for r in range(N)] for t in range(STEPS)]
    a = [GraphCore(config, TFBackend()) for _ in range(N)]
    b = [GraphCore(config, TFBackend()) for _ in range(N)]
    fa, fb = _graph_fn(a, True), _graph_fn(b, True)
    for t in range(3):
        fa(feed[t], p_tf)
        fb(feed[t], p_tf)
    saved = [core.state_dict() for core in a]
    for t in range(3, STEPS):       # b trains on, then goes back to the checkpoint
        fb(feed[t], p_tf)
    for core, sd in zip(b, saved):
        core.load_state_dict(sd)
    assert [core.steps for core in b] == [3, 3]
    for t in range(3, STEPS):
        pa, ua = fa(feed[t], p_tf)
        pb, ub = fb(feed[t], p_tf)
        assert all(_same(x, y) for x, y in zip(tf.nest.flatten(pa), tf.nest.flatten(pb)))
        assert all(_same(x, y) for x, y in zip(tf.nest.flatten(ua), tf.nest.flatten(ub)))
    for x, y in zip(a, b):
        assert _stats(x.total_stats) == _stats(y.total_stats)
        for name, st in x.states.items():
            assert _same(st.v, y.states[name].v) and _same(st.u, y.states[name].u)
    # a reset (elastic): every traced variable restarts at zero
    b[0].load_state_dict(b[0].state_dict(), reset_residuals=True)
    assert all(not to_np(st.v).any() for st in b[0].states.values() if st.v is not None)


def test_graph_checkpoint_of_another_model_is_refused_before_anything_changes():
    import tensorflow as tf
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import GraphCore

    config = _config("default")
    grads, params = _data("default")
    cores = [GraphCore(config, TFBackend()) for _ in range(N)]
    fn = _graph_fn(cores, True)
    fn([[tf.constant(g) for g in grads[0][r]] for r in range(N)], [tf.constant(p) for p in params])
    sd = cores[0].state_dict()
    sd["tensors"] = {"other/" + k: v for k, v in sd["tensors"].items()}
    before = to_np(cores[0].states["fc1/kernel:0"].v)
    with pytest.raises(ValueError, match="does not fit this model"):
        cores[0].load_state_dict(sd)
    assert np.array_equal(to_np(cores[0].states["fc1/kernel:0"].v), before)
    assert cores[0].steps == 1
    cores[0].load_state_dict(cores[0].state_dict())     # its own, after the trace: accepted
    assert np.array_equal(to_np(cores[0].states["fc1/kernel:0"].v), before)


@pytest.mark.parametrize("what, mangle", [
    ("another header", lambda p: np.concatenate([[7], p[1:]])),
    ("another number of elements", lambda p: np.concatenate([p[:1], [p[1] + 1], p[2:]])),
    ("is truncated", lambda p: p[:-1]),
    ("unexpected trailing words", lambda p: np.concatenate([p, [0]])),
    # a zero (escape) token where the header counts one token per entry
    ("index tokens that do not match", lambda p: np.concatenate([p[:6], [p[6] & ~0xFFFF],
                                                                  p[7:]])),
])
def test_graph_decode_names_the_tensor_and_what_is_wrong(what, mangle):
    import tensorflow as tf
    from dgc_horovod.core import wire
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import decode_sum

    B = TFBackend()
    good = to_np(wire.encode(B, 100, tf.constant([3, 70], tf.int64),
                             tf.constant([1.0, -2.0]), 0, "delta16"))
    dense, bad = tf.function(decode_sum)(tf.constant(np.concatenate([good, good])), 100,
                                         tf.constant(2), "layer/kernel:0")
    assert to_np(dense)[3] == 2.0 and to_np(dense)[70] == -4.0 and not bool(bad)
    payload = np.concatenate([good, mangle(good)]).astype(np.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match=what) as e:
        tf.function(decode_sum)(tf.constant(payload), 100, tf.constant(2), "layer/kernel:0")
    assert "layer/kernel:0" in str(e.value)


def test_graph_decode_one_scatter_equals_the_rank_loop():
    """The CPU's one scatter_nd in rank order and the GPU's scatter per rank give the same bits
    (3 ranks, every position sent by several of them, int32 and delta16 payloads)."""
    import tensorflow as tf
    from dgc_horovod.core import wire
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import decode_sum

    B, rng, n = TFBackend(), np.random.default_rng(3), 5000
    payloads = []
    for r in range(3):
        idx = np.sort(rng.choice(200, 120, replace=False)) * 25
        vals = (rng.standard_normal(120) * 10 ** rng.uniform(-6, 6, 120)).astype(np.float32)
        payloads.append(to_np(wire.encode(B, n, tf.constant(idx, tf.int64), tf.constant(vals),
                                          0, "delta16" if r != 1 else "int32")))
    gathered = tf.constant(np.concatenate(payloads))
    one = tf.function(lambda g: decode_sum(g, n, tf.constant(3), "t", rank_loop=False))(gathered)
    loop = tf.function(lambda g: decode_sum(g, n, tf.constant(3), "t", rank_loop=True))(gathered)
    eager, _ = wire.decode_sum(B, gathered, n, 3)
    assert _same(one[0], loop[0]) and _same(one[0], eager)


def _bucket_segments(B, n_ranks=3):
    """Each rank's payloads for a bucket of members of 5000, 300 and 70000 elements (delta16,
    int32, float16 values, an escape gap), framed by the eager wire.frame_bucket."""
    import tensorflow as tf
    from dgc_horovod.core import wire

    rng, sizes = np.random.default_rng(11), [5000, 300, 70000]
    formats = [("delta16", "float32"), ("int32", "float32"), ("delta16", "float16")]
    payloads = []
    for r in range(n_ranks):
        mine = []
        for n, (index, values) in zip(sizes, formats):
            idx = np.sort(rng.choice(n, 40, replace=False))
            vals = rng.standard_normal(40).astype(np.float32)
            mine.append(to_np(wire.encode(B, n, tf.constant(idx, tf.int64), tf.constant(vals),
                                          0, index, values)))
        payloads.append(mine)
    return sizes, payloads


@pytest.mark.parametrize("rank_loop", [False, True], ids=["segment-sum", "rank-loop"])
def test_graph_bucket_frame_and_decode_equal_the_eager_wire(rank_loop):
    """A bucket's segment in the graph is the eager frame_bucket's, word for word, and each
    member decodes to the eager split_bucket + decode_sum of it (3 ranks, three wire formats);
    the members' word counts add up to the allgather (the statistics' received bytes)."""
    import tensorflow as tf
    from dgc_horovod.core import wire
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import decode_bucket, frame_bucket

    B = TFBackend()
    sizes, payloads = _bucket_segments(B)
    segments = []
    for mine in payloads:
        eager = to_np(wire.frame_bucket(B, list(enumerate(tf.constant(p) for p in mine)),
                                        like=tf.constant(mine[0])))
        graph = to_np(tf.function(frame_bucket)([tf.constant(p) for p in mine]))
        assert np.array_equal(eager, graph)
        segments.append(graph)
    gathered = tf.constant(np.concatenate(segments))
    names = ["a:0", "b:0", "c:0"]
    out = tf.function(lambda g: decode_bucket(g, sizes, names, tf.constant(3), "bucket.a:0",
                                              rank_loop=rank_loop))(gathered)
    parts = wire.split_bucket(B, gathered, 3, 3)
    for (dense, bad, _), n, member in zip(out, sizes, parts):
        want, nonfinite = wire.decode_sum(B, tf.concat(member, 0), n, 3)
        assert _same(dense, want) and bool(bad) == bool(nonfinite) is False
    assert sum(int(w) for _, _, w in out) == int(tf.size(gathered))


@pytest.mark.parametrize("what, mangle", [
    ("another header than a DGC bucket", lambda s: np.concatenate([[s[0] + 1], s[1:]])),
    ("entry count differs from its 3 tensors", lambda s: np.concatenate([s[:1], [2], s[2:]])),
    ("names another member where member 0", lambda s: np.concatenate([s[:2], [1], s[3:]])),
    ("is truncated", lambda s: s[:-3]),
    ("unexpected trailing words", lambda s: np.concatenate([s, [7]])),
])
def test_graph_bucket_decode_names_the_bucket_and_what_is_wrong(what, mangle):
    """A malformed segment (rank 1's) stops the step with an error naming the bucket (or the
    member's tensor, for a payload cut short), what is wrong, and the rank."""
    import tensorflow as tf
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import decode_bucket, frame_bucket

    B = TFBackend()
    sizes, payloads = _bucket_segments(B, 2)
    segments = [to_np(tf.function(frame_bucket)([tf.constant(p) for p in mine]))
                for mine in payloads]
    gathered = np.concatenate([segments[0], mangle(segments[1])]).astype(np.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match=what) as e:
        tf.function(lambda g: decode_bucket(g, sizes, ["a:0", "b:0", "c:0"], tf.constant(2),
                                            "bucket.a:0"))(tf.constant(gathered))
    assert ("bucket.a:0" in str(e.value) or "c:0" in str(e.value)) and "rank" in str(e.value)


def test_graph_set_step_keeps_the_counted_statistics():
    """set_step moves the warm-up position; what the graphs counted before stays in the
    statistics (read or not), and with warmup_epochs the step counter is left as it is."""
    import tensorflow as tf
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.core import DGCConfig
    from dgc_horovod.tensorflow.graph import GraphCore

    grads, params = _data("default")
    p_tf = [tf.constant(p) for p in params]
    for config in (_config("default"),
                   DGCConfig(environ={}, compress_ratio=0.004, warmup_epochs=2, seed=7)):
        cores = [GraphCore(config, TFBackend()) for _ in range(N)]
        fn = _graph_fn(cores, True)
        for t in range(3):
            fn([[tf.constant(g) for g in grads[t][r]] for r in range(N)], p_tf)
        cores[0].set_step(100, steps_per_epoch=50)
        assert cores[0].total_stats.steps == 3 and cores[0].total_stats.tensors == 3 * len(SHAPES)
        if config.warmup_epochs is None:
            assert cores[0].steps == 100
        else:
            assert cores[0].steps == 3 and cores[0].epoch == 2.0
        fn([[tf.constant(g) for g in grads[3][r]] for r in range(N)], p_tf)
        assert cores[0].total_stats.steps == 4
        assert cores[0].steps == (101 if config.warmup_epochs is None else 4)


def test_graph_checkpoint_with_other_sizes_is_refused_before_anything_changes():
    """A checkpoint whose tensor has the traced name but another size: refused, naming it,
    with the step counter and every variable as they were."""
    import tensorflow as tf
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import GraphCore

    config = _config("default")
    grads, params = _data("default")
    cores = [GraphCore(config, TFBackend()) for _ in range(N)]
    fn = _graph_fn(cores, True)
    for t in range(2):
        fn([[tf.constant(g) for g in grads[t][r]] for r in range(N)],
           [tf.constant(p) for p in params])
    sd = cores[0].state_dict()
    entry = dict(sd["tensors"]["fc2/kernel:0"])
    entry.update(numel=600, u=np.zeros(600, np.float32), v=np.zeros(600, np.float32))
    sd = dict(sd, steps=77, tensors=dict(sd["tensors"], **{"fc2/kernel:0": entry}))
    before = {k: to_np(st.v) for k, st in cores[0].states.items() if st.v is not None}
    with pytest.raises(ValueError, match=r"'fc2/kernel:0' has 600 elements"):
        cores[0].load_state_dict(sd)
    assert cores[0].steps == 2
    for k, v in before.items():
        assert np.array_equal(to_np(cores[0].states[k].v), v)


def test_graph_float16_warning_counts_every_step():
    """float16 overflows are warned about when the statistics are read, from the entries
    counted since the last read: the overflow step (the third) is not the last one run."""
    import warnings
    import tensorflow as tf
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import GraphCore

    case = "float16_values"
    config = _config(case)
    grads, params = _data(case)
    cores = [GraphCore(config, TFBackend()) for _ in range(N)]
    fn = _graph_fn(cores, True)
    for t in range(STEPS):
        fn([[tf.constant(g) for g in grads[t][r]] for r in range(N)],
           [tf.constant(p) for p in params])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        total = cores[0].total_stats.overflowed_entries
    assert total > 0
    assert any("exceed float16's range" in str(w.message) for w in seen), \
        [str(w.message)[:80] for w in seen]


def test_graph_variables_made_at_a_later_trace():
    """A tensor Horovod reduces from a later step on (its gradient None before) gets its
    variables at that trace; tf.function refuses tf.Variable there, DGC's are made eagerly."""
    import horovod.tensorflow as hvd
    from dgc_horovod.tensorflow import DGC

    hvd.init()
    dgc = DGC(compress_ratio=0.01, momentum=0.9, min_sparse_numel=10)
    import tensorflow as tf
    a = tf.Variable(np.ones([20, 20], np.float32), name="a")
    b = tf.Variable(np.ones([20, 20], np.float32), name="b")
    for use_b in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * a) + (tf.reduce_sum(b * b) if use_b else 0.0)
        grads = hvd.DistributedGradientTape(tape, compression=dgc).gradient(loss, [a, b])
        assert (grads[1] is None) == (not use_b)
    assert len(dgc._core.states) == 2


@pytest.mark.parametrize("positions", [[0, 1, 2, 65534], [70000], [3, 65539, 65540, 200000],
                                       [131070, 131071, 262143]])
def test_graph_encode_and_decode_with_escapes_equal_the_eager_wire(positions):
    """Gaps beyond 65535 take escape tokens: the graph's payload is the eager encoder's, word
    for word, and decodes to the same sum (with and without escapes)."""
    import tensorflow as tf
    from dgc_horovod.core import wire
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import decode_sum, encode

    B, n = TFBackend(), 262144
    idx = tf.constant(positions, tf.int64)
    vals = tf.constant(np.arange(1, len(positions) + 1, dtype=np.float32))
    eager = to_np(wire.encode(B, n, idx, vals, 0, "delta16"))
    graph = to_np(tf.function(lambda i, v: encode(n, i, v, len(positions)))(idx, vals))
    assert np.array_equal(eager, graph)
    gathered = tf.constant(np.concatenate([graph, graph]))
    dense, bad = tf.function(lambda g: decode_sum(g, n, tf.constant(2), "t"))(gathered)
    want, _ = wire.decode_sum(B, gathered, n, 2)
    assert _same(dense, want) and not bool(bad)
    assert np.array_equal(np.flatnonzero(to_np(dense)), positions)


def _select_cases():
    """(name, v, density, exact) for test_graph_select_is_the_rule: each of the rule's ways
    (normal, nan-inf and few take the lower level; all-equal has more candidates than the
    cap)."""
    rng = np.random.default_rng(2)
    normal = rng.standard_normal(300000).astype(np.float32)
    ties = (np.round(normal * 4) / 4).astype(np.float32)
    odd = normal[:20000].copy()
    odd[[5, 77, 1234]] = [np.nan, np.inf, -np.inf]
    few = np.zeros(5000, np.float32)
    few[rng.choice(5000, 7, replace=False)] = 1.5       # fewer non-zeros than k
    return [("normal", normal, 0.001, False), ("ties", ties, 0.004, False),
            ("ties-small", ties[:1000], 0.01, False), ("nan-inf", odd, 0.004, False),
            ("few", few, 0.01, False),
            ("all-equal", np.full(30000, 0.5, np.float32), 0.01, False),  # beyond the cap
            ("exact", ties[:70000], 0.004, True), ("dense", ties[:1000], 0.6, False),
            ("one", normal[:200000], 1e-9, False)]


@pytest.mark.parametrize("static", [True, False], ids=["static-size", "dynamic-size"])
@pytest.mark.parametrize("case", [c[0] for c in _select_cases()])
def test_graph_select_is_the_rule(case, static):
    """graph.select (one graph, no host read) sends sparsify.select's positions on the NumPy
    reference, for each of the rule's ways: sampled levels (upper, lower), ties to the lower
    position, NaN/Inf, fewer candidates than k, more than the cap, no sampling (exact top-k,
    k >= n/2), k = 1."""
    import tensorflow as tf
    from dgc_horovod.core import DGCConfig, sparsify
    from dgc_horovod.core.backend import NumpyBackend
    from dgc_horovod.tensorflow.graph import plan_row, select

    _, v, density, exact = next(c for c in _select_cases() if c[0] == case)
    n = v.size
    config = DGCConfig(environ={}, exact_topk=exact)
    p = sparsify.plan(n, density, config)
    base = sparsify.sample_base(sparsify.seed_key(7), sparsify.tensor_key(case), 3)
    want = sparsify.select(NumpyBackend(), v, p, base)
    spec = [tf.TensorSpec([n if static else None], tf.float32), tf.TensorSpec([5], tf.int64),
            tf.TensorSpec([], tf.int64)]
    fn = tf.function(lambda v, plan, base: select(v, n, plan, base), input_signature=spec)
    got = to_np(fn(tf.constant(v), tf.constant(plan_row(n, density, config), tf.int64),
                   tf.constant(base, tf.int64)))
    assert got.dtype == np.int64 and np.array_equal(got, want), (case, got.size, want.size)


class _Allgather:
    """horovod.tensorflow for the graph module, its allgather that of N ranks that sent the same
    segment."""

    def __getattr__(self, name):
        import horovod.tensorflow as hvd
        return getattr(hvd, name)

    @staticmethod
    def allgather(x, name=None, process_set=None):
        import tensorflow as tf
        return tf.concat([x] * N, 0)


class _OneProcessSet(_ProcessSet):
    process_set_id = 0


def _one_rank_fn(core, average, buckets):
    """One rank's traced step, every rank having sent the same (the allgather: N copies): its
    sparsified gradients exchanged in buckets (GraphCore.plan_ops, as the adapter plans them)
    or one allgather per tensor (compress_ops)."""
    import tensorflow as tf

    names = [name for name, _ in SHAPES]

    @tf.function(autograph=False)
    def step(grads, params):
        ps = _OneProcessSet()
        s = core.step_ops(grads, grads[0], ps, average)
        members = core.plan_ops(list(zip(names, grads, params)), s, ps, average) \
            if buckets else {}
        updates = []
        for name, g, p in zip(names, grads, params):
            if name in members:
                ctx, decoded = members[name]
                updates.append(core.decompress_ops(name, decoded, ctx, s, None, average, p))
                continue
            kind, out, ctx = core.compress_ops(name, g, s, average, p)
            if kind == "dense":
                result, words = (out * N) * (1.0 / N) if average else out * N, 0
            else:
                result, words = _Allgather.allgather(out), tf.size(out, out_type=tf.int64)
            updates.append(core.decompress_ops(name, result, ctx, s, words, average, p))
        return updates

    return step


@pytest.mark.parametrize("case", sorted(CASES) + ["small_buckets"])
def test_graph_buckets_equal_one_allgather_per_tensor_bit_for_bit(case, monkeypatch):
    """A bucket's members (GraphCore.bucket_ops: one framed allgather, decode_bucket) get the
    updates, u, v, weight-decay buffers and statistics of one allgather per
    tensor, bit for bit, for every option of test_graph_path_equals_eager_core_bit_for_bit
    (NaN steps included); the statistics differ only by the framing: 12 bytes per bucket and
    step for its first member, 4 for each other, sent and received alike. ``small_buckets``:
    bucket_numel=5000, several buckets."""
    import tensorflow as tf
    import dgc_horovod.tensorflow.graph as graph
    from dgc_horovod.backends.tf_backend import TFBackend

    from dgc_horovod.core.buckets import plan_buckets

    monkeypatch.setattr(graph, "hvd", _Allgather())
    bucket_numel = 5000 if case == "small_buckets" else 1 << 22
    case = "default" if case == "small_buckets" else case
    config = _config(case, bucket_numel=bucket_numel)
    average = CASES[case].get("_average", True)
    epochs = CASES[case].get("_epochs")
    grads, params = _data(case)
    plan = plan_buckets([(n, int(np.prod(shape)), len(shape)) for n, shape in SHAPES],
                        bucket_numel, config)
    members = [sum(flags) for _, flags in plan if any(flags)]
    framing = 4 * (2 * len(members) + sum(members))     # bytes per step, each way
    assert len(members) == (2 if bucket_numel == 5000 else 1)
    cores = {b: graph.GraphCore(config, TFBackend()) for b in (False, True)}
    fns = {b: _one_rank_fn(core, average, b) for b, core in cores.items()}
    p_tf = [tf.constant(p) for p in params]
    for t in range(STEPS):
        out = {}
        for b, core in cores.items():
            if epochs is not None:
                core.set_epoch(epochs[t])
            out[b] = fns[b]([tf.constant(g) for g in grads[t][NAN_RANK]], p_tf)
        where = f"{case}, step {t}"
        for j, (name, _) in enumerate(SHAPES):
            assert _same(out[False][j], out[True][j]), f"{where}: update of {name}"
        one, bucketed = cores[False], cores[True]
        for name, st in one.states.items():
            for attr in ("u", "v", "wd"):
                assert _same(getattr(st, attr), getattr(bucketed.states[name], attr)), \
                    f"{where}: {attr} of {name}"
        want = _stats(one.step_stats)
        for k in ("wire_bytes", "received_bytes"):
            want[k] += framing if k == "wire_bytes" else framing * (N - 1)
        assert _stats(bucketed.step_stats) == want, where


@pytest.mark.parametrize("called", [False, True], ids=["never-called", "called"])
def test_graph_says_once_when_an_epoch_warmup_never_gets_set_epoch(called, monkeypatch, capfd):
    """As the eager core warns (tests/test_fidelity.py): with warmup_epochs and no set_epoch()
    call, the traced step prints the warning to stderr once, at the first step beyond
    EPOCH_CALL_CHECK_STEPS, naming the density still in force; after a set_epoch() call it
    says nothing."""
    import tensorflow as tf
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.core import DGCConfig, compressor
    from dgc_horovod.tensorflow.graph import GraphCore

    monkeypatch.setattr(compressor, "EPOCH_CALL_CHECK_STEPS", 3)
    core = GraphCore(DGCConfig(environ={}, warmup_epochs=4), TFBackend())
    if called:
        core.set_epoch(0)

    @tf.function(autograph=False)
    def step(g):
        return core.step_ops([g], g, _ProcessSet(), True).step

    g = tf.ones([30, 30])
    capfd.readouterr()
    assert [int(step(g)) for _ in range(7)] == list(range(1, 8))
    said = [line for line in capfd.readouterr().err.splitlines() if "never called" in line]
    if called:
        assert said == []
    else:
        assert len(said) == 1 and "set_epoch" in said[0] and "density 0.25 " in said[0], said
