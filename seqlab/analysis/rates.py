"""Rates fitted to measured curves: least-squares lines, exponential rates, power-law exponents.

All take host arrays (numpy float64) and return Python floats; none is traceable.

- `line_fit(x, y)`: `y ~ intercept + slope x`, with the standard error of the slope.
- `slope(x, y)`: the least-squares slope alone.
- `exponential_rate(t, y)`: `r` in `y ~ c exp(r t)`, the slope of `log y` against `t`.
- `power_exponent(x, y)`: `p` in `y ~ c x^p`, the slope of `log y` against `log x`.
- `pooled_slope(x, y, valid)`: one common slope for rows `d` with their own intercepts,
  `y[d, s] ~ c_d + slope x[d, s]`, over the `valid` entries.
"""

import numpy as np


def line_fit(x, y) -> dict[str, float]:
    """`{"slope", "slope_stderr", "intercept"}` of the least-squares line through `(x, y)`, both
    `[S]` with `S >= 3` (the standard error is `sqrt` of the fit's covariance, `np.polyfit`)."""
    (slope_, intercept), cov = np.polyfit(x, y, 1, cov=True)
    return dict(
        slope=float(slope_), slope_stderr=float(np.sqrt(cov[0, 0])), intercept=float(intercept)
    )


def slope(x, y) -> float:
    """The least-squares slope of `y: [S]` against `x: [S]`."""
    return float(np.polyfit(x, y, 1)[0])


def exponential_rate(t, y) -> float:
    """`r` in `y ~ c exp(r t)`: the least-squares slope of `log y` against `t` (`[S]`, `y > 0`)."""
    return slope(np.asarray(t), np.log(np.asarray(y)))


def power_exponent(x, y) -> float:
    """`p` in `y ~ c x^p`: the least-squares slope of `log y` against `log x` (`[S]`, positive)."""
    return slope(np.log(np.asarray(x)), np.log(np.asarray(y)))


def pooled_slope(x, y, valid) -> float:
    """The common least-squares slope of `y[d, s] = c_d + slope * x[d, s]` (one intercept per row
    `d`), over the entries where `valid` holds. `x, y, valid: [d, S]`.

    With row means over the valid entries removed, `slope = sum w x_c y_c / sum w x_c^2`.
    """
    w = valid.astype(np.float64)
    count = np.maximum(w.sum(axis=1, keepdims=True), 1.0)
    x_c = x - (w * x).sum(axis=1, keepdims=True) / count
    y_c = y - (w * y).sum(axis=1, keepdims=True) / count
    return float((w * x_c * y_c).sum() / (w * x_c**2).sum())
