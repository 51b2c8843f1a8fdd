"""Mamba with token reordering (Vo et al., arXiv 2410.03292, Refinement 2) on multi-query
associative recall: every block sorts its post-conv tokens (and the gate) by the importance score
`w^T (S_delta u + b_dt)` with SoftSort before the scan and permutes the output back
(`Mamba(reorder=True)`); `off` is the same Mamba without it.

Arg: comma-separated `reorder=on|off` (default on), `tau=T` (SoftSort temperature, default 0.1),
`hard` (straight-through permutation), `runlocal` (seconds on a CPU).

    for SEED in 0 1 2; do for R in on off; do
      python -m experiments.launch --config=experiments/configs/reorder.py:reorder=$R \
          --workdir=/tmp/reorder-$R-$SEED --config.seed=$SEED
    done; done

trains a 2-layer Mamba of width 64 (d_state 16) for 1000 steps on MQAR with the setup of
`mqar.py` (sequences of 32 tokens, vocabulary 64, 2/4/8 key-value pairs, AdamW lr 1e-2) and
evaluates the recall accuracy at each count (`eval/kv{N}/accuracy` in metrics.jsonl). The paper
predicts reordering to improve accuracy. Reordering makes the mixer non-causal, which MQAR
tolerates: a query's value appears only in the key-value prefix. The decided, smaller version is
the claim `refinement2_reorder` of `python -m theory.mamba_dynamics --full`.

    python -m experiments.launch --config=experiments/configs/reorder.py:runlocal \
        --workdir=/tmp/reorder-local

runs `mqar.py:runlocal` (a 1-layer model of width 16, 8 steps) with reordering.
"""

from experiments.configs import mqar
from experiments.configs.base import parse_arg


def get_config(arg: str | None = None):
    """`mqar.py`'s Mamba run with the reordering of `arg` (module docstring)."""
    args = parse_arg(arg, {"reorder": ("on", "off"), "tau": 0.1, "hard": False, "runlocal": False})
    if not args["tau"] > 0:
        raise ValueError(f"config arg tau must be > 0, got {args['tau']}")
    config = mqar.get_config("model=mamba" + (",runlocal" if args["runlocal"] else ""))
    if args["reorder"] == "on":
        config.model.mamba.update(reorder=True, reorder_tau=args["tau"], reorder_hard=args["hard"])
    return config
