"""The properties behind the claims, on a tiny Mamba and a tiny SSM stack: they hold where the
paper says and the same measurements detect their absence elsewhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from seqlab.analysis import rates, similarity
from seqlab.modules.mamba import Mamba
from theory.ssm_bottleneck import claims, measures

T = 24


@pytest.fixture(scope="module")
def polarized():
    """Influence, step sizes and A of a random `Mamba(polarize=(1, 1))`, N = 1 + 2 + 1."""
    model = Mamba(d_model=4, d_state=2, polarize=(1, 1))
    params, x = measures.init_with_input(model, jax.random.key(0), T)
    infl, dt, A = (
        np.asarray(v, np.float64) for v in measures.influence_and_steps(model, params, x)
    )
    rho, dt_r, _ = (
        np.asarray(v, np.float64) for v in measures.retention_and_steps(model, params, x)
    )
    return dict(model=model, infl=infl, dt=dt, A=A, rho=rho, dt_r=dt_r)


def _rates(infl, dt, width):
    """Fitted decay rate per state channel, as the claim computes it."""
    s = np.arange(T - width + 1)
    tau = measures.elapsed(dt, s + width).T
    window = infl[:, :, s]
    valid = window > measures.UNDERFLOW
    log_w = np.log(np.where(valid, window, 1.0))
    return np.array(
        [-rates.pooled_slope(tau, log_w[:, n], valid[:, n]) for n in range(infl.shape[1])]
    )


def test_elapsed_is_the_step_size_still_to_come():
    dt = np.arange(1.0, 5.0)[:, None] * np.ones((1, 2))  # [T=4, d=2]: 1, 2, 3, 4
    np.testing.assert_array_equal(measures.elapsed(dt, np.array([0, 2, 4, 9]))[:, 0], [10, 7, 0, 0])


def test_smoothing_curves_are_scale_free_where_the_measure_is():
    xs = np.random.default_rng(2).normal(size=(3, 6, 4))
    got, scaled = measures.smoothing_curves(xs), measures.smoothing_curves(1e-3 * xs)
    np.testing.assert_allclose(scaled["diameter"], 1e-3 * got["diameter"], rtol=1e-5)
    np.testing.assert_allclose(
        scaled["dirichlet_energy"], 1e-6 * got["dirichlet_energy"], rtol=1e-5
    )
    np.testing.assert_allclose(
        scaled["relative_dirichlet_energy"], got["relative_dirichlet_energy"], rtol=1e-5
    )
    np.testing.assert_allclose(got["linf_diameter"], np.ptp(xs, axis=1).max(axis=1), rtol=1e-6)


def test_influence_is_causal_and_carried_by_the_one_channel(polarized):
    infl, A = polarized["infl"], polarized["A"]
    assert A[0, 0] == 0.0 and A[0, -1] == -100.0
    rates = _rates(infl, polarized["dt"], polarized["model"].conv_size)
    assert abs(rates[0]) <= 0.25  # 1-channel: no decay
    np.testing.assert_allclose(rates[1:3], -A[0, 1:3], rtol=0.25)  # learnable: rate |A_n|
    assert rates[-1] > 50  # 0-channel: fast decay (rate 100 up to the fit)


def test_unpolarized_channels_do_decay():
    # The same measurement on a plain Mamba: its first state channel (A = -1) is not a 1-channel.
    model = Mamba(d_model=4, d_state=2)
    params, x = measures.init_with_input(model, jax.random.key(1), T)
    infl, dt, A = (
        np.asarray(v, np.float64) for v in measures.influence_and_steps(model, params, x)
    )
    rates = _rates(infl, dt, model.conv_size)
    assert A[0, 0] == -1.0
    assert rates[0] > 0.5  # would fail the 1-channel criterion |rate| <= 0.25
    np.testing.assert_allclose(rates, -A[0], rtol=0.25)


def test_one_step_retention_is_the_transition(polarized):
    rho, dt, A = polarized["rho"], polarized["dt_r"], polarized["A"]  # rho: [T, d, N]
    np.testing.assert_allclose(rho, np.exp(dt[:, :, None] * A[None]), rtol=1e-5, atol=1e-7)
    assert np.all(rho[..., 0] == 1.0)  # the 1-channel keeps all of its state
    zero = rho[..., -1]
    dt_star = np.log(1 / claims.FORGET) / 100.0
    assert np.all(zero[dt >= dt_star * 1.01] <= claims.FORGET)
    assert np.all(zero[dt <= dt_star * 0.99] > claims.FORGET)
    # A weak "zero" channel (A = -1) never forgets in one step at these step sizes.
    assert np.all(rho[..., 1] > 0.5)


# -- recency and over-smoothing -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack_layers():
    return measures.stack_layers(jax.random.key(5), 4, 3)


@settings(max_examples=6)
@given(seed=st.integers(0, 2**16), scale=st.floats(0.1, 3.0))
def test_convex_layers_never_widen_a_channel(stack_layers, seed, scale):
    x = scale * jax.random.normal(jax.random.key(seed), (12, 3), jnp.float32)
    run = measures.ssm_stack(x, stack_layers, 2.0)
    # The theorem's conditions depend on the data through dt; large inputs can break them.
    assume(max(run["max_a_plus_dt"]) <= 1.0 and min(run["min_a"]) >= 0.0)
    ranges = run["xs"].max(axis=1) - run["xs"].min(axis=1)  # [depth + 1, D]
    assert np.all(ranges[1:] <= ranges[:-1] * (1 + 1e-6))


def test_the_range_check_fails_outside_the_conditions():
    # dt ~ 1 and a = 0.1: A_t + dt_t ~ 1.9, so outputs are not convex combinations and grow.
    width = 3
    layers = [(jnp.zeros((width, width), jnp.float32), jnp.full((width,), 0.55, jnp.float32))] * 3
    x = jax.random.normal(jax.random.key(0), (12, width), jnp.float32)
    run = measures.ssm_stack(x, layers, 0.1)
    assert max(run["max_a_plus_dt"]) > 1.0
    ranges = run["xs"].max(axis=1) - run["xs"].min(axis=1)
    assert np.any(ranges[1:] > ranges[:-1] * (1 + 1e-6))


def test_exact_zero_channel_keeps_tokens_distinct(stack_layers):
    x = jax.random.normal(jax.random.key(1), (16, 3), jnp.float32)
    kept = {}
    for a in (np.inf, 1.0):
        xs = measures.ssm_stack(x, stack_layers, a)["xs"]
        energy = [float(similarity.relative_dirichlet_energy(jnp.asarray(v))) for v in xs]
        kept[a] = energy[-1] / energy[0]
    assert kept[np.inf] > 0.5 > kept[1.0]


def test_recency_fit_recovers_a_geometric_decay():
    # I[t, s] = c_b * rho^(t - s): the fitted slope is log rho exactly; above log A_max when
    # rho > A_max, which the claim's check reports as a failure.
    rho, length = 0.9, 10
    dist = np.arange(length)[:, None] - np.arange(length)[None, :]
    infl = np.stack([c * rho ** np.maximum(dist, 0) for c in (0.5, 2.0)])
    fit = measures.recency_fit(infl, min_distance=2)
    assert fit["slope"] == pytest.approx(np.log(rho), rel=1e-10)
    assert fit["slope_stderr"] < 1e-10
    assert fit["slope"] - 2 * fit["slope_stderr"] > np.log(0.85)  # rho > A_max = 0.85: fails


def test_recency_slope_of_a_mamba_is_below_log_a_max():
    model = Mamba(d_model=4, d_state=2)
    xs = jax.random.normal(jax.random.key(2), (2, T, 4), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(3), xs)
    prof = measures.recency_profile(model, params, xs, min_distance=model.conv_size)
    assert -0.01 < prof["log_a_max"] < 0.0  # the slowest channel: A = -1, dt ~ 1e-3
    assert prof["slope"] + 2 * prof["slope_stderr"] <= prof["log_a_max"]
