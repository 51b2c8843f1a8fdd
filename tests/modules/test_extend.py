"""Prefill with per-row lengths (`extend`) and speculative verification (`verify`/`accept`), checked
on every mixer and on a hybrid `LanguageModel` (hence `Block`) against `step` token by token (the
contract of `seqlab.modules.mixer`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.lm import LanguageModel
from seqlab.modules.mixer import check_lengths
from tests.conftest import assert_close
from tests.modules.test_mixers import D_MODEL, MIXERS, _mixer, _params

BATCH, T, CUT = 4, 6, 3  # CUT: where the chained prefill splits each row (at most)
N_DRAFT, MAX_LEN = T, 2 * T  # drafts as long as prompts: the programs compile once
WINDOW = T  # of the sliding-window attention: less than MAX_LEN, so its ring wraps
LENGTHS = np.array([0, 4, 6, 2])  # per-row real tokens: none, some, all
ACCEPTED = np.array([0, 6, 1, 3])  # per-row accepted draft tokens, 0 to N_DRAFT
# Mamba with polarization and sign constraint differs from "mamba" in its parameters only.
NAMES = [name for name in MIXERS if name != "mamba-polar-mixed"]


def _x(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def _tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 23, shape), jnp.int32)


def _assert_cache(got, want, exact=False):
    """Caches agree: integer leaves (positions) exactly, floating ones to the tolerance of their
    dtype, or bit for bit with `exact`."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if exact or jnp.issubdtype(b.dtype, jnp.integer):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert_close(a, b)


def _rows(stacked, index):
    """Row `b` of every leaf `[T + 1, B, ...]` at token `index[b]`."""
    return jax.tree.map(lambda a: a[index, np.arange(len(index))], stacked)


@functools.cache
def _programs(module):
    """Jitted `extend`, `verify`, `accept` and `steps` of `module`: `steps` runs `step`
    token by token (a scan) and returns the outputs `[B, T, ...]` and the cache before and after
    every token, stacked `[T + 1, ...]`."""

    def steps(params, x, cache):
        def body(carry, x_t):
            y_t, carry = module.apply(params, x_t, carry, method="step")
            return carry, (y_t, carry)

        _, (y, caches) = jax.lax.scan(body, cache, jnp.swapaxes(x, 0, 1))
        stacked = jax.tree.map(lambda c0, cs: jnp.concatenate([c0[None], cs]), cache, caches)
        return jnp.swapaxes(y, 0, 1), stacked

    def method(name):
        return jax.jit(functools.partial(module.apply, method=name))

    return dict(
        extend=method("extend"),
        verify=method("verify"),
        accept=method("accept"),
        steps=jax.jit(steps),
    )


def _check(module, params, x, draft, cache, exact=True):
    """From the zero `cache`: `extend` with `LENGTHS` equals `step` token by token (hence
    `__call__`, as `test_mixers` and `test_lm` check) at the real positions and in each row's
    final cache; two chained calls equal one. From that
    cache (rows at different positions), `verify` of `draft` equals `step` token by token and
    `accept` gives the cache after each row's `ACCEPTED` tokens, bit for bit with `exact`."""
    run = _programs(module)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    real = np.arange(T) < LENGTHS[:, None]
    y_steps, stacked = run["steps"](params, x, cache)
    y, prefilled = run["extend"](params, x, cache, lengths)
    assert_close(y[real], y_steps[real])
    _assert_cache(prefilled, _rows(stacked, LENGTHS))

    # Chained: each row's first min(length, CUT) tokens, then the rest shifted to the front.
    first = np.minimum(LENGTHS, CUT)
    rest = jnp.stack([jnp.roll(row, -int(f), axis=0) for row, f in zip(x, first, strict=True)])
    y1, mid = run["extend"](params, x, cache, jnp.asarray(first, jnp.int32))
    y2, chained = run["extend"](params, rest, mid, jnp.asarray(LENGTHS - first, jnp.int32))
    for b, (f, n) in enumerate(zip(first, LENGTHS, strict=True)):
        assert_close(jnp.concatenate([y1[b, :f], y2[b, : n - f]]), y[b, :n])
    _assert_cache(chained, prefilled)

    y_steps, stacked = run["steps"](params, draft, prefilled)
    y, trail = run["verify"](params, draft, prefilled)
    assert_close(y, y_steps)
    accepted = run["accept"](params, trail, jnp.asarray(ACCEPTED, jnp.int32))
    _assert_cache(accepted, _rows(stacked, ACCEPTED), exact=exact)


# KDA, Gated DeltaNet-2 and Gated DeltaProduct extend through the gated delta rule's code
# (`mixer.extend_qkv`, the same chunked form): their cases are `slow` (about 20 s each on 2 cores).
SHARED_EXTEND = ("kda", "gdn2", "gdp")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SHARED_EXTEND else n for n in NAMES]
)
def test_mixer_extend_and_verify_equal_step(name):
    mixer = _mixer(name, window=WINDOW) if name == "sliding-window" else _mixer(name)
    x, draft = _x((BATCH, T, D_MODEL)), _x((BATCH, N_DRAFT, D_MODEL), seed=1)
    _check(mixer, _params(name), x, draft, mixer.init_cache(BATCH, MAX_LEN))


def test_lengths_default_to_the_whole_sequence():
    np.testing.assert_array_equal(check_lengths("lengths", None, 3, 5), np.full(3, 5))
    assert check_lengths("lengths", np.array([0, 2, 5]), 3, 5).dtype == jnp.int32


def test_language_model_hybrid_extend_and_verify_equal_step():
    model = LanguageModel(
        vocab_size=23,
        d_model=D_MODEL,
        pattern="mas",  # the mixers' own tests cover the others; Mamba compiles fastest
        d_ff=24,
        mamba=dict(d_state=3, conv_size=3),
        attention=dict(num_heads=2, window=WINDOW),
        dtype=jnp.float64,
        param_dtype=jnp.float64,
    )
    tokens = _tokens((BATCH, T))
    params = jax.jit(model.init)(jax.random.key(0), tokens)
    cache = model.apply(params, BATCH, MAX_LEN, method="init_cache")
    # Bit for bit per mixer; through a model the blocks' inputs come from [B, n] computations
    # (norms, MLPs, attention) that XLA rounds differently from [B] ones, so to the tolerance.
    _check(model, params, tokens, _tokens((BATCH, N_DRAFT), seed=1), cache, exact=False)


@pytest.mark.parametrize("name", ["gdn", "sliding-window"])
def test_bad_arguments_raise(name):
    mixer, params = _mixer(name), _params(name)
    x, cache = _x((BATCH, T, D_MODEL)), mixer.init_cache(BATCH, T)
    for lengths, match in [
        (jnp.ones((BATCH,)), "lengths must be"),
        (jnp.ones((1,), int), "lengths"),
    ]:
        with pytest.raises(ValueError, match=match):
            mixer.apply(params, x, cache, lengths, method="extend")
    for method in ("extend", "verify"):
        with pytest.raises(ValueError, match="x must have rank 3"):
            mixer.apply(params, x[0], cache, method=method)
    draft = jax.ShapeDtypeStruct((BATCH, 2, D_MODEL), x.dtype)
    verify = functools.partial(mixer.apply, method="verify")
    _, trail = jax.eval_shape(verify, params, draft, cache)
    for m in (jnp.ones((BATCH,)), jnp.ones((BATCH + 1,), int), None):
        with pytest.raises(ValueError, match="m must"):
            mixer.apply(params, trail, m, method="accept")
    with pytest.raises(ValueError, match="trail must be what verify returns"):
        mixer.apply(params, cache, jnp.ones((BATCH,), int), method="accept")


def test_attention_verifies_at_most_its_slots():
    mixer, params = _mixer("sliding-window"), _params("sliding-window")  # window 3
    with pytest.raises(ValueError, match="at most 3 tokens"):
        mixer.apply(params, _x((BATCH, 4, D_MODEL)), mixer.init_cache(BATCH, T), method="verify")


def test_language_model_rejects_bad_lengths_and_trails():
    model = LanguageModel(vocab_size=23, d_model=D_MODEL, pattern="g", gdn=dict(num_heads=2))
    tokens = _tokens((BATCH, T))
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)
    cache = model.apply(params, BATCH, T, method="init_cache")
    with pytest.raises(ValueError, match="lengths must have shape"):
        model.apply(params, tokens, cache, jnp.ones((BATCH + 1,), int), method="extend")
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        model.apply(params, tokens * 1.0, cache, method="verify")
    with pytest.raises(ValueError, match="trail must hold 1 block caches"):
        model.apply(params, (), jnp.ones((BATCH,), int), method="accept")
