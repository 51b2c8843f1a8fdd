"""Language modeling on bytes of text files, or on token ids from a `.npy` file.

Arg: comma-separated `data=bytes|tokens` (default bytes), `model=NAME` (a name of
`seqlab.train.models`: mamba, polar_mamba, gdn, mamba2, hybrid, attention, kda, gdn2, gdp, or a
preset of `seqlab.modules.lm.PRESETS` such as gdn-0.4b), `runlocal` (seconds on a CPU).

Bytes of text files (default: the Python sources of this repository's `seqlab/` package, a small
self-contained corpus; set your own with `--config.data.paths="('a.txt','b.txt')"`):

    python -m experiments.launch --config=experiments/configs/lm.py:model=gdn \
        --workdir=/tmp/lm-bytes

trains a 4-block Gated DeltaNet of width 128 for 2000 steps of 16 x 256 bytes; expected: the
training loss falls from log(256) ≈ 5.5 nats/byte towards 1-1.5 and the held-out
loss (`eval/loss`, the last 5% of the bytes) follows it (not measured at full length here).

Token ids (a 1-D integer `.npy`, opened as a memmap):

    python -m experiments.launch --config=experiments/configs/lm.py:data=tokens,model=gdn-0.4b \
        --workdir=/tmp/lm-tokens --config.data.path=/data/tokens.npy \
        --config.data.vocab_size=32000 --config.batch_size=64 --config.data.seq_len=2048

    python -m experiments.launch --config=experiments/configs/lm.py:runlocal --workdir=/tmp/l

runs a 1-block model of width 16 for 8 steps on the bytes (seconds; loss near log(256) ≈ 5.5).
"""

import pathlib

from experiments.configs.base import base_config, model_block, parse_arg, runlocal

_SOURCES = pathlib.Path(__file__).resolve().parents[2] / "seqlab"


def get_config(arg: str | None = None):
    """The run of `arg` (module docstring)."""
    args = parse_arg(arg, {"data": ("bytes", "tokens"), "model": "gdn", "runlocal": False})
    config = base_config(
        total_steps=2000, batch_size=16, checkpoint_every=500, log_every=50, eval_every=500
    )
    config.optimizer.update(learning_rate=2e-3, warmup_steps=100)
    config.model = model_block(args["model"], d_model=128, num_layers=4, d_ff=256)
    config.model.gdn.update(num_heads=2, head_dim=64, chunk_size=64)
    delta_family = dict(num_heads=2, head_dim=64, expand_v=2, chunk_size=64)  # as gdn's
    config.model.kda = dict(delta_family)
    config.model.gdn2 = dict(delta_family)
    config.model.gdp = dict(delta_family, num_householder=2)
    config.model.mamba2.update(d_state=64, head_dim=32, chunk_size=64)
    config.model.attention.num_heads = 4
    if args["data"] == "bytes":
        paths = tuple(sorted(str(p) for p in _SOURCES.rglob("*.py")))
        config.data = dict(name="bytes", seq_len=256, paths=paths, eval_fraction=0.05)
    else:
        config.data = dict(
            name="tokens", seq_len=256, path="", vocab_size=32000, eval_fraction=0.01
        )
    if args["runlocal"]:
        runlocal(config)
        config.model.update(d_model=16, num_layers=1, d_ff=32)
        for mixer in ("kda", "gdn2", "gdp"):  # the sizes runlocal gives Gated DeltaNet
            config.model[mixer].update(head_dim=8, chunk_size=16)
        config.data.seq_len = 32
    return config
