"""Finite-time Lyapunov exponents: exact on linear flows (Euler and RK4 maps), the QR/SVD identities
on a nonlinear token flow against `jax.jacfwd`, finite differences, per-token blocks, gradients,
Lorenz-63 (slow), bad input."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.analysis import lyapunov
from tests.conftest import assert_close, tolerance

DTYPES = [jnp.float32, jnp.float64]
T_LEN, D = 4, 3


def _normal(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _linear(a):
    return lambda t, x: x @ a.T  # dx/dt = A x for x: [n]


def _token_field(w, v):
    """A causal attention-like field on tokens `x: [T, D]`, explicitly time dependent."""

    def f(t, x):
        scores = jnp.where(jnp.tril(jnp.ones((x.shape[0],) * 2, bool)), x @ w @ x.T, -jnp.inf)
        return (1.0 + t) * jax.nn.softmax(scores, axis=-1) @ jnp.tanh(x @ v) - 0.5 * x

    return f


def _flow_setup(dtype):
    w, v = 0.5 * _normal(0, (D, D), dtype), 1.5 * _normal(1, (D, D), dtype)
    return _token_field(w, v), _normal(2, (T_LEN, D), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_euler_integrate_matches_diffrax(dtype):
    f, x0 = _flow_setup(dtype)
    got = jax.jit(lambda x: lyapunov.integrate(f, x, num_steps=7, trajectory=True))(x0)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, x, args: f(t, x)),
        diffrax.Euler(),
        t0=0.0,
        t1=1.0,
        dt0=1.0 / 7,
        y0=x0,
        stepsize_controller=diffrax.ConstantStepSize(),
        saveat=diffrax.SaveAt(steps=True),
    )
    assert got.shape == (8, T_LEN, D)
    assert_close(got[0], x0)
    n = sol.stats["num_accepted_steps"]  # ys is padded to max_steps; diffrax may promote time
    assert_close(got[1:], sol.ys[:n], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", lyapunov.METHODS)
def test_linear_upper_triangular_qr_exponents_are_the_diagonal_exactly(dtype, method):
    # Each step's map M is upper triangular with diagonal m(dt a_ii) (m(z) = 1 + z for Euler, the
    # degree-4 Taylor polynomial of exp for RK4), so from Q_0 = I every R_k = +-M and
    # mu_i = N log|m(dt a_ii)| / tau exactly, at any finite time (not only as tau -> inf).
    n, steps, t0, t1 = 4, 9, 0.5, 2.0
    a = jnp.triu(_normal(3, (n, n), dtype)) + jnp.diag(jnp.asarray([1.0, -0.5, -3.0, 2.5], dtype))
    z = (t1 - t0) / steps * jnp.diagonal(a)
    m = 1 + z if method == "euler" else 1 + z + z**2 / 2 + z**3 / 6 + z**4 / 24
    want = steps * jnp.log(jnp.abs(m)) / (t1 - t0)
    x0 = _normal(4, (n,), dtype)
    got = jax.jit(
        lambda x: lyapunov.qr_exponents(_linear(a), x, num_steps=steps, t0=t0, t1=t1, method=method)
    )(x0)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", lyapunov.METHODS)
def test_linear_symmetric_flow_exponents_are_the_eigenvalue_maps(dtype, method):
    # M = m(dt A) is symmetric with eigenvalues m(dt lambda_i); J = M^N has singular values
    # |m(dt lambda_i)|^N, so the exponents are N log|m(dt lambda_i)| / tau, sorted.
    n, steps = 5, 6
    b = _normal(5, (n, n), dtype)
    a = (b + b.T) / 2
    z = jnp.linalg.eigvalsh(a) / steps
    m = 1 + z if method == "euler" else 1 + z + z**2 / 2 + z**3 / 6 + z**4 / 24
    want = jnp.sort(steps * jnp.log(jnp.abs(m)))[::-1]
    run = jax.jit(
        lambda x: (
            lyapunov.flow_jacobian_exponents(_linear(a), x, num_steps=steps, method=method),
            lyapunov.integrate(_linear(a), x, num_steps=steps, method=method),
        )
    )
    x0 = _normal(6, (n,), dtype)
    got, x1 = run(x0)
    assert_close(got, want)
    mat = jnp.linalg.matrix_power(jnp.eye(n, dtype=dtype) + (a / steps), steps)
    if method == "euler":  # the flow map itself: (I + dt A)^N x0
        assert_close(x1, mat @ x0)


@pytest.fixture(scope="module", params=DTYPES, ids=["float32", "float64"])
def token_flow(request):
    """A nonlinear causal token flow, its exact Jacobian by `jax.jacfwd` and both exponents for
    token 1's frame and a random 5-vector frame."""
    dtype = request.param
    f, x0 = _flow_setup(dtype)
    kw = dict(num_steps=6, t0=0.0, t1=1.5)
    flow = lambda x: lyapunov.integrate(f, x, **kw)  # noqa: E731
    jac = jax.jit(jax.jacfwd(flow))(x0).reshape(T_LEN * D, T_LEN * D)
    frames = {
        "token1": lyapunov.token_frame((T_LEN, D), 1, dtype),
        "random": jnp.linalg.qr(_normal(7, (T_LEN * D, 5), dtype))[0].T.reshape(5, T_LEN, D),
    }

    @jax.jit
    def measure(frame):
        lam, vecs = lyapunov.flow_jacobian_exponents(f, x0, frame=frame, return_vectors=True, **kw)
        return lam, vecs, lyapunov.qr_exponents(f, x0, frame=frame, **kw)

    return dict(f=f, x0=x0, kw=kw, jac=jac, frames=frames, measure=measure, dtype=dtype)


@pytest.mark.parametrize("frame_name", ["token1", "random"])
def test_exponents_against_the_exact_jacobian(token_flow, frame_name):
    fl = token_flow
    frame = fl["frames"][frame_name]
    p, tau = frame.shape[0], fl["kw"]["t1"] - fl["kw"]["t0"]
    lam, vecs, mu = fl["measure"](frame)
    q0 = np.asarray(frame, np.float64).reshape(p, -1).T  # [n, p]
    jq = np.asarray(fl["jac"], np.float64) @ q0  # J Q_0
    sigma = np.linalg.svd(jq, compute_uv=False)
    r = np.linalg.qr(jq)[1]
    # SVD version: log sigma(J Q_0) / tau, in decreasing order.
    assert_close(lam, np.log(sigma) / tau, dtype=fl["dtype"])
    # QR version: exactly log|diag R(J Q_0)| / tau, in frame order.
    assert_close(mu, np.log(np.abs(np.diagonal(r))) / tau, dtype=fl["dtype"])
    # Volume identities: full p-volume equal, partial sums bounded by the top-k singular values.
    lam64, mu64 = np.asarray(lam, np.float64), np.asarray(mu, np.float64)
    np.testing.assert_allclose(mu64.sum(), lam64.sum(), **tolerance(fl["dtype"]))
    slack = 10 * tolerance(fl["dtype"])["rtol"]
    assert np.all(np.cumsum(mu64) <= np.cumsum(lam64) + slack)
    # The returned directions are unit vectors in the frame's span reaching sigma_k.
    v = np.asarray(vecs, np.float64).reshape(p, -1)
    np.testing.assert_allclose(v @ v.T, np.eye(p), atol=slack)
    growth = np.linalg.norm(np.asarray(fl["jac"], np.float64) @ v.T, axis=0)
    np.testing.assert_allclose(growth, sigma, rtol=slack)


def test_qr_on_a_frame_led_by_the_top_direction_reaches_the_top_exponent(token_flow):
    fl = token_flow
    lam, vecs, mu = fl["measure"](fl["frames"]["token1"])
    _, _, mu_aligned = fl["measure"](vecs)
    assert_close(mu_aligned, lam)  # right singular vectors: J V = U diag(sigma), R diagonal
    assert mu[0] < lam[0]  # an unaligned frame's first QR exponent is below the top one


def test_per_token_blocks_and_causality(token_flow):
    fl = token_flow
    f, x0, kw = fl["f"], fl["x0"], fl["kw"]
    jac = np.asarray(fl["jac"], np.float64).reshape(T_LEN, D, T_LEN, D)
    frame = fl["frames"]["token1"]
    per_output = jax.jit(
        lambda x: [
            lyapunov.flow_jacobian_exponents(f, x, frame=frame, out_token=out, **kw)
            for out in range(T_LEN)
        ]
    )(x0)
    for out, got in enumerate(per_output):
        block = jac[out, :, 1, :]  # dx_out(t1) / dx_1(t0)
        if out < 1:  # causal: an earlier token never sees token 1
            assert np.all(block == 0.0) and np.all(np.isneginf(np.asarray(got)))
        else:
            want = np.log(np.linalg.svd(block, compute_uv=False)) / 1.5
            assert_close(got, want, dtype=fl["dtype"])


def test_top_exponent_is_the_growth_of_small_perturbations():
    # Float64: the nonlinear growth |Phi(x0 + eps v_1) - Phi(x0)| / eps tends to sigma_1 as
    # eps -> 0, with an O(eps) deviation (second-order term of Phi).
    f, x0 = _flow_setup(jnp.float64)
    kw = dict(num_steps=6, t0=0.0, t1=1.5)
    frame = lyapunov.token_frame((T_LEN, D), 0, jnp.float64)
    lam, vecs = lyapunov.flow_jacobian_exponents(f, x0, frame=frame, return_vectors=True, **kw)
    flow = jax.jit(lambda x: lyapunov.integrate(f, x, **kw))
    errors = []
    for eps in (1e-2, 1e-3, 1e-4):
        growth = jnp.linalg.norm(flow(x0 + eps * vecs[0]) - flow(x0)) / eps
        errors.append(abs(float(jnp.log(growth) / 1.5 - lam[0])))
    assert errors[-1] < 1e-3
    assert errors[2] < errors[1] < errors[0]  # linear regime: the error falls with eps


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_of_the_qr_exponents(dtype):
    # Euler on upper-triangular A: mu_i = N log|1 + dt a_ii| / tau, d mu_i / d a_ii = N dt / tau /
    # (1 + dt a_ii); the off-diagonal part does not enter.
    n, steps = 3, 5
    upper = jnp.triu(_normal(8, (n, n), dtype), k=1)
    diag = jnp.asarray([0.7, -1.2, 2.0], dtype)
    x0 = _normal(9, (n,), dtype)

    def total(diag, upper):
        a = upper + jnp.diag(diag)
        mu = lyapunov.qr_exponents(_linear(a), x0, num_steps=steps)
        return jnp.sum(mu * jnp.arange(1, n + 1, dtype=dtype))

    g_diag, g_upper = jax.jit(jax.grad(total, argnums=(0, 1)))(diag, upper)
    assert_close(g_diag, jnp.arange(1, n + 1, dtype=dtype) / (1 + diag / steps))
    assert_close(jnp.triu(g_upper, k=1), jnp.zeros_like(upper))  # below it, A leaves triangular


def _lorenz(t, x, sigma=10.0, rho=28.0, beta=8.0 / 3.0):
    return jnp.stack([sigma * (x[1] - x[0]), x[0] * (rho - x[2]) - x[1], x[0] * x[1] - beta * x[2]])


def test_lorenz63_long_time_exponents():
    # Known spectrum ~ (0.906, 0, -14.572) (Sprott); the sum is the divergence -(sigma + 1 + beta)
    # = -13.667 at every point, so the discrete map's volume rate matches it to RK4's accuracy.
    x0 = jnp.asarray([1.0, 1.0, 20.0], jnp.float64)
    x_on = lyapunov.integrate(_lorenz, x0, num_steps=5000, t1=50.0, method="rk4")  # transient
    mu = jax.jit(
        lambda x: lyapunov.qr_exponents(_lorenz, x, num_steps=100_000, t1=1000.0, method="rk4")
    )(x_on)
    mu = np.asarray(mu)
    np.testing.assert_allclose(mu.sum(), -(10.0 + 1.0 + 8.0 / 3.0), atol=1e-3)
    np.testing.assert_allclose(mu, [0.906, 0.0, -14.572], atol=0.05)


def test_bad_input_names_the_argument():
    f, x0 = _flow_setup(jnp.float32)
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        lyapunov.integrate(f, x0, num_steps=0)
    with pytest.raises(ValueError, match="method must be one of"):
        lyapunov.qr_exponents(f, x0, num_steps=2, method="rk45")
    with pytest.raises(ValueError, match="t1 must be > t0"):
        lyapunov.flow_jacobian_exponents(f, x0, num_steps=2, t0=1.0, t1=1.0)
    with pytest.raises(ValueError, match="x0 must be a floating"):
        lyapunov.integrate(f, jnp.ones((2, 3), jnp.int32), num_steps=2)
    with pytest.raises(ValueError, match=r"frame must have shape \[p, \*x0.shape\]"):
        lyapunov.qr_exponents(f, x0, num_steps=2, frame=jnp.ones((2, T_LEN, D + 1)))
    with pytest.raises(ValueError, match=r"frame must hold 1\.\.12 vectors"):
        lyapunov.qr_exponents(f, x0, num_steps=2, frame=jnp.ones((13, T_LEN, D)))
    with pytest.raises(ValueError, match="out_token must index a token"):
        lyapunov.flow_jacobian_exponents(f, x0, num_steps=2, out_token=T_LEN)
    with pytest.raises(ValueError, match=r"token must be in \[0, 4\)"):
        lyapunov.token_frame((T_LEN, D), 4)
