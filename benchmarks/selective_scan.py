"""Wall time of seqlab.ops.selective_scan: "parallel" against "sequential", forward and
forward+backward, float32, batch 2, D=256, N=16, L in {1024, 4096, 16384}.

    python benchmarks/selective_scan.py              # full table
    python benchmarks/selective_scan.py --quick      # tiny smoke run
    python benchmarks/selective_scan.py --write-results   # also replace the section in RESULTS.md

Times are medians over `--repeats` calls after one warm-up call (compilation excluded), each
ended with `block_until_ready`.
"""

import argparse
import datetime
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _common import RESULTS, cpu_model, median_seconds, replace_section

from seqlab.ops.selective_scan import selective_scan

SECTION = "## selective_scan (CPU)"


def make_inputs(batch, length, dim, state, dtype=jnp.float32):
    """Mamba-like arguments: softplus step sizes around 0.1-1, negative A, a gate and a skip."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return dict(
        u=normal(batch, length, dim),
        delta=normal(batch, length, dim),
        A=-jnp.asarray(np.tile(np.arange(1, state + 1), (dim, 1)), dtype),  # S4D-real init
        B=normal(batch, length, state),
        C=normal(batch, length, state),
        D=normal(dim),
        z=normal(batch, length, dim),
        delta_bias=normal(dim),
    )


def build(impl, backward):
    """A jitted forward, or forward+backward in every input, of the op with `impl`."""

    def forward(args):
        return selective_scan(**args, delta_softplus=True, impl=impl)

    if not backward:
        return jax.jit(forward)
    return jax.jit(jax.grad(lambda args: jnp.sum(forward(args) ** 2)))


def run(lengths, batch, dim, state, repeats):
    """Rows `(L, pass, sequential_s, parallel_s)`, printed as they come."""
    rows = []
    print(f"{'L':>6} {'pass':>8} {'sequential ms':>14} {'parallel ms':>12} {'par/seq':>8}")
    for length in lengths:
        args = make_inputs(batch, length, dim, state)
        for backward in (False, True):
            seq, par = (
                median_seconds(build(impl, backward), args, repeats=repeats)
                for impl in ("sequential", "parallel")
            )
            name = "fwd+bwd" if backward else "fwd"
            rows.append((length, name, seq, par))
            print(f"{length:>6} {name:>8} {seq * 1e3:>14.1f} {par * 1e3:>12.1f} {par / seq:>8.2f}")
    return rows


def verdict(rows) -> str:
    """Which implementation was faster, for the choice of `impl=None`."""
    wins = {
        name: sum(par < seq if name == "parallel" else seq <= par for *_, seq, par in rows)
        for name in ("sequential", "parallel")
    }
    return ", ".join(f"{name} faster in {n} of {len(rows)} rows" for name, n in wins.items())


def write_results(rows, command, batch, dim, state, repeats, note):
    """Replace (or append) this benchmark's section of RESULTS.md."""
    table = [
        "| L | pass | sequential ms | parallel ms | parallel/sequential |",
        "|---:|---|---:|---:|---:|",
        *(
            f"| {length} | {name} | {seq * 1e3:.1f} | {par * 1e3:.1f} | {par / seq:.2f} |"
            for length, name, seq, par in rows
        ),
    ]
    section = "\n".join(
        [
            SECTION,
            "",
            f"- date: {datetime.date.today().isoformat()}",
            f"- machine: {cpu_model()}",
            f"- jax {jax.__version__}, backend {jax.default_backend()}",
            f"- command: `{command}`",
            f"- float32, batch {batch}, D={dim}, N={state}, delta_softplus with delta_bias, D and"
            f" z; median of {repeats} calls after a warm-up call",
            *([f"- note: {note}"] if note else []),
            "",
            *table,
            "",
            f"{verdict(rows)}; `impl=None` uses the faster on this platform.",
            "",
        ]
    )
    replace_section(SECTION, section)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-results", action="store_true", help="update RESULTS.md")
    parser.add_argument("--note", default="", help="a line for RESULTS.md, e.g. the machine's load")
    flags = parser.parse_args()
    if flags.quick:
        lengths, batch, dim, state, repeats = (64, 200), 1, 8, 4, 2
    else:
        lengths, batch, dim, state, repeats = (1024, 4096, 16384), 2, 256, 16, flags.repeats
    print(f"jax {jax.__version__} on {jax.default_backend()}: {cpu_model()}")
    rows = run(lengths, batch, dim, state, repeats)
    print(verdict(rows))
    if flags.write_results:
        command = shlex.join(["python", "benchmarks/selective_scan.py", *sys.argv[1:]])
        write_results(rows, command, batch, dim, state, repeats, flags.note)
        print(f"wrote section {SECTION!r} of {RESULTS}")


if __name__ == "__main__":
    main()
