"""Tests of `seqlab.ops.ssd` (Mamba-2): the recurrent reference against brute force, the chunked
form against the reference (outputs, final state, every gradient), segments, grouping, decoding.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlab.ops.ssd import ssd, ssd_step
from tests.conftest import assert_close
from tests.ops.test_gated_delta import inputs as _inputs
from tests.ops.test_gated_delta import (
    jitted,
    segment_rows,
)

inputs = functools.partial(_inputs, beta=False)


# -------------------------------------------------------------------------------- references


def brute_force(x, segment_ids=None):
    """Numpy loop of `S_t = exp(g_t) S_{t-1} + k_t v_t^T`, `o_t = S_t^T q_t`."""
    q, k, v, g, s0 = (np.asarray(x[n], np.float64) for n in ("q", "k", "v", "g", "initial_state"))
    b, t, h, _ = q.shape
    hv = v.shape[2]
    o = np.zeros(v.shape)
    final = np.zeros(s0.shape)
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
                s = np.exp(g[bi, ti, j]) * s + np.outer(k[bi, ti, j // (hv // h)], v[bi, ti, j])
                o[bi, ti, j] = s.T @ q[bi, ti, j // (hv // h)]
            final[bi, j] = s
    return o, final


def causal_linear_attention(x):
    """g = 0: `o = tril(Q K^T) V + Q S_0` as one masked matrix product per head (no recurrence)."""
    q, k, v, s0 = (np.asarray(x[n], np.float64) for n in ("q", "k", "v", "initial_state"))
    t = q.shape[1]
    scores = np.einsum("bihk,bjhk->bhij", q, k) * np.tril(np.ones((t, t)))
    o = np.einsum("bhij,bjhv->bihv", scores, v) + np.einsum("bihk,bhkv->bihv", q, s0)
    return o, s0 + np.einsum("bthk,bthv->bhkv", k, v)


def test_recurrent_matches_brute_force():
    x = inputs(0, 2, 9, 1, 2, 3, 2, jnp.float64)
    seg = segment_rows([[4, 5], [9]])
    o, s = jitted(ssd, impl="recurrent")(**x, segment_ids=seg)
    o_ref, s_ref = brute_force(x, np.asarray(seg))
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_ungated_equals_causal_linear_attention(impl):
    x = inputs(1, 2, 37, 2, 2, 4, 3, jnp.float64)
    x["g"] = jnp.zeros_like(x["g"])
    o, s = jitted(ssd, chunk_size=16, impl=impl)(**x)
    o_ref, s_ref = causal_linear_attention(x)
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
        ssd(**change(x))


def test_bad_step_inputs():
    x = inputs(16, 2, 1, 1, 2, 4, 3, jnp.float32)
    args = [x[n][:, 0] for n in ("q", "k", "v", "g")]
    with pytest.raises(ValueError, match="state"):
        ssd_step(*args, x["initial_state"][:, :1])
    with pytest.raises(ValueError, match="g_t"):
        ssd_step(*args[:3], args[3][:, :1], x["initial_state"])


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu", "pallas"])
def test_pallas_impls_not_implemented(impl):
    x = inputs(17, 1, 8, 1, 1, 4, 3, jnp.float32)
    with pytest.raises(NotImplementedError, match="no Pallas kernel yet"):
        ssd(**x, impl=impl)


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
    o, s = jitted(ssd, impl="chunked", chunk_size=chunk)(**x, segment_ids=jnp.asarray(seg))
    o_ref, s_ref = brute_force(x, seg)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
