"""Measurements behind the sparse-embedding claims, on `seqlab.sketching`.

Everything stays sparse: data are `SparseVectors` in `R^d` with `d` up to `10^6`, images are kept
as compact sparse vectors (`seqlab.sketching.compact`), and true pairwise distances are computed
on the union of two supports, so no `[n, d]` or `[n, m]` array is ever built.

- Data: `random_sparse` (uniform supports), `near_duplicates` (groups sharing `s - 1`
  coordinates: each pair's distance sits on two coordinates, the hard case of the max map).
- Exactness of norms: `exact_norms`, `birthday_probability`, `needed_dimension` (the `m` at
  which a fraction of exact vectors reaches a target), `loglog_slope`.
- Pairwise distances: `pair_indices`, `true_distances`, `rep_distances` (per repetition, from
  compact images), `running_ratios` (the estimate from the first `t` repetitions over the
  truth), `repetitions_needed`, `sum_map_images` (the max map's linear counterpart).
"""

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.sketching import (
    SparseVectors,
    birthday_embedding,
    linf_dimension,
    lp_distance,
    max_embedding,
    max_embedding_dimension,
)
from seqlab.sketching.compact import compact_max_image, merge_slots, sparse_jl
from seqlab.sketching.recovery import gaussian_measurements, measure, omp

PS = (1.0, 2.0, 3.0, math.inf)
P_NAMES = ("1", "2", "3", "inf")
# Exactness in float32: an injective hash only reorders the non-zeros, so norms agree up to the
# rounding of a reordered sum (< 1e-5 relative for s <= 64); a collision of magnitudes in [1, 2]
# changes ||x||_2^2 by 2|x_i x_j| >= 2, i.e. by >= 2 / (4 s) >= 0.008 relative (l_3 similarly).
EXACT_RTOL = 1e-4
# An estimate "never expands" a distance when estimate / true <= 1 + EXPAND_RTOL (float32 sums).
EXPAND_RTOL = 1e-5


def random_sparse(rng, n: int, d: int, s: int, *, signed: bool) -> SparseVectors:
    """`n` vectors in `R^d` with exactly `s` non-zeros each (uniform support without
    replacement), magnitudes uniform in [1, 2], random signs when `signed`."""
    idx = rng.integers(0, d, (n, s))
    for _ in range(100):  # redraw the rare rows with a repeated index
        dup = np.array([len(set(r)) < s for r in idx])
        if not dup.any():
            break
        idx[dup] = rng.integers(0, d, (int(dup.sum()), s))
    vals = rng.uniform(1, 2, (n, s)) * (rng.choice([-1.0, 1.0], (n, s)) if signed else 1.0)
    return SparseVectors(jnp.asarray(idx, jnp.int32), jnp.asarray(vals, jnp.float32), d)


def near_duplicates(rng, n: int, d: int, s: int, group: int = 8) -> SparseVectors:
    """`n` non-negative `s`-sparse vectors in groups of `group`: a group shares `s - 1`
    coordinates and values (its base), and each vector adds one coordinate of its own (values
    uniform in [1, 2]). Two vectors of one group differ on two coordinates only, so a single
    collision of one of them can remove half of their distance: the max map's hard case."""
    if s < 2 or n % group:
        raise ValueError(f"need s >= 2 and n a multiple of group = {group}, got s={s}, n={n}")
    idx = rng.choice(d, size=(n // group) * (s - 1) + n, replace=False)
    base = idx[: (n // group) * (s - 1)].reshape(n // group, s - 1)
    own = idx[(n // group) * (s - 1) :].reshape(n, 1)
    base_vals = rng.uniform(1, 2, (n // group, s - 1))
    indices = np.concatenate([np.repeat(base, group, axis=0), own], axis=1)
    values = np.concatenate([np.repeat(base_vals, group, axis=0), rng.uniform(1, 2, (n, 1))], 1)
    return SparseVectors(jnp.asarray(indices, jnp.int32), jnp.asarray(values, jnp.float32), d)


def head(x: SparseVectors, n: int) -> SparseVectors:
    """The first `n` vectors of `x: [N]`."""
    return SparseVectors(x.indices[:n], x.values[:n], x.dim)


def norms(values: jax.Array, p: float) -> np.ndarray:
    """`||v||_p` over the last axis of `values` (zero slots are padding), as numpy."""
    return np.asarray(lp_distance(values, jnp.zeros_like(values), p))


def slot_norms(indices, values, ps=PS) -> np.ndarray:
    """`[len(ps), ...]`: `||sum_j values_j e_{indices_j}||_p` over the last axis of `indices,
    values: [..., k]`, slots with equal indices summed first (numpy, float64: a sort per row is
    fast there, unlike XLA's on CPU)."""
    idx = np.asarray(indices)
    k = idx.shape[-1]
    idx, val = idx.reshape(-1, k), np.asarray(values, np.float64).reshape(-1, k)
    order = np.argsort(idx, axis=1, kind="stable")
    idx, val = np.take_along_axis(idx, order, 1), np.take_along_axis(val, order, 1)
    first = np.ones(idx.shape, bool)
    first[:, 1:] = idx[:, 1:] != idx[:, :-1]
    last = np.ones(idx.shape, bool)
    last[:, :-1] = first[:, 1:]
    total = np.cumsum(val, axis=1)
    before = np.zeros_like(total)
    before[:, 1:] = total[:, :-1]
    runs = np.abs(total[last] - before[first])  # the sum of each run, row-major
    starts = np.searchsorted(np.nonzero(first)[0], np.arange(len(idx)))
    out = [
        np.maximum.reduceat(runs, starts)
        if math.isinf(p)
        else np.add.reduceat(runs**p, starts) ** (1 / p)
        for p in ps
    ]
    return np.stack(out).reshape(len(ps), *np.shape(indices)[:-1])


def exact_norms(indices, values, x: SparseVectors, ps=PS) -> np.ndarray:
    """`[len(ps), n]` bool: whether the image given by its slots `(indices, values)` (merged or
    not, `slot_norms`) has the norms of `x` to `EXACT_RTOL`, for each `p`: a map's image `A x`,
    or a decoded vector of `x`."""
    got = slot_norms(indices, values, ps)
    want = slot_norms(x.indices, x.values, ps)
    return np.abs(got - want) <= EXACT_RTOL * want


def all_p_exact_fraction(indices, values, x: SparseVectors) -> float:
    """The fraction of vectors of `x` whose every norm in `PS` is exact in the image slots."""
    return float(np.mean(np.all(exact_norms(indices, values, x), axis=0)))


def birthday_slots(emb, x: SparseVectors) -> tuple[jax.Array, jax.Array]:
    """The birthday map's image slots `(h(i), sigma(i) x_i): [n, s]` of `x` (unmerged)."""
    bucket, sign = emb.buckets(x.indices)
    return bucket, sign.astype(x.values.dtype) * x.values


def birthday_probability(s: int, m: int) -> float:
    """Exact probability that a uniform hash into `m` buckets is injective on `s` coordinates."""
    return float(np.prod(1 - np.arange(s) / m))


def needed_dimension(ms, fractions, target: float = 0.99) -> float:
    """The `m` at which the exact fraction reaches `target`, from measurements on a grid `ms`.

    Fits `log(1 - fraction) = a + b log m` by least squares on the grid points whose failure
    rate `1 - fraction` lies in `[(1 - target) / 5, 5 (1 - target)]` (a local fit: it smooths the
    binomial noise of single points without assuming the rate's exponent `b`) and solves it for
    `1 - target`. Returns `nan` when fewer than two points are in that range or the fitted rate
    does not fall with `m`, and `inf` when it falls too slowly for the answer to be a float.
    """
    ms, fail = np.asarray(ms, float), 1 - np.asarray(fractions, float)
    goal = 1 - target
    keep = (fail >= goal / 5) & (fail <= 5 * goal)
    if keep.sum() < 2:
        return math.nan
    b, a = np.polyfit(np.log(ms[keep]), np.log(fail[keep]), 1)
    if b >= 0:
        return math.nan
    log_m = (math.log(goal) - a) / b
    return math.exp(log_m) if log_m < math.log(sys.float_info.max) else math.inf


def loglog_slope(xs, ys) -> float:
    """Least-squares slope of `log y` against `log x`."""
    return float(np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)[0])


def pair_indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """`(i, j)`: the `n (n - 1) / 2` pairs `i < j` ordered by `j`, then `i`. The pairs of the first
    `n' < n` vectors are then the first `n' (n' - 1) / 2` pairs: nested data sets share rows."""
    i, j = np.triu_indices(n, 1)
    order = np.lexsort((i, j))
    return i[order], j[order]


def pair_count(n: int) -> int:
    """`n (n - 1) / 2`."""
    return n * (n - 1) // 2


def _pair_powers(idx_a, val_a, idx_b, val_b, ps):
    """Per `p`, `sum |a - b|^p` (finite `p`) or `max |a - b|` over the last axis, for sparse
    vectors `a, b` given as `(indices, values): [..., s]` (live slots: non-zero values, with
    distinct indices within a vector). Slots of `a` and `b` with one index are paired through an
    `s x s` equality test: `a - b` is `val_a - partner` on `a`'s slots and `-val_b` on the
    unpaired slots of `b`."""
    live_a, live_b = val_a != 0, val_b != 0
    same = idx_a[..., :, None] == idx_b[..., None, :]
    same &= live_a[..., :, None] & live_b[..., None, :]
    partner = jnp.sum(jnp.where(same, val_b[..., None, :], 0), axis=-1)
    unpaired_b = jnp.where(jnp.any(same, axis=-2), 0, val_b)
    diff = jnp.abs(jnp.concatenate([val_a - partner, unpaired_b], axis=-1))
    return tuple(jnp.max(diff, -1) if math.isinf(p) else jnp.sum(diff**p, -1) for p in ps)


@functools.partial(jax.jit, static_argnums=4)
def _pair_powers_at(indices, values, ii, jj, ps):
    """`_pair_powers` of the pairs `(ii, jj)` of the vectors `(indices, values): [n, ..., s]`."""
    return _pair_powers(indices[ii], values[ii], indices[jj], values[jj], ps)


def _pairwise_chunks(x: SparseVectors, ps, chunk: int):
    """Yields `(lo, powers)` with `powers: [len(ps), k, ...]` the `_pair_powers` of pairs
    `lo .. lo + k` (`pair_indices` order) of `x` (batch `[n, ...]`), `k <= chunk` (the last chunk
    is padded, so one compilation serves all)."""
    i, j = pair_indices(x.batch_shape[0])
    for lo in range(0, len(i), chunk):
        ii, jj = i[lo : lo + chunk], j[lo : lo + chunk]
        k = len(ii)
        pad = chunk - k if len(i) > chunk else 0
        ii, jj = np.pad(ii, (0, pad)), np.pad(jj, (0, pad))
        out = _pair_powers_at(x.indices, x.values, ii, jj, tuple(ps))
        yield lo, np.stack([np.asarray(o) for o in out])[:, :k]


def true_distances(x: SparseVectors, ps=PS, chunk: int = 1 << 15) -> np.ndarray:
    """`[len(ps), pairs]`: `||x_i - x_j||_p` for every pair `i < j` of `x: [n]` (`pair_indices`),
    on the union of the two supports (never densified)."""
    powers = np.concatenate([v for _, v in _pairwise_chunks(x, ps, chunk)], axis=1)
    return np.stack([v if math.isinf(p) else v ** (1 / p) for v, p in zip(powers, ps, strict=True)])


def rep_distances(images: SparseVectors, ps=PS, rows: int = 1 << 20) -> np.ndarray:
    """`[len(ps), pairs, T]`: per repetition `r`, `||f_r(x_i) - f_r(x_j)||_p^p` (finite `p`) or
    `||f_r(x_i) - f_r(x_j)||_inf`, from compact images of batch `[n, T]` (dimension `m`).

    `rows` bounds the (pair, repetition) rows processed at once.
    """
    chunk = max(1, rows // images.batch_shape[1])
    return np.concatenate([v for _, v in _pairwise_chunks(images, ps, chunk)], axis=1)


def running_ratios(rep: np.ndarray, true: np.ndarray, ps=PS) -> np.ndarray:
    """`[len(ps), pairs, T]`: the estimate from the first `t` repetitions over the true distance,
    `(mean_{r <= t} ||f_r(x) - f_r(y)||_p^p)^{1/p} / ||x - y||_p` (the max over `r <= t` for
    `p = inf`), from `rep_distances` and `true_distances`."""
    out = []
    for v, t, p in zip(rep, true, ps, strict=True):
        if math.isinf(p):
            est = np.maximum.accumulate(v, axis=-1)
        else:
            est = (np.cumsum(v, axis=-1) / np.arange(1, v.shape[-1] + 1)) ** (1 / p)
        out.append(est / t[:, None])
    return np.stack(out)


def repetitions_needed(ratios: np.ndarray, eps: float) -> int:
    """The smallest `t` such that every pair's ratio is `>= 1 - eps` at every `t' >= t` up to the
    last repetition (`ratios: [pairs, T]` of `running_ratios` for one `p`); `T + 1` when some
    pair is below at the last repetition (never reached)."""
    return first_good(np.any(ratios < 1 - eps, axis=0))


def first_good(bad: np.ndarray) -> int:
    """`1 +` the last index where `bad: [T]` is true (1-based: the first `t` after which it
    never is), `1` when it never is, `T + 1` when it is at the end."""
    return int(np.flatnonzero(bad)[-1] + 2) if bad.any() else 1


def final_ratios(images: SparseVectors, x: SparseVectors, ps=PS) -> np.ndarray:
    """`[len(ps), pairs]`: the estimate from all `T` repetitions of the compact images
    (batch `[n, T]`) over the true distance, for every pair of `x: [n]`."""
    return running_ratios(rep_distances(images, ps), true_distances(x, ps), ps)[..., -1]


def scan_repetitions(images, true, sizes, reps, eps: float, ps=PS, rows: int = 1 << 20):
    """`repetitions_needed` for nested data sets without holding every pair's repetitions at once.

    `images`: compact images of batch `[n, T]`; `true: [len(ps), pairs]` (`true_distances`);
    the data set of size `sizes[k]` is the first `sizes[k]` vectors, evaluated on its first
    `reps[k] <= T` repetitions. Returns `(needed, max_ratio)`: `needed: [len(sizes), len(ps)]`
    ints and `max_ratio: [len(sizes)]`, the largest estimate over true distance (any `t`, any
    `p`).
    """
    n, t_all = images.batch_shape
    if max(sizes) > n or max(reps) > t_all:
        raise ValueError(f"sizes must be <= {n} and reps <= {t_all}, got {sizes}, {reps}")
    bad = [np.zeros((len(ps), t), bool) for t in reps]  # [k][p, t]: some pair below 1 - eps
    top = np.zeros(len(sizes))
    for lo, rep in _pairwise_chunks(images, ps, max(1, rows // t_all)):
        for k, (size, t) in enumerate(zip(sizes, reps, strict=True)):
            hi = min(pair_count(size), lo + rep.shape[1])
            if hi <= lo:
                continue
            ratios = running_ratios(rep[:, : hi - lo, :t], true[:, lo:hi], ps)
            bad[k] |= np.any(ratios < 1 - eps, axis=1)
            top[k] = max(top[k], float(ratios.max()))
    return np.array([[first_good(b) for b in bk] for bk in bad]), top


def sum_map_images(key: jax.Array, emb, x: SparseVectors) -> SparseVectors:
    """The max map's linear counterpart: the same hashes `h_r` as `emb` (a `MaxMap`), signed bucket
    sums `sum_{h_r(i) = b} sigma_r(i) x_i` instead of maxima (a CountSketch with `T` rows,
    `sigma_r` drawn from `key`), as compact images of batch `[n, T]`; compared by the same
    estimate."""
    return _sum_map_images(key, emb, x)


@jax.jit
def _sum_map_images(key, emb, x):
    bucket = jnp.moveaxis(emb.buckets(x.indices), 0, 1)  # [n, T, s]

    def signs(r):
        return birthday_embedding(jax.random.fold_in(key, r), x.dim, 2).buckets(x.indices)[1]

    sign = jnp.moveaxis(jax.vmap(signs)(jnp.arange(emb.repetitions)), 0, 1)  # [n, T, s]
    values = sign.astype(x.values.dtype) * x.values[:, None, :]
    return SparseVectors(*merge_slots(bucket, values), emb.m)


def max_map_sweep(key: jax.Array, x: SparseVectors, sizes, eps: float, s: int):
    """The smallest repetitions giving `1 - eps` for the nested data sets `x[:n]`, `n in sizes`.

    One max map with `m = ceil(4 s / eps)` buckets and the stated repetitions of the largest set,
    `T = max_embedding_dimension(s, max(sizes), eps)[1]`; the set of size `n` is scanned on its
    own stated repetitions. Returns one dict per size: `n`, `m`, `stated` (its `T`), `needed`
    (per `p` in `PS`, `scan_repetitions`), `max_ratio`.
    """
    stated = [max_embedding_dimension(s, n, eps)[1] for n in sizes]
    m = max_embedding_dimension(s, max(sizes), eps)[0]
    emb = max_embedding(key, x.dim, m, max(stated))
    images = compact_max_image(emb, head(x, max(sizes)))
    true = true_distances(head(x, max(sizes)))
    needed, top = scan_repetitions(images, true, sizes, stated, eps)
    return [
        dict(n=n, m=m, stated=t, needed=[int(v) for v in need], max_ratio=float(r))
        for n, t, need, r in zip(sizes, stated, needed, top, strict=True)
    ]


def linf_sweep(key: jax.Array, x: SparseVectors, sizes, s: int) -> list[int]:
    """The smallest repetitions making every pairwise `l_inf` distance of `x[:n]` exact, for each
    `n` in `sizes` (nested), with `m = 4 s` buckets (`linf_dimension`); scanned up to the stated
    repetitions of the largest set (`T + 1` when not reached). Exact: estimate / true within
    `EXPAND_RTOL` of 1 (the max map copies values, so an exact estimate is the same float)."""
    m, reps = linf_dimension(s, max(sizes))
    emb = max_embedding(key, x.dim, m, reps)
    images = compact_max_image(emb, head(x, max(sizes)))
    true = true_distances(head(x, max(sizes)), ps=(math.inf,))
    needed, _ = scan_repetitions(
        images, true, sizes, [reps] * len(sizes), EXPAND_RTOL, ps=(math.inf,)
    )
    return [int(v) for v in needed[:, 0]]


def l2_exact_fractions(make_map, x: SparseVectors, ms) -> list[float]:
    """For each `m` in `ms`: the fraction of `x` whose `l_2` norm the map `make_map(i, m)` keeps
    exactly, `make_map` returning the map's slot function `x -> (indices, values)` (the `i`-th
    map of the grid, drawn independently of the others)."""
    return [
        float(np.mean(exact_norms(*make_map(i, m)(x), x, ps=(2.0,))[0])) for i, m in enumerate(ms)
    ]


def compressed_sensing_fraction(key: jax.Array, x: SparseVectors, m: int) -> dict:
    """Gaussian measurements `A: [m, d]` of `x` decoded by `omp`: the fraction of vectors with
    every norm in `PS` exact, and the largest relative `l_2` error of the decoded vectors."""
    a = gaussian_measurements(key, m, x.dim, x.values.dtype)
    z = omp(a, measure(a, x), x.slots)
    idx = jnp.concatenate([z.indices, x.indices], axis=-1)  # z - x
    err = slot_norms(idx, jnp.concatenate([z.values, -x.values], axis=-1), (2.0,))[0]
    err = err / slot_norms(x.indices, x.values, (2.0,))[0]
    return dict(
        fraction=all_p_exact_fraction(z.indices, z.values, x), max_rel_error=float(err.max())
    )


def birthday_fraction(key: jax.Array, x: SparseVectors, m: int) -> float:
    """The fraction of `x` whose every norm the birthday map into `m` buckets keeps exactly."""
    return all_p_exact_fraction(*birthday_slots(birthday_embedding(key, x.dim, m), x), x)


def linear_maps(key: jax.Array, d: int):
    """The oblivious linear maps of `lower_bound_s2`: `(name, k, make)` with `k` the non-zeros per
    column and `make(i, m)` the image-slot function `x -> (indices, values)` of the `i`-th
    independent draw into `m` buckets (`m` a multiple of `k`)."""

    def birthday(i, m):
        emb = birthday_embedding(jax.random.fold_in(key, i), d, m)
        return lambda x: birthday_slots(emb, x)

    def jl(k):
        def make(i, m):
            return sparse_jl(jax.random.fold_in(key, 1000 * k + i), d, m, k).slots

        return make

    return [
        ("birthday (CountSketch)", 1, birthday),
        ("sparse JL, k=2", 2, jl(2)),
        ("sparse JL, k=4", 4, jl(4)),
    ]


def m99_curve(make, k: int, data: dict, steps) -> list[float]:
    """`needed_dimension` (99% with exact `l_2`) of the map family `make` (`linear_maps`) for each
    `s` of `data` (`{s: SparseVectors}`), on the grid `k round(50 k s(s-1) 2^c / k)`, `c` in
    `steps`, centred on the union bound's 99% point."""
    out = []
    for s, x in data.items():
        guess = 50 * k * k * s * (s - 1)
        dims = sorted({k * max(1, round(guess * 2**c / k)) for c in steps})
        out.append(needed_dimension(dims, l2_exact_fractions(make, x, dims)))
    return out
