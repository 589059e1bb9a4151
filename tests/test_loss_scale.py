"""Loss scaling (DGCCore.set_loss_scale, the torch adapter's ``DGC(loss_scaler=...)``).

The core's rule (module docstring of dgc_horovod/core/precision.py): the state is kept in the
units of the current loss scale S, rescaled by S_t/S when the scale changes; clipping compares
the unscaled norm, weight decay adds λ·S_t·w. So training on S_t·g and dividing each update by
S_t must give exactly the updates of training on g, with power-of-two scales bit for bit.
The horovodrun check of the same with torch.amp.GradScaler: tests/test_loss_scaler_horovod.py.
"""
import warnings

import numpy as np
import pytest

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend
from dgc_horovod.core.checkpoint import STATE_DICT_VERSION

F32 = np.float32
N = 2
SHAPES = {"w": (6, 50), "b": (6,)}          # w sparsified, b dense (1-D)
# the loss scale of each step: backs off, grows, falls far, as GradScaler's do (powers of two)
SCALES = [2.0 ** 10, 2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 11, 2.0 ** 11, 2.0 ** 4, 2.0 ** 16]
NONFINITE_STEP = 2                          # rank 1's gradient is inf: the step is skipped
SETTINGS = {
    "plain": {},
    "nesterov": {"nesterov": True},
    "no_masking": {"momentum_masking": False},
    "error_feedback": {"momentum": 0.0},
    "clip_global": {"clip_norm": 0.3},
    "clip_tensor": {"clip_norm": 0.3, "clip_scope": "tensor"},
    "weight_decay_separate": {"weight_decay": 0.1},
    "weight_decay_accumulated": {"weight_decay": 0.1, "weight_decay_mode": "accumulated"},
    # scales that float16 can carry (2**16 overflows: then the scaled run rightly differs, as
    # it would by flushing values below 2**-25 that the unscaled run sends as 0)
    "float16_wire": {"wire_values": "float16", "scales": SCALES[:-1] + [2.0 ** 12]},
    "clip_and_weight_decay_sum": {"clip_norm": 0.3, "weight_decay": 0.1, "average": False},
}


def cores(settings, engine):
    settings = {k: v for k, v in settings.items() if k not in ("average", "scales")}
    return [DGCCore(DGCConfig(compress_ratio=0.05, warmup_epochs=0, environ={}, engine=engine,
                              **settings), NumpyBackend()) for _ in range(N)]


def gradients(step, w):
    """Per-rank float32 gradients of a fixed quadratic-ish loss at the weights w."""
    out = []
    for rank in range(N):
        rng = np.random.default_rng(100 * step + rank)
        out.append({n: (rng.standard_normal(s).astype(F32) + F32(0.5) * w[n]).astype(F32)
                    for n, s in SHAPES.items()})
    return out


def step_updates(ranks, grads, w, average, scale=None):
    """One step through every rank's DGCCore, as the adapters drive it: set_loss_scale (when
    scale is given), the global clipping factor, compress, the exchange (allgather =
    concatenation in rank order; dense: sum / N), decompress, separate weight decay.
    Returns {name: rank 0's update} (asserted identical on every rank)."""
    B = ranks[0].B
    if scale is not None:
        for c in ranks:
            c.set_loss_scale(scale)
    clips = [c.clip_scale(list(g.values()), N, average) if c.needs_clip_scale else None
             for c, g in zip(ranks, grads)]
    updates = {}
    for name in SHAPES:
        outs = [c.compress(name, g[name].copy(), N, w[name], average, s)
                for c, g, s in zip(ranks, grads, clips)]
        if outs[0][0] == "sparse":
            gathered = B.cat([o[1] for o in outs])
            ups = [c.decompress(gathered, o[2], N, average) for c, o in zip(ranks, outs)]
        else:
            total = outs[0][1] + outs[1][1]
            ups = [total / F32(N) if average else total for _ in ranks]
        ups = [np.array(c.apply_weight_decay(name, u.copy(), w[name]))
               for c, u in zip(ranks, ups)]
        assert np.array_equal(ups[0], ups[1], equal_nan=True)
        updates[name] = ups[0]
    return updates


def train(settings, engine, scaled):
    """SGD (lr 0.1) on the updates; scaled: the gradients are multiplied by the step's scale,
    DGC is told the scale, and the update divided by it (GradScaler.unscale_). Returns the
    per-step unscaled updates and the cores."""
    average = settings.get("average", True)
    ranks = cores(settings, engine)
    w = {n: np.full(s, 0.25, F32) for n, s in SHAPES.items()}
    history = []
    for step, s in enumerate(settings.get("scales", SCALES)):
        grads = gradients(step, w)
        if step == NONFINITE_STEP:
            grads[1]["w"][0, 0] = np.inf
            grads[1]["b"][0] = np.inf
        if scaled:
            grads = [{n: (g * F32(s)).astype(F32) for n, g in r.items()} for r in grads]
        up = step_updates(ranks, grads, w, average, s if scaled else None)
        if scaled:
            up = {n: (u * F32(1.0 / s)).astype(F32) for n, u in up.items()}
        history.append(up)
        if all(np.isfinite(u).all() for u in up.values()):        # the loss scaler's skip
            w = {n: (w[n] - F32(0.1) * up[n].reshape(w[n].shape)).astype(F32) for n in w}
    return history, ranks


@pytest.mark.unit
@pytest.mark.parametrize("engine", ["c", "ops"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_scaled_training_gives_the_unscaled_updates_bit_for_bit(setting, engine):
    plain, plain_ranks = train(SETTINGS[setting], engine, scaled=False)
    scaled, scaled_ranks = train(SETTINGS[setting], engine, scaled=True)
    for step, (a, b) in enumerate(zip(plain, scaled)):
        for name in SHAPES:
            assert np.array_equal(a[name], b[name], equal_nan=True), (setting, step, name)
    assert not all(np.isfinite(u).all() for u in plain[NONFINITE_STEP].values())
    # the state is the unscaled algorithm's times the last scale (the docstring's mapping)
    last = SETTINGS[setting].get("scales", SCALES)[-1]
    for pc, sc in zip(plain_ranks, scaled_ranks):
        assert sc.loss_scale == last and pc.loss_scale == 1.0
        for name in SHAPES:
            for key in ("u", "v", "wd"):
                x, y = getattr(pc.states[name], key), getattr(sc.states[name], key)
                assert (x is None) == (y is None)
                if x is not None:
                    assert np.array_equal(x * F32(last), y), (name, key)
    # the settings matter: clipping and weight decay change the updates
    if setting not in ("plain", "float16_wire", "clip_and_weight_decay_sum"):
        base, _ = train(SETTINGS["plain"], engine, scaled=False)
        assert not all(np.array_equal(x["w"], y["w"], equal_nan=True)
                       for x, y in zip(base, plain))


@pytest.mark.unit
def test_without_set_loss_scale_a_change_of_scale_breaks_the_equality():
    """The test above can fail: telling DGC the first scale only (as if it never saw a change)
    gives different updates after the first change."""
    ranks = cores({}, "auto")
    w = {n: np.full(s, 0.25, F32) for n, s in SHAPES.items()}
    plain_ranks = cores({}, "auto")
    differs = []
    for step, s in enumerate(SCALES[:6]):
        grads = gradients(step, w)
        ref = step_updates(plain_ranks, grads, w, True)
        scaled = [{n: (g * F32(s)).astype(F32) for n, g in r.items()} for r in grads]
        up = step_updates(ranks, scaled, w, True, SCALES[0])
        differs.append(not np.array_equal(ref["b"], (up["b"] * F32(1 / s)).astype(F32)))
    assert differs[:2] == [False, False] and any(differs[2:])


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "x", None, True])
def test_set_loss_scale_refuses_a_bad_scale(bad):
    core = cores({}, "auto")[0]
    with pytest.raises(ValueError, match="loss scale must be a finite number > 0"):
        core.set_loss_scale(bad)
    assert core.loss_scale == 1.0


@pytest.mark.unit
def test_rescaling_that_overflows_drops_the_tensor_state():
    core = cores({}, "auto")[0]
    core.set_loss_scale(1.0)
    core.compress("w", np.full(SHAPES["w"], 1e30, F32), N)
    core.compress("b", np.full(SHAPES["b"], 1.0, F32), N)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        core.set_loss_scale(2.0 ** 30)
    dgc = [str(c.message) for c in caught if issubclass(c.category, UserWarning)]
    assert len(dgc) == 1 and "'w'" in dgc[0] and "overflowed float32" in dgc[0]
    w, b = core.states["w"], core.states["b"]
    assert not w.u.any() and not w.v.any()                  # dropped, not inf
    assert np.array_equal(b.u, np.full(6, 2.0 ** 30, F32))   # rescaled


@pytest.mark.unit
def test_checkpoint_records_the_loss_scale_and_reads_version_2():
    a = cores({}, "auto")[0]
    a.set_loss_scale(2.0 ** 12)
    a.compress("b", np.ones(6, F32), N)
    sd = a.state_dict()
    assert sd["version"] == STATE_DICT_VERSION == 4 and sd["loss_scale"] == 2.0 ** 12
    b = cores({}, "auto")[0]
    b.load_state_dict(sd)
    assert b.loss_scale == 2.0 ** 12
    b.set_loss_scale(2.0 ** 13)                         # rescaled from the recorded scale
    assert np.array_equal(b.states["b"].u, np.full(6, 2.0, F32))
    # version 2 (before loss_scale): loads; the scale is unknown, the next one is adopted
    old = dict(sd, version=2)
    del old["loss_scale"]
    c = cores({}, "auto")[0]
    c.load_state_dict(old)
    assert c.loss_scale == 1.0 and c.state_dict()["loss_scale"] is None
    c.set_loss_scale(2.0 ** 13)
    assert np.array_equal(c.states["b"].u, np.ones(6, F32))          # not rescaled
    assert c.loss_scale == 2.0 ** 13
    for bad in (0.0, float("nan"), "2"):
        with pytest.raises(ValueError, match="'loss_scale' must be a finite number > 0"):
            cores({}, "auto")[0].load_state_dict(dict(sd, loss_scale=bad))
    with pytest.raises(ValueError, match="reads versions 2, 3, 4"):
        cores({}, "auto")[0].load_state_dict(dict(sd, version=1))


@pytest.mark.adapter
def test_torch_dgc_refuses_a_loss_scaler_without_get_scale():
    from dgc_horovod.torch import DGC
    with pytest.raises(TypeError, match="loss_scaler must be a loss scaler with a get_scale"):
        DGC(loss_scaler=object())
    with pytest.raises(TypeError, match="got float"):
        DGC(loss_scaler=2.0 ** 16)


@pytest.mark.adapter
def test_torch_dgc_refuses_a_bad_scale_from_the_scaler():
    from dgc_horovod.torch import DGC

    class Broken:
        def get_scale(self):
            return float("inf")

    dgc = DGC(loss_scaler=Broken())
    with pytest.raises(ValueError, match=r"loss_scaler.get_scale\(\) must return a finite"):
        dgc._read_loss_scale()
