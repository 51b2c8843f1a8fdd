"""Throughput of seqlab.sketching (rows per second) against plain numpy implementations of the same
algorithms, measured in the same run: sketch construction of one table (priority, threshold, JL,
CountSketch) and estimation of A^T B from two sketches. Sparse rows (`s` non-zeros of `d`),
float32, CPU.

    python benchmarks/sketching.py            # n = 100000 rows, d = 10000, s = 8
    python benchmarks/sketching.py --quick    # n = 10000, a smoke run
    python benchmarks/sketching.py --help

The numpy versions use a splitmix64 integer hash of (seed, key) instead of threefry (the same
statistics, not the same numbers). Times are medians over `--repeats` calls after one warm-up
(compilation excluded). Ratios above 1 mean seqlab (jax.jit) is faster. The estimate returns
a dense `[d, d']` product; zeroing it dominates its time at these sizes (numpy's `np.zeros` is
lazily mapped memory).
"""

import argparse
import datetime
import platform
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import cpu_model, median_seconds

from seqlab.sketching import (
    SparseVectors,
    countsketch,
    estimate_product,
    jl_sketch,
    priority_sketch,
    threshold_sketch,
)

MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer on uint64 (wrapping arithmetic)."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def np_uniforms(seed: int, keys: np.ndarray) -> np.ndarray:
    """`u in (0, 1]` per key from `splitmix64(seed * 2^32 + key)`."""
    bits = splitmix64(np.uint64(seed) << np.uint64(32) | keys.astype(np.uint64))
    return ((bits >> np.uint64(11)).astype(np.float64) + 1) / 2.0**53


def np_sample(idx, vals, keys, k, seed, method):
    """Numpy priority/threshold sample: `(keys, idx, vals, w, tau)` of the kept rows."""
    w = np.einsum("ij,ij->i", vals, vals)
    rank = np_uniforms(seed, keys) / w
    if method == "priority":
        part = np.argpartition(rank, k)[: k + 1]
        order = part[np.argsort(rank[part])]
        tau, keep = rank[order[k]], order[:k]
    else:
        tau = k / w.sum()
        keep = np.flatnonzero(rank < tau)
    return keys[keep], idx[keep], vals[keep], w[keep], tau


def np_estimate(sa, sb, d, db):
    """Numpy coordinated estimate from two `np_sample` results."""
    (ka, ia, va, wa, ta), (kb, ib, vb, wb, tb) = sa, sb
    _, pa, pb = np.intersect1d(ka, kb, return_indices=True)
    p = np.minimum(1, np.minimum(wa[pa] * ta, wb[pb] * tb))
    out = np.zeros((d, db), np.float32)
    contrib = (va[pa] / p[:, None])[:, :, None] * vb[pb][:, None, :]
    np.add.at(out, (ia[pa][:, :, None], ib[pb][:, None, :]), contrib)
    return out


def np_countsketch(idx, vals, keys, k, seed, d):
    h = splitmix64(np.uint64(seed) << np.uint64(32) | keys.astype(np.uint64))
    bucket = (h % np.uint64(k)).astype(np.int64)
    sign = np.where((h >> np.uint64(63)) == 1, -1.0, 1.0).astype(np.float32)
    out = np.zeros((k, d), np.float32)
    np.add.at(out, (bucket[:, None], idx), sign[:, None] * vals)
    return out


def np_jl(idx, vals, keys, k, seed, d):
    g = np.random.default_rng(seed).standard_normal((len(keys), k), np.float32) / np.sqrt(k)
    out = np.zeros((k, d), np.float32)
    np.add.at(out, (np.arange(k)[None, :, None], idx[:, None, :]), g[:, :, None] * vals[:, None, :])
    return out


def tables(n, d, db, s, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**31 - 1, n, replace=False).astype(np.int32)
    ia = np.sort(rng.integers(0, d, (n, s)), axis=1).astype(np.int32)
    ib = rng.integers(0, db, (n, s)).astype(np.int32)
    va, vb = rng.standard_normal((2, n, s)).astype(np.float32)
    return keys, ia, va, ib, vb


def run(n, d, db, s, k, k_lin, repeats):
    keys, ia, va, ib, vb = tables(n, d, db, s)
    A, B = (
        SparseVectors(jnp.asarray(ia), jnp.asarray(va), d),
        SparseVectors(jnp.asarray(ib), jnp.asarray(vb), db),
    )
    jkeys = jnp.asarray(keys)
    rows = []

    def add(name, jax_s, np_s, count):
        rows.append((name, count / jax_s, count / np_s, np_s / jax_s))
        print(f"{name:28s} {count / jax_s:>14,.0f} {count / np_s:>14,.0f} {np_s / jax_s:>8.2f}")

    print(f"{'phase':28s} {'seqlab rows/s':>14} {'numpy rows/s':>14} {'ratio':>8}")
    # Threshold sketches get 2k slots (default n): at most k rows are expected to qualify, and
    # `truncated` is checked below; n slots would sort the whole table.
    sampling = (
        ("priority", lambda a, kk: priority_sketch(a, k, 0, kk)),
        ("threshold", lambda a, kk: threshold_sketch(a, k, 0, kk, capacity=2 * k)),
    )
    for method, fn in sampling:
        build = jax.jit(fn)
        j = median_seconds(build, A, jkeys, repeats=repeats)
        nps = median_seconds(
            lambda m=method: np_sample(ia, va, keys, k, 0, m), repeats=repeats, sync=lambda r: r
        )
        add(f"{method} sketch", j, nps, n)
        SA, SB = build(A, jkeys), build(B, jkeys)
        assert not (bool(SA.truncated) or bool(SB.truncated)), "threshold sketch overflowed"
        est = jax.jit(estimate_product)
        j = median_seconds(est, SA, SB, repeats=repeats)
        sa, sb = np_sample(ia, va, keys, k, 0, method), np_sample(ib, vb, keys, k, 0, method)
        nps = median_seconds(lambda sa=sa, sb=sb: np_estimate(sa, sb, d, db), repeats=repeats,
                             sync=lambda r: r)  # fmt: skip
        add(f"{method} estimate (rows kept)", j, nps, int(SA.kept.sum()))
    for name, fn, npfn in (("jl", jl_sketch, np_jl), ("countsketch", countsketch, np_countsketch)):
        build = jax.jit(lambda a, kk, fn=fn: fn(a, k_lin, 0, kk))
        j = median_seconds(build, A, jkeys, repeats=repeats)
        nps = median_seconds(lambda npfn=npfn: npfn(ia, va, keys, k_lin, 0, d), repeats=repeats,
                             sync=lambda r: r)  # fmt: skip
        add(f"{name} sketch", j, nps, n)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 10000 rows, 2 repeats")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement")
    args = parser.parse_args(argv)
    n = 10_000 if args.quick else 100_000
    repeats = 2 if args.quick else args.repeats
    d, db, s, k, k_lin = 10_000, 1_000, 8, 1_000, 64
    print(f"{datetime.date.today()}; {cpu_model()}, {platform.system()}; jax {jax.__version__}; "
          f"`python {shlex.join(['benchmarks/sketching.py', *sys.argv[1:]])}`")  # fmt: skip
    print(f"n={n} rows, d={d}, d'={db}, s={s} non-zeros per row, sampling k={k}, "
          f"linear k={k_lin}, float32, medians of {repeats}")  # fmt: skip
    run(n, d, db, s, k, k_lin, repeats)


if __name__ == "__main__":
    main()
