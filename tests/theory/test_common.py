"""Helpers shared by the papers' claims."""

import jax
import numpy as np

from theory.common import numpy_rng


def test_numpy_rng_is_a_function_of_the_key():
    key = jax.random.key(7)
    np.testing.assert_array_equal(numpy_rng(key).random(5), numpy_rng(key).random(5))
    assert not np.array_equal(numpy_rng(key).random(5), numpy_rng(jax.random.key(8)).random(5))
