"""Self-attention particles on the sphere: the field against the numpy oracle (dense and blocked,
values and gradients), the circle reduction, the projected integrators (sphere, order, vmap), the
energy identity, the linearized growth rates against the particle Jacobian and Funk-Hecke
quadrature, the dominant mode table, cluster counts and bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
import scipy.special
from hypothesis import given, settings
from hypothesis import strategies as st

from seqlab.dynamics import token_flow
from tests.conftest import assert_close

DTYPES = [jnp.float32, jnp.float64]


def _sphere(rng, n, d, dtype=jnp.float64):
    x = rng.normal(size=(n, d))
    return jnp.asarray(x / np.linalg.norm(x, axis=1, keepdims=True), dtype)


def _maps(rng, d, dtype):
    return {name: jnp.asarray(rng.normal(size=(d, d)) / np.sqrt(d), dtype) for name in "QKV"}


def _circle(theta, dtype=jnp.float64):
    return jnp.asarray(np.stack([np.cos(theta), np.sin(theta)], axis=-1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalized", [True, False])
@pytest.mark.parametrize("with_maps", [False, True])
def test_field_matches_numpy_reference(dtype, normalized, with_maps):
    rng = np.random.default_rng(0)
    x = _sphere(rng, 37, 3, dtype)
    maps = _maps(rng, 3, dtype) if with_maps else {}
    expected = token_flow.vector_field_reference(x, 2.5, normalized, **maps)
    for block in (None, 8, 37, 64):
        got = token_flow.vector_field(x, beta=2.5, normalized=normalized, block_size=block, **maps)
        assert got.dtype == dtype
        assert_close(got, expected, dtype, err_msg=f"block_size={block}")


@settings(max_examples=6)  # every draw compiles a scan; 6 shapes cover odd and whole blocks
@given(
    n=st.integers(1, 40),
    d=st.integers(2, 5),
    block=st.integers(1, 16),
    beta=st.floats(0.0, 12.0),
    normalized=st.booleans(),
)
def test_blocked_equals_dense(n, d, block, beta, normalized):
    x = _sphere(np.random.default_rng(n * 31 + d), n, d)
    dense = token_flow.vector_field(x, beta=beta, normalized=normalized)
    blocked = token_flow.vector_field(x, beta=beta, normalized=normalized, block_size=block)
    assert_close(blocked, dense)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalized", [True, False])
def test_blocked_gradients_equal_dense(dtype, normalized):
    rng = np.random.default_rng(1)
    x = _sphere(rng, 23, 3, dtype)
    maps = _maps(rng, 3, dtype)
    probe = jnp.asarray(rng.normal(size=(23, 3)), dtype)

    def loss(x, beta, maps, block):
        field = token_flow.vector_field(
            x, beta=beta, normalized=normalized, block_size=block, **maps
        )
        return jnp.sum(field * probe)

    grads = jax.grad(loss, argnums=(0, 1, 2))
    beta = jnp.asarray(3.0, dtype)
    assert_close(grads(x, beta, maps, 5), grads(x, beta, maps, None), dtype)


def test_identity_maps_equal_default():
    x = _sphere(np.random.default_rng(2), 11, 4)
    eye = jnp.eye(4, dtype=x.dtype)
    for normalized in (True, False):
        explicit = token_flow.vector_field(x, beta=1.5, normalized=normalized, Q=eye, K=eye, V=eye)
        assert_close(explicit, token_flow.vector_field(x, beta=1.5, normalized=normalized))


def test_field_is_tangent():
    x = _sphere(np.random.default_rng(3), 19, 5)
    field = token_flow.vector_field(x, beta=4.0, **_maps(np.random.default_rng(4), 5, x.dtype))
    assert_close(jnp.sum(field * x, axis=1), jnp.zeros(19, x.dtype))


@pytest.mark.parametrize("normalized", [True, False])
def test_circle_reduces_to_the_angle_equation(normalized):
    # dtheta_i/dt = -(1/Z_i) sum_j exp(beta cos(theta_i - theta_j)) sin(theta_i - theta_j),
    # Z_i = n (USA) or sum_j exp(beta cos(theta_i - theta_j)) (SA).
    theta = np.random.default_rng(5).uniform(0, 2 * np.pi, 29)
    beta = 3.0
    diff = theta[:, None] - theta[None, :]
    w = np.exp(beta * np.cos(diff))
    z = w.sum(axis=1) if normalized else len(theta)
    dtheta = -(w * np.sin(diff)).sum(axis=1) / z
    field = token_flow.vector_field(_circle(theta), beta=beta, normalized=normalized)
    tangent = np.stack([-np.sin(theta), np.cos(theta)], axis=-1)
    assert_close(field, jnp.asarray(dtheta[:, None] * tangent))


def test_energy_derivative_is_mean_squared_speed():
    # dE/dt along USA = (1/n) sum_i |dx_i/dt|^2: the normalization of E_beta makes it exact.
    x = _sphere(np.random.default_rng(6), 17, 3)
    beta = 2.0
    v = token_flow.vector_field(x, beta=beta, normalized=False)
    _, rate = jax.jvp(lambda y: token_flow.energy(y, beta=beta), (x,), (v,))
    assert_close(rate, jnp.sum(v**2) / x.shape[0])


@pytest.mark.parametrize("method", ["euler", "rk4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_integrator_stays_on_sphere(method, dtype):
    x0 = _sphere(np.random.default_rng(7), 16, 3, dtype)
    traj = token_flow.integrate(x0, beta=4.0, t1=3.0, n_steps=60, n_saves=6, method=method)
    assert traj.xs.shape == (7, 16, 3) and traj.xs.dtype == dtype
    assert_close(traj.ts, jnp.linspace(0, 3.0, 7, dtype=dtype), dtype)
    assert_close(traj.xs[0], x0, dtype)
    norms = jnp.linalg.norm(traj.xs, axis=-1)
    assert float(jnp.max(jnp.abs(norms - 1))) <= 8 * float(jnp.finfo(dtype).eps)


@pytest.mark.parametrize("method, order", [("euler", 1), ("rk4", 4)])
def test_integrator_order(method, order):
    x0 = _sphere(np.random.default_rng(8), 12, 3)
    kwargs = dict(beta=3.0, t1=1.0, n_saves=1)
    exact = token_flow.integrate(x0, n_steps=1024, method="rk4", **kwargs).xs[-1]
    errors = [
        float(
            jnp.max(
                jnp.abs(token_flow.integrate(x0, n_steps=s, method=method, **kwargs).xs[-1] - exact)
            )
        )
        for s in (16, 32)
    ]
    observed = np.log2(errors[0] / errors[1])
    assert abs(observed - order) < 0.3, (errors, observed)


def test_vmap_over_betas_and_seeds_equals_loop():
    keys = jax.random.split(jax.random.key(0), 2)
    x0 = jax.vmap(lambda k: token_flow_circle(k, 10))(keys)  # [2, 10, 2]
    betas = jnp.asarray([0.5, 8.0])

    def run(x, b):
        return token_flow.integrate(x, beta=b, t1=2.0, n_steps=8, n_saves=4, block_size=4).xs

    batched = jax.vmap(jax.vmap(run, (None, 0)), (0, None))(x0, betas)  # [seed, beta, S, n, 2]
    for s in range(2):
        for b in range(2):
            assert_close(batched[s, b], run(x0[s], betas[b]), jnp.float32)


def token_flow_circle(key, n):
    theta = jax.random.uniform(key, (n,), jnp.float32, 0.0, 2 * np.pi)
    return jnp.stack([jnp.cos(theta), jnp.sin(theta)], axis=-1)


@pytest.mark.parametrize("normalized", [True, False])
@pytest.mark.parametrize("beta", [1.0, 9.0])
def test_growth_rates_are_the_particle_jacobian_eigenvalues(normalized, beta):
    # Equally spaced particles are an equilibrium; the displacement theta_j -> theta_j + s
    # sin(k theta_j) is an eigenvector of the linearized flow with eigenvalue lambda_k (up to
    # aliasing terms of order I_{n-k}(beta), negligible for n = 64).
    n = 64
    theta = 2 * np.pi * np.arange(n) / n
    x = _circle(theta)
    tangent = np.stack([-np.sin(theta), np.cos(theta)], axis=-1)
    assert float(jnp.max(jnp.abs(token_flow.vector_field(x, beta=beta)))) < 1e-12
    for k in range(1, 8):
        direction = jnp.asarray(np.sin(k * theta)[:, None] * tangent)
        _, response = jax.jvp(
            lambda y: token_flow.vector_field(y, beta=beta, normalized=normalized),
            (x,),
            (direction,),
        )
        rate = float(jnp.sum(response * direction) / jnp.sum(direction**2))
        expected = token_flow.growth_rate(k, beta, 2, normalized=normalized)
        assert rate == pytest.approx(float(expected), rel=1e-9)
        assert_close(response, rate * direction)


@pytest.mark.parametrize("d", [2, 3, 4, 5])
@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_growth_rate_is_funk_hecke(d, k):
    # USA: lambda_k = k (k + d - 2) c_k / beta with c_k the Funk-Hecke eigenvalue of exp(beta t)
    # on S^{d-1} under the normalized uniform measure:
    # c_k = |S^{d-2}| / |S^{d-1}| int_{-1}^1 e^{beta t} P_k(t) (1 - t^2)^{(d-3)/2} dt, with
    # P_k = C_k^{(d-2)/2} / C_k^{(d-2)/2}(1) (the Legendre polynomial for d = 3; cos(k acos t)
    # for d = 2).
    beta = 3.0

    def legendre(t):
        if d == 2:
            return np.cos(k * np.arccos(t))
        alpha = (d - 2) / 2
        return scipy.special.eval_gegenbauer(k, alpha, t) / scipy.special.eval_gegenbauer(
            k, alpha, 1.0
        )

    def area(m):  # |S^{m-1}|
        return 2 * np.pi ** (m / 2) / scipy.special.gamma(m / 2)

    weight = {"alpha": (d - 3) / 2, "beta": (d - 3) / 2}  # (1 - t)^a (1 + t)^b
    integral, _ = scipy.integrate.quad(
        lambda t: np.exp(beta * t) * legendre(t),
        -1,
        1,
        weight="alg",
        wvar=(weight["alpha"], weight["beta"]),
    )
    c_k = area(d - 1) / area(d) * integral
    expected = k * (k + d - 2) * c_k / beta
    got = float(token_flow.growth_rate(k, beta, d, normalized=False))
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-15)
    c_0 = float(token_flow.growth_rate(1, beta, d, normalized=False)) / float(
        token_flow.growth_rate(1, beta, d, normalized=True)
    )
    c_0_quad, _ = scipy.integrate.quad(
        lambda t: np.exp(beta * t), -1, 1, weight="alg", wvar=(weight["alpha"], weight["beta"])
    )
    assert c_0 == pytest.approx(area(d - 1) / area(d) * c_0_quad, rel=1e-9)


def test_dominant_mode_table_of_the_paper():
    # PAPERS.md section C: circle beta 1, 4, 9, 16, 25, 36, 64, 100 -> 1, 3, 4, 6, 7, 8, 11, 14.
    betas = [1, 4, 9, 16, 25, 36, 64, 100]
    assert [token_flow.dominant_mode(b, 2) for b in betas] == [1, 3, 4, 6, 7, 8, 11, 14]


@pytest.mark.parametrize("d", [2, 3, 8])
@pytest.mark.parametrize("beta", [0.3, 7.0, 50.0, 2000.0])
def test_dominant_mode_is_the_argmax_of_both_rates(d, beta):
    k = np.arange(1, int(beta) + 40)
    best = token_flow.dominant_mode(beta, d)
    for normalized in (True, False):
        rates = token_flow.growth_rate(k, beta, d, normalized=normalized)
        if np.all(np.isfinite(rates)):  # USA overflows float64 past beta ~ 700
            assert k[np.argmax(rates)] == best
    if d == 2:
        assert abs(best - np.sqrt(2 * beta)) <= 2 + 0.1 * np.sqrt(beta)  # k* ~ sqrt(2 beta)


def test_mode_amplitudes():
    theta = 2 * np.pi * np.arange(12) / 12
    amps = token_flow.mode_amplitudes(_circle(theta), jnp.arange(1, 13))
    assert_close(amps, jnp.asarray([0.0] * 11 + [1.0]))
    three = _circle(np.repeat([0.1, 0.1 + 2 * np.pi / 3, 0.1 + 4 * np.pi / 3], 5))
    assert_close(
        token_flow.mode_amplitudes(three, jnp.asarray([1, 2, 3, 6])),
        jnp.asarray([0.0, 0.0, 1.0, 1.0]),
    )


def test_cluster_counts():
    rng = np.random.default_rng(9)
    centers = np.array([0.3, 1.5, 3.0, 5.9])
    theta = np.concatenate([c + rng.uniform(-0.02, 0.02, 7) for c in centers])
    x = _circle(theta)
    assert int(token_flow.cluster_count_circle(x, gap=0.2)) == 4
    assert token_flow.cluster_count(x, cos_min=np.cos(0.2)) == 4
    assert int(token_flow.cluster_count_circle(_circle(np.linspace(0, 6, 40)), gap=0.2)) == 1
    # Random configurations: gaps on the circle and single linkage by cosine agree.
    for seed in range(5):
        x = _circle(np.random.default_rng(seed).uniform(0, 2 * np.pi, 30))
        assert int(token_flow.cluster_count_circle(x, gap=0.3)) == token_flow.cluster_count(
            x, cos_min=np.cos(0.3)
        )
    s2 = _sphere(rng, 3, 3)
    blobs = jnp.concatenate([s2[i] + 1e-3 * jnp.asarray(rng.normal(size=(5, 3))) for i in range(3)])
    blobs = blobs / jnp.linalg.norm(blobs, axis=1, keepdims=True)
    assert token_flow.cluster_count(blobs, cos_min=0.999) == 3


def test_circle_clusters_width_of_the_widest():
    theta = np.concatenate([c + np.linspace(-0.01, 0.01, 5) for c in (0.0, 2.0, 4.0)])
    count, widest = token_flow.circle_clusters(token_flow.on_circle(theta), gap=0.1)
    assert int(count) == 3 and float(widest) == pytest.approx(0.02, abs=1e-6)
    spread = token_flow.on_circle(jnp.linspace(0, 2 * jnp.pi, 200, endpoint=False))
    count, widest = token_flow.circle_clusters(spread, gap=0.1)
    assert int(count) == 1 and float(widest) == pytest.approx(2 * np.pi)
    # Traceable: vmap over configurations gives the per-configuration values.
    both = jnp.stack([token_flow.on_circle(theta), token_flow.on_circle(theta + 1.0)])
    counts, widths = jax.vmap(lambda x: token_flow.circle_clusters(x, gap=0.1))(both)
    np.testing.assert_array_equal(counts, [3, 3])
    np.testing.assert_allclose(widths, 0.02, atol=1e-6)


def test_fibonacci_sphere_is_a_near_uniform_lattice():
    x = token_flow.fibonacci_sphere(500)
    assert x.shape == (500, 3) and x.dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-14)
    np.testing.assert_allclose(x.mean(axis=0), 0.0, atol=1e-2)  # no preferred direction
    np.testing.assert_allclose(
        token_flow.on_circle(np.array([0.0, np.pi / 2])), [[1, 0], [0, 1]], atol=1e-7
    )


def test_bad_inputs_raise_named_errors():
    x = _sphere(np.random.default_rng(10), 5, 3)
    field = token_flow.vector_field
    with pytest.raises(ValueError, match="x must have rank 2"):
        field(x[0], beta=1.0)
    with pytest.raises(ValueError, match="x must have unit rows"):
        field(2 * x, beta=1.0)
    with pytest.raises(ValueError, match="d >= 2"):
        field(jnp.ones((4, 1)), beta=1.0)
    with pytest.raises(ValueError, match="x must be a floating-point"):
        field(jnp.ones((4, 2), jnp.int32), beta=1.0)
    for beta in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="beta must be a finite number"):
            field(x, beta=beta)
    with pytest.raises(ValueError, match="beta must be a scalar"):
        field(x, beta=jnp.ones(2))
    with pytest.raises(ValueError, match=r"Q must have shape \[d, d\]"):
        field(x, beta=1.0, Q=jnp.eye(2))
    for block in (0, -3, 2.0):
        with pytest.raises(ValueError, match="block_size must be a positive int"):
            field(x, beta=1.0, block_size=block)
    with pytest.raises(ValueError, match="n_steps must be a multiple of n_saves"):
        token_flow.integrate(x, beta=1.0, t1=1.0, n_steps=10, n_saves=3)
    with pytest.raises(ValueError, match="method must be one of"):
        token_flow.integrate(x, beta=1.0, t1=1.0, n_steps=3, n_saves=3, method="rk2")
    with pytest.raises(ValueError, match="t1 must be a positive scalar"):
        token_flow.integrate(x, beta=1.0, t1=0.0, n_steps=3, n_saves=3)
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        token_flow.dominant_mode(0.0, 2)
    with pytest.raises(ValueError, match="d must be an int >= 2"):
        token_flow.dominant_mode(4.0, 1)
    with pytest.raises(ValueError, match="k must hold integers >= 0"):
        token_flow.growth_rate(1.5, 4.0, 2)
    with pytest.raises(ValueError, match=r"x must have shape \[n, 2\]"):
        token_flow.mode_amplitudes(x, [1])


def test_traced_beta_is_not_value_checked():
    # Under jit beta is abstract: the value checks are skipped, the shape check stays.
    x = _sphere(np.random.default_rng(11), 6, 3)
    jitted = jax.jit(lambda b: token_flow.vector_field(x, beta=b))
    assert_close(jitted(2.0), token_flow.vector_field(x, beta=2.0))


@pytest.mark.slow
def test_hundred_thousand_particles_fit_in_blocks():
    # A dense [n, n] float32 interaction would take 40 GB; blocks of 2048 keys take n * 2048 * 4
    # bytes = 0.8 GB. Some rows are checked against the equation in float64 numpy.
    n, beta = 100_000, 4.0
    x = _sphere(np.random.default_rng(12), n, 3, jnp.float32)
    field = jax.jit(lambda x: token_flow.vector_field(x, beta=beta, block_size=2048))
    got = np.asarray(field(x))
    x64 = np.asarray(x, np.float64)
    for i in range(0, n, 9973):
        w = np.exp(beta * (x64 @ x64[i] - 1))
        y = w @ x64 / w.sum()
        assert_close(got[i], y - (x64[i] @ y) * x64[i], jnp.float32)


@pytest.mark.parametrize("normalized", [True, False])
@pytest.mark.parametrize("with_maps", [False, True])
def test_blocked_field_over_several_query_tiles(monkeypatch, normalized, with_maps):
    # Tiles of 64 logits: with 8 keys a block, 8 queries a tile, 5 tiles (the last one padded).
    monkeypatch.setattr(token_flow, "_TILE", 64)
    rng = np.random.default_rng(13)
    x = _sphere(rng, 37, 3)
    maps = _maps(rng, 3, jnp.float64) if with_maps else {}
    expected = token_flow.vector_field_reference(x, 3.0, normalized, **maps)
    got = token_flow.vector_field(x, beta=3.0, normalized=normalized, block_size=8, **maps)
    assert_close(got, expected)


@pytest.mark.parametrize("block", [None, 16])
def test_usa_with_identity_maps_does_not_overflow_in_the_sum(block):
    # The sums are shifted by beta (every row's own logit): at beta = 90 in float32 each weight
    # exp(90 <x_i, x_j>) of nearby tokens overflows (exp(88.7) is the largest float32), but the
    # shifted sum times exp(90) / n does not; it equals the float64 reference.
    rng = np.random.default_rng(14)
    x = rng.normal(size=(64, 3)) * 0.05 + np.array([1.0, 0.0, 0.0])
    x = jnp.asarray(x / np.linalg.norm(x, axis=1, keepdims=True))
    got = token_flow.vector_field(x.astype(jnp.float32), beta=90.0, normalized=False,
                                  block_size=block)  # fmt: skip
    expected = token_flow.vector_field_reference(x, 90.0, normalized=False)
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-3 * np.abs(expected).max())


def test_fourier_modes_and_the_linearized_solution():
    theta = np.random.default_rng(15).uniform(0, 2 * np.pi, 50)
    x = _circle(theta)
    ks = np.array([1, 2, 5])
    modes = np.asarray(token_flow.fourier_modes(x, ks))
    np.testing.assert_allclose(modes, np.exp(1j * ks[:, None] * theta).mean(1), atol=1e-12)
    np.testing.assert_allclose(token_flow.mode_amplitudes(x, ks), np.abs(modes), atol=1e-12)
    t = np.array([0.0, 0.3])
    got = token_flow.linearized_modes(modes[None], ks, t, 4.0, normalized=False)
    rates = token_flow.growth_rate(ks, 4.0, 2, normalized=False)
    assert got.shape == (1, 2, 3)
    np.testing.assert_allclose(got[0, 1], modes * np.exp(0.3 * rates), rtol=1e-14)
    with pytest.raises(ValueError, match=r"c0 must have shape \[\.\.\., K\]"):
        token_flow.linearized_modes(modes[:2], ks, t, 4.0)
    with pytest.raises(ValueError, match="t must be a 1-D array"):
        token_flow.linearized_modes(modes, ks, 0.3, 4.0)


def test_linearized_modes_follow_the_particles_at_first_order():
    # Equally spaced particles with a mode-3 perturbation of amplitude 1e-6: the particle mode
    # after one unit of 1 / lambda_3 equals the linearized solution to O(amplitude^2).
    beta, k, n = 4.0, 3, 90
    theta = 2 * np.pi * np.arange(n) / n
    x0 = _circle(theta + 2e-6 * np.sin(k * theta) / k)
    rate = float(token_flow.growth_rate(k, beta, 2, normalized=False))
    x1 = token_flow.integrate(x0, beta=beta, t1=1 / rate, n_steps=100, n_saves=1,
                              normalized=False).xs[-1]  # fmt: skip
    c0, c1 = (np.asarray(token_flow.fourier_modes(x, [k])) for x in (x0, x1))
    linear = token_flow.linearized_modes(c0, [k], [1 / rate], beta, normalized=False)[0]
    np.testing.assert_allclose(c1, linear, rtol=1e-5)


def test_circle_cluster_sizes():
    theta = np.concatenate([np.linspace(0, 0.05, 4), np.linspace(2, 2.03, 6), [4.0]])
    sizes, widths = token_flow.circle_cluster_sizes(_circle(theta), gap=0.1)
    assert sorted(np.asarray(sizes)[np.asarray(sizes) > 0].tolist()) == [1, 4, 6]
    assert np.asarray(sizes).sum() == 11
    np.testing.assert_allclose(sorted(np.asarray(widths)[:3]), [0.0, 0.03, 0.05], atol=1e-12)
    one, width = token_flow.circle_cluster_sizes(_circle(np.linspace(0, 2 * np.pi, 40, False)),
                                                 gap=0.5)  # fmt: skip
    assert int(one[0]) == 40 and float(width[0]) == pytest.approx(2 * np.pi)
