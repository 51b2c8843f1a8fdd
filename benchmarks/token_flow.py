"""Speed of seqlab.dynamics.token_flow (jax.jit, CPU) against plain numpy implementations of the
same equations, measured in the same run, float32, d = 3, beta = 4, SA (softmax-normalized):

- one evaluation of the vector field, dense (`[n, n]` logits) for moderate `n`, and blocked over
  keys (`block_size` keys at a time; seqlab also tiles the queries so that a tile of logits stays
  in cache, and with `Q = K = I` shifts every row by its known largest logit `beta`, one pass with
  no running max; numpy runs the online softmax) up to n = 100000 particles, where a dense
  `[n, n]` float32 matrix would take 40 GB;
- a batch of flows: `runs` independent systems of `n` particles on the circle integrated by
  projected RK4 (vmapped in seqlab, a Python loop over runs and steps in numpy).

    python benchmarks/token_flow.py                  # field up to n = 100000, 64 flows
    python benchmarks/token_flow.py --quick          # field up to n = 16384, a smoke run
    python benchmarks/token_flow.py --write-results  # also replace the section in RESULTS.md
    python benchmarks/token_flow.py --write-results --note "..."  # with a sentence (the load)

Times are medians over `--repeats` calls after one warm-up (compilation excluded); the numpy
blocked field at n = 100000 is timed once. Ratios above 1 mean seqlab is faster.
"""

import argparse
import datetime
import os
import platform
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import cpu_model, median_seconds, replace_section

from seqlab.dynamics import token_flow

SECTION = "## token_flow (CPU)"
BETA = 4.0


def np_field(x, beta, block_size=None):
    """SA `dx/dt` in numpy: dense softmax, or an online softmax over blocks of keys."""
    if block_size is None:
        logits = beta * (x @ x.T)
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        y = (w @ x) / w.sum(axis=1, keepdims=True)
    else:
        m = np.full(len(x), -np.inf, x.dtype)
        s = np.zeros(len(x), x.dtype)
        acc = np.zeros_like(x)
        for start in range(0, len(x), block_size):
            keys = x[start : start + block_size]
            logits = beta * (x @ keys.T)
            m_new = np.maximum(m, logits.max(axis=1))
            scale = np.exp(m - m_new)
            p = np.exp(logits - m_new[:, None])
            s = s * scale + p.sum(axis=1)
            acc = acc * scale[:, None] + p @ keys
            m = m_new
        y = acc / s[:, None]
    return y - np.sum(x * y, axis=1, keepdims=True) * x


def np_rk4(x, beta, h, steps):
    """Projected RK4 in numpy, as `token_flow.integrate(method="rk4")`."""

    def retract(y):
        return y / np.linalg.norm(y, axis=1, keepdims=True)

    for _ in range(steps):
        k1 = np_field(x, beta)
        k2 = np_field(retract(x + h / 2 * k1), beta)
        k3 = np_field(retract(x + h / 2 * k2), beta)
        k4 = np_field(retract(x + h * k3), beta)
        x = retract(x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4))
    return x


def sphere(n, d=3, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def field_rows(sizes, block_size, repeats):
    rows = []
    for n, blocked in sizes:
        x = sphere(n)
        block = block_size if blocked else None
        fn = jax.jit(lambda x, b=block: token_flow.vector_field(x, beta=BETA, block_size=b))
        ours = median_seconds(fn, jnp.asarray(x), repeats=repeats)
        reps = 1 if n >= 50_000 else repeats
        theirs = median_seconds(
            lambda x=x, b=block: np_field(x, BETA, b), repeats=reps, warmup=0, sync=lambda r: r
        )
        if reps > 1:  # the two agree (checked where numpy is cheap)
            got = np.asarray(fn(jnp.asarray(x)))
            np.testing.assert_allclose(got, np_field(x, BETA, block), rtol=1e-3, atol=1e-5)
        rows.append(("blocked" if blocked else "dense", n, ours * 1e3, theirs * 1e3, theirs / ours))
        print(
            f"field {rows[-1][0]:8s} n={n:>7}  seqlab {ours * 1e3:10.1f} ms  "
            f"numpy {theirs * 1e3:10.1f} ms  ratio {theirs / ours:6.2f}"
        )
    return rows


def flow_row(runs, n, steps, repeats):
    theta = np.random.default_rng(1).uniform(0, 2 * np.pi, (runs, n))
    x0 = np.stack([np.cos(theta), np.sin(theta)], axis=-1).astype(np.float32)
    t1 = np.float32(0.05 * steps)

    @jax.jit
    def ours_fn(x0):
        def one(x):
            return token_flow.integrate(x, beta=BETA, t1=t1, n_steps=steps, n_saves=1).xs[-1]

        return jax.vmap(one)(x0)

    ours = median_seconds(ours_fn, jnp.asarray(x0), repeats=repeats)
    theirs = median_seconds(
        lambda: [np_rk4(x, BETA, t1 / steps, steps) for x in x0],
        repeats=repeats,
        warmup=0,
        sync=lambda r: r,
    )
    np.testing.assert_allclose(
        np.asarray(ours_fn(jnp.asarray(x0[:1])))[0],
        np_rk4(x0[0], BETA, t1 / steps, steps),
        atol=1e-4,
    )
    print(
        f"flows {runs} x n={n} x {steps} RK4 steps  seqlab {ours * 1e3:.1f} ms  "
        f"numpy {theirs * 1e3:.1f} ms  ratio {theirs / ours:.2f}"
    )
    return runs, n, steps, ours * 1e3, theirs * 1e3, theirs / ours


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="field up to n = 16384, 2 repeats")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement")
    parser.add_argument("--block-size", type=int, default=2048, help="keys per block")
    parser.add_argument("--write-results", action="store_true", help="update RESULTS.md")
    parser.add_argument("--note", default="", help="a sentence for RESULTS.md (e.g. the load)")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()[0]
    repeats = 2 if args.quick else args.repeats
    sizes = [(1024, False), (4096, False), (4096, True), (16384, True)]
    if not args.quick:
        sizes.append((100_000, True))
    header = (
        f"{datetime.date.today()}; {cpu_model()}, {platform.system()}; jax {jax.__version__}; "
        f"`python {shlex.join(['benchmarks/token_flow.py', *sys.argv[1:]])}`"
    )
    print(header)
    fields = field_rows(sizes, args.block_size, repeats)
    flows = flow_row(64, 128, 100, repeats)
    load = (
        f"1-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    )
    print(load)
    if args.write_results:
        lines = [
            SECTION,
            "",
            header,
            f"float32, d = 3, beta = {BETA}, SA; blocked = {args.block_size} keys per block; "
            f"medians of {repeats} after a warm-up (numpy at n = 100000: one call); {load}."
            + (f" {args.note}" if args.note else ""),
            "",
            "| field | n | seqlab ms | numpy ms | ratio |",
            "|---|---:|---:|---:|---:|",
            *[f"| {k} | {n} | {a:.1f} | {b:.1f} | {r:.2f} |" for k, n, a, b, r in fields],
            "",
            "| flows | n | RK4 steps | seqlab ms | numpy ms | ratio |",
            "|---:|---:|---:|---:|---:|---:|",
            "| {} | {} | {} | {:.1f} | {:.1f} | {:.2f} |".format(*flows),
        ]
        replace_section(SECTION, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
