"""Op-specific tests of the delta-rule family, `seqlab.ops.kda`, `gdn2`, `gated_delta_product`
and `kda_gate`: each op's recurrent reference and chunked form against a numpy loop of its
definition (hypothesis: shapes, grouped heads, packed documents), the reductions between them,
cumulative per-channel log-gates down to -1e4 inside a chunk, and trained-like inputs
(correlated keys, write strengths near 1) in float32 and bfloat16. The contract shared with the
other recurrences (every gradient against the reference, segments, decoding steps, dtypes,
memory, bad inputs) is `tests/ops/test_recurrences.py`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from seqlab.ops import (
    gated_delta_product,
    gated_delta_product_step,
    gated_delta_rule,
    gdn2,
    kda,
    kda_gate,
)
from tests.conftest import assert_close
from tests.ops import trained_like
from tests.ops.recurrences import (
    abstract,
    brute_force_cases,
    gdn2_inputs,
    inputs,
    jitted,
    kda_inputs,
    numpy_recurrence,
)


def brute_force(x, erase, write, segment_ids=None, scale=None):
    """Numpy loop of `S = Diag(exp(g)) S; S += k (write(tok) * v - S^T erase(tok))^T`,
    `o = S^T (scale q)` (g a scalar or per key channel)."""
    scale = x["q"].shape[-1] ** -0.5 if scale is None else scale

    def step(s, tok):
        s = np.exp(np.atleast_1d(tok["g"]))[:, None] * s
        u = write(tok) * tok["v"] - s.T @ erase(tok)
        return s + np.outer(tok["k"], u)

    return numpy_recurrence(dict(x, q=np.asarray(x["q"], np.float64) * scale), step, segment_ids)


kda_brute_force = functools.partial(
    brute_force, erase=lambda tok: tok["beta"] * tok["k"], write=lambda tok: tok["beta"]
)
gdn2_brute_force = functools.partial(
    brute_force, erase=lambda tok: tok["b"] * tok["k"], write=lambda tok: tok["w"]
)


def product_brute_force(q, k, v, g, beta, s0, *, n, scale):
    """Numpy loop of Gated DeltaProduct in its own layout (`k, v, beta` with `T n` rows)."""
    q, k, v, g, beta, s0 = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s0))
    b, t, h, _ = q.shape
    hv = v.shape[2]
    o, final = np.zeros((b, t, hv, v.shape[-1])), np.zeros(s0.shape)
    for bi in range(b):
        for j in range(hv):
            s = s0[bi, j].copy()
            for ti in range(t):
                s = np.exp(g[bi, ti, j]) * s
                for r in range(ti * n, ti * n + n):
                    key = k[bi, r, j // (hv // h)]
                    s = s + np.outer(key, beta[bi, r, j] * (v[bi, r, j] - s.T @ key))
                o[bi, ti, j] = s.T @ (scale * q[bi, ti, j // (hv // h)])
            final[bi, j] = s
    return o, final


def product_inputs(seed, b, t, h, hv, dk, dv, n, dtype):
    """Gated DeltaProduct's own layout: `inputs` over `T n` rows, q and g of the first T."""
    x = inputs(seed, b, t * n, h, hv, dk, dv, dtype)
    return dict(x, q=x["q"][:, :t], g=x["g"][:, :t])


# ------------------------------------------------------------------------ against numpy loops


@pytest.mark.parametrize(
    ("op", "make", "want"),
    [(kda, kda_inputs, kda_brute_force), (gdn2, gdn2_inputs, gdn2_brute_force)],
    ids=["kda", "gdn2"],
)
@settings(max_examples=4)  # two compilations per draw
@given(data=st.data())
def test_matches_brute_force_hypothesis(op, make, want, data):
    """Both impls against the numpy loop over shapes, grouped heads (KDA) and packed documents."""
    x, chunk, seg = data.draw(brute_force_cases(make))
    if op is gdn2:  # one value head per q/k head
        x = make(int(x["v"].shape[1]), *x["v"].shape[:2], x["v"].shape[2], x["v"].shape[2],
                 x["q"].shape[-1], x["v"].shape[-1], jnp.float64)  # fmt: skip
    for impl in ("recurrent", "chunked"):
        got = jitted(op, impl=impl, chunk_size=chunk)(**x, segment_ids=jnp.asarray(seg))
        assert_close(got, want(x, segment_ids=seg))


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
@pytest.mark.parametrize("n", [1, 3])
def test_product_matches_brute_force(impl, n):
    x = product_inputs(3, 2, 23, 1, 2, 4, 3, n, jnp.float64)
    got = jitted(gated_delta_product, impl=impl, chunk_size=16, num_householder=n)(**x)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    assert_close(got, product_brute_force(*(x[m] for m in names), n=n, scale=4**-0.5))


# --------------------------------------------------------------------- reductions between ops


def test_kda_with_equal_channels_is_the_gated_delta_rule():
    x = inputs(4, 2, 50, 1, 2, 6, 3, jnp.float64)
    per_channel = dict(x, g=jnp.repeat(x["g"][..., None], 6, axis=-1))
    assert_close(
        jitted(kda, chunk_size=16)(**per_channel), jitted(gated_delta_rule, chunk_size=16)(**x)
    )


def test_gdn2_with_beta_gates_is_kda():
    x = kda_inputs(5, 1, 50, 2, 2, 6, 3, jnp.float64)
    gates = dict(
        b=jnp.repeat(x["beta"][..., None], 6, -1), w=jnp.repeat(x["beta"][..., None], 3, -1)
    )
    gated = {n: a for n, a in x.items() if n != "beta"} | gates
    assert_close(jitted(gdn2, chunk_size=16)(**gated), jitted(kda, chunk_size=16)(**x))


def test_product_with_one_write_is_the_gated_delta_rule():
    x = inputs(6, 1, 40, 1, 2, 4, 3, jnp.float64)
    assert_close(
        jitted(gated_delta_product, impl="recurrent", num_householder=1)(**x),
        jitted(gated_delta_rule, impl="recurrent")(**x),
    )


# ------------------------------------------------------------------------------ extreme gates


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.float64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("op", ["kda", "gdn2"])
def test_cumulative_log_gates_down_to_minus_1e4_in_a_chunk(op, dtype):
    """Half the key channels decay by -300 per token (cumulative -9600 over 32 tokens, -1.9e4
    over the 64-token chunk), the others not at all, and one token wipes every channel: finite
    and equal to the recurrence, forward and every gradient."""
    make = kda_inputs if op == "kda" else gdn2_inputs
    x = make(7, 1, 100, 2, 2, 8, 4, dtype)
    g = np.zeros((1, 100, 2, 8))
    g[..., :4] = -300.0
    g[:, 70] = -1e4
    x["g"] = jnp.asarray(g, dtype)
    fn = {"kda": kda, "gdn2": gdn2}[op]
    got = trained_like.forward_and_grads(
        functools.partial(fn, impl="chunked", chunk_size=64, output_final_state=True), x
    )
    want = trained_like.forward_and_grads(
        functools.partial(fn, impl="recurrent", output_final_state=True), x
    )
    for name in want:
        assert np.isfinite(got[name]).all(), name
    assert_close(tuple(got.values()), tuple(want.values()), dtype)


# ------------------------------------------------------------------------- trained-like inputs


def trained_like_inputs(op, cosine, beta_low, seed=0):
    """Correlated unit keys (neighbouring cosine `cosine`), write strengths in (beta_low, 1),
    per-channel gates from a strong to no decay, packed segments (float64 numpy)."""
    case = trained_like.Case(cosine=cosine, beta=(beta_low, 1.0), segments=True, t=90, d=32)
    x = trained_like.inputs(case, b=1, h=2)
    rng = np.random.default_rng(seed)
    g_shape = x["q"].shape
    x["g"] = np.log(rng.uniform(0.05, 1.0, size=g_shape)) * (rng.uniform(size=g_shape) < 0.7)
    if op == "gdn2":
        x["b"] = rng.uniform(beta_low, 1.0, size=g_shape)
        x["w"] = rng.uniform(beta_low, 1.0, size=x["v"].shape)
        del x["beta"]
    if op == "gated_delta_product":  # two writes per token: keys and values of 2T rows
        writes = trained_like.inputs(dataclasses.replace(case, t=180, seed=1), b=1, h=2)
        x = {**x, **{n: writes[n] for n in ("k", "v", "beta")}}
        x["g"] = np.log(rng.uniform(0.05, 1.0, size=x["beta"][:, :90].shape))
    return x


OPS = {
    "kda": kda,
    "gdn2": gdn2,
    "gated_delta_product": functools.partial(gated_delta_product, num_householder=2),
}
# float32 against the float64 recurrence, relative RMS over outputs, state and every gradient:
# the gated delta rule's bound (tests/ops/test_gated_delta_trained_like.py).
F32_REL_RMS = 1e-4
BF16_REL_RMS = 3e-2  # q, k, v round at 2^-9; gradients sum many such products


def outputs_and_grads(fn, x):
    """`o`, the final state and the gradients of a fixed loss in both with respect to every
    floating argument, as float64 numpy arrays (`segment_ids` passed through)."""
    floats = {n: a for n, a in x.items() if n != "segment_ids"}

    def loss(floats):
        o, s = fn(**floats, segment_ids=x["segment_ids"], output_final_state=True)
        o, s = o.astype(s.dtype), s
        return jnp.sum(jnp.sin(o) * o) + jnp.sum(jnp.cos(s) * s), (o, s)

    (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(floats)
    out = {"o": o, "final_state": s, **{f"d{n}": g for n, g in grads.items()}}
    return {n: np.asarray(a).astype(np.float64) for n, a in out.items()}


@pytest.mark.parametrize(
    ("cosine", "beta_low"),
    [pytest.param(0.95, 0.9, marks=pytest.mark.slow), (0.99, 0.99)],
)
@pytest.mark.parametrize("op", list(OPS))
def test_trained_like_float32_and_bfloat16(op, cosine, beta_low):
    x = trained_like_inputs(op, cosine, beta_low)
    x["segment_ids"] = jnp.asarray(x["segment_ids"][:, :90], jnp.int32)
    want = outputs_and_grads(
        functools.partial(OPS[op], impl="recurrent"), trained_like.cast(x, jnp.float64)
    )
    for dtype, bound in ((jnp.float32, F32_REL_RMS), (jnp.bfloat16, BF16_REL_RMS)):
        got = outputs_and_grads(
            functools.partial(OPS[op], impl="chunked"), trained_like.cast(x, dtype)
        )
        err = {n: trained_like.rel_rms(got[n], want[n]) for n in want}
        assert max(err.values()) <= bound, (jnp.dtype(dtype).name, err)


# -------------------------------------------------------------------------------------- gates


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate_law_and_gradients(lower_bound):
    r = np.random.default_rng(8)
    x, a_log, bias = r.normal(size=(2, 3, 4, 5)) * 3, r.normal(size=4), r.normal(size=(4, 5))
    g = kda_gate(jnp.asarray(x), jnp.asarray(a_log), jnp.asarray(bias), lower_bound=lower_bound)
    z = x + bias
    rate = np.exp(a_log)[:, None]
    if lower_bound is None:
        want = -rate * np.logaddexp(0.0, z)
    else:
        want = lower_bound / (1 + np.exp(-rate * z))
        assert np.all((np.asarray(g) > lower_bound) & (np.asarray(g) < 0))
    assert_close(g, want)
    assert g.dtype == jnp.float64
    fn = functools.partial(kda_gate, lower_bound=lower_bound)
    check_grads(fn, (jnp.asarray(x), jnp.asarray(a_log), jnp.asarray(bias)), 1)
    assert (
        kda_gate(jnp.asarray(x, jnp.bfloat16), jnp.asarray(a_log, jnp.float32)).dtype == jnp.float32
    )


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    [
        ("x", (jnp.zeros(5), jnp.zeros(1)), {}),
        ("A_log", (jnp.zeros((2, 4, 5)), jnp.zeros(3)), {}),
        ("dt_bias", (jnp.zeros((2, 4, 5)), jnp.zeros(4), jnp.zeros((4, 4))), {}),
        ("lower_bound", (jnp.zeros((2, 4, 5)), jnp.zeros(4)), {"lower_bound": 1.0}),
        ("lower_bound", (jnp.zeros((2, 4, 5)), jnp.zeros(4)), {"lower_bound": float("nan")}),
    ],
)
def test_kda_gate_bad_inputs(name, args, kwargs):
    with pytest.raises(ValueError, match=rf"^{name} "):
        kda_gate(*args, **kwargs)


# ------------------------------------------------------------- Gated DeltaProduct's own layout


def test_product_bad_inputs_name_the_argument():
    x = abstract(product_inputs(9, 2, 8, 1, 2, 4, 3, 2, jnp.float32))
    cases = [
        ("num_householder", dict(num_householder=0)),
        ("k", dict(k=abstract({"k": jnp.zeros((2, 8, 1, 4))})["k"])),  # T rows, not T n
        ("beta", dict(beta=abstract({"b": jnp.zeros((2, 16, 3))})["b"])),
        ("g", dict(g=abstract({"g": jnp.zeros((2, 16, 2))})["g"])),
    ]
    for name, change in cases:
        with pytest.raises(ValueError, match=rf"^{name} "):
            gated_delta_product(**{**x, **change, "num_householder": 2, **change})
    step = (jnp.zeros((2, 1, 4)), jnp.zeros((2, 2, 1, 4)), jnp.zeros((2, 2, 2, 3)),
            jnp.zeros((2, 2)), jnp.zeros((2, 2, 2)), jnp.zeros((2, 2, 4, 3)))  # fmt: skip
    for i, name in enumerate(("q_t", "k_t", "v_t", "g_t", "beta_t", "state")):
        bad = list(step)
        bad[i] = bad[i][..., None]
        with pytest.raises(ValueError, match=rf"^{name} "):
            gated_delta_product_step(*bad)


def test_product_runs_on_the_gated_delta_kernel():
    """`impl="pallas"` (the TPU kernel of the gated delta rule on the expanded sequence,
    interpreted on CPU) against the float64 recurrence, output and final state, float32."""
    x = product_inputs(10, 1, 40, 1, 2, 16, 8, 2, jnp.float32)
    got = jitted(gated_delta_product, impl="pallas", chunk_size=32, num_householder=2)(**x)
    x64 = {n: a.astype(jnp.float64) for n, a in x.items()}
    want = jitted(gated_delta_product, impl="recurrent", num_householder=2)(**x64)
    assert_close(got, want, jnp.float32)
