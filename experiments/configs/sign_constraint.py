"""Sign-constrained Mamba (Vo et al., arXiv 2410.03292, Refinement 1) on multi-query associative
recall: `S_B = diag(lambda) S_C`, so the token-interaction matrix `M = S_C^T S_B` is positive
semidefinite (`pos`), negative semidefinite (`neg`) or indefinite (`mixed`); `none` is the
unconstrained Mamba.

Arg: comma-separated `sign=pos|neg|mixed|none` (default pos), `runlocal` (seconds on a CPU).

    for SEED in 0 1 2; do for S in pos neg none; do
      python -m experiments.launch --config=experiments/configs/sign_constraint.py:sign=$S \
          --workdir=/tmp/sign-$S-$SEED --config.seed=$SEED
    done; done

trains a 2-layer Mamba of width 64 (d_state 16) for 1000 steps on MQAR with the setup of
`mqar.py` (sequences of 32 tokens, vocabulary 64, 2/4/8 key-value pairs, AdamW lr 1e-2) and
evaluates the recall accuracy at each count (`eval/kv{N}/accuracy` in metrics.jsonl); about 2.5
CPU-minutes per run. The paper predicts `neg` (tokens converge to zero in the continuous-time
limit) to train worst and `pos` to improve on the unconstrained Mamba; Mamba-1 on MQAR depends
strongly on the seed, so compare three seeds per sign. Results: experiments/RESULTS.md. The
decided, smaller version is the claim `refinement1_sign_constraint` of
`python -m theory.mamba_dynamics --full`.

    python -m experiments.launch --config=experiments/configs/sign_constraint.py:runlocal \
        --workdir=/tmp/sign-local

runs `mqar.py:runlocal` (a 1-layer model of width 16, 8 steps) with the constraint.
"""

from experiments.configs import mqar
from experiments.configs.base import parse_arg

SIGNS = ("pos", "neg", "mixed", "none")


def get_config(arg: str | None = None):
    """`mqar.py`'s Mamba run with the sign constraint of `arg` (module docstring)."""
    args = parse_arg(arg, {"sign": SIGNS, "runlocal": False})
    config = mqar.get_config("model=mamba" + (",runlocal" if args["runlocal"] else ""))
    if args["sign"] != "none":
        config.model.mamba.sign_constraint = args["sign"]
    return config
