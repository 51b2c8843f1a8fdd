"""`python -m experiments.generate` on a saved tiny workdir: the continuation equals
`seqlab.serving.generate`, the speeds and the prefill progress are printed, errors exit 1."""

import jax
import jax.numpy as jnp
import pytest

from experiments import generate as command
from seqlab.modules.lm import LanguageModel
from seqlab.serving import generate
from seqlab.train.workdir import save_model

LM = {"vocab_size": 23, "d_model": 16, "pattern": "2a",
      "mamba2": {"d_state": 4, "head_dim": 8, "chunk_size": 4},
      "attention": {"num_heads": 2, "head_dim": 8}}  # fmt: skip
PROMPT = [3, 1, 4, 1, 5, 9, 2]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("generate") / "run"
    model = LanguageModel(**LM)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))["params"]
    save_model(path, {"name": "lm", "lm": LM, "dtype": "float32"}, params)
    return path, model, params


def test_prints_the_continuation_and_speeds(workdir, capsys):
    """Sampled with `jax.random.key(--seed)` up to a stop token (the third token drawn), with a
    progress line per prefill piece, then the speeds."""
    path, model, params = workdir
    key = jax.random.key(5)
    prompt = jnp.asarray([PROMPT], jnp.int32)
    drawn = generate(model, params, prompt, max_new_tokens=6, temperature=1.0, key=key)
    drawn = [int(t) for t in drawn.tokens[0]]
    cut = drawn[: drawn.index(drawn[2]) + 1]
    argv = [f"--workdir={path}", "--prompt=" + " ".join(map(str, PROMPT)), f"--stop={drawn[2]}"]
    argv += ["--max_new_tokens=6", "--prefill_chunk=3", "--temperature=1", "--seed=5"]
    assert command.main(["generate", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["prefill 3/7 tokens", "prefill 6/7 tokens", "prefill 7/7 tokens"]
    assert lines[3] == " ".join(map(str, cut))
    assert lines[4].startswith("prefill: 7 tokens in ")
    assert f"decode: {len(cut) - 1} steps in " in lines[4] and "tokens/s" in lines[4]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt=1 x"], "prompt must be integer"),
        (["--prompt=1 99"], "outside"),
        (["--prompt=1", "--temperature=-1"], "temperature"),
        (["--prompt=1", "--stop=a"], "stop"),
        (["--prompt=1", "--max_new_tokens=0"], "max_new_tokens"),
        (["--prompt=1", "--no_such_flag"], "no_such_flag"),
        ([], "required"),
    ],
)
def test_errors_exit_1(workdir, capsys, args, message):
    path = workdir[0]
    assert command.main(["generate", f"--workdir={path}", *args]) == 1
    assert message in capsys.readouterr().err
