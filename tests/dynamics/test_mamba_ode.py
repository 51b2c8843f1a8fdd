"""The Mamba token ODE: the field against a loop reference and the real Mamba scan, extraction
from module parameters, and integration against closed-form solutions and blow-up times."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqlab.dynamics import mamba_ode
from seqlab.modules.mamba import Mamba
from seqlab.ops.selective_scan import selective_scan
from tests.conftest import assert_close


def _softplus(v):
    return np.logaddexp(0.0, v)


def _reference_field(x, M, S_delta, a, b):
    """The DESIGN.md 3.3 equation as loops, in float64 numpy."""
    x, M, S_delta, a, b = (np.asarray(v, np.float64) for v in (x, M, S_delta, a, b))
    L, D = x.shape
    dt = _softplus(x @ S_delta.T + b)
    out = np.zeros((L, D))
    for l in range(L):
        for j in range(l + 1):
            elapsed = dt[j + 1 : l + 1].sum(axis=0)  # sum_{k=j+1..l} dt_k
            out[l] += (x[l] @ M @ x[j]) * dt[j] * np.exp(-a * elapsed) * x[j]
    return out


def _field(rng, D, dtype):
    return mamba_ode.Field(
        M=jnp.asarray(rng.normal(size=(D, D)), dtype),
        S_delta=jnp.asarray(rng.normal(size=(D, D)), dtype),
        a=jnp.asarray(rng.uniform(0.1, 2.0, D), dtype),
        delta_bias=jnp.asarray(rng.normal(size=D), dtype),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@settings(max_examples=6)
@given(L=st.integers(1, 6), D=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_field_matches_loop_reference(dtype, L, D, seed):
    rng = np.random.default_rng(seed)
    field = _field(rng, D, dtype)
    x = jnp.asarray(rng.normal(size=(L, D)), dtype)
    got = mamba_ode.vector_field(x, **field._asdict())
    assert got.shape == (L, D) and got.dtype == dtype
    assert_close(got, _reference_field(x, *field).astype(dtype))


def test_field_without_bias_and_token_one_alone():
    rng = np.random.default_rng(1)
    field = _field(rng, 2, jnp.float64)._replace(delta_bias=None)
    x = jnp.asarray(rng.normal(size=(4, 2)))
    got = mamba_ode.vector_field(x, **field._asdict())
    assert_close(got, _reference_field(x, *field[:3], np.zeros(2)))
    # Causal cascade: token 1 evolves on its own, token l sees tokens <= l only.
    jac = jax.jacobian(lambda x: mamba_ode.vector_field(x, **field._asdict()))(x)  # [L,D,L,D]
    block = np.linalg.norm(np.asarray(jac), axis=(1, 3))
    assert np.all(block[np.triu_indices(4, 1)] == 0.0)
    assert np.all(block[np.tril_indices(4)] > 0.0)


def _mamba_with_scalar_decay(dtype, seed=0):
    """A Mamba (d_model=3, d_inner=6, N=4) whose A rows are constant: A^d = -a_d I."""
    model = Mamba(d_model=3, d_state=4, dtype=dtype, param_dtype=dtype)
    params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 5, 3), dtype))
    a = jnp.linspace(0.5, 2.0, model.d_inner, dtype=dtype)
    A_log = jnp.broadcast_to(jnp.log(a)[:, None], (model.d_inner, model.d_state))
    params = {"params": {**params["params"], "A_log": A_log}}
    return model, params, a


def test_field_is_the_mamba_scan(dtype=jnp.float64):
    # The vector field at u is the selective scan the module runs on its post-conv tokens u
    # (Euler input weight dt * B, no skip D, no gate z). The field itself is checked in both
    # dtypes against the loop reference above; this link to the module runs in float64.
    model, params, a = _mamba_with_scalar_decay(dtype)
    field = mamba_ode.field_from_mamba(model, params)
    assert_close(field.a, a)
    u = jnp.asarray(np.random.default_rng(2).normal(size=(7, model.d_inner)), dtype)
    scan = jax.jit(lambda p, u: selective_scan(**model.apply(p, u, method="s6_inputs")))(
        params, u[None]
    )[0]
    got = mamba_ode.vector_field(u, **field._asdict())
    assert_close(got, scan.astype(dtype))


def test_field_from_mamba_rejects_non_scalar_decay():
    model = Mamba(d_model=3, d_state=4)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 5, 3)))
    with pytest.raises(ValueError, match="one value per row"):
        mamba_ode.field_from_mamba(model, params)  # S4D-real init: A = -(1..N)
    polar = Mamba(d_model=3, d_state=1, polarize=(1, 1))
    with pytest.raises(ValueError, match="one value per row"):
        mamba_ode.field_from_mamba(
            polar, jax.jit(polar.init)(jax.random.key(0), jnp.zeros((1, 5, 3)))
        )
    with pytest.raises(ValueError, match="module must be"):
        mamba_ode.field_from_mamba(object(), params)


def _constant_step_field(mu, c, dtype):
    """1-D field with S_delta = 0 and bias softplus^-1(c): dt = c for every token."""
    return mamba_ode.Field(
        M=jnp.full((1, 1), mu, dtype),
        S_delta=jnp.zeros((1, 1), dtype),
        a=jnp.ones((1,), dtype),
        delta_bias=jnp.full((1,), np.log(np.expm1(c)), dtype),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_integrate_matches_closed_form_convergence(dtype):
    # Token 1 with constant dt = c: x' = mu c x^3, so x(t) = x0 / sqrt(1 - 2 mu c x0^2 t).
    mu, c, x0 = -0.7, 0.4, 1.3
    ts = np.geomspace(1e-2, 1e4, 25)
    traj = mamba_ode.integrate(
        jnp.asarray([[x0]], dtype), _constant_step_field(mu, c, dtype), t1=1e4, ts=ts.astype(dtype)
    )
    assert bool(traj.ok) and not bool(traj.blew_up) and float(traj.t_end) == pytest.approx(1e4)
    exact = x0 / np.sqrt(1 - 2 * mu * c * x0**2 * ts)
    # Integration error (rtol 1e-7) and, in float32, rounding of t and x: within 1e-5 relative.
    np.testing.assert_allclose(np.asarray(traj.xs[:, 0, 0]), exact, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "max_norm"), [(jnp.float32, 30.0), (jnp.float64, 1e3)])
def test_integrate_detects_blow_up_at_its_time(dtype, max_norm):
    # x' = mu c x^3 blows up at T = 1 / (2 mu c x0^2); the threshold is reached at
    # T - 1 / (2 mu c max_norm^2).
    mu, c, x0 = 0.9, 0.6, 0.8
    ts = np.linspace(0.1, 5.0, 8)
    traj = mamba_ode.integrate(
        jnp.asarray([[x0]], dtype),
        _constant_step_field(mu, c, dtype),
        t1=5.0,
        ts=ts.astype(dtype),
        max_norm=max_norm,
    )
    blow_up = 1 / (2 * mu * c * x0**2)
    crossing = blow_up - 1 / (2 * mu * c * max_norm**2)
    assert bool(traj.ok) and bool(traj.blew_up)
    # Detection ends the step that crosses the threshold: between the crossing and the blow-up.
    assert crossing * (1 - 1e-6) <= float(traj.t_end) <= blow_up * (1 + 1e-6)
    after = ts > float(traj.t_end)
    assert np.all(np.isinf(np.asarray(traj.xs)[after])) and np.all(
        np.isfinite(np.asarray(traj.xs)[~after])
    )


def test_integrate_reports_running_out_of_steps():
    traj = mamba_ode.integrate(
        jnp.asarray([[1.0]]),
        _constant_step_field(-1.0, 0.5, jnp.float64),
        t1=1e6,
        ts=jnp.asarray([1.0]),
        max_steps=3,
    )
    assert not bool(traj.ok) and not bool(traj.blew_up)


def test_bad_inputs_name_the_argument():
    f = _field(np.random.default_rng(0), 2, jnp.float32)
    x = jnp.zeros((3, 2), jnp.float32)
    with pytest.raises(ValueError, match=r"x must have rank 2 with layout \[L, D\]"):
        mamba_ode.vector_field(x[None], **f._asdict())
    with pytest.raises(ValueError, match="x must be a floating-point array"):
        mamba_ode.vector_field(x.astype(jnp.int32), **f._asdict())
    with pytest.raises(ValueError, match=r"M must have shape \[D, D\]"):
        mamba_ode.vector_field(x, **{**f._asdict(), "M": jnp.zeros((3, 3))})
    with pytest.raises(ValueError, match=r"a must have shape \[D\]"):
        mamba_ode.vector_field(x, **{**f._asdict(), "a": jnp.zeros((3,))})
    with pytest.raises(ValueError, match=r"delta_bias must have shape \[D\]"):
        mamba_ode.vector_field(x, **{**f._asdict(), "delta_bias": jnp.zeros((1,))})
    with pytest.raises(ValueError, match=r"ts must have rank 1"):
        mamba_ode.integrate(x, f, t1=1.0, ts=jnp.zeros((2, 2)))
