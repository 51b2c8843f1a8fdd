"""The property behind the sign-constraint claim: eigenvalue signs and rank of M = S_C^T S_B."""

import jax
import numpy as np
import pytest

from seqlab.modules.mamba import Mamba
from theory.mamba_dynamics import claims

D_MODEL, N, INITS = 4, 3, 6  # d_inner = 8 > N, so rank <= N is a real constraint


def _summary(constraint, seed):
    model = Mamba(d_model=D_MODEL, d_state=N, sign_constraint=constraint)
    return claims.spectrum_summary(claims.interaction_matrices(model, jax.random.key(seed), INITS))


def test_spectrum_summary_on_known_matrices():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(2, 5))
    psd = s.T @ np.diag([2.0, 0.5]) @ s  # rank 2, positive semidefinite
    indefinite = s.T @ np.diag([2.0, -0.5]) @ s
    out = claims.spectrum_summary(np.stack([psd, indefinite, -psd]))
    np.testing.assert_array_equal(out["rank"], [2, 2, 2])
    assert out["eig"][0].min() >= -claims.REL_TOL
    assert out["eig"][1].min() < -claims.REL_TOL < claims.REL_TOL < out["eig"][1].max()
    assert out["eig"][2].max() <= claims.REL_TOL
    np.testing.assert_allclose(out["asymmetry"], 0.0, atol=1e-15)


@pytest.mark.parametrize(("constraint", "seed"), [("pos", 0), ("neg", 1), ("mixed", 2)])
def test_sign_constraints_give_the_stated_signs(constraint, seed):
    out = _summary(constraint, seed)
    eig = out["eig"]  # [INITS, d_inner], scaled by ||M||_2
    assert np.all(out["rank"] <= N)
    assert np.all(out["asymmetry"] <= 1e-5)
    positive, negative = eig > claims.REL_TOL, eig < -claims.REL_TOL
    if constraint == "pos":
        assert not negative.any() and np.all(positive.sum(1) == N)
    elif constraint == "neg":
        assert not positive.any() and np.all(negative.sum(1) == N)
    else:  # lambda has N - N // 2 positive and N // 2 negative entries
        assert np.all(positive.sum(1) == N - N // 2) and np.all(negative.sum(1) == N // 2)


def test_unconstrained_interaction_is_indefinite():
    # Without the constraint M is not symmetric and its symmetric part has both signs: the sign
    # checks above can fail.
    out = _summary(None, 3)
    assert np.all(out["asymmetry"] > 0.1)
    assert np.all(out["eig"].min(1) < -claims.REL_TOL) and np.all(
        out["eig"].max(1) > claims.REL_TOL
    )
    assert np.all(out["rank"] <= N)  # rank(S_C^T S_B) <= N holds for any x_proj
