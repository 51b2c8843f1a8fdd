"""Measurements behind the coordinated-sampling claims, on `seqlab.sketching`.

- `sketch_pair`, `trials`: sketches of `A` and `B` by each method and the product estimates over
  many seeds (one compilation per method and size); `error_trials`: only the Frobenius errors
  (for products too large to keep one per trial).
- Data: `random_rows`, `random_rows_padded`, `dense_of`, `product_pair`; `exact_product` and
  `shared_keys` for tables that share part of their keys; `join_tables` and `beta_from_product`
  for regression across a join; `attention_activations` and `attention_weights` for the
  attention product.
- `relative_errors`, `rms`; storage matching: `sampling_rows`, `linear_rows_matching`.
- Decisions: `tail_holds` (the `(eps, delta)` form of the guarantee), `storage_to_reach` (the
  storage a linear sketch needs to match an error).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from seqlab import sketching
from seqlab.modules.lm import LanguageModel
from seqlab.ops.attention import attention
from seqlab.sketching import SparseVectors
from theory.common import numpy_rng

METHODS = ("priority", "threshold", "threshold_indep", "jl", "countsketch")
# Seed offset giving B its own seed for the independent variants.
INDEPENDENT_OFFSET = 1_000_003
_SKETCHES = {
    "priority": sketching.priority_sketch,
    "priority_indep": sketching.priority_sketch,
    "threshold": sketching.threshold_sketch,
    "threshold_indep": sketching.threshold_sketch,
    "jl": sketching.jl_sketch,
    "countsketch": sketching.countsketch,
}


def _base(method: str) -> tuple[str, int]:
    """`(sketch name, seed offset of B)` of a method: `"<name>_indep"` is `<name>` with B's seed
    shifted by `INDEPENDENT_OFFSET` (independent samples); the others share the seed."""
    if method not in _SKETCHES:
        raise ValueError(f"method must be one of {sorted(_SKETCHES)}, got {method!r}")
    if method.endswith("_indep"):
        return method.removesuffix("_indep"), INDEPENDENT_OFFSET
    return method, 0


def sketch_pair(method: str, A, B, k: int, seed, keys_a=None, keys_b=None):
    """Sketches `(SA, SB)` of `A` and `B` with `k` rows each by `method` (one of `METHODS`, or
    `"priority_indep"`: priority sampling with different seeds for A and B)."""
    base, offset = _base(method)
    return _sketch_both(base, A, B, k, seed, seed + offset, keys_a, keys_b)


def _sketch_both(base: str, A, B, k: int, seed_a, seed_b, keys_a, keys_b):
    fn = _SKETCHES[base]
    return fn(A, k, seed_a, keys_a), fn(B, k, seed_b, keys_b)


# B's seed offset is traced, so that a method and its independent variant share a compilation.
@functools.partial(jax.jit, static_argnums=(0, 3))
def _trials(base, A, B, k, seeds, offset, keys_a, keys_b):
    def one(seed):
        SA, SB = _sketch_both(base, A, B, k, seed, seed + offset, keys_a, keys_b)
        return sketching.estimate_product(SA, SB), sketching.storage(SA) + sketching.storage(SB)

    return jax.lax.map(one, seeds)  # sequential over seeds: bounded memory for large sketches


def trials(method, A, B, k, seeds, keys_a=None, keys_b=None):
    """`(W: [trials, d, d'], storage: [trials])` over the integer `seeds`."""
    base, offset = _base(method)
    seeds = jnp.asarray(seeds, jnp.int32)
    return _trials(base, A, B, k, seeds, jnp.int32(offset), keys_a, keys_b)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _error_trials(base, A, B, k, seeds, offset, truth, keys_a, keys_b):
    def one(seed):
        SA, SB = _sketch_both(base, A, B, k, seed, seed + offset, keys_a, keys_b)
        err = jnp.linalg.norm(sketching.estimate_product(SA, SB) - truth)
        return err, sketching.storage(SA) + sketching.storage(SB)

    return jax.lax.map(one, seeds)


def error_trials(method, A, B, k, seeds, truth, keys_a=None, keys_b=None):
    """`(||W_t - truth||_F: [trials] float64, storage: [trials])` over the integer `seeds`,
    without keeping the estimates `W_t` (`truth: [d, d']`, compared in float32)."""
    base, offset = _base(method)
    seeds, truth = jnp.asarray(seeds, jnp.int32), jnp.asarray(truth, jnp.float32)
    err, st = _error_trials(base, A, B, k, seeds, jnp.int32(offset), truth, keys_a, keys_b)
    return np.asarray(err, np.float64), np.asarray(st)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _batched_error_trials(base, A, B, k, seeds, truth):
    def one(a, b, t):
        return _error_trials(base, a, b, k, seeds, jnp.int32(0), t, None, None)

    return jax.vmap(one)(A, B, truth)


def batched_error_trials(method, A, B, k, seeds, truth):
    """`error_trials` of coordinated `method` for a batch of products at once (one compilation):
    `A` and `B` with a leading batch axis `[G, ...]` (dense or `SparseVectors`), `truth:
    [G, d, d']`; returns `(errors, storage): [G, trials]`."""
    base, offset = _base(method)
    if offset:
        raise ValueError(f"method must be coordinated, got {method!r}")
    seeds, truth = jnp.asarray(seeds, jnp.int32), jnp.asarray(truth, jnp.float32)
    err, st = _batched_error_trials(base, A, B, k, seeds, truth)
    return np.asarray(err, np.float64), np.asarray(st)


def distinct_columns(rng, n: int, d: int, s: int) -> np.ndarray:
    """`[n, s]` column indices, each row `s` distinct columns of `d` drawn uniformly (rows with a
    repeat are drawn again: uniform over ordered distinct tuples, O(n s) when `s^2 <= d`)."""
    if not 0 < s <= d:
        raise ValueError(f"s must be in [1, d = {d}], got {s}")
    if s * s > d:  # repeats are common: a random permutation per row
        return np.argsort(rng.random((n, d)), axis=1)[:, :s]
    idx = rng.integers(0, d, (n, s))
    while True:
        srt = np.sort(idx, axis=1)
        bad = np.flatnonzero(np.any(srt[:, 1:] == srt[:, :-1], axis=1))
        if bad.size == 0:
            return idx
        idx[bad] = rng.integers(0, d, (bad.size, s))


def random_rows(rng, n: int, d: int, s: int, *, heavy: bool = False) -> SparseVectors:
    """`n` rows in `R^d` with `s` non-zeros at uniform distinct columns, standard normal values,
    row scales from a Student-t(2) when `heavy`; float32."""
    idx = distinct_columns(rng, n, d, s)
    vals = rng.normal(size=(n, s))
    if heavy:
        vals *= np.abs(rng.standard_t(2, (n, 1)))
    return SparseVectors(jnp.asarray(idx, jnp.int32), jnp.asarray(vals, jnp.float32), d)


def dense_of(x: SparseVectors) -> np.ndarray:
    """`[n, d]` float64 dense rows of `x`."""
    out = np.zeros((x.batch_shape[0], x.dim))
    np.put_along_axis(out, np.asarray(x.indices), np.asarray(x.values, np.float64), axis=1)
    return out


def relative_errors(W, truth: np.ndarray, scale: float) -> np.ndarray:
    """`||W_t - truth||_F / scale` per trial."""
    W = np.asarray(W, np.float64)
    return np.linalg.norm((W - truth).reshape(len(W), -1), axis=1) / scale


def rms(x) -> float:
    """Root mean square of `x`."""
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


def exact_product(A: SparseVectors, B: SparseVectors, keys_a=None, keys_b=None) -> np.ndarray:
    """`A^T B = sum over keys in both of a_key b_key^T: [d, d']` float64, from the sparse rows
    (numpy outer products of the matched rows; keys default to the row index)."""
    n_a, n_b = A.batch_shape[0], B.batch_shape[0]
    ka = np.arange(n_a) if keys_a is None else np.asarray(keys_a)
    kb = np.arange(n_b) if keys_b is None else np.asarray(keys_b)
    _, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    va, vb = np.asarray(A.values, np.float64)[ia], np.asarray(B.values, np.float64)[ib]
    xa, xb = np.asarray(A.indices)[ia], np.asarray(B.indices)[ib]
    out = np.zeros((A.dim, B.dim))
    outer = va[:, :, None] * vb[:, None, :]  # [matched, s_A, s_B]
    np.add.at(out, (np.broadcast_to(xa[:, :, None], outer.shape), xb[:, None, :]), outer)
    return out


def frobenius(x: SparseVectors) -> float:
    """`||X||_F` of sparse rows."""
    return float(np.linalg.norm(np.asarray(x.values, np.float64)))


def shared_keys(n: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Keys of two tables of `n` rows each sharing `round(fraction n)` keys: `(keys_a, keys_b)`,
    `[n]` int32 each (A: `0..n-1`; B: the first shared ones, then keys from `n` up)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    m = round(fraction * n)
    keys_b = np.r_[np.arange(m), n + np.arange(n - m)]
    return np.arange(n, dtype=np.int32), keys_b.astype(np.int32)


def tail_holds(relative: np.ndarray, eps: float, delta: float) -> tuple[bool, float]:
    """The `(eps, delta)` form of the guarantee on measured relative errors `[trials]`:
    `(fraction within eps >= 1 - delta, fraction within eps)`."""
    within = float(np.mean(np.asarray(relative) <= eps))
    return within >= 1 - delta, within


def storage_to_reach(storage, errors, target: float) -> float:
    """The storage at which an error-vs-storage curve (`storage, errors: [points]`, storage
    ascending, error decreasing) comes down to `target`: log-log interpolation between the
    measured points around the crossing; `inf` when even the largest storage stays above
    `target`, `storage[0]` when the smallest is already at or below it."""
    storage, errors = np.asarray(storage, np.float64), np.asarray(errors, np.float64)
    if errors[-1] > target:
        return math.inf
    if errors[0] <= target:
        return float(storage[0])
    i = int(np.argmax(errors <= target))  # first point at or below target
    x0, x1 = np.log(storage[i - 1 : i + 1])
    y0, y1 = np.log(errors[i - 1 : i + 1])
    return float(np.exp(x0 + (np.log(target) - y0) * (x1 - x0) / (y1 - y0)))


def product_pair(key: jax.Array, n: int, d: int, s: int, heavy: bool):
    """`(A, B, A^T B, ||A||_F ||B||_F)` for two tables of `random_rows` drawn from `key`."""
    rng = numpy_rng(key)
    A, B = random_rows(rng, n, d, s, heavy=heavy), random_rows(rng, n, d, s, heavy=heavy)
    Ad, Bd = dense_of(A), dense_of(B)
    return A, B, Ad.T @ Bd, float(np.linalg.norm(Ad) * np.linalg.norm(Bd))


def sampling_rows(budget_per_table: float, d: int, s: int) -> int:
    """Rows a sampling sketch keeps for about `budget_per_table` stored numbers with `s`
    non-zeros per row (`min(2s, d) + 1` per row, plus 1)."""
    return max(1, round((budget_per_table - 1) / (min(2 * s, d) + 1)))


def random_rows_padded(rng, n: int, d: int, s: int) -> SparseVectors:
    """`random_rows` with `d` slots whatever `s` (zero padding), so that every sparsity shares one
    array shape and one compilation; storage counts only the non-zeros."""
    rows = random_rows(rng, n, d, s)
    pad = d - s
    idx = jnp.pad(rows.indices, ((0, 0), (0, pad)))
    return SparseVectors(idx, jnp.pad(rows.values, ((0, 0), (0, pad))), d)


def linear_rows_matching(k: int, d: int, s: int) -> int:
    """Rows of a linear sketch (`k_lin d` numbers per table) matching a sampling sketch of `k`
    rows with `s` non-zeros each (`k (min(2s, d) + 1) + 1` numbers per table)."""
    return max(1, round((k * (min(2 * s, d) + 1) + 1) / d))


def join_tables(rng, n_a: int, n_b: int, overlap: int, features: int):
    """Two tables joined by key. Party A holds `x: [n_a, features]` (heavy-tailed), party B holds
    `y: [n_b]`; `overlap` keys are shared, and on them `y = x beta + noise`.

    Returns the regression design of each side, `A' = [x, upper(x x^T), 1]` and `B' = [y, 1]`
    (so that `A'^T B'` over the join holds `X^T y`, `X^T X`, `1^T X`, `1^T y`, the join size), the
    keys, and `beta` of the exact join.
    """
    keys = rng.choice(10**8, n_a + n_b - overlap, replace=False)
    keys_a, keys_b = keys[:n_a], keys[n_a - overlap :]
    x = rng.standard_t(3, (n_a, features))
    beta_true = rng.normal(size=features + 1)
    y = rng.normal(size=n_b) * 3
    joined = np.c_[x[n_a - overlap :], np.ones(overlap)]
    y[:overlap] = joined @ beta_true + rng.normal(size=overlap)
    iu = np.triu_indices(features)
    design_a = np.c_[x, (x[:, :, None] * x[:, None, :])[:, iu[0], iu[1]], np.ones(n_a)]
    design_b = np.c_[y, np.ones(n_b)]
    beta = np.linalg.lstsq(joined, y[:overlap], rcond=None)[0]
    return design_a, design_b, keys_a, keys_b, beta


def beta_from_product(P: np.ndarray, features: int) -> np.ndarray:
    """Least squares `beta` of `y` on `[x, 1]` from `P = A'^T B'` (`join_tables` layout)."""
    iu = np.triu_indices(features)
    gram = np.zeros((features + 1, features + 1))
    upper = P[features : features + len(iu[0]), 1]
    gram[iu] = upper
    gram[iu[1], iu[0]] = upper
    gram[:features, features] = gram[features, :features] = P[:features, 1]
    gram[features, features] = P[-1, 1]
    rhs = np.r_[P[:features, 0], P[-1, 0]]
    return np.linalg.lstsq(gram, rhs, rcond=None)[0]


def attention_activations(model: LanguageModel, params, tokens) -> list[tuple]:
    """Per attention block of `model` (a `LanguageModel` whose blocks are all `"a"`) on `tokens:
    [T]` int: `(q, k, v, o)`, `q, k, v: [T, H, D]` float32 the block's real operands (its norm,
    projections and RoPE, through `op_inputs`) and `o: [T, H, D]` the block's attention output,
    for the consistency check. `params`: the model's `params` collection."""
    if set(model.pattern) != {"a"}:
        raise ValueError(
            f"model must be all global attention blocks, got pattern {model.pattern!r}"
        )
    bound = model.bind({"params": params})
    h = bound.embed(jnp.asarray(tokens, jnp.int32)[None])
    out = []
    for block in bound.blocks:
        inputs = block.mixer.op_inputs(block.mixer_norm(h))
        if inputs["k"].shape[2] != inputs["q"].shape[2]:
            raise ValueError("model must have as many key/value heads as query heads")
        o = attention(**inputs)
        out.append((inputs["q"][0], inputs["k"][0], inputs["v"][0], o[0]))
        h = block(h)
    return out


def attention_weights(q: jax.Array, k: jax.Array) -> jax.Array:
    """Causal `P = softmax(q k^T / sqrt(D)): [H, T, T]` (rows: queries) for `q, k: [T, H, D]`."""
    scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    return jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)


def top_share(P, fraction: float) -> float:
    """The share of `||P||_F^2` held by the `fraction` of key positions (columns of `P: [T, T]`,
    rows of `P^T`) with the largest norms: a concentration measure of attention."""
    col = np.sort(np.sum(np.square(np.asarray(P, np.float64)), axis=0))[::-1]
    top = max(1, round(fraction * col.size))
    return float(col[:top].sum() / col.sum())
