"""Sequence parallelism (`mesh.seq`) on the 4 fake CPU devices: a hybrid `LanguageModel` run with
`seq_axis` under `shard_map` gives the plain forward; one training step on a mesh that splits the
time axis (alone, and with data parallelism and FSDP) gives the unsharded step's loss, gradients
and parameters; a `mesh.seq` that does not divide the sequence length, or a model that cannot run
on a piece of it, is an error; the launcher trains with `--config.mesh.seq=2`."""

import functools
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from experiments import launch
from experiments.configs import mqar as mqar_config
from experiments.configs import ode_lm as ode_lm_config
from seqlab.modules.lm import LanguageModel
from seqlab.train import Dataset, Trainer, make_mesh, read_metrics
from seqlab.train import mesh as mesh_lib
from seqlab.train.data import synthetic
from tests.conftest import assert_close

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIZES = dict(batch_size=4, seq_len=16, vocab_size=16, num_kv_pairs=2)
# One block of each kind whose mixer exchanges state between the pieces of the sequence: the
# delta rule ('g'), SSD ('2'), the selective scan ('m'), global and sliding-window attention (a
# window of 5 reaches across the pieces of 8 tokens), each after a causal convolution.
MODEL = LanguageModel(
    vocab_size=16,
    d_model=16,
    pattern="g2mas",
    gdn={"num_heads": 2, "head_dim": 8, "chunk_size": 4},
    mamba2={"d_state": 8, "head_dim": 8, "chunk_size": 4},
    mamba={"d_state": 4},
    attention={"num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "window": 5},
)


def _mqar(rng, step):
    return synthetic.mqar(rng, **SIZES)


@functools.cache
def _params():
    tokens = jnp.zeros((1, SIZES["seq_len"]), jnp.int32)
    return jax.jit(MODEL.init)(jax.random.key(0), tokens)["params"]


def _trainer(mesh, seq_len=SIZES["seq_len"]) -> Trainer:
    # SGD at rate 1: the update is minus the gradient, so comparing parameters compares gradients.
    return Trainer(MODEL, optax.sgd(1.0), Dataset(_mqar, 0, 0), {}, mesh, seq_len=seq_len)


@functools.cache
def _unsharded_step():
    trainer = _trainer(make_mesh(1, 1, devices=jax.devices()[:1]))
    state, metrics = trainer.step(trainer.state_from(_params()), 0)
    return jax.device_get(state.params), metrics


def sharded_forward(model: LanguageModel, mesh):
    """`model`'s forward on pieces of the time axis: cloned with `seq_axis="seq"` inside a
    `shard_map` manual over `seq` (parameters replicated, tokens and logits split along T)."""
    local = model.clone(seq_axis="seq")
    return jax.shard_map(
        lambda params, tokens: local.apply({"params": params}, tokens),
        mesh=mesh,
        in_specs=(P(), P(None, "seq")),
        out_specs=P(None, "seq"),
        axis_names={"seq"},
    )


def test_the_forward_under_shard_map_equals_the_plain_forward():
    mesh = make_mesh(2, 1, 2)
    forward = sharded_forward(MODEL, mesh)
    tokens = mesh_lib.place_batch(Dataset(_mqar, 0, 0).batch(0), mesh_lib.batch_sharding(mesh))
    tokens = tokens["inputs"]
    expected = jax.jit(MODEL.apply)({"params": _params()}, np.asarray(tokens))
    with jax.set_mesh(mesh):
        logits = jax.jit(forward)(_params(), tokens)
    assert_close(logits, expected)


def test_the_delta_family_forward_under_shard_map_equals_the_plain_forward():
    """Kimi Delta Attention ('k'), Gated DeltaNet-2 ('n') and Gated DeltaProduct ('p') on 4
    pieces of 4 tokens (their convolutions' halos span a whole piece)."""
    model = LanguageModel(
        vocab_size=16,
        d_model=16,
        pattern="knp",
        kda={"num_heads": 2, "head_dim": 8, "chunk_size": 4},
        gdn2={"num_heads": 2, "head_dim": 8, "chunk_size": 4},
        gdp={"num_heads": 2, "head_dim": 8, "chunk_size": 4, "num_householder": 2},
    )
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 16)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    mesh = make_mesh(1, 1, 4)
    forward = sharded_forward(model, mesh)
    with jax.set_mesh(mesh):
        logits = jax.jit(forward)(params, tokens)
    assert_close(logits, jax.jit(model.apply)({"params": params}, tokens))


@pytest.mark.parametrize("data, fsdp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_one_training_step_with_mesh_seq_2_equals_the_unsharded_step(data, fsdp):
    """Time over 2 devices and the batch (data) or the parameters (FSDP) over the other 2."""
    expected_params, expected = _unsharded_step()
    trainer = _trainer(make_mesh(data, fsdp, 2))
    state, metrics = trainer.step(trainer.state_from(_params()), 0)
    for key in ("loss", "accuracy", "grad_norm"):
        assert_close(metrics[key], expected[key], err_msg=key)
    assert bool(metrics["finite"]) and int(state.step) == 1
    assert_close(jax.device_get(state.params), expected_params)


def test_mesh_seq_must_divide_the_sequence_length():
    with pytest.raises(ValueError, match=r"mesh\.seq = 2 must divide seq_len = 15"):
        _trainer(make_mesh(2, 1, 2), seq_len=15)
    config = mqar_config.get_config("model=hybrid,runlocal")
    config.mesh.seq, config.data.seq_len = 2, 33
    with pytest.raises(ValueError, match=r"mesh\.seq"):
        launch.build(config)
    config.mesh.seq = 3  # 4 devices: data = -1 cannot fill the rest
    with pytest.raises(ValueError, match=r"mesh\.seq"):
        launch.build(config)


def test_mesh_seq_needs_a_model_that_runs_on_a_piece_of_the_sequence():
    config = ode_lm_config.get_config("runlocal")
    config.mesh.seq = 2
    with pytest.raises(ValueError, match=r"mesh\.seq = 2 needs a model with a seq_axis field"):
        launch.build(config)


def test_launch_with_mesh_seq_2(tmp_path):
    """Two steps of the hybrid MQAR run (Gated DeltaNet and attention) with the time axis split
    in two and the batch over the other two devices."""
    command = [
        sys.executable,
        "-m",
        "experiments.launch",
        f"--workdir={tmp_path}",
        "--config=experiments/configs/mqar.py:model=hybrid,runlocal",
        "--config.mesh.seq=2",
        "--config.total_steps=2",
        "--config.optimizer.warmup_steps=1",
        "--config.log_every=1",
        "--config.eval_every=2",
        "--config.checkpoint_every=2",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in records) and "eval/kv4/loss" in records[-1]
    assert json.loads((tmp_path / "config.json").read_text())["mesh"]["seq"] == 2
