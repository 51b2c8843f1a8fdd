"""Measurements behind the sparse-embedding claims, on `seqlab.sketching`.

- `random_sparse`: `s`-sparse vectors with magnitudes in [1, 2].
- Birthday map: `exact_norms` (which `l_p` norms it keeps exactly), `birthday_probability`.
- Max map: `pairwise_ratios` (estimate over true distance per pair), `prefix_ratios` (the same
  for the maps made of the first `t` repetitions), `sum_map_ratios` (its linear counterpart),
  `ratios_of_images`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.sketching import SparseVectors, lp_distance, to_dense
from theory.common import numpy_rng

PS = (1.0, 2.0, 3.0, math.inf)
P_NAMES = ("1", "2", "3", "inf")
# Exactness in float32: an injective hash only reorders the non-zeros, so norms agree up to the
# rounding of a reordered sum (< 1e-5 relative for s <= 32); a collision of magnitudes in [1, 2]
# changes ||x||_2^2 by 2|x_i x_j| >= 2, i.e. by >= 2 / (4 s) >= 0.015 relative (l_3 similarly).
EXACT_RTOL = 1e-4


def random_sparse(rng, n: int, d: int, s: int, *, signed: bool) -> SparseVectors:
    """`n` vectors in `R^d` with exactly `s` non-zeros each, magnitudes uniform in [1, 2]."""
    idx = rng.integers(0, d, (n, s))
    for _ in range(100):  # redraw the rare rows with a repeated index
        dup = np.array([len(set(r)) < s for r in idx])
        if not dup.any():
            break
        idx[dup] = rng.integers(0, d, (int(dup.sum()), s))
    vals = rng.uniform(1, 2, (n, s)) * (rng.choice([-1.0, 1.0], (n, s)) if signed else 1.0)
    return SparseVectors(jnp.asarray(idx, jnp.int32), jnp.asarray(vals, jnp.float32), d)


def exact_norms(emb, x: SparseVectors) -> np.ndarray:
    """`[len(PS), n]` bool: whether `||Ax||_p == ||x||_p` (to `EXACT_RTOL`) for each p in PS."""
    y = emb.apply(x)
    out = []
    for p in PS:
        got = np.asarray(lp_distance(y, jnp.zeros_like(y), p))
        want = np.asarray(lp_distance(x.values, jnp.zeros_like(x.values), p))
        out.append(np.abs(got - want) <= EXACT_RTOL * want)
    return np.stack(out)


def birthday_probability(s: int, m: int) -> float:
    """Exact probability that a uniform hash into `m` buckets is injective on `s` coordinates."""
    return float(np.prod(1 - np.arange(s) / m))


def pairwise_ratios(emb, x: SparseVectors) -> np.ndarray:
    """`[len(PS), n(n-1)/2]`: the max map's distance estimate over the true `l_p` distance for
    every pair of `x`."""
    return ratios_of_images(emb, emb.apply(x), x)


def prefix_ratios(emb, x: SparseVectors, t_grid) -> np.ndarray:
    """`[len(t_grid), len(PS), n(n-1)/2]`: `pairwise_ratios` of the maps made of the first `t`
    repetitions of `emb` (each prefix is a max map of its own), by cumulative sums in numpy."""
    n = x.batch_shape[0]
    f = np.asarray(emb.apply(x), np.float64).reshape(n, emb.repetitions, emb.m)
    dense = np.asarray(to_dense(x), np.float64)
    t_idx = np.asarray(t_grid) - 1
    out = []
    for i in range(n - 1):  # pairs (i, j > i), in the order of np.triu_indices
        diff = np.abs(f[i] - f[i + 1 :])  # [n-i-1, T, m]
        true_diff = np.abs(dense[i] - dense[i + 1 :])
        per_p = []
        for p in PS:
            if math.isfinite(p):
                cum = np.cumsum(np.sum(diff**p, axis=-1), axis=-1)[:, t_idx]  # [pairs, t]
                est = (cum / (t_idx + 1)) ** (1 / p)
                true = np.sum(true_diff**p, axis=-1) ** (1 / p)
            else:
                est = np.maximum.accumulate(diff.max(axis=-1), axis=-1)[:, t_idx]
                true = true_diff.max(axis=-1)
            per_p.append(est / true[:, None])
        out.append(np.stack(per_p))  # [P, pairs_i, t]
    return np.moveaxis(np.concatenate(out, axis=1), -1, 0)


def sum_map_ratios(emb, x: SparseVectors) -> np.ndarray:
    """The linear counterpart of the max map: the same hashes, bucket sums (with random signs)
    instead of maxima, compared with the same estimate `T^{-1/p} ||A x - A y||_p`."""
    idx, vals = np.asarray(x.indices), np.asarray(x.values)
    buckets = np.asarray(emb.buckets(jnp.asarray(idx)))  # [T, n, s]
    signs = numpy_rng(jax.random.fold_in(emb.key, 7)).choice([-1.0, 1.0], (emb.repetitions, x.dim))
    n = len(vals)
    y = np.zeros((n, emb.repetitions, emb.m))
    for r in range(emb.repetitions):
        np.add.at(y[:, r], (np.arange(n)[:, None], buckets[r]), signs[r][idx] * vals)
    return ratios_of_images(emb, jnp.asarray(y.reshape(n, -1)), x)


def ratios_of_images(emb, f: jax.Array, x: SparseVectors) -> np.ndarray:
    """`[len(PS), pairs]`: `emb.distance` of the images `f: [n, T m]` over the true distances."""
    dense = to_dense(x)
    iu = np.triu_indices(len(f), 1)
    out = []
    for p in PS:
        est = np.asarray(emb.distance(f[:, None], f[None], p))[iu]
        true = np.asarray(lp_distance(dense[:, None], dense[None], p))[iu]
        out.append(est / true)
    return np.stack(out)
