"""Parity of `seqlab.interop` conversions with transformers' pure-torch models.

For the tiny random models of `tests/interop/hf_models.py` (Mamba, Mamba-2 with 2 groups and
transformers' norm, Qwen3-Next), on 2 x 19 random tokens: the relative RMS of seqlab's logits
against transformers' in float32 and float64, the worst relative RMS over parameters of the
gradient of `sum(R * logits)` (R ~ N(0, 1)), and in bfloat16 compute both libraries' logits
against transformers' float32 logits. Needs the `interop` extra (torch, transformers).

    python benchmarks/interop_parity.py                  # print the tables
    python benchmarks/interop_parity.py --write-results  # also into RESULTS.md
"""

import argparse
import datetime
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import cpu_model, replace_section  # noqa: E402
from flax.traverse_util import flatten_dict  # noqa: E402

from seqlab.interop import ARCHITECTURES, load_hf  # noqa: E402
from tests.interop import hf_models  # noqa: E402
from tests.interop.hf_models import torch, transformers  # noqa: E402

OPTIONS = {"mamba2": {"hf_mamba2_norm": True}}


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.sum((a - b) ** 2) / np.sum(b**2)))


def inputs():
    tokens = torch.randint(0, hf_models.VOCAB, (2, 19), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 19, hf_models.VOCAB, generator=torch.Generator().manual_seed(2))
    return tokens, weights


def parity(name: str, path: pathlib.Path, dtype: str) -> tuple[float, float, str]:
    """(logits rel RMS, worst gradient rel RMS, its parameter) in `dtype` (float32, float64)."""
    model = hf_models.build(name).to(getattr(torch, dtype))
    converted = load_hf(
        path, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype), **OPTIONS.get(name, {})
    )
    tokens, weights = inputs()
    logits = model(tokens).logits
    (logits * weights.to(logits.dtype)).sum().backward()
    hf_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}

    def forward(params):
        return converted.model.apply({"params": params}, jnp.asarray(tokens.numpy()))

    ours, vjp = jax.vjp(forward, jax.tree.map(jnp.asarray, converted.params))
    grads = flatten_dict(vjp(jnp.asarray(weights.numpy(), ours.dtype))[0], sep="/")
    errors = {}
    for rule in ARCHITECTURES[converted.architecture].rules(converted.model):
        for key, want in zip(
            rule.params, rule.to_seqlab(*(hf_grads[n] for n in rule.hf)), strict=True
        ):
            errors[key] = rel_rms(grads[key], want)
    worst = max(errors, key=errors.get)
    return rel_rms(ours, logits.detach().numpy()), errors[worst], worst


def bfloat16(name: str, path: pathlib.Path) -> tuple[float, float]:
    """Logits in bfloat16 compute against transformers' float32 logits: (transformers, seqlab)."""
    model = hf_models.build(name)
    tokens, _ = inputs()
    with torch.no_grad():
        reference = model(tokens).logits.numpy()
        theirs = model.to(torch.bfloat16)(tokens).logits.float().numpy()
    converted = load_hf(path, dtype=jnp.bfloat16, **OPTIONS.get(name, {}))
    ours = converted.model.apply({"params": converted.params}, jnp.asarray(tokens.numpy()))
    return rel_rms(theirs, reference), rel_rms(ours, reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    rows = ["| architecture | dtype | logits | worst parameter gradient |", "|---|---|---|---|"]
    bf16 = [
        "| architecture | transformers bf16 | seqlab bf16 |",
        "|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name in hf_models.CONFIGS:
            path = hf_models.save(hf_models.build(name), pathlib.Path(tmp) / name)
            for dtype in ("float32", "float64"):
                logits, grad, worst = parity(name, path, dtype)
                rows.append(f"| {name} | {dtype} | {logits:.2e} | {grad:.2e} (`{worst}`) |")
                print(rows[-1], flush=True)
            theirs, ours = bfloat16(name, path)
            bf16.append(f"| {name} | {theirs:.2e} | {ours:.2e} |")
            print(bf16[-1], flush=True)
    text = "\n".join(
        [
            "## Hugging Face interop: parity with transformers (CPU)",
            "",
            f"{datetime.date.today().isoformat()}, {cpu_model()}, transformers "
            f"{transformers.__version__}, torch {torch.__version__}, jax {jax.__version__}; "
            "`python benchmarks/interop_parity.py --write-results`. Relative RMS against "
            "transformers' pure-torch forward (tests: logits <= 1e-5, gradients <= 1e-4 in "
            "float32). float64 agrees only to float32 rounding because transformers computes its "
            "RMSNorms (and Qwen3-Next its delta rule) in float32 whatever the model's dtype.",
            "",
            *rows,
            "",
            "bfloat16 compute, logits against transformers' float32 logits:",
            "",
            *bf16,
        ]
    )
    print("\n" + text)
    if args.write_results:
        replace_section("## Hugging Face interop: parity with transformers (CPU)", text)


if __name__ == "__main__":
    main()
