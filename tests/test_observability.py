"""TensorBoard logging: the framework-free event writer, the user helpers (torch log_stats, the
Keras DGCTensorBoardCallback), the Compression entry points, and the examples' --tensorboard-dir
in real `horovodrun -np 2` jobs, whose output must be plain lines (no progress-bar fragments).
Event files are read back with TensorFlow's own reader."""
import glob
import os
import re

import pytest

from conftest import horovodrun

from dgc_horovod.core import CompressionStats, DGCConfig
from dgc_horovod.summary import STATS_SCALARS, EventWriter, write_stats

DGC_TAGS = ["dgc/" + name for name in STATS_SCALARS]


def read_scalars(log_dir):
    """{tag: [(step, value), ...]} of every event file in ``log_dir`` (TensorFlow's reader)."""
    import tensorflow as tf
    files = sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*")))
    assert files, f"no event file in {log_dir}"
    out = {}
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                v = value.simple_value if value.HasField("simple_value") else float(
                    tf.make_ndarray(value.tensor))
                out.setdefault(value.tag, []).append((event.step, v))
    return out


def fake_stats(selected=100, elements=100_000, steps=3):
    s = CompressionStats()
    s.steps, s.tensors, s.sparse_tensors, s.elements = steps, 2, 1, elements
    s.selected, s.dense_bytes, s.wire_bytes = selected, 4 * elements, 8 * selected + 4
    s.compress_seconds, s.density = 0.25, selected / elements
    return s


@pytest.mark.unit
def test_event_writer_round_trip(tmp_path):
    with EventWriter(str(tmp_path)) as w:
        w.add_scalar("a/x", 1.5, 0)
        w.add_scalar("a/x", -2.0, 7)
        values = write_stats(w, fake_stats(), 3)
    got = read_scalars(str(tmp_path))
    assert got["a/x"] == [(0, 1.5), (7, -2.0)]
    assert set(DGC_TAGS) <= set(got)
    assert got["dgc/selected"] == [(3, 100.0)]
    assert got["dgc/ratio"][0][1] == pytest.approx(values["ratio"], rel=1e-6) and values["ratio"] > 1


class _FakeDGC:
    def __init__(self):
        self.total_stats = CompressionStats()
        self.stats = CompressionStats()

    def step(self, s):
        t = self.total_stats
        for k in CompressionStats.__slots__:
            if k != "density":
                setattr(t, k, getattr(t, k) + getattr(s, k))
        t.density = s.density
        self.stats = s


@pytest.mark.adapter
def test_torch_log_stats(tmp_path):
    torch_adapter = pytest.importorskip("dgc_horovod.torch")
    dgc = _FakeDGC()
    start = dgc.total_stats.copy()
    dgc.step(fake_stats(selected=10))
    dgc.step(fake_stats(selected=30))
    with EventWriter(str(tmp_path)) as w:
        last = torch_adapter.log_stats(w, dgc, 5)                   # the last step
        epoch = torch_adapter.log_stats(w, dgc, 6, since=start)     # since the snapshot
    assert last["selected"] == 30 and epoch["selected"] == 40
    got = read_scalars(str(tmp_path))
    assert got["dgc/selected"] == [(5, 30.0), (6, 40.0)]


@pytest.mark.adapter
def test_keras_tensorboard_callback(tmp_path):
    tf_adapter = pytest.importorskip("dgc_horovod.tensorflow")
    import tensorflow as tf
    with pytest.raises(ValueError):
        tf_adapter.DGCTensorBoardCallback(_FakeDGC())
    for kind in ("log_dir", "tf.summary"):
        d = str(tmp_path / kind)
        dgc = _FakeDGC()
        cb = (tf_adapter.DGCTensorBoardCallback(dgc, log_dir=d) if kind == "log_dir" else
              tf_adapter.DGCTensorBoardCallback(dgc, writer=tf.summary.create_file_writer(d)))
        for epoch, selected in enumerate((50, 20)):
            cb.on_epoch_begin(epoch)
            dgc.step(fake_stats(selected=selected))
            cb.on_epoch_end(epoch, {})
        cb.on_train_end()
        got = read_scalars(d)
        assert set(DGC_TAGS) <= set(got), kind
        assert got["dgc/selected"] == [(0, 50.0), (1, 20.0)], kind
        assert all(v > 1 for _, v in got["dgc/ratio"]), kind


@pytest.mark.adapter
def test_compression_entry_points():
    import horovod.torch as hvd_torch
    torch_adapter = pytest.importorskip("dgc_horovod.torch")
    dgc = torch_adapter.Compression.dgc(compress_ratio=0.01, momentum=0.5)
    assert isinstance(dgc, torch_adapter.DGC)
    assert dgc.config.compress_ratio == 0.01 and dgc.config.momentum == 0.5
    assert torch_adapter.Compression.dgc() is not torch_adapter.Compression.dgc()   # stateful
    assert torch_adapter.Compression.fp16 is hvd_torch.Compression.fp16
    assert torch_adapter.Compression.none is hvd_torch.Compression.none

    import horovod.tensorflow as hvd_tf
    tf_adapter = pytest.importorskip("dgc_horovod.tensorflow")
    dgc = tf_adapter.Compression.dgc(compress_ratio=0.002, warmup_epochs=0)
    assert isinstance(dgc, tf_adapter.DGC)
    assert dgc.config.compress_ratio == 0.002 and dgc.config.warmup_epochs == 0
    assert tf_adapter.Compression.fp16 is hvd_tf.Compression.fp16


def _check_example_scalars(log_dir, epochs):
    got = read_scalars(log_dir)
    for tag in ["train/loss", "test/accuracy"] + DGC_TAGS:
        assert tag in got, f"{tag} missing; have {sorted(got)}"
        assert [s for s, _ in got[tag]] == list(range(1, epochs + 1)), tag   # one per epoch
    assert all(0 < v < 10 for _, v in got["train/loss"])
    assert all(0 <= v <= 100 for _, v in got["test/accuracy"])
    assert all(v > 1 for _, v in got["dgc/ratio"])
    assert all(v > 0 for _, v in got["dgc/selected"] + got["dgc/wire_bytes"]
               + got["dgc/received_bytes"])
    # 2 ranks: rank 0 receives rank 1's payloads, about what it sends itself
    for (_, sent), (_, received) in zip(got["dgc/ratio"], got["dgc/received_ratio"]):
        assert received == pytest.approx(sent, rel=0.2)
    assert all(v == 0 for _, v in got["dgc/overflowed_entries"] + got["dgc/flushed_entries"])
    assert all(v >= 0 for _, v in got["dgc/compress_seconds"])
    density = [v for _, v in got["dgc/density"]]
    # the default density (the examples do not set it), reached after the 1-epoch warm-up
    assert density[-1] == pytest.approx(DGCConfig(environ={}).compress_ratio, rel=1e-3)
    # only rank 0 writes
    assert len(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))) == 1


PREFIX = re.compile(r"\[(\d+)\]<(stdout|stderr)>:")
RANK0_LINE = re.compile(   # what an example prints on rank 0, one whole line each
    r"Horovod: 2 ranks; .*"
    r"|epoch \d+/\d+  step \d+/\d+  loss \d+\.\d+"                      # at most every 10 s
    r"|epoch +(?P<epoch>\d+)  train loss \d+\.\d+  test accuracy .*"       # one per epoch
    r"|final test accuracy: .*|wire compression after warm-up: .*|wall time: .*")


def _check_plain_output(stdout, epochs):
    """Under horovodrun stdout is a pipe: whole lines, no progress-bar fragments, and on rank 0
    the header, one line per epoch, plain progress lines and the summary, nothing else. (The
    output is read as text, so a bar's carriage returns arrive as line ends: its fragments are
    lines that match none of these.)"""
    epoch_lines = []
    for line in stdout.splitlines():
        assert len(PREFIX.findall(line)) <= 1, f"fragments of two writes in one line: {line!r}"
        m = PREFIX.match(line)
        if not m or m.group(1) != "0" or m.group(2) != "stdout":
            continue
        text = line[m.end():]
        shown = RANK0_LINE.fullmatch(text)
        assert shown, f"unexpected rank-0 line: {text!r}"
        if shown.group("epoch"):
            epoch_lines.append(int(shown.group("epoch")))
    assert epoch_lines == list(range(1, epochs + 1)), stdout[-3000:]


@pytest.mark.horovodrun
@pytest.mark.parametrize("example", ["pytorch_mnist.py", "tensorflow2_mnist.py",
                                     "tensorflow2_keras_mnist.py"])
def test_example_tensorboard_dir_and_plain_output(tmp_path, example):
    log_dir = str(tmp_path / "tb")
    proc = horovodrun([os.path.join("examples", example), "--epochs", "2",
                       "--batch-size", "64", "--tensorboard-dir", log_dir],
                      env={"TF_USE_LEGACY_KERAS": "1"}, timeout=300)
    _check_example_scalars(log_dir, 2)
    _check_plain_output(proc.stdout, 2)
    # the printed lines give the compression of the traffic both ways
    epochs = re.findall(r"wire compression sent ([0-9.]+)x received ([0-9.]+)x", proc.stdout)
    assert len(epochs) == 2, proc.stdout[-3000:]
    final = re.search(r"wire compression after warm-up: sent ([0-9.]+)x, received ([0-9.]+)x",
                      proc.stdout)
    assert final, proc.stdout[-3000:]
    assert float(final.group(2)) == pytest.approx(float(final.group(1)), rel=0.2)
