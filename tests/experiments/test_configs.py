"""Tests of experiments/configs/base.py (the typed config-arg parser, `runlocal`, `base_config`)
and of which errors `python -m experiments.launch` reports as config errors: those raised while
building the run, never those raised during training."""

import pytest
from absl import flags

from experiments import launch
from experiments.configs import base, lm, mqar, ode_finetune

SPEC = {"model": ("mamba", "gdn"), "layers": 2, "steps": int, "rate": 0.5, "runlocal": False}


def test_parse_arg_converts_to_the_type_of_the_default_and_fills_defaults():
    assert base.parse_arg(None, SPEC) == {
        "model": "mamba",
        "layers": 2,
        "steps": None,
        "rate": 0.5,
        "runlocal": False,
    }
    got = base.parse_arg("model=gdn,layers=3,steps=7,rate=0.25,runlocal", SPEC)
    assert got == {"model": "gdn", "layers": 3, "steps": 7, "rate": 0.25, "runlocal": True}
    assert base.parse_arg("runlocal=false", SPEC)["runlocal"] is False


@pytest.mark.parametrize(
    "arg, match",
    [
        ("depth=3", r"config arg 'depth' unknown"),
        ("model=lstm", r"config arg model must be one of \('mamba', 'gdn'\), got 'lstm'"),
        ("layers=two", r"config arg layers must be int, got 'two'"),
        ("steps=1.5", r"config arg steps must be int, got '1.5'"),
        ("layers", r"config arg layers needs a value"),
        ("runlocal=yes", r"config arg runlocal is a flag"),
    ],
)
def test_parse_arg_errors_name_the_arg(arg, match):
    with pytest.raises(ValueError, match=match):
        base.parse_arg(arg, SPEC)


def test_runlocal_and_base_config():
    config = base.runlocal(mqar.get_config(None), total_steps=5)
    assert (config.total_steps, config.batch_size, config.eval_batches) == (5, 8, 1)
    assert config.optimizer.warmup_steps == 2 and config.model.gdn.chunk_size == 16
    assert base.base_config(seed=3).seed == 3
    with pytest.raises(ValueError, match=r"unknown run-level keys \['steps'\]"):
        base.base_config(steps=3)
    assert ode_finetune.get_config("runlocal,steps=0").model.num_layers == 0  # given, not default


@pytest.fixture
def parsed_flags(tmp_path):
    flags.FLAGS(
        ["launch", "--config=experiments/configs/mqar.py:runlocal", f"--workdir={tmp_path}"]
    )
    yield
    flags.FLAGS.unparse_flags()


def test_only_errors_of_building_the_run_are_config_errors(parsed_flags, monkeypatch):
    def failing_run(*_):
        raise ValueError("raised during training")

    monkeypatch.setattr(launch, "run_trainer", failing_run)
    with pytest.raises(ValueError, match="raised during training"):  # not a SystemExit
        launch.main(["launch"])
    flags.FLAGS.config.batch_size = 6  # the fixture parses a fresh config for every test
    with pytest.raises(SystemExit, match=r"config error: config\.batch_size = 6 must be"):
        launch.main(["launch"])


@pytest.mark.parametrize("model", ["kda", "gdn2", "gdp"])
def test_delta_family_models_build_in_mqar_and_lm(model):
    """The mixer blocks of the delta family are in both configs and reach the model (building
    compiles nothing; tests/experiments/test_launch.py trains them with `runlocal`, slow)."""
    letter = {"kda": "k", "gdn2": "n", "gdp": "p"}[model]
    for config in (mqar.get_config(f"model={model},runlocal"), lm.get_config(f"model={model}")):
        built = launch.build(config, data=False)
        assert built.model.pattern == letter * config.model.num_layers
        assert getattr(built.model, model) == config.model[model].to_dict()
