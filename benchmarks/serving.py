"""Serving speed on CPU, `seqlab.serving`: prefill and decode tokens/s of Gated DeltaNet, Mamba-2
and global-attention language models at long contexts, and how the decode cost per token grows
with the context (flat for the recurrent mixers, growing for attention, whose step reads every
cached key).

    python benchmarks/serving.py                                   # 1k / 8k / 32k, batch 1 and 8
    python benchmarks/serving.py --contexts 1024,32768 --batches 1 # a subset
    python benchmarks/serving.py --write-results                   # also replace the section

Models: `LanguageModel(vocab 1024, d_model 256, 2 blocks, SwiGLU d_ff 512)`, float32, with
'g' (4 heads of 64), '2' (head_dim 64, d_state 64, expand 2) or 'a' (4 heads of 64) blocks.
Prefill: `seqlab.serving.prefill` of a random prompt of `context` tokens in pieces of `--chunk`
tokens (its pieces compiled before the timed run); decode: `seqlab.serving.decode` of
`--new_tokens` greedy tokens from that cache, per decode step: the median of `--repeats` runs after
a compiling one. Every time ends with `block_until_ready`; the prefill is one run. The ratio
column: decode time per step at this context over that at the smallest context of the run, same
model and batch.
"""

import argparse
import datetime
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import cpu_model, median_seconds, replace_section

from seqlab.modules.lm import LanguageModel
from seqlab.serving import decode, prefill

SECTION = "## serving: prefill and decode tokens/s (CPU)"
VOCAB, WIDTH, LAYERS, D_FF = 1024, 256, 2, 512
MODELS = {
    "gdn": dict(pattern="g" * LAYERS, gdn={"num_heads": 4, "head_dim": 64}),
    "mamba2": dict(pattern="2" * LAYERS, mamba2={"d_state": 64, "head_dim": 64}),
    "attention": dict(pattern="a" * LAYERS, attention={"num_heads": 4, "head_dim": 64}),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def measure(model, params, batch: int, context: int, chunk: int, new_tokens: int, repeats: int):
    """(prefill seconds, decode seconds per step) at `context` tokens."""
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (batch, context)), jnp.int32)
    max_len = context + new_tokens
    chunk = min(chunk, context)
    # Compile the prefill piece (same cache shape) and the decode loop before timing them.
    jax.block_until_ready(prefill(model, params, prompts[:, :chunk], max_len=max_len))
    start = time.perf_counter()
    logits, cache = prefill(model, params, prompts, max_len=max_len, prefill_chunk=chunk)
    jax.block_until_ready((logits, cache))
    prefill_s = time.perf_counter() - start
    decode_s = median_seconds(
        lambda: decode(model, params, logits, cache, max_new_tokens=new_tokens), repeats=repeats
    )
    return prefill_s, decode_s / (new_tokens - 1)  # new_tokens - 1 steps: no stop tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=_ints, default=[1024, 8192, 32768])
    parser.add_argument("--batches", type=_ints, default=[1, 8])
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ",".join(MODELS))
    parser.add_argument("--chunk", type=int, default=2048, help="prefill piece, tokens")
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="decode runs (median)")
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    contexts = sorted(args.contexts)
    rows = [
        "| model | batch | context | prefill tokens/s | decode tokens/s | decode ms/step |"
        f" decode cost vs {contexts[0]} |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in args.models.split(","):
        model = LanguageModel(vocab_size=VOCAB, d_model=WIDTH, d_ff=D_FF, **MODELS[name])
        params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
        for batch in args.batches:
            base = None
            for context in contexts:
                prefill_s, step_s = measure(
                    model, params, batch, context, args.chunk, args.new_tokens, args.repeats
                )
                base = base or step_s
                row = (
                    f"| {name} | {batch} | {context} | {batch * context / prefill_s:,.0f} |"
                    f" {batch / step_s:,.1f} | {1e3 * step_s:.2f} | {step_s / base:.2f} |"
                )
                rows.append(row)
                print(row, flush=True)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    text = "\n".join(
        [
            SECTION,
            "",
            f"{datetime.date.today().isoformat()}; {cpu_model()}; jax {jax.__version__};"
            f" `{command}`.",
            f"vocab {VOCAB}, d_model {WIDTH}, {LAYERS} blocks, SwiGLU {D_FF}, float32; prefill in"
            f" pieces of {args.chunk} (one run after compilation); {args.new_tokens} greedy decode"
            f" tokens (median of {args.repeats} runs).",
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
