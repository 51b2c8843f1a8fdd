"""Prefix-cache states (`state_every=N`) of the recurrent ops: the delta-rule family and SSD (every
row of `tests/ops/recurrences.RECURRENCES`) and the selective scan, for both impls of each.

`states[:, i]` is the final state of the op on the first `(i + 1) N` tokens; resuming on tokens
`[j N, T)` from `states[:, j - 1]` gives the outputs and final state of the full run there (with
packed documents, from zeros where a document starts at `j N`); gradients through `states` equal
those through the prefix runs; T is never a multiple of N; bad `state_every` and the impls that
cannot serve it raise."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.ops import selective_scan
from tests.conftest import assert_close
from tests.ops.recurrences import RECURRENCES, family_slow, segment_rows
from tests.ops.trained_like import correlated_keys

EVERY, CHUNK, LENGTH = 8, 4, 21  # two states, and five tokens after the last one
IMPLS = ("recurrent", "chunked")
# float32 gradients compile the heavier graphs a second time: in the slow run.
DTYPES = (pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.float64)
OPS = [pytest.param(rec, id=rec.name) for rec in RECURRENCES]
# Documents of 5, 11, 5 and 9, 12 tokens: row 0 starts one at t = 16 = 2 N, row 1 none at j N.
DOCUMENTS = ([5, 11, 5], [9, 12])


def make_inputs(rec, dtype, t=LENGTH):
    return rec.inputs(0, 2, t, 1, 2, 4, 3, dtype)


def tokens(x, start, stop=None):
    """The per-token arrays of `x` at tokens `start .. stop - 1`; other entries as they are."""
    return {n: a if n == "initial_state" else a[:, start:stop] for n, a in x.items()}


def run(rec, impl, state_every=None):
    """`rec.op(..., output_final_state=True)` with the test's chunk size, jitted (one per op)."""
    return _run(rec.name, impl, state_every)


@functools.cache
def _run(name, impl, state_every):
    (rec,) = (r for r in RECURRENCES if r.name == name)
    kw = {} if state_every is None else {"state_every": state_every}
    op = functools.partial(rec.op, output_final_state=True, chunk_size=CHUNK, impl=impl, **kw)
    return jax.jit(functools.partial(op, **rec.options))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rec", family_slow(OPS))
def test_states_and_resume_equal_full_run(rec, impl):
    """With packed documents; float64 (float32 in `test_gradients_through_states`)."""
    x = make_inputs(rec, jnp.float64)
    seg = segment_rows(DOCUMENTS)
    o, final, states = run(rec, impl, EVERY)(**x, segment_ids=seg)
    assert states.shape == (2, LENGTH // EVERY, 2, 4, 3) and states.dtype == jnp.float64
    assert_close((o, final), run(rec, "recurrent")(**x, segment_ids=seg))
    for i in range(LENGTH // EVERY):
        stop = (i + 1) * EVERY
        _, prefix_final = run(rec, "recurrent")(**tokens(x, 0, stop), segment_ids=seg[:, :stop])
        assert_close(states[:, i], prefix_final, err_msg=f"states[:, {i}]")
    for j in range(1, LENGTH // EVERY + 1):
        start = j * EVERY
        new_document = (seg[:, start] != seg[:, start - 1])[:, None, None, None]
        resume = jnp.where(new_document, 0.0, states[:, j - 1])
        rest = dict(tokens(x, start), initial_state=resume)
        o_rest, final_rest = run(rec, impl)(**rest, segment_ids=seg[:, start:])
        assert_close((o_rest, final_rest), (o[:, start:], final), err_msg=f"resumed at {start}")
    assert bool(new_document[0, 0, 0, 0]) and not bool(new_document[1, 0, 0, 0])  # both cases met


def test_trained_like_inputs_float32():
    """The chunked gated delta rule in float32 on a trained model's kind of inputs: keys with
    neighbouring cosine 0.97, write strengths in (0.95, 1) and log-gates down to -30 (a state
    all but erased): the states are the prefix runs' final states, resuming from them gives
    the full run."""
    (rec,) = (r for r in RECURRENCES if r.name == "gated_delta_rule")
    rng = np.random.default_rng(4)
    x = make_inputs(rec, jnp.float32)
    x["k"] = jnp.asarray(correlated_keys(rng, x["k"].shape, 0.97), jnp.float32)
    x["beta"] = jnp.asarray(rng.uniform(0.95, 1.0, x["beta"].shape), jnp.float32)
    x["g"] = jnp.asarray(np.where(rng.random(x["g"].shape) < 0.2, -30.0, -0.01), jnp.float32)
    o, final, states = run(rec, "chunked", EVERY)(**x)
    for i in range(LENGTH // EVERY):
        stop = (i + 1) * EVERY
        _, prefix_final = run(rec, "recurrent")(**tokens(x, 0, stop))
        assert_close(states[:, i], prefix_final, err_msg=f"states[:, {i}]")
        rest = dict(tokens(x, stop), initial_state=states[:, i])
        assert_close(run(rec, "chunked")(**rest), (o[:, stop:], final), err_msg=f"at {stop}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rec", family_slow(OPS))
def test_gradients_through_states(rec, impl, dtype):
    x = make_inputs(rec, dtype)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(2, 2, 2, 4, 3)), dtype)
    grads = grad_through_states(rec.name, impl)(x, weights)
    assert_close(grads, grad_through_prefixes(rec.name)(x, weights), dtype)
    assert all(bool(jnp.any(grads[n] != 0)) for n in ("k", "v", "g", "initial_state"))


@functools.cache
def grad_through_states(name, impl):
    """Jitted gradient of `sum(sin(states) * weights)` with respect to the op's arrays."""
    (rec,) = (r for r in RECURRENCES if r.name == name)

    def loss(x, weights):
        return jnp.sum(jnp.sin(run(rec, impl, EVERY)(**x)[2]) * weights)

    return jax.jit(jax.grad(loss))


@functools.cache
def grad_through_prefixes(name):
    """`grad_through_states` with the states replaced by the final states of the reference on
    the first `N` and `2 N` tokens."""
    (rec,) = (r for r in RECURRENCES if r.name == name)

    def loss(x, weights):
        prefixes = (tokens(x, 0, (i + 1) * EVERY) for i in range(LENGTH // EVERY))
        finals = [run(rec, "recurrent")(**prefix)[1] for prefix in prefixes]
        return jnp.sum(jnp.sin(jnp.stack(finals, axis=1)) * weights)

    return jax.jit(jax.grad(loss))


@pytest.mark.parametrize("rec", family_slow(OPS))
def test_auto_impl_is_chunked_and_states_may_be_empty(rec):
    x = make_inputs(rec, jnp.float64)
    assert_close(run(rec, None, EVERY)(**x), run(rec, "chunked", EVERY)(**x))
    assert run(rec, "recurrent", EVERY)(**make_inputs(rec, jnp.float32))[2].dtype == jnp.float32
    for impl in IMPLS:  # T < N: no state
        o, final, states = run(rec, impl, 24)(**x)
        assert states.shape == (2, 0, 2, 4, 3)
        assert_close((o, final), run(rec, "recurrent")(**x))


@pytest.mark.parametrize("rec", OPS)
def test_bad_state_every(rec):
    x = make_inputs(rec, jnp.float32)
    for bad in (0, -8, True, 8.0, "8"):
        for impl in IMPLS:
            with pytest.raises(ValueError, match="state_every"):
                rec.op(**x, chunk_size=CHUNK, impl=impl, state_every=bad)
    # Not a multiple of the chunk size (Gated DeltaProduct: in steps, 2 per token).
    bad = 3 if rec.writes_per_token == 1 else 1
    for impl in ("chunked", None):
        with pytest.raises(ValueError, match="state_every"):
            rec.op(**x, chunk_size=CHUNK, impl=impl, state_every=bad)
    assert rec.op(**x, chunk_size=CHUNK, impl="recurrent", state_every=bad)[2].shape[1] == (
        LENGTH // bad
    )
    for impl in ("pallas_tpu", "pallas_gpu", "pallas"):
        with pytest.raises(NotImplementedError, match="state_every"):
            rec.op(**x, chunk_size=16, impl=impl, state_every=16)


def test_product_counts_tokens_not_writes():
    """N = 2 tokens are 4 steps of the expanded sequence: a multiple of the chunk size 4."""
    (rec,) = (r for r in RECURRENCES if r.writes_per_token > 1)
    x = make_inputs(rec, jnp.float64)
    _, _, states = rec.op(**x, chunk_size=CHUNK, impl="chunked", state_every=2, **rec.options)
    assert states.shape[1] == LENGTH // 2
    _, prefix_final = run(rec, "recurrent")(**tokens(x, 0, 6))
    assert_close(states[:, 2], prefix_final)


# ---------------------------------------------------------------------------- selective scan


def scan_inputs(dtype, length=37):
    """Selective-scan inputs: `u, delta, z: [2, L, 3]`, `A: [3, 4]`, `B, C: [2, L, 4]`, `D: [3]`,
    `initial_state: [2, 3, 4]`."""
    r = np.random.default_rng(0)
    x = dict(
        u=r.normal(size=(2, length, 3)),
        delta=r.normal(size=(2, length, 3)),
        A=-r.uniform(0.5, 2.0, size=(3, 4)),
        B=r.normal(size=(2, length, 4)),
        C=r.normal(size=(2, length, 4)),
        D=r.normal(size=(3,)),
        z=r.normal(size=(2, length, 3)),
        initial_state=r.normal(size=(2, 3, 4)),
    )
    return {n: jnp.asarray(a, dtype) for n, a in x.items()}


def scan_tokens(x, start, stop=None):
    """`x` at tokens `start .. stop - 1` (the arrays with a time axis)."""
    timed = ("u", "delta", "B", "C", "z")
    return {n: a[:, start:stop] if n in timed else a for n, a in x.items()}


@functools.cache
def scan_run(impl, state_every=None):
    return jax.jit(
        functools.partial(
            selective_scan,
            delta_softplus=True,
            return_final_state=True,
            impl=impl,
            state_every=state_every,
        )
    )


SCAN_IMPLS = ("sequential", "parallel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("every", [6, 16])  # parallel: chunks of 2 and of 16 tokens
@pytest.mark.parametrize("impl", SCAN_IMPLS)
def test_scan_states_resume_and_gradients(impl, every, dtype):
    count, length = 2, 2 * every + 3
    x = scan_inputs(dtype, length)
    y, final, states = scan_run(impl, every)(**x)
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    assert states.shape == (2, count, 3, 4) and states.dtype == acc
    assert_close((y, final), scan_run("sequential")(**x), dtype)
    for i in range(count):
        _, prefix_final = scan_run("sequential")(**scan_tokens(x, 0, (i + 1) * every))
        assert_close(states[:, i], prefix_final, dtype, err_msg=f"states[:, {i}]")
    for j in range(1, count + 1):
        rest = dict(scan_tokens(x, j * every), initial_state=states[:, j - 1])
        assert_close(scan_run(impl)(**rest), (y[:, j * every :], final), dtype)

    weights = jnp.asarray(np.random.default_rng(1).normal(size=states.shape), dtype)

    def through_states(x):
        return jnp.sum(jnp.sin(scan_run(impl, every)(**x)[2]) * weights)

    def through_prefixes(x):
        finals = [scan_run(impl)(**scan_tokens(x, 0, (i + 1) * every))[1] for i in range(count)]
        return jnp.sum(jnp.sin(jnp.stack(finals, axis=1)) * weights)

    grads = jax.jit(jax.grad(through_states))(x)
    assert_close(grads, jax.jit(jax.grad(through_prefixes))(x), dtype)
    assert bool(jnp.any(grads["initial_state"] != 0)) and bool(jnp.any(grads["A"] != 0))


@pytest.mark.parametrize("impl", SCAN_IMPLS)
def test_scan_return_layouts(impl):
    x = scan_inputs(jnp.float32)
    y, _, states = scan_run(impl, 8)(**x)
    y_only, states_only = selective_scan(**x, delta_softplus=True, impl=impl, state_every=8)
    assert_close((y_only, states_only), (y, states))
    assert selective_scan(**x, delta_softplus=True, impl=impl).shape == y.shape
    assert selective_scan(**x, delta_softplus=True, impl=impl, state_every=40)[1].shape == (
        2, 0, 3, 4,
    )  # fmt: skip


@pytest.mark.parametrize("impl", [None, *SCAN_IMPLS])
def test_scan_bad_state_every(impl):
    x = scan_inputs(jnp.float32)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="state_every"):
            selective_scan(**x, impl=impl, state_every=bad)
