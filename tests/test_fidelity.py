"""The paper's semantics (Lin et al. 2018, Algorithm 1 and §3), each held to a NumPy transcription.

* local clipping (§3.2): threshold by Horovod's op, global norm over a rank's gradients, and on
  iid gradients as often / as much as a dense global clip of the averaged gradient;
* which tensors are sparsified (1-D dense, as the authors' reference code);
* weight decay: "separate" (reference DGCSGD: own momentum, dense, after the exchange) and
  "accumulated" (before momentum correction);
* a warm-up that counts its own steps (§3.3), with a warning when it cannot advance.

No launcher: the core on the NumPy backend (and torch's clip_grad_norm_ as the dense reference).
"""
import math
import warnings

import numpy as np
import pytest
import torch

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend
from dgc_horovod.core import compressor as compressor_mod
from dgc_horovod.core.accumulate import clip_threshold
from dgc_horovod.core.buckets import plan_buckets
from dgc_horovod.core.sparsify import is_sparse
from dgc_horovod.core.warmup import density_at_step

pytestmark = pytest.mark.unit

B = NumpyBackend()


def core(**kw):
    kw.setdefault("seed", 0)
    return DGCCore(DGCConfig(environ={}, **kw), B)


def exchange_one(c, name, g, world=1, param=None, average=True, clip_scale=None):
    """compress + decompress of one tensor on one worker (world 1: its own payload)."""
    kind, out, ctx = c.compress(name, g, world, param, average, clip_scale)
    if kind == "dense":
        upd = out.copy()
    else:
        upd = c.decompress(out, ctx, 1, average=False)
    return c.apply_weight_decay(name, upd, param) if param is not None else upd


# ------------------------------------------------------------------ clipping (§3.2)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_threshold_follows_horovods_op(n):
    # paper: ||grad_k|| <= C * N^-1/2 on the contribution nodes sum; Horovod's Average hands
    # DGC g_k = N * grad_k, Sum hands g_k = grad_k
    assert clip_threshold(2.0, n, average=True) == pytest.approx(2.0 * math.sqrt(n))
    assert clip_threshold(2.0, n, average=False) == pytest.approx(2.0 / math.sqrt(n))


def test_global_clip_is_one_factor_over_all_tensors():
    # numpy transcription: s = min(1, C*sqrt(N) / (sqrt(sum ||g_i||^2) + 1e-6)), the same s on
    # every tensor; at density 1 and momentum 0 the sent update is s * g exactly
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 30)).astype(np.float32)
    b = (rng.normal(size=(50, 20)) * 0.01).astype(np.float32)     # 100x smaller gradients
    C, N = 1.0, 4
    c = core(compress_ratio=1.0, momentum=0.0, momentum_masking=False, clip_norm=C,
             warmup_steps=0)
    s = c.clip_scale([a, b], N, average=True)
    ref = min(1.0, C * math.sqrt(N) / (math.sqrt(float(np.linalg.norm(a)) ** 2
                                                 + float(np.linalg.norm(b)) ** 2) + 1e-6))
    assert s == pytest.approx(ref, rel=1e-6) and s < 0.5
    ua = exchange_one(c, "a", a, N, clip_scale=s)
    ub = exchange_one(c, "b", b, N, clip_scale=s)
    np.testing.assert_array_equal(ua, (a.reshape(-1) * np.float32(s)))
    np.testing.assert_array_equal(ub, (b.reshape(-1) * np.float32(s)))


def test_per_tensor_scope_clips_each_tensor_by_its_own_norm():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(40, 30)).astype(np.float32)
    b = (rng.normal(size=(50, 20)) * 0.01).astype(np.float32)
    C, N = 1.0, 4
    c = core(compress_ratio=1.0, momentum=0.0, momentum_masking=False, clip_norm=C,
             clip_scope="tensor", warmup_steps=0)
    for name, g in (("a", a), ("b", b)):
        s = min(1.0, C * math.sqrt(N) / (float(np.linalg.norm(g)) + 1e-6))
        np.testing.assert_array_equal(exchange_one(c, name, g, N),
                                      g.reshape(-1) * np.float32(s))
    # the small tensor is not clipped at all: the direction of the update changed
    assert float(np.linalg.norm(b)) < C * math.sqrt(N)


def test_global_scope_needs_the_steps_factor_and_never_changes_state_without_it():
    c = core(clip_norm=1.0)
    g = np.ones((8, 8), np.float32)
    with pytest.raises(ValueError, match="clip_scale"):
        c.compress("w", g, 2)
    with pytest.raises(ValueError, match="clip_scale"):
        c.compress_many([("w", g, None)], 2)
    with pytest.raises(ValueError, match="clip_scale"):
        c.compress("w", g, 2, clip_scale=1.5)
    assert c.states == {} and c.steps == 0


def test_global_norm_leaves_out_nonfinite_tensors():
    c = core(clip_norm=1.0)
    a = np.full((10, 10), 1.0, np.float32)
    bad = np.full((10, 10), np.nan, np.float32)
    assert c.clip_scale([a, bad], 1) == c.clip_scale([a], 1)
    huge = np.full((10, 10), 3e38, np.float32)        # finite, but its float32 norm overflows
    assert c.clip_scale([a, huge], 1) == 0.0


def _clip_statistics(n, steps=400, dim=4000, average=True):
    """(dense, local) pairs of (fraction of clipped steps, mean clipping scale) on a stream of
    iid gradients whose scale varies from step to step."""
    rng = np.random.default_rng(n)
    C = 1.0
    c = core(clip_norm=C)
    dense_scales, local_scales = [], []
    for _ in range(steps):
        sigma = math.exp(rng.uniform(-1.0, 1.0)) / math.sqrt(dim)
        # two tensors per rank (the global norm spans them), iid across ranks
        ranks = [[(rng.normal(size=(dim // 2,)) * sigma * math.sqrt(n)).astype(np.float32)
                  for _ in range(2)] for _ in range(n)]
        reduced = [torch.tensor(sum(r[i] for r in ranks) / (n if average else 1))
                   for i in range(2)]
        params = [torch.nn.Parameter(torch.zeros_like(t)) for t in reduced]
        for p, t in zip(params, reduced):
            p.grad = t.clone()
        total = float(torch.nn.utils.clip_grad_norm_(params, C))
        dense_scales.append(min(1.0, C / (total + 1e-6)))
        local_scales.extend(c.clip_scale(r, n, average) for r in ranks)
    dense, local = np.array(dense_scales), np.array(local_scales)
    return ((np.mean(dense < 1), dense.mean()), (np.mean(local < 1), local.mean()))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_local_clipping_matches_dense_global_clipping_on_iid_gradients(n):
    (dense_frac, dense_mean), (local_frac, local_mean) = _clip_statistics(n)
    assert 0.2 < dense_frac < 0.8                     # the threshold is in the interesting range
    assert abs(local_frac - dense_frac) <= 0.1 * dense_frac
    assert abs(local_mean - dense_mean) <= 0.1 * dense_mean


def test_local_clipping_under_sum_matches_dense_clip_of_the_sum():
    (dense_frac, dense_mean), (local_frac, local_mean) = _clip_statistics(4, average=False)
    assert abs(local_frac - dense_frac) <= 0.1 * max(dense_frac, 1e-9)
    assert abs(local_mean - dense_mean) <= 0.1 * dense_mean


def test_the_old_rule_was_n_times_too_tight():
    # clip_norm / sqrt(N) under Average (the rule before this fix) clips almost every step
    n = 4
    rng = np.random.default_rng(3)
    g = rng.normal(size=1000).astype(np.float32)
    g *= 1.5 / np.linalg.norm(g)                       # ||g_k|| = 1.5, C = 1, N = 4
    c = core(clip_norm=1.0)
    assert c.clip_scale([g], n, average=True) == 1.0   # C*sqrt(N) = 2 > 1.5: not clipped
    assert c.clip_scale([g], n, average=False) < 0.34  # C/sqrt(N) = 0.5


# ------------------------------------------------------------------ which tensors are sparsified
def test_one_dimensional_tensors_go_dense_by_default():
    cfg = DGCConfig(environ={})
    assert not is_sparse(1000, 1, cfg) and is_sparse(1000, 2, cfg) and is_sparse(9, 4, cfg)
    assert is_sparse(1000, 1, DGCConfig(min_sparse_ndim=1, environ={}))
    assert not is_sparse(10, 2, DGCConfig(min_sparse_numel=100, environ={}))
    c = core()
    kind, out, _ = c.compress("bias", np.ones(50, np.float32), 2)
    assert kind == "dense" and c.states["bias"].v is None
    kind, _, _ = c.compress("weight", np.ones((5, 10), np.float32), 2)
    assert kind == "sparse" and c.states["weight"].v is not None


def test_bucket_plan_marks_dense_members_with_the_same_rule():
    cfg = DGCConfig(environ={})
    plan = plan_buckets([("fc.bias", 10, 1), ("fc.weight", 100, 2), ("conv.weight", 300, 4)],
                        200, cfg)
    assert plan == [(["fc.bias", "fc.weight", "conv.weight"], [False, True, True])]
    plan = plan_buckets([("a", 10, 2), ("b", 10, 2)], 0, cfg)
    assert plan == [(["a"], [True]), (["b"], [True])]


def test_dense_tensor_receives_its_full_momentum_sgd_displacement():
    # a persistent bias gradient: dense it moves exactly as momentum SGD (u <- m u + g sent
    # every step), the displacement the issue measured a third of with the bias sparsified
    m, steps = 0.9, 200
    g = np.full(64, 0.01, np.float32)
    c = core(momentum=m, warmup_steps=0)
    total, u = np.zeros(64, np.float32), np.zeros(64, np.float32)
    ref = np.zeros(64, np.float32)
    for _ in range(steps):
        total += exchange_one(c, "bias", g, 1)
        u = np.float32(m) * u + g
        ref += u
    np.testing.assert_allclose(total, ref, rtol=1e-5)


# ------------------------------------------------------------------ weight decay
def _momentum_sgd_with_wd(w, grads, lr, m, wd, nesterov=False):
    """torch.optim.SGD's update, transcribed: d = g + wd*w; b = m*b + d; w -= lr*(d + m*b if
    nesterov else b)."""
    w = w.copy()
    b = None
    for g in grads:
        d = g + wd * w
        b = d.copy() if b is None else m * b + d
        w -= lr * ((d + m * b) if nesterov else b)
    return w


@pytest.mark.parametrize("nesterov", [False, True])
def test_separate_weight_decay_at_density_one_is_dense_momentum_sgd(nesterov):
    rng = np.random.default_rng(4)
    w0 = rng.normal(size=(6, 7)).astype(np.float64)
    grads = [rng.normal(size=(6, 7)) for _ in range(25)]
    lr, m, wd = 0.1, 0.9, 0.05
    c = core(compress_ratio=1.0, momentum=m, nesterov=nesterov, momentum_masking=False,
             weight_decay=wd, warmup_steps=0)
    w = w0.astype(np.float32)
    for g in grads:
        upd = exchange_one(c, "w", g.astype(np.float32), 1, param=w)
        w = w - np.float32(lr) * upd.reshape(w.shape)
    ref = _momentum_sgd_with_wd(w0, grads, lr, m, wd, nesterov)
    np.testing.assert_allclose(w, ref, rtol=2e-4, atol=2e-5)


def test_separate_weight_decay_is_the_reference_two_buffer_update_bit_for_bit():
    # authors' DGCSGD: b <- m b + wd*w (b starts at wd*w), update = exchanged + b; the exchanged
    # part is DGC's sparse update of the gradient alone (weight decay never enters v)
    rng = np.random.default_rng(5)
    m, wd, density = 0.9, 1e-2, 0.1
    c = core(compress_ratio=density, momentum=m, weight_decay=wd, warmup_steps=0,
             exact_topk=True)
    plain = core(compress_ratio=density, momentum=m, warmup_steps=0, exact_topk=True)
    w = rng.normal(size=(20, 10)).astype(np.float32).reshape(-1)
    b = np.zeros_like(w)
    for _ in range(10):
        g = rng.normal(size=(20, 10)).astype(np.float32)
        got = exchange_one(c, "w", g, 1, param=w)
        sparse_only = exchange_one(plain, "w", g, 1)
        b = np.float32(m) * b + np.float32(wd) * w
        np.testing.assert_array_equal(got, sparse_only + b)
        np.testing.assert_array_equal(c.states["w"].v, plain.states["w"].v)   # wd not in v
        w = w - np.float32(0.1) * got


def test_accumulated_weight_decay_joins_the_gradient_before_momentum_correction():
    rng = np.random.default_rng(6)
    m, wd = 0.9, 1e-2
    c = core(compress_ratio=1.0, momentum=m, momentum_masking=False, weight_decay=wd,
             weight_decay_mode="accumulated", warmup_steps=0)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    u = np.zeros(64, np.float32)
    for _ in range(5):
        g = rng.normal(size=(8, 8)).astype(np.float32)
        kind, out, ctx = c.compress("w", g, 1, param=w)
        got = c.decompress(out, ctx, 1, average=False)
        gp = g.reshape(-1) + np.float32(wd) * w.reshape(-1)   # g <- g + wd*w
        u = np.float32(m) * u + gp                            # u <- m u + g ; v <- v + u
        np.testing.assert_allclose(got, u, rtol=1e-6)         # density 1: all of v is sent
    with pytest.raises(ValueError, match="param"):
        c.compress("w", g, 1)                                 # accumulated mode needs param


def test_separate_weight_decay_skips_a_nonfinite_update():
    c = core(momentum=0.9, weight_decay=0.1, warmup_steps=0)
    w = np.ones((4, 4), np.float32)
    exchange_one(c, "w", np.ones((4, 4), np.float32), 1, param=w)
    before = c.states["w"].wd.copy()
    upd = np.full(16, np.nan, np.float32)
    assert c.apply_weight_decay("w", upd, w) is upd
    np.testing.assert_array_equal(c.states["w"].wd, before)


# ------------------------------------------------------------------ warm-up (§3.3)
def test_warmup_counts_its_own_steps_without_any_call():
    W, final = 8, 0.001
    c = core(compress_ratio=final, warmup_steps=W)
    g = np.ones((100, 100), np.float32)
    seen = []
    for step in range(12):
        c.compress("w", g, 2)
        c.compress("b", np.ones((10, 10), np.float32), 2)
        seen.append(c.density)
        # transcription: four equal stages of 0.25 * (final / 0.25) ** (j / 4), then final
        stage = min(4, (4 * step) // W)
        ref = final if stage >= 4 else 0.25 * (final / 0.25) ** (stage / 4)
        assert c.density == pytest.approx(ref, rel=1e-12), step
        assert c.step_stats.selected == math.ceil(ref * 10000 - 1e-9) + math.ceil(ref * 100 - 1e-9)
    assert c.steps == 12 and seen[-1] == final
    assert [round(d, 5) for d in seen[:8:2]] == [0.25, 0.06287, 0.01581, 0.00398]


def test_density_at_step_schedule():
    assert density_at_step(0, 0.001, 1000) == 0.25
    assert density_at_step(249, 0.001, 1000) == 0.25
    assert density_at_step(250, 0.001, 1000) == pytest.approx(0.25 * 0.004 ** 0.25)
    assert density_at_step(1000, 0.001, 1000) == 0.001
    assert density_at_step(5, 0.001, 0) == 0.001
    assert density_at_step(500, 0.001, 1000, per_step=True) == pytest.approx(0.25 * 0.004 ** 0.5)
    with pytest.raises(ValueError):
        density_at_step(-1, 0.001, 1000)


def test_steps_survive_a_checkpoint_and_set_step_moves_the_position():
    c = core(warmup_steps=8)
    g = np.ones((50, 50), np.float32)
    for _ in range(5):
        c.compress("w", g, 2)
    sd = c.state_dict()
    assert sd["steps"] == 5
    d = core(warmup_steps=8)
    d.load_state_dict(sd)
    d.compress("w", g, 2)
    c.compress("w", g, 2)
    assert d.steps == c.steps == 6 and d.density == c.density
    d.set_step(100)
    d.compress("w", g, 2)
    assert d.steps == 101 and d.density == 0.004


def test_set_epoch_without_warmup_epochs_warns_that_it_does_nothing():
    c = core(warmup_steps=8)
    with pytest.warns(UserWarning, match="no effect"):
        c.set_epoch(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.set_epoch(4)                                  # once
    assert c.density == 0.25


def test_epoch_driven_warmup_warns_once_when_set_epoch_is_never_called(monkeypatch):
    monkeypatch.setattr(compressor_mod, "EPOCH_CALL_CHECK_STEPS", 3)
    c = core(warmup_epochs=4)
    g = np.ones((50, 50), np.float32)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(6):
            c.compress("w", g, 2)
    msgs = [str(w.message) for w in rec if "never called" in str(w.message)]
    assert len(msgs) == 1 and "set_epoch" in msgs[0] and "0.25" in msgs[0]
    d = core(warmup_epochs=4)
    d.set_epoch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            d.compress("w", g, 2)
    d.set_epoch(4)
    assert d.density == 0.004


def test_statistics_before_the_first_step_say_so():
    from dgc_horovod.core import CompressionStats
    assert repr(CompressionStats()) == "CompressionStats(no step yet)"
    c = core(warmup_steps=0)
    assert repr(c.step_stats) == "CompressionStats(no step yet)"
    c.compress("w", np.ones((10, 10), np.float32), 2)
    assert repr(c.step_stats).startswith("CompressionStats(steps=1, tensors=1")
    seconds = c.step_stats.compress_seconds
    assert seconds > 0 and f"compress_seconds={seconds:.6g}" in repr(c.step_stats)
