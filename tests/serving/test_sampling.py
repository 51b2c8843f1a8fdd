"""`seqlab.serving.sample`: greedy ties, the top-k and top-p supports, the distribution against
numpy, per-row keys, and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.serving import sample

DRAWS = 4000
LOGITS = np.log(np.array([0.3, 0.05, 0.2, 0.15, 0.1, 0.12, 0.08]))  # ranks: 0 2 3 5 4 6 1


def _draws(**options) -> np.ndarray:
    """`DRAWS` samples of the row `LOGITS` (one key, split per row)."""
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (DRAWS, LOGITS.size))
    return np.asarray(sample(jax.random.key(0), logits, **options))


def _frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=LOGITS.size) / tokens.size


def _expected(temperature=1.0, top_k=None, top_p=None) -> np.ndarray:
    """The restricted, renormalized softmax by brute force over the sorted probabilities."""
    probs = np.exp(LOGITS / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    kept = list(order[: top_k or probs.size])
    if top_p is not None:
        mass, nucleus = probs[kept].sum(), []
        for token in kept:
            nucleus.append(token)
            if probs[nucleus].sum() / mass >= top_p:
                break
        kept = nucleus
    out = np.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def test_temperature_zero_is_argmax_with_ties_to_the_lowest_id():
    logits = jnp.asarray([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]], jnp.float32)
    tokens = sample(None, logits, temperature=0.0)
    assert tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens, [1, 0])
    # top_k / top_p do not change a greedy choice.
    np.testing.assert_array_equal(sample(None, logits, temperature=0, top_k=1, top_p=0.1), [1, 0])


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(temperature=0.5),
        dict(top_k=3),
        dict(top_p=0.6),
        dict(top_k=4, top_p=0.7, temperature=2.0),
    ],
    ids=str,
)
def test_distribution_and_support(options):
    """Draws never leave the restricted support and their frequencies match it (4000 draws: the
    standard error of a frequency is at most 0.008)."""
    frequencies = _frequencies(_draws(**options))
    expected = _expected(**options)
    assert np.all(frequencies[expected == 0] == 0), (frequencies, expected)
    np.testing.assert_allclose(frequencies, expected, atol=0.03)


def test_top_k_and_top_p_supports():
    assert set(_draws(top_k=2)) == {0, 2}
    assert set(_draws(top_p=0.5)) == {0, 2}  # 0.3 < 0.5 <= 0.3 + 0.2
    assert set(_draws(top_p=0.3)) == {0}
    assert set(_draws(top_k=1, temperature=5.0)) == {0}


def test_row_keys_make_rows_independent_of_the_batch():
    logits = jax.random.normal(jax.random.key(1), (3, 11), jnp.float32)
    keys = jax.random.split(jax.random.key(2), 3)
    batch = sample(keys, logits, top_k=6, top_p=0.9)
    alone = [
        int(sample(keys[b : b + 1], logits[b : b + 1], top_k=6, top_p=0.9)[0]) for b in range(3)
    ]
    np.testing.assert_array_equal(batch, alone)
    # One key is split into one key per row; raw uint32 keys are accepted.
    np.testing.assert_array_equal(sample(jax.random.key(2), logits), sample(keys, logits))
    np.testing.assert_array_equal(sample(jax.random.key_data(keys), logits), sample(keys, logits))


def test_float64_logits():
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]), jnp.float64)
    tokens = sample(jax.random.key(0), logits, top_k=1)
    np.testing.assert_array_equal(tokens, [0, LOGITS.size - 1])


@pytest.mark.parametrize(
    ("args", "options", "name"),
    [
        ((jax.random.key(0), jnp.zeros((2, 5), jnp.int32)), {}, "logits"),
        ((jax.random.key(0), jnp.zeros((5,))), {}, "logits"),
        ((jax.random.key(0), jnp.zeros((2, 5))), dict(temperature=-1.0), "temperature"),
        ((jax.random.key(0), jnp.zeros((2, 5))), dict(temperature=float("nan")), "temperature"),
        ((jax.random.key(0), jnp.zeros((2, 5))), dict(temperature="hot"), "temperature"),
        ((jax.random.key(0), jnp.zeros((2, 5))), dict(top_k=0), "top_k"),
        ((jax.random.key(0), jnp.zeros((2, 5))), dict(top_k=2.0), "top_k"),
        ((jax.random.key(0), jnp.zeros((2, 5))), dict(top_p=0.0), "top_p"),
        ((jax.random.key(0), jnp.zeros((2, 5))), dict(top_p=1.5), "top_p"),
        ((None, jnp.zeros((2, 5))), {}, "key"),
        ((jax.random.split(jax.random.key(0), 3), jnp.zeros((2, 5))), {}, "key"),
        ((jnp.zeros((2,), jnp.float32), jnp.zeros((2, 5))), {}, "key"),
    ],
)
def test_bad_arguments_raise(args, options, name):
    with pytest.raises(ValueError, match=name):
        sample(*args, **options)
