"""Small ODE transformers trained for the claims, with seqlab's training pieces (data, optimizer,
train and eval steps), cached so that the claims of one run share one model.

The task is multi-query associative recall (`seqlab.train.data`, `mqar`): scored positions are
the queries, and a uniform guess has loss `log V`. The training seed is fixed (`Setup.seed`), not
drawn from a claim's key, so that every claim measures the same trained model.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.modules.ode_transformer import ODETransformer
from seqlab.train import Trainer, make_datasets, make_mesh, make_optimizer, optimizer_config
from seqlab.train.data import Dataset
from seqlab.train.step import eval_step, evaluate_batches
from theory import common

_eval_step = jax.jit(eval_step, static_argnums=0)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Sizes of the task, the model and its training."""

    vocab_size: int
    seq_len: int
    num_kv_pairs: int
    d_model: int
    num_heads: int
    d_ff: int
    num_steps: int  # Euler steps of the trained model (N)
    batch_size: int
    train_steps: int
    learning_rate: float
    eval_batches: int
    seed: int = 0


# The fields in order: vocab_size, seq_len, num_kv_pairs, d_model, num_heads, d_ff, num_steps,
# batch_size, train_steps, learning_rate, eval_batches.
QUICK = Setup(16, 16, 2, 32, 2, 64, 4, 32, 300, 3e-3, 4)
# At lr 3e-3 for 1500 steps the paper size did not train (measured: loss 2.33 of log V = 3.47,
# QK eigenvalues grown from 0.4 to ~300; likely because Adam moves every parameter by up to ~lr
# per step and each W(t) sums `hidden` of them); at lr 1e-3 it trains (loss 1.39).
FULL = Setup(32, 32, 4, 64, 2, 128, 8, 32, 1500, 1e-3, 4)


@dataclasses.dataclass(frozen=True)
class Trained:
    """A trained model and what it was trained on. `losses: [train_steps]` training losses."""

    setup: Setup
    model: ODETransformer
    init_params: dict
    params: dict
    losses: np.ndarray
    train_data: Dataset
    eval_data: tuple[dict, ...]  # fixed evaluation batches {"inputs", "targets"}: [B, T]

    @property
    def uniform_loss(self) -> float:
        """The loss of a uniform guess over the vocabulary, `log V`."""
        return float(np.log(self.setup.vocab_size))


def _data(setup: Setup):
    """The `mqar` data block of `setup` (one kv count, trained and evaluated)."""
    return common.mqar_data(
        setup.seq_len, setup.vocab_size, (setup.num_kv_pairs,), setup.num_kv_pairs
    )


def optimizer(learning_rate: float, total_steps: int):
    """Adam with a 10% linear warmup and cosine decay to 10%, global-norm clipping at 1."""
    block = optimizer_config(
        name="adam",
        learning_rate=learning_rate,
        warmup_steps=max(1, total_steps // 10),
        weight_decay=0.0,
    )
    return make_optimizer(block, total_steps)


def fit(model, params, dataset, *, steps: int, learning_rate: float, first_batch: int = 0):
    """`steps` updates of `model` (its own `num_steps`) from `params` (left intact) on batches
    `first_batch ...` of `dataset`, with a fresh `optimizer`, by `seqlab.train.Trainer`'s train
    step on one device. Returns `(params, losses: [steps])`."""
    seq_len = dataset.batch(first_batch)["inputs"].shape[1]
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    trainer = Trainer(model, optimizer(learning_rate, steps), dataset, {}, mesh, seq_len=seq_len)
    state = trainer.state_from(params)
    losses = []
    for i in range(steps):
        state, metrics = trainer.step(state, first_batch + i)
        losses.append(metrics["loss"])
    return state.params, np.asarray(losses, np.float64)


def eval_metrics(model, params, batches, num_steps: int) -> dict[str, float]:
    """Mean `loss` and `accuracy` over the scored positions of `batches` at `num_steps` Euler
    steps."""
    apply_fn = model.clone(num_steps=num_steps).apply
    return evaluate_batches(functools.partial(_eval_step, apply_fn), params, batches)


def eval_loss(model, params, batches, num_steps: int) -> float:
    """Mean loss over the scored positions of `batches` at `num_steps` Euler steps."""
    return eval_metrics(model, params, batches, num_steps)["loss"]


@functools.cache
def trained(setup: Setup) -> Trained:
    """The model of `setup` at init and after `setup.train_steps` Adam steps (cached)."""
    train_data, evals, vocab = make_datasets(
        _data(setup), batch_size=setup.batch_size, seed=setup.seed
    )
    model = ODETransformer(
        vocab_size=vocab,
        d_model=setup.d_model,
        num_heads=setup.num_heads,
        d_ff=setup.d_ff,
        num_steps=setup.num_steps,
    )
    tokens = jnp.zeros((1, setup.seq_len), jnp.int32)
    init_params = jax.jit(model.init)(jax.random.key(setup.seed), tokens)["params"]
    params, losses = fit(
        model,
        init_params,
        train_data,
        steps=setup.train_steps,
        learning_rate=setup.learning_rate,
    )
    (eval_data,) = evals.values()
    batches = tuple(eval_data.batch(i) for i in range(setup.eval_batches))
    return Trained(setup, model, init_params, params, losses, train_data, batches)


def setup_for(full: bool) -> Setup:
    """`FULL` at paper size, `QUICK` otherwise."""
    return FULL if full else QUICK
