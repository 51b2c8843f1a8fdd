"""The fields every experiment config has (`python -m experiments.launch` reads exactly these),
the `runlocal` variant every config offers, and the parser of config args.

Run-level keys: `seed`, `total_steps`, `batch_size` (global, over all devices),
`checkpoint_every`, `keep_checkpoints`, `log_every`, `eval_every`, `eval_batches`, and `mesh.data`
(-1: every device left), `mesh.fsdp`, `mesh.seq` (1: no sequence parallelism; N: the time axis
split over N devices, `data.seq_len` a multiple of N). Blocks: `model` (see
`seqlab.train.models`), `optimizer` (`seqlab.train.optim.optimizer_config`), `data` (see
`seqlab.train.data`).
"""

import ml_collections

from seqlab.train.optim import optimizer_config

# `runlocal`: seconds on a CPU (with a width-16 model, `RUNLOCAL_MODEL`).
RUNLOCAL = dict(
    total_steps=8, batch_size=8, checkpoint_every=4, log_every=2, eval_every=4, eval_batches=1
)
RUNLOCAL_MODEL = dict(
    mamba2=dict(d_state=8, head_dim=8, chunk_size=8),
    gdn=dict(head_dim=8, chunk_size=16),  # 16: the Pallas kernels
)


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
            mamba=dict(d_state=16, conv_size=4, expand=2),
            mamba2=dict(d_state=64, head_dim=32, expand=2, chunk_size=64),
            gdn=dict(num_heads=2, head_dim=32, expand_v=2, chunk_size=64),
            attention=dict(num_heads=2),
            ode=dict(num_heads=2, time_features=16, hidden=64, lora_rank=0),
        )
    )


def base_config(**run) -> ml_collections.ConfigDict:
    """The run-level defaults, with those of `run` replaced, `mesh`, and the `optimizer` block
    (`optimizer_config()`); each config sets `model` and `data`."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.total_steps = 1000
    config.batch_size = 32
    config.checkpoint_every = 200
    config.keep_checkpoints = 3
    config.log_every = 20
    config.eval_every = 200
    config.eval_batches = 4
    unknown = sorted(set(run) - set(config))
    if unknown:
        raise ValueError(f"base_config: unknown run-level keys {unknown}")
    config.update(run)
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, seq=1))
    config.optimizer = optimizer_config()
    return config


def runlocal(config, *, warmup_steps: int = 2, **run) -> ml_collections.ConfigDict:
    """`config` (in place, and returned) made a seconds-on-a-CPU run: the run-level keys of
    `RUNLOCAL` (those of `run` replacing them), `optimizer.warmup_steps`, and the small mixer
    sizes of `RUNLOCAL_MODEL`. The model's width and depth are the caller's."""
    config.update({**RUNLOCAL, **run})
    config.optimizer.warmup_steps = warmup_steps
    for mixer, sizes in RUNLOCAL_MODEL.items():
        config.model[mixer].update(sizes)
    return config


def _default(spec_value):
    if isinstance(spec_value, tuple):
        return spec_value[0]
    return None if isinstance(spec_value, type) else spec_value


def _convert(key: str, value: str, kind: type):
    if kind is bool:
        if value not in ("true", "false"):
            raise ValueError(f"config arg {key} is a flag: give {key} or {key}=true|false")
        return value == "true"
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"config arg {key} must be {kind.__name__}, got {value!r}") from None


def parse_arg(arg: str | None, spec: dict) -> dict:
    """`"key=value,flag"` parsed against `spec`; every key of `spec` is in the result.

    `spec[key]` is the default, whose type converts the value (`int("3")`; a `bool` default
    makes a flag: `key` alone is True), or a tuple of allowed strings (default: the first), or a
    type (`int`: no default, None when absent). An unknown key, a bad value or a value of the
    wrong type raises `ValueError` naming the arg.
    """
    out = {key: _default(value) for key, value in spec.items()}
    for part in filter(None, (arg or "").split(",")):
        key, sep, value = part.partition("=")
        if key not in spec:
            raise ValueError(f"config arg {key!r} unknown; known: {sorted(spec)}")
        default = spec[key]
        if isinstance(default, tuple):
            if value not in default:
                raise ValueError(f"config arg {key} must be one of {default}, got {value!r}")
            out[key] = value
            continue
        kind = default if isinstance(default, type) else type(default)
        if not sep and kind is not bool:
            raise ValueError(f"config arg {key} needs a value: {key}=...")
        out[key] = _convert(key, value, kind) if sep else True
    return out
