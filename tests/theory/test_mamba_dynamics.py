"""The properties behind the claims: eigenvalue signs and rank of M = S_C^T S_B (sign
constraint), and the token-ODE behaviours (convergence, blow-up, slow divergence, 2-D cases)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqlab.dynamics import mamba_ode
from seqlab.modules.mamba import Mamba
from theory.mamba_dynamics import measures

D_MODEL, N, INITS = 4, 3, 6  # d_inner = 8 > N, so rank <= N is a real constraint


def _summary(constraint, seed):
    model = Mamba(d_model=D_MODEL, d_state=N, sign_constraint=constraint)
    return measures.spectrum_summary(
        measures.interaction_matrices(model, jax.random.key(seed), INITS)
    )


def test_spectrum_summary_on_known_matrices():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(2, 5))
    psd = s.T @ np.diag([2.0, 0.5]) @ s  # rank 2, positive semidefinite
    indefinite = s.T @ np.diag([2.0, -0.5]) @ s
    out = measures.spectrum_summary(np.stack([psd, indefinite, -psd]))
    np.testing.assert_array_equal(out["rank"], [2, 2, 2])
    assert out["eig"][0].min() >= -measures.REL_TOL
    assert out["eig"][1].min() < -measures.REL_TOL < measures.REL_TOL < out["eig"][1].max()
    assert out["eig"][2].max() <= measures.REL_TOL
    np.testing.assert_allclose(out["asymmetry"], 0.0, atol=1e-15)


@pytest.mark.parametrize(("constraint", "seed"), [("pos", 0), ("neg", 1), ("mixed", 2)])
def test_sign_constraints_give_the_stated_signs(constraint, seed):
    out = _summary(constraint, seed)
    eig = out["eig"]  # [INITS, d_inner], scaled by ||M||_2
    assert np.all(out["rank"] <= N)
    assert np.all(out["asymmetry"] <= 1e-5)
    positive, negative = eig > measures.REL_TOL, eig < -measures.REL_TOL
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
    assert np.all(out["eig"].min(1) < -measures.REL_TOL) and np.all(
        out["eig"].max(1) > measures.REL_TOL
    )
    assert np.all(out["rank"] <= N)  # rank(S_C^T S_B) <= N holds for any x_proj


# -- token dynamics: the properties behind the ODE claims, at small size ------------------------

_SMALL = dict(t1=1e4)


@settings(max_examples=4)
@given(
    mu=st.floats(0.5, 2.0),
    s=st.floats(0.5, 2.0),
    a=st.floats(0.5, 2.0),
    x0=st.lists(st.floats(0.5, 1.5), min_size=3, max_size=3),
    signs=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_negative_mu_converges_like_one_over_sqrt_t(mu, s, a, x0, signs):
    x = np.where(signs, 1.0, -1.0) * np.asarray(x0)
    run = measures.solve_1d(-mu, s, a, x.astype(np.float32), _SMALL["t1"])
    mag = np.abs(run["xs"])
    assert run["ok"] and not run["blew_up"]
    assert np.all(np.diff(mag, axis=0) <= 1e-6 * mag[:-1])  # every |x_l| non-increasing
    assert np.all(np.sign(run["xs"]) == np.sign(x))  # each token keeps its sign
    # sqrt(t) x_1 -> sign / sqrt(2 |mu| ln 2); at t = 1e4 the O(t^-1/2) correction is < 3%.
    got = math.sqrt(run["ts"][-1]) * run["xs"][-1, 0]
    assert got == pytest.approx(np.sign(x[0]) * measures.convergence_limit(mu), rel=3e-2)


def test_convergence_limit_fails_for_the_wrong_sign():
    # The same check on a positive mu: the tokens grow, so sqrt(t) x_1 cannot approach the limit.
    run = measures.solve_1d(1.0, -1.0, 1.0, np.float32([0.7, 0.9, 1.1]), 1e4, max_norm=1e6)
    assert abs(run["xs"][-1, 0]) > 0.7


@settings(max_examples=4)
@given(mu=st.floats(0.5, 2.0), s=st.floats(0.5, 2.0), x0=st.floats(0.5, 1.5))
def test_blow_up_time_matches_the_quadrature(mu, s, x0):
    run = measures.solve_1d(mu, s, 1.0, np.float32([x0]), 1e3)
    t_star = measures.time_to_reach(mu, s, x0, math.inf)
    assert run["blew_up"] and run["ok"]
    assert run["t_end"] == pytest.approx(t_star, rel=1e-3)


def test_time_to_reach_matches_closed_form_pieces():
    # For s -> 0 softplus(s y) -> ln 2, and t(x) = (x0^-2 - x^-2) / (2 mu ln 2).
    mu, x0, x = 1.3, 0.6, 4.0
    want = (x0**-2 - x**-2) / (2 * mu * math.log(2))
    assert measures.time_to_reach(mu, 1e-9, x0, x) == pytest.approx(want, rel=1e-6)
    assert measures.time_to_reach(mu, 1e-9, x, x0) == pytest.approx(-want, rel=1e-6)


def test_slow_divergence_has_no_blow_up_and_follows_the_quadrature():
    mu, s, a = 1.2, 0.8, 1.0
    x = -np.float32([0.7, 1.0, 1.3])
    run = measures.solve_1d(mu, s, a, x, 1e4, max_norm=1e6)
    assert run["ok"] and not run["blew_up"]
    mag = np.abs(run["xs"])
    assert np.all(np.diff(mag, axis=0) >= -1e-6 * mag[:-1])  # |x_l| non-decreasing
    back = measures.time_to_reach(mu, s, float(x[0]), float(run["xs"][-1, 0]))
    assert back == pytest.approx(run["ts"][-1], rel=1e-3)
    assert mag[-1, 0] < 3 * math.log(1e4) / s  # logarithmic, far from any blow-up


@pytest.mark.parametrize(("constraint", "expected"), [("pos", "diverges"), ("neg", "converges")])
def test_definite_two_d_fields_from_mamba(constraint, expected):
    field = measures.mamba_2d_field(constraint, jax.random.key(3))
    eig = np.linalg.eigvalsh(np.asarray(field.M))
    assert np.all(eig > 0) if constraint == "pos" else np.all(eig < 0)
    x0 = jax.random.normal(jax.random.key(4), (3, 2))
    traj = mamba_ode.integrate(x0, field, t1=1e6, ts=jnp.geomspace(1e-3, 1e6, 20))
    assert bool(traj.ok)
    assert measures.classify(np.asarray(traj.xs, np.float64), bool(traj.blew_up)) == expected


def test_classify_detects_each_case():
    grow = np.stack([np.full((2, 2), v) for v in (1.0, 5.0, 20.0)])
    assert measures.classify(grow, False) == "diverges"
    assert measures.classify(grow[::-1], False) == "converges"
    assert measures.classify(np.ones((3, 2, 2)), False) == "neither"
    assert measures.classify(np.ones((3, 2, 2)), True) == "diverges"


def test_residual_stack_of_the_module_converges_to_the_ode():
    model, params = measures.scalar_decay_mamba(2, jax.random.key(6))
    x0 = 0.5 * jax.random.normal(jax.random.key(7), (4, model.d_inner), jnp.float32)
    field = mamba_ode.field_from_mamba(model, params)
    exact = mamba_ode.integrate(x0, field, t1=1.0, ts=jnp.ones((1,), jnp.float32)).xs[0]
    errors = [
        float(jnp.max(jnp.abs(measures.residual_stack(model, params, x0, 1 / n, n) - exact)))
        for n in (8, 16, 32)
    ]
    assert 1.7 <= errors[0] / errors[1] <= 2.3 and 1.7 <= errors[1] / errors[2] <= 2.3
    # The ODE of another module is not the limit: the error stays put as tau shrinks.
    other = mamba_ode.field_from_mamba(*measures.scalar_decay_mamba(2, jax.random.key(8)))
    wrong = mamba_ode.integrate(x0, other, t1=1.0, ts=jnp.ones((1,), jnp.float32)).xs[0]
    far = float(jnp.max(jnp.abs(measures.residual_stack(model, params, x0, 1 / 32, 32) - wrong)))
    assert far > 10 * errors[2]


def test_one_d_draws_ranges_and_save_times():
    mu, s, a, x0 = measures.one_d_draws(jax.random.key(2), 5, 3, sign=-1.0)
    assert mu.shape == s.shape == a.shape == (5,) and x0.shape == (5, 3)
    assert np.all((mu >= -2.0) & (mu <= -0.5)) and np.all((s >= 0.5) & (s <= 2.0))
    assert np.all((np.abs(x0) >= 0.5) & (np.abs(x0) <= 1.5)) and x0.dtype == np.float32
    ts = measures.save_times(1e4)
    assert ts.shape == (measures.SAVES,) and ts[0] == np.float32(1e-3) and ts[-1] == np.float32(1e4)
    assert np.all(np.diff(np.log(ts)) > 0)
    field = measures.one_d_field(-1.0, 2.0, 0.5)
    assert field.M.shape == field.S_delta.shape == (1, 1) and field.a.shape == (1,)
