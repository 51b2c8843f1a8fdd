"""Train and eval steps of a token model on batches `{"inputs", "targets"}` (`[B, T] int32`).

Loss: the mean over scored positions (`targets != IGNORE`) of the cross-entropy
`-log softmax(logits[b, t])[targets[b, t]]`; accuracy: the fraction of scored positions whose
argmax is the target. The logits are float32 (float64 for a float64 model, see `LanguageModel`).

Sequence parallelism: on a mesh whose `seq` axis is above 1 (`seqlab.train.mesh`), `batch_sums`
runs the model, cloned with `seq_axis="seq"`, inside `jax.shard_map` over `seq`: each device holds
a block of sequences (over `data` and `fsdp`) and a piece of their time axis (over `seq`), the
parameters replicated; the mixers exchange what crosses the pieces (`seqlab.ops.sequence_parallel`)
and the scored sums are `psum`med over `seq` (and summed over the batch), so the loss and its
gradients are those of the unsharded model.
"""

import functools
from collections.abc import Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from seqlab.train import mesh as mesh_lib
from seqlab.train.data import IGNORE

__all__ = [
    "TrainState",
    "batch_sums",
    "check_sequence_parallel",
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


def train_step(
    state: TrainState, batch: dict, sums_fn: Callable | None = None
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on `batch`; metrics `loss`, `accuracy`, `grad_norm`, `finite`.

    `sums_fn(params, batch)`: the `scored_sums` of the model on `batch` (None: `eval_step` of
    `state.apply_fn`; `batch_sums` for a mesh that splits the time axis). When the loss or a
    gradient is not finite the update is skipped (the returned state is the input state), so the
    caller can stop and the last good parameters are never overwritten.
    """
    sums_fn = functools.partial(eval_step, state.apply_fn) if sums_fn is None else sums_fn

    def loss_fn(params):
        sums = sums_fn(params, batch)
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


def check_sequence_parallel(model: nn.Module, mesh: Mesh, seq_len: int) -> None:
    """On a mesh that splits the time axis (`seq > 1`): `seq_len` must be a multiple of `seq`, and
    `model` must run on a piece of the sequence (a `seq_axis` field, as `LanguageModel`)."""
    mesh_lib.check_seq_len(seq_len, mesh)
    if mesh.shape["seq"] > 1 and not hasattr(model, "seq_axis"):
        raise ValueError(
            f"mesh.seq = {mesh.shape['seq']} needs a model with a seq_axis field (LanguageModel), "
            f"got {type(model).__name__}"
        )


# Inside the sequence-parallel loss: time split over "seq"; the batch axis stays with the compiler.
TIME_SPEC = P(None, "seq")


def batch_sums(model: nn.Module, mesh: Mesh) -> Callable:
    """`sums_fn(params, batch) -> scored_sums` of `model` on batches placed on `mesh`.

    With `seq = 1`, `eval_step` of `model.apply`. With `seq > 1` (module docstring), the model
    cloned with `seq_axis="seq"` under `jax.shard_map` manual over the mesh axis `seq` only:
    parameters replicated (`P()`), `inputs` and `targets: [B, T]` split along T (`P(None,
    "seq")`), the local sums `psum`med over `seq`. The batch axis stays split over `data` and
    `fsdp` by the compiler (auto axes), which sums the scored positions of every sequence, so
    `loss_sum` and `count` are those of the whole batch and the mean loss and its gradients the
    unsharded model's; the ops keep the `data`/`fsdp` axes for their own per-shard kernels
    (`seqlab.kernels`). T must be a multiple of `seq`.
    """
    if mesh.shape["seq"] == 1:
        return functools.partial(eval_step, model.apply)

    def sums_fn(params, batch):
        check_sequence_parallel(model, mesh, batch["inputs"].shape[1])
        local_model = model.clone(seq_axis="seq")

        def local_sums(params, batch):
            sums = eval_step(local_model.apply, params, batch)
            return jax.tree.map(lambda s: lax.psum(s, "seq"), sums)

        # check_vma=False: the TPU kernels' backward (a `jax.vjp` traced inside the Pallas
        # kernel) mixes values typed varying over `seq` with untyped kernel-local ones, which a
        # checked shard_map rejects; the sums leave replicated by their `psum`.
        sharded = jax.shard_map(
            local_sums,
            mesh=mesh,
            in_specs=(P(), TIME_SPEC),
            out_specs=P(),
            axis_names={"seq"},
            check_vma=False,
        )
        return sharded(params, batch)

    return sums_fn


def means(sums: dict) -> dict:
    """`loss` and `accuracy` from summed `loss_sum`, `correct`, `count`."""
    return {k: float(v) for k, v in _means(sums).items()}


def evaluate_batches(eval_fn: Callable, params, batches: Iterable[dict]) -> dict[str, float]:
    """`loss` and `accuracy` over every scored position of `batches` (at least one):
    `eval_fn(params, batch)` gives each batch's `scored_sums`, added up before dividing."""
    sums = [eval_fn(params, batch) for batch in batches]
    return means(jax.device_get(jax.tree.map(lambda *xs: sum(xs), *sums)))


def jit_steps(
    apply_fn: Callable, state_shardings, mesh, *, sums_fn: Callable | None = None
) -> tuple[Callable, Callable]:
    """`(train_fn, eval_fn)`: `train_step` and `eval_step` jitted with the run's placement.

    `train_fn(state, batch) -> (state, metrics)` donates `state`; `eval_fn(params, batch) -> sums`.
    Both score batches with `sums_fn(params, batch)` (None: `eval_step` of `apply_fn`; a mesh
    with `seq > 1` needs `batch_sums(model, mesh)`). State as `state_shardings`
    (`seqlab.train.mesh.state_shardings`), batches as `seqlab.train.mesh.batch_sharding`, metrics
    replicated. Trace and call them under `jax.set_mesh(mesh)`, so that the ops see the mesh (the
    Pallas kernels then run per shard).
    """
    sums_fn = functools.partial(eval_step, apply_fn) if sums_fn is None else sums_fn
    batch = mesh_lib.batch_sharding(mesh)
    repl = mesh_lib.replicated(mesh)
    train_fn = jax.jit(
        functools.partial(train_step, sums_fn=sums_fn),
        in_shardings=(state_shardings, batch),
        out_shardings=(state_shardings, repl),
        donate_argnums=0,
    )
    eval_fn = jax.jit(sums_fn, in_shardings=(state_shardings.params, batch), out_shardings=repl)
    return train_fn, eval_fn
