"""The path of a tensor that is not sparsified (``DGCCore._compress_dense``: biases and
normalisation scales, ResNet-50's 107 1-D tensors) against the generic steps it replaced, bit for
bit.

The reference below is what ``DGCCore._compress_locked`` computed for such a tensor before the
dedicated path (``_accumulated``'s clipping and weight decay written out with the public
functions of :mod:`dgc_horovod.core.accumulate`; the finiteness test element by element
(``torch.isfinite`` / ``np.isfinite``); a zeroed v and :func:`accumulate.momentum_correction`;
the statistics row that :meth:`StatsRecorder.count` adds). Over several steps, in every setting
that changes those steps, the velocity sent, the state u and the statistics must have the same
bits, including -0.0 (0 + -0.0 is +0.0: a copy of u would differ), non-finite and float16 /
bfloat16 gradients, a loss scale, and the separate weight decay after the exchange.
"""
import numpy as np
import pytest
import torch

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend
from dgc_horovod.core.accumulate import (add_weight_decay, clip_by_local_norm,
                                         momentum_correction)
from dgc_horovod.core.stats import StatsRecorder
from dgc_horovod.backends.torch_backend import TorchBackend

pytestmark = pytest.mark.unit

SETTINGS = {
    "classic": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "no_momentum": dict(momentum=0.0),
    "clip_tensor": dict(momentum=0.9, clip_norm=0.05, clip_scope="tensor"),
    "clip_global": dict(momentum=0.9, clip_norm=0.05, clip_scope="global"),
    "clip_global_nesterov": dict(momentum=0.9, nesterov=True, clip_norm=0.05,
                                 clip_scope="global"),
    "wd_accumulated": dict(momentum=0.9, weight_decay=1e-3, weight_decay_mode="accumulated",
                           clip_norm=0.05, clip_scope="tensor"),
    "wd_separate": dict(momentum=0.9, weight_decay=1e-3, weight_decay_mode="separate"),
}
STAT_FIELDS = ("steps", "tensors", "sparse_tensors", "elements", "selected", "wire_bytes",
               "received_bytes", "dense_bytes", "nonfinite_tensors", "overflowed_entries",
               "flushed_entries", "density")


def _reference(B, c, u, grad, param, world, average, clip_scale, loss_scale):
    """(velocity sent, True) or (the gradient itself, False) for a non-finite one; updates u."""
    g = B.float32_view(grad)
    if c.clip_norm is None:
        scale = 1.0
    elif c.clip_scope == "tensor":
        scale = clip_by_local_norm(B, g, c.clip_norm, world, average, loss_scale)
    else:
        scale = float(clip_scale)
    if c.weight_decay and c.weight_decay_mode == "accumulated":
        g = add_weight_decay(B, g, B.float32_view(param), c.weight_decay * loss_scale, scale)
        scale = 1.0
    finite = (bool(torch.isfinite(g).all()) if isinstance(g, torch.Tensor)
              else bool(np.isfinite(g).all()))
    if not finite:
        return B.float32_flat(g), False
    v = B.zeros(B.numel(g), like=g)
    momentum_correction(B, u, v, g, c.momentum, c.nesterov, scale)
    return v, True


def _bits(x):
    x = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return x.astype(np.float32).view(np.int32).tobytes()


def _gradients(B, rng, dtype, steps=6):
    """Per step: [(name, gradient, parameter)] of three dense tensors (one of them 2-D and
    made dense by min_sparse_ndim), with -0.0 entries, a NaN in step 3 and an Inf in step 4."""
    shapes = {"bn.weight": (64,), "fc.bias": (1000,), "ln.scale": (3, 7)}
    out = []
    for step in range(steps):
        entries = []
        for name, shape in shapes.items():
            g = (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 2)).astype(np.float32)
            g.reshape(-1)[::5] = -0.0
            if step == 3 and name == "fc.bias":
                g.reshape(-1)[7] = np.nan
            if step == 4 and name == "bn.weight":
                g.reshape(-1)[0] = np.inf
            p = rng.standard_normal(shape).astype(np.float32)
            if isinstance(B, TorchBackend):
                g, p = torch.from_numpy(g).to(dtype), torch.from_numpy(p).to(dtype)
            entries.append((name, g, p))
        out.append(entries)
    return out


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("torch", torch.float16),
                                           ("torch", torch.bfloat16), ("numpy", None)])
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_dense_path_is_the_generic_steps_bit_for_bit(setting, backend, dtype, loss_scale):
    B = TorchBackend() if backend == "torch" else NumpyBackend()
    c = DGCConfig(environ={}, min_sparse_ndim=3, **SETTINGS[setting])    # every tensor dense
    core = DGCCore(c, B)
    core.set_loss_scale(loss_scale)
    stats = StatsRecorder()             # the statistics the generic path counted
    world, average = 2, True
    us, nonfinite_seen = {}, 0
    for step, entries in enumerate(_gradients(B, np.random.default_rng(7), dtype)):
        if step == 1 and c.momentum:
            # -0.0 in u where the gradients have -0.0 stays -0.0 (-0 + m·-0): the velocity sent
            # is 0 + u, +0.0 there (a copy of u would send -0.0)
            for name in us:
                us[name][::5] = -0.0
                core.states[name].u[::5] = -0.0
        clip_scale = core.clip_scale([g for _, g, _ in entries], world, average) \
            if core.needs_clip_scale else None
        for name, g, p in entries:
            kind, out, ctx = core.compress(name, g, world, p, average, clip_scale)
            if name not in us:
                us[name] = None if c.momentum == 0 else B.zeros(B.numel(g), like=B.float32_view(g))
            ref, finite = _reference(B, c, us[name], g, p, world, average, clip_scale,
                                     loss_scale)
            assert kind == "dense" and ctx is None
            assert _bits(out) == _bits(ref), (name, setting)
            st = core.states[name]
            assert (st.u is None) == (us[name] is None)
            if st.u is not None:
                assert _bits(st.u) == _bits(us[name]), (name, setting)
            nonfinite_seen += not finite
            nbytes = 4 * st.numel
            stats.count(st, 0, nbytes, not finite, 0.0, core.density)
            if core.separate_weight_decay:          # after the exchange: the same buffers
                update = B.float32_flat(out)
                core.apply_weight_decay(name, update, p)
    assert nonfinite_seen == 2
    for mine, theirs in ((core.step_stats, stats.step), (core.total_stats, stats.total)):
        assert {f: getattr(mine, f) for f in STAT_FIELDS} == \
            {f: getattr(theirs, f) for f in STAT_FIELDS}


def test_dense_path_in_compress_many_matches_compress():
    """compress_many of a mixed bucket (its dense entries take the dense path inside the
    driver) gives the dense entries the same bits as one compress each."""
    B = TorchBackend()
    c = DGCConfig(environ={}, momentum=0.9, compress_ratio=0.1, warmup_epochs=0)
    many, single = DGCCore(c, B), DGCCore(c, B)
    rng = np.random.default_rng(3)
    for _ in range(4):
        entries = [("w", torch.from_numpy(rng.standard_normal((40, 30)).astype(np.float32)), None),
                   ("b", torch.from_numpy(rng.standard_normal(30).astype(np.float32)), None),
                   ("s", torch.from_numpy(rng.standard_normal(30).astype(np.float32)), None)]
        got = many.compress_many(entries, 2)
        want = [single.compress(n, g, 2, p) for n, g, p in entries]
        for (k1, o1, _), (k2, o2, _) in zip(got, want):
            assert k1 == k2 and _bits(o1) == _bits(o2)
        for name in ("b", "s"):
            assert _bits(many.states[name].u) == _bits(single.states[name].u)
    for f in STAT_FIELDS:
        assert getattr(many.total_stats, f) == getattr(single.total_stats, f)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_all_finite_is_exact(dtype):
    """TorchBackend.all_finite reads the sum's value (math.isfinite) first and looks at the
    elements only when the sum is not finite: the same answer as torch.isfinite on every
    element, an overflowing sum of finite values included (finite)."""
    B = TorchBackend()
    big = torch.finfo(dtype).max
    cases = [torch.zeros(0, dtype=dtype), torch.tensor([-0.0, 1.0], dtype=dtype),
             torch.tensor([big, big], dtype=dtype), torch.tensor([big, -big], dtype=dtype),
             torch.tensor([1.0, float("nan")], dtype=dtype),
             torch.tensor([float("inf"), 1.0], dtype=dtype),
             torch.tensor([float("-inf"), float("inf")], dtype=dtype),
             torch.randn(1000).to(dtype)]
    for x in cases:
        assert B.all_finite(x) is bool(torch.isfinite(x).all())
