"""TensorFlow ranks whose models differ get a clear ValueError within seconds, never a hang.

One `horovodrun -np 2` job per controller (Gloo and MPI) runs tests/workers/tf_mismatch_worker.py:
models that differ on rank 1 by a variable's name, a shape, the order of the variables, or a
layer trainable on one rank only, through DistributedGradientTape in tf.function and eagerly and
through Keras fit; then the same model again, which must train.
"""
import json

import pytest

from conftest import horovodrun

pytestmark = pytest.mark.horovodrun

TF_ENV = {"TF_USE_LEGACY_KERAS": "1"}
PREFIX = "DGC: the ranks' "        # models differ: ... / DGC configs differ (...)


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tf_mismatch_" + request.param)
    horovodrun(["tests/workers/tf_mismatch_worker.py", "--out", str(out)],
               launcher=request.param, env=TF_ENV, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _message(result):
    assert result["error"] is not None and result["error"]["type"] == "ValueError"
    msg = result["error"]["message"]
    return msg[msg.index(PREFIX):].strip()


def test_same_model_trains_before_and_after_the_errors(ranks):
    for r in ranks:
        assert r["same"]["error"] is None and r["same_after_errors"]["error"] is None


@pytest.mark.parametrize("case,expected", [
    ("names", ["the gradient #0 Horovod reduces is of 'fc1/kernel:0' (shape [16, 32], float32) "
               "on rank 0 but of 'hidden/kernel:0' (shape [16, 32], float32) on rank 1",
               "the gradient #0 Horovod reduces is of 'hidden/kernel:0' (shape [16, 32], "
               "float32) on rank 1 but of 'fc1/kernel:0' (shape [16, 32], float32) on rank 0"]),
    ("shapes", ["'fc1/kernel:0' (shape [16, 32], float32) on rank 0 but of 'fc1/kernel:0' "
                "(shape [16, 48], float32) on rank 1",
                "'fc1/kernel:0' (shape [16, 48], float32) on rank 1 but of 'fc1/kernel:0' "
                "(shape [16, 32], float32) on rank 0"]),
    ("order", ["#0 Horovod reduces is of 'fc1/kernel:0' (shape [16, 32], float32) on rank 0 but "
               "of 'fc2/bias:0' (shape [4], float32) on rank 1",
               "#0 Horovod reduces is of 'fc2/bias:0' (shape [4], float32) on rank 1 but of "
               "'fc1/kernel:0' (shape [16, 32], float32) on rank 0"]),
    ("trainable_on_one_rank",
     ["rank 0 reduces the gradients of 4 variables, rank 1 of 2; 'fc1/kernel:0' (shape [16, 32], "
      "float32) is reduced on rank 0 only",
      "rank 1 reduces the gradients of 2 variables, rank 0 of 4; 'fc1/kernel:0' (shape [16, 32], "
      "float32) is reduced on rank 0 only"]),
    ("shapes_eager", ["(shape [16, 48], float32) on rank 1", "(shape [16, 48], float32) on rank 1"]),
    ("keras_fit_shapes", ["(shape [16, 48], float32) on rank 1",
                          "(shape [16, 48], float32) on rank 1"]),
    ("config", ["configs differ (bucket_numel: 4194304 here, 0 on rank 1)",
                "configs differ (bucket_numel: 0 here, 4194304 on rank 0)"]),
])
def test_differing_models_raise_a_clear_error_on_every_rank_within_seconds(ranks, case, expected):
    for rank, r in enumerate(ranks):
        assert expected[rank] in _message(r[case])
        assert r[case]["seconds"] < 20          # an error, not a hang (the job's timeout)
