"""Train and eval steps of a token model on batches `{"inputs", "targets"}` (`[B, T] int32`).

Loss: the mean over scored positions (`targets != IGNORE`) of the cross-entropy
`-log softmax(logits[b, t])[targets[b, t]]`; accuracy: the fraction of scored positions whose
argmax is the target. The logits are float32 (float64 for a float64 model, see `LanguageModel`).
"""

import functools
from collections.abc import Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from seqlab.train import mesh as mesh_lib
from seqlab.train.data import IGNORE

__all__ = [
    "TrainState",
    "create_state",
    "eval_step",
    "evaluate_batches",
    "jit_steps",
    "means",
    "scored_sums",
    "train_step",
]


def create_state(
    model: nn.Module, tx: optax.GradientTransformation, key: jax.Array, seq_len: int
) -> TrainState:
    """Parameters initialized with `key` on a `[1, seq_len]` batch, and the optimizer state."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(key, tokens)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def scored_sums(logits: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
    """Sums over scored positions: `loss_sum`, `correct`, `count`.

    `logits: [B, T, V]`, `targets: [B, T]` int with `IGNORE` where nothing is scored.
    """
    scored = targets != IGNORE
    safe = jnp.where(scored, targets, 0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    correct = (jnp.argmax(logits, axis=-1) == safe) & scored
    return {
        "loss_sum": jnp.sum(jnp.where(scored, nll, 0.0)),
        "correct": jnp.sum(correct).astype(logits.dtype),
        "count": jnp.sum(scored).astype(logits.dtype),
    }


def _means(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    count = jnp.maximum(sums["count"], 1)
    return {"loss": sums["loss_sum"] / count, "accuracy": sums["correct"] / count}


def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on `batch`; metrics `loss`, `accuracy`, `grad_norm`, `finite`.

    When the loss or a gradient is not finite the update is skipped (the returned state is the
    input state), so the caller can stop and the last good parameters are never overwritten.
    """

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        sums = scored_sums(logits, batch["targets"])
        return sums["loss_sum"] / jnp.maximum(sums["count"], 1), sums

    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updated = state.apply_gradients(grads=grads)
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, state)
    return new_state, {**_means(sums), "grad_norm": grad_norm, "finite": finite}


def eval_step(apply_fn: Callable, params, batch: dict) -> dict[str, jax.Array]:
    """`scored_sums` of the model on `batch` (sum over batches, then divide by `count`)."""
    return scored_sums(apply_fn({"params": params}, batch["inputs"]), batch["targets"])


def means(sums: dict) -> dict:
    """`loss` and `accuracy` from summed `loss_sum`, `correct`, `count`."""
    return {k: float(v) for k, v in _means(sums).items()}


def evaluate_batches(eval_fn: Callable, params, batches: Iterable[dict]) -> dict[str, float]:
    """`loss` and `accuracy` over every scored position of `batches` (at least one):
    `eval_fn(params, batch)` gives each batch's `scored_sums`, added up before dividing."""
    sums = [eval_fn(params, batch) for batch in batches]
    return means(jax.device_get(jax.tree.map(lambda *xs: sum(xs), *sums)))


def jit_steps(apply_fn: Callable, state_shardings, mesh) -> tuple[Callable, Callable]:
    """`(train_fn, eval_fn)`: `train_step` and `eval_step` jitted with the run's placement.

    `train_fn(state, batch) -> (state, metrics)` donates `state`; `eval_fn(params, batch) -> sums`.
    State as `state_shardings` (`seqlab.train.mesh.state_shardings`), batches split over every
    device, metrics replicated. Trace and call them under `jax.set_mesh(mesh)`, so that the ops
    see the mesh (the Pallas kernels then run per shard).
    """
    batch = mesh_lib.batch_sharding(mesh)
    repl = mesh_lib.replicated(mesh)
    train_fn = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch),
        out_shardings=(state_shardings, repl),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        functools.partial(eval_step, apply_fn),
        in_shardings=(state_shardings.params, batch),
        out_shardings=repl,
    )
    return train_fn, eval_fn
