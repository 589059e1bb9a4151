"""docs/api.md is what scripts/gen_api_docs.py generates now; the DGC figure script runs."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def _run(script, out):
    env = dict(os.environ, PYTHONPATH=ROOT, MPLBACKEND="Agg", TF_USE_LEGACY_KERAS="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), str(out)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=300)


@pytest.mark.adapter
def test_api_reference_is_up_to_date(tmp_path):
    fresh = tmp_path / "api.md"
    _run("gen_api_docs.py", fresh)
    committed = open(os.path.join(ROOT, "docs", "api.md")).read()
    assert fresh.read_text() == committed, (
        "docs/api.md is out of date: run `make docs` (or python scripts/gen_api_docs.py)")
    for name in ("dgc_horovod.torch.DGC", "dgc_horovod.tensorflow.DGCWarmupCallback",
                 "dgc_horovod.torch.Compression", "dgc_horovod.core.CompressionStats"):
        assert name in committed


@pytest.mark.unit
def test_pipeline_figure_renders(tmp_path):
    out = tmp_path / "fig.png"
    _run("draw_dgc_figure.py", out)
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert os.path.exists(os.path.join(ROOT, "docs", "dgc_pipeline.png"))
