"""Op-specific tests of `seqlab.ops.ssd` (Mamba-2): the recurrent reference and the chunked form
against numpy loops, the ungated case against causal linear attention, and the Pallas names it
does not have yet. The contract shared with the other recurrences (fast vs reference with every
gradient, segments, grouping, decoding steps, dtypes, bad inputs) is
`tests/ops/test_recurrences.py`."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from seqlab.ops.ssd import ssd
from tests.conftest import assert_close
from tests.ops.recurrences import (
    brute_force_cases,
    jitted,
    numpy_recurrence,
    segment_rows,
    ssd_inputs,
    ungated,
)


def brute_force(x, segment_ids=None):
    """Numpy loop of `S_t = exp(g_t) S_{t-1} + k_t v_t^T`, `o_t = S_t^T q_t`."""

    def write(s, tok):
        return np.exp(tok["g"]) * s + np.outer(tok["k"], tok["v"])

    return numpy_recurrence(x, write, segment_ids)


def causal_linear_attention(x):
    """g = 0: `o = tril(Q K^T) V + Q S_0` as one masked matrix product per head (no recurrence)."""
    q, k, v, s0 = (np.asarray(x[n], np.float64) for n in ("q", "k", "v", "initial_state"))
    t = q.shape[1]
    scores = np.einsum("bihk,bjhk->bhij", q, k) * np.tril(np.ones((t, t)))
    o = np.einsum("bhij,bjhv->bihv", scores, v) + np.einsum("bihk,bhkv->bihv", q, s0)
    return o, s0 + np.einsum("bthk,bthv->bhkv", k, v)


def test_recurrent_matches_brute_force():
    x = ssd_inputs(0, 2, 9, 1, 2, 3, 2, jnp.float64)
    seg = np.asarray(segment_rows([[4, 5], [9]]))
    assert_close(jitted(ssd, impl="recurrent")(**x, segment_ids=seg), brute_force(x, seg))


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_ungated_equals_causal_linear_attention(impl):
    x = ungated(ssd_inputs(1, 2, 37, 2, 2, 4, 3, jnp.float64))
    assert_close(jitted(ssd, chunk_size=16, impl=impl)(**x), causal_linear_attention(x))


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu", "pallas"])
def test_pallas_impls_not_implemented(impl):
    x = ssd_inputs(17, 1, 8, 1, 1, 4, 3, jnp.float32)
    with pytest.raises(NotImplementedError, match="no Pallas kernel yet"):
        ssd(**x, impl=impl)


@given(brute_force_cases(ssd_inputs))
def test_chunked_matches_brute_force_hypothesis(case):
    """The chunked form against the numpy loop over shapes, grouped heads and packed documents
    (one compile per draw)."""
    x, chunk, seg = case
    run = jitted(ssd, impl="chunked", chunk_size=chunk)
    assert_close(run(**x, segment_ids=jnp.asarray(seg)), brute_force(x, np.asarray(seg)))
