"""Review of `DGCCore.compress_many`'s contract (adversarial cases).

Contract: ``core.compress_many(entries, N)`` gives the same results (payloads and the sparse
contexts' indices / values / u_sent), the same state (every tensor's u and v), the same random
generator state and the same statistics (every CompressionStats field but compress_seconds) as
``[core.compress(name, grad, N, param=param) for name, grad, param in entries]`` on an identical
core. Every test below runs a "batch" core (compress_many, possibly several calls per step) and
a "single" core (one compress() per entry, in order) side by side and compares all of that after
every call.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from dgc_horovod.core import DGCConfig, DGCCore, NumpyBackend, kernels
from dgc_horovod.backends.torch_backend import TorchBackend
from batch_helpers import raw, restore_torch_threads, to_np  # noqa: F401 (the fixture applies)
from batch_helpers import convert as tensor
from batch_helpers import same_gen as gen_equal

# these tests are of the sparse path's mechanics on flat gradients (see conftest)
pytestmark = pytest.mark.usefixtures("sparse_mechanics")

F32 = np.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = {"numpy": NumpyBackend, "torch": TorchBackend}
SMALL = kernels.SMALL_NUMEL
STATS = ("steps", "tensors", "sparse_tensors", "elements", "selected", "wire_bytes",
         "dense_bytes", "nonfinite_tensors", "density")
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels not built/disabled")



# ----------------------------------------------------------------- helpers
def check(batch_core, single_core, got, want, names, what):
    """Results of one call (or one step) and the complete state of both cores."""
    assert len(got) == len(want), what
    for name, a, b in zip(names, got, want):
        w = f"{what}: tensor {name!r}"
        assert a[0] == b[0], w + " kind"
        assert raw(a[1]) == raw(b[1]), w + " payload"
        assert (a[2] is None) == (b[2] is None), w + " context"
        if a[2] is not None:
            assert (a[2].name, a[2].numel) == (b[2].name, b[2].numel), w
            for attr in ("indices", "values", "u_sent"):
                assert raw(getattr(a[2], attr)) == raw(getattr(b[2], attr)), f"{w} ctx.{attr}"
    assert set(batch_core.states) == set(single_core.states), what + ": state names"
    for name, sa in batch_core.states.items():
        sb = single_core.states[name]
        assert (sa.numel, sa.sparse) == (sb.numel, sb.sparse), f"{what}: {name!r} numel/sparse"
        for attr in ("u", "v"):
            assert raw(getattr(sa, attr)) == raw(getattr(sb, attr)), \
                f"{what}: state {name!r}.{attr}"
    assert gen_equal(batch_core, single_core), what + ": generator state"
    check_stats(batch_core, single_core, what)


def check_stats(a, b, what, labels=("batch", "single")):
    for which in ("step_stats", "total_stats"):
        for attr in STATS:
            x, y = getattr(getattr(a, which), attr), getattr(getattr(b, which), attr)
            assert x == y, f"{what}: {which}.{attr} {labels[0]} {x!r} != {labels[1]} {y!r}"


def spy_paths(monkeypatch):
    """Counts of the calls of compress_many's paths: _count_batch (every row finished by the
    kernel), _batch_results (some rows finished here), _compress_mixed (entries outside the
    batch)."""
    used = {"_count_batch": 0, "_batch_results": 0, "_compress_mixed": 0}
    for meth in used:
        orig = getattr(DGCCore, meth)

        def spy(self, *a, _orig=orig, _m=meth, **k):
            used[_m] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(DGCCore, meth, spy)
    return used


def pair(backend, **cfg):
    conf = DGCConfig(**cfg)
    cores = [DGCCore(conf, BACKENDS[backend]()) for _ in range(2)]
    assert all(c.use_kernels for c in cores)
    return cores


def run_step(cores, make_entries, world=4, splits=(), each_call=None):
    """Core 0: compress_many over the bucket cut at `splits` (several calls); core 1: compress()
    per entry. make_entries() builds fresh tensors (same values) for each core. If each_call is
    given, it is called after each batch call with the entries done so far (to compare
    statistics at call boundaries)."""
    ea, eb = make_entries(), make_entries()
    cuts = [0] + list(splits) + [len(ea)]
    got, want = [], []
    for lo, hi in zip(cuts, cuts[1:]):
        got += cores[0].compress_many(ea[lo:hi], world)
        want += [cores[1].compress(n, g, world, param=p) for n, g, p in eb[lo:hi]]
        if each_call is not None:
            each_call(lo, hi)
    return got, want, [e[0] for e in ea]


# ----------------------------------------------------------------- sizes at the kernel's limits
CONFIGS = [
    dict(),
    dict(warmup_epochs=0, momentum=0.0, momentum_masking=False),
    dict(warmup_epochs=0, nesterov=True, clip_norm=0.5),
    dict(warmup_epochs=0, weight_decay=1e-2, clip_norm=5.0, momentum_masking=False),
    dict(warmup_epochs=0, wire_index="int32"),
    dict(warmup_epochs=0, wire_values="float16"),
    dict(warmup_epochs=0, exact_topk=True),
    dict(warmup_epochs=0, compress_ratio=0.3),
    dict(warmup_epochs=0, compress_ratio=0.45, sample_ratio=1.0),
    dict(warmup_epochs=0, momentum=0.0),
    dict(warmup_epochs=0, compress_ratio=1.0),
]
CFG_IDS = ["warmup", "m0", "nesterov-clip", "wd-clip-nomask", "int32", "fp16", "exact",
           "ratio0.3", "ratio0.45-s1", "m0-masking", "ratio1"]


def _boundary_grads(rng, sizes, step):
    grads = [rng.standard_normal(n).astype(F32) for n in sizes]
    if step % 3 == 2:
        grads = [np.round(g * 2).astype(F32) for g in grads]              # many ties
    # non-finite values: none / first entry / middle / last / all, then finite again
    bad = {1: [0], 2: [len(sizes) // 2], 3: [len(sizes) - 1], 4: list(range(len(sizes))),
           6: [1, len(sizes) - 2]}.get(step, [])
    for j, i in enumerate(bad):
        g = grads[i]
        g[(7 * j + step) % g.size] = (np.nan, np.inf, -np.inf)[(i + step) % 3]
    return grads


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", CONFIGS, ids=CFG_IDS)
def test_sizes_at_small_numel_boundary_and_tiny_with_nonfinite_positions(backend, cfg,
                                                                         monkeypatch):
    """Tensors of 1, 2, 3, 63, 64, 65 elements and of SMALL_NUMEL - 1, SMALL_NUMEL and
    SMALL_NUMEL + 1 elements (checked in the updating task vs in the kernel's first phase) in one bucket, in an
    order rotated every step (so each lands first, in the middle and last), with NaN/Inf in the
    first / middle / last / every / two entries on some steps and finite ones in between."""
    cores = pair(backend, **dict(dict(min_sparse_numel=1), **cfg))
    used = spy_paths(monkeypatch)
    rng = np.random.default_rng(11)
    sizes = [1, 2, 3, 63, 64, 65, SMALL - 1, SMALL, SMALL + 1, 1000]
    names = [f"b{n}" for n in sizes]
    params = {n: rng.standard_normal(s).astype(F32) for n, s in zip(names, sizes)}
    for step in range(8):
        if backend == "torch":
            torch.set_num_threads((1, 2, 3)[step % 3])
        for c in cores:
            c.set_epoch(step * 0.6)
        rot = (3 * step) % len(sizes)
        order = list(range(len(sizes)))[rot:] + list(range(len(sizes)))[:rot]
        grads = _boundary_grads(rng, [sizes[i] for i in order], step)

        def entries():
            return [(names[i], tensor(backend, g), tensor(backend, params[names[i]]))
                    for i, g in zip(order, grads)]
        got, want, nm = run_step(cores, entries, splits=(4,) if step % 4 == 3 else ())
        check(cores[0], cores[1], got, want, nm, f"{cfg} step {step}")
    # the non-finite rows (small and large) are settled inside the batch: not all finished
    assert used["_batch_results"] > 0


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_nonfinite_small_and_large_for_several_steps_then_finite(backend):
    """The same tensors non-finite for three steps in a row (small: NaN, large: Inf), then
    finite: their draws are consumed every step, their state never changes meanwhile."""
    cores = pair(backend, warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.01)
    rng = np.random.default_rng(5)
    sizes = [SMALL, 5000, SMALL + 1, 70_000, 64]
    names = [f"n{i}" for i in range(len(sizes))]
    for step in range(7):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        if 1 <= step <= 3:
            grads[0][-1] = np.nan
            grads[2][0] = np.inf
            grads[4][step] = -np.inf
        before = {n: raw(cores[0].states[n].v) for n in names} if step else None

        def entries():
            return [(n, tensor(backend, g), None) for n, g in zip(names, grads)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"step {step}")
        if 1 <= step <= 3:
            for i in (0, 2, 4):
                assert raw(cores[0].states[names[i]].v) == before[names[i]]
    assert cores[0].total_stats.nonfinite_tensors == 9


# ----------------------------------------------------------------- odd buckets, fuzzed
FUZZ_CONFIGS = [
    dict(warmup_epochs=2, warmup_per_step=True, min_sparse_numel=50),
    dict(warmup_epochs=0, min_sparse_numel=50, weight_decay=5e-3, clip_norm=2.0, nesterov=True),
    dict(warmup_epochs=0, min_sparse_numel=50, momentum=0.0, wire_index="int32"),
    dict(warmup_epochs=1, min_sparse_numel=50, wire_values="float16", momentum_masking=False),
    dict(warmup_epochs=0, min_sparse_numel=50, compress_ratio=0.3, sample_ratio=0.2),
]


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cfg", FUZZ_CONFIGS, ids=["warmup-per-step", "wd-clip-nesterov",
                                                   "m0-int32", "fp16-nomask", "ratio0.3"])
def test_fuzzed_buckets_mixed_kinds_new_tensors_and_split_calls(backend, cfg):
    """Random buckets: dense tensors (below min_sparse_numel), float16 / bfloat16 / float64 /
    transposed / strided gradients, tensors appearing for the first time mid-training, random
    order, NaN/Inf in random tensors, buckets cut into up to three compress_many calls, names
    coming back within a step (a new statistics step), the warm-up position moving by steps and
    the thread count changing. Statistics are compared after every call."""
    rng = np.random.default_rng(3 + FUZZ_CONFIGS.index(cfg))
    cores = pair(backend, **cfg)
    shapes = {"d1": (7,), "d2": (3, 4), "s1": (1, 60), "s2": (65,), "m1": (40, 50),
              "m2": (3001,), "m3": (257, 33), "L1": (SMALL + 1,), "L2": (SMALL,),
              "m4": (9000,), "t1": (64,), "z0": (0,), "z1": (2, 0), "sc": (), "m5": (20_000,)}
    kinds = ["", "", "", "f16", "f64", "T", "strided"] + (["bf16"] if backend == "torch"
                                                          else ["be"])
    pool = list(shapes)
    for step in range(8):
        if backend == "torch":
            torch.set_num_threads(int(rng.integers(1, 4)))
        for c in cores:
            c.set_step(step, 3)
        live = pool[:4 + 2 * step]                   # more tensors appear as training goes
        names = [str(x) for x in rng.permutation(live)]
        if step % 3 == 2:                            # a name seen again within the step
            names.append(names[0])
        grads, kind_of = {}, {}
        for j, n in enumerate(names):
            g = rng.standard_normal(shapes[n]).astype(F32)
            if rng.random() < 0.15 and g.size:
                g.flat[int(rng.integers(g.size))] = (np.nan, np.inf, -np.inf)[int(rng.integers(3))]
            grads[j] = g
            kind_of[j] = kinds[int(rng.integers(len(kinds)))]
        params = {n: rng.standard_normal(shapes[n]).astype(F32) for n in set(names)}

        def entries():
            return [(n, tensor(backend, grads[j], kind_of[j]), tensor(backend, params[n]))
                    for j, n in enumerate(names)]
        # calls: names must be distinct within a call; the repeated one goes to the last call
        n_calls = int(rng.integers(1, 4))
        cuts = sorted(set(int(x) for x in rng.integers(1, len(names) - 1, n_calls - 1)))
        if step % 3 == 2:
            cuts = sorted(set(cuts + [len(names) - 1]))

        def each_call(lo, hi):
            check_stats(cores[0], cores[1], f"step {step} after call [{lo}:{hi}]")
        got, want, nm = run_step(cores, entries, splits=cuts, each_call=each_call)
        # repeated names: compare per-entry results; the final state is compared once
        check(cores[0], cores[1], got, want, nm, f"{cfg} step {step}")


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_one_call_vs_several_calls_per_step_statistics(backend):
    """Statistics with buckets cut at every possible point, and calls that start a new step in
    their middle (a name already seen), all entries fused or some dense / non-finite."""
    cores = pair(backend, warmup_epochs=0, min_sparse_numel=100)
    rng = np.random.default_rng(17)
    sizes = {"A": 5000, "B": 30, "C": 4000, "D": SMALL + 1, "E": 700, "F": 3000}
    calls = [["A", "C"], ["E", "F", "A"], ["C", "D"], ["B", "A", "E"], ["F"], ["D", "C", "B", "A"],
             ["E", "F", "D"], ["A", "B", "C", "D", "E", "F"], ["A", "B"]]
    for i, call in enumerate(calls):
        grads = [rng.standard_normal(sizes[n]).astype(F32) for n in call]
        if i % 3 == 1:
            grads[-1][0] = np.nan

        def entries():
            return [(n, tensor(backend, g), None) for n, g in zip(call, grads)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"call {i} {call}")


# ----------------------------------------------------------------- warm-up and density changes
@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_density_crossing_the_sampling_limit_between_calls(backend):
    """A warm-up from density 0.6 (k >= n/2: exact top-k, no draws) down to 0.002 (sampled), the
    position set by set_step and set_epoch between calls and even between the two calls of one
    step; small tensors cross the sampled / not-sampled limit at different points."""
    cores = pair(backend, warmup_epochs=3, warmup_initial_density=0.6, compress_ratio=0.002,
                 warmup_per_step=True, min_sparse_numel=1)
    rng = np.random.default_rng(23)
    sizes = [3, 4, 5, 9, 17, 64, 100, 1000, 20_000, SMALL + 1]
    names = [f"w{n}" for n in sizes]
    for step in range(10):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        half = len(sizes) // 2

        def entries():
            return [(n, tensor(backend, g), None) for n, g in zip(names, grads)]
        ea, eb = entries(), entries()
        for c in cores:
            c.set_step(step, 3)
        got = cores[0].compress_many(ea[:half], 2)
        want = [cores[1].compress(n, g, 2) for n, g, _ in eb[:half]]
        for c in cores:
            c.set_epoch(step / 3 + 0.17)         # the density moves within the step
        got += cores[0].compress_many(ea[half:], 2)
        want += [cores[1].compress(n, g, 2) for n, g, _ in eb[half:]]
        check(cores[0], cores[1], got, want, names, f"step {step}")


# ----------------------------------------------------------------- checkpoints between calls
@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_state_dict_into_fresh_cores_between_calls(backend):
    """Mid-run checkpoints: (step 1) both cores are replaced by brand-new cores loaded from their
    state_dicts, and the per-tensor core's candidate buffers are then grown (as a higher warm-up
    density would have left them) so that the two cores' plans differ; (step 3) the cores swap
    checkpoints, each resuming the other's; (step 5) both reload their own checkpoint between
    the two calls of a step."""
    cfg = dict(warmup_epochs=2, min_sparse_numel=10, weight_decay=1e-3)
    cores = pair(backend, **cfg)
    rng = np.random.default_rng(31)
    sizes = [5, 3000, SMALL, SMALL + 1, 64]
    names = [f"c{i}" for i in range(len(sizes))]
    params = [rng.standard_normal(n).astype(F32) for n in sizes]

    def fresh(state):
        c = DGCCore(DGCConfig(**cfg), BACKENDS[backend]())
        c.load_state_dict(state, world_size=4, rank=0)
        return c
    for step in range(7):
        for c in cores:
            c.set_epoch(step * 0.5)
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        if step == 4:
            grads[2][5] = np.nan

        def entries():
            return [(n, tensor(backend, g), tensor(backend, p))
                    for n, g, p in zip(names, grads, params)]

        def reload_mid_step(lo, hi):
            if step == 5 and lo == 0:
                for c in cores:
                    c.load_state_dict(c.state_dict(world_size=4, rank=0), world_size=4, rank=0)
                check_stats(cores[0], cores[1], "after the mid-step reload")
        got, want, nm = run_step(cores, entries, splits=(2,) if step % 2 else (),
                                 each_call=reload_mid_step)
        check(cores[0], cores[1], got, want, nm, f"step {step}")
        if step == 1:
            cores = [fresh(c.state_dict(world_size=4, rank=0)) for c in cores]
        elif step == 2:                  # grow the per-tensor core's candidate buffers only
            c = cores[1]
            for st in c.states.values():
                if st.plan:
                    st.plan.set_density(c.B, st.numel, c.config, 0.45)
                    st.plan.set_density(c.B, st.numel, c.config, c.density)
            assert any(st.plan and st.plan.cap > cores[0].states[n].plan.cap
                       for n, st in c.states.items())
        elif step == 3:
            sd = [c.state_dict(world_size=4, rank=0) for c in cores]
            cores = [fresh(sd[1]), fresh(sd[0])]


@pytest.mark.parametrize("many", [False, True], ids=["compress", "compress_many"])
def test_step_statistics_of_the_first_step_after_a_resume(many):
    """(Not specific to compress_many.) A checkpoint taken between steps and loaded into a new
    core: the first step after the resume must have the step statistics of that step alone, as in
    the uninterrupted run. load_state_dict empties the set of names seen in the step but keeps
    the saved step_stats, so the resumed core adds the new step onto the saved one."""
    conf = DGCConfig(warmup_epochs=0)
    g = np.ones(5000, F32)
    a, b = DGCCore(conf, NumpyBackend()), DGCCore(conf, NumpyBackend())

    def step(c):
        if many:
            c.compress_many([("A", g.copy(), None), ("B", g.copy(), None)], 1)
        else:
            c.compress("A", g.copy(), 1)
            c.compress("B", g.copy(), 1)
    for c in (a, b):
        step(c)
    resumed = DGCCore(conf, NumpyBackend())
    resumed.load_state_dict(b.state_dict())
    for c in (a, resumed):
        step(c)
    assert a.step_stats.tensors == 2
    check_stats(resumed, a, "first step after the resume", ("resumed", "uninterrupted"))


@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_use_kernels_switched_between_calls(backend):
    """use_kernels turned off and on again between steps, on the batch core only (its plans
    go stale: densities move on meanwhile) or on both."""
    cores = pair(backend, warmup_epochs=2, warmup_per_step=True, min_sparse_numel=1)
    rng = np.random.default_rng(61)
    sizes = [3000, SMALL + 1, 17, 70_000]
    names = [f"k{i}" for i in range(len(sizes))]
    for step in range(8):
        cores[0].use_kernels = step % 3 != 1
        cores[1].use_kernels = step not in (4, 5)
        for c in cores:
            c.set_step(step, 3)
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]

        def entries():
            return [(n, tensor(backend, g), None) for n, g in zip(names, grads)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"step {step}")


# ----------------------------------------------------------------- threads
@needs_kernels
def test_batch_with_many_threads_matches_single_with_one_thread():
    """The kernels' results must not depend on the thread count: compress_many with 4 threads
    against compress() per tensor with 1 thread (no clipping: torch's norm may round
    differently with other thread counts)."""
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.01)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    rng = np.random.default_rng(41)
    sizes = [SMALL + 1, 2 ** 20 + 3, 5000, 64, SMALL, 131_073, 7]
    names = [f"p{i}" for i in range(len(sizes))]
    for step in range(4):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        if step == 2:
            grads[1][-1] = np.nan
            grads[3][0] = np.inf
        torch.set_num_threads(70 if step == 3 else 4)      # 70: above the pool's 64
        got = cores[0].compress_many([(n, torch.from_numpy(g.copy()), None)
                                      for n, g in zip(names, grads)], 2)
        torch.set_num_threads(1)
        want = [cores[1].compress(n, torch.from_numpy(g.copy()), 2) for n, g in zip(names, grads)]
        check(cores[0], cores[1], got, want, names, f"step {step}")


# ----------------------------------------------------------------- the threshold fallbacks
@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("kind", ["cauchy", "spiky", "ties", "sparse"])
def test_threshold_fallbacks_too_few_and_too_many_candidates(backend, kind, monkeypatch):
    """Heavy tails and spikes make the sampled threshold overshoot (fewer than k/2 candidates:
    the batch kernel lowers the threshold or takes the exact top-k itself, compress() leaves it
    to the backend) or undershoot (more candidates than the plan's buffers); ties and mostly-zero
    gradients make the kernel give up. Many steps, small and large tensors."""
    cores = pair(backend, warmup_epochs=0, min_sparse_numel=1, compress_ratio=0.005,
                 sample_ratio=0.002)
    used = spy_paths(monkeypatch)
    rng = np.random.default_rng(53)
    sizes = [40_000, 100_000, SMALL + 1, 3000]
    names = [f"f{i}" for i in range(len(sizes))]
    for step in range(12):
        grads = []
        for n in sizes:
            if kind == "cauchy":
                g = rng.standard_cauchy(n)
            elif kind == "spiky":
                g = rng.standard_normal(n) * 1e-3
                g[rng.integers(0, n, 8)] = rng.standard_normal(8) * 1e3
                if step % 2:
                    g[: n // 3] = rng.standard_normal(n // 3) * 10    # undershoot
            elif kind == "ties":
                g = rng.integers(-2, 3, n).astype(float)
            else:
                g = rng.standard_normal(n) * (rng.random(n) < 0.003)
            grads.append(g.astype(F32))

        def entries():
            return [(n, tensor(backend, g), None) for n, g in zip(names, grads)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"{kind} step {step}")
    # cauchy / spiky: the kernel settles every row itself (all-finished path); ties / sparse:
    # some rows are left to the backend
    assert used["_count_batch" if kind in ("cauchy", "spiky") else "_batch_results"] > 0


# ----------------------------------------------------------------- findings of this review
@needs_kernels
@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("bad", ["nan-param", "overflow"])
def test_weight_decay_nonfinite_only_after_adding_decay_small_tensor(backend, bad):
    """A finite gradient whose weight-decayed gradient g + wd·param is not finite (a NaN in the
    parameter, or a sum overflowing float32). compress() checks the gradient itself (finite) and
    accumulates; compress_many must do the same for a small tensor (<= SMALL_NUMEL), whose
    check the batch kernel makes."""
    cores = pair(backend, warmup_epochs=0, weight_decay=0.5)
    rng = np.random.default_rng(2)
    sizes = [5000, SMALL + 1]
    names = ["small", "large"]
    for step in range(2):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]
        params = [rng.standard_normal(n).astype(F32) for n in sizes]
        if step == 1:
            for g, p in zip(grads, params):
                if bad == "nan-param":
                    p[7] = np.nan
                else:
                    g[7], p[7] = 3.0e38, 3.0e38          # 3e38 + 0.5 * 3e38 = inf
            assert all(np.isfinite(g).all() for g in grads)

        def entries():
            return [(n, tensor(backend, g), tensor(backend, p))
                    for n, g, p in zip(names, grads, params)]
        got, want, nm = run_step(cores, entries)
        check(cores[0], cores[1], got, want, nm, f"{bad} step {step}")


@needs_kernels
def test_nan_in_the_residual_threshold_overshoot_torch():
    """A NaN in a large tensor's residual v (here: a NaN parameter with weight decay, which both
    paths accumulate for a tensor > SMALL_NUMEL). When the sampled threshold overshoots
    (candidates < k/2), compress() takes torch.topk over |v| (NaN counts as largest) and drops
    the NaN: k - 1 entries; the batch kernel lowers the threshold / takes its own top-k
    (comparisons with NaN are false): k entries."""
    conf = DGCConfig(warmup_epochs=0, weight_decay=1e-2)
    cores = [DGCCore(conf, TorchBackend()) for _ in range(2)]
    rng = np.random.default_rng(0)
    sizes = [300_000, 100_000]
    names = ["t0", "t1"]
    params = [rng.standard_normal(n).astype(F32) for n in sizes]
    params[0][7] = np.nan
    for step in range(8):
        grads = [rng.standard_normal(n).astype(F32) for n in sizes]

        def entries():
            return [(n, torch.from_numpy(g.copy()), torch.from_numpy(p.copy()))
                    for n, g, p in zip(names, grads, params)]
        got, want, nm = run_step(cores, entries, world=2)
        check(cores[0], cores[1], got, want, nm, f"step {step}")


_DENORMAL = textwrap.dedent("""
    import numpy as np, torch
    from dgc_horovod.core import DGCConfig, DGCCore
    from dgc_horovod.backends.torch_backend import TorchBackend
    torch.set_num_threads(2)
    # the kernels' thread pool starts here, with the default floating-point mode
    DGCCore(DGCConfig(warmup_epochs=0), TorchBackend()).compress_many(
        [(f"w{i}", torch.randn(300_000), None) for i in range(4)], 2)
    torch.set_flush_denormal(True)          # denormals are zero, on this thread
    rng = np.random.default_rng(0)
    grads = [rng.integers(1, 2 ** 23, 200_000).astype(np.int32).view(np.float32)
             for _ in range(30)]                                    # denormal gradients
    conf = DGCConfig(warmup_epochs=0, min_sparse_numel=1)
    a, b = DGCCore(conf, TorchBackend()), DGCCore(conf, TorchBackend())
    ra = a.compress_many([(f"t{i}", torch.from_numpy(g), None) for i, g in enumerate(grads)], 2)
    rb = [b.compress(f"t{i}", torch.from_numpy(g), 2) for i, g in enumerate(grads)]
    same_v = [torch.equal(a.states[f"t{i}"].v.view(torch.int32),
                          b.states[f"t{i}"].v.view(torch.int32)) for i in range(30)]
    same_p = [torch.equal(x[1], y[1]) for x, y in zip(ra, rb)]
    print(sum(same_v), sum(same_p))
""")


@needs_kernels
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_flush_denormal_set_after_the_kernel_pool_started():
    """torch.set_flush_denormal(True) after the kernels' pool threads were started: the calling
    thread flushes denormals, the pool workers do not, so the result depends on which thread ran
    a row (compress_many and compress() spread work differently)."""
    proc = subprocess.run([sys.executable, "-c", _DENORMAL], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["30", "30"], \
        f"tensors with equal v / equal payload out of 30: {proc.stdout.strip()}"
