"""Op-specific tests of `seqlab.ops.gated_delta`: the recurrent reference and the chunked form
against numpy loops of the gated delta rule, and the ungated case (DeltaNet) against
retrieve-and-replace. The contract shared with the other recurrences (fast vs reference with
every gradient, segments, grouping, decoding steps, dtypes, bad inputs) is
`tests/ops/test_recurrences.py`."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from seqlab.ops.gated_delta import gated_delta_rule
from tests.conftest import assert_close
from tests.ops.recurrences import (
    brute_force_cases,
    inputs,
    jitted,
    numpy_recurrence,
    segment_rows,
    ungated,
)


def brute_force(x, segment_ids=None, scale=None):
    """Numpy loop of `S_t = exp(g_t)(I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`,
    `o_t = S_t^T (scale q_t)`; `scale` defaults to `K ** -0.5`."""
    scale = x["q"].shape[-1] ** -0.5 if scale is None else scale

    def write(s, tok):
        k, beta = tok["k"], tok["beta"]
        s = np.exp(tok["g"]) * (np.eye(len(k)) - beta * np.outer(k, k)) @ s
        return s + beta * np.outer(k, tok["v"])

    return numpy_recurrence(dict(x, q=np.asarray(x["q"], np.float64) * scale), write, segment_ids)


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
    seg = np.asarray(segment_rows([[4, 5], [9]]))
    got = jitted(gated_delta_rule, impl="recurrent")(**x, segment_ids=seg)
    assert_close(got, brute_force(x, seg))


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_ungated_equals_delta_rule(impl):
    x = ungated(inputs(1, 2, 37, 2, 2, 4, 3, jnp.float64))
    run = jitted(gated_delta_rule, scale=0.7, chunk_size=16, impl=impl)
    assert_close(run(**x), ungated_delta(x, 0.7))


@given(brute_force_cases(inputs))
def test_chunked_matches_brute_force_hypothesis(case):
    """The chunked form against the numpy loop over shapes, grouped heads and packed documents
    (one compile per draw)."""
    x, chunk, seg = case
    run = jitted(gated_delta_rule, impl="chunked", chunk_size=chunk)
    assert_close(run(**x, segment_ids=jnp.asarray(seg)), brute_force(x, seg))
