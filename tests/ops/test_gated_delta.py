"""Tests of `seqlab.ops.gated_delta`: the recurrent reference against brute force, the chunked form
against the reference (outputs, final state, every gradient), segments, grouping, decoding steps.

The helpers (`inputs`, `jitted`, `forward_and_grads`, `assert_all_close`, `segment_rows`) are
shared with `test_ssd.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlab.ops.gated_delta import gated_delta_rule, gated_delta_rule_step
from tests.conftest import assert_close

CHUNK_SIZES = (16, 32, 64, 128)


def inputs(seed, b, t, h, hv, dk, dv, dtype, *, beta=True, initial_state=True):
    """Random well-conditioned inputs: unit-norm k, beta in (0, 1), log-gates in log(0.8..1)."""
    r = np.random.default_rng(seed)
    k = r.normal(size=(b, t, h, dk))
    x = dict(
        q=r.normal(size=(b, t, h, dk)),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=r.normal(size=(b, t, hv, dv)),
        g=np.log(r.uniform(0.8, 1.0, size=(b, t, hv))),
    )
    if beta:
        x["beta"] = r.uniform(0.05, 1.0, size=(b, t, hv))
    if initial_state:
        x["initial_state"] = r.normal(size=(b, hv, dk, dv))
    return {name: jnp.asarray(a, dtype) for name, a in x.items()}


def forward_and_grads(fn, x):
    """`(o, final_state)` of `fn(**x, output_final_state=True)` and the gradients of a generic
    loss on both with respect to every array in `x` (jitted)."""

    def loss(x):
        o, s = fn(**x, output_final_state=True)
        return jnp.sum(jnp.sin(o) * o) + jnp.sum(jnp.cos(s) * s), (o, s)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    return out, grads


def assert_all_close(got, want, dtype, **tol):
    (o, s), grads = got
    (o_ref, s_ref), grads_ref = want
    check = functools.partial(np.testing.assert_allclose, **tol) if tol else None
    pairs = [("o", o, o_ref), ("final_state", s, s_ref)]
    pairs += [(f"d{name}", grads[name], grads_ref[name]) for name in grads_ref]
    for name, a, e in pairs:
        if check is None:
            assert_close(a, e, dtype, err_msg=name)
        else:
            check(np.asarray(a, np.float64), np.asarray(e, np.float64), err_msg=name)


def jitted(op, **static):
    """`jax.jit` of `op(..., output_final_state=True, **static)`: one compile per shape."""
    return jax.jit(functools.partial(op, output_final_state=True, **static))


def segment_rows(lengths_per_row):
    """`segment_ids [B, T]` int32 from document lengths per row (ids need not be increasing)."""
    rows = [np.repeat(np.arange(len(ls))[::-1] * 7 + 3, ls) for ls in lengths_per_row]
    return jnp.asarray(np.stack(rows), jnp.int32)


# -------------------------------------------------------------------------------- references


def brute_force(x, scale, segment_ids=None):
    """Numpy loop of `S_t = exp(g_t)(I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`."""
    names = ("q", "k", "v", "g", "beta", "initial_state")
    q, k, v, g, beta, s0 = (np.asarray(x[n], np.float64) for n in names)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2:]
    o = np.zeros((b, t, hv, dv))
    final = np.zeros((b, hv, dk, dv))
    for bi in range(b):
        for j in range(hv):
            s = s0[bi, j].copy()
            for ti in range(t):
                if (
                    segment_ids is not None
                    and ti
                    and segment_ids[bi, ti] != segment_ids[bi, ti - 1]
                ):
                    s = np.zeros_like(s)
                kt = k[bi, ti, j // (hv // h)]
                qt = q[bi, ti, j // (hv // h)]
                s = np.exp(g[bi, ti, j]) * (np.eye(dk) - beta[bi, ti, j] * np.outer(kt, kt)) @ s
                s = s + beta[bi, ti, j] * np.outer(kt, v[bi, ti, j])
                o[bi, ti, j] = s.T @ (scale * qt)
            final[bi, j] = s
    return o, final


def ungated_delta(x, scale):
    """DeltaNet (g = 0) as retrieve-and-replace: `v_old = S^T k`, `S += k (beta (v - v_old))^T`
    written as `S - k v_old^T + k (beta v + (1 - beta) v_old)^T`."""
    names = ("q", "k", "v", "beta", "initial_state")
    q, k, v, beta, s0 = (np.asarray(x[n], np.float64) for n in names)
    o = np.zeros(v.shape)
    s = s0.copy()  # [B, H, K, V]
    for ti in range(q.shape[1]):
        kt, qt, vt, bt = k[:, ti], q[:, ti], v[:, ti], beta[:, ti, :, None]
        v_old = np.einsum("bhkv,bhk->bhv", s, kt)
        v_mix = bt * vt + (1 - bt) * v_old
        s = s + np.einsum("bhk,bhv->bhkv", kt, v_mix - v_old)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", s, scale * qt)
    return o, s


def test_recurrent_matches_brute_force():
    x = inputs(0, 2, 9, 1, 2, 3, 2, jnp.float64)
    seg = segment_rows([[4, 5], [9]])
    o, s = jitted(gated_delta_rule, impl="recurrent")(**x, segment_ids=seg)
    o_ref, s_ref = brute_force(x, 3**-0.5, np.asarray(seg))
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_ungated_equals_delta_rule(impl):
    x = inputs(1, 2, 37, 2, 2, 4, 3, jnp.float64)
    x["g"] = jnp.zeros_like(x["g"])
    o, s = jitted(gated_delta_rule, scale=0.7, chunk_size=16, impl=impl)(**x)
    o_ref, s_ref = ungated_delta(x, 0.7)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


# ------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("q", lambda x: dict(x, q=x["q"][0])),
        ("k", lambda x: dict(x, k=x["k"][:, :, :1])),
        ("v", lambda x: dict(x, v=x["v"][:, :, :3])),  # HV = 3 is not a multiple of H = 2
        ("g", lambda x: dict(x, g=x["g"][:, :-1])),
        ("beta", lambda x: dict(x, beta=x["beta"][..., None])),
        ("initial_state", lambda x: dict(x, initial_state=x["initial_state"][:, :2])),
        ("segment_ids", lambda x: dict(x, segment_ids=jnp.zeros((2, 8), jnp.float32))),
        ("chunk_size", lambda x: dict(x, chunk_size=0)),
        ("impl", lambda x: dict(x, impl="fast")),
        ("q", lambda x: dict(x, q=x["q"].astype(jnp.int32))),
    ],
)
def test_bad_inputs_raise_value_error_naming_argument(name, change):
    x = inputs(15, 2, 8, 2, 4, 4, 3, jnp.float32)
    with pytest.raises(ValueError, match=name):
        gated_delta_rule(**change(x))


def test_bad_step_inputs():
    x = inputs(16, 2, 1, 1, 2, 4, 3, jnp.float32)
    args = [x[n][:, 0] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule_step(*args, x["initial_state"][:, :1])
    with pytest.raises(ValueError, match="beta_t"):
        gated_delta_rule_step(*args[:4], args[4][:, :1], x["initial_state"])


# ------------------------------------------------------------------------------ hypothesis


@given(
    b=st.integers(1, 2),
    t=st.integers(1, 40),
    h=st.integers(1, 2),
    groups=st.integers(1, 2),
    dk=st.integers(1, 5),
    dv=st.integers(1, 4),
    chunk=st.sampled_from([16, 32]),
    n_docs=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_brute_force_hypothesis(b, t, h, groups, dk, dv, chunk, n_docs, seed):
    """The chunked form against the numpy brute force (one compile per draw)."""
    x = inputs(seed, b, t, h, h * groups, dk, dv, jnp.float64)
    r = np.random.default_rng(seed)
    seg = np.sort(r.integers(0, n_docs, size=(b, t)), axis=1).astype(np.int32)
    run = jitted(gated_delta_rule, impl="chunked", chunk_size=chunk)
    o, s = run(**x, segment_ids=jnp.asarray(seg))
    o_ref, s_ref = brute_force(x, dk**-0.5, seg)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
