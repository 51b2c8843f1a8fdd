"""Accuracy of every gated-delta-rule impl on inputs like a trained model's.

For each input regime (neighbouring-key cosine, write strength, gates, segments, grouped heads;
`tests/ops/trained_like.py`), the relative RMS error against the float64 token-by-token
recurrence of the output, the final state and every gradient, per impl and dtype. Prints a
markdown table and the worst error per (impl, dtype); the bfloat16 column also gives each
impl's ratio to `"chunked"` at the same inputs.

    python benchmarks/gated_delta_accuracy.py            # CPU: Pallas kernels interpreted
    python benchmarks/gated_delta_accuracy.py --quick    # two regimes
    python benchmarks/gated_delta_accuracy.py --compiled --impls=chunked,pallas_gpu   # on a GPU
    python benchmarks/gated_delta_accuracy.py --write-results   # also into RESULTS.md
"""

import argparse
import datetime
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from _common import cpu_model, gpu_model, replace_section  # noqa: E402

from seqlab.ops import gated_delta_rule  # noqa: E402
from tests.ops import trained_like  # noqa: E402

CASES = [
    trained_like.Case(cosine=0.2),
    trained_like.Case(cosine=0.5, gate="extreme", groups=2),
    trained_like.Case(cosine=0.9, beta=(0.9, 1.0), segments=True, groups=2),
    trained_like.Case(cosine=0.99, beta=(0.99, 1.0), gate="zero"),
    trained_like.Case(cosine=1.0, beta=(0.5, 1.0), gate="strong", segments=True),
]
QUICK = [CASES[0], CASES[3]]


def run(impl: str, x: dict, *, compiled: bool):
    interpret = impl.startswith("pallas") and not compiled
    fn = functools.partial(
        gated_delta_rule, output_final_state=True, impl=impl, interpret=interpret
    )
    return trained_like.forward_and_grads(fn, x)


def measure(cases, impls, dtypes, *, compiled: bool):
    """Rows `(case, impl, dtype, worst relative RMS error, which output)`."""
    rows = []
    for case in cases:
        x = trained_like.inputs(case)
        want = run("recurrent", trained_like.cast(x, jnp.float64), compiled=compiled)
        for dtype in dtypes:
            for impl in impls:
                got = run(impl, trained_like.cast(x, dtype), compiled=compiled)
                errors = {n: trained_like.rel_rms(got[n], want[n]) for n in want}
                worst = max(errors, key=errors.get)
                rows.append((case.name, impl, jnp.dtype(dtype).name, errors[worst], worst))
                print(f"{case.name:45s} {impl:11s} {jnp.dtype(dtype).name:9s} "
                      f"{errors[worst]:.2e} ({worst})", flush=True)  # fmt: skip
    return rows


def table(rows) -> str:
    ref = {(c, d): e for c, i, d, e, _ in rows if i == "chunked"}
    lines = [
        "| inputs | impl | dtype | worst rel. RMS error (output) | vs chunked |",
        "|---|---|---|---|---|",
    ]
    for case, impl, dtype, err, worst in rows:
        ratio = f"{err / ref[(case, dtype)]:.2f}" if (case, dtype) in ref else "-"
        lines.append(f"| {case} | {impl} | {dtype} | {err:.2e} ({worst}) | {ratio} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two input regimes")
    parser.add_argument("--impls", default="chunked,pallas_tpu,pallas_gpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--compiled", action="store_true", help="kernels compiled, not interpreted")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    impls = args.impls.split(",")
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
    rows = measure(QUICK if args.quick else CASES, impls, dtypes, compiled=args.compiled)
    text = table(rows)
    print(text)
    if args.write_results:
        machine = gpu_model() if args.compiled else cpu_model()
        mode = "compiled" if args.compiled else "Pallas kernels in interpret mode"
        replace_section(
            "## Gated delta rule: accuracy on trained-model-like inputs",
            "## Gated delta rule: accuracy on trained-model-like inputs\n\n"
            f"{datetime.date.today()}; {machine}; jax {jax.__version__}; {mode}. Command: "
            f"`python benchmarks/gated_delta_accuracy.py{' --quick' * args.quick}"
            f"{' --compiled' * args.compiled} --impls={args.impls}`. Error against the float64 "
            "recurrence of the output, the final state and every gradient (the worst of them "
            "named), relative RMS. Inputs: `tests/ops/trained_like.py`.\n\n" + text + "\n",
        )


if __name__ == "__main__":
    main()
