"""`seqlab.ops._delta.solve_unit_lower`, the blocked forward substitution of the chunked delta
rule, against LAPACK's triangular solve (`jax.scipy.linalg.solve_triangular`): values, reverse
and forward derivatives, any chunk size (padded to whole 16-row blocks inside), and the matrices
of correlated keys with write strengths near 1 (where `I + L` is far from the identity)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import solve_triangular

from seqlab.ops._delta import solve_unit_lower
from tests.conftest import assert_close
from tests.ops.trained_like import correlated_keys


def reference(a, rhs):
    """`(I + strict_lower(a))^{-1} rhs` by LAPACK."""
    c = a.shape[-1]
    return solve_triangular(jnp.tril(a, -1) + jnp.eye(c, dtype=a.dtype), rhs, lower=True)


def erase_matrix(c: int, cosine: float, beta: float, dtype, seed: int = 0):
    """`beta k_i^T k_j`, `[2, C, C]`, of unit keys with neighbouring cosine `cosine`."""
    rng = np.random.default_rng(seed)
    k = correlated_keys(rng, (2, c, 1, 16), cosine)[:, :, 0]
    return jnp.asarray(beta * np.einsum("bik,bjk->bij", k, k), dtype)


# Below one block, one block and a part, the default chunk; one block and other sizes: -m slow.
@pytest.mark.parametrize(
    "c", [5, 20, 64, *(pytest.param(c, marks=pytest.mark.slow) for c in (1, 16, 37))]
)
def test_values_and_derivatives_match_lapack_float64(c):
    rng = np.random.default_rng(c)
    a = jnp.asarray(rng.normal(size=(2, c, c)) / np.sqrt(c))
    rhs = jnp.asarray(rng.normal(size=(2, c, 3)))
    assert_close(solve_unit_lower(a, rhs), reference(a, rhs))
    cot = jnp.asarray(rng.normal(size=(2, c, 3)))
    ours = jax.vjp(solve_unit_lower, a, rhs)[1](cot)
    theirs = jax.vjp(reference, a, rhs)[1](cot)
    for x, y in zip(ours, theirs, strict=True):
        assert_close(x, y)
    tangents = (jnp.asarray(rng.normal(size=a.shape)), jnp.asarray(rng.normal(size=rhs.shape)))
    assert_close(
        jax.jvp(solve_unit_lower, (a, rhs), tangents)[1],
        jax.jvp(reference, (a, rhs), tangents)[1],
    )


@pytest.mark.parametrize("cosine", [0.9, 0.99])
def test_correlated_keys_and_beta_near_one_in_float32(cosine):
    """float32 against the float64 LAPACK solve on a trained-like chunk: the blocked substitution
    is as accurate as forward substitution (no explicit inverse, no matrix powers)."""
    a64 = erase_matrix(64, cosine, 0.99, jnp.float64)
    rhs64 = jnp.asarray(np.random.default_rng(1).normal(size=(2, 64, 8)))
    expected = reference(a64, rhs64)
    actual = solve_unit_lower(a64.astype(jnp.float32), rhs64.astype(jnp.float32))
    assert actual.dtype == jnp.float32
    assert_close(actual, expected, jnp.float32)
