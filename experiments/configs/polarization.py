"""Polarized vs default Mamba on multi-query associative recall at the size of Table 2's trend
(Wang et al., arXiv 2501.00658): sequences of 256 tokens, 16/32/64 key-value pairs, 2 and 4
layers, three seeds per model.

Arg: comma-separated `model=mamba|polar_mamba` (default mamba; `polar_mamba` is `polarize=(1, 1)`:
one state channel with `A = 0`, decay exactly 1, and one with `A = -100` per inner channel, on top
of the 16 learnable ones), `layers=N` (default 2), `runlocal` (seconds on a CPU).

    for SEED in 0 1 2; do for M in mamba polar_mamba; do for L in 2 4; do
      python -m experiments.launch --config=experiments/configs/polarization.py:model=$M,layers=$L \
          --workdir=runs/polarization/$M-$L-$SEED --config.seed=$SEED
    done; done; done

trains a Mamba language model of width 128 (no MLP, d_state 16) over a vocabulary of 8192 (as the
authors' Zoology runs) for 5000 steps of 64 sequences of 256 tokens, cycling through 16, 32 and 64
key-value pairs by step, with AdamW (lr 1e-3, 200 warmup steps, cosine decay; the paper's
optimizer and learning rate), and evaluates the recall accuracy at each count on 8 held-out
batches (`eval/kv{N}/accuracy` in metrics.jsonl). Not run here: it is a GPU job (on the 2-core CPU
of this repository's machine one run would take many hours). The paper's Table 2 (256 pairs, test
length 1024): default 36.0 % at 2 layers and 33.5 % at 4, polarized 54.7 % and 81.6 %; the trend
to reproduce is that polarization helps at both depths and more at 4 layers. The same comparison
at the largest size the CPU budget of `python -m theory` allows is the claim
`mqar_polarization_table2` of `python -m theory.ssm_bottleneck` (`--full`: this size), where its
decision rule (paired gains over seeds) is stated; earlier MQAR runs at 32 tokens did not
reproduce the gain (experiments/RESULTS.md).

    python -m experiments.launch \
        --config=experiments/configs/polarization.py:model=polar_mamba,runlocal \
        --workdir=/tmp/polar-local

runs a 1-layer model of width 16 on sequences of 64 tokens with 4/8 pairs for 8 steps (seconds;
accuracy near chance).
"""

from experiments.configs.base import base_config, model_block, parse_arg, runlocal

MODELS = ("mamba", "polar_mamba")


def get_config(arg: str | None = None):
    """The run of `arg` (module docstring)."""
    args = parse_arg(arg, {"model": MODELS, "layers": 2, "runlocal": False})
    config = base_config(
        total_steps=5000,
        batch_size=64,
        checkpoint_every=500,
        log_every=50,
        eval_every=500,
        eval_batches=8,
    )
    config.optimizer.update(learning_rate=1e-3, warmup_steps=200)
    config.model = model_block(args["model"], d_model=128, num_layers=args["layers"])
    config.data = dict(
        name="mqar",
        seq_len=256,
        vocab_size=8192,
        num_kv_pairs=(16, 32, 64),
        eval_num_kv_pairs=(16, 32, 64),
        power_a=0.01,
    )
    if args["runlocal"]:
        runlocal(config)
        config.model.update(d_model=16, num_layers=1)
        config.data.update(seq_len=64, vocab_size=64, num_kv_pairs=(4, 8), eval_num_kv_pairs=(8,))
    return config
