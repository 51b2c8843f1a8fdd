"""Multi-query associative recall (Zoology MQAR) with any seqlab mixer.

Arg: comma-separated `model=mamba|polar_mamba|gdn|mamba2|hybrid|attention|kda|gdn2|gdp` (default
mamba; kda: Kimi Delta Attention, gdn2: Gated DeltaNet-2, gdp: Gated DeltaProduct),
`layers=N` (default 2), `runlocal` (a few seconds on a CPU).

    python -m experiments.launch --config=experiments/configs/mqar.py:model=polar_mamba,layers=2 \
        --workdir=/tmp/mqar-polar-2

trains a 2-block model of width 64 for 1000 steps of 32 sequences of 32 tokens over a vocabulary
of 64, cycling through 2/4/8 key-value pairs by step, and evaluates the recall accuracy at each
count on 8 held-out batches (`eval/kv{N}/accuracy` in metrics.jsonl). Expected (measured on 2
shared CPU cores, see experiments/RESULTS.md): 6-7 minutes for 2 blocks; final accuracy at
2/4/8 pairs with seed 0 about 92/79/53 % for mamba, 91/76/51 % for polar_mamba, 99/98/97 % for
mamba2 and 100/100/100 % for gdn. Mamba-1 runs depend strongly on the seed: with seed 1 both
mamba and polar_mamba stay at about 45/26/15 %. `experiments/mqar_study.py` runs the table.
The delta-rule family at Gated DeltaNet's head sizes, seed 0 (measured once each on 2 CPU cores
shared with other jobs, 5.5-12 minutes): 100/99.8/99.8 % for kda, 100/99.8/100 % for gdn2 and
100/99.8/99.8 % for gdp.

    python -m experiments.launch --config=experiments/configs/mqar.py:runlocal --workdir=/tmp/m

runs a 1-block model of width 16 for 8 steps (seconds; loss near log(64) ≈ 4.2, accuracy near 0).
"""

from experiments.configs.base import base_config, model_block, parse_arg, runlocal

MODELS = ("mamba", "polar_mamba", "gdn", "mamba2", "hybrid", "attention", "kda", "gdn2", "gdp")
# The delta-rule family at Gated DeltaNet's head sizes (2 heads, K = 32, V = 64).
_DELTA_FAMILY = dict(num_heads=2, head_dim=32, expand_v=2, chunk_size=32)


def get_config(arg: str | None = None):
    """The run of `arg` (module docstring)."""
    args = parse_arg(arg, {"model": MODELS, "layers": 2, "runlocal": False})
    name = args["model"]
    config = base_config(checkpoint_every=250, log_every=25, eval_every=250, eval_batches=8)
    config.optimizer.update(learning_rate=1e-2, warmup_steps=100)
    config.model = model_block(name, d_model=64, num_layers=args["layers"])
    config.model.gdn.update(num_heads=2, head_dim=32, chunk_size=32)
    config.model.kda = dict(_DELTA_FAMILY)
    config.model.gdn2 = dict(_DELTA_FAMILY)
    config.model.gdp = dict(_DELTA_FAMILY, num_householder=2)
    config.model.mamba2.update(d_state=16, head_dim=32, chunk_size=32)
    config.data = dict(
        name="mqar",
        seq_len=32,
        vocab_size=64,
        num_kv_pairs=(2, 4, 8),
        eval_num_kv_pairs=(2, 4, 8),
        power_a=0.01,
    )
    if args["runlocal"]:
        runlocal(config)
        config.model.update(d_model=16, num_layers=2 if name == "hybrid" else 1)
        for mixer in ("kda", "gdn2", "gdp"):  # the sizes runlocal gives Gated DeltaNet
            config.model[mixer].update(head_dim=8, chunk_size=16)
        config.data.update(num_kv_pairs=(2, 4), eval_num_kv_pairs=(4,))
    return config
