"""The fields every experiment config has (`python -m experiments.launch` reads exactly these).

Run-level keys: `seed`, `total_steps`, `batch_size` (global, over all devices),
`checkpoint_every`, `keep_checkpoints`, `log_every`, `eval_every`, `eval_batches`, and `mesh.data`
(-1: every device left), `mesh.fsdp`. Blocks: `model` (see `seqlab.train.models`), `optimizer`
(see `seqlab.train.optim`), `data` (see `seqlab.train.data`).
"""

import ml_collections


def model_block(name: str, *, d_model: int, num_layers: int, d_ff: int = 0):
    """A `model` block with every mixer's keyword-argument block present (so that
    `--config.model.mamba.d_state=...` and the like work on a locked config)."""
    return ml_collections.ConfigDict(
        dict(
            name=name,
            d_model=d_model,
            num_layers=num_layers,
            d_ff=d_ff,
            dtype="float32",
            mamba=dict(d_state=16, d_conv=4, expand=2),
            mamba2=dict(d_state=64, head_dim=32, expand=2, chunk_size=64),
            gdn=dict(num_heads=2, head_dim=32, expand_v=2, chunk_size=64),
            attention=dict(num_heads=2),
            ode=dict(num_heads=2, time_features=16, hidden=64, lora_rank=0),
        )
    )


def base_config() -> ml_collections.ConfigDict:
    """Defaults shared by the configs; each config sets `model`, `data` and sizes."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.total_steps = 1000
    config.batch_size = 32
    config.checkpoint_every = 200
    config.keep_checkpoints = 3
    config.log_every = 20
    config.eval_every = 200
    config.eval_batches = 4
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1))
    config.optimizer = ml_collections.ConfigDict(
        dict(
            name="adamw",
            learning_rate=1e-3,
            schedule="cosine",
            warmup_steps=50,
            final_fraction=0.1,
            weight_decay=0.1,
            b1=0.9,
            b2=0.98,
            eps=1e-8,
            grad_clip=1.0,
            trainable="",
        )
    )
    return config


def parse_arg(arg: str | None, allowed: dict[str, tuple]) -> dict[str, str | bool]:
    """`"key=value,flag"` -> `{"key": "value", "flag": True}`, each key in `allowed`
    (`allowed[key]`: its permitted values, or `()` for any)."""
    out: dict[str, str | bool] = {}
    for part in filter(None, (arg or "").split(",")):
        key, sep, value = part.partition("=")
        if key not in allowed:
            raise ValueError(f"config arg {key!r} unknown; known: {sorted(allowed)}")
        if sep and allowed[key] and value not in allowed[key]:
            raise ValueError(f"config arg {key} must be one of {allowed[key]}, got {value!r}")
        out[key] = value if sep else True
    return out
