"""Overhead and communication volume of sequence parallelism (`seqlab.ops.sequence_parallel`) on
4 fake CPU devices: `gated_delta_rule`, `ssd` and `selective_scan` with their time axis split over
a mesh axis of 4 (`shard_time`), against the single-device op in the same run.

    python benchmarks/sequence_parallel.py                  # B=1, T=4096, H=4, K=V=64; D=256, N=16
    python benchmarks/sequence_parallel.py --quick          # tiny smoke run
    python benchmarks/sequence_parallel.py --write-results  # also replace the section in RESULTS.md

The 4 devices are one CPU process's fake devices sharing the same cores, so the ratio measures the
overhead of the decomposition (the wider local run, the collectives, the combine), not a speed-up.
Times are medians over `--repeats` calls after one warm-up (compilation excluded), each ended with
`block_until_ready`; forward+backward is `jit(grad(sum(o)))` with respect to every input.
Communication: the bytes each shard receives in the forward pass, from the shapes the collectives
move (the formulas of the `seqlab.ops.sequence_parallel` docstring), beside the same count read
from the collectives of the compiled forward's HLO (all-gather: the `(P - 1) / P` of its result
that comes from other shards; collective-permute and all-reduce: their result).
"""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import datetime
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
from _common import cpu_model, median_seconds, replace_section

from seqlab import ops
from seqlab.ops import sequence_parallel as sp

SECTION = "## sequence parallelism: 4 fake CPU devices"
SHARDS = 4
ITEMSIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "pred": 1}


def make_inputs(op, batch, length, heads, dim, width, states):
    """float32 inputs: unit keys, gates in log(0.9..1), beta in (0, 1); selective scan with
    `D = width` channels and `N = states`."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    if op == "selective_scan":
        return (
            normal(batch, length, width), normal(batch, length, width),
            -jnp.exp(normal(width, states)), normal(batch, length, states),
            normal(batch, length, states),
        )  # fmt: skip
    k = normal(batch, length, heads, dim)
    gates = jnp.asarray(np.log(rng.uniform(0.9, 1.0, (batch, length, heads))), jnp.float32)
    x = (normal(batch, length, heads, dim), k / jnp.linalg.norm(k, axis=-1, keepdims=True))
    x += (normal(batch, length, heads, dim), gates)
    if op == "gated_delta_rule":
        x += (jnp.asarray(rng.uniform(0.0, 1.0, (batch, length, heads)), jnp.float32),)
    return x


def single_device(op):
    """The op of `seqlab.ops` returning its per-token output."""
    fn = {"gated_delta_rule": ops.gated_delta_rule, "ssd": ops.ssd}.get(op)
    if fn is None:
        return ops.selective_scan
    return lambda *x: fn(*x)[0]


def sharded(op, mesh):
    """`shard_time(op)` returning its per-token output."""
    fn = sp.shard_time(op, mesh)
    return fn if op == "selective_scan" else (lambda *x: fn(*x)[0])


def formula_bytes(op, x):
    """Bytes one shard receives in the forward pass (module docstring of sequence_parallel):
    the all-gather of every other shard's transition and offset."""
    s = 4  # float32
    if op == "selective_scan":
        batch, _, width = x[0].shape
        return (SHARDS - 1) * 2 * batch * width * x[2].shape[1] * s
    batch, _, heads, dk = x[0].shape
    dv = x[2].shape[-1]
    per_head = dk * (dk + dv) if op == "gated_delta_rule" else 1 + dk * dv
    return (SHARDS - 1) * batch * heads * per_head * s


def hlo_collectives(compiled_text):
    """`{kind: bytes received per shard}` of the collectives in a compiled module's HLO."""
    found = {}
    pattern = re.compile(
        r"= (.*?) (all-gather|collective-permute|all-reduce|reduce-scatter|all-to-all)(?:-start)?\("
    )
    for result, kind in pattern.findall(compiled_text):
        size = sum(
            ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result)
        )
        if kind == "all-gather":
            size = size * (SHARDS - 1) // SHARDS
        found[kind] = found.get(kind, 0) + size
    return found


def grad_of(fn):
    """`jit(grad(sum(fn)))` with respect to every argument."""

    def loss(x):
        return jnp.sum(fn(*x))

    return jax.jit(lambda *x: jax.grad(loss)(x))


def measure(op, x, mesh, repeats):
    """Row of the table: times single/sharded forward and forward+backward, bytes."""
    one, many = single_device(op), sharded(op, mesh)
    times = [median_seconds(jax.jit(f), *x, repeats=repeats) for f in (one, many)] + [
        median_seconds(grad_of(f), *x, repeats=repeats) for f in (one, many)
    ]
    hlo = hlo_collectives(jax.jit(many).lower(*x).compile().as_text())
    return times, formula_bytes(op, x), hlo


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    length, heads, dim, width, states = (4096, 4, 64, 256, 16)
    repeats = args.repeats
    if args.quick:
        length, heads, dim, width, states, repeats = (256, 2, 16, 32, 4, 1)
    mesh = jax.make_mesh((SHARDS,), ("seq",), devices=jax.devices()[:SHARDS])
    rows = [
        "| op | shapes | fwd single ms | fwd sharded ms | ratio | fwd+bwd single ms |"
        " fwd+bwd sharded ms | ratio | bytes/shard (shapes) | HLO collectives (bytes/shard) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for op in ("gated_delta_rule", "ssd", "selective_scan"):
        x = make_inputs(op, 1, length, heads, dim, width, states)
        (f1, fp, b1, bp), shape_bytes, hlo = measure(op, x, mesh, repeats)
        shapes = (
            f"B=1, L={length}, D={width}, N={states}"
            if op == "selective_scan"
            else f"B=1, T={length}, H={heads}, K=V={dim}"
        )
        hlo_text = ", ".join(f"{k} {v}" for k, v in sorted(hlo.items())) or "none"
        rows.append(
            f"| {op} | {shapes} | {f1 * 1e3:.1f} | {fp * 1e3:.1f} | {fp / f1:.2f} |"
            f" {b1 * 1e3:.1f} | {bp * 1e3:.1f} | {bp / b1:.2f} | {shape_bytes} | {hlo_text} |"
        )
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    text = "\n".join(
        [
            SECTION,
            "",
            f"{datetime.date.today().isoformat()}; {cpu_model()}; jax {jax.__version__};"
            f" `{command}`.",
            f"float32, {SHARDS} fake CPU devices of one process (XLA_FLAGS"
            " --xla_force_host_platform_device_count=4) sharing the same cores: the ratios"
            " (sharded / single device) measure the overhead of the decomposition, not a"
            f" speed-up. Medians of {repeats} after a warm-up; impl None (chunked, chunk 64, for"
            " the gated delta rule and SSD; sequential for the selective scan). Bytes: what one"
            " shard receives in the forward pass.",
            "",
            *rows,
            "",
        ]
    )
    if args.write_results:
        replace_section(SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
