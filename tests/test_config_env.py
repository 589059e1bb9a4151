"""HOROVOD_DGC_* environment variables: parsing, validation, precedence, provenance, and a real
`horovodrun -np 2` job (Gloo and MPI) in which the variables set in the launching shell change
what DGC does on both ranks.

Precedence under test: an explicit keyword argument > the environment variable > the default.
"""
import json
import math
import os
import re

import pytest

from conftest import ROOT, horovodrun
from dgc_horovod.core import DGCConfig
from dgc_horovod.core.config import ENV_PREFIX

OPTIONS = list(DGCConfig.DEFAULTS)


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch):
    """No HOROVOD_DGC_* variable of the caller's shell leaks into these tests."""
    for var in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(var)


# ------------------------------------------------------------------ names and defaults
@pytest.mark.unit
def test_every_option_has_one_variable():
    assert set(DGCConfig.ENV_VARS) == set(DGCConfig().to_dict()) == set(DGCConfig.DEFAULTS)
    for name, var in DGCConfig.ENV_VARS.items():
        assert var == "HOROVOD_DGC_" + name.upper()


@pytest.mark.unit
def test_defaults_without_environment():
    cfg = DGCConfig()
    assert cfg.to_dict() == DGCConfig.DEFAULTS
    assert (cfg.clip_scope, cfg.min_sparse_ndim, cfg.warmup_steps, cfg.warmup_epochs,
            cfg.weight_decay_mode) == ("global", 2, 1000, None, "separate")
    assert set(cfg.sources.values()) == {"default"}
    assert str(cfg) == repr(cfg)            # nothing to annotate


# ------------------------------------------------------------------ parsing
VALID = [
    ("compress_ratio", "0.01", 0.01), ("compress_ratio", " 1 ", 1.0),
    ("compress_ratio", "1e-3", 0.001),
    ("momentum", "0", 0.0), ("momentum", "0.99", 0.99),
    ("nesterov", "1", True), ("nesterov", "TRUE", True), ("nesterov", "yes", True),
    ("nesterov", "On", True), ("nesterov", "0", False), ("nesterov", "false", False),
    ("momentum_masking", "0", False), ("momentum_masking", "no", False),
    ("momentum_masking", "off", False), ("momentum_masking", "true", True),
    ("clip_norm", "2.5", 2.5), ("clip_norm", "none", None), ("clip_norm", "None", None),
    ("weight_decay", "1e-4", 1e-4), ("weight_decay", "0", 0.0),
    ("sample_ratio", "0.001", 0.001),
    ("exact_topk", "1", True),
    ("min_sparse_numel", "1024", 1024),
    ("warmup_epochs", "0", 0.0), ("warmup_epochs", "2.5", 2.5),
    ("warmup_initial_density", "0.5", 0.5),
    ("warmup_per_step", "yes", True),
    ("seed", "123", 123),
    ("wire_index", "int32", "int32"), ("wire_index", "DELTA16", "delta16"),
    ("wire_values", "float16", "float16"),
    ("bucket_numel", "0", 0), ("bucket_numel", "1048576", 1048576),
]


@pytest.mark.unit
@pytest.mark.parametrize("option,text,expected", VALID)
def test_variable_sets_option(option, text, expected):
    var = DGCConfig.ENV_VARS[option]
    cfg = DGCConfig(environ={var: text})
    got = getattr(cfg, option)
    assert got == expected and type(got) is type(expected), (got, expected)
    assert cfg.sources[option] == var
    assert {k for k, s in cfg.sources.items() if s != "default"} == {option}
    # the same value given as a keyword gives an equal config
    assert cfg == DGCConfig(**{option: expected}, environ={})


@pytest.mark.unit
def test_os_environ_is_read_by_default(monkeypatch):
    monkeypatch.setenv("HOROVOD_DGC_COMPRESS_RATIO", "0.05")
    monkeypatch.setenv("HOROVOD_DGC_WIRE_VALUES", "float16")
    cfg = DGCConfig()
    assert (cfg.compress_ratio, cfg.wire_values) == (0.05, "float16")
    assert DGCConfig(environ={}).compress_ratio == 0.004     # environ={} ignores it


@pytest.mark.unit
def test_empty_variable_counts_as_unset():
    cfg = DGCConfig(environ={"HOROVOD_DGC_COMPRESS_RATIO": "", "HOROVOD_DGC_SEED": "  "})
    assert cfg.compress_ratio == 0.004 and cfg.seed == 0
    assert set(cfg.sources.values()) == {"default"}


@pytest.mark.unit
def test_other_variables_are_ignored():
    cfg = DGCConfig(environ={"HOROVOD_FUSION_THRESHOLD": "abc", "DGC_COMPRESS_RATIO": "x",
                             "HOROVOD_CYCLE_TIME": "5"})
    assert cfg == DGCConfig(environ={})


# ------------------------------------------------------------------ errors
BAD = [
    ("compress_ratio", "abc", "a float in (0, 1]"),
    ("compress_ratio", "0", "a float in (0, 1]"),
    ("compress_ratio", "1.5", "a float in (0, 1]"),
    ("compress_ratio", "nan", "a float in (0, 1]"),
    ("compress_ratio", "1/1000", "a float in (0, 1]"),
    ("momentum", "1", "a float in [0, 1)"),
    ("momentum", "-0.1", "a float in [0, 1)"),
    ("nesterov", "maybe", "a boolean: 1, true, yes, on or 0, false, no, off"),
    ("nesterov", "2", "a boolean"),
    ("momentum_masking", "True!", "a boolean"),
    ("clip_norm", "0", "a finite float > 0, or none to disable clipping"),
    ("clip_norm", "-1", "a finite float > 0"),
    ("clip_norm", "inf", "a finite float > 0"),
    ("weight_decay", "-1e-4", "a finite float >= 0"),
    ("sample_ratio", "2", "a float in (0, 1]"),
    ("min_sparse_numel", "0", "an int >= 1"),
    ("min_sparse_numel", "1.5", "an int >= 1"),
    ("min_sparse_numel", "1e3", "an int >= 1"),
    ("warmup_epochs", "-1", "a finite float >= 0"),
    ("warmup_epochs", "four", "a finite float >= 0"),
    ("warmup_initial_density", "0", "a float in (0, 1]"),
    ("warmup_per_step", "per-step", "a boolean"),
    ("seed", "-1", "an int in [0, 9223372036854775807]"),
    ("seed", "0x10", "an int in [0, 9223372036854775807]"),
    ("seed", str(2 ** 63), "an int in [0, 9223372036854775807]"),
    ("wire_index", "int16", "one of delta16, int32"),
    ("wire_values", "bfloat16", "one of float32, float16"),
    ("bucket_numel", "-1", "an int >= 0"),
    ("bucket_numel", "2**22", "an int >= 0"),
]


@pytest.mark.unit
@pytest.mark.parametrize("option,text,form", BAD)
def test_bad_variable_names_itself_and_expected_form(option, text, form):
    var = DGCConfig.ENV_VARS[option]
    with pytest.raises(ValueError) as err:
        DGCConfig(environ={var: text})
    msg = str(err.value)
    assert msg.startswith(f"{var} must be {form}"), msg
    assert msg.endswith(f"got {text!r}"), msg


@pytest.mark.unit
def test_error_message_example_from_the_issue():
    with pytest.raises(ValueError, match=re.escape(
            "HOROVOD_DGC_COMPRESS_RATIO must be a float in (0, 1], got 'abc'")):
        DGCConfig(environ={"HOROVOD_DGC_COMPRESS_RATIO": "abc"})


@pytest.mark.unit
def test_unknown_variable_is_refused():
    with pytest.raises(ValueError) as err:
        DGCConfig(environ={"HOROVOD_DGC_COMPRES_RATIO": "0.01"})   # misspelt
    msg = str(err.value)
    assert "HOROVOD_DGC_COMPRES_RATIO" in msg and "HOROVOD_DGC_COMPRESS_RATIO" in msg


@pytest.mark.unit
def test_explicit_argument_beats_a_bad_variable_too():
    # the variable of an option given explicitly is not used, so it is not validated either
    cfg = DGCConfig(compress_ratio=0.1, environ={"HOROVOD_DGC_COMPRESS_RATIO": "abc"})
    assert cfg.compress_ratio == 0.1 and cfg.sources["compress_ratio"] == "argument"


@pytest.mark.unit
def test_non_string_environ_value():
    with pytest.raises(TypeError, match="HOROVOD_DGC_SEED must be a str"):
        DGCConfig(environ={"HOROVOD_DGC_SEED": 3})


@pytest.mark.unit
def test_cross_check_names_where_values_came_from():
    with pytest.raises(ValueError) as err:
        DGCConfig(environ={"HOROVOD_DGC_NESTEROV": "1", "HOROVOD_DGC_MOMENTUM": "0"})
    msg = str(err.value)
    assert "nesterov=True needs momentum > 0" in msg
    assert "nesterov from HOROVOD_DGC_NESTEROV" in msg
    assert "momentum from HOROVOD_DGC_MOMENTUM" in msg
    with pytest.raises(ValueError) as err:
        DGCConfig(momentum=0.0, environ={"HOROVOD_DGC_NESTEROV": "on"})
    assert "momentum from argument" in str(err.value)
    with pytest.raises(ValueError, match=r"^nesterov=True needs momentum > 0$"):
        DGCConfig(nesterov=True, momentum=0.0, environ={})    # keyword form: unchanged


@pytest.mark.unit
def test_keyword_errors_still_name_the_argument():
    with pytest.raises(TypeError, match="compress_ratio must be a float in"):
        DGCConfig(compress_ratio="0.01", environ={})
    with pytest.raises(ValueError, match=r"clip_norm must be a finite number > 0 \(or None"):
        DGCConfig(clip_norm=0, environ={"HOROVOD_DGC_CLIP_NORM": "1"})


@pytest.mark.unit
@pytest.mark.parametrize("value", [0, 0.0, -1, -1.0, float("inf"), float("nan")])
def test_clip_norm_zero_negative_and_inf_get_one_message(value):
    with pytest.raises(ValueError) as err:
        DGCConfig(clip_norm=value, environ={})
    assert str(err.value) == ("clip_norm must be a finite number > 0 (or None to disable "
                              f"clipping), got {value!r}")


# ------------------------------------------------------------------ precedence and provenance
@pytest.mark.unit
def test_precedence_argument_over_variable_over_default():
    env = {"HOROVOD_DGC_COMPRESS_RATIO": "0.05", "HOROVOD_DGC_SEED": "7",
           "HOROVOD_DGC_CLIP_NORM": "1.0", "HOROVOD_DGC_MOMENTUM_MASKING": "0"}
    # an explicit keyword wins even when it equals the default, and None is an explicit value
    cfg = DGCConfig(seed=0, clip_norm=None, environ=env)
    assert cfg.seed == 0 and cfg.sources["seed"] == "argument"
    assert cfg.clip_norm is None and cfg.sources["clip_norm"] == "argument"
    assert cfg.compress_ratio == 0.05
    assert cfg.sources["compress_ratio"] == "HOROVOD_DGC_COMPRESS_RATIO"
    assert cfg.momentum_masking is False
    assert cfg.momentum == 0.9 and cfg.sources["momentum"] == "default"


@pytest.mark.unit
def test_str_shows_where_non_defaults_came_from():
    cfg = DGCConfig(seed=3, environ={"HOROVOD_DGC_COMPRESS_RATIO": "0.01"})
    s = str(cfg)
    assert "compress_ratio=0.01 [HOROVOD_DGC_COMPRESS_RATIO]" in s
    assert "seed=3 [argument]" in s
    assert "momentum=0.9," in s and "momentum=0.9 [" not in s
    assert s.count("[") == 2
    assert "[" not in repr(cfg)                            # repr stays DGCConfig(k=v, ...)
    assert cfg.sources == {**{k: "default" for k in OPTIONS}, "seed": "argument",
                           "compress_ratio": "HOROVOD_DGC_COMPRESS_RATIO"}


@pytest.mark.unit
def test_sources_is_a_copy():
    cfg = DGCConfig(environ={})
    cfg.sources["seed"] = "tampered"
    assert cfg.sources["seed"] == "default"


@pytest.mark.unit
def test_docs_document_every_variable():
    doc = open(os.path.join(ROOT, "docs", "options.md"), encoding="utf-8").read()
    options = doc[doc.index("## Environment variables"):]
    options = options[:options.index("\n## ", 1)]
    missing = [v for v in DGCConfig.ENV_VARS.values() if f"`{v}`" not in options]
    assert not missing, missing
    for needle in ("HOROVOD_DGC_", "keyword argument", "environment variable", "default"):
        assert needle in options, needle


# ------------------------------------------------------------------ a real horovodrun job
WORKER = r'''
"""Two ranks build DGC with only seed given; everything else comes from HOROVOD_DGC_*."""
import json, os, sys
import torch
import horovod.torch as hvd
from dgc_horovod.torch import DGC

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.ReLU(), torch.nn.Linear(50, 10))
dgc = DGC(seed=3)                               # explicit: beats HOROVOD_DGC_SEED
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), compression=dgc)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
g = torch.Generator().manual_seed(100 + hvd.rank())
for step in range(4):
    x, y = torch.randn(16, 100, generator=g), torch.randint(0, 10, (16,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
t = dgc.total_stats
out = {"rank": hvd.rank(), "size": hvd.size(), "config": dgc.config.to_dict(),
       "sources": dgc.config.sources, "str": str(dgc.config), "density": dgc.density,
       "elements": t.elements, "selected": t.selected, "wire_bytes": t.wire_bytes,
       "steps": t.steps,
       "params": [p.detach().flatten().tolist()[:20] for p in model.parameters()]}
with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.json"), "w") as f:
    json.dump(out, f)
'''

JOB_ENV = {"HOROVOD_DGC_COMPRESS_RATIO": "0.05", "HOROVOD_DGC_WARMUP_EPOCHS": "0",
           "HOROVOD_DGC_MOMENTUM": "0.5", "HOROVOD_DGC_WIRE_INDEX": "int32",
           "HOROVOD_DGC_SEED": "7"}


@pytest.mark.horovodrun
@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_horovodrun_ranks_follow_the_environment(tmp_path, launcher):
    script = tmp_path / "env_worker.py"
    script.write_text(WORKER)
    horovodrun([str(script), str(tmp_path)], launcher=launcher, env=JOB_ENV, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for out in ranks:
        assert out["size"] == 2
        cfg, src = out["config"], out["sources"]
        assert cfg["compress_ratio"] == 0.05
        assert src["compress_ratio"] == "HOROVOD_DGC_COMPRESS_RATIO"
        assert cfg["warmup_epochs"] == 0.0 and cfg["momentum"] == 0.5
        assert cfg["wire_index"] == "int32"
        assert cfg["seed"] == 3 and src["seed"] == "argument"          # argument > environment
        assert cfg["sample_ratio"] == 0.01 and src["sample_ratio"] == "default"
        assert "compress_ratio=0.05 [HOROVOD_DGC_COMPRESS_RATIO]" in out["str"]
        # behaviour: density 0.05 from step 0 (no warm-up); per tensor DGC sends between
        # ceil(k/2) and k entries, k = ceil(0.05 n) -- against ~0.1% (and 25% in warm-up) by default
        assert out["density"] == 0.05
        numels = [100 * 50, 50, 50 * 10, 10]
        k = [math.ceil(0.05 * n) for n in numels]
        assert out["steps"] == 4 and out["elements"] == 4 * sum(numels)
        assert 4 * sum(math.ceil(x / 2) for x in k) <= out["selected"] <= 4 * sum(k), out
        # int32 indices: 4 + 4 bytes per sent entry, plus each payload's 5-word header
        assert out["wire_bytes"] >= 8 * out["selected"]
    assert ranks[0]["params"] == ranks[1]["params"]       # the ranks stayed in step


@pytest.mark.unit
def test_numpy_scalars_are_taken_as_python_numbers():
    import numpy as np
    c = DGCConfig(compress_ratio=np.float32(0.01), warmup_steps=np.int64(100),
                  momentum=np.float64(0.9), bucket_numel=np.int32(0), environ={})
    assert type(c.compress_ratio) is float and c.compress_ratio == float(np.float32(0.01))
    assert type(c.momentum) is float and c.momentum == 0.9
    assert (type(c.warmup_steps), c.warmup_steps) == (int, 100)
    assert (type(c.bucket_numel), c.bucket_numel) == (int, 0)
    with pytest.raises(TypeError, match="warmup_steps must be an int"):
        DGCConfig(warmup_steps=np.float64(100.0), environ={})
    with pytest.raises(TypeError, match="compress_ratio must be a float"):
        DGCConfig(compress_ratio=np.bool_(True), environ={})
    with pytest.raises(ValueError, match="compress_ratio must be in"):
        DGCConfig(compress_ratio=np.float32("nan"), environ={})
