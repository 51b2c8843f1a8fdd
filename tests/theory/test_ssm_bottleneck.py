"""The properties behind the polarization claims, on a tiny Mamba: they hold for the polarized
channels and the same measurements detect their absence elsewhere."""

import jax
import numpy as np
import pytest

from seqlab.modules.mamba import Mamba
from theory.ssm_bottleneck import claims

T = 24


@pytest.fixture(scope="module")
def polarized():
    """Influence, step sizes and A of a random `Mamba(polarize=(1, 1))`, N = 1 + 2 + 1."""
    model = Mamba(d_model=4, d_state=2, polarize=(1, 1))
    params, x = claims._init(model, jax.random.key(0), T)
    infl, dt, A = (np.asarray(v, np.float64) for v in claims._influence_and_steps(model, params, x))
    rho, dt_r, _ = (
        np.asarray(v, np.float64) for v in claims._retention_and_steps(model, params, x)
    )
    return dict(model=model, infl=infl, dt=dt, A=A, rho=rho, dt_r=dt_r)


def _rates(infl, dt, width):
    """Fitted decay rate per state channel, as the claim computes it."""
    s = np.arange(T - width + 1)
    tau = claims.elapsed(dt, s + width).T
    window = infl[:, :, s]
    valid = window > claims._UNDERFLOW
    log_w = np.log(np.where(valid, window, 1.0))
    return np.array(
        [claims.decay_rate(log_w[:, n], tau, valid[:, n]) for n in range(infl.shape[1])]
    )


def test_decay_rate_recovers_a_known_rate():
    rng = np.random.default_rng(0)
    tau = np.cumsum(rng.uniform(0.01, 0.1, (3, 20)), axis=1)[:, ::-1]
    log_infl = np.array([[1.0], [-2.0], [0.5]]) - 7.0 * tau + rng.normal(0, 0.01, tau.shape)
    valid = np.ones_like(tau, bool)
    valid[0, :5] = False
    log_infl[0, :5] = 50.0  # masked entries must not count
    assert claims.decay_rate(log_infl, tau, valid) == pytest.approx(7.0, rel=0.02)


def test_influence_is_causal_and_carried_by_the_one_channel(polarized):
    infl, A = polarized["infl"], polarized["A"]
    assert A[0, 0] == 0.0 and A[0, -1] == -100.0
    rates = _rates(infl, polarized["dt"], polarized["model"].d_conv)
    assert abs(rates[0]) <= 0.25  # 1-channel: no decay
    np.testing.assert_allclose(rates[1:3], -A[0, 1:3], rtol=0.25)  # learnable: rate |A_n|
    assert rates[-1] > 50  # 0-channel: fast decay (rate 100 up to the fit)


def test_unpolarized_channels_do_decay():
    # The same measurement on a plain Mamba: its first state channel (A = -1) is not a 1-channel.
    model = Mamba(d_model=4, d_state=2)
    params, x = claims._init(model, jax.random.key(1), T)
    infl, dt, A = (np.asarray(v, np.float64) for v in claims._influence_and_steps(model, params, x))
    rates = _rates(infl, dt, model.d_conv)
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
