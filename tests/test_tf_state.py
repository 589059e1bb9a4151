"""dgc_horovod.tensorflow.DGC.state_dict() / load_state_dict(): a round trip restores u, v, the
warm-up epoch and step count (which with the seed fix the threshold's samples), so training
continues bit-identically.

hvd.init() runs in a child process (one Horovod process, no launcher), so the pytest process
never initializes Horovod or MPI. The gradients go through the DGC core exactly as the adapter's
compress/decompress would send them (world size 2, this rank's own payload), on both of the
adapter's backends (``device="cpu"``: NumPy + C kernels; ``"gpu"``: eager TensorFlow ops, which
run on this CPU too), and a state saved on one loads on the other.
"""
import os
import pickle
import subprocess
import sys

import pytest

from helpers import to_np

pytestmark = pytest.mark.adapter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dict(compress_ratio=0.05, momentum=0.9, warmup_epochs=4, min_sparse_numel=16, seed=3)
DEVICES = ["cpu", "gpu"]


def _steps(dgc, n, seed):
    import numpy as np
    import tensorflow as tf
    rng, outs = np.random.default_rng(seed), []
    for _ in range(n):
        for name, shape in [("dense_1/kernel:0", (40, 10)), ("dense_1/bias:0", (10,))]:
            g = dgc._host(tf.constant(rng.standard_normal(shape).astype(np.float32)))
            kind, out, ctx = dgc._core.compress(name, g, 2)
            if kind == "sparse":
                out = dgc._core.decompress(out, ctx, 2, ranks=1)
            outs.append(to_np(out))
    return outs


def _snapshot(dgc):
    import numpy as np
    return {n: (None if s.u is None else to_np(s.u), None if s.v is None else to_np(s.v))
            for n, s in dgc.states.items()}


def _same(a, b):
    import numpy as np
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None
                                      and np.array_equal(x.view(np.int32), y.view(np.int32)))
        for n in a for x, y in zip(a[n], b[n]))


def _child(device):
    import warnings

    import numpy as np
    import horovod.tensorflow as hvd
    from dgc_horovod.tensorflow import DGC as _DGC

    def DGC(**kw):
        return _DGC(device=device, in_graph=False, **kw)

    try:
        DGC(**CFG).state_dict()
        raise AssertionError("state_dict before hvd.init() did not raise")
    except RuntimeError as e:
        assert "hvd.init()" in str(e)
    hvd.init()
    a = DGC(**CFG)
    a.set_epoch(1.5)
    _steps(a, 3, seed=0)
    sd = a.state_dict()
    saved = _snapshot(a)
    assert sd["world_size"] == 1 and sd["rank"] == 0 and sd["epoch"] == 1.5
    assert set(sd["tensors"]) == {"dense_1/kernel:0", "dense_1/bias:0"}
    assert sd["tensors"]["dense_1/kernel:0"]["v"] is not None            # sparsified: has v
    ref = _steps(a, 3, seed=1)
    ref_after = _snapshot(a)
    assert not _same(saved, ref_after)                                   # training moved on ...
    assert np.array_equal(to_np(sd["tensors"]["dense_1/kernel:0"]["u"]),
                          saved["dense_1/kernel:0"][0])                  # ... the dict did not

    # through pickle with NumPy arrays, as a checkpoint file would carry it
    assert "generator" not in sd and sd["version"] == 4
    plain = pickle.loads(pickle.dumps({
        **sd,
        "tensors": {n: {k: (to_np(v) if k in ("u", "v") and v is not None else v)
                        for k, v in t.items()} for n, t in sd["tensors"].items()}}))
    # a version-3 dict (with the generator state DGC kept before version 4) loads, its
    # generator ignored
    old = dict(plain, version=3, generator={"bit_generator": "PCG64", "state": {}})
    for loaded_sd in (sd, plain, old):
        b = DGC(**CFG)
        b.load_state_dict(loaded_sd)
        assert _same(_snapshot(b), saved), "u/v not restored"
        assert b._core.epoch == 1.5 and b.density == a.density
        assert b._core.steps == sd["steps"]
        assert b.total_stats.steps == sd["total_stats"]["steps"]
        got = _steps(b, 3, seed=1)
        assert all(np.array_equal(x.view(np.int32), y.view(np.int32)) for x, y in zip(got, ref))
        assert _same(_snapshot(b), ref_after), "did not continue bit-identically"

    c = DGC(**CFG)
    for bad, match in [(dict(sd, rank=1), "rank"), (dict(sd, world_size=2), "ranks"),
                       (dict(sd, config=dict(sd["config"], compress_ratio=0.5)), "compress_ratio")]:
        try:
            c.load_state_dict(bad)
            raise AssertionError(f"load_state_dict accepted {match}")
        except ValueError as e:
            assert match in str(e), str(e)
    assert c.states == {} and c._core.epoch == 0.0                      # nothing changed
    c.load_state_dict(dict(sd, world_size=2), reset_residuals=True)
    assert c.states == {} and c._core.epoch == 1.5

    # saved on the other backend: it loads exactly, without a warning, and continues the same
    other = _DGC(device="gpu" if device == "cpu" else "cpu", in_graph=False, **CFG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(sd)
    assert not caught, [str(w.message) for w in caught]
    assert _same(_snapshot(other), saved) and other._core.epoch == 1.5
    got = _steps(other, 3, seed=1)
    assert all(np.array_equal(x.view(np.int32), y.view(np.int32)) for x, y in zip(got, ref))
    print("TF-STATE-OK")


def _elastic_child(device):
    """dgc_horovod.tensorflow.elastic's three states in one process (the elastic jobs are in
    tests/test_elastic.py): each carries the DGC through commit, restore and reset; a wrong
    assignment is refused; Horovod's own state refuses a DGC at sync, naming these classes."""
    import copy

    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from dgc_horovod.tensorflow import DGC
    from dgc_horovod.tensorflow import elastic as dgc_elastic

    hvd.init()
    model = tf.keras.Sequential([tf.keras.layers.Dense(10, input_shape=(40,))])
    model.build((None, 40))
    opt = tf.keras.optimizers.SGD(0.1)
    opt.build(model.trainable_variables)
    for make in (lambda d: dgc_elastic.TensorFlowKerasState(model, opt, dgc=d, step=0),
                 lambda d: dgc_elastic.TensorFlowState(model.variables, dgc=d, step=0),
                 lambda d: dgc_elastic.KerasState(model, opt, dgc=d, step=0)):
        dgc = DGC(device=device, in_graph=False, **CFG)
        state = make(dgc)
        assert state.dgc is dgc and state.step == 0 and "dgc" not in state._saved_state
        _steps(dgc, 2, seed=0)
        state.commit()
        committed, sd = _snapshot(dgc), dgc.state_dict()
        _steps(dgc, 2, seed=1)
        assert not _same(_snapshot(dgc), committed)
        state.restore()
        assert _same(_snapshot(dgc), committed), f"{type(state).__name__}: u/v not restored"
        now = dgc.state_dict()
        assert now["steps"] == sd["steps"] and now["total_stats"] == sd["total_stats"]
        state.sync()                                     # one rank: its own config, position
        state.on_reset()                                 # what hvd.elastic.run calls at a reset
        assert dgc.resets == 1 and dgc.states == {} and dgc.state_dict()["steps"] == sd["steps"]
        try:
            state.dgc = "not a DGC"
            raise AssertionError("a non-DGC assigned to state.dgc was accepted")
        except TypeError as e:
            assert "state.dgc" in str(e), str(e)
        assert state.dgc is dgc
        other = DGC(device=device, in_graph=False, **CFG)
        state.dgc = other                                # another DGC: carried from now on
        _steps(other, 1, seed=2)
        state.commit()
        committed = _snapshot(other)
        _steps(other, 1, seed=3)
        state.restore()
        assert _same(_snapshot(other), committed) and len(committed) == 2

    dgc = DGC(device=device, in_graph=False, **CFG)
    for attempt in (lambda: pickle.dumps(dgc), lambda: copy.deepcopy(dgc),
                    lambda: hvd.elastic.TensorFlowKerasState(model, opt, dgc=dgc).sync()):
        try:
            attempt()
            raise AssertionError("a DGC was pickled")
        except TypeError as e:
            assert "dgc_horovod.tensorflow.elastic" in str(e) and "TensorFlowKerasState" in str(e)
    print("TF-ELASTIC-STATES-OK")


def _run_child(which, marker, device):
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", TF_USE_LEGACY_KERAS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), which, device], cwd=ROOT,
                          env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and marker in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("device", DEVICES)
def test_tf_state_dict_round_trip_resumes_bit_identically(device):
    _run_child("state_dict", "TF-STATE-OK", device)


@pytest.mark.parametrize("device", DEVICES)
def test_tf_elastic_states_carry_dgc(device):
    _run_child("elastic", "TF-ELASTIC-STATES-OK", device)


if __name__ == "__main__":
    {"state_dict": _child, "elastic": _elastic_child}[sys.argv[1]](sys.argv[2])
