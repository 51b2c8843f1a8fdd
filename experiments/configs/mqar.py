"""Multi-query associative recall (Zoology MQAR) with any seqlab mixer.

Arg: comma-separated `model=mamba|polar_mamba|gdn|mamba2|hybrid|attention` (default mamba),
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

    python -m experiments.launch --config=experiments/configs/mqar.py:runlocal --workdir=/tmp/m

runs a 1-block model of width 16 for 8 steps (seconds; loss near log(64) ≈ 4.2, accuracy near 0).
"""

from experiments.configs.base import base_config, model_block, parse_arg

MODELS = ("mamba", "polar_mamba", "gdn", "mamba2", "hybrid", "attention")


def get_config(arg: str | None = None):
    args = parse_arg(arg, {"model": MODELS, "layers": (), "runlocal": ()})
    name = args.get("model", "mamba")
    config = base_config()
    config.model = model_block(name, d_model=64, num_layers=int(args.get("layers", 2)))
    config.model.mamba.d_state = 16
    config.model.gdn.update(num_heads=2, head_dim=32, chunk_size=32)
    config.model.mamba2.update(d_state=16, head_dim=32, chunk_size=32)
    config.model.attention.num_heads = 2
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
        config.model.num_layers = 2 if name == "hybrid" else 1
        config.model.gdn.update(head_dim=8, chunk_size=16)  # 16: the Pallas kernels
        config.model.mamba2.update(d_state=8, head_dim=8, chunk_size=8)
        config.data.update(seq_len=32, vocab_size=64, num_kv_pairs=(2, 4), eval_num_kv_pairs=(4,))
        config.total_steps = 8
        config.batch_size = 8
        config.checkpoint_every = 4
        config.log_every = 2
        config.eval_every = 4
        config.eval_batches = 1
        config.optimizer.warmup_steps = 2
    return config
