"""Fitted rates on curves with known rates."""

import numpy as np
import pytest

from seqlab.analysis import rates


def test_exponential_rate_recovers_an_exponential():
    ts = np.linspace(0, 3, 30)
    assert rates.exponential_rate(ts, 1e-4 * np.exp(0.7 * ts)) == pytest.approx(0.7, rel=1e-10)


def test_power_exponent_recovers_a_power_law():
    x = np.geomspace(1, 1e4, 20)
    assert rates.power_exponent(x, 3 * x**-1.5) == pytest.approx(-1.5, rel=1e-10)


def test_line_fit_slope_stderr_and_intercept():
    x = np.arange(10.0)
    exact = rates.line_fit(x, 2.0 - 0.5 * x)
    assert exact["slope"] == pytest.approx(-0.5) and exact["intercept"] == pytest.approx(2.0)
    assert exact["slope_stderr"] == pytest.approx(0.0, abs=1e-12)
    noisy = rates.line_fit(x, 2.0 - 0.5 * x + np.random.default_rng(0).normal(0, 0.1, 10))
    assert abs(noisy["slope"] + 0.5) < 4 * noisy["slope_stderr"] and noisy["slope_stderr"] > 0
    assert rates.slope(x, 2.0 - 0.5 * x) == pytest.approx(-0.5)


def test_pooled_slope_shares_one_slope_over_rows_with_their_own_intercepts():
    x = np.tile(np.linspace(0, 1, 20), (3, 1))
    y = np.array([[5.0], [-1.0], [0.0]]) - 7.0 * x
    valid = np.ones_like(x, bool)
    assert rates.pooled_slope(x, y, valid) == pytest.approx(-7.0)
    y[0, :5] = 100.0  # entries left out of the fit do not move it
    valid[0, :5] = False
    assert rates.pooled_slope(x, y, valid) == pytest.approx(-7.0)


def test_pooled_slope_recovers_a_noisy_decay_rate():
    rng = np.random.default_rng(0)
    tau = np.cumsum(rng.uniform(0.01, 0.1, (3, 20)), axis=1)[:, ::-1]
    log_infl = np.array([[1.0], [-2.0], [0.5]]) - 7.0 * tau + rng.normal(0, 0.01, tau.shape)
    valid = np.ones_like(tau, bool)
    valid[0, :5] = False
    log_infl[0, :5] = 50.0  # masked entries must not count
    assert -rates.pooled_slope(tau, log_infl, valid) == pytest.approx(7.0, rel=0.02)
