"""seqlab against its PyTorch peers on CPU: the gated delta rule, SSD and the selective scan,
forward and forward+backward, float32, with the backward memory of seqlab's paths.

    python benchmarks/cpu_peers.py                  # T in {2048, 8192} (the Mamba mixer 2048)
    python benchmarks/cpu_peers.py --quick          # tiny smoke run (T = 256)
    python benchmarks/cpu_peers.py --write-results  # also replace the section in RESULTS.md

Needs the `bench` extra (`pip install -e ".[bench]"`: torch 2.13.0, transformers 4.57.x,
flash-linear-attention 0.5.2). Importing the package `fla` imports triton (absent from the CPU
build of torch), so fla's naive torch functions are loaded from their files
(`fla/ops/<op>/naive.py`, which import only torch and einops) without running the package.

What is compared (B = 2, H = 8, K = V = 64 by default; seqlab's `impl="recurrent"`,
`"chunked"` and `None`, the default, all jitted; on CPU `None` is `"mixed"`: the recurrent
forward, and under `jax.grad` the chunked form's recomputing derivative):

- gated delta rule, `seqlab.ops.gated_delta_rule`, against transformers'
  `qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule` (with
  `use_qk_l2norm_in_kernel=False`) and fla's `gated_delta_rule.naive.naive_chunk_gated_delta_rule`,
  both with chunk 64. All three take `[B, T, H, K]` inputs and `scale = K ** -0.5`, and none
  normalizes q or k, so they get the same arrays: unit-norm keys, beta in (0, 1), log-gates in
  log(0.9..1).
- SSD, `seqlab.ops.ssd`, against fla's `simple_gla.naive.naive_chunk_simple_gla` (chunk 64,
  `scale=1.0`: SSD reads `o_t = S_t^T q_t` unscaled), the same recurrence
  `S_t = exp(g_t) S_{t-1} + k_t v_t^T` in the same layout. transformers' Mamba-2 SSD lives inline in
  `Mamba2Mixer.torch_forward`, which materializes `[B, n, n, H, V, K]` inter-chunk and
  `[B, n, C, C, H, K]` intra-chunk products (n chunks of C tokens): 4.4 and 2.1 GB at T = 8192
  for these sizes, before its backward saves them, so it is not run here.
- selective scan: transformers' scan is inline in `MambaMixer.slow_forward` (a token loop in
  torch), so the whole mixer is compared: a one-layer `MambaForCausalLM` (hidden 128, expand 2:
  D = 256 channels, N = 16) is saved and read back with `seqlab.interop.load_hf`, and its
  `slow_forward` is timed against seqlab's `Mamba` mixer with the converted weights
  (`impl="sequential"`, `"parallel"`, `None`); the gradients are taken in the input and every
  weight on both sides.

First every contestant runs once on the same inputs (the warm-up, which also compiles), and its
output (forward) or input gradients (forward+backward) are compared with seqlab's first path that
ran: the largest `max|a - b| / max|b|` over the arrays is printed, and the script aborts above
1e-3 (then the comparison would be of different math). Then the contestants are timed in turn,
one call each per round, `--repeats` rounds; the table holds the medians. torch runs its forward
under `torch.no_grad()`, its backward as `.sum().backward()` in every float input (and weight);
seqlab as `jax.jit(fn)` and `jax.jit(jax.grad(sum(fn)))`. torch uses `--threads` threads; XLA
uses the machine's cores. Backward memory is seqlab's compiled forward+backward `temp + output`
bytes (`jax.jit(grad).lower(x).compile().memory_analysis()`), per head and token in floats
(`B H T (K + V) 4` bytes; for the Mamba mixer `B T D 4`); a seqlab backward whose compiled memory
exceeds `--max-bwd-gib` is reported (memory) but not run (`nan`).
"""

import argparse
import datetime
import functools
import importlib.metadata
import importlib.util
import os
import shlex
import statistics
import sys
import tempfile
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from _common import RESULTS, cpu_model, median_seconds, replace_section
from gated_delta_cpu import make_inputs
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from seqlab.interop import load_hf
from seqlab.ops.gated_delta import gated_delta_rule
from seqlab.ops.ssd import ssd

SECTION = "## CPU: seqlab against the PyTorch peers"
MiB = 2**20
TOLERANCE = 1e-3  # the largest relative difference that still counts as the same math


class Contestant(NamedTuple):
    """One implementation: `forward(inputs)` and `backward(inputs) -> dict of gradients`."""

    name: str
    forward: Any
    backward: Any
    inputs: Any
    sync: Any
    seqlab: bool


@functools.cache
def fla_naive(op: str, function: str):
    """`fla.ops.<op>.naive.<function>`, loaded from its file without importing `fla` (which
    imports triton)."""
    root = importlib.util.find_spec("fla").submodule_search_locations[0]
    path = os.path.join(root, "ops", op, "naive.py")
    spec = importlib.util.spec_from_file_location(f"fla_naive_{op}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)


def no_sync(_):
    """torch on CPU returns when the result is ready."""


def seqlab_op(op, impl, x) -> Contestant:
    """`op(**x, impl=impl)[0]` and the gradient of its sum in every input, jitted."""

    def out(x):
        return op(**x, impl=impl)[0]

    name = f"seqlab {impl or 'default'}"
    backward = jax.jit(jax.grad(lambda x: jnp.sum(out(x))))
    return Contestant(name, jax.jit(out), backward, x, jax.block_until_ready, True)


def torch_op(name, fn, x) -> Contestant:
    """`fn(**x)` under no_grad, and `.sum().backward()` in every input."""

    def forward(x):
        with torch.no_grad():
            return fn(**x)

    def backward(x):
        leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
        fn(**leaves).sum().backward()
        return {n: t.grad for n, t in leaves.items()}

    return Contestant(name, forward, backward, x, no_sync, False)


def seqlab_mixer(mixer, impl, params, x) -> Contestant:
    """The mixer with `impl`; gradients in its weights and the input."""
    mixer = mixer.clone(impl=impl)

    def out(a):
        return mixer.apply({"params": a["params"]}, a["x"])

    backward = jax.jit(jax.grad(lambda a: jnp.sum(out(a))))
    inputs = {"params": params, "x": x}
    return Contestant(
        f"seqlab {impl or 'default'}", jax.jit(out), backward, inputs, jax.block_until_ready, True
    )


def torch_mixer(name, mixer, x) -> Contestant:
    """transformers' `MambaMixer.slow_forward`; gradients in its weights and the input."""

    def forward(a):
        with torch.no_grad():
            return mixer.slow_forward(a["x"])

    def backward(a):
        mixer.zero_grad(set_to_none=True)
        x = a["x"].detach().requires_grad_()
        mixer.slow_forward(x).sum().backward()
        return {"x": x.grad, "params": [p.grad for p in mixer.parameters()]}

    return Contestant(name, forward, backward, {"x": x}, no_sync, False)


def gated_delta_contestants(batch, length, heads, dim):
    jx = make_inputs(batch, length, heads, dim, beta=True)
    tx = {n: torch.from_numpy(np.array(a)) for n, a in jx.items()}
    fla = fla_naive("gated_delta_rule", "naive_chunk_gated_delta_rule")

    def hf_fn(q, k, v, g, beta):
        return torch_chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=False
        )[0]

    def fla_fn(q, k, v, g, beta):
        return fla(q, k, v, g, beta, chunk_size=64)[0]

    return [
        *(seqlab_op(gated_delta_rule, impl, jx) for impl in ("recurrent", "chunked", None)),
        torch_op("HF", hf_fn, tx),
        torch_op("fla", fla_fn, tx),
    ]


def ssd_contestants(batch, length, heads, dim):
    jx = make_inputs(batch, length, heads, dim, beta=False)
    tx = {n: torch.from_numpy(np.array(a)) for n, a in jx.items()}
    fla = fla_naive("simple_gla", "naive_chunk_simple_gla")

    def fla_fn(q, k, v, g):
        return fla(q, k, v, g, chunk_size=64, scale=1.0)[0]

    return [
        *(seqlab_op(ssd, impl, jx) for impl in ("recurrent", "chunked", None)),
        torch_op("fla", fla_fn, tx),
    ]


def mamba_pair(d_model, d_state):
    """transformers' Mamba mixer (one random layer) and seqlab's with the same weights."""
    config = transformers.MambaConfig(
        vocab_size=16, hidden_size=d_model, state_size=d_state, num_hidden_layers=1, expand=2
    )
    torch.manual_seed(0)
    hf = transformers.MambaForCausalLM(config).eval()
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path, safe_serialization=True)
        converted = load_hf(path)
    params = jax.tree.map(jnp.asarray, converted.params["blocks_0"]["mixer"])
    return hf.backbone.layers[0].mixer, converted.model.make_mixer("m"), params


def mamba_contestants(batch, length, pair):
    hf, mixer, params = pair
    x = np.random.default_rng(0).standard_normal((batch, length, mixer.d_model), np.float32)
    return [
        *(
            seqlab_mixer(mixer, impl, params, jnp.asarray(x))
            for impl in ("sequential", "parallel", None)
        ),
        torch_mixer("HF slow", hf, torch.from_numpy(x)),
    ]


def as_numpy(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().numpy()
    return np.asarray(a, np.float64)


def relative_difference(a, b) -> float:
    """`max|a - b| / max|b|`."""
    a, b = as_numpy(a), as_numpy(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def difference(result, reference, compared) -> float:
    """The largest relative difference over the forward output or the `compared` gradients."""
    if not isinstance(reference, dict):
        return relative_difference(result, reference)
    return max(relative_difference(result[n], reference[n]) for n in compared)


def backward_bytes(c: Contestant) -> int:
    stats = c.backward.lower(c.inputs).compile().memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def measure(op, contestants, length, compared, repeats, max_bytes, unit):
    """Time every contestant, forward and forward+backward, after checking agreement.

    Returns (table rows `(T, pass, {name: seconds})`, memory rows, agreement lines)."""
    rows, memory, checks = [], [], []
    for pass_ in ("fwd", "fwd+bwd"):
        backward = pass_ == "fwd+bwd"
        results, ran = {}, []
        for c in contestants:
            fn = c.backward if backward else c.forward
            if backward and c.seqlab:
                need = backward_bytes(c)
                memory.append((length, c.name, need, need / unit))
                if need > max_bytes:
                    continue  # reported, not run
            results[c.name] = fn(c.inputs)  # the warm-up (compilation) and the agreement check
            ran.append((c, fn))
        reference = next(c.name for c, _ in ran if c.seqlab)
        diffs = {
            name: difference(r, results[reference], compared)
            for name, r in results.items()
            if name != reference
        }
        what = "output" if not backward else f"gradients in {', '.join(compared)}"
        line = f"{op}, T = {length}, {pass_}: max relative difference of the {what} to " + (
            f"{reference}: " + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items())
        )
        print(line, flush=True)
        checks.append(line)
        bad = {n: d for n, d in diffs.items() if not d <= TOLERANCE}
        if bad:
            sys.exit(f"{op}: {bad} differ from {reference} beyond {TOLERANCE}: not the same math")
        del results
        times = {c.name: [] for c, _ in ran}
        for _ in range(repeats):
            for c, fn in ran:
                times[c.name].append(median_seconds(fn, c.inputs, repeats=1, warmup=0, sync=c.sync))
        medians = {n: statistics.median(t) for n, t in times.items()}
        print(", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in medians.items()), flush=True)
        rows.append((length, pass_, medians))
    return rows, memory, checks


def timing_table(rows, names):
    """Markdown rows: times in ms, then peer / seqlab ratios (above 1: seqlab faster)."""
    ours = [n for n in names if n.startswith("seqlab")]
    peers = [n for n in names if not n.startswith("seqlab")]
    ratios = [(p, s) for p in peers for s in ours]
    header = [
        "| T | pass | "
        + " | ".join(f"{n} ms" for n in names)
        + " | "
        + " | ".join(f"{p} / {s.removeprefix('seqlab ')}" for p, s in ratios)
        + " |",
        "|---:|---|" + "---:|" * (len(names) + len(ratios)),
    ]
    nan, out = float("nan"), []
    for length, pass_, t in rows:
        cells = [f"{t.get(n, nan) * 1e3:.1f}" for n in names]
        cells += [f"{t.get(p, nan) / t.get(s, nan):.2f}" for p, s in ratios]
        out.append(f"| {length} | {pass_} | " + " | ".join(cells) + " |")
    return header + out


def memory_table(memory, unit_name):
    header = [f"| T | seqlab impl | fwd+bwd MiB | / ({unit_name}) |", "|---:|---|---:|---:|"]
    return header + [
        f"| {length} | {name.removeprefix('seqlab ')} | {need / MiB:.1f} | {per:.1f} |"
        for length, name, need, per in memory
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (T = 256)")
    parser.add_argument("--lengths", default="2048,8192", help="comma-separated T")
    parser.add_argument("--mamba-lengths", default="2048", help="comma-separated T of the Mamba "
                        "mixer (HF's slow path: ~1 min per forward+backward at 2048)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64, help="K = V")
    parser.add_argument("--mamba-d-model", type=int, default=128, help="Mamba: D = 2 * this")
    parser.add_argument("--mamba-d-state", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-bwd-gib", type=float, default=4.0, help="run no seqlab backward "
                        "whose compiled memory exceeds this")  # fmt: skip
    parser.add_argument("--write-results", action="store_true")
    parser.add_argument("--note", default="", help="a line for RESULTS.md, e.g. the machine's load")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths, mamba_lengths = (
        ((256,),) * 2
        if args.quick
        else (tuple(int(t) for t in a.split(",")) for a in (args.lengths, args.mamba_lengths))
    )
    repeats = 1 if args.quick else args.repeats
    b, h, d = args.batch, args.heads, args.dim
    max_bytes = args.max_bwd_gib * 2**30
    pair = mamba_pair(args.mamba_d_model, args.mamba_d_state)
    d_inner = 2 * args.mamba_d_model
    ops = [
        # (title, T, contestants of T, compared gradients, bytes of one float per head and token)
        (
            "gated delta rule",
            lengths,
            lambda t: gated_delta_contestants(b, t, h, d),
            ("q", "k", "v", "g", "beta"),
            lambda t: b * h * t * 2 * d * 4,
            "B H T (K+V) 4",
        ),
        (
            "ssd",
            lengths,
            lambda t: ssd_contestants(b, t, h, d),
            ("q", "k", "v", "g"),
            lambda t: b * h * t * 2 * d * 4,
            "B H T (K+V) 4",
        ),
        (
            "selective scan (Mamba mixer)",
            mamba_lengths,
            lambda t: mamba_contestants(b, t, pair),
            ("x",),
            lambda t: b * t * d_inner * 4,
            "B T D 4",
        ),
    ]
    versions = {
        "jax": jax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "flash-linear-attention": importlib.metadata.version("flash-linear-attention"),
    }
    print(f"{cpu_model()}; " + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    sections = []
    for title, op_lengths, make, compared, unit, unit_name in ops:
        rows, memory, checks, names = [], [], [], []
        for length in op_lengths:
            contestants = make(length)
            names = [c.name for c in contestants]
            r, m, c = measure(
                title, contestants, length, compared, repeats, max_bytes, unit(length)
            )
            rows += r
            memory += m
            checks += c
        tables = [*timing_table(rows, names), "", *memory_table(memory, unit_name)]
        print("\n".join(["", f"### {title}", "", *tables, ""]), flush=True)
        sections += [f"### {title}", "", *(f"- {c}" for c in checks), "", *tables, ""]
    command = shlex.join(["python", "benchmarks/cpu_peers.py", *sys.argv[1:]])
    text = "\n".join(
        [
            SECTION,
            "",
            f"{datetime.date.today().isoformat()}; {cpu_model()};"
            + "".join(f" {k} {v};" for k, v in versions.items())
            + f" `{command}`.",
            f"float32, B = {b}, H = {h}, K = V = {d}, chunk 64; Mamba mixer D = {d_inner},"
            f" N = {args.mamba_d_state}; torch on {args.threads} threads; medians of {repeats}"
            " rounds (every contestant once per round) after a warm-up. Ratios are peer time /"
            " seqlab time: above 1, seqlab is faster. `nan`: a seqlab backward not run because"
            f" its compiled memory exceeds {args.max_bwd_gib} GiB. What each peer is: the"
            " docstring of `benchmarks/cpu_peers.py`.",
            *([args.note] if args.note else []),
            "",
            *sections,
        ]
    )
    if args.write_results:
        replace_section(SECTION, text)
        print(f"wrote section {SECTION!r} of {RESULTS}")


if __name__ == "__main__":
    main()
