"""benchmarks/synthetic_benchmark.py's peers in the same job: PyTorch DDP over gloo (dense, the fp16
hook, PowerSGD) beside Horovod with DGC, under a real `horovodrun -np 2`.

The byte counts are checked against transcriptions written here from the peers' definitions (DDP
allreduces the fp32 gradients, the fp16 hook half of them, PowerSGD P (n × r) and Q (m × r) of each
matrix view n × m it compresses plus every tensor it leaves dense), and the replicas against each
other: the ranks' gradient sources differ, so equal parameters after training mean the peer really
averaged them. Across the two-host bed, tests/test_cluster.py checks the same counts against the
veth's own byte counter.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT, horovodrun

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def powersgd_numel(shapes, rank, min_compression_rate=2):
    """Elements PowerSGD allreduces per step for these parameter shapes (torch's powerSGD_hook:
    a tensor is viewed as shape[0] × rest; it is compressed when (n + m)·r' · rate < n·m with
    r' = min(n, m, r), sending P and Q; otherwise it goes dense)."""
    total = 0
    for _, shape in shapes:
        n = shape[0]
        m = math.prod(shape) // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
    return total


@pytest.mark.unit
def test_powersgd_numel_transcription():
    """The transcription itself on hand-made shapes: a 1-D tensor and a thin matrix go dense."""
    assert powersgd_numel([("b", (64,))], 1) == 64
    assert powersgd_numel([("w", (100, 3))], 1) == 103            # 103·2 < 300: P and Q
    assert powersgd_numel([("w", (100, 2))], 1) == 200            # 102·2 ≥ 200: dense
    assert powersgd_numel([("w", (64, 3, 7, 7))], 4) == (64 + 147) * 4


@pytest.mark.unit
def test_compress_cost_recall_and_scaling_sparsify_their_1d_tensors(capsys):
    """benchmarks/compress_cost.py's recall and scaling parts hand DGCCore 1-D tensors, which
    DGCConfig's default (min_sparse_ndim=2) leaves dense: they must ask for sparsification, or
    recall has no selection to score and scaling times the dense path."""
    import compress_cost
    assert compress_cost.recall(n=20_000, density=0.01, seeds=1) == 1.0
    compress_cost.scaling(repeats=1, max_elements=10_000, density=0.01)
    out = capsys.readouterr().out
    assert "exact top-k in 1/1" in out and "bucket" in out


@pytest.mark.unit
def test_compress_cost_times_another_checkout_in_the_same_rounds(capsys):
    """--against DIR times the dgc_horovod of DIR in a worker process; here the same tree (what
    a comparison with the last landed version runs), at a tiny size."""
    import compress_cost
    step = compress_cost.Worker(ROOT, 0.01, 1, 1)
    try:
        assert step.where == os.path.join(ROOT, "dgc_horovod")
        buckets, dense = step()                    # seconds of one step's two parts
        assert 0 < buckets < 60 and 0 <= dense < 60
    finally:
        step.close()


@pytest.mark.horovodrun
def test_ddp_peers_beside_dgc(tmp_path):
    from shapes import resnet50
    out = tmp_path / "bench.json"
    proc = horovodrun(["benchmarks/synthetic_benchmark.py", "--model", "resnet50",
                       "--compression", "dgc,ddp,ddp-fp16,ddp-powersgd1,ddp-powersgd4",
                       "--warmup-steps", "1", "--steps", "1", "--json-out", str(out)],
                      timeout=900)
    r = json.loads(out.read_text())
    runs = r["runs"]
    dense = 4 * sum(math.prod(s) for _, s in resnet50())
    assert r["dense_bytes"] == dense == 4 * 25_557_032
    assert runs["ddp"]["bytes"] == dense and runs["ddp-fp16"]["bytes"] == dense / 2
    for rank in (1, 4):
        got = runs[f"ddp-powersgd{rank}"]["bytes"]
        assert got == 4 * powersgd_numel(resnet50(), rank), (rank, got)
        assert got < dense / 10
    for name in ("ddp", "ddp-fp16", "ddp-powersgd1", "ddp-powersgd4"):
        a, b = runs[name]["param_checksums"]
        assert a == b and a != 0.0, (name, a, b)
        assert runs[name]["synchronize"][0] == 0.0 and runs[name]["step"][0] > 0
    assert "DGC against PowerSGD (step time of PowerSGD / step time of DGC): powersgd1" in proc.stdout
    for name in ("ddp-powersgd1", "ddp-powersgd4", "dgc"):
        assert f"<stdout>:{name:>13} | " in proc.stdout


@pytest.mark.horovodrun
def test_tf_mnist_wall_runs_each_variant():
    """benchmarks/tf_mnist_wall.py launches the TensorFlow example once per variant (dense, DGC
    in the graph in buckets and per tensor, DGC in tf.py_function on the C kernels and on eager
    TF ops, through its patched defaults) and reads each run's result: one epoch each, every one must train (the ratio itself
    is measured in docs/performance.md)."""
    import re
    import subprocess
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "benchmarks/tf_mnist_wall.py", "--epochs", "1",
                           "--tf-ops", "--per-tensor"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    accs = dict(re.findall(r"round 1 +(\S+): wall +[\d.]+ s, final test accuracy ([\d.]+)%",
                           proc.stdout))
    assert set(accs) == {"none", "dgc", "dgc-host", "dgc-tf-ops", "dgc-per-tensor"}, proc.stdout
    assert all(float(a) > 50.0 for a in accs.values()), accs
    assert re.search(r"dgc-tf-ops: median wall +[\d.]+ s, [\d.]+x none", proc.stdout)


@pytest.mark.adapter
def test_tf_graph_cost_runs_every_line():
    """benchmarks/tf_graph_cost.py times DGC's TensorFlow step in the graph (buckets and one
    allgather per tensor), in tf.py_function (C kernels, TF ops) and a memory pass, counts the
    traced steps' ops, and with --profile gives the kernel time per op type (the ratios
    themselves are measured in docs/performance.md)."""
    import re
    import subprocess
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "benchmarks/tf_graph_cost.py", "--model", "lstm_lm",
                           "--repeats", "1", "--tf-ops", "--profile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for label in ("one memory pass", "DGC in the graph, buckets", "DGC in the graph, per tensor",
                  "C kernels", "TF ops"):
        assert re.search(label + r".* [\d.]+ ms +[\d.]+x", proc.stdout), proc.stdout
    for variant in ("buckets", "per tensor"):
        assert re.search(rf"the traced step, {variant}: [\d,]+ ops", proc.stdout), proc.stdout
    # --profile: kernel time by op type for both variants, and the executor's step
    assert re.search(r"ResourceApplyMomentum +[\d.]+ +\d+ +[\d.]+ +\d+", proc.stdout), proc.stdout
    assert re.search(r"step \(the executor\) +[\d.]+ +\d+ +[\d.]+ +\d+", proc.stdout), proc.stdout


@pytest.mark.horovodrun
def test_tf_step_phases_reports_both_variants():
    """benchmarks/tf_step_phases.py splits the TensorFlow example's step into trace, first run,
    warm-up and later steps for dense and DGC under horovodrun (the times themselves are
    measured in docs/performance.md); a bad argument is refused."""
    import re
    import subprocess
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "benchmarks/tf_step_phases.py", "--steps", "12",
                           "--warmup-steps", "4", "--breakdown"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for variant in ("none", "dgc"):
        assert re.search(rf"{variant}: trace +[\d.]+ s \| first run +[\d.]+ s \| warm-up +[\d.]+ s "
                         rf"\( *[\d.]+ ms/step\) \| after +[\d.]+ s .*\| ops \d+", proc.stdout), \
            proc.stdout
    for label in ("DGC.compress", "ComparedModels.check", "GraphCore.compress_ops",
                  "GraphCore.decompress_ops"):        # the example's model: 4 tensors, 2 traces
        assert re.search(rf"trace breakdown: {label} +[\d.]+ s in [1-9]\d* calls",
                         proc.stdout), proc.stdout
    bad = subprocess.run([sys.executable, "benchmarks/tf_step_phases.py", "--steps", "4",
                          "--warmup-steps", "4"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--warmup-steps" in bad.stderr


@pytest.mark.environment
def test_gpu_check_runs_at_tiny_sizes_on_cpu():
    """benchmarks/gpu_check.py --tiny: every part of the GPU check (conformance on the device
    against the NumPy reference, timing, launches and host reads, the simulated cluster) at
    small sizes under Triton's interpreter, as on a GPU machine; its exit status says whether
    every check held."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--tiny"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for part in ("1. conformance", "2. time per step", "3. launches", "4. simulated cluster"):
        assert part in out, out
    assert "FAIL" not in out and "0 host reads" in out


@pytest.mark.unit
def test_sketch_cost_prints_a_row_per_model(capsys):
    """benchmarks/sketch_cost.py: a row per model with the sketch's time beside the global
    clip's, and an estimate error within the sketch's stated bound (W = 512: 3.1% of the norm
    per standard deviation)."""
    import sketch_cost
    sketch_cost.main(["--models", "mnist_cnn", "--rounds", "1", "--draws", "3"])
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| mnist_cnn")]
    assert len(row) == 1 and "2,048 / 6,144" in row[0]
    worst = float(row[0].rstrip(" |").split("(")[-1].rstrip("%)"))
    assert worst < 15, row
