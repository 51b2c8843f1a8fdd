"""Synthetic sequence tasks; every batch is a pure function of `(seed, stream, step)`.

A batch is a dict of numpy arrays `inputs: [B, T] int32` and `targets: [B, T] int32`:
`targets[b, t]` is the token to predict after reading `inputs[b, : t + 1]`, or `IGNORE` (-100)
where nothing is scored.

Randomness is numpy's PCG64 seeded with the integer triple `(seed, stream, step)`: integer seeds are
the point here, since a resumed run and every host of a pod must regenerate exactly the batch of a
step without sharing any state. `stream` separates training (0) from evaluation streams (>= 1).
"""

import numpy as np

from seqlab.ops.checks import check_positive_int

IGNORE = -100


def batch_rng(seed: int, stream: int, step: int) -> np.random.Generator:
    """The generator of one batch: PCG64 seeded with `(seed, stream, step)`, all ints >= 0."""
    for name, value in (("seed", seed), ("stream", stream), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return np.random.default_rng([int(seed), int(stream), int(step)])


def _check_positive(**sizes) -> None:
    for name, value in sizes.items():
        check_positive_int(name, value)


def _distinct(rng: np.random.Generator, batch_size: int, low: int, high: int, k: int):
    """`[batch_size, k]` ints from `[low, high)`, distinct within each row (uniform subsets in
    uniform order: the first k of a random permutation)."""
    return rng.random((batch_size, high - low)).argsort(axis=1)[:, :k] + low


def mqar(
    rng: np.random.Generator,
    *,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    num_kv_pairs: int,
    power_a: float = 0.01,
) -> dict[str, np.ndarray]:
    """Multi-query associative recall as in Zoology (Arora et al. 2023, `multiquery_ar`).

    One row (`T = seq_len`, `P = num_kv_pairs`, `V = vocab_size`):

        k_1 v_1 k_2 v_2 ... k_P v_P | query region of length T - 2P

    keys are distinct draws from `[1, V // 2)`, values distinct draws from `[V // 2, V)`. Key `k_i`
    appears once more in the query region, at offset `2 g_i`; the gaps `g` are distinct, drawn
    without replacement from `{0, ..., (T - 2P) // 2 - 1}` with weights `p(g) ∝ (g + 1)^(a - 1)`
    (`a = power_a`, a power law favouring short gaps). The target at that query position is `v_i`;
    the other query-region positions hold uniform random tokens from `[0, V)` and target `IGNORE`,
    and so does the whole kv prefix.

    Weighted sampling without replacement is done with exponential races (Efraimidis and
    Spirakis): the P largest `log(u) / p(g)` give the same law as drawing one gap after another.
    """
    _check_positive(batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size)
    _check_positive(num_kv_pairs=num_kv_pairs)
    if 4 * num_kv_pairs > seq_len:
        raise ValueError(f"seq_len must be >= 4 * num_kv_pairs = {4 * num_kv_pairs}, got {seq_len}")
    if vocab_size // 2 - 1 < num_kv_pairs:
        raise ValueError(
            f"vocab_size must be >= 2 * (num_kv_pairs + 1) = {2 * (num_kv_pairs + 1)}, "
            f"got {vocab_size}"
        )
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0, got {power_a}")
    b, p, half = batch_size, num_kv_pairs, vocab_size // 2
    keys = _distinct(rng, b, 1, half, p)
    values = _distinct(rng, b, half, vocab_size, p)
    space = (seq_len - 2 * p) // 2
    weights = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1.0)
    race = np.log(rng.random((b, space))) / (weights / weights.sum())
    gaps = np.argsort(-race, axis=1)[:, :p]

    inputs = np.empty((b, seq_len), np.int32)
    inputs[:, 0 : 2 * p : 2] = keys
    inputs[:, 1 : 2 * p : 2] = values
    inputs[:, 2 * p :] = rng.integers(0, vocab_size, (b, seq_len - 2 * p))
    query_pos = 2 * p + 2 * gaps
    np.put_along_axis(inputs, query_pos, keys, axis=1)
    targets = np.full((b, seq_len), IGNORE, np.int32)
    np.put_along_axis(targets, query_pos, values, axis=1)
    return {"inputs": inputs, "targets": targets}


def selective_copying(
    rng: np.random.Generator,
    *,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    num_tokens: int,
) -> dict[str, np.ndarray]:
    """Selective copying (Gu and Dao 2023, Mamba, section 4.1.1).

    One row (`T = seq_len`, `n = num_tokens`): a context of `T - n` positions holding `n` data
    tokens from `[2, V)` at random positions (in order) and the blank token 0 elsewhere, then `n`
    copies of the marker token 1. The target at the j-th marker is the j-th data token; every
    other target is `IGNORE`.
    """
    _check_positive(batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size)
    _check_positive(num_tokens=num_tokens)
    if 2 * num_tokens > seq_len:
        raise ValueError(f"seq_len must be >= 2 * num_tokens = {2 * num_tokens}, got {seq_len}")
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3 (blank, marker, data), got {vocab_size}")
    b, n, context = batch_size, num_tokens, seq_len - num_tokens
    data = rng.integers(2, vocab_size, (b, n))
    positions = np.sort(_distinct(rng, b, 0, context, n), axis=1)
    inputs = np.zeros((b, seq_len), np.int32)
    np.put_along_axis(inputs, positions, data, axis=1)
    inputs[:, context:] = 1
    targets = np.full((b, seq_len), IGNORE, np.int32)
    targets[:, context:] = data
    return {"inputs": inputs, "targets": targets}


def induction_heads(
    rng: np.random.Generator,
    *,
    batch_size: int,
    seq_len: int,
    vocab_size: int,
) -> dict[str, np.ndarray]:
    """Induction heads (Olsson et al. 2022; the Mamba paper's synthetic, section 4.1.2).

    One row: uniform tokens from `[2, V)`, the trigger token 1 at a random position `p` in
    `[0, T - 3]` followed by an answer token `x = inputs[p + 1]`, and the trigger again at the last
    position, whose target is `x`. Every other target is `IGNORE`.
    """
    _check_positive(batch_size=batch_size, seq_len=seq_len, vocab_size=vocab_size)
    if seq_len < 4:
        raise ValueError(f"seq_len must be >= 4, got {seq_len}")
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3 (unused 0, trigger, data), got {vocab_size}")
    b = batch_size
    inputs = rng.integers(2, vocab_size, (b, seq_len)).astype(np.int32)
    trigger_pos = rng.integers(0, seq_len - 2, b)
    rows = np.arange(b)
    inputs[rows, trigger_pos] = 1
    inputs[:, -1] = 1
    targets = np.full((b, seq_len), IGNORE, np.int32)
    targets[:, -1] = inputs[rows, trigger_pos + 1]
    return {"inputs": inputs, "targets": targets}
