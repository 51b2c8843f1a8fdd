"""Where the forward time of the chunked gated delta rule and SSD goes on CPU: each stage of the
chunked form, timed as the difference of jitted prefixes of it, beside the token-by-token scan.

    python benchmarks/cpu_stages.py                  # T = 2048 and 8192
    python benchmarks/cpu_stages.py --quick          # tiny smoke run
    python benchmarks/cpu_stages.py --write-results  # also replace the section in RESULTS.md

Stages (float32, B = 2, H = 8, K = V = 64, chunk 64, the sizes of `cpu_peers.py`):

- `intra`: chunking, the decays and, for the gated delta rule, the WY solve
  (`_delta.intra_chunk`); for SSD the decays alone (`_chunked.chunk_decays`);
- `scan`: the state pass over the chunks (`_chunked.scan_chunk_states`);
- `outputs`: the outputs from the chunk states and the intra-chunk scores.

Each prefix ends in its arrays' sum (so XLA keeps the work), and `prefix n - prefix n-1` is the
cost of stage n (median of `--repeats` calls after a warm-up, compilation excluded).
"""

import argparse
import datetime
import functools
import shlex
import sys

import jax
import jax.numpy as jnp
from _common import cpu_model, median_seconds, replace_section
from gated_delta_cpu import make_inputs

from seqlab.ops import _chunked, _delta
from seqlab.ops.gated_delta import gated_delta_rule
from seqlab.ops.ssd import ssd

SECTION = "## CPU: where the chunked forward's time goes"
STAGES = ("intra", "scan", "outputs")


def delta_prefix(stages: int, q, k, v, g, beta, *, chunk: int):
    """The gated delta rule's chunked form (`_delta.chunked_form`) up to stage `stages`."""
    b, t, h, dk = q.shape
    state = jnp.zeros((b, h, dk, v.shape[-1]), q.dtype)
    q, k, v, g, beta = (_chunked.pad_and_chunk(x, chunk) for x in (q, k, v, g, beta))
    seg = _chunked.pad_and_chunk(jnp.zeros((b, t), jnp.int32), chunk, edge=True)
    parts = _delta.intra_chunk(
        _delta.beta_write, q, k, v, g, seg, _chunked.incoming_segment(seg), beta
    )
    if stages == 1:
        return sum(jnp.sum(x) for x in parts)
    token_major = (_chunked.token_major(x) for x in (parts.k_end, parts.u, parts.w))
    final, states, v_new = _chunked.scan_chunk_states(state, *token_major, parts.state_to_end)
    if stages == 2:
        return jnp.sum(final) + jnp.sum(states) + jnp.sum(v_new)
    o = _delta.einsum("bnhck,bnhkv->bnhcv", parts.q_in, states)
    o = o + _delta.einsum("bnhij,bnhjv->bnhiv", parts.scores, _chunked.heads_major(v_new))
    return jnp.sum(_chunked.unchunk(_chunked.token_major(o), t)) + jnp.sum(final)


def ssd_prefix(stages: int, q, k, v, g, *, chunk: int):
    """SSD's chunked form (`seqlab.ops.ssd._chunked_form`) up to stage `stages`."""
    b, t, h, dk = q.shape
    state = jnp.zeros((b, h, dk, v.shape[-1]), q.dtype)
    q, k, v, g = (_chunked.pad_and_chunk(x, chunk) for x in (q, k, v, g))
    seg = _chunked.pad_and_chunk(jnp.zeros((b, t), jnp.int32), chunk, edge=True)
    decays = _chunked.chunk_decays(g, seg)
    if stages == 1:
        return sum(jnp.sum(x) for x in decays)
    k_end = k * decays.token_to_end[..., None]
    final, states, _ = _chunked.scan_chunk_states(state, k_end, v, None, decays.state_to_end)
    if stages == 2:
        return jnp.sum(final) + jnp.sum(states)
    o = _chunked.chunk_outputs(q, k, v, states, decays)
    return jnp.sum(_chunked.unchunk(o, t)) + jnp.sum(final)


def measure(args, t: int) -> list[dict]:
    """One row per op at length `t`: the recurrent forward, the chunked forward and its stages."""
    x = make_inputs(args.batch, t, args.heads, args.dim, beta=True)
    ops = {
        "gated_delta_rule": (
            # scale 1: the prefixes take q as it is
            functools.partial(gated_delta_rule, scale=1.0),
            delta_prefix,
            (x["q"], x["k"], x["v"], x["g"], x["beta"]),
        ),
        "ssd": (ssd, ssd_prefix, (x["q"], x["k"], x["v"], x["g"])),
    }
    rows = []
    for name, (op, prefix, arrays) in ops.items():
        row = {"op": name, "T": t}
        for impl in ("recurrent", "chunked"):
            fn = jax.jit(functools.partial(op, impl=impl, chunk_size=args.chunk))
            row[impl] = median_seconds(lambda *a, fn=fn: fn(*a)[0], *arrays, repeats=args.repeats)
        before = 0.0
        for n, stage in enumerate(STAGES, 1):
            fn = jax.jit(functools.partial(prefix, n, chunk=args.chunk))
            upto = median_seconds(fn, *arrays, repeats=args.repeats)
            row[stage], before = upto - before, upto
        rows.append(row)
        cells = "  ".join(f"{k} {1e3 * row[k]:7.1f}" for k in ("recurrent", "chunked", *STAGES))
        print(f"{name:17s} T={t:5d}  {cells}  (ms)", flush=True)
    return rows


def table(rows) -> str:
    head = "| op | T | recurrent ms | chunked ms | " + " | ".join(f"{s} ms (share)" for s in STAGES)
    lines = [head + " |", "|---|---:|" + "---:|" * (2 + len(STAGES))]
    for r in rows:
        total = sum(r[s] for s in STAGES)
        shares = " | ".join(f"{1e3 * r[s]:.1f} ({r[s] / total:.0%})" for s in STAGES)
        lines.append(
            f"| {r['op']} | {r['T']} | {1e3 * r['recurrent']:.1f} | {1e3 * r['chunked']:.1f} | "
            f"{shares} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (T = 256)")
    parser.add_argument("--lengths", default="2048,8192", help="comma-separated T")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64, help="K = V")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    lengths = [256] if args.quick else [int(t) for t in args.lengths.split(",")]
    rows = [row for t in lengths for row in measure(args, t)]
    print(table(rows))
    if args.write_results:
        command = "python benchmarks/cpu_stages.py " + shlex.join(sys.argv[1:])
        replace_section(
            SECTION,
            f"{SECTION}\n\n{datetime.date.today()}; {cpu_model()}, Linux; jax {jax.__version__};"
            f" `{command.strip()}`.\nfloat32, B = {args.batch}, H = {args.heads}, K = V ="
            f" {args.dim}, chunk {args.chunk}; medians of {args.repeats} after a warm-up. A"
            " stage's time is the difference of two jitted prefixes of the form (the script's"
            " docstring), so the stages add up to the last prefix, not exactly to the `chunked`"
            " column (the whole op, with its own fusions).\n\n" + table(rows) + "\n",
        )


if __name__ == "__main__":
    main()
