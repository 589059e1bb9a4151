"""TensorFlow adapter checks that need no launcher: the same bad input as PyTorch, misuse."""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from dgc_horovod.tensorflow import DGC  # noqa: E402

pytestmark = pytest.mark.adapter


@pytest.mark.parametrize("kwargs, arg", [
    (dict(compress_ratio=0.0), "compress_ratio"), (dict(compress_ratio=1.5), "compress_ratio"),
    (dict(sample_ratio=0.0), "sample_ratio"), (dict(sample_ratio=2.0), "sample_ratio"),
    (dict(momentum=1.0), "momentum")])
def test_bad_arguments_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        DGC(**kwargs)


def test_non_floating_gradient_is_a_type_error():
    with pytest.raises(TypeError, match="floating"):
        DGC().compress(tf.constant([1, 2, 3]))


def test_compress_outside_horovod_reduction_explains_usage():
    with pytest.raises(RuntimeError, match="DistributedGradientTape"):
        DGC().compress(tf.zeros([3]))


def test_keras3_gets_a_warning_with_the_fix():
    """Without TF_USE_LEGACY_KERAS, tf.keras is Keras 3, which horovod.tensorflow cannot drive."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    code = ("import warnings; warnings.simplefilter('always'); "
            "from dgc_horovod.tensorflow import DGC; DGC()")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)
    assert "TF_USE_LEGACY_KERAS=1" in proc.stderr and "Keras 3" in proc.stderr


def test_uncalled_factory_or_class_shows_the_right_line():
    from dgc_horovod.tensorflow import Compression
    with pytest.raises(TypeError, match=r"dgc = Compression\.dgc\("):
        Compression.dgc.compress(tf.zeros([3]))
    with pytest.raises(TypeError, match=r"dgc = DGC\("):
        DGC.compress(tf.zeros([3]))
    assert isinstance(Compression.dgc(compress_ratio=0.01), DGC)


def test_loss_scaler_is_refused_with_the_reason():
    with pytest.raises(TypeError, match=r"loss_scaler= is supported by dgc_horovod.torch.DGC only"):
        DGC(loss_scaler=tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD()))


@pytest.mark.parametrize("exchange", ["regions", "hierarchical"])
def test_pytorch_only_exchanges_are_refused_with_the_reason(exchange):
    with pytest.raises(ValueError, match=rf"exchange='{exchange}' is not available in "
                       r"dgc_horovod.tensorflow; it supports 'allgather'\. It runs in "
                       r"dgc_horovod.torch only: .*graph ops"):
        DGC(exchange=exchange)


@pytest.mark.parametrize("in_graph", [True, False])
def test_sketch_clipping_is_refused_as_pytorch_only(in_graph):
    with pytest.raises(ValueError, match="clip_scope='sketch' is available in PyTorch only"):
        DGC(clip_norm=1.0, clip_scope="sketch", in_graph=in_graph)
    DGC(clip_scope="sketch", in_graph=in_graph)             # no clip_norm: nothing to refuse


def test_backend_follows_the_device():
    """By default DGC's work is traced into the graph (state in tf.Variables). With
    in_graph=False, without a GPU the core runs on NumPy arrays (its engine: the C kernels, as
    PyTorch on a CPU); device="gpu" keeps eager TensorFlow ops; anything else is refused by
    name, and so is a device for the in-graph path (TensorFlow places its ops)."""
    from dgc_horovod.core.backend import NumpyBackend
    from dgc_horovod.backends.tf_backend import TFBackend
    from dgc_horovod.tensorflow.graph import GraphCore, GraphPath
    dgc = DGC()
    assert isinstance(dgc._core, GraphCore) and isinstance(dgc._path, GraphPath)
    assert isinstance(dgc._core.B, TFBackend)
    if not tf.config.list_logical_devices("GPU"):
        assert isinstance(DGC(in_graph=False)._core.B, NumpyBackend)
    assert isinstance(DGC(device="cpu", in_graph=False)._core.B, NumpyBackend)
    assert isinstance(DGC(device="gpu", in_graph=False)._core.B, TFBackend)
    with pytest.raises(ValueError, match="device"):
        DGC(device="tpu", in_graph=False)
    with pytest.raises(ValueError, match="device=.*in_graph=False"):
        DGC(device="cpu")
    with pytest.raises(TypeError, match="in_graph must be True or False"):
        DGC(in_graph="yes")


def test_host_view_is_read_only_and_results_are_copied():
    """The core reads the gradient through a read-only view of TensorFlow's memory (no copy, and
    a write would raise); what it returns is copied into a new tensor, so the velocity state it
    came from can change without changing the tensor TensorFlow holds."""
    import numpy as np
    dgc = DGC(device="cpu", in_graph=False, momentum=0.9, min_sparse_numel=1024)
    g = tf.constant(np.arange(6, dtype=np.float32))
    view = dgc._host(g)
    assert not view.flags.writeable
    kind, out, _ = dgc._core.compress("b", view, 2)
    assert kind == "dense"
    held = tf.py_function(lambda: out, [], tf.float32)
    dgc._core.compress("b", dgc._host(g), 2)            # u <- 0.9 u + g changes the state
    assert np.array_equal(held.numpy(), np.arange(6)) and np.array_equal(g.numpy(), np.arange(6))


def test_jit_compile_is_refused_with_the_fix():
    """XLA cannot compile Horovod's allgather nor the selection's data-dependent shapes (nor,
    with in_graph=False, tf.py_function): DGC says so at trace time, naming jit_compile."""
    dgc = DGC()
    fn = tf.function(lambda: dgc.compress(tf.zeros([3])), jit_compile=True)
    with pytest.raises(RuntimeError, match=r"jit_compile=True.*Drop jit_compile"):
        fn()


@pytest.mark.parametrize("make", ["class", "factory"])
def test_made_inside_a_traced_step_is_refused_with_the_pattern(make):
    """Horovod's GradientTape examples pick their (stateless) compressor inside the step; a DGC
    made there would start from nothing at every trace: refused at once, with the fix."""
    from dgc_horovod.tensorflow import Compression
    new = DGC if make == "class" else Compression.dgc

    @tf.function
    def step():
        new(compress_ratio=0.01)
        return tf.constant(0.0)

    with pytest.raises(RuntimeError, match="inside a tf.function") as err:
        step()
    msg = str(err.value)
    assert "dgc = DGC(compress_ratio=0.004, momentum=0.9)" in msg and "compression=dgc" in msg
    assert "once, outside the step" in msg
    DGC(compress_ratio=0.01)          # eagerly, outside any trace: fine


def test_run_functions_eagerly_is_refused_with_the_way_to_debug():
    """tf.config.run_functions_eagerly(True) runs Horovod's reduction eagerly, where the
    in-graph path cannot place its ops: a RuntimeError naming the switch and in_graph=False,
    instead of TensorFlow's 'Tensor.graph is undefined'."""
    dgc = DGC()
    tf.config.run_functions_eagerly(True)
    try:
        with pytest.raises(RuntimeError, match=r"run_functions_eagerly\(True\).*in_graph=False"):
            dgc.compress(tf.zeros([3]))
    finally:
        tf.config.run_functions_eagerly(False)
