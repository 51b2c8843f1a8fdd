"""Tests of seqlab.ops.attention: RoPE properties, attention against a brute-force oracle, GQA,
window masking, decoding against a cache, dtypes and bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlab.ops.attention import attention, rope
from tests.conftest import assert_close, tolerance


def _normal(seed, shape, dtype=jnp.float64):
    # numpy draws: jax.random would compile a sampler for every new shape
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _brute_force(q, k, v, q_pos, k_pos, window, scale):
    """Per-query numpy softmax over the visible keys; GQA by explicit head index."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, length, heads, _ = q.shape
    groups = heads // k.shape[2]
    out = np.zeros((batch, length, heads, v.shape[-1]))
    for b in range(batch):
        for t in range(length):
            for h in range(heads):
                seen = [
                    s
                    for s in range(k.shape[1])
                    if k_pos[s] <= q_pos[t] and (window is None or q_pos[t] - k_pos[s] < window)
                ]
                scores = np.array([scale * q[b, t, h] @ k[b, s, h // groups] for s in seen])
                p = np.exp(scores - scores.max())
                p /= p.sum()
                out[b, t, h] = sum(pi * v[b, s, h // groups] for pi, s in zip(p, seen, strict=True))
    return out


# ---------------------------------------------------------------------------------------------
# RoPE


def test_rope_preserves_norm_and_is_identity_at_zero():
    x = _normal(0, (2, 6, 3, 8))
    y = rope(x, jnp.arange(6, dtype=jnp.int32) * 37)
    assert_close(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1))
    assert_close(rope(x, jnp.zeros((2, 6), jnp.int32)), x)


@given(shift=st.integers(-50, 1000), theta=st.sampled_from([10.0, 10000.0, 500000.0]))
def test_rope_scores_depend_only_on_position_differences(shift, theta):
    q, k = _normal(1, (1, 5, 2, 8)), _normal(2, (1, 5, 2, 8))
    pos = jnp.array([0, 3, 4, 9, 60], jnp.int32) + 50

    def scores(p):
        qr, kr = rope(q, p, theta=theta), rope(k, p, theta=theta)
        return jnp.einsum("bthd,bshd->bhts", qr, kr)

    # Rotations by angles ~1e3 lose ~1e-13 relative in float64.
    np.testing.assert_allclose(scores(pos + shift), scores(pos), rtol=1e-9, atol=1e-9)


def test_rope_batched_positions_and_dtype():
    x = _normal(3, (2, 4, 1, 6))
    pos = jnp.array([[0, 1, 2, 3], [5, 6, 7, 8]], jnp.int32)
    y = rope(x, pos)
    assert_close(y[1], rope(x[1:], pos[1])[0])
    x16 = x.astype(jnp.bfloat16)
    y16 = rope(x16, pos)
    assert y16.dtype == jnp.bfloat16
    assert_close(y16, rope(x16.astype(jnp.float32), pos), jnp.bfloat16)


# ---------------------------------------------------------------------------------------------
# attention


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_attention_matches_brute_force(window, kv_heads):
    q = _normal(4, (2, 6, 4, 4))
    k, v = _normal(5, (2, 6, kv_heads, 4)), _normal(6, (2, 6, kv_heads, 4))
    pos = jnp.arange(6, dtype=jnp.int32)
    out = attention(q, k, v, q_positions=pos, k_positions=pos, window=window, scale=0.7)
    assert out.shape == (2, 6, 4, 4)
    assert_close(out, _brute_force(q, k, v, pos, pos, window, 0.7))


def test_gqa_equals_repeated_heads():
    q = _normal(7, (2, 5, 6, 4))
    k, v = _normal(8, (2, 5, 2, 4)), _normal(9, (2, 5, 2, 3))  # value width may differ
    pos = jnp.arange(5, dtype=jnp.int32)
    kw = dict(q_positions=pos, k_positions=pos, window=4)
    grouped = attention(q, k, v, **kw)
    repeated = attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), **kw)
    assert grouped.shape == (2, 5, 6, 3)
    assert_close(grouped, repeated)


@pytest.mark.parametrize("window", [None, 3])
def test_keys_outside_the_mask_have_zero_influence(window):
    """d out[t] / d (k, v)[s] is exactly zero for future keys and keys out of the window, and
    nonzero for every visible key."""
    length = 7
    q, k, v = (
        _normal(10, (1, length, 2, 4)),
        _normal(11, (1, length, 2, 4)),
        _normal(12, (1, 7, 2, 4)),
    )
    pos = jnp.arange(length, dtype=jnp.int32)

    def out(k, v):  # [T]: one scalar per query
        return attention(q, k, v, q_positions=pos, k_positions=pos, window=window)[0].sum((1, 2))

    jk, jv = jax.jacrev(out, argnums=(0, 1))(k, v)  # [T, 1, S, HKV, D]
    influence = np.abs(np.asarray(jk)).sum((1, 3, 4)) + np.abs(np.asarray(jv)).sum((1, 3, 4))
    t, s = np.meshgrid(np.arange(length), np.arange(length), indexing="ij")
    seen = (s <= t) & ((t - s < window) if window is not None else True)
    np.testing.assert_array_equal(influence > 0, seen)


def test_decoding_query_against_ring_buffer_equals_full_attention():
    """One query at position 9 against keys stored out of order (a wrapped ring buffer) with a
    never-written slot equals the last row of full attention."""
    q, k, v = _normal(13, (2, 10, 4, 4)), _normal(14, (2, 10, 2, 4)), _normal(15, (2, 10, 2, 4))
    pos = jnp.arange(10, dtype=jnp.int32)
    full = attention(q, k, v, q_positions=pos, k_positions=pos, window=4)

    slots = jnp.array([8, 9, 6, 7, 0], jnp.int32)  # positions in ring order, plus a stale one
    unwritten = jnp.iinfo(jnp.int32).max
    ring_pos = jnp.array([8, 9, 6, 7, unwritten], jnp.int32)
    one = attention(
        q[:, 9:], k[:, slots], v[:, slots], q_positions=pos[9:], k_positions=ring_pos, window=4
    )
    assert_close(one[:, 0], full[:, 9])
    # the stale slot holding position 0 is excluded by the window too
    stale = attention(
        q[:, 9:], k[:, slots], v[:, slots], q_positions=pos[9:], k_positions=slots, window=4
    )
    assert_close(stale[:, 0], full[:, 9])


def test_query_without_visible_keys_returns_zeros_and_finite_gradients():
    q, k, v = _normal(16, (1, 2, 1, 4)), _normal(17, (1, 3, 1, 4)), _normal(18, (1, 3, 1, 4))
    kw = dict(q_positions=jnp.array([0, 5], jnp.int32), k_positions=jnp.array([1, 2, 3], jnp.int32))
    out = attention(q, k, v, **kw)
    assert_close(out[0, 0], jnp.zeros((1, 4)))
    grads = jax.grad(lambda q, k, v: attention(q, k, v, **kw).sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_low_precision_matches_float64(dtype):
    q, k, v = (_normal(s, (2, 8, 4, 8)).astype(dtype) for s in (19, 20, 21))
    pos = jnp.arange(8, dtype=jnp.int32)
    out = attention(q, k, v, q_positions=pos, k_positions=pos, window=5)
    assert out.dtype == dtype
    ref = attention(
        *(a.astype(jnp.float64) for a in (q, k, v)), q_positions=pos, k_positions=pos, window=5
    )
    np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(ref), **tolerance(dtype))


def test_attention_is_jittable_with_traced_positions():
    q, k, v = _normal(22, (1, 4, 2, 4)), _normal(23, (1, 4, 2, 4)), _normal(24, (1, 4, 2, 4))
    pos = jnp.arange(4, dtype=jnp.int32)
    fn = jax.jit(lambda p: attention(q, k, v, q_positions=p, k_positions=p, window=2))
    assert_close(fn(pos), attention(q, k, v, q_positions=pos, k_positions=pos, window=2))


# ---------------------------------------------------------------------------------------------
# bad inputs


def _qkv():
    return _normal(0, (2, 4, 4, 8)), _normal(1, (2, 4, 2, 8)), _normal(2, (2, 4, 2, 8))


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (dict(q=jnp.zeros((2, 4, 8))), "q"),
        (dict(q=jnp.zeros((2, 4, 4, 8), jnp.int32)), "q"),
        (dict(k=jnp.zeros((2, 4, 2, 6))), "k"),
        (dict(k=jnp.zeros((3, 4, 2, 8))), "k"),
        (dict(k=jnp.zeros((2, 4, 3, 8)), v=jnp.zeros((2, 4, 3, 8))), "k"),
        (dict(v=jnp.zeros((2, 5, 2, 8))), "v"),
        (dict(q_positions=jnp.zeros((4,))), "q_positions"),
        (dict(q_positions=jnp.zeros((3,), jnp.int32)), "q_positions"),
        (dict(k_positions=jnp.zeros((1, 4), jnp.int32)), "k_positions"),
        (dict(window=0), "window"),
    ],
)
def test_attention_rejects_bad_inputs(change, name):
    q, k, v = _qkv()
    pos = jnp.arange(4, dtype=jnp.int32)
    kw = dict(q=q, k=k, v=v, q_positions=pos, k_positions=pos, window=None) | change
    with pytest.raises(ValueError, match=name):
        attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


def test_rope_rejects_bad_inputs():
    with pytest.raises(ValueError, match="x"):
        rope(jnp.zeros((1, 4, 2, 5)), jnp.arange(4, dtype=jnp.int32))
    with pytest.raises(ValueError, match="x"):
        rope(jnp.zeros((4, 2, 6)), jnp.arange(4, dtype=jnp.int32))
    with pytest.raises(ValueError, match="positions"):
        rope(jnp.zeros((1, 4, 2, 6)), jnp.arange(5, dtype=jnp.int32))
    with pytest.raises(ValueError, match="positions"):
        rope(jnp.zeros((1, 4, 2, 6)), jnp.arange(4.0))
