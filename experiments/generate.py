"""Continue a prompt with the model of a workdir (a trained run or a converted checkpoint).

    python -m experiments.generate --workdir=RUN --prompt="1 2 3" [--max_new_tokens=32] \
        [--temperature=0] [--top_k=K] [--top_p=P] [--seed=0] [--stop=ID,ID] \
        [--prefill_chunk=1024] [--nowarmup]

The prompt is token ids, space separated (there is no tokenizer). The model and its latest
parameters come from `seqlab.train.workdir.load_model`; generation is `seqlab.serving` (prefill
with `extend` in pieces of `--prefill_chunk` tokens, a progress line per piece for longer prompts,
then the compiled decode loop), greedy unless `--temperature > 0` (then `--top_k`, `--top_p` and
the key `jax.random.key(--seed)` apply); generation of a row ends at a `--stop` token. Prints the
continuation (ids, space separated) and the prefill and decode speeds in tokens/s; with
`--warmup` (the default) the generation runs once before the timed run, so the speeds exclude
compilation. Errors in the arguments or the workdir exit 1 with the reason.
"""

import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

from seqlab.ops.checks import check_positive_int
from seqlab.serving import decode, prefill
from seqlab.serving.generate import check_stops
from seqlab.serving.sampling import check_sampling
from seqlab.train.workdir import load_model

# A FlagValues of its own: `main(argv)` parses it, so the command runs (and is tested) beside
# other absl programs in one process (`experiments.launch` defines `--workdir` too).
FLAGS = flags.FlagValues()
flags.DEFINE_string("workdir", None, "a run's workdir or a converted checkpoint", flag_values=FLAGS)
flags.DEFINE_string("prompt", None, "token ids, space separated", flag_values=FLAGS)
flags.DEFINE_integer("max_new_tokens", 32, "tokens to generate", flag_values=FLAGS)
flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sample", flag_values=FLAGS)
flags.DEFINE_integer("top_k", None, "sample among the k most likely tokens", flag_values=FLAGS)
flags.DEFINE_float("top_p", None, "sample within the top-p nucleus", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "seed of the sampling key", flag_values=FLAGS)
flags.DEFINE_list("stop", [], "stop token ids, comma separated", flag_values=FLAGS)
flags.DEFINE_integer(
    "prefill_chunk", 1024, "prefill pieces (a progress line each)", flag_values=FLAGS
)
flags.DEFINE_bool("warmup", True, "run once untimed first (compilation)", flag_values=FLAGS)


def parse_ids(name: str, text) -> list[int]:
    """Token ids from `text` (space or comma separated); `ValueError` naming `name` otherwise."""
    words = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    try:
        return [int(word) for word in words]
    except ValueError:
        raise ValueError(f"{name} must be integer token ids, got {text!r}") from None


def run(
    workdir,
    prompt: list[int],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop: tuple[int, ...] = (),
    prefill_chunk: int = 1024,
    warmup: bool = True,
    out=print,
) -> dict:
    """Generate after `prompt` with the model of `workdir` and report through `out`: a progress
    line per prefill piece (prompts longer than `prefill_chunk`), the continuation, the speeds.
    Returns `{"tokens": [...], "prefill_tokens_per_s", "decode_tokens_per_s"}`."""
    if not prompt:
        raise ValueError("prompt must hold at least one token id")
    check_positive_int("max_new_tokens", max_new_tokens)
    check_positive_int("prefill_chunk", prefill_chunk)
    check_sampling(temperature, top_k, top_p)
    model, params = load_model(workdir)
    bad = [t for t in prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise ValueError(f"prompt has ids outside [0, {model.vocab_size}): {bad}")
    stops = check_stops(stop, 0, model.vocab_size)
    tokens = jnp.asarray([prompt], jnp.int32)
    key = jax.random.key(seed) if temperature > 0 else None

    def report(done: int, total: int) -> None:
        out(f"prefill {done}/{total} tokens")

    def generation(progress):
        start = time.perf_counter()
        logits, cache = prefill(
            model,
            params,
            tokens,
            max_len=len(prompt) + max_new_tokens,
            prefill_chunk=prefill_chunk,
            progress=progress,
        )
        jax.block_until_ready((logits, cache))
        middle = time.perf_counter()
        result = decode(
            model, params, logits, cache, max_new_tokens=max_new_tokens, key=key,
            temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stops,
        )  # fmt: skip
        jax.block_until_ready(result)
        return result, middle - start, time.perf_counter() - middle

    if warmup:
        generation(None)
    result, prefill_s, decode_s = generation(report if len(prompt) > prefill_chunk else None)
    length = int(result.lengths[0])
    continuation = [int(t) for t in result.tokens[0, :length]]
    # The decode loop runs `steps` calls of `step`; the first token comes from the prefill.
    stepped = int(result.steps)
    speeds = {
        "prefill_tokens_per_s": len(prompt) / prefill_s,
        "decode_tokens_per_s": stepped / decode_s if stepped else float("nan"),
    }
    out(" ".join(map(str, continuation)))
    out(
        f"prefill: {len(prompt)} tokens in {prefill_s:.3f} s "
        f"({speeds['prefill_tokens_per_s']:,.1f} tokens/s); decode: {stepped} steps in "
        f"{decode_s:.3f} s ({speeds['decode_tokens_per_s']:,.1f} tokens/s)"
        + ("" if warmup else ", compilation included")
    )
    return {"tokens": continuation, **speeds}


def main(argv) -> int:
    try:
        rest = FLAGS(argv)
        if len(rest) > 1:
            raise ValueError(f"unexpected arguments {rest[1:]}")
        if not FLAGS.workdir or FLAGS.prompt is None:
            raise ValueError("--workdir and --prompt are required")
        run(
            FLAGS.workdir,
            parse_ids("prompt", FLAGS.prompt),
            max_new_tokens=FLAGS.max_new_tokens,
            temperature=FLAGS.temperature,
            top_k=FLAGS.top_k,
            top_p=FLAGS.top_p,
            seed=FLAGS.seed,
            stop=tuple(parse_ids("stop", FLAGS.stop)),
            prefill_chunk=FLAGS.prefill_chunk,
            warmup=FLAGS.warmup,
        )
    except (flags.Error, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        FLAGS.unparse_flags()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
