"""Gated delta rule on one NVIDIA GPU: seqlab "pallas_gpu" and "chunked" against
flash-linear-attention's `chunk_gated_delta_rule` (Triton), bfloat16, in one run.

    python benchmarks/gated_delta_gpu.py                  # the shapes below
    python benchmarks/gated_delta_gpu.py --quick          # one small shape, few repeats
    python benchmarks/gated_delta_gpu.py --write-results  # also replace the section in RESULTS.md

flash-linear-attention is an optional benchmark dependency (`pip install flash-linear-attention`,
needs PyTorch with CUDA); without it the peer column is empty and no ratios are printed.
Times are medians over `--repeats` calls after `--warmup` calls, each synchronized; the first
call's time (compilation included) is reported too. Forward is
`o = op(q, k, v, g, beta)`; forward+backward also takes the gradients of `sum(o * do)` with respect
to q, k, v, g and beta. An implementation that fails (compile error, out of memory) is reported
with its error, not skipped silently.

FLOP model (the work of the chunked algorithm, chunk C, per batch row, head and chunk):
    q k^T and k k^T                        4 C^2 K
    (I + L)^{-1} by forward substitution   C^3 / 3
    u = A (beta v), w = A (beta k)         C^2 V + C^2 K          (triangular)
    w S, q S, k^T v_new                    6 C K V
    ((q k^T) * Gamma) v_new                C^2 V                  (causal)
forward+backward counts three times the forward (the usual backward = 2 x forward model).
"""

import argparse
import datetime
import functools
import os
import shlex
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for PyTorch

import jax
import jax.numpy as jnp
import numpy as np
from _common import gpu_model, median_seconds, replace_section

from seqlab.ops.gated_delta import gated_delta_rule

SECTION = "## gated_delta_rule (GPU)"
# (B, T, H q/k heads, HV value heads, K = V). The first three are the published H200 figures'
# shapes (Qwen3.5-style heads: FlashQLA 0.397 ms forward at 8k, 1.52 ms at 32k; backward at 32k
# with 16/32 heads 2.52 ms), the rest issue 8's.
SHAPES = (
    (1, 8192, 16, 64, 128),
    (1, 32768, 16, 64, 128),
    (1, 32768, 16, 32, 128),
    (1, 8192, 96, 96, 128),
    (4, 4096, 64, 64, 128),
    (2, 16384, 16, 16, 128),
    (4, 2048, 16, 16, 128),
    (8, 2048, 16, 16, 64),
)
LARGE = SHAPES[3:6]  # issue 8's targets against fla are stated for these
CHUNK = 64


def forward_flops(b, t, h, hv, d, c=CHUNK):
    """Per value head (q/k heads are shared, the work is not)."""
    per_chunk = 4 * c * c * d + c**3 / 3 + 2 * c * c * d + 6 * c * d * d
    return b * hv * (t // c) * per_chunk


def numpy_inputs(b, t, h, hv, d, seed=0):
    r = np.random.default_rng(seed)
    k = r.standard_normal((b, t, h, d), np.float32)
    return dict(
        q=r.standard_normal((b, t, h, d), np.float32),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=r.standard_normal((b, t, hv, d), np.float32),
        g=np.log(r.uniform(0.9, 1.0, (b, t, hv))).astype(np.float32),
        beta=r.uniform(0.0, 1.0, (b, t, hv)).astype(np.float32),
        do=r.standard_normal((b, t, hv, d), np.float32),
    )


def timed(fn, *args, repeats, warmup, sync=None):
    """`(first-call seconds, median seconds)`: the first call compiles."""
    sync = sync or jax.block_until_ready
    start = time.perf_counter()
    sync(fn(*args))
    first = time.perf_counter() - start
    return first, median_seconds(fn, *args, repeats=repeats, warmup=warmup, sync=sync)


def seqlab_functions(impl):
    def fwd(q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, impl=impl, chunk_size=CHUNK)[0]

    def fwd_bwd(q, k, v, g, beta, do):
        o, pullback = jax.vjp(fwd, q, k, v, g, beta)
        return o, pullback(do)

    return jax.jit(fwd), jax.jit(fwd_bwd)


def time_seqlab(impl, x, repeats, warmup):
    bf16 = {n: jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v", "do")}
    gates = {n: jnp.asarray(x[n]) for n in ("g", "beta")}
    fwd, fwd_bwd = seqlab_functions(impl)
    args = (bf16["q"], bf16["k"], bf16["v"], gates["g"], gates["beta"])
    first_fwd, t_fwd = timed(fwd, *args, repeats=repeats, warmup=warmup)
    first_both, t_both = timed(fwd_bwd, *args, bf16["do"], repeats=repeats, warmup=warmup)
    return t_fwd, t_both, first_fwd, first_both


def load_fla():
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        return None, f"flash-linear-attention not available ({e})"
    if not torch.cuda.is_available():
        return None, "PyTorch sees no CUDA device"
    return (torch, chunk_gated_delta_rule), None


def time_fla(fla, x, repeats, warmup):
    torch, op = fla
    dev = "cuda"
    t = {n: torch.tensor(x[n], device=dev, dtype=torch.bfloat16) for n in ("q", "k", "v", "do")}
    g = torch.tensor(x["g"], device=dev, dtype=torch.float32)
    beta = torch.tensor(x["beta"], device=dev, dtype=torch.bfloat16)
    scale = x["q"].shape[-1] ** -0.5

    def sync(_):
        torch.cuda.synchronize()

    def fwd():
        with torch.no_grad():
            return op(t["q"], t["k"], t["v"], g, beta, scale=scale)[0]

    leaves = [a.clone().requires_grad_(True) for a in (t["q"], t["k"], t["v"], g, beta)]

    def fwd_bwd():
        o = op(*leaves, scale=scale)[0]
        o.backward(t["do"])
        return o

    first_fwd, t_fwd = timed(fwd, repeats=repeats, warmup=warmup, sync=sync)
    try:
        first_both, t_both = timed(fwd_bwd, repeats=repeats, warmup=warmup, sync=sync)
    except RuntimeError as e:  # fla refuses its backward on some Triton versions: keep the forward
        print(f"  fla backward failed: {str(e).splitlines()[0][:200]}", flush=True)
        first_both = t_both = None
    return t_fwd, t_both, first_fwd, first_both


def measure(name, timer):
    try:
        return timer(), None
    except Exception as e:  # a failing implementation is a finding: report it, keep going
        message = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"  {name} failed: {message}", flush=True)
        return None, message


def table_row(shape, name, times, error, flops, peer):
    if times is None:
        return f"| {shape} | {name} | failed: {error} | | | | | | |"
    t_fwd, t_both, first_fwd, first_both = times

    def ratio(i):
        return f"{times[i] / peer[i]:.2f}" if peer and peer[i] and times[i] else "-"

    both = f"{t_both * 1e3:.3f} | {3 * flops / t_both / 1e12:.1f}" if t_both else "failed | -"
    return (
        f"| {shape} | {name} | {t_fwd * 1e3:.3f} | {flops / t_fwd / 1e12:.1f} | {both} |"
        f" {ratio(0)} / {ratio(1)} | {first_fwd:.1f} / {first_both or 0:.1f} |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, 3 repeats")
    parser.add_argument("--shapes", default="", help='"B,T,H,HV,D;..." instead of the shapes above')
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--write-results", action="store_true", help="update RESULTS.md")
    parser.add_argument("--note", default="", help="a line for RESULTS.md")
    args = parser.parse_args()
    shapes = ((2, 1024, 4, 4, 64),) if args.quick else SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(n) for n in s.split(",")) for s in args.shapes.split(";"))
    repeats = 3 if args.quick else args.repeats
    fla, fla_missing = load_fla()
    if fla_missing:
        print(f"peer: {fla_missing}")
    header = [
        "| B, T, H, HV, D | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s"
        " | fwd, fwd+bwd / fla | first call s (fwd / fwd+bwd) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(header), flush=True)
    rows, notes = [], []
    for shape in shapes:
        x = numpy_inputs(*shape)
        flops = forward_flops(*shape)
        times, errors = {}, {}
        timers = {
            impl: functools.partial(time_seqlab, impl, x, repeats, args.warmup)
            for impl in ("pallas_gpu", "chunked")
        }
        if fla is not None:
            timers["fla"] = functools.partial(time_fla, fla, x, repeats, args.warmup)
        for name, timer in timers.items():
            times[name], errors[name] = measure(name, timer)
        peer = times.get("fla")
        for name in timers:
            rows.append(table_row(shape, name, times[name], errors[name], flops, peer))
            print(rows[-1], flush=True)
        if shape in LARGE and peer and peer[1]:
            for name, limit in (("pallas_gpu", 1.0), ("chunked", 3.0)):
                if times[name] is not None and times[name][1]:
                    ratio = times[name][1] / peer[1]
                    met = "met" if ratio <= limit else "NOT met"
                    notes.append(
                        f"- {shape} {name} fwd+bwd / fla = {ratio:.2f} (target <= {limit}): {met}"
                    )
    print("\n".join(notes))
    if args.write_results:
        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        text = "\n".join(
            [
                SECTION,
                "",
                f"- date: {datetime.date.today().isoformat()}",
                f"- machine: {gpu_model()}; jax {jax.__version__}, backend {jax.default_backend()}",
                f"- command: `{command}`",
                f"- bfloat16 q/k/v, chunk {CHUNK}; median of {repeats} calls after"
                f" {args.warmup} warm-up calls",
                f"- peer: {fla_missing or 'flash-linear-attention chunk_gated_delta_rule'}",
                *([f"- note: {args.note}"] if args.note else []),
                "",
                *header,
                *rows,
                "",
                *notes,
                "",
            ]
        )
        replace_section(SECTION, text)
        print(f"wrote section {SECTION!r}")


if __name__ == "__main__":
    main()
