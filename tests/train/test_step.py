"""Tests of seqlab.train.step and seqlab.train.optim: the masked loss against a numpy brute
force in float32 and float64, the update against optax by hand, the non-finite guard, schedules,
errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seqlab.modules.lm import preset
from seqlab.train.data import IGNORE
from seqlab.train.optim import make_optimizer, make_schedule, optimizer_config
from seqlab.train.step import create_state, eval_step, means, scored_sums, train_step
from tests.conftest import assert_close


def _opt(**overrides):
    return optimizer_config(
        **{"learning_rate": 1e-2, "schedule": "constant", "warmup_steps": 0, **overrides}
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_scored_sums_match_brute_force(dtype):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 5, 7)) * 3
    targets = rng.integers(0, 7, (3, 5))
    targets[rng.random((3, 5)) < 0.4] = IGNORE
    sums = scored_sums(jnp.asarray(logits, dtype), jnp.asarray(targets, jnp.int32))
    loss, correct, count = 0.0, 0, 0
    for b in range(3):
        for t in range(5):
            if targets[b, t] == IGNORE:
                continue
            row = logits[b, t]
            loss += np.log(np.sum(np.exp(row - row.max()))) + row.max() - row[targets[b, t]]
            correct += int(np.argmax(row) == targets[b, t])
            count += 1
    assert_close(sums["loss_sum"], np.asarray(loss, dtype))
    assert float(sums["correct"]) == correct and float(sums["count"]) == count
    assert means(sums) == pytest.approx(
        {"loss": loss / count, "accuracy": correct / count}, rel=1e-5
    )


@functools.cache
def _tiny_state():
    """A float64 tiny Mamba and its train state (initialized under jit: eager init is slow)."""
    model = preset("tiny-mamba", dtype=jnp.float64, param_dtype=jnp.float64)
    tx = make_optimizer(_opt(), total_steps=10)
    init = jax.jit(functools.partial(create_state, model, tx, seq_len=6))
    return model, init(jax.random.key(0))


def _batch(vocab: int):
    rng = np.random.default_rng(1)
    targets = rng.integers(0, vocab, (2, 6)).astype(np.int32)
    targets[:, :2] = IGNORE
    return {
        "inputs": jnp.asarray(rng.integers(0, vocab, (2, 6)), jnp.int32),
        "targets": jnp.asarray(targets),
    }


def test_train_step_is_one_optax_update_of_the_masked_mean_loss():
    model, state = _tiny_state()
    batch = _batch(model.vocab_size)

    def loss(params):
        sums = eval_step(model.apply, params, batch)
        return sums["loss_sum"] / sums["count"]

    @jax.jit
    def by_hand(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, _ = state.tx.update(grads, opt_state, params)
        return value, grads, optax.apply_updates(params, updates)

    value, grads, expected = by_hand(state.params, state.opt_state)
    new, metrics = jax.jit(train_step)(state, batch)
    assert_close(new.params, expected)
    assert_close(metrics["loss"], value)
    assert_close(metrics["grad_norm"], optax.tree.norm(grads))
    assert bool(metrics["finite"]) and int(new.step) == 1


def test_train_step_skips_a_non_finite_update():
    model, state = _tiny_state()
    params = jax.tree.map(lambda x: x, state.params)
    params["embedding"]["embedding"] = params["embedding"]["embedding"].at[0, 0].set(jnp.nan)
    state = state.replace(params=params)
    batch = _batch(model.vocab_size)
    batch["inputs"] = batch["inputs"].at[0, 0].set(0)  # reads the NaN row
    new, metrics = jax.jit(train_step)(state, batch)
    assert not bool(metrics["finite"])
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_schedules():
    warm = make_schedule(_opt(warmup_steps=4), total_steps=10)
    assert [float(warm(s)) for s in (0, 2, 4, 9)] == pytest.approx([0, 5e-3, 1e-2, 1e-2])
    cos = make_schedule(_opt(schedule="cosine", warmup_steps=2), total_steps=12)
    assert float(cos(2)) == pytest.approx(1e-2)
    assert float(cos(7)) == pytest.approx(1e-3 + (1e-2 - 1e-3) * 0.5, rel=1e-5)
    assert float(cos(12)) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(name="lion"), "optimizer.name"),
        (dict(schedule="step"), "optimizer.schedule"),
        (dict(learning_rate=0.0), "optimizer.learning_rate"),
        (dict(warmup_steps=-1), "optimizer.warmup_steps"),
        (dict(schedule="cosine", warmup_steps=10), "optimizer.warmup_steps"),
        (dict(grad_clip=-1.0), "optimizer.grad_clip"),
    ],
)
def test_bad_optimizer_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_optimizer(_opt(**overrides), total_steps=10)


def test_optimizer_config_defaults_and_unknown_keys():
    config = optimizer_config(learning_rate=0.5)
    assert config.learning_rate == 0.5 and config.name == "adamw" and config.trainable == ""
    with pytest.raises(ValueError, match=r"unknown keys \['lr'\]"):
        optimizer_config(lr=0.5)
