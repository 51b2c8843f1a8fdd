"""The trained language model of the `attention` claim: the `lm` experiment config
(`experiments/configs/lm.py` with `model=attention`: a stack of causal softmax-attention blocks on
the bytes of seqlab's own Python sources) at the sizes of a `Setup`, trained with seqlab's training
pieces (`make_datasets`, `build_model`, `make_optimizer`, `create_state`, `train_step`). The
result is cached, so one process trains each setup once.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from experiments.configs import lm
from seqlab.train import build_model, make_datasets, make_optimizer
from seqlab.train.step import create_state, train_step


@dataclasses.dataclass(frozen=True)
class Setup:
    """Training sizes; a `None` model size keeps the `lm` config's (width 128, 4 blocks, MLP 256,
    4 heads)."""

    seq_len: int
    batch_size: int
    steps: int
    d_model: int | None = None
    num_layers: int | None = None
    d_ff: int | None = None
    seed: int = 0


def config(setup: Setup):
    """The `lm` config (`model=attention`, bytes) with the sizes of `setup`; the warmup is the
    config's or a fifth of the steps, whichever is shorter."""
    c = lm.get_config("model=attention")
    c.seed, c.total_steps, c.batch_size = setup.seed, setup.steps, setup.batch_size
    c.data.seq_len = setup.seq_len
    for field in ("d_model", "num_layers", "d_ff"):
        if getattr(setup, field) is not None:
            c.model[field] = getattr(setup, field)
    c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, setup.steps // 5)
    return c


@functools.cache
def trained(setup: Setup):
    """`(model, params, train_loss: [steps], held_out: [seq_len] int32)`: the model trained for
    `setup.steps` steps, its training losses, and one window of held-out bytes (the config's
    evaluation split) to measure it on. Cached per setup."""
    c = config(setup)
    train, evals, vocab = make_datasets(c.data, batch_size=c.batch_size, seed=c.seed)
    model = build_model(c.model, vocab)
    tx = make_optimizer(c.optimizer, c.total_steps)
    state = create_state(model, tx, jax.random.key(c.seed), c.data.seq_len)
    step = jax.jit(train_step, donate_argnums=0)
    losses = []
    for i in range(c.total_steps):
        state, metrics = step(state, train.batch(i))
        losses.append(metrics["loss"])
    held_out = evals[""].batch(0)["inputs"][0]
    return model, state.params, np.asarray(jax.device_get(jnp.stack(losses)), np.float64), held_out
