"""PyTorch adapter checks that need no launcher: construction errors and misuse."""
import pytest
import torch

from dgc_horovod.core import DGCConfig
from dgc_horovod.torch import DGC

pytestmark = pytest.mark.adapter


@pytest.mark.parametrize("kwargs, arg", [
    (dict(compress_ratio=0.0), "compress_ratio"), (dict(compress_ratio=1.5), "compress_ratio"),
    (dict(compress_ratio=float("nan")), "compress_ratio"), (dict(sample_ratio=0.0), "sample_ratio"),
    (dict(sample_ratio=2.0), "sample_ratio"), (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.1), "momentum"), (dict(clip_norm=-1.0), "clip_norm"),
    (dict(min_sparse_numel=0), "min_sparse_numel"), (dict(warmup_epochs=-1), "warmup_epochs"),
    (dict(warmup_steps=-1), "warmup_steps"), (dict(min_sparse_ndim=0), "min_sparse_ndim"),
    (dict(clip_scope="layer"), "clip_scope"), (dict(weight_decay_mode="x"), "weight_decay_mode"),
])
def test_bad_arguments_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        DGC(**kwargs)


@pytest.mark.parametrize("kwargs, arg", [(dict(compress_ratio="0.1"), "compress_ratio"),
                                         (dict(min_sparse_numel=1.5), "min_sparse_numel")])
def test_wrong_types_name_the_argument(kwargs, arg):
    with pytest.raises(TypeError, match=arg):
        DGC(**kwargs)


def test_a_density_passed_positionally_hints_the_keyword():
    with pytest.raises(TypeError, match=r"first argument is config .* got float 0.01; to set the "
                                        r"density pass it by keyword: DGC\(compress_ratio=0.01\)"):
        DGC(0.01)
    with pytest.raises(TypeError, match="first argument is config"):
        DGC("0.01")


def test_a_misspelt_keyword_lists_the_valid_ones():
    with pytest.raises(TypeError) as err:
        DGC(compres_ratio=0.01)
    msg = str(err.value)
    assert "unexpected keyword argument 'compres_ratio' (did you mean 'compress_ratio'?)" in msg
    assert all(k in msg for k in ("clip_norm", "wire_values", "loss_scaler", "environ"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'xyz'; the valid ones: "):
        DGC(xyz=1)


def test_config_or_kwargs_not_both():
    with pytest.raises(TypeError, match="either"):
        DGC(config=DGCConfig(), compress_ratio=0.01)


def test_compress_outside_distributed_optimizer_explains_usage():
    with pytest.raises(RuntimeError, match="DistributedOptimizer"):
        DGC().compress(torch.zeros(3))


def test_repr_shows_every_setting():
    text = repr(DGC(compress_ratio=0.01, clip_norm=1.0))
    assert "compress_ratio=0.01" in text and "clip_norm=1.0" in text and "sample_ratio" in text


@pytest.mark.parametrize("arg", ["nesterov", "momentum_masking", "exact_topk", "warmup_per_step"])
def test_boolean_options_refuse_strings(arg):
    with pytest.raises(TypeError, match=arg):
        DGC(**{arg: "False"})


def test_set_epoch_refuses_strings():
    with pytest.raises(TypeError, match="epoch"):
        DGC().set_epoch("1")


def test_set_step_needs_steps_per_epoch_only_with_warmup_epochs():
    dgc = DGC(warmup_steps=8)
    dgc.set_step(100)                       # the step-counted warm-up: no epoch length needed
    assert dgc.density == dgc.config.compress_ratio
    with pytest.raises(ValueError, match="steps_per_epoch"):
        DGC(warmup_epochs=2).set_step(10)


@pytest.mark.parametrize("uncalled, right_line", [("factory", "dgc = Compression.dgc("),
                                                  ("class", "dgc = DGC(")])
def test_uncalled_factory_or_class_shows_the_right_line(uncalled, right_line):
    from dgc_horovod.torch import Compression
    obj = Compression.dgc if uncalled == "factory" else DGC
    for method in (obj.compress, obj.decompress):
        with pytest.raises(TypeError, match=right_line.replace("(", r"\(")):
            method(torch.zeros(3))
    made = Compression.dgc(compress_ratio=0.01)            # called, it makes a DGC
    assert isinstance(made, DGC) and made.config.compress_ratio == 0.01
    with pytest.raises(RuntimeError, match="DistributedOptimizer"):
        DGC.compress(made, torch.zeros(3))                 # an explicit instance still works


@pytest.mark.parametrize("text, value", [(None, 0.0002), ("0", 0.0), ("0.001", 0.001)])
def test_wait_sleep_reads_the_environment(text, value):
    from dgc_horovod.torch.exchange import wait_sleep
    assert wait_sleep({} if text is None else {"DGC_WAIT_SLEEP": text}) == value


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "fast", ""])
def test_bad_wait_sleep_names_the_variable(text):
    from dgc_horovod.torch.exchange import wait_sleep
    with pytest.raises(ValueError, match="DGC_WAIT_SLEEP"):
        wait_sleep({"DGC_WAIT_SLEEP": text})


def test_a_copy_or_pickle_is_refused_with_what_to_do_instead():
    import copy
    import pickle
    dgc = DGC()
    for attempt in (lambda: pickle.dumps(dgc), lambda: copy.deepcopy(dgc), lambda: copy.copy(dgc)):
        with pytest.raises(TypeError, match=r"dgc_horovod\.torch\.DGC cannot be pickled or copied"
                                            r".*TorchState.*state_dict"):
            attempt()
