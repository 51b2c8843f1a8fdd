"""A run's workdir as a model: `load_model(workdir)` rebuilds its model from `config.json` and
reads the parameters of its latest checkpoint; `save_model(workdir, model_block, params)` writes a
workdir holding only a model (its config and one checkpoint of `{"params": ...}` at step 0), which
`experiments.launch` can fine-tune from (`init_from`) and `load_model` reads back.
"""

import json
import pathlib

import jax
import ml_collections

from seqlab.modules.lm import param_shapes
from seqlab.train.checkpoint import Checkpointer, restore_params
from seqlab.train.data import vocab_size
from seqlab.train.metrics import CONFIG
from seqlab.train.models import LM, build_model

CHECKPOINTS = "checkpoints"
"""The folder of a workdir that holds its checkpoints."""


def model_config(workdir) -> ml_collections.ConfigDict:
    """The `config.json` of `workdir` as a ConfigDict (`ValueError` when there is none)."""
    path = pathlib.Path(workdir) / CONFIG
    if not path.is_file():
        raise ValueError(f"workdir {str(workdir)!r} has no {CONFIG}")
    config = ml_collections.ConfigDict(json.loads(path.read_text()))
    if "model" not in config:
        raise ValueError(f"{path} has no model block")
    return config


def load_model(workdir):
    """`(model, params)` of `workdir`: the model of its `config.json` (vocabulary from its data
    block, or `model.lm.vocab_size` for an `lm` model) and the parameters of its latest
    checkpoint. Raises `ValueError` when the workdir has no config or no checkpoint."""
    config = model_config(workdir)
    vocab = config.model.lm.vocab_size if config.model.name == LM else vocab_size(config.data)
    model = build_model(config.model, vocab)
    target = param_shapes(model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), target)
    params, kept = restore_params(pathlib.Path(workdir) / CHECKPOINTS, target)
    if kept:
        raise ValueError(f"the checkpoint of {workdir} lacks the parameters {kept}")
    return model, params


def save_model(workdir, model_block: dict, params, *, extra: dict | None = None) -> None:
    """Write a model-only workdir: `config.json` (`{"model": model_block, **extra}`) and the
    checkpoint `{"params": params}` at step 0. The workdir must not hold checkpoints yet."""
    workdir = pathlib.Path(workdir)
    if (workdir / CHECKPOINTS).exists():
        raise ValueError(f"workdir {str(workdir)!r} already has checkpoints")
    workdir.mkdir(parents=True, exist_ok=True)
    config = {"model": model_block, **(extra or {})}
    (workdir / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    checkpointer = Checkpointer(workdir / CHECKPOINTS, every=1, keep=1, async_save=False)
    checkpointer.save(0, {"params": params}, force=True)
    checkpointer.wait()
    checkpointer.close()
