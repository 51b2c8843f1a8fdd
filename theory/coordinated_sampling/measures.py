"""Measurements behind the coordinated-sampling claims, on `seqlab.sketching`.

- `sketch_pair`, `trials`: sketches of `A` and `B` by each method and the product estimates over
  many seeds (one compilation per method and size).
- Data: `random_rows`, `random_rows_padded`, `dense_of`, `product_pair`; `join_tables` and
  `beta_from_product` for regression across a join; `attention_activations` and
  `attention_weights` for the attention product.
- `relative_errors`; storage matching: `sampling_rows`, `linear_rows_matching`.
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
# Seed offset giving B its own seed for the independent variant.
INDEPENDENT_OFFSET = 1_000_003


def sketch_pair(method: str, A, B, k: int, seed, keys_a=None, keys_b=None):
    """Sketches `(SA, SB)` of `A` and `B` with `k` rows each by `method` (one of `METHODS`)."""
    fn = {
        "priority": sketching.priority_sketch,
        "threshold": sketching.threshold_sketch,
        "threshold_indep": sketching.threshold_sketch,
        "jl": sketching.jl_sketch,
        "countsketch": sketching.countsketch,
    }[method]
    seed_b = seed + INDEPENDENT_OFFSET if method == "threshold_indep" else seed
    return fn(A, k, seed, keys_a), fn(B, k, seed_b, keys_b)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _trials(method, A, B, k, seeds, keys_a, keys_b):
    def one(seed):
        SA, SB = sketch_pair(method, A, B, k, seed, keys_a, keys_b)
        return sketching.estimate_product(SA, SB), sketching.storage(SA) + sketching.storage(SB)

    return jax.lax.map(one, seeds)  # sequential over seeds: bounded memory for large sketches


def trials(method, A, B, k, seeds, keys_a=None, keys_b=None):
    """`(W: [trials, d, d'], storage: [trials])` over the integer `seeds`."""
    return _trials(method, A, B, k, jnp.asarray(seeds, jnp.int32), keys_a, keys_b)


def random_rows(rng, n: int, d: int, s: int, *, heavy: bool = False) -> SparseVectors:
    """`n` rows in `R^d` with `s` non-zeros at uniform distinct columns, standard normal values,
    row scales from a Student-t(2) when `heavy`; float32."""
    idx = np.argsort(rng.random((n, d)), axis=1)[:, :s]
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


def attention_activations(key: jax.Array, length: int):
    """`(q, k, v): [T, H, D]` float32 from the attention block of a randomly initialized
    `LanguageModel(pattern="a")` on random tokens (its real projections, norm and RoPE), and the
    block's attention output `o: [T, H, D]` for the consistency check."""
    model = LanguageModel(
        vocab_size=256, d_model=64, pattern="a", attention={"num_heads": 4, "head_dim": 16}
    )
    k_init, k_tok = jax.random.split(key)
    tokens = jax.random.randint(k_tok, (1, length), 0, model.vocab_size)
    params = model.init(k_init, tokens)
    bound = model.bind(params)
    block = bound.blocks[0]
    x = block.mixer_norm(bound.embed(tokens))
    inputs = block.mixer.op_inputs(x)
    o = attention(**inputs)
    return inputs["q"][0], inputs["k"][0], inputs["v"][0], o[0]


def attention_weights(q: jax.Array, k: jax.Array) -> jax.Array:
    """Causal `P = softmax(q k^T / sqrt(D)): [H, T, T]` (rows: queries) for `q, k: [T, H, D]`."""
    scores = jnp.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    return jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
