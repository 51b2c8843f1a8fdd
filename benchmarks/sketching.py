"""Throughput of seqlab.sketching (rows per second) against plain numpy implementations of the same
algorithms, measured in the same run: sketch construction of one table (priority, threshold, JL,
CountSketch) and estimation of A^T B from two sketches, on sparse rows (`s` non-zeros of `d`,
float32); and the birthday map on dense float64 rows against a scipy.sparse product, with the peak
memory of the 5000 x 1e5 -> 1e4 case (issue 16) measured in a child process. CPU.

    python benchmarks/sketching.py                   # n = 100000 rows, d = 10000, s = 8
    python benchmarks/sketching.py --quick           # n = 10000, a smoke run
    python benchmarks/sketching.py --write-results   # also replace its section of RESULTS.md

The numpy versions use a splitmix64 integer hash of (seed, key) instead of seqlab's hashes (the
same statistics, not the same numbers). Each phase times seqlab and numpy alternately, call by
call, after one warm-up (compilation excluded), and reports both medians: on a shared machine the
two see the same load, so their ratio is what to compare. Ratios above 1 mean seqlab (jax.jit) is
faster. The estimate returns a dense `[d, d']` product: allocating and zeroing it dominates its
time at these sizes (numpy's `np.zeros` is lazily mapped memory that the kernel zeroes on first
touch; XLA writes the zeros itself).
"""

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse
from _common import cpu_model, replace_section

from seqlab.sketching import (
    SparseVectors,
    birthday_embedding,
    countsketch,
    estimate_product,
    jl_sketch,
    priority_sketch,
    threshold_sketch,
)

SECTION = "## sketching (CPU)"
# The dense case: 5000 float64 rows of dimension 1e5 mapped to 1e4.
PEAK_CASE = (5000, 100_000, 10_000)


def paired_seconds(fa, fb, repeats: int) -> tuple[float, float, float]:
    """Medians of `fa()` and `fb()` timed alternately (each blocks until its result is ready),
    and the ratio of their minima `min(fb) / min(fa)` (the least disturbed calls: on a loaded
    machine the medians include time spent waiting for a core)."""
    fa(), fb()  # warm-up: compilation
    ta, tb = [], []
    for _ in range(repeats):
        for f, ts in ((fa, ta), (fb, tb)):
            start = time.perf_counter()
            f()
            ts.append(time.perf_counter() - start)
    return statistics.median(ta), statistics.median(tb), min(tb) / min(ta)


def jax_call(fn, *args):
    return lambda: jax.block_until_ready(fn(*args))


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

    def add(name, times, count):
        jax_s, np_s, best = times
        rows.append((name, count / jax_s, count / np_s, np_s / jax_s, best))
        print(f"{name:34s} {count / jax_s:>14,.0f} {count / np_s:>14,.0f} {np_s / jax_s:>8.2f} "
              f"{best:>8.2f}")  # fmt: skip

    print(f"{'phase':34s} {'seqlab rows/s':>14} {'numpy rows/s':>14} {'ratio':>8} {'min':>8}")
    # Threshold sketches get 2k slots (default n): at most k rows are expected to qualify, and
    # `truncated` is checked below.
    sampling = (
        ("priority", lambda a, kk: priority_sketch(a, k, 0, kk)),
        ("threshold", lambda a, kk: threshold_sketch(a, k, 0, kk, capacity=2 * k)),
    )
    for method, fn in sampling:
        build = jax.jit(fn)
        times = paired_seconds(
            jax_call(build, A, jkeys), lambda m=method: np_sample(ia, va, keys, k, 0, m), repeats
        )
        add(f"{method} sketch", times, n)
        SA, SB = build(A, jkeys), build(B, jkeys)
        assert not (bool(SA.truncated) or bool(SB.truncated)), "threshold sketch overflowed"
        sa, sb = np_sample(ia, va, keys, k, 0, method), np_sample(ib, vb, keys, k, 0, method)
        times = paired_seconds(
            jax_call(jax.jit(estimate_product), SA, SB),
            lambda sa=sa, sb=sb: np_estimate(sa, sb, d, db),
            repeats,
        )
        add(f"{method} estimate (rows kept)", times, int(SA.kept.sum()))
    for name, fn, npfn in (("jl", jl_sketch, np_jl), ("countsketch", countsketch, np_countsketch)):
        build = jax.jit(lambda a, kk, fn=fn: fn(a, k_lin, 0, kk))
        times = paired_seconds(
            jax_call(build, A, jkeys), lambda npfn=npfn: npfn(ia, va, keys, k_lin, 0, d), repeats
        )
        add(f"{name} sketch", times, n)
    return rows


def np_birthday_dense(x, seed, m):
    """`x: [N, d]` through the birthday map as a scipy.sparse `[d, m]` product (splitmix64 hash)."""
    d = x.shape[1]
    h = splitmix64(np.uint64(seed) << np.uint64(32) | np.arange(d, dtype=np.uint64))
    sign = np.where((h >> np.uint64(63)) == 1, -1.0, 1.0)
    M = scipy.sparse.csr_matrix((sign, (np.arange(d), (h % np.uint64(m)).astype(np.int64))),
                                shape=(d, m))  # fmt: skip
    return np.asarray(x @ M)


def birthday_child(n, d, m, repeats):
    """Child process (float64): seconds per call of the birthday map on `[n, d]` dense rows,
    seqlab and scipy.sparse, as JSON."""
    x = np.random.default_rng(0).standard_normal((n, d))
    jx = jnp.asarray(x)
    emb = birthday_embedding(jax.random.key(0), d, m)
    j, nps, best = paired_seconds(jax_call(jax.jit(emb.apply), jx),
                                  lambda: np_birthday_dense(x, 0, m), repeats)  # fmt: skip
    print(json.dumps({"seqlab_s": j, "numpy_s": nps, "best": best}))


def peak_child(n, d, m):
    """Child process (float64): the dense birthday map of `[n, d]` rows, its peak RSS as JSON."""
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    # The input is drawn row by row on the device (its own peak stays ~ the input).
    keys = jax.random.split(jax.random.key(1), n)
    draw = jax.jit(lambda ks: jax.lax.map(lambda kk: jax.random.normal(kk, (d,), jnp.float64), ks))
    x = jax.block_until_ready(draw(keys))
    before = rss()
    emb = birthday_embedding(jax.random.key(0), d, m)
    apply = jax.jit(emb.apply)
    memory = apply.lower(x).compile().memory_analysis()
    start, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(apply(x))
    first_wall, first_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(apply(x))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(json.dumps({
        "input_bytes": x.nbytes, "rss_before_apply": before, "peak_rss": rss(),
        "temp_bytes": memory.temp_size_in_bytes, "output_bytes": memory.output_size_in_bytes,
        "first_call_wall_s": first_wall, "first_call_cpu_s": first_cpu,
        "wall_s": wall, "cpu_s": cpu,
    }))  # fmt: skip


def child(*spec) -> dict:
    """Run `birthday_child` or `peak_child` in a fresh process with float64 enabled (the sparse
    phases run in float32 without it; a child's peak RSS is its own)."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", ",".join(map(str, spec))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def birthday_dense(n, d, m, repeats):
    """The birthday map's row in the table (`birthday_child`)."""
    t = child("birthday", n, d, m, repeats)
    name = f"birthday map, dense {n} x {d:.0e} -> {m:.0e} (float64, numpy: scipy.sparse)"
    j, nps, best = t["seqlab_s"], t["numpy_s"], t["best"]
    print(f"{name:34s} {n / j:>14,.0f} {n / nps:>14,.0f} {nps / j:>8.2f} {best:>8.2f}")
    return name, n / j, n / nps, nps / j, best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 10000 rows, 3 repeats, no peak")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per measurement")
    parser.add_argument("--write-results", action="store_true", help="replace RESULTS.md section")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        jax.config.update("jax_enable_x64", True)
        kind, *sizes = args.child.split(",")
        (birthday_child if kind == "birthday" else peak_child)(*(int(v) for v in sizes))
        return
    n = 10_000 if args.quick else 100_000
    repeats = 3 if args.quick else args.repeats
    d, db, s, k, k_lin = 10_000, 1_000, 8, 1_000, 64
    dense_n = 100 if args.quick else 1000
    command = shlex.join(["python", "benchmarks/sketching.py", *(argv or sys.argv[1:])])
    load = os.getloadavg()[0]
    head = [
        f"{datetime.date.today()}; {cpu_model()}, {platform.system()}; jax {jax.__version__}; "
        f"`{command}`.",
        f"n={n} rows, d={d}, d'={db}, s={s} non-zeros per row, sampling k={k} (threshold: 2k "
        f"slots), linear k={k_lin}, float32; birthday map on {dense_n} dense float64 rows. "
        f"Medians of {repeats} calls after a warm-up, seqlab and numpy timed alternately.",
    ]
    print("\n".join(head))
    rows = run(n, d, db, s, k, k_lin, repeats)
    rows.append(birthday_dense(dense_n, 100_000, 10_000, repeats))
    load = max(load, os.getloadavg()[0])
    peak = None if args.quick else child("peak", *PEAK_CASE)
    text = [SECTION, "", *head]
    text.append(
        f"Measured while other jobs shared the 2 cores (1-minute load average up to {load:.1f}): "
        "absolute rates are inflated by the load, the ratios (same run, alternate calls) are "
        "what to compare; `ratio` is of the medians, `min ratio` of the fastest calls (the "
        "least disturbed by the load). Numpy references use a splitmix64 hash; the estimate's "
        "time is mostly allocating and zeroing the dense [d, d'] output (numpy's zeros is "
        "lazily mapped)."
    )
    text += [
        "",
        "| phase | seqlab rows/s | numpy rows/s | ratio | min ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    text += [f"| {nm} | {a:,.0f} | {b:,.0f} | {r:.2f} | {mr:.2f} |" for nm, a, b, r, mr in rows]
    if peak is not None:
        gib = 2**30
        n_, d_, m_ = PEAK_CASE
        text += [
            "",
            f"Dense birthday map, {n_} x {d_:.0e} float64 rows -> m = {m_:.0e} (issue 16: it asked "
            f"for 28 GB before): peak RSS {peak['peak_rss'] / gib:.2f} GiB of which the input "
            f"{peak['input_bytes'] / gib:.2f} GiB (RSS {peak['rss_before_apply'] / gib:.2f} GiB "
            f"before the call); compiled temporaries {peak['temp_bytes'] / 2**20:.1f} MiB, output "
            f"{peak['output_bytes'] / 2**20:.0f} MiB; {peak['wall_s']:.2f} s wall, "
            f"{peak['cpu_s']:.2f} s CPU per call ({peak['first_call_wall_s']:.2f} s wall with "
            "compilation).",
        ]
    text = "\n".join(text) + "\n"
    print(text)
    if args.write_results:
        replace_section(SECTION, text)


if __name__ == "__main__":
    main()
