"""Mamba-1 mixer: shapes, decoding, causality, polarization, init, sign constraints, token
reordering, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.mamba import Mamba
from seqlab.ops.selective_scan import selective_scan
from seqlab.ops.softsort import soft_sort
from tests.conftest import assert_close, tolerance

D_MODEL, D_STATE, D_INNER = 8, 4, 16
SHAPE = (2, 16, D_MODEL)  # one input shape throughout, so eager ops compile once


def _x(dtype=jnp.float32, shape=SHAPE):
    """Standard normal input (drawn by numpy: an eager jax.random draw compiles per shape)."""
    return jnp.asarray(np.random.default_rng(0).standard_normal(shape)).astype(dtype)


@functools.cache
def _params(polarize: tuple[int, int], constrained: bool):
    """Initial float32 parameters, shared by every test whose module has these parameter shapes.

    Initial values depend only on the parameter shapes, not on the compute dtype, the sign of the
    constraint, `polar_zero_A` or `impl`; sharing them keeps the compilations few.
    """
    m = Mamba(
        D_MODEL, d_state=D_STATE, polarize=polarize, sign_constraint="pos" if constrained else None
    )
    return jax.jit(m.init)(jax.random.key(1), jnp.zeros(SHAPE, jnp.float32))


def _model(**kwargs):
    """`(Mamba(D_MODEL, d_state=D_STATE, **kwargs), its initial parameters)`."""
    m = Mamba(D_MODEL, d_state=D_STATE, **kwargs)
    params = _params(m.polarize, m.sign_constraint is not None)
    return m, jax.tree.map(lambda a: a.astype(m.param_dtype), params)


def _decode(module, params, x):
    """Run `step` token by token over `x: [B, T, D]`; returns `[B, T, D]` and the final cache."""
    cache = module.init_cache(x.shape[0], x.shape[1])
    step = jax.jit(functools.partial(module.apply, method="step"))
    ys = []
    for t in range(x.shape[1]):
        y_t, cache = step(params, x[:, t], cache)
        ys.append(y_t)
    return jnp.stack(ys, axis=1), cache


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"polarize": (1, 1)},
        {"polarize": (1, 1), "sign_constraint": "pos"},
        {"polarize": (1, 1), "sign_constraint": "neg"},
        {"polarize": (1, 1), "sign_constraint": "mixed"},
    ],
    ids=["plain", "polar", "polar-pos", "polar-neg", "polar-mixed"],
)
def test_step_matches_call(kwargs):
    m, params = _model(**kwargs)
    x = _x()
    y_steps, cache = _decode(m, params, x)
    assert_close(y_steps, m.apply(params, x))
    # The decoded SSM state is the scan's final state.
    _, h_last = selective_scan(**m.apply(params, x, method="op_inputs"), return_final_state=True)
    assert_close(cache["state"], h_last)


def test_call_is_out_proj_of_op_inputs():
    m, params = _model(polarize=(1, 1))
    x = _x()
    inner = selective_scan(**m.apply(params, x, method="op_inputs"))
    assert_close(m.apply(params, x), inner @ params["params"]["out_proj"]["kernel"])


def test_polarized_channels_are_fixed_constants():
    m, params = _model(polarize=(1, 1), polar_zero_A=-50.0)
    assert params["params"]["A_log"].shape == (D_INNER, D_STATE)  # only the learnable channels
    A = m.apply(params, _x(), method="op_inputs")["A"]
    assert A.shape == (D_INNER, 1 + D_STATE + 1)
    np.testing.assert_array_equal(A[:, 0], 0.0)
    np.testing.assert_array_equal(A[:, -1], -50.0)

    def grad_of_channels(channels):
        return jax.grad(lambda p: m.apply(p, method="state_matrix")[:, channels].sum())(params)

    # No gradient path from any parameter to the fixed channels; one to each learnable channel.
    assert all(np.all(g == 0) for g in jax.tree.leaves(grad_of_channels(np.array([0, -1]))))
    assert np.all(grad_of_channels(np.arange(1, 1 + D_STATE))["params"]["A_log"] != 0)


def test_one_channel_carries_state_without_decay():
    """d h_L / d u_s = dt_s B_s[n] exp(A[n] sum_{k>s} dt_k); for the 1-channel, dt_s B_s exactly."""
    m, params = _model(polarize=(1, 1), dtype=jnp.float64)
    x = _x(jnp.float64)
    kw = m.apply(params, x, method="op_inputs")

    @jax.jit
    @jax.jacrev
    def influence(u):
        """`[N, b, L, d]`: d h_L[b, d, n] / d u[b, s, d] (batch rows and channels don't mix)."""
        _, h = selective_scan(**{**kw, "u": u}, return_final_state=True)
        return h.sum(axis=(0, 1))

    got = influence(kw["u"])
    dt = jax.nn.softplus(kw["delta"] + kw["delta_bias"])  # [b, L, d]
    later = jnp.cumsum(dt[:, ::-1], axis=1)[:, ::-1] - dt  # sum_{k > s} dt_k
    decay = jnp.exp(kw["A"].T[:, :, None, None] * jnp.moveaxis(later, -1, 0))  # [n, d, b, L]
    undecayed = dt * jnp.moveaxis(kw["B"], -1, 0)[..., None]  # [n, b, L, d]: dt_s B_s[n]
    assert_close(got, jnp.moveaxis(decay, 1, -1) * undecayed)
    np.testing.assert_array_equal(kw["A"][:, 0], 0.0)
    assert_close(got[0], undecayed[0])  # the 1-channel: no decay at any distance
    # The learnable channels do forget: the first token's influence has decayed.
    assert np.all(np.abs(got[1:-1, :, 0]) < np.abs(undecayed[1:-1, :, 0]))


def _init_setup_params(module):
    """The parameters `setup` creates (all but in_proj/out_proj), without tracing a forward pass."""
    return module.init(jax.random.key(0), method="state_matrix")["params"]


def test_init_ranges():
    d_model = 40  # dt_rank = ceil(40 / 16) = 3, d_inner = 80
    m = Mamba(d_model, d_state=6, dt_min=2e-3, dt_max=5e-2)
    p = _init_setup_params(m)
    assert m.effective_dt_rank == 3 and p["dt_proj"].shape == (3, 80)
    assert np.all(np.abs(p["dt_proj"]) <= 3**-0.5)
    dt = np.asarray(jax.nn.softplus(p["dt_bias"].astype(jnp.float64)))
    rel = 1e-5  # inverse softplus in float32, then softplus
    assert np.all(dt >= 2e-3 * (1 - rel)) and np.all(dt <= 5e-2 * (1 + rel))
    assert dt.max() / dt.min() > 5  # spread over the log-uniform range, not one value
    A = m.apply({"params": p}, method="state_matrix")
    np.testing.assert_allclose(A, -np.broadcast_to(np.arange(1.0, 7.0), (80, 6)), rtol=1e-6)
    np.testing.assert_array_equal(p["D"], 1.0)
    # The floor wins over a smaller sampled dt.
    floored = Mamba(d_model, d_state=6, dt_min=1e-5, dt_max=2e-5, dt_init_floor=1e-3)
    dt = jax.nn.softplus(_init_setup_params(floored)["dt_bias"])
    np.testing.assert_allclose(dt, 1e-3, rtol=1e-5)


def test_default_dt_rank():
    assert (
        Mamba(16).effective_dt_rank == 1
        and Mamba(17).effective_dt_rank == 2
        and Mamba(17, dt_rank=5).effective_dt_rank == 5
    )


@pytest.mark.parametrize("constraint", [None, "pos", "neg", "mixed"])
def test_interaction_matrix(constraint):
    n_total = 1 + D_STATE + 1
    m, params = _model(
        polarize=(1, 1), sign_constraint=constraint, dtype=jnp.float64, param_dtype=jnp.float64
    )
    M = np.asarray(m.apply(params, method="interaction_matrix"))
    assert M.shape == (D_INNER, D_INNER) and M.dtype == np.float64
    assert np.linalg.matrix_rank(M) <= n_total
    # M is the map the scan sees: C_l . B_j = u_l^T M u_j.
    kw = m.apply(params, _x(jnp.float64), method="op_inputs")
    got = jnp.einsum("bln,bjn->blj", kw["C"], kw["B"])
    assert_close(got, jnp.einsum("bld,de,bje->blj", kw["u"], M, kw["u"]))
    if constraint is None:
        return
    assert_close(M, M.T)
    eig = np.linalg.eigvalsh(M)
    eps = 1e-9 * np.abs(eig).max()
    inertia = int(np.sum(eig > eps)), int(np.sum(eig < -eps))
    # Sylvester's law: M = S_C^T diag(lambda) S_C with S_C of full rank has lambda's inertia.
    assert inertia == {"pos": (n_total, 0), "neg": (0, n_total), "mixed": (3, 3)}[constraint]
    _, s_b, s_c = m.apply(params, method="x_proj_maps")
    lam = np.diag(np.asarray(s_b))  # S_C has a unit diagonal, so diag(S_B) = lambda
    np.testing.assert_allclose(s_b, lam[:, None] * np.asarray(s_c))
    assert np.all(np.abs(lam) >= 0.7)


def test_bfloat16_close_to_float32():
    m32, params = _model(polarize=(1, 1))
    m16, _ = _model(polarize=(1, 1), dtype=jnp.bfloat16)
    x = _x()
    y32 = m32.apply(params, x)
    y16 = m16.apply(params, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    # bfloat16 roundings in series (in_proj, conv, x_proj, dt_proj, out_proj): bound the relative
    # error norm, since single entries near zero have no relative accuracy.
    err = np.linalg.norm(np.asarray(y16, np.float32) - y32) / np.linalg.norm(y32)
    assert err < tolerance(jnp.bfloat16)["rtol"]


def test_bad_impl_raises():
    _, params = _model(polarize=(1, 1))
    with pytest.raises(ValueError, match="impl"):  # impl reaches selective_scan
        Mamba(D_MODEL, d_state=D_STATE, polarize=(1, 1), impl="fast").apply(params, _x())


# -- token reordering (Vo et al., Refinement 2) ----------------------------------------------


def _reorder_model(dtype=jnp.float32, **kwargs):
    m = Mamba(D_MODEL, d_state=D_STATE, reorder=True, dtype=dtype, param_dtype=dtype, **kwargs)
    return m, jax.jit(m.init)(jax.random.key(2), jnp.zeros(SHAPE, dtype))


def _reordered_reference(m, params, x):
    """Hard reordering spelled out: argsort the scores, gather u and z, scan, scatter back."""
    p = params["params"]
    u, z = m.apply(params, x, method="_tokens")
    s_dt = p["x_proj"][:, : m.effective_dt_rank]  # [d_inner, rank]
    scores = (u @ s_dt @ p["dt_proj"] + p["dt_bias"]) @ p["importance"]  # [B, T]
    order = jnp.argsort(scores, axis=-1, stable=True)
    gather = jax.vmap(lambda v, o: v[o])
    inputs = m.apply(params, gather(u, order), gather(z, order), method="_scan_inputs")
    y_sorted = selective_scan(**inputs)
    y = jax.vmap(lambda v, o: jnp.zeros_like(v).at[o].set(v))(y_sorted, order)
    return y @ p["out_proj"]["kernel"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_hard_reorder_is_sort_scan_unsort(dtype):
    m, params = _reorder_model(dtype, reorder_hard=True)
    x = _x(dtype)
    got, want, perm = jax.jit(
        lambda p, x: (
            m.apply(p, x),
            _reordered_reference(m, p, x),
            m.apply(p, x, method="sort_matrix"),
        )
    )(params, x)
    assert_close(got, want)
    perm = np.asarray(perm)
    np.testing.assert_array_equal(np.sort(perm, axis=-1)[..., -1], 1.0)  # one 1 per row
    np.testing.assert_array_equal(perm.sum(axis=1), 1.0)  # and per column: a permutation


def test_soft_sort_approaches_the_permutation_and_mixes_at_tau_one():
    s = jnp.asarray(np.random.default_rng(3).normal(size=(2, 9)))
    exact = jax.nn.one_hot(jnp.argsort(s, axis=-1), 9)
    cold, warm = soft_sort(s, 1e-3), soft_sort(s, 1.0)
    np.testing.assert_allclose(np.asarray(cold.sum(-1)), 1.0, rtol=1e-12)
    # Not a fast path but an approximation: neighbours leak exp(-gap / tau) into each row.
    np.testing.assert_allclose(np.asarray(cold @ s[..., None])[..., 0], np.sort(s, -1), atol=1e-6)
    np.testing.assert_allclose(np.asarray(cold), np.asarray(exact), atol=1e-6)
    assert float(jnp.max(warm)) < 0.9  # tau = 1 (the authors' value) averages tokens
    hard = soft_sort(s, 1.0, hard=True)
    np.testing.assert_array_equal(np.asarray(hard), np.asarray(exact))
    # Straight-through: the hard forward carries the soft gradient.
    g_hard = jax.grad(lambda s: (soft_sort(s, 1.0, hard=True) * exact).sum())(s)
    g_soft = jax.grad(lambda s: (soft_sort(s, 1.0) * exact).sum())(s)
    assert_close(g_hard, g_soft)
    # Ties still give a permutation.
    tied = soft_sort(jnp.zeros((1, 4)), 0.1, hard=True)
    np.testing.assert_array_equal(np.asarray(tied[0]), np.eye(4))


def test_soft_reorder_trains_the_importance_weights():
    m, params = _reorder_model(jnp.float64, reorder_tau=0.5)
    x = _x(jnp.float64)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(m.apply(p, x) ** 2)))(params)
    assert float(jnp.abs(grads["params"]["importance"]).max()) > 0
    # A cold soft sort agrees with the hard one up to its softness.
    cold = m.clone(reorder_tau=1e-6)
    hard = m.clone(reorder_hard=True)
    got, want = jax.jit(lambda p: (cold.apply(p, x), hard.apply(p, x)))(params)
    assert_close(got, want)


def test_reorder_cannot_decode():
    m, params = _reorder_model()
    with pytest.raises(NotImplementedError, match="cannot decode"):
        m.init_cache(2, 16)
    with pytest.raises(NotImplementedError, match="cannot decode"):
        m.apply(params, _x()[:, 0], {}, method="step")
    with pytest.raises(ValueError, match="reorder_tau"):
        Mamba(D_MODEL, reorder=True, reorder_tau=0.0)
    plain, plain_params = _model()
    with pytest.raises(ValueError, match="reorder=True"):
        plain.apply(plain_params, _x(), method="sort_matrix")
