"""`seqlab.serving.generate`: every row of a batch of prompts of different lengths (left and
right padded) equals its prompt run alone (greedy: the argmax of the full forward; sampled: the
prompt generated in a batch of one with the row's key), generate equals a hand loop over `step`,
chunked prefill equals one piece, stop tokens, and argument errors.

One model (Mamba-2, Gated DeltaNet and sliding-window attention blocks; float64) and one batch
shape throughout, so that the tests share their compilations."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.lm import LanguageModel, preset
from seqlab.serving import generate

PROMPT = 6
LENGTHS = (6, 2, 5)  # > and < the sliding window (4) and the chunk sizes (4)
NEW = 7
SAMPLING = dict(temperature=1.0, top_k=8, top_p=0.9)


def _model(name: str = "tiny-h2"):
    """A float64 tiny preset without MLPs (the mixers are what serving exercises), parameters."""
    return _built(name)


@functools.cache
def _built(name: str):
    model = preset(name, d_ff=None, dtype=jnp.float64, param_dtype=jnp.float64)
    tokens = jnp.zeros((1, 2), jnp.int32)
    return model, jax.jit(model.init)(jax.random.key(0), tokens)["params"]


def _prompts(vocab: int, seed: int = 1) -> np.ndarray:
    """`[len(LENGTHS), PROMPT]` random tokens (every position real; lengths choose)."""
    return np.random.default_rng(seed).integers(1, vocab, (len(LENGTHS), PROMPT), dtype=np.int32)


def _left_padded(prompts: np.ndarray, lengths) -> np.ndarray:
    """Row b's first `lengths[b]` tokens moved to the end of the row, zeros before them."""
    out = np.zeros_like(prompts)
    for row, n in enumerate(lengths):
        out[row, PROMPT - n :] = prompts[row, :n]
    return out


def _cut(tokens: np.ndarray, stops, pad_id: int) -> np.ndarray:
    """`tokens: [B, N]` with `pad_id` after each row's first stop token."""
    out = np.array(tokens)
    for row in out:
        hits = np.flatnonzero(np.isin(row, stops))
        if hits.size:
            row[hits[0] + 1 :] = pad_id
    return out


def test_greedy_rows_are_the_argmax_of_the_full_forward():
    """Right- and left-padded batches: each row's tokens are the argmax of `__call__` on its own
    prompt and the tokens before them."""
    model, params = _model()
    prompts = _prompts(model.vocab_size)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    greedy = generate(model, params, prompts, lengths=lengths, max_new_tokens=NEW)
    left = _left_padded(prompts, LENGTHS)
    greedy_left = generate(model, params, left, lengths=lengths, padding="left", max_new_tokens=NEW)
    np.testing.assert_array_equal(greedy_left.tokens, greedy.tokens)
    # Row b: its prompt, its continuation, then zeros (right padding does not reach back).
    sequences = np.zeros((len(LENGTHS), PROMPT + NEW), np.int32)
    for row, n in enumerate(LENGTHS):
        sequences[row, : n + NEW] = np.concatenate([prompts[row, :n], greedy.tokens[row]])
    logits = jax.jit(model.apply)({"params": params}, sequences)
    for row, n in enumerate(LENGTHS):
        predicted = jnp.argmax(logits[row, n - 1 : n + NEW - 1], axis=-1)
        np.testing.assert_array_equal(predicted, greedy.tokens[row])
    assert greedy.tokens.shape == (len(LENGTHS), NEW) and greedy.tokens.dtype == jnp.int32
    np.testing.assert_array_equal(greedy.lengths, NEW)
    assert int(greedy.steps) == NEW - 1


def test_sampled_rows_equal_each_prompt_alone():
    """One key per row: each row of a right-padded, a left-padded and a reversed batch equals its
    prompt generated alone (a batch of one) with the row's key."""
    model, params = _model()
    prompts = _prompts(model.vocab_size)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    keys = jax.random.split(jax.random.key(3), len(LENGTHS))
    run = functools.partial(generate, model, params, max_new_tokens=NEW, **SAMPLING)
    right = run(prompts, lengths=lengths, key=keys).tokens
    left = run(_left_padded(prompts, LENGTHS), lengths=lengths, padding="left", key=keys).tokens
    reverse = run(prompts[::-1], lengths=lengths[::-1], key=keys[::-1]).tokens[::-1]
    for row in range(len(LENGTHS)):
        one = slice(row, row + 1)
        alone = run(prompts[one], lengths=lengths[one], key=keys[one]).tokens[0]
        for batch in (right, left, reverse):
            np.testing.assert_array_equal(batch[row], alone)
    greedy = generate(model, params, prompts, lengths=lengths, max_new_tokens=NEW).tokens
    assert not np.array_equal(right, greedy)  # the draws are not the argmax here


def test_generate_equals_a_hand_loop_over_step():
    model, params = _model()
    prompts = jnp.asarray(_prompts(model.vocab_size))
    variables = {"params": params}
    step = jax.jit(functools.partial(model.apply, method=LanguageModel.step))
    cache = model.apply(variables, len(LENGTHS), PROMPT + NEW, method=LanguageModel.init_cache)
    for t in range(PROMPT):
        logits, cache = step(variables, prompts[:, t], cache)
    expected = []
    for _ in range(NEW):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        expected.append(token)
        logits, cache = step(variables, token, cache)
    out = generate(model, params, prompts, max_new_tokens=NEW)
    np.testing.assert_array_equal(out.tokens, jnp.stack(expected, axis=1))


def test_chunked_prefill_equals_one_piece_and_reports_progress():
    model, params = _model()
    prompts = _prompts(model.vocab_size)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    seen = []
    chunked = generate(
        model, params, prompts, lengths=lengths, max_new_tokens=NEW, prefill_chunk=4,
        progress=lambda done, total: seen.append((done, total)),
    )  # fmt: skip
    whole = generate(model, params, prompts, lengths=lengths, max_new_tokens=NEW)
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)
    assert seen == [(4, PROMPT), (PROMPT, PROMPT)]


def test_stop_tokens_pad_the_rest_and_end_the_loop_early():
    """Each row is cut after its first stop token (pad_id after it); the stop tokens are the
    rows' second tokens, so every row stops by then and the loop runs one step, not NEW - 1."""
    model, params = _model()
    prompts = _prompts(model.vocab_size)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    free = generate(model, params, prompts, lengths=lengths, max_new_tokens=NEW).tokens
    stops = tuple(int(t) for t in free[:, 1])
    out = generate(
        model, params, prompts, lengths=lengths, max_new_tokens=NEW, stop_tokens=stops, pad_id=-1
    )
    expected = _cut(free, stops, -1)
    np.testing.assert_array_equal(out.tokens, expected)
    np.testing.assert_array_equal(out.lengths, np.sum(expected != -1, axis=1))
    assert int(out.steps) == 1


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (dict(prompts=np.zeros((2, 3), np.float32)), "prompts"),
        (dict(prompts=np.zeros((3,), np.int32)), "prompts"),
        (dict(prompts=np.zeros((2, 0), np.int32)), "prompts"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(lengths=np.array([1, 4])), "lengths"),
        (dict(lengths=np.array([0, 2])), "lengths"),
        (dict(lengths=np.array([1, 2, 3])), "lengths"),
        (dict(lengths=np.array([1.0, 2.0])), "lengths"),
        (dict(padding="middle"), "padding"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=1.0), "key"),
        (dict(top_p=2.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop_tokens=(61,)), "stop_tokens"),
        (dict(pad_id="0"), "pad_id"),
        (dict(prefill_chunk=0), "prefill_chunk"),
    ],
)
def test_bad_arguments_raise(change, name):
    model, params = _model()
    args = {"prompts": np.ones((2, 3), np.int32), "max_new_tokens": 2, **change}
    with pytest.raises(ValueError, match=name):
        generate(model, params, args.pop("prompts"), **args)
