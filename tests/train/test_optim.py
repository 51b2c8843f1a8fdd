"""Tests of seqlab.train.optim's `trainable` restriction (LoRA fine-tuning): frozen parameters stay
bit-identical through AdamW with weight decay and clipping, the trained ones move exactly as the
same optimizer on them alone would move them, and a pattern matching nothing is an error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seqlab.train.optim import make_optimizer, optimizer_config, param_path
from tests.conftest import assert_close


def _opt(trainable: str):
    # grad_clip small: clipping is active, so the clipped norm must be the LoRA one.
    return optimizer_config(
        learning_rate=1e-2, schedule="constant", warmup_steps=0, grad_clip=0.5, trainable=trainable
    )


def _params(rng):
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    return {
        "wq": {"A": normal(3, 4), "B": normal(4), "lora_u": normal(4, 2), "lora_v": normal(5, 2)},
        "embedding": {"embedding": normal(6, 4)},
        "blocks": [{"lora_u": normal(2)}, {"w": normal(2)}],
    }


@functools.partial(jax.jit, static_argnums=0)
def _run(tx, params, grads_seq):
    """`params` after one update of `tx` per gradient of `grads_seq`."""
    state = tx.init(params)
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def test_only_the_matching_parameters_move_and_frozen_ones_are_bit_identical():
    rng = np.random.default_rng(0)
    params = _params(rng)
    grads_seq = [
        jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
        for _ in range(3)
    ]
    trained = _run(make_optimizer(_opt("lora"), total_steps=10), params, grads_seq)

    flat = {param_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(trained)}
    before = {param_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
    assert set(flat) == {
        "wq/A",
        "wq/B",
        "wq/lora_u",
        "wq/lora_v",
        "embedding/embedding",
        "blocks/0/lora_u",
        "blocks/1/w",
    }
    lora = sorted(k for k in flat if "lora" in k)
    for name, value in flat.items():
        if name in lora:
            assert not np.array_equal(value, before[name]), name
        else:
            np.testing.assert_array_equal(value, before[name], err_msg=name)  # bit-identical

    # The trained parameters move exactly as the same optimizer on them alone moves them
    # (clipping, moments and weight decay see only them).
    def subset(tree):
        leaves = {param_path(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}
        return {k: leaves[k] for k in lora}

    alone = _run(
        make_optimizer(_opt(""), total_steps=10), subset(params), [subset(g) for g in grads_seq]
    )
    assert_close(subset(trained), alone)


def test_a_pattern_matching_nothing_raises():
    tx = make_optimizer(_opt("adapter"), total_steps=10)
    with pytest.raises(ValueError, match=r"optimizer\.trainable = 'adapter' matches no parameter"):
        tx.init(_params(np.random.default_rng(0)))
