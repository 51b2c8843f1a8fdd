"""Batched generation over `LanguageModel`'s cache API: prefill with `extend`, decode with `step`.

    generate(model, params, prompts [B, P], max_new_tokens=N)
      = decode(model, params, *prefill(model, params, prompts, max_len=P + N), max_new_tokens=N)

`prefill` feeds the prompts through the sequence path (`LanguageModel.extend`, chained over pieces
of `prefill_chunk` tokens), each row up to its own length: right-padded prompts go in as they are
(row b's real tokens are its first `lengths[b]`), left-padded ones (its last `lengths[b]`) are
first rolled to the left. It returns the logits after each row's last real token and the cache.
`decode` samples a token from those logits, then runs a jit-compiled `lax.while_loop` of
`step` + `sample`: after a row emits one of `stop_tokens` it emits `pad_id` and its length stops
growing; the loop ends after `N` tokens or as soon as every row has stopped. Everything is compiled
once per (model, shapes, static options): the sampling options, `stop_tokens` and `pad_id` are
static.

Randomness: `key` is one key (split into one key per row) or `[B]` keys; the token of row b at
step t is drawn with `fold_in(key_b, t)`, so a row generated in a batch equals the same prompt
generated alone with that row's key, whatever the padding and the other rows.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.modules.lm import LanguageModel
from seqlab.ops.checks import check_choice, check_positive_int, check_shape
from seqlab.serving.sampling import check_sampling, row_keys, sample

PADDINGS = ("right", "left")
"""Which side of a batch of prompts of different lengths holds the padding."""


class Generation(NamedTuple):
    """`tokens: [B, N]` int32 (`pad_id` after a row's stop token); `lengths: [B]` int32, tokens
    generated per row (its stop token included); `steps: []` int32, `step` calls the decode loop
    ran (N - 1, or fewer when every row stopped early)."""

    tokens: jax.Array
    lengths: jax.Array
    steps: jax.Array


def check_tokens(name: str, tokens, layout: str, rank: int) -> None:
    """Raise `ValueError` unless `tokens` is an integer array of rank `rank`."""
    if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {jnp.result_type(tokens)}")
    check_shape(name, tokens, (None,) * rank, layout)


def prompt_lengths(prompts, lengths) -> jax.Array:
    """The checked `[B]` int32 lengths of `prompts: [B, P]` (None: every row has P tokens); each
    must lie in [1, P]."""
    check_tokens("prompts", prompts, "[B, P]", 2)
    batch, length = prompts.shape
    if length < 1:
        raise ValueError(f"prompts must hold at least one token per row, got shape {prompts.shape}")
    if lengths is None:
        return jnp.full((batch,), length, jnp.int32)
    check_tokens("lengths", lengths, "[B]", 1)
    check_shape("lengths", lengths, (batch,), "[B]")
    values = np.asarray(lengths)
    if values.min() < 1 or values.max() > length:
        raise ValueError(f"lengths must lie in [1, P] = [1, {length}], got {values.tolist()}")
    return jnp.asarray(lengths, jnp.int32)


def check_stops(stop_tokens, pad_id, vocab_size: int) -> tuple[int, ...]:
    """`stop_tokens` as a tuple of ids in [0, vocab_size); `pad_id` an int."""
    stops = tuple(stop_tokens)
    if any(isinstance(s, bool) or not isinstance(s, int | np.integer) for s in stops) or any(
        not 0 <= s < vocab_size for s in stops
    ):
        raise ValueError(f"stop_tokens must be token ids in [0, {vocab_size}), got {stop_tokens!r}")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int | np.integer):
        raise ValueError(f"pad_id must be an int, got {pad_id!r}")
    return tuple(int(s) for s in stops)


def right_aligned(prompts: jax.Array, lengths: jax.Array) -> jax.Array:
    """Left-padded `prompts: [B, P]` (row b's tokens are its last `lengths[b]`) rolled so that
    they come first: `out[b, i] = prompts[b, (i + P - lengths[b]) % P]`."""
    length = prompts.shape[1]
    index = (jnp.arange(length)[None, :] + (length - lengths)[:, None]) % length
    return jnp.take_along_axis(prompts, index, axis=1)


def prefill(
    model: LanguageModel,
    params,
    prompts,
    *,
    max_len: int,
    lengths=None,
    padding: str = "right",
    prefill_chunk: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[jax.Array, tuple]:
    """Feed `prompts: [B, P]` int through `model.extend` from a fresh cache of `max_len` tokens:
    `(logits [B, vocab] after each row's last real token, cache)`.

    `lengths: [B]` in [1, P] (None: P); `padding`: "right" (row b's tokens are its first
    `lengths[b]`) or "left" (its last); `prefill_chunk`: feed pieces of that many tokens, calling
    `progress(tokens_done, P)` after each (it waits for the piece); `params`: the `"params"`
    entry."""
    lengths = prompt_lengths(prompts, lengths)
    check_choice("padding", padding, PADDINGS)
    check_positive_int("max_len", max_len)
    length = prompts.shape[1]
    if max_len < length:
        raise ValueError(f"max_len must be at least the prompt length {length}, got {max_len}")
    if prefill_chunk is not None:
        check_positive_int("prefill_chunk", prefill_chunk)
    prompts = jnp.asarray(prompts, jnp.int32)
    if padding == "left":
        prompts = right_aligned(prompts, lengths)
    chunk = min(prefill_chunk or length, length)
    pieces = math.ceil(length / chunk)
    prompts = jnp.pad(prompts, ((0, 0), (0, pieces * chunk - length)))
    cache = _init_cache(model, params, prompts.shape[0], max_len)
    logits = None
    for piece in range(pieces):
        # Row b's real tokens in this piece: clip(lengths - start, 0, chunk).
        piece_lengths = jnp.clip(lengths - piece * chunk, 0, chunk)
        tokens = prompts[:, piece * chunk : (piece + 1) * chunk]
        last, cache = _extend(model, params, tokens, cache, piece_lengths)
        logits = last if logits is None else jnp.where(piece_lengths[:, None] > 0, last, logits)
        if progress is not None:
            jax.block_until_ready(cache)
            progress(min((piece + 1) * chunk, length), length)
    return logits, cache


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _init_cache(model: LanguageModel, params, batch: int, max_len: int) -> tuple:
    return model.apply({"params": params}, batch, max_len, method=LanguageModel.init_cache)


@functools.partial(jax.jit, static_argnums=0)
def _extend(model: LanguageModel, params, tokens, cache, lengths) -> tuple[jax.Array, tuple]:
    """`extend` over one piece; the logits at each row's last real token of the piece `[B, V]`
    (meaningless for rows with no token in it)."""
    logits, cache = model.apply(
        {"params": params}, tokens, cache, lengths, method=LanguageModel.extend
    )
    index = jnp.maximum(lengths - 1, 0)[:, None, None]
    return jnp.take_along_axis(logits, index, axis=1)[:, 0], cache


def decode(
    model: LanguageModel,
    params,
    logits,
    cache,
    *,
    max_new_tokens: int,
    key=None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens=(),
    pad_id: int = 0,
) -> Generation:
    """`max_new_tokens` tokens per row from the `logits: [B, vocab]` of the last fed token and
    `cache` (as `prefill` returns them): see the module docstring. `key` (one key or `[B]` keys)
    is required when `temperature > 0`."""
    check_positive_int("max_new_tokens", max_new_tokens)
    check_shape("logits", logits, (None, model.vocab_size), "[B, vocab]")
    check_sampling(temperature, top_k, top_p)
    stops = check_stops(stop_tokens, pad_id, model.vocab_size)
    keys = row_keys(key, logits.shape[0]) if temperature > 0 else None
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    return _decode(
        model, params, logits, cache, keys, max_new_tokens, tuple(options.items()), stops, pad_id
    )


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8))
def _decode(model, params, logits, cache, keys, length, options, stops, pad_id) -> Generation:
    options = dict(options)
    batch = logits.shape[0]
    stop_ids = jnp.asarray(stops, jnp.int32)

    def draw(t, logits):
        step_keys = None if keys is None else jax.vmap(lambda k: jax.random.fold_in(k, t))(keys)
        return sample(step_keys, logits, **options)

    def emit(t, token, out, lengths, done):
        """Write step t's tokens; a row that emitted a stop token before emits pad_id."""
        out = out.at[:, t].set(jnp.where(done, pad_id, token))
        return out, lengths + (~done).astype(jnp.int32), done | jnp.isin(token, stop_ids)

    def cond(carry):
        t, _, _, _, _, done = carry
        return (t < length) & ~jnp.all(done)

    def body(carry):
        t, token, cache, out, lengths, done = carry
        logits, cache = model.apply({"params": params}, token, cache, method=LanguageModel.step)
        token = draw(t, logits)
        return (t + 1, token, cache, *emit(t, token, out, lengths, done))

    first = draw(0, logits)
    out = jnp.full((batch, length), pad_id, jnp.int32)
    zeros = jnp.zeros((batch,), jnp.int32)
    state = emit(0, first, out, zeros, jnp.zeros((batch,), bool))
    t, _, _, out, lengths, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), first, cache, *state))
    return Generation(out, lengths, jnp.asarray(t - 1, jnp.int32))


def generate(
    model: LanguageModel,
    params,
    prompts,
    *,
    max_new_tokens: int,
    lengths=None,
    padding: str = "right",
    key=None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens=(),
    pad_id: int = 0,
    prefill_chunk: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Generation:
    """`max_new_tokens` new tokens after each row of `prompts: [B, P]` int: `prefill` then
    `decode` (see the module docstring and theirs for the arguments). Greedy by default
    (`temperature=0`: argmax, ties to the lowest id). `params`: the model's `"params"` entry.
    Every argument is checked (a `ValueError` naming it) before anything is compiled."""
    check_tokens("prompts", prompts, "[B, P]", 2)
    check_positive_int("max_new_tokens", max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    check_stops(stop_tokens, pad_id, model.vocab_size)
    if temperature > 0:
        row_keys(key, prompts.shape[0])
    logits, cache = prefill(
        model,
        params,
        prompts,
        max_len=prompts.shape[1] + max_new_tokens,
        lengths=lengths,
        padding=padding,
        prefill_chunk=prefill_chunk,
        progress=progress,
    )
    return decode(
        model,
        params,
        logits,
        cache,
        max_new_tokens=max_new_tokens,
        key=key,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_tokens=stop_tokens,
        pad_id=pad_id,
    )
