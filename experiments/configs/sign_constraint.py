"""Sign-constrained Mamba (Vo et al., arXiv 2410.03292, Refinement 1) on multi-query associative
recall: `S_B = diag(lambda) S_C`, so the token-interaction matrix `M = S_C^T S_B` is positive
semidefinite (`pos`), negative semidefinite (`neg`) or indefinite (`mixed`); `none` is the
unconstrained Mamba.

Arg: comma-separated `sign=pos|neg|mixed|none` (default pos), `runlocal` (seconds on a CPU).

    python -m experiments.launch --config=experiments/configs/sign_constraint.py:sign=pos \
        --workdir=/tmp/sign-pos

trains a 2-layer Mamba of width 64 (d_state 16) for 1000 steps on MQAR with the setup of
`mqar.py` (sequences of 32 tokens, vocabulary 64, 2/4/8 key-value pairs, AdamW lr 1e-2) and
evaluates the recall accuracy at each count (`eval/kv{N}/accuracy` in metrics.jsonl); about 2.5
CPU-minutes per sign. The paper predicts `neg` (tokens converge to zero in the continuous-time
limit) to train worst. Results: experiments/RESULTS.md.

    python -m experiments.launch --config=experiments/configs/sign_constraint.py:runlocal \
        --workdir=/tmp/sign-local

runs a 1-layer model of width 16 for 8 steps.
"""

from experiments.configs.base import base_config, model_block, parse_arg

SIGNS = ("pos", "neg", "mixed", "none")


def get_config(arg: str | None = None):
    args = parse_arg(arg, {"sign": SIGNS, "runlocal": ()})
    sign = args.get("sign", "pos")
    config = base_config()
    config.model = model_block("mamba", d_model=64, num_layers=2)
    config.model.mamba.d_state = 16
    if sign != "none":
        config.model.mamba.sign_constraint = sign
    config.data = dict(
        name="mqar",
        seq_len=32,
        vocab_size=64,
        num_kv_pairs=(2, 4, 8),
        eval_num_kv_pairs=(2, 4, 8),
        power_a=0.01,
    )
    config.total_steps = 1000
    config.batch_size = 32
    config.checkpoint_every = 250
    config.log_every = 25
    config.eval_every = 250
    config.eval_batches = 8
    config.optimizer.learning_rate = 1e-2
    config.optimizer.warmup_steps = 100

    if args.get("runlocal"):
        config.model.d_model = 16
        config.model.num_layers = 1
        config.model.mamba.d_state = 4
        config.data.update(num_kv_pairs=(2, 4), eval_num_kv_pairs=(4,))
        config.total_steps = 8
        config.batch_size = 8
        config.checkpoint_every = 4
        config.log_every = 2
        config.eval_every = 4
        config.eval_batches = 1
        config.optimizer.warmup_steps = 2
    return config
