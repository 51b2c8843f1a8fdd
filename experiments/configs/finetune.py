"""Fine-tune a model-only workdir: a Hugging Face checkpoint converted by
`python -m experiments.convert`, or any run's workdir.

Arg: comma-separated `from=WORKDIR` (required: its `config.json` gives the model, its latest
checkpoint the initial parameters, `init_from`), `data=tokens|bytes` (default tokens: a 1-D integer
`.npy` of token ids in the model's vocabulary, `--config.data.path=...`; bytes: the bytes of text
files, for models with a 256-token vocabulary), `runlocal` (seconds on a CPU; without `from`, a
fresh byte-level Mamba of width 16 instead of a source).

    python -m experiments.convert --from ~/hf/mamba-130m-hf --to /tmp/mamba-130m
    python -m experiments.launch --config=experiments/configs/finetune.py:from=/tmp/mamba-130m \
        --workdir=/tmp/mamba-130m-ft --config.data.path=/data/gpt-neox-tokens.npy

trains from the converted parameters (step 0, a fresh AdamW at learning rate 1e-4 with 50 warmup
steps) for 1000 steps of 8 x 512 tokens. Relaunching resumes from the run's own checkpoints;
`python -m experiments.convert --from /tmp/mamba-130m-ft --to-hf OUT` writes the result back
(the model block of the fine-tuning run is the converted one).
"""

from experiments.configs import lm
from experiments.configs.base import RUNLOCAL, base_config, parse_arg
from seqlab.train.workdir import model_config

_RUNLOCAL_LM = dict(vocab_size=256, d_model=16, pattern="m", mamba=dict(d_state=4))


def get_config(arg: str | None = None):
    """The fine-tuning run of `arg` (module docstring)."""
    args = parse_arg(arg, {"from": "", "data": ("tokens", "bytes"), "runlocal": False})
    if not args["from"] and not args["runlocal"]:
        raise ValueError("config arg from=WORKDIR is required (a workdir with a checkpoint)")
    config = base_config(
        total_steps=1000, batch_size=8, checkpoint_every=200, log_every=10, eval_every=200
    )
    config.init_from = args["from"]
    if args["from"]:
        config.model = model_config(args["from"]).model
    else:  # runlocal without a source: a fresh byte-level Mamba, the same machinery
        config.model = dict(name="lm", lm=_RUNLOCAL_LM, dtype="float32")
        args["data"] = "bytes"
    config.optimizer.update(learning_rate=1e-4, warmup_steps=50)
    config.data = lm.get_config(f"data={args['data']}").data
    config.data.seq_len = 512
    if args["data"] == "tokens" and "lm" in config.model:
        config.data.vocab_size = config.model.lm.vocab_size
    if args["runlocal"]:
        config.update(RUNLOCAL)
        config.optimizer.warmup_steps = 2
        config.data.seq_len = 32
    return config
