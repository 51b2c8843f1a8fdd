"""The MQAR runs of the polarization claim (Table 2 of Wang et al.): default and polarized Mamba
language models at 2 and 4 layers, several seeds, trained with seqlab's data, optimizer and train
step, and cached so that the claims of one run share them.

The seeds of a setup are integers (data stream and initialization, as `config.seed` of
`experiments/configs/polarization.py`), not drawn from a claim's key: the quick claim is that
experiment at a smaller size. All runs are trained together in one compiled program (`train_all`):
every variant is the deepest polarized model with some parameters masked to zero, vmapped over
(variant, seed), so that the quick size costs one compilation.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax.core import FrozenDict

from seqlab.analysis.influence import module_influence
from seqlab.modules.lm import LanguageModel
from seqlab.modules.mamba import Mamba
from seqlab.train import create_state, make_datasets, make_optimizer, optimizer_config
from seqlab.train.step import scored_sums
from theory import common


@dataclasses.dataclass(frozen=True)
class Setup:
    """Sizes of the task, the models and their training."""

    seq_len: int
    vocab_size: int
    train_kv: tuple[int, ...]  # training cycles through these kv counts by step
    eval_kv: int  # the kv count of the verdict (the largest)
    d_model: int
    d_state: int
    batch_size: int
    steps: int
    learning_rate: float
    warmup_steps: int
    eval_batches: int
    seeds: tuple[int, ...] = (0, 1, 2)
    depths: tuple[int, ...] = (2, 4)

    @property
    def chance(self) -> float:
        """The accuracy of a uniform guess among the values, `2 / vocab_size`."""
        return 2.0 / self.vocab_size


# Quick: what the CPU budget of `python -m theory` allows (one compilation, a few s of steps), at 1
# and 2 layers instead of 2 and 4; too short to learn the task (see the README).
QUICK = Setup(32, 32, (2, 4, 8), 8, 16, 4, 16, 30, 1e-2, 4, 2, depths=(1, 2))
# Paper size (the size of the Table 2 trend): sequences of 256, 16-64 pairs, width 128,
# vocab 8192 as the authors' Zoology runs; hours on a CPU (experiments/configs/polarization.py).
FULL = Setup(256, 8192, (16, 32, 64), 64, 128, 16, 64, 5000, 1e-3, 200, 8)


def data_block(setup: Setup) -> ml_collections.ConfigDict:
    """The `data` block of the runs (`seqlab.train.data`, task `mqar`)."""
    return common.mqar_data(setup.seq_len, setup.vocab_size, setup.train_kv, setup.eval_kv)


def model(setup: Setup, *, polarized: bool, layers: int) -> LanguageModel:
    """A Mamba language model without MLP (`polarize=(1, 1)` when `polarized`)."""
    mamba = FrozenDict(d_state=setup.d_state, polarize=(1, 1) if polarized else (0, 0))
    return LanguageModel(
        vocab_size=setup.vocab_size, d_model=setup.d_model, pattern="m" * layers, mamba=mamba
    )


def variant_mask(lm: LanguageModel, params, *, polarized: bool, layers: int):
    """A 0/1 mask over the parameters of the deepest polarized model `lm` that makes
    `params * mask` the model of the variant: for the default Mamba, the `B` and `C` columns of
    the two fixed state channels are zeroed (their state then stays 0 and adds nothing through
    `C`); for `layers` fewer than `lm` has, the later blocks' `out_proj` is zeroed (the block is
    then the identity `x + 0`). A masked entry gets zero gradient, so training `params * mask` is
    training the variant itself."""
    mamba = Mamba(d_model=lm.d_model, **lm.mamba)
    rank, n = mamba.effective_dt_rank, mamba.n_total
    fixed = np.array([rank, rank + n - 1, rank + n, rank + 2 * n - 1])  # B and C of A = 0, -100

    def mask(path, value):
        names = [getattr(k, "key", "") for k in path]
        out = np.ones(value.shape, np.float32)
        block = next((int(k.split("_")[-1]) for k in names if k.startswith("blocks_")), None)
        if block is not None and block >= layers and names[-2:] == ["out_proj", "kernel"]:
            out[:] = 0.0
        if not polarized and names[-1] == "x_proj":
            out[..., fixed] = 0.0
        return jnp.asarray(out)

    return jax.tree_util.tree_map_with_path(mask, params)


@functools.cache
def train_all(setup: Setup) -> dict:
    """Train every variant (default and polarized, each depth of `setup`) for every seed, in one
    compiled program: all are the deepest polarized model with a `variant_mask`, vmapped over
    (variant, seed). The seeds share their initialization across variants (paired runs).

    Returns `{(polarized, layers): run}` with `run["accuracy"]: [S]` (recall accuracy on
    `eval_batches` held-out batches at `eval_kv` pairs), `run["losses"]: [S, steps]` and
    `run["params"]` (the effective, masked parameters with a leading seed axis), and `"model"`:
    the model those parameters are for (equal to the variant as a function)."""
    lm = model(setup, polarized=True, layers=max(setup.depths))
    variants = [(p, L) for L in setup.depths for p in (False, True)]
    runs = [(v, s) for v in variants for s in setup.seeds]
    opt = optimizer_config(learning_rate=setup.learning_rate, warmup_steps=setup.warmup_steps)
    tx = make_optimizer(opt, setup.steps)
    data = {
        s: make_datasets(data_block(setup), batch_size=setup.batch_size, seed=s)
        for s in setup.seeds
    }
    keys = jnp.stack([jax.random.key_data(jax.random.key(s)) for _, s in runs])
    state = jax.jit(
        jax.vmap(lambda k: create_state(lm, tx, jax.random.wrap_key_data(k), setup.seq_len))
    )(keys)
    template = jax.tree.map(lambda v: v[0], state.params)
    masks = [variant_mask(lm, template, polarized=p, layers=L) for (p, L), _ in runs]
    mask = jax.tree.map(lambda *m: jnp.stack(m), *masks)

    def sums(params, mask, batch):
        masked = jax.tree.map(jnp.multiply, params, mask)
        return scored_sums(lm.apply({"params": masked}, batch["inputs"]), batch["targets"])

    @jax.jit
    @jax.vmap
    def step(state, mask, batch):
        def loss_fn(params):
            got = sums(params, mask, batch)
            return got["loss_sum"] / jnp.maximum(got["count"], 1)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def stacked(batches):
        return {k: jnp.stack([b[k] for b in batches]) for k in ("inputs", "targets")}

    losses = []
    for i in range(setup.steps):
        batch = {s: data[s][0].batch(i) for s in setup.seeds}
        state, loss = step(state, mask, stacked([batch[s] for _, s in runs]))
        losses.append(loss)

    evaluate = jax.jit(jax.vmap(sums))
    correct, count = np.zeros(len(runs)), np.zeros(len(runs))
    for i in range(setup.eval_batches):
        batch = {s: data[s][1][f"kv{setup.eval_kv}"].batch(i) for s in setup.seeds}
        got = evaluate(state.params, mask, stacked([batch[s] for _, s in runs]))
        correct += np.asarray(got["correct"])
        count += np.asarray(got["count"])
    losses = np.asarray(jnp.stack(losses, axis=1))
    params = jax.tree.map(jnp.multiply, state.params, mask)
    out = {"model": lm}
    for v in variants:
        rows = np.array([i for i, (w, _) in enumerate(runs) if w == v])
        out[v] = dict(
            accuracy=correct[rows] / count[rows],
            losses=losses[rows],
            params=jax.tree.map(lambda a, rows=rows: a[rows], params),
        )
    return out


def seed_params(params, index: int):
    """The parameters of seed number `index` from a pytree with a leading seed axis."""
    return jax.tree.map(lambda v: v[index], params)


def paired_gain(polar: np.ndarray, default: np.ndarray) -> dict[str, float]:
    """Mean over seeds of `polar - default` (`[S]` each, paired by seed) and its standard error
    `std(diff, ddof=1) / sqrt(S)`; `S >= 2`."""
    diff = np.asarray(polar, np.float64) - np.asarray(default, np.float64)
    if diff.size < 2:
        raise ValueError(f"paired_gain needs at least 2 seeds, got {diff.size}")
    return dict(gain=float(diff.mean()), stderr=float(diff.std(ddof=1) / np.sqrt(diff.size)))


def table2_verdict(acc: dict, chance: float, *, floor_margin: float = 0.1) -> dict:
    """The decision of the Table 2 claim from `acc[(polarized, layers)]: [S]` accuracies.

    Per depth `L`, the paired gain `g_L +- se_L` (`paired_gain`). Holds iff `g_L - 2 se_L > 0` at
    every depth and the gain grows with depth (`g` at the deepest > `g` at the shallowest). Fails
    iff some `g_L + 2 se_L < 0` (polarization significantly worse), or every gain is significant
    but does not grow with depth. Otherwise, or when no model's mean accuracy is above `chance +
    floor_margin` (nothing was learned, so nothing separates), inconclusive.
    """
    depths = sorted({layers for _, layers in acc})
    gains = {L: paired_gain(acc[(True, L)], acc[(False, L)]) for L in depths}
    above = {L: g["gain"] - 2 * g["stderr"] > 0 for L, g in gains.items()}
    below = {L: g["gain"] + 2 * g["stderr"] < 0 for L, g in gains.items()}
    grows = gains[depths[-1]]["gain"] > gains[depths[0]]["gain"]
    learned = max(float(np.mean(a)) for a in acc.values()) > chance + floor_margin
    holds = all(above.values()) and grows
    fails = any(below.values()) or (all(above.values()) and not grows)
    if not learned or not (holds or fails):
        verdict = "inconclusive"
    else:
        verdict = "holds" if holds else "fails"
    return dict(verdict=verdict, gains=gains, grows=grows, learned=learned)


def hidden_states(lm: LanguageModel, h: jax.Array) -> jax.Array:
    """The blocks of `lm` on embeddings `h: [B, T, d_model]`, before the readout (a method for
    `lm.apply(..., method=hidden_states)`)."""
    for block in lm.blocks:
        h = block(h)
    return h


@functools.partial(jax.jit, static_argnums=0)
def _influence(lm: LanguageModel, params, tokens: jax.Array) -> jax.Array:
    emb = lm.apply({"params": params}, tokens, method="embed")  # [B, T, d_model]
    return jax.lax.map(
        lambda e: module_influence(lm, {"params": params}, e, method=hidden_states), emb
    )


def block_influence(lm: LanguageModel, params, tokens: jax.Array) -> np.ndarray:
    """`I[b, t, s] = ||dh_t / de_s||_F`: the influence of the embedding of token `s` on the last
    block's output at `t`, for each sequence of `tokens: [B, T]`. Returns `[B, T, T]` float64."""
    return np.asarray(_influence(lm, params, tokens), np.float64)
