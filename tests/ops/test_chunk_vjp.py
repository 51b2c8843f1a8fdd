"""The chunk-wise recomputing derivative of the chunked forms (`seqlab/ops/_chunk_vjp.py`).

For the gated delta rule, SSD and KDA (a gate per key channel): values and every gradient
(q, k, v, gates, initial state) of `recomputing(form)` equal those of the plain form and of the
token-by-token reference, with packed documents (one starting exactly on a chunk and block
boundary, others inside a chunk), T not a multiple of the chunk, T below one chunk and exactly one
chunk, one and two chunks per block; forward mode equals the plain form's; trained-like inputs
(correlated keys, write strengths near 1, strong gates); the compiled gradient keeps fewer
temporary bytes than the plain form's; a bad `chunks_per_block` raises. `impl="mixed"` (what
`impl=None` runs on CPU) has the recurrent values and the chunked derivative.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.ops import _chunk_vjp, _chunked, _delta, gated_delta
from seqlab.ops.kda import _token_step as kda_token_step
from seqlab.ops.ssd import _chunked_form as ssd_chunked_form
from seqlab.ops.ssd import _token_step as ssd_token_step
from tests.conftest import assert_close
from tests.ops import trained_like
from tests.ops.recurrences import RECURRENCES, inputs, kda_inputs, segment_rows, ssd_inputs
from tests.ops.recurrences import forward_and_grads as rec_forward_and_grads

CHUNK, LENGTH, SCALE = 4, 21, 0.3
# Row 0: documents start at t = 8 (a chunk boundary, and a block boundary of two chunks) and at
# t = 13 (inside a chunk); row 1 at t = 3 (inside the first chunk).
DOCUMENTS = ([8, 5, 8], [3, 18])
DTYPES = (jnp.float32, jnp.float64)

# name: (token step, chunked form of chunk size CHUNK, inputs, per-token arrays in the form's order)
OPS = {
    "gated_delta_rule": (
        gated_delta._token_step,
        functools.partial(gated_delta._chunked_form, chunk_size=CHUNK),
        inputs,
        ("q", "k", "v", "g", "beta"),
    ),
    "ssd": (
        ssd_token_step,
        functools.partial(ssd_chunked_form, chunk_size=CHUNK),
        ssd_inputs,
        ("q", "k", "v", "g"),
    ),
    "kda": (
        kda_token_step,
        functools.partial(
            _delta.chunked_form, _delta.beta_write, CHUNK, _chunked.scan_chunk_states
        ),
        kda_inputs,
        ("q", "k", "v", "g", "beta"),
    ),
}


@functools.cache
def forward_and_grads(name, variant, chunks_per_block=1):
    """Jitted `x, seg -> ((o, final), grads)` of the op `name` run through `_chunked.run` with
    the form `variant` ("plain", "recomputing" or "recurrent"); the gradients of a generic loss
    on o and final with respect to every array of `x`."""
    token_step, form, _, names = OPS[name]
    if variant == "recomputing":
        form = _chunk_vjp.recomputing(form, CHUNK, chunks_per_block=chunks_per_block)
    elif variant == "recurrent":
        form = functools.partial(_chunked.recurrent, token_step)

    def loss(x, seg):
        xs = tuple(x[n] for n in names)
        o, s = _chunked.run(form, xs, x["initial_state"], seg, True, scale=SCALE)
        return jnp.sum(jnp.sin(o) * o) + jnp.sum(jnp.cos(s) * s), (o, s)

    def run(x, seg):
        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(x, seg)
        return out, grads

    return jax.jit(run)


def make_inputs(name, dtype, t=LENGTH, seed=0):
    """Two rows, one q/k head serving two value heads, K = 4, V = 3."""
    return OPS[name][2](seed, 2, t, 1, 2, 4, 3, dtype)


def assert_matches(name, x, seg, dtype, chunks_per_block, references=("plain", "recurrent")):
    """The recomputing form's values and gradients equal those of the `references` (variants of
    `forward_and_grads`), and no gradient is zero."""
    got = forward_and_grads(name, "recomputing", chunks_per_block)(x, seg)
    for ref in references:
        assert_close(got, forward_and_grads(name, ref)(x, seg), dtype, err_msg=f"vs {ref}")
    assert all(bool(jnp.any(g != 0)) for g in got[1].values())


# Every op in both dtypes; one and two chunks per block in each dtype across the ops. KDA's
# graphs compile slowest: its float64 case runs in the slow run.
CASES = [
    ("gated_delta_rule", jnp.float32, 1),
    ("gated_delta_rule", jnp.float64, 2),
    ("ssd", jnp.float32, 2),
    ("ssd", jnp.float64, 1),
    ("kda", jnp.float32, 2),
    pytest.param("kda", jnp.float64, 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("name", "dtype", "chunks_per_block"), CASES)
def test_matches_plain_form_and_reference_with_documents(name, dtype, chunks_per_block):
    """T = 21 (not a multiple of the chunk of 4 or the block of 8) with packed documents."""
    assert_matches(name, make_inputs(name, dtype), segment_rows(DOCUMENTS), dtype, chunks_per_block)


@pytest.mark.parametrize(("name", "length"), [("gated_delta_rule", 3), ("ssd", CHUNK), ("kda", 3)])
def test_shorter_than_a_block(name, length):
    """T below one chunk, or exactly one chunk, in blocks of two chunks (one padded block)."""
    x = make_inputs(name, jnp.float64, t=length, seed=1)
    assert_matches(name, x, None, jnp.float64, 2, references=("recurrent",))


def test_undifferentiated_values_are_the_plain_forms():
    """Without differentiation the wrapper runs the plain form on the whole sequence."""
    _, form, _, names = OPS["kda"]
    x = make_inputs("kda", jnp.float32)
    xs = tuple(x[n] for n in names)
    seg = segment_rows(DOCUMENTS)

    def values(form):
        run = functools.partial(_chunked.run, form, segment_ids=seg, output_final_state=True)
        return jax.jit(lambda xs, s0: run(xs, s0, scale=SCALE))(xs, x["initial_state"])

    wrapped = _chunk_vjp.recomputing(form, CHUNK, chunks_per_block=2)
    for got, want in zip(values(wrapped), values(form), strict=True):
        np.testing.assert_array_equal(got, want)


def test_forward_mode_matches_plain_form():
    """`jax.jvp` of the gated delta rule along a random direction of every floating input."""
    _, form, _, names = OPS["gated_delta_rule"]
    x = make_inputs("gated_delta_rule", jnp.float64)
    direction = make_inputs("gated_delta_rule", jnp.float64, seed=5)
    seg = segment_rows(DOCUMENTS)

    def tangent(form):
        def op(x):
            xs = tuple(x[n] for n in names)
            return _chunked.run(form, xs, x["initial_state"], seg, True, scale=SCALE)

        return jax.jit(lambda x, dx: jax.jvp(op, (x,), (dx,)))(x, direction)

    wrapped = _chunk_vjp.recomputing(form, CHUNK, chunks_per_block=2)
    assert_close(tangent(wrapped), tangent(form))


@pytest.mark.parametrize("dtype", DTYPES)
def test_trained_like_inputs(dtype):
    """The gated delta rule on keys with neighbouring cosine 0.97, write strengths in (0.95, 1),
    strong gates (log U(0.001, 0.05)) and two document boundaries: against the reference in
    float64, against the plain form (the same chunk arithmetic) in float32."""
    case = trained_like.Case(
        cosine=0.97, beta=(0.95, 1.0), gate="strong", segments=True, groups=2, t=30, d=4
    )
    x = trained_like.cast(trained_like.inputs(case, b=2), dtype)
    seg = x.pop("segment_ids")
    reference = "recurrent" if dtype == jnp.float64 else "plain"
    assert_matches("gated_delta_rule", x, seg, dtype, 1, references=(reference,))


def test_gradient_keeps_fewer_temporary_bytes():
    """The compiled gradient of the gated delta rule at T = 64, C = 8, K = V = 16: the plain
    form keeps every chunk's intermediates, the recomputing one the inputs, the chunk states and
    one chunk's transients."""
    b, t, h, d, c = 1, 64, 2, 16, 8
    form = functools.partial(gated_delta._chunked_form, chunk_size=c)
    shapes = [(b, t, h, d)] * 3 + [(b, t, h)] * 2 + [(b, h, d, d)]
    xs = [jnp.zeros(s, jnp.float32) for s in shapes]
    seg = jnp.zeros((b, t), jnp.int32)

    def temp_bytes(form):
        def loss(xs):
            o, final = form(*xs, seg)
            return jnp.sum(o * o) + jnp.sum(final)

        compiled = jax.jit(jax.grad(loss)).lower(xs).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    plain = temp_bytes(form)
    assert temp_bytes(_chunk_vjp.recomputing(form, c)) < 0.5 * plain, plain


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_bad_chunks_per_block_raises(bad):
    with pytest.raises(ValueError, match="chunks_per_block"):
        _chunk_vjp.recomputing(OPS["ssd"][1], CHUNK, chunks_per_block=bad)


# ----------------------------------------------------------------- "mixed": impl=None on CPU

PUBLIC = {rec.name: rec for rec in RECURRENCES}


@pytest.mark.parametrize(
    "name",
    [
        "gated_delta_rule",
        "ssd",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("kda", "gdn2")),
    ],
)
def test_mixed_is_the_recurrent_values_and_the_chunked_derivative(name):
    """`impl="mixed"` on float64 inputs with packed documents: without a derivative its values are
    `"recurrent"`'s, bit for bit; under `jax.grad` its values and gradients are `"chunked"`'s (the
    same computation), and both agree with the reference."""
    rec = PUBLIC[name]
    x = rec.inputs(0, 2, LENGTH, 1, 2, 4, 3, jnp.float64)
    op = functools.partial(
        rec.op, chunk_size=CHUNK, segment_ids=segment_rows(DOCUMENTS), **rec.options
    )

    def values(impl):
        return jax.jit(lambda x: op(**x, impl=impl, output_final_state=True))(x)

    for got, want in zip(values("mixed"), values("recurrent"), strict=True):
        np.testing.assert_array_equal(got, want)
    mixed = rec_forward_and_grads(functools.partial(op, impl="mixed"), x)
    chunked = rec_forward_and_grads(functools.partial(op, impl="chunked"), x)
    assert_close(mixed, chunked, jnp.float64)
    assert_close(
        mixed, rec_forward_and_grads(functools.partial(op, impl="recurrent"), x), jnp.float64
    )


def test_impl_none_resolves_by_platform(monkeypatch):
    """`None` is `"mixed"` on CPU, `"chunked"` on a GPU without the kernel (not Hopper) and for
    ops without kernels on TPU, and `"chunked"` with `state_every`, where `"mixed"` is refused."""
    platform = {"name": "cpu"}
    monkeypatch.setattr(_chunked, "target_platform", lambda: platform["name"])
    monkeypatch.setattr(_chunked, "_has_kernel_hardware", lambda p: p == "tpu")
    assert _chunked.check_impl(None) == "mixed"
    assert _chunked.check_impl(None, kernels=True) == "mixed"
    assert gated_delta.resolve_impl(None, jnp.float32, 64, 64, 64) == "mixed"
    assert _chunked.check_impl("chunked") == "chunked"
    assert _chunked.resolve_with_states(None, 8, 4) == "chunked"
    with pytest.raises(NotImplementedError, match="impl='mixed' with state_every"):
        _chunked.resolve_with_states("mixed", 8, 4)
    platform["name"] = "gpu"
    assert _chunked.check_impl(None, kernels=True) == "chunked"
    platform["name"] = "tpu"
    assert _chunked.check_impl(None) == "chunked"
    assert _chunked.check_impl(None, kernels=True) == "pallas_tpu"
