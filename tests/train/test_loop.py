"""Tests of seqlab.train.loop, used as a library (no flags, no config files): a run writes its
metrics and checkpoints; SIGTERM stops it at the end of the step with a checkpoint, and resuming
logs exactly the losses of an uninterrupted run; metrics read back every few steps still name
the first non-finite step exactly and no checkpoint follows it; `state_from` leaves the caller's
parameters alive; bad cadences are errors naming the argument."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seqlab.modules.lm import LanguageModel
from seqlab.train import (
    Checkpointer,
    Dataset,
    Trainer,
    make_mesh,
    make_optimizer,
    optimizer_config,
    read_metrics,
)
from seqlab.train.data import synthetic

TOTAL = 6
SIZES = dict(batch_size=8, seq_len=16, vocab_size=16, num_kv_pairs=2)


def _mqar(rng, step):
    return synthetic.mqar(rng, **SIZES)


def _trainer(make=_mqar, tx=None) -> Trainer:
    model = LanguageModel(vocab_size=16, d_model=16, pattern="a", attention={"num_heads": 2})
    tx = tx or make_optimizer(optimizer_config(warmup_steps=1), total_steps=TOTAL)
    evals = {"": Dataset(_mqar, seed=0, stream=1)}
    return Trainer(
        model, tx, Dataset(make, 0, 0), evals, make_mesh(-1, 1), seq_len=SIZES["seq_len"]
    )


RUN = dict(total_steps=TOTAL, seed=0, checkpoint_every=2, log_every=1, eval_every=3, eval_batches=1)


def _losses(workdir):
    return [(r["step"], r["loss"]) for r in read_metrics(workdir)]


def test_a_run_writes_metrics_and_checkpoints(tmp_path):
    assert _trainer().run(str(tmp_path), **RUN) == {"status": "done", "step": TOTAL}
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, TOTAL + 1))
    assert {"eval/loss", "eval/accuracy"} <= set(records[2]) and "eval/loss" not in records[1]
    assert "learning_rate" not in records[0]  # no schedule given
    ckpt = Checkpointer(tmp_path / "checkpoints", every=1, keep=1)
    assert ckpt.latest_step() == TOTAL
    ckpt.close()


def test_sigterm_stops_with_a_checkpoint_and_the_resumed_run_logs_the_same_losses(tmp_path):
    def interrupted(rng, step):
        if step == 2:  # SIGTERM arrives while step 3 is being prepared
            os.kill(os.getpid(), signal.SIGTERM)
        return _mqar(rng, step)

    trainer = _trainer(interrupted)
    assert trainer.run(str(tmp_path / "run"), **RUN) == {"status": "sigterm", "step": 3}
    assert trainer.stop_requested and signal.getsignal(signal.SIGTERM) is not trainer._request_stop
    assert [s for s, _ in _losses(tmp_path / "run")] == [1, 2, 3]
    assert _trainer().run(str(tmp_path / "run"), **RUN)["status"] == "done"
    _trainer().run(str(tmp_path / "reference"), **RUN)
    assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")  # exact


def test_nonfinite_step_is_named_exactly_between_reads_and_no_checkpoint_follows_it(tmp_path):
    """SGD whose learning rate jumps to 1e30 at the fourth update: the parameters blow up and a
    later step is not finite. `Trainer.step` (host metrics every step) finds that step; `run`,
    reading the metrics back only at even steps (saves every 2, logs every 4, evaluations every
    6), names the same odd step."""
    tx = optax.sgd(lambda count: jnp.where(count >= 3, 1e30, 1e-2))
    trainer = _trainer(tx=tx)
    state = trainer.init_state(jax.random.key(0))
    for index in range(TOTAL):
        state, metrics = trainer.step(state, index)
        if not metrics["finite"]:
            break
    bad = index + 1
    assert bad < TOTAL and bad % 2  # not a step that reads back: named from the metrics kept
    run = {**RUN, "log_every": 4, "eval_every": 6}
    assert trainer.run(str(tmp_path), **run) == {"status": "nonfinite", "step": bad}
    ckpt = Checkpointer(tmp_path / "checkpoints", every=1, keep=1)
    assert ckpt.latest_step() == bad - 1
    ckpt.close()


def test_state_from_copies_the_parameters_the_steps_donate():
    trainer = _trainer()
    params = trainer.init_state(jax.random.key(0)).params
    before = jax.device_get(params)
    state = trainer.state_from(params)
    state, metrics = trainer.step(state, 0)
    assert int(state.step) == 1 and np.isfinite(metrics["loss"])
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # still alive and unchanged


@pytest.mark.parametrize("key", ["total_steps", "log_every", "eval_batches"])
def test_bad_cadence_raises_naming_the_argument(tmp_path, key):
    with pytest.raises(ValueError, match=f"{key} must be a positive int"):
        _trainer().run(str(tmp_path), **{**RUN, key: 0})
    assert not (tmp_path / "checkpoints").exists()
