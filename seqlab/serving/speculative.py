"""Greedy speculative decoding: a small draft model proposes, the target model verifies.

One round, per row, from the last emitted token `x` (not yet fed to either model):

    draft:   d_1..d_k    k = num_draft greedy tokens, d_{i+1} = argmax draft(.. x d_1..d_i) (`step`)
    target:  g_0..g_k    g_i = argmax target(.. x d_1..d_i), all in ONE `verify` call on x d_1..d_k
    accept:  m = the length of the longest prefix with d_{i+1} == g_i (0 <= m <= k)
    emit:    g_0..g_m    (= d_1..d_m and the target's correction, or its bonus token when m = k)

then both caches roll back to the state after `x d_1..d_m` with `accept(trail, m + 1)` (the draft
from a `verify` of the same tokens: `step` leaves no trail). Every emitted token is the target's
own greedy choice after the tokens before it, so the output equals greedy `generate` with the
target exactly; the draft only decides how many tokens one target call yields (1 to k + 1).
A row that has its `max_new_tokens` tokens or has emitted a stop token keeps its caches
(`accept(trail, 0)`); the loop ends when every row is done.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from seqlab.modules.lm import LanguageModel
from seqlab.ops.checks import check_choice, check_positive_int
from seqlab.serving.generate import PADDINGS, check_stops, check_tokens, prefill, prompt_lengths


class SpeculativeGeneration(NamedTuple):
    """`tokens: [B, N]` int32 and `lengths: [B]` int32 as `Generation`; `rounds: [B]` int32,
    target `verify` calls while the row was generating; `accepted: [B]` int32, draft tokens the
    target accepted over those rounds (the mean accepted count is `accepted / rounds`)."""

    tokens: jax.Array
    lengths: jax.Array
    rounds: jax.Array
    accepted: jax.Array


def speculative_generate(
    target: LanguageModel,
    target_params,
    draft: LanguageModel,
    draft_params,
    prompts,
    *,
    max_new_tokens: int,
    num_draft: int,
    lengths=None,
    padding: str = "right",
    stop_tokens=(),
    pad_id: int = 0,
    prefill_chunk: int | None = None,
) -> SpeculativeGeneration:
    """Greedy continuation of `prompts: [B, P]` int by `max_new_tokens` tokens, proposed
    `num_draft` at a time by `draft` and verified by `target` (see the module docstring); equal to
    `generate(target, target_params, prompts, ...)` with `temperature=0`. `lengths`, `padding`,
    `stop_tokens`, `pad_id`, `prefill_chunk` as in `generate`; the two models must share the
    vocabulary, and `num_draft` must be below the window of their sliding-window attention."""
    check_tokens("prompts", prompts, "[B, P]", 2)
    check_positive_int("max_new_tokens", max_new_tokens)
    check_positive_int("num_draft", num_draft)
    check_choice("padding", padding, PADDINGS)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft must have the target's vocab_size {target.vocab_size}, got {draft.vocab_size}"
        )
    for name, model in (("target", target), ("draft", draft)):
        # A sliding-window cache holds `window` slots; `verify` rewrites num_draft + 1 of them.
        if "s" in model.pattern and num_draft + 1 > model.attention["window"]:
            raise ValueError(
                f"num_draft must be below the {name}'s attention window "
                f"{model.attention['window']}, got {num_draft}"
            )
    stops = check_stops(stop_tokens, pad_id, target.vocab_size)
    lengths = prompt_lengths(prompts, lengths)
    # Verify feeds k + 1 tokens past the last emitted one.
    max_len = prompts.shape[1] + max_new_tokens + num_draft
    options = dict(max_len=max_len, lengths=lengths, padding=padding, prefill_chunk=prefill_chunk)
    logits, target_cache = prefill(target, target_params, prompts, **options)
    _, draft_cache = prefill(draft, draft_params, prompts, **options)
    return _speculate(
        target,
        draft,
        target_params,
        draft_params,
        logits,
        target_cache,
        draft_cache,
        max_new_tokens,
        num_draft,
        stops,
        pad_id,
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 7, 8, 9, 10))
def _speculate(
    target, draft, target_params, draft_params, logits, target_cache, draft_cache,
    length, num_draft, stops, pad_id,
) -> SpeculativeGeneration:  # fmt: skip
    batch = logits.shape[0]
    rows = jnp.arange(batch)
    offsets = jnp.arange(num_draft + 1)
    stop_ids = jnp.asarray(stops, jnp.int32)

    def greedy(logits):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def apply(model, params, *args, method):
        return model.apply({"params": params}, *args, method=method)

    def propose(carry, _):
        cache, token = carry
        logits, cache = apply(draft, draft_params, token, cache, method=LanguageModel.step)
        token = greedy(logits)
        return (cache, token), token

    def cond(carry):
        return jnp.any(carry[-1])

    def body(carry):
        token, t_cache, d_cache, out, count, rounds, accepted, active = carry
        _, drafts = jax.lax.scan(propose, (d_cache, token), None, length=num_draft)
        fed = jnp.concatenate([token[:, None], drafts.T], axis=1)  # [B, k + 1]: x d_1..d_k
        t_logits, t_trail = apply(target, target_params, fed, t_cache, method=LanguageModel.verify)
        chosen = greedy(t_logits)  # [B, k + 1]: g_0..g_k
        matches = fed[:, 1:] == chosen[:, :-1]
        m = jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
        # Emit g_0..g_m at positions count..count + m (those past the end are dropped).
        emitted = active[:, None] & (offsets[None, :] <= m[:, None])
        positions = count[:, None] + offsets[None, :]
        keep = emitted & (positions < length)
        out = out.at[rows[:, None], jnp.where(keep, positions, length)].set(chosen, mode="drop")
        kept = jnp.where(active, m + 1, 0)
        t_cache = apply(target, target_params, t_trail, kept, method=LanguageModel.accept)
        _, d_trail = apply(draft, draft_params, fed, d_cache, method=LanguageModel.verify)
        d_cache = apply(draft, draft_params, d_trail, kept, method=LanguageModel.accept)
        token = jnp.where(active, chosen[rows, m], token)
        stopped = jnp.any(keep & jnp.isin(chosen, stop_ids), axis=1)
        rounds = rounds + active.astype(jnp.int32)
        accepted = accepted + jnp.where(active, m, 0)
        count = count + kept
        active = active & (count < length) & ~stopped
        return token, t_cache, d_cache, out, count, rounds, accepted, active

    first = greedy(logits)
    out = jnp.zeros((batch, length), jnp.int32).at[:, 0].set(first)
    zeros = jnp.zeros((batch,), jnp.int32)
    active = (length > 1) & ~jnp.isin(first, stop_ids)
    carry = (first, target_cache, draft_cache, out, zeros + 1, zeros, zeros, active)
    _, _, _, out, _, rounds, accepted, _ = jax.lax.while_loop(cond, body, carry)
    tokens, lengths = _after_stops(out, stop_ids, pad_id)
    return SpeculativeGeneration(tokens, lengths, rounds, accepted)


def _after_stops(tokens: jax.Array, stop_ids: jax.Array, pad_id: int):
    """`tokens: [B, N]` with every token after a row's first stop token set to `pad_id`, and the
    `[B]` lengths up to and including that stop token (N for a row without one)."""
    is_stop = jnp.isin(tokens, stop_ids).astype(jnp.int32)
    after = (jnp.cumsum(is_stop, axis=1) - is_stop) > 0
    lengths = tokens.shape[1] - jnp.sum(after, axis=1).astype(jnp.int32)
    return jnp.where(after, pad_id, tokens), lengths
