"""The contract of every chunked linear recurrence, checked on each row of
`tests/ops/recurrences.RECURRENCES` (`gated_delta_rule`, `ssd`, `kda`, `gdn2`,
`gated_delta_product`): every fast impl against the
`lax.scan` reference in float64 and float32 (outputs, final state, every gradient) over odd lengths
(T = 1, T not a multiple of the chunk), chunk sizes, initial states, packed segments and extreme
gates; inert padding; grouped heads; the decoding step token by token; causality; dtypes; backward
memory without per-token states; a split run equals one run; packed segments equal separate
documents; no gradient crosses a segment; bad inputs raise `ValueError` naming the argument from
shapes and dtypes alone. The rows of kda, gdn2 and gated_delta_product (`recurrences.FAMILY`) run
their float64 comparison with packed documents, float32, decoding steps and bad inputs by default,
the rest of the matrix with -m slow (`recurrences.family_slow`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import assert_close, tolerance
from tests.ops.recurrences import (
    CHUNK_SIZES,
    FAMILY,
    RECURRENCES,
    abstract,
    assert_all_close,
    documents,
    family_slow,
    forward_and_grads,
    jitted,
    segment_rows,
)

OPS = [pytest.param(rec, id=rec.name) for rec in RECURRENCES]
GROUPED = [pytest.param(rec, id=rec.name) for rec in RECURRENCES if rec.grouped]
FAST = [
    pytest.param(rec, impl, id=f"{rec.name}-{impl}") for rec in RECURRENCES for impl in rec.fast
]
IMPLS = [
    pytest.param(rec, impl, id=f"{rec.name}-{impl}")
    for rec in RECURRENCES
    for impl in (rec.reference, *rec.fast)
]


def assert_fast_matches_reference(rec, impl, x, dtype, chunk, *, segment_ids=None, tol=None):
    """`impl` against `rec.reference` on `x`: output, final state and every gradient."""
    op = functools.partial(rec.op, segment_ids=segment_ids)
    want = forward_and_grads(functools.partial(op, impl=rec.reference), x)
    got = forward_and_grads(functools.partial(op, impl=impl, chunk_size=chunk), x)
    assert_all_close(got, want, dtype, **(tol or {}))


# ------------------------------------------------------------------ fast impls vs reference


# Every T once (1, around the chunk, several chunks) and every chunk size once; packed segments
# with a reset inside a chunk at T = 65. The full cross-product is slow-marked below. The
# delta-rule family's rows (the chunked core of the gated delta rule, `seqlab.ops._delta`, which
# the gated_delta_rule row covers on every case) run the packed-segments case by default, the
# others with -m slow.
LENGTHS = [(1, 16, None), (63, 32, None), (64, 64, None), (65, 64, [[21, 44]]), (300, 128, None)]


def float64_cases():
    for rec, impl in (p.values for p in FAST):
        for t, chunk, lengths in LENGTHS:
            slow = rec.name in FAMILY and lengths is None
            yield pytest.param(
                rec, impl, t, chunk, lengths, id=f"{rec.name}-{impl}-{t}-{chunk}",
                marks=[pytest.mark.slow] if slow else [],
            )  # fmt: skip


@pytest.mark.parametrize(("rec", "impl", "t", "chunk", "lengths"), list(float64_cases()))
def test_fast_matches_reference_float64(rec, impl, t, chunk, lengths):
    x = rec.inputs(t, 1, t, 1, 2, 8, 4, jnp.float64)
    seg = None if lengths is None else segment_rows(lengths)
    assert_fast_matches_reference(rec, impl, x, jnp.float64, chunk, segment_ids=seg)


@pytest.mark.parametrize(("rec", "impl"), FAST)
def test_fast_matches_reference_float32(rec, impl):
    """float32 against the float64 reference (the truth, not another float32 rounding of it); no
    initial state; packed segments with a different reset per row."""
    x = rec.inputs(5, 2, 65, 1, 1, 8, 4, jnp.float32, initial_state=False)
    seg = segment_rows([[20, 45], [65]])
    op = functools.partial(rec.op, segment_ids=seg)
    got = forward_and_grads(functools.partial(op, impl=impl, chunk_size=16), x)
    x64 = jax.tree.map(lambda a: a.astype(jnp.float64), x)
    want = forward_and_grads(functools.partial(op, impl=rec.reference), x64)
    # A gradient entry is a sum over the sequence of terms of the array's scale (|dg| up to ~50
    # here), so it carries their float32 rounding, not its own: an entry of 0.07 erred by 3.6e-5
    # (elementwise 5e-4), on one CPU, for the float32 reference and the chunked form alike
    # (both within 1.6e-6 of the array's scale). `atol` is the table's, scaled by each array's
    # largest entry.
    for name, a, e in zip(("o", "final_state", *("d" + n for n in sorted(x))),
                          jax.tree.leaves(got), jax.tree.leaves(want), strict=True):  # fmt: skip
        tol = tolerance(jnp.float32)
        scale = max(1.0, float(np.abs(np.asarray(e)).max()))
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(e), rtol=tol["rtol"], atol=tol["atol"] * scale,
            err_msg=name,
        )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("initial_state", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("chunk", CHUNK_SIZES)
@pytest.mark.parametrize("t", [1, 63, 64, 65, 300])
@pytest.mark.parametrize(("rec", "impl"), FAST)
def test_fast_matches_reference_full(rec, impl, t, chunk, dtype, initial_state):
    # float32 over 300 steps: the two orders of summation drift apart by ~5e-4 relative in the
    # gradients (measured), beyond the per-dtype table meant for short comparisons.
    tol = dict(rtol=2e-3, atol=2e-4) if dtype == jnp.float32 and t > 65 else None
    x = rec.inputs(t, 2, t, 2, 4, 16, 8, dtype, initial_state=initial_state)
    assert_fast_matches_reference(rec, impl, x, dtype, chunk, tol=tol)


@pytest.mark.parametrize(("rec", "impl"), family_slow(FAST))
def test_extreme_gates_finite_and_correct(rec, impl):
    """Half the gates exactly 0, the others summing to -80 within each 64-token chunk."""
    x = rec.inputs(7, 1, 128, 1, 2, 8, 4, jnp.float32)
    g = np.zeros((1, 128, 2), np.float32)
    g[:, 1::2] = -80.0 / 32
    x["g"] = jnp.asarray(
        np.broadcast_to(g.reshape(g.shape + (1,) * (x["g"].ndim - 3)), x["g"].shape)
    )
    got = forward_and_grads(functools.partial(rec.op, impl=impl, chunk_size=64), x)
    for leaf in jax.tree.leaves(got):
        assert np.isfinite(np.asarray(leaf)).all()
    want = forward_and_grads(functools.partial(rec.op, impl=rec.reference), x)
    assert_all_close(got, want, jnp.float32)


@pytest.mark.parametrize(("rec", "impl"), family_slow(FAST))
def test_padding_is_inert(rec, impl):
    """T = 40 in chunks of 32 equals the same tokens followed by 24 explicit inert tokens."""
    x = rec.inputs(6, 1, 40, 1, 1, 4, 3, jnp.float64)
    padded = {
        n: a if n == "initial_state" else jnp.pad(a, [(0, 0), (0, 24)] + [(0, 0)] * (a.ndim - 2))
        for n, a in x.items()
    }
    padded["q"] = padded["q"].at[:, 40:].set(1.0)  # reading the state does not change it
    padded["v"] = padded["v"].at[:, 40:].set(1.0)  # written with k = 0 (and beta = 0): nothing
    run = jitted(rec.op, chunk_size=32, impl=impl)
    o_pad, s_pad = run(**padded)
    assert_close((o_pad[:, :40], s_pad), run(**x))


# ------------------------------------------------------------------------- structure of T, H


@pytest.mark.parametrize("rec", GROUPED)
def test_grouped_heads_equal_repeated_qk(rec):
    x = rec.inputs(11, 2, 40, 2, 6, 4, 3, jnp.float64)
    rep = dict(x, q=jnp.repeat(x["q"], 3, axis=2), k=jnp.repeat(x["k"], 3, axis=2))
    run = jitted(rec.op, chunk_size=16)
    assert_close(run(**x), run(**rep))


@pytest.mark.parametrize(("rec", "impl"), IMPLS)
def test_step_equals_forward(rec, impl):
    """The decoding step, token by token, gives every output and the final state of `impl`."""
    x = rec.inputs(12, 2, 9, 1, 2, 4, 3, jnp.float64)
    o, s = jitted(rec.op, impl=impl, **rec.options)(**x)
    step = jax.jit(functools.partial(rec.step, **rec.options))
    state = x["initial_state"]
    for t in range(9):
        o_t, state = step(*(x[n][:, t] for n in rec.per_token), state)
        assert_close(o_t, o[:, t])
    assert_close(state, s)


@pytest.mark.parametrize("rec", family_slow(OPS))
def test_gradient_causality(rec):
    """The output at t = 40 does not depend on any input after it (chunk 32: mid-chunk)."""
    x = rec.inputs(13, 1, 70, 1, 1, 4, 3, jnp.float64)

    def out_at(x):
        return jnp.sum(rec.op(**x, chunk_size=32)[0][:, 40] ** 2)

    grads = jax.jit(jax.grad(out_at))(x)
    for arg in rec.per_token:
        assert np.all(grads[arg][:, 41:] == 0), arg
        assert np.any(grads[arg][:, :41] != 0), arg


@pytest.mark.parametrize("rec", family_slow(OPS))
def test_split_run_equals_one_run(rec):
    x = rec.inputs(8, 2, 80, 1, 2, 4, 3, jnp.float64)
    run = jitted(rec.op, chunk_size=32)
    o, s = run(**x)
    first = {n: a if n == "initial_state" else a[:, :40] for n, a in x.items()}
    second = {n: a[:, 40:] for n, a in x.items() if n != "initial_state"}
    o1, s1 = run(**first)
    o2, s2 = run(**second, initial_state=s1)
    assert_close((jnp.concatenate([o1, o2], axis=1), s2), (o, s))


# ---------------------------------------------------------------------------------- segments


@pytest.mark.parametrize(("rec", "impl"), family_slow(IMPLS))
def test_packed_segments_equal_separate_documents(rec, impl):
    lengths = [[30, 30, 30], [60, 30]]
    x = rec.inputs(9, 2, 90, 1, 2, 4, 3, jnp.float64)
    run = jitted(rec.op, chunk_size=32, impl=impl)
    o, s = run(**x, segment_ids=segment_rows(lengths))
    for row, start, length, doc in documents(x, lengths):
        state = x["initial_state"][row : row + 1] if start == 0 else jnp.zeros_like(s[:1])
        o_doc, s_doc = run(**doc, initial_state=state)
        assert_close(o[row : row + 1, start : start + length], o_doc)
        if start + length == sum(lengths[row]):
            assert_close(s[row : row + 1], s_doc)


@pytest.mark.parametrize("rec", family_slow(OPS))
def test_gradients_do_not_leak_across_segments(rec):
    """A loss on the middle document's outputs has exactly zero gradient outside that document."""
    seg = segment_rows([[30, 30, 30]])
    x = rec.inputs(10, 1, 90, 1, 2, 4, 3, jnp.float64)

    def loss(x):
        o, _ = rec.op(**x, segment_ids=seg, chunk_size=32)
        return jnp.sum(jnp.sin(o[:, 30:60]))

    grads = jax.jit(jax.grad(loss))(x)
    for arg in rec.per_token:
        outside = np.concatenate([grads[arg][:, :30], grads[arg][:, 60:]], axis=1)
        assert np.all(outside == 0), arg
        assert np.any(grads[arg][:, 30:60] != 0), arg
    assert np.all(grads["initial_state"] == 0)


# ------------------------------------------------------------------------ dtypes and memory


@pytest.mark.parametrize(("rec", "impl"), family_slow(IMPLS))
def test_dtypes(rec, impl):
    """bfloat16 in: output in v.dtype, state float32; float64 in: both float64; the decoding
    step likewise; no final state unless asked."""
    for dtype, state_dtype in ((jnp.bfloat16, jnp.float32), (jnp.float64, jnp.float64)):
        x = rec.inputs(14, 1, 20, 1, 1, 4, 3, dtype)
        o, s = jitted(rec.op, chunk_size=16, impl=impl)(**x)
        assert (o.dtype, s.dtype) == (dtype, state_dtype)
        o_t, s_t = jax.eval_shape(rec.step, *(x[n][:, 0] for n in rec.per_token), s)
        assert (o_t.dtype, s_t.dtype) == (dtype, state_dtype)
    assert jax.eval_shape(functools.partial(rec.op, impl=impl), **x)[1] is None


@pytest.mark.parametrize(("rec", "impl"), family_slow(FAST))
def test_backward_memory_does_not_store_per_token_states(rec, impl):
    """The compiled forward+backward grows by less than half a float32 [K, V] state per token
    (per write: Gated DeltaProduct writes several per token)."""
    dk = dv = 128

    def backward_bytes(t):
        x = rec.inputs(0, 1, t, 1, 1, dk, dv, jnp.float32)
        loss = functools.partial(rec.op, chunk_size=64, impl=impl)
        grad = jax.jit(jax.grad(lambda x: jnp.sum(loss(**x)[0])))
        stats = grad.lower(x).compile().memory_analysis()
        return stats.temp_size_in_bytes + stats.output_size_in_bytes

    per_write = (backward_bytes(2048) - backward_bytes(1024)) / 1024 / rec.writes_per_token
    assert 0 < per_write < dk * dv * 4 / 2


# -------------------------------------------------------------------------------- bad inputs


def bad_inputs(rec):
    """`(argument, change)`: each change breaks one argument of valid inputs of `rec`."""
    gates = [n for n in rec.per_token if n not in ("q", "k", "v", "g")]
    return [
        ("q", lambda x: dict(x, q=x["q"][0])),
        ("k", lambda x: dict(x, k=x["k"][:, :, :1])),
        ("v", lambda x: dict(x, v=x["v"][:, :, :3])),  # HV = 3 is not a multiple of H = 2
        ("g", lambda x: dict(x, g=x["g"][:, :-1])),
        *((n, lambda x, n=n: dict(x, **{n: x[n][..., None]})) for n in gates),
        ("initial_state", lambda x: dict(x, initial_state=x["initial_state"][:, :2])),
        ("segment_ids", lambda x: dict(x, segment_ids=jnp.zeros((2, 8), jnp.float32))),
        ("chunk_size", lambda x: dict(x, chunk_size=0)),
        ("impl", lambda x: dict(x, impl="fast")),
        ("q", lambda x: dict(x, q=x["q"].astype(jnp.int32))),
    ]


@pytest.mark.parametrize(
    ("rec", "name", "change"),
    [
        pytest.param(rec, name, change, id=f"{rec.name}-{name}-{i}")
        for rec in RECURRENCES
        for i, (name, change) in enumerate(bad_inputs(rec))
    ],
)
def test_bad_inputs_raise_value_error_naming_argument(rec, name, change):
    """On abstract arrays (`recurrences.abstract`): the error comes before any array work."""
    x = change(rec.inputs(15, 2, 8, 2, 4, 4, 3, jnp.float32))
    with pytest.raises(ValueError, match=rf"^{name} "):
        rec.op(**abstract(x))


@pytest.mark.parametrize("rec", [r for r in OPS if not r.values[0].adapted])
def test_bad_step_inputs(rec):
    x = rec.inputs(16, 2, 1, 1, 2, 4, 3, jnp.float32)
    args = {f"{n}_t": x[n][:, 0] for n in rec.per_token}
    cases = [(n, dict(args, **{n: a[..., None]})) for n, a in args.items()]
    for name, bad in [*cases, ("state", args)]:
        state = x["initial_state"][:, :1] if name == "state" else x["initial_state"]
        with pytest.raises(ValueError, match=rf"^{name} "):
            rec.step(*abstract(bad).values(), abstract({"state": state})["state"])
