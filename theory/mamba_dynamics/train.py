"""Small Mamba language models trained for the refinement claims (Vo et al., Refinement 1: the
sign-constrained `S_B = diag(lambda) S_C`; Refinement 2: token reordering), with seqlab's training
pieces: the model registry (`build_model`), the task data (`make_datasets`), the optimizer and the
train and eval steps of `seqlab.train`.

The seeds of one arm train together: `train_step` is vmapped over the seeds and scanned over the
steps in one compiled function (one compile per arm: at these sizes compiling costs more than
training), each seed with its own initialization and its own data stream
(`make_datasets(..., seed=seed)`), so the result per seed is that of the seed trained alone.
Results are cached, so the claims of one run share the baseline arm.

The task is multi-query associative recall (`mqar`): scored positions are the queries and a guess
among the `V/2` values has accuracy `2/V`. A bidirectional mixer does not see the answer early:
the value of a query's key appears only in the key-value prefix, so token reordering (which makes
the mixer non-causal) cannot read the target.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from seqlab.train import build_model, make_datasets, make_optimizer, optimizer_config
from seqlab.train.step import create_state, eval_step, train_step
from theory import common

# The arms: keyword arguments of `seqlab.modules.mamba.Mamba` on top of the setup's `d_state`.
ARMS = {
    "none": {},
    "pos": {"sign_constraint": "pos"},
    "neg": {"sign_constraint": "neg"},
    "reorder": {"reorder": True},
}


@dataclasses.dataclass(frozen=True)
class Setup:
    """Sizes of the task, the model and its training; `seeds` train each arm."""

    seq_len: int
    vocab_size: int
    num_kv_pairs: int
    d_model: int
    num_layers: int
    d_state: int
    batch_size: int
    train_steps: int
    learning_rate: float
    eval_batches: int
    seeds: tuple[int, ...] = (0, 1, 2)

    @property
    def chance(self) -> float:
        """The accuracy of a uniform guess among the values, `2 / V`."""
        return 2.0 / self.vocab_size


def _data(setup: Setup):
    """The `mqar` data block of `setup` (one kv count, trained and evaluated)."""
    return common.mqar_data(
        setup.seq_len, setup.vocab_size, (setup.num_kv_pairs,), setup.num_kv_pairs
    )


def model_block(setup: Setup, arm: str) -> ml_collections.ConfigDict:
    """The `model` block of `seqlab.train.build_model`: a Mamba stack of the arm."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {sorted(ARMS)}, got {arm!r}")
    return ml_collections.ConfigDict(
        dict(
            name="mamba",
            d_model=setup.d_model,
            num_layers=setup.num_layers,
            d_ff=0,
            dtype="float32",
            mamba=dict(d_state=setup.d_state, **ARMS[arm]),
            mamba2={},
            gdn={},
            attention={},
        )
    )


def _stack(batches: list[dict]) -> dict:
    """Batches `{"inputs", "targets"}` with equal shapes -> one batch with a leading axis."""
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


@functools.cache
def train_arm(setup: Setup, arm: str) -> dict:
    """Train the arm's model once per seed of `setup`, the seeds vmapped and the steps scanned in
    one compiled function (`seqlab.train.step.train_step` on each seed's batch of each step).

    Returns `{"accuracy": [S], "loss": [S]}` on the first `eval_batches` evaluation batches of each
    seed's stream (all scored positions pooled), and `"train_loss": [S, train_steps]`. Cached.
    """
    seeds = setup.seeds
    if not seeds:
        raise ValueError("setup.seeds must name at least one seed")
    data = [make_datasets(_data(setup), batch_size=setup.batch_size, seed=s) for s in seeds]
    model = build_model(model_block(setup, arm), data[0][2])
    opt = optimizer_config(learning_rate=setup.learning_rate, warmup_steps=setup.train_steps // 10)
    tx = make_optimizer(opt, setup.train_steps)
    # [steps, S, B, T] and [E, S, B, T]: every seed's batch of every step.
    batches = _stack(
        [_stack([train.batch(i) for train, _, _ in data]) for i in range(setup.train_steps)]
    )
    evals = [next(iter(e.values())) for _, e, _ in data]
    held_out = _stack([_stack([e.batch(i) for e in evals]) for i in range(setup.eval_batches)])

    @jax.jit
    def run(keys, batches, held_out):
        state = jax.vmap(lambda k: create_state(model, tx, k, setup.seq_len))(keys)

        def body(state, batch):
            state, metrics = jax.vmap(train_step)(state, batch)
            return state, metrics["loss"]

        state, losses = jax.lax.scan(body, state, batches)  # losses: [steps, S]
        score = jax.vmap(functools.partial(eval_step, model.apply))  # over seeds
        sums = jax.lax.map(lambda batch: score(state.params, batch), held_out)  # [E, S] each
        return losses.T, jax.tree.map(lambda v: v.sum(0), sums)

    losses, sums = jax.device_get(
        run(jnp.stack([jax.random.key(s) for s in seeds]), batches, held_out)
    )
    count = np.maximum(sums["count"], 1)
    return dict(
        accuracy=np.asarray(sums["correct"] / count, np.float64),
        loss=np.asarray(sums["loss_sum"] / count, np.float64),
        train_loss=np.asarray(losses, np.float64),
    )


def compare(baseline: np.ndarray, variant: np.ndarray, chance: float) -> dict:
    """The decision rule of the refinement claims, fixed before measuring, on per-seed accuracies
    `baseline, variant: [S]` (S >= 3):

    - "inconclusive" when no run of either arm beats `chance + 0.05` (nothing was learned), or
      every run of both is above 0.99 (a ceiling);
    - "holds" when every variant seed beats every baseline seed (the one-sided Mann-Whitney test
      at its smallest p, `1 / C(2S, S)`: 0.05 for S = 3);
    - "fails" when the variant's mean is not above the baseline's;
    - "inconclusive" otherwise (a better mean, but overlapping seeds).

    Returns `{"decision", "mean_difference", "pairs_won"}` (`pairs_won`: the fraction of
    (variant, baseline) seed pairs the variant wins).
    """
    baseline, variant = np.asarray(baseline, np.float64), np.asarray(variant, np.float64)
    if baseline.ndim != 1 or variant.ndim != 1 or min(baseline.size, variant.size) < 3:
        raise ValueError(
            f"baseline and variant must be [S] with S >= 3, got {baseline.shape}, {variant.shape}"
        )
    both = np.concatenate([baseline, variant])
    diff = float(variant.mean() - baseline.mean())
    won = float(np.mean(variant[:, None] > baseline[None, :]))
    if np.all(both <= chance + 0.05) or np.all(both > 0.99):
        decision = "inconclusive"
    elif won == 1.0:
        decision = "holds"
    elif diff <= 0:
        decision = "fails"
    else:
        decision = "inconclusive"
    return dict(decision=decision, mean_difference=diff, pairs_won=won)
