"""The properties behind the claims: eigenvalue signs and rank of M = S_C^T S_B (sign
constraint), and the token-ODE behaviours (convergence, blow-up, slow divergence, 2-D cases)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqlab.dynamics import mamba_ode
from seqlab.modules.mamba import Mamba
from theory.mamba_dynamics import measures, train

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


# -- the 1-D criterion: mixed signs, the dichotomy ----------------------------------------------


def test_scenario_and_blowup_bound():
    x = np.float32([-0.7, 0.9, -1.1])
    assert measures.scenario_1d(-1.0, 1.0, x) == "converges"
    assert measures.scenario_1d(1.0, 1.0, x) == "fast"  # s x_2 > 0
    assert measures.scenario_1d(1.0, -1.0, -np.abs(x)) == "fast"
    assert measures.scenario_1d(1.0, 1.0, -np.abs(x)) == "slow"
    with pytest.raises(ValueError, match="x0"):
        measures.scenario_1d(1.0, 1.0, np.float32([0.5, 0.0]))
    # T* depends on |x0| and s sign(x0) only; inf where s x0 <= 0 or mu <= 0.
    assert measures.blowup_time(1.3, 0.7, -0.6) == math.inf
    assert measures.blowup_time(-1.3, 0.7, 0.6) == math.inf
    assert measures.blowup_time(1.3, -0.7, -0.6) == pytest.approx(
        measures.blowup_time(1.3, 0.7, 0.6)
    )
    # A larger start blows up sooner; the bound is the smallest T* of the positive tokens.
    assert measures.blowup_time(1.3, 0.7, 1.2) < measures.blowup_time(1.3, 0.7, 0.6)
    bound = measures.blowup_bound(1.3, 0.7, np.float32([-2.0, 0.6, 1.2]))
    assert bound == pytest.approx(measures.blowup_time(1.3, 0.7, float(np.float32(1.2))))
    assert measures.blowup_bound(1.3, 0.7, np.float32([-2.0, -0.6])) == math.inf
    with pytest.raises(ValueError, match="one sign"):
        measures.time_to_reach(1.0, 1.0, 0.5, -1.0)


def test_draws_put_the_first_positive_token_at_l0_and_cycle_the_scenarios():
    mu, s, _, x0, l0 = measures.first_positive_draws(jax.random.key(5), 6, 5)
    positive = s[:, None] * x0 > 0
    assert np.all(mu > 0) and np.all((l0 >= 2) & (l0 <= 5))
    assert np.all(np.argmax(positive, axis=1) + 1 == l0)
    mu, s, _, x0 = measures.scenario_draws(jax.random.key(6), 9, 4)
    got = [measures.scenario_1d(*args) for args in zip(mu, s, x0, strict=True)]
    assert got == list(measures.SCENARIOS) * 3


def test_mixed_signs_blow_up_within_the_bound_and_the_prefix_diverges_slowly():
    mu, s, a, x0, l0 = measures.first_positive_draws(jax.random.key(7), 2, 3)
    for m, ss, aa, x, first in zip(mu, s, a, x0, l0, strict=True):
        seen = measures.observe_1d(m, ss, aa, x, 1e4)
        assert seen["label"] == "blows_up" and seen["monotone"] == "up"
        assert seen["t_blowup"] <= measures.blowup_bound(m, ss, x) * (1 + 1e-3)
        prefix = np.where(np.arange(3) < first - 1, x, 0.0)
        before = measures.observe_1d(m, ss, aa, prefix, 1e4)
        assert before["label"] == "diverges" and before["ratio"].size == first - 1


def test_observe_tells_the_scenarios_apart():
    # Negative controls of the blow-up test: the same x0 without a positive token (slow) or with
    # mu < 0 gives no blow-up.
    x = np.float32([-0.8, -1.2, 0.9])
    assert measures.observe_1d(1.2, 0.9, 1.0, x, 1e4)["label"] == "blows_up"
    slow = measures.observe_1d(1.2, 0.9, 1.0, -np.abs(x), 1e4)
    assert slow["label"] == "diverges" and slow["monotone"] == "up" and np.isnan(slow["t_blowup"])
    down = measures.observe_1d(-1.2, 0.9, 1.0, x, 1e4)
    assert down["label"] == "converges" and down["monotone"] == "down"


# -- higher dimensions -------------------------------------------------------------------------


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_definite_field_has_a_definite_symmetric_part(sign):
    field = measures.definite_field(jax.random.key(8), 4, sign)
    m = np.asarray(field.M, np.float64)
    assert np.all(sign * np.linalg.eigvalsh((m + m.T) / 2) >= 0.5 - 1e-5)
    assert np.linalg.norm(m - m.T) > 0.1  # not symmetric
    with pytest.raises(ValueError, match="sign"):
        measures.definite_field(jax.random.key(8), 4, 0.5)


def test_negative_definite_decays_like_inverse_sqrt_and_an_indefinite_one_does_not():
    ts = measures.save_times(1e6)
    field = measures.definite_field(jax.random.key(0), 3, -1.0)
    x0 = jax.random.normal(jax.random.key(10), (4, 3), jnp.float32)
    ratio, exponent = measures.decay_summary(measures.token_norms(x0, field, ts, 30.0))
    assert np.all(ratio <= 0.1) and np.all(np.abs(exponent + 0.5) <= 0.05)
    # Negative control: flip one eigenvalue of sym(M) to positive: the same check fails.
    m = np.asarray(field.M, np.float64)
    w, v = np.linalg.eigh((m + m.T) / 2)
    w[-1] = -w[-1]
    indefinite = field._replace(M=jnp.asarray(v @ np.diag(w) @ v.T + (m - m.T) / 2, jnp.float32))
    ratio, exponent = measures.decay_summary(measures.token_norms(x0, indefinite, ts, 30.0))
    assert not (np.all(ratio <= 0.1) and np.all(np.abs(exponent + 0.5) <= 0.05))


def test_positive_definite_first_token_norm_does_not_decrease():
    field = measures.definite_field(jax.random.key(1), 3, 1.0)
    x0 = jax.random.normal(jax.random.key(11), (4, 3), jnp.float32)
    first = measures.token_norms(x0, field, measures.save_times(1e6), 30.0)
    dense = measures.dense_times(first["t_end"])
    assert measures.norm_x1_min_step(measures.token_norms(x0, field, dense, 30.0)) >= -1e-6


def test_norm_and_decay_helpers_on_known_curves():
    ts = np.geomspace(1e-3, 1e6, 41)
    norms = np.stack([2 * ts**-0.5, 3 * ts**-0.5], axis=1) + 0.0
    norms[0] = [4.0, 5.0]
    ratio, exponent = measures.decay_summary(dict(ts=ts, norms=norms))
    np.testing.assert_allclose(ratio, [2e-3 / 4, 3e-3 / 5])
    np.testing.assert_allclose(exponent, -0.5, atol=1e-9)
    rising = dict(norms=np.array([[1.0, 5.0], [1.5, 1.0], [np.inf, np.inf]]))
    assert measures.norm_x1_min_step(rising) == pytest.approx(0.5)
    assert measures.norm_x1_min_step(dict(norms=np.array([[1.0], [0.5]]))) == pytest.approx(-0.5)
    stopped = dict(ts=ts[:3], norms=np.array([[1.0], [2.0], [np.inf]]))
    assert np.isnan(measures.decay_summary(stopped)[0]).all()


# -- the refinements' decision rule and training --------------------------------------------------


def test_compare_decides_as_stated():
    chance = 0.1
    assert train.compare([0.3, 0.35, 0.32], [0.4, 0.41, 0.36], chance)["decision"] == "holds"
    # Negative control: the baseline better -> fails.
    out = train.compare([0.4, 0.41, 0.36], [0.3, 0.35, 0.32], chance)
    assert out["decision"] == "fails" and out["mean_difference"] < 0 and out["pairs_won"] == 0
    assert train.compare([0.3, 0.4, 0.35], [0.33, 0.42, 0.36], chance)["decision"] == "inconclusive"
    assert (
        train.compare([0.1, 0.12, 0.11], [0.13, 0.14, 0.12], chance)["decision"] == "inconclusive"
    )
    assert train.compare([1.0] * 3, [1.0] * 3, chance)["decision"] == "inconclusive"
    with pytest.raises(ValueError, match="S >= 3"):
        train.compare([0.3, 0.4], [0.5, 0.6], chance)


@pytest.mark.slow
def test_train_arm_seeds_train_as_alone():
    small = train.Setup(8, 8, 1, 8, 1, 2, 4, 5, 1e-2, 1, seeds=(0, 1, 2))
    together = train.train_arm(small, "reorder")
    alone = train.train_arm(dataclasses.replace(small, seeds=(1,)), "reorder")
    assert together["accuracy"].shape == (3,) and together["train_loss"].shape == (3, 5)
    np.testing.assert_allclose(together["train_loss"][1], alone["train_loss"][0], rtol=1e-4)
    np.testing.assert_allclose(together["loss"][1], alone["loss"][0], rtol=1e-4)
    with pytest.raises(ValueError, match="arm"):
        train.model_block(small, "unknown")
