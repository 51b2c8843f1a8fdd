"""Helpers shared by the claims of several papers."""

import jax
import numpy as np


def numpy_rng(key: jax.Array) -> np.random.Generator:
    """A numpy generator seeded from a jax key (data generation only)."""
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
