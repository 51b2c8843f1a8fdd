"""Token similarity measures against brute force, their invariances, and errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlab.analysis import similarity
from tests.conftest import assert_close


def _brute(x):
    x = np.asarray(x, np.float64)
    dist = [np.linalg.norm(x[i] - x[j]) for i, j in itertools.combinations(range(len(x)), 2)]
    centered = x - x.mean(0)
    energy = np.mean([np.sum((x[t + 1] - x[t]) ** 2) for t in range(len(x) - 1)])
    return dict(
        channel_range=x.max(0) - x.min(0),
        diameter=max(dist),
        average_pairwise_distance=np.mean(dist),
        dirichlet_energy=energy,
        relative_dirichlet_energy=energy / np.mean(np.sum(centered**2, -1)),
        normalized_diameter=max(dist) / np.sqrt(np.mean(np.sum(centered**2, -1))),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@given(T=st.integers(2, 7), D=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_measures_match_brute_force(dtype, T, D, seed):
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(T, D)), dtype)
    want = _brute(x)
    for name, value in want.items():
        got = getattr(similarity, name)(x)
        assert got.dtype == dtype
        assert_close(got, np.asarray(value, dtype), err_msg=name)


def test_invariances_and_scaling():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 3)))
    shifted, scaled = x + jnp.asarray([1.0, -2.0, 5.0]), 3.0 * x
    for name in ("channel_range", "diameter", "average_pairwise_distance", "dirichlet_energy"):
        f = getattr(similarity, name)
        assert_close(f(shifted), f(x))
        power = 2 if name == "dirichlet_energy" else 1
        assert_close(f(scaled), 3.0**power * f(x))
    for name in ("relative_dirichlet_energy", "normalized_diameter"):
        f = getattr(similarity, name)
        assert_close(f(scaled), f(x))
        assert_close(f(shifted), f(x))
    # Two distinct tokens: diameter 2 r, RMS distance to the mean r.
    assert float(similarity.normalized_diameter(jnp.asarray([[0.0], [3.0]]))) == pytest.approx(2)
    # A smooth sequence has a small relative energy, an alternating one a large one.
    t = jnp.linspace(0.0, 1.0, 32)[:, None]
    # A ramp of T points: step^2 / variance = 12 / (T^2 - 1).
    assert float(similarity.relative_dirichlet_energy(t)) == pytest.approx(12 / (32**2 - 1))
    assert float(similarity.relative_dirichlet_energy((-1.0) ** jnp.arange(32.0)[:, None])) > 3.9


def test_vmap_and_errors():
    xs = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 2)), jnp.float32)
    batched = jax.jit(jax.vmap(similarity.diameter))(xs)
    assert_close(batched, jnp.stack([similarity.diameter(x) for x in xs]))
    with pytest.raises(ValueError, match=r"x must have rank 2 with layout \[T, D\]"):
        similarity.diameter(xs)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        similarity.dirichlet_energy(xs[0, :1])
    with pytest.raises(ValueError, match="floating-point"):
        similarity.channel_range(jnp.ones((3, 2), jnp.int32))
