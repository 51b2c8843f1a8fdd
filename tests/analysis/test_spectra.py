"""Weight-product spectra: the small-side eigenvalues are those of the full [D, D] product (numpy
reference), per head; known spectra along depth; gradients; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from seqlab.analysis import spectra
from tests.conftest import assert_close, tolerance

DTYPES = [jnp.float32, jnp.float64]


def _normal(seed, shape, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _match(small, full):
    """Pair each eigenvalue of `small: [k]` with one of `full: [n >= k]` (least total distance);
    returns `(full values paired with small, the n - k unpaired full values)`."""
    small, full = np.asarray(small, np.complex128), np.asarray(full, np.complex128)
    rows, cols = linear_sum_assignment(np.abs(small[:, None] - full[None, :]))
    paired = np.empty_like(small)
    paired[rows] = full[cols]
    return paired, np.delete(full, cols)


def _assert_eigs_close(got, want, dtype, scale):
    """Complex eigenvalues agree within the dtype's tolerance, relative to the matrix `scale`
    (an eigenvalue's error is of order `eps * ||M||`, not `eps * |lambda|`)."""
    tol = tolerance(dtype)
    np.testing.assert_allclose(got.real, want.real, rtol=tol["rtol"], atol=tol["rtol"] * scale)
    np.testing.assert_allclose(got.imag, want.imag, rtol=tol["rtol"], atol=tol["rtol"] * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "k"), [(8, 3), (3, 8), (5, 5), (1, 4)])
def test_product_eigenvalues_are_the_full_products_nonzero_ones(dtype, d, k):
    a, b = _normal(0, (2, d, k), dtype), _normal(1, (2, k, d), dtype)
    got = jax.jit(spectra.product_eigenvalues)(a, b)
    assert got.shape == (2, min(d, k))
    assert got.dtype == (jnp.complex64 if dtype == jnp.float32 else jnp.complex128)
    for i in range(2):
        full_matrix = np.asarray(a[i], np.float64) @ np.asarray(b[i], np.float64)
        full = np.linalg.eigvals(full_matrix)
        paired, rest = _match(got[i], full)
        scale = np.linalg.norm(full_matrix, 2)
        _assert_eigs_close(np.asarray(got[i]), paired, dtype, scale)
        # Sylvester: the other D - K eigenvalues of a b are zero.
        np.testing.assert_allclose(np.abs(rest), 0.0, atol=10 * tolerance(dtype)["rtol"] * scale)
        mags = np.abs(np.asarray(got[i]))
        assert np.all(mags[:-1] >= mags[1:]), "sorted by decreasing magnitude"


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_products_match_numpy(dtype):
    d, h, k, f = 6, 3, 2, 10
    wq, wk, wv = (_normal(s, (d, h, k), dtype) for s in (2, 3, 4))
    wo, w1, w2 = _normal(5, (h, k, d), dtype), _normal(6, (d, f), dtype), _normal(7, (f, d), dtype)
    got = jax.jit(
        lambda: (
            spectra.qk_eigenvalues(wq, wk),
            spectra.ov_eigenvalues(wv, wo),
            spectra.mlp_eigenvalues(w1, w2),
        )
    )()
    np64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    products = {
        "qk": [np64(wq[:, i]) @ np64(wk[:, i]).T for i in range(h)],  # W_Q^h (W_K^h)^T
        "ov": [np64(wv[:, i]) @ np64(wo[i]) for i in range(h)],  # W_V^h W_O^h
        "mlp": [np64(w1) @ np64(w2)],
    }
    for (name, mats), eigs in zip(products.items(), got, strict=True):
        eigs = np.asarray(eigs).reshape(len(mats), -1)
        assert eigs.shape[1] == min(d, k if name != "mlp" else f), name
        for m, e in zip(mats, eigs, strict=True):
            paired, rest = _match(e, np.linalg.eigvals(m))
            _assert_eigs_close(e, paired, dtype, np.linalg.norm(m, 2))
            assert rest.size == m.shape[0] - e.size


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_matches_the_trace_identity(dtype):
    # sum_i lambda_i^2 = tr((a b)^2) over all eigenvalues, and the zero ones add nothing.
    a, b = _normal(8, (6, 3), dtype), _normal(9, (3, 6), dtype)
    via_eigs = lambda a, b: jnp.sum(spectra.product_eigenvalues(a, b) ** 2).real  # noqa: E731
    via_trace = lambda a, b: jnp.trace((a @ b) @ (a @ b))  # noqa: E731
    got = jax.jit(jax.value_and_grad(via_eigs, argnums=(0, 1)))(a, b)
    want = jax.value_and_grad(via_trace, argnums=(0, 1))(a, b)
    assert_close(got, want, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_spectra_along_depth_of_a_known_family(dtype):
    # W_Q^h = c_h(t) U_h, W_K^h = U_h with orthonormal columns: QK^h = c_h(t) U_h U_h^T has the
    # eigenvalue c_h(t) K times. W_V^h = U_h, W_O^h = -(1 + t) U_h^T: OV^h eigenvalue -(1 + t).
    # W_1 = [I_D, 0] s(t), W_2 = [diag(r); 0]: W_1 W_2 = s(t) diag(r).
    d, h, k, f = 5, 2, 2, 7
    u = np.linalg.qr(np.random.default_rng(0).normal(size=(h, d, k)))[0]  # [H, D, K]
    u = jnp.asarray(np.transpose(u, (1, 0, 2)), dtype)  # [D, H, K]
    r = jnp.asarray([3.0, -2.0, 1.0, 0.5, -0.25], dtype)
    c = lambda t: jnp.stack([1.0 + t, 2.0 - t])  # noqa: E731

    def weights_fn(t):
        return dict(
            wq=u * c(t)[None, :, None],
            wk=u,
            wv=u,
            wo=-(1.0 + t) * jnp.transpose(u, (1, 2, 0)),
            w1=jnp.eye(d, f, dtype=dtype) * jnp.exp(t),
            w2=jnp.eye(f, d, dtype=dtype) * r,
            ln_attn=jnp.ones(d, dtype),  # extra entries are ignored
        )

    ts = jnp.linspace(0.0, 1.0, 4, dtype=dtype)
    got = jax.jit(spectra.spectra_along_depth, static_argnums=0)(weights_fn, ts)
    assert got["qk"].shape == (4, h, k) and got["mlp"].shape == (4, d)
    want_qk = jnp.broadcast_to(jax.vmap(c)(ts)[:, :, None], (4, h, k))
    assert_close(got["qk"].real, want_qk)
    assert_close(got["ov"].real, jnp.broadcast_to(-(1.0 + ts)[:, None, None], (4, h, k)))
    assert_close(got["mlp"].real, jnp.exp(ts)[:, None] * r[None])
    for v in got.values():
        assert_close(v.imag, jnp.zeros_like(v.real))
    mags = spectra.magnitudes(got["qk"])
    assert_close(mags["spectral_radius"], jnp.abs(want_qk).max(-1))
    assert_close(mags["mean_abs"], jnp.abs(want_qk).mean(-1))


def test_bad_input_names_the_argument():
    x = jnp.ones((4, 2, 3))
    with pytest.raises(ValueError, match="wk must have shape"):
        spectra.qk_eigenvalues(x, jnp.ones((4, 2, 2)))
    with pytest.raises(ValueError, match=r"wo must have shape \[H, K, D\]"):
        spectra.ov_eigenvalues(x, jnp.ones((2, 3, 3)))
    with pytest.raises(ValueError, match=r"w2 must have shape \[F, D\]"):
        spectra.mlp_eigenvalues(jnp.ones((4, 6)), jnp.ones((4, 6)))
    with pytest.raises(ValueError, match=r"b: \[\.\.\., K, D\]"):
        spectra.product_eigenvalues(jnp.ones((3, 2)), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="a must be a floating"):
        spectra.product_eigenvalues(jnp.ones((3, 2), jnp.int32), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"missing \['w1', 'w2'\]"):
        spectra.spectra_along_depth(
            lambda t: dict(wq=x, wk=x, wv=x, wo=jnp.ones((2, 3, 4))), jnp.zeros(2)
        )
