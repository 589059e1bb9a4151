"""A step a loss scaler skips (DGCCore.skip_nonfinite_steps, set by the torch adapter with
``DGC(loss_scaler=GradScaler)``).

GradScaler skips the whole optimizer step when any reduced gradient is non-finite, so a step in
which one tensor's gradient is inf on one rank applies nothing, the other tensors' finite
updates included. What each rank's state must then be, by the core's own rule for a discarded
exchange (decompress after a non-finite sum puts back the entries the rank sent): the state a
rank would have if *every* tensor's exchange of that step had been non-finite, i.e. the step's
gradient accumulated into u and v and nothing taken out. The oracle is that: for rank r, a twin
pair of cores fed the same gradients, but with the other rank's gradients all inf at that step
(so every decode is non-finite and the per-tensor restore runs). The states (u, v, the separate
weight decay's buffer) must equal the twin's bit for bit, for every order in which the
results come back, the non-finite tensor sparsified or dense, and so must the steps after.
Without skip_nonfinite_steps they differ (the finite tensors' sent entries are gone): the test
can fail.
"""
import numpy as np
import pytest

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend, regions
from dgc_horovod.backends.torch_backend import TorchBackend
from helpers import to_backend, to_np

pytestmark = pytest.mark.unit

F32 = np.float32
N = 2
SHAPES = {"a": (8, 50), "c": (4, 30), "d": (5, 40), "e": (3, 64), "b": (6,)}  # b dense (1-D)
BUCKETS = [["a", "c"], ["d", "e"]]      # bucket=True: two compress_many calls before any decode
ORDER = ["a", "c", "d", "e", "b"]
SKIP = 2                                              # the step with an inf on rank 1
SETTINGS = {
    "plain": {},
    "no_masking": {"momentum_masking": False},
    "error_feedback": {"momentum": 0.0},
    "nesterov": {"nesterov": True},
    "weight_decay_separate": {"weight_decay": 0.1},
    "float16_wire": {"wire_values": "float16"},
    "regions": {"exchange": "regions"},
}
BACKENDS = {"numpy": NumpyBackend, "torch": TorchBackend}


def make(setting, backend, engine, skip=True):
    out = []
    for _ in range(N):
        c = DGCCore(DGCConfig(compress_ratio=0.05, warmup_epochs=0, environ={}, engine=engine,
                              **SETTINGS[setting]), BACKENDS[backend]())
        c.skip_nonfinite_steps = skip
        out.append(c)
    return out


def gradients(step):
    out = []
    for rank in range(N):
        rng = np.random.default_rng(10 * step + rank)
        out.append({n: rng.standard_normal(s).astype(F32) for n, s in SHAPES.items()})
    return out


def exchange(ranks, name, outs, regional):
    """The decoded update of a sparsified tensor on every rank, in rank order of the calls."""
    B = ranks[0].B
    if not regional:
        gathered = B.cat([o[1] for o in outs])
        return [lambda c=c, o=o: c.decompress(gathered, o[2], N) for c, o in zip(ranks, outs)]
    numel = outs[0][2].numel
    parts = [regions.split_payload(B, o[1], numel, N, name) for o in outs]
    owned = []
    for j, c in enumerate(ranks):            # region j's owner reduces what the ranks sent it
        sent = [p[j] for p in parts if p[j] is not None]
        gathered = B.cat(sent) if sent else B.int32_tensor([], like=outs[0][1])
        owned.append(c.reduce_region(gathered, name, numel, j, N, len(sent)))
    pays = [p for p, _ in owned if p is not None]
    gathered = B.cat(pays)
    return [lambda c=c, o=o, d=d: c.decompress(gathered, o[2], N, ranks=len(pays), dropped=d[1])
            for c, o, d in zip(ranks, outs, owned)]


def step(ranks, grads, w, bucket, order):
    """One step as the torch adapter drives it: compress (the sparsified tensors one by one or
    in one compress_many), the exchange, then per tensor in ``order`` decompress (sparsified)
    and finish_update. Returns {name: update}."""
    B, regional = ranks[0].B, ranks[0].config.exchange == "regions"
    sparse = [n for n in SHAPES if len(SHAPES[n]) > 1]
    param = {n: to_backend(B, w[n]) for n in SHAPES}
    outs = {}
    for c, g in zip(ranks, grads):
        gb = {n: to_backend(B, g[n]) for n in SHAPES}
        if bucket:
            for names in BUCKETS:
                for n, r in zip(names, c.compress_many([(n, gb[n], param[n]) for n in names], N)):
                    outs.setdefault(n, []).append(r)
        else:
            for n in sparse:
                outs.setdefault(n, []).append(c.compress(n, gb[n], N, param[n]))
        outs.setdefault("b", []).append(c.compress("b", gb["b"], N, param["b"]))
    updates = {}
    decodes = {n: exchange(ranks, n, outs[n], regional) for n in sparse}
    for n in order:
        if n in decodes:
            ups = [d() for d in decodes[n]]
        else:
            total = to_np(outs[n][0][1]) + to_np(outs[n][1][1])
            ups = [to_backend(B, total / F32(N)) for _ in ranks]
        ups = [to_np(c.finish_update(n, u, param[n])) for c, u in zip(ranks, ups)]
        assert np.array_equal(ups[0], ups[1], equal_nan=True)
        updates[n] = ups[0]
    return updates


def state(core):
    return {(n, k): to_np(getattr(st, k)) for n, st in core.states.items()
            for k in ("u", "v", "wd")}


def run(ranks, bad, order, bucket, twin_of=None, start=0, w=None, steps=4):
    """Train steps ``start`` .. ``steps - 1`` (SGD, lr 0.1, from the weights w, skipping a step
    with a non-finite update as the scaler does); at step SKIP rank 1's gradient of ``bad`` has
    an inf. ``twin_of=r``: at step SKIP every gradient of the rank other than r is inf too.
    Returns (each rank's state after SKIP, their state_dicts then, the weights then, the updates
    of every step)."""
    w = {n: np.full(s, 0.25, F32) for n, s in SHAPES.items()} if w is None else w
    after, history = (None, None, None), []
    for t in range(start, steps):
        grads = gradients(t)
        if t == SKIP:
            grads[1][bad].reshape(-1)[3] = np.inf
            if twin_of is not None:
                for n in SHAPES:
                    grads[1 - twin_of][n][...] = np.inf
        up = step(ranks, grads, w, bucket, order)
        history.append(up)
        if all(np.isfinite(u).all() for u in up.values()):
            w = {n: (w[n] - F32(0.1) * up[n].reshape(w[n].shape)).astype(F32) for n in w}
        else:
            assert t == SKIP
        if t == SKIP:
            after = ([state(c) for c in ranks], [c.state_dict() for c in ranks], w)
    return after + (history,)


def differing(a, b):
    return [k for k in a if (a[k] is None) != (b[k] is None)
            or (a[k] is not None and not np.array_equal(a[k], b[k]))]


def order_for(bad, where):
    rest = [n for n in ORDER if n != bad]
    return [bad] + rest if where == "bad_first" else rest + [bad]


def check_like_twins(setting, after, twins):
    """Each rank's state after the skipped step is its twin's. With exchange="regions" the
    entries a rank sent that its region's owner dropped stay with the owner (keep_unapplied,
    before the step is known to be skipped), so there u must equal the twin's and v summed
    over the ranks the twins' sum (up to float32 rounding: added in another order)."""
    if setting != "regions":
        for r in range(N):
            assert not differing(after[r], twins[r][0][r]), (r, differing(after[r], twins[r][0][r]))
        return
    for key in after[0]:
        if key[1] == "u":
            for r in range(N):
                assert np.array_equal(after[r][key], twins[r][0][r][key], equal_nan=True), key
        elif key[1] == "v" and after[0][key] is not None:
            np.testing.assert_allclose(after[0][key] + after[1][key],
                                       twins[0][0][0][key] + twins[1][0][1][key],
                                       rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bucket", [False, True], ids=["per_tensor", "bucket"])
@pytest.mark.parametrize("engine", ["c", "ops"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_skipped_step_leaves_every_rank_as_if_no_exchange_happened(setting, backend,
                                                                      engine, bucket):
    for bad in ("a", "b"):
        twins = {r: run(make(setting, backend, engine), bad, ORDER, bucket,
                        twin_of=r) for r in range(N)}
        # the rest of the run from the twins' states: what the steps after must give
        resumed = make(setting, backend, engine)
        for r, c in enumerate(resumed):
            c.load_state_dict(twins[r][1][r])
        rest = run(resumed, bad, ORDER, bucket, start=SKIP + 1, w=twins[0][2])[3]
        for where in ("bad_first", "bad_last"):
            after, _, _, history = run(make(setting, backend, engine), bad,
                                       order_for(bad, where), bucket)
            check_like_twins(setting, after, twins)
            if setting == "regions":
                continue
            # the steps after go on identically (the records do not outlive their step)
            for t, want in zip(range(SKIP + 1, len(history)), rest):
                for n in SHAPES:
                    assert np.array_equal(history[t][n], want[n]), (bad, where, t, n)


@pytest.mark.parametrize("setting", ["plain", "regions", "weight_decay_separate"])
def test_without_skip_mode_the_finite_tensors_lose_what_they_sent(setting):
    """The test above can fail: without skip_nonfinite_steps the finite tensor's sent entries
    (and the weight decay buffer) are not put back, so the states differ from the twin's."""
    twin = run(make(setting, "numpy", "auto"), "a", ORDER, False, twin_of=0)[0][0]
    after = run(make(setting, "numpy", "auto", skip=False), "a", ["c", "d", "e", "b", "a"],
                False)[0][0]
    bad = differing(after, twin)
    assert ("c", "v") in bad
    if setting == "weight_decay_separate":
        assert ("c", "wd") in bad and ("b", "wd") in bad
    if setting != "regions":
        # the entries c sent are what is missing: zero in v where the twin holds them
        v, want = after["c", "v"], twin["c", "v"]
        gone = (v == 0) & (want != 0)
        assert gone.any() and np.array_equal(v[~gone], want[~gone])


def test_the_skipped_step_keeps_its_gradient_in_the_residual():
    """The twin's state is what the paper's accumulation gives with nothing sent: against a
    NumPy transcription (momentum correction u ← m·u + g, v ← v + u, §3.1; Nesterov off), up
    to float32 rounding (the core may fuse the multiply-add)."""
    ranks = make("plain", "numpy", "ops")
    w = {n: np.full(s, 0.25, F32) for n, s in SHAPES.items()}
    for t in range(SKIP):
        up = step(ranks, gradients(t), w, False, ORDER)
        w = {n: (w[n] - F32(0.1) * up[n].reshape(w[n].shape)).astype(F32) for n in w}
    before = [state(c) for c in ranks]
    grads = gradients(SKIP)
    grads[1]["a"].reshape(-1)[3] = np.inf
    up = step(ranks, grads, w, False, ["c", "d", "e", "b", "a"])
    assert np.isnan(up["a"]).all() and np.isfinite(up["c"]).all()
    m = ranks[0].config.momentum
    for r, c in enumerate(ranks):
        for n in ("a", "c", "d", "e"):
            if r == 1 and n == "a":         # its own non-finite gradient: untouched
                assert np.array_equal(to_np(c.states[n].v), before[r][n, "v"])
                continue
            u = F32(m) * before[r][n, "u"] + grads[r][n].reshape(-1)
            np.testing.assert_allclose(to_np(c.states[n].u), u, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(to_np(c.states[n].v), before[r][n, "v"] + u, rtol=1e-6,
                                       atol=1e-6)
