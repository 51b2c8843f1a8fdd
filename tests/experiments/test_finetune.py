"""Fine-tuning through `python -m experiments.launch`: `ode_finetune.py` starts from another run's
checkpoint at another step count with LoRA (only `lora` parameters move, every other one stays
bit-identical to the source); slow: from a real `ode_lm.py` run, full fine-tuning moves every
parameter, and a relaunch resumes from the run's own checkpoint without reading `init_from`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from flax.traverse_util import flatten_dict

from experiments import launch
from experiments.configs import ode_finetune, ode_lm
from seqlab.modules.ode_transformer import ODETransformer
from seqlab.train.checkpoint import Checkpointer, restore_params
from seqlab.train.data import make_datasets
from seqlab.train.metrics import read_metrics
from seqlab.train.models import build_model


def _param_shapes(config):
    _, _, vocab = make_datasets(config.data, batch_size=config.batch_size, seed=config.seed)
    model = build_model(config.model, vocab)
    tokens = jax.ShapeDtypeStruct((1, config.data.seq_len), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def _final_params(config, workdir):
    """The parameters of the latest checkpoint of the run of `config` in `workdir`, flat."""
    target = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _param_shapes(config))
    params, _ = restore_params(workdir / "checkpoints", target)
    return {k: np.asarray(v) for k, v in flatten_dict(params, sep="/").items()}


@pytest.fixture(scope="module")
def saved_source(tmp_path_factory):
    """A checkpoint of an `ode_lm.py:runlocal` model as the launcher writes it (a `TrainState` at
    step 8), with random parameters from numpy (no initializer to compile)."""
    workdir = tmp_path_factory.mktemp("source")
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype),
        _param_shapes(ode_lm.get_config("runlocal")),
    )
    state = TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))
    ckpt = Checkpointer(workdir / "checkpoints", every=1, keep=1)
    ckpt.save(8, state.replace(step=8))
    ckpt.wait()
    ckpt.close()
    return workdir, {k: np.asarray(v) for k, v in flatten_dict(params, sep="/").items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished `ode_lm.py:runlocal` run (2 Euler steps)."""
    workdir = tmp_path_factory.mktemp("ode_lm")
    config = ode_lm.get_config("runlocal")
    assert launch.train(config, str(workdir))["status"] == "done"
    return workdir, _final_params(config, workdir)


def _finetune(src_dir, workdir, arg: str):
    config = ode_finetune.get_config(f"runlocal,steps=3,from={src_dir},{arg}")
    assert launch.train(config, str(workdir)) == {"status": "done", "step": config.total_steps}
    return config, _final_params(config, workdir)


@pytest.mark.slow  # ~40 s; theory's test_lora_runs_move_only_lora_and_the_embedding covers the mask
def test_lora_finetuning_at_another_step_count_moves_only_lora(saved_source, tmp_path):
    src_dir, src_params = saved_source
    config, params = _finetune(src_dir, tmp_path / "ft", "lora=2")
    assert config.model.num_layers == 3 and config.optimizer.trainable == "lora"
    records = read_metrics(tmp_path / "ft")
    assert [r["step"] for r in records] == list(range(1, config.total_steps + 1))  # from step 0
    assert set(params) - set(src_params) == {
        f"{w}/lora_{f}" for w in ("wq", "wk", "wv", "wo", "w1", "w2") for f in "uv"
    }
    for name, value in src_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)  # frozen: bit-identical
    assert np.abs(params["wq/lora_u"]).max() > 0  # zero at init, trained


@pytest.mark.slow
def test_ode_lm_then_full_finetuning_moves_every_parameter(source, tmp_path):
    src_dir, src_params = source
    config, params = _finetune(src_dir, tmp_path / "ft", "lora=0")
    assert config.optimizer.trainable == "" and set(params) == set(src_params)
    for name, value in src_params.items():
        assert not np.array_equal(params[name], value), name


@pytest.mark.slow
def test_a_relaunch_resumes_its_own_checkpoint_and_never_reads_init_from(source, tmp_path):
    src_dir, src_params = source
    config, params = _finetune(src_dir, tmp_path / "ft", "lora=2")
    # `init_from` now names a folder with no checkpoint, which restoring from would reject.
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    with config.unlocked():
        config.total_steps += 2
        config.init_from = str(empty)
    assert launch.train(config, str(tmp_path / "ft")) == {
        "status": "done",
        "step": config.total_steps,
    }
    assert read_metrics(tmp_path / "ft")[-1]["step"] == config.total_steps
    resumed = _final_params(config, tmp_path / "ft")
    for name, value in src_params.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    assert not np.array_equal(resumed["wq/lora_u"], params["wq/lora_u"])


@pytest.mark.parametrize(
    "module, arg, steps, lora",
    [
        (ode_lm, None, 12, 0),
        (ode_lm, "steps=18", 18, 0),
        (ode_lm, "runlocal", 2, 0),
        (ode_finetune, "from=/runs/x,lora=4", 24, 4),
        (ode_finetune, "runlocal,steps=5", 5, 0),
    ],
)
def test_the_configs_build_ode_transformers(module, arg, steps, lora):
    config = module.get_config(arg)
    model = build_model(config.model, vocab_size=256)
    assert isinstance(model, ODETransformer)
    assert (model.num_steps, model.lora_rank) == (steps, lora)
    assert config.optimizer.trainable == ("lora" if lora else "")


def test_init_from_must_be_a_workdir(tmp_path):
    config = ode_finetune.get_config(f"runlocal,from={tmp_path / 'nothing'}")
    with pytest.raises(ValueError, match=r"config\.init_from"):
        launch.train(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
