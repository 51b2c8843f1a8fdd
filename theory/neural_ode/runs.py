"""Several small language models trained at once, for the claims on the language task.

`train_runs` trains `R` runs of one model family in one compiled step: parameters, optimizer
states and batches are stacked on a leading run axis and the step is `jax.vmap`ped over it, so
three seeds, or nine fine-tuning variants, cost one compilation. Each run has its own Adam state
and global-norm clipping (`seqlab.train.optim.make_optimizer`, vmapped), and a per-run mask of
its trainable parameters (LoRA runs train only `lora_*` and the embedding, as the paper's code;
full runs everything else).

Discrete transformers of different depths share one compiled step as *stacks*: the weights of
`L` layers padded to `max_layers` with a 0/1 layer mask `active: [max_layers]`,

    x_{k+1} = x_k + active_k * block_update(W_k + U_k V_k^T, x_k),

which for `active = [1] * L + [0] * (max_layers - L)` is the `L`-layer `DiscreteTransformer`
(`stacked_logits` equals its `apply`, tested) plus a per-layer LoRA delta `U_k V_k^T` (`U_k` zero
at init). `resample` turns an ODE transformer into the stack of `evaluate_at(model, ., L)`.

Data: bytes of text files (`seqlab.train.data`, `bytes`): the `ode_lm.py` corpus (the Python
sources of `seqlab/`) for pretraining and the repository's Markdown files for fine-tuning (the
paper pretrains on one corpus and fine-tunes on another: OpenWebText and WikiText-103).
"""

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments.configs import ode_lm
from seqlab.modules.ode_transformer import (
    BLOCK_WEIGHTS,
    DiscreteTransformer,
    ODETransformer,
    block_update,
    evaluate_at,
)
from seqlab.train import make_datasets, make_optimizer, optimizer_config
from seqlab.train.step import scored_sums

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 256  # bytes
LORA_WEIGHTS = ("wq", "wk", "wv", "wo", "w1", "w2")


@dataclasses.dataclass(frozen=True)
class LMSetup:
    """Sizes of the language-task models and their training."""

    d_model: int
    num_heads: int
    d_ff: int
    time_features: int
    hidden: int
    num_steps: int  # N: Euler steps of the ODE model, layers of the matched discrete model
    seq_len: int
    batch_size: int
    pretrain_steps: int
    learning_rate: float
    finetune_steps: int
    finetune_learning_rate: float
    lora_rank: int
    eval_batches: int
    seeds: tuple[int, ...]  # pretraining seeds (the comparison and the spectra)
    finetune_seed: int = 0  # the pretrained models the fine-tuning runs start from


LM_QUICK = LMSetup(32, 2, 64, 8, 16, 4, 32, 16, 150, 3e-3, 60, 1e-3, 4, 2, (0, 1, 2))
LM_FULL = LMSetup(64, 4, 256, 8, 32, 8, 128, 16, 1500, 1e-3, 400, 1e-3, 8, 8, (0, 1, 2))


def lm_setup_for(full: bool) -> LMSetup:
    """`LM_FULL` at paper size, `LM_QUICK` otherwise."""
    return LM_FULL if full else LM_QUICK


# -- data ---------------------------------------------------------------------------------------


def corpus_paths(corpus: str) -> tuple[str, ...]:
    """The files of a corpus: `"python"`, the `ode_lm.py` data (the sources of `seqlab/`), or
    `"markdown"`, the repository's Markdown files outside `theory/` (whose READMEs hold
    generated verdicts) and hidden folders."""
    if corpus == "python":
        return tuple(ode_lm.get_config().data.paths)
    if corpus == "markdown":
        found = [
            p
            for p in ROOT.rglob("*.md")
            if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
            and p.relative_to(ROOT).parts[0] not in ("theory", "build")
            and "egg-info" not in str(p)
        ]
        return tuple(sorted(str(p) for p in found))
    raise ValueError(f"corpus must be 'python' or 'markdown', got {corpus!r}")


@functools.cache
def lm_data(corpus: str, seq_len: int, batch_size: int, seed: int):
    """`(train, eval_batches)` of a corpus: the training `Dataset` (windows of the first 95% of
    its bytes, seeded) and `eval_batches` fixed held-out batches are drawn by `eval_batch(i)`."""
    block = ml_collections.ConfigDict(
        dict(name="bytes", seq_len=seq_len, paths=corpus_paths(corpus), eval_fraction=0.05)
    )
    train, evals, _ = make_datasets(block, batch_size=batch_size, seed=seed)
    return train, evals[""]


def eval_batches(setup: LMSetup, corpus: str) -> tuple[dict, ...]:
    """The fixed held-out batches of a corpus (the same for every run)."""
    _, evals = lm_data(corpus, setup.seq_len, setup.batch_size, 0)
    return tuple(evals.batch(i) for i in range(setup.eval_batches))


def stacked_batch(datasets, step: int) -> dict:
    """`{"inputs", "targets"}: [R, B, T]`: batch `step` of each run's `Dataset`."""
    batches = [d.batch(step) for d in datasets]
    return {k: np.stack([b[k] for b in batches]) for k in ("inputs", "targets")}


# -- models ------------------------------------------------------------------------------------


def ode_model(setup: LMSetup, num_steps: int | None = None) -> ODETransformer:
    """The ODE transformer of `setup` (at `num_steps`, default `setup.num_steps`)."""
    return ODETransformer(
        vocab_size=VOCAB,
        d_model=setup.d_model,
        num_heads=setup.num_heads,
        d_ff=setup.d_ff,
        num_steps=num_steps or setup.num_steps,
        time_features=setup.time_features,
        hidden=setup.hidden,
    )


def discrete_model(setup: LMSetup, num_layers: int) -> DiscreteTransformer:
    """The `num_layers`-layer discrete transformer of the sizes of `setup`."""
    return DiscreteTransformer(
        vocab_size=VOCAB,
        d_model=setup.d_model,
        num_heads=setup.num_heads,
        d_ff=setup.d_ff,
        num_layers=num_layers,
    )


def _lora_shape(weight: jax.Array, name: str) -> tuple[int, int]:
    """`(fan_in, fan_out)` of a block weight viewed as a matrix."""
    if name == "wo":  # [H, K, D]
        return weight.shape[0] * weight.shape[1], weight.shape[2]
    return weight.shape[0], int(np.prod(weight.shape[1:]))


def to_stack(discrete_params: dict, num_layers: int, max_layers: int, lora_rank: int, key):
    """The stack of an `num_layers`-layer `DiscreteTransformer`'s params (`blocks_k`), padded
    with zero layers to `max_layers`, with LoRA factors (`u` zeros, `v` normal with variance
    `1 / r`) of rank `lora_rank`.

    Returns `{"embedding": ..., "layers": {name: [max_layers, ...]}, "lora": {name: {"u":
    [max_layers, fan_in, r], "v": [max_layers, fan_out, r]}}, "active": [max_layers]}`.
    """
    if not 0 < num_layers <= max_layers:
        raise ValueError(f"num_layers must be in [1, max_layers = {max_layers}], got {num_layers}")
    blocks = [discrete_params[f"blocks_{k}"] for k in range(num_layers)]
    dtype = discrete_params["embedding"]["embedding"].dtype
    pad = max_layers - num_layers
    layers = {
        name: jnp.concatenate(
            [jnp.stack([b[name] for b in blocks]), jnp.zeros((pad, *blocks[0][name].shape), dtype)]
        )
        for name in BLOCK_WEIGHTS
    }
    lora = {}
    for name, key_w in zip(LORA_WEIGHTS, jax.random.split(key, len(LORA_WEIGHTS)), strict=True):
        fan_in, fan_out = _lora_shape(blocks[0][name], name)
        v = jax.random.normal(key_w, (max_layers, fan_out, lora_rank), dtype) * lora_rank**-0.5
        lora[name] = {"u": jnp.zeros((max_layers, fan_in, lora_rank), dtype), "v": v}
    active = jnp.asarray([1.0] * num_layers + [0.0] * pad, dtype)
    return {
        "embedding": discrete_params["embedding"],
        "layers": layers,
        "lora": lora,
        "active": active,
    }


def pad_stack(stack: dict, max_layers: int) -> dict:
    """`stack` with inactive zero layers (and zero LoRA factors) appended up to `max_layers`."""
    pad = max_layers - stack["active"].shape[0]
    if pad < 0:
        raise ValueError(f"max_layers must be >= {stack['active'].shape[0]}, got {max_layers}")
    grow = lambda a: jnp.concatenate([a, jnp.zeros((pad, *a.shape[1:]), a.dtype)])  # noqa: E731
    rest = {k: jax.tree.map(grow, stack[k]) for k in ("layers", "lora", "active")}
    return {"embedding": stack["embedding"], **rest}


def init_stack(setup: LMSetup, num_layers: int, max_layers: int, key):
    """A freshly initialized `num_layers`-layer discrete transformer as a stack (`to_stack`)."""
    model = discrete_model(setup, num_layers)
    init_key, lora_key = jax.random.split(key)
    tokens = jnp.zeros((1, setup.seq_len), jnp.int32)
    params = jax.jit(model.init)(init_key, tokens)["params"]
    return to_stack(params, num_layers, max_layers, setup.lora_rank, lora_key)


def resample(setup: LMSetup, ode_params: dict, num_layers: int, max_layers: int, key):
    """The ODE transformer's parameters sampled at `num_layers` Euler steps (`evaluate_at`) as a
    stack (`to_stack`)."""
    _, variables = evaluate_at(ode_model(setup), {"params": ode_params}, num_layers)
    return to_stack(variables["params"], num_layers, max_layers, setup.lora_rank, key)


@functools.cache
def ode_logits_fn(setup: LMSetup, num_steps: int | None = None):
    """`(params, tokens: [B, T]) -> logits` of `ode_model(setup, num_steps)` (one per size)."""
    model = ode_model(setup, num_steps)
    return lambda params, tokens: model.apply({"params": params}, tokens)


@functools.cache
def stack_logits_fn(setup: LMSetup):
    """`(stack, tokens: [B, T]) -> logits` of `stacked_logits` (one per size)."""
    return lambda stack, tokens: stacked_logits(setup, stack, tokens)


def stacked_logits(setup: LMSetup, stack: dict, tokens: jax.Array):
    """Logits `[B, T, V]` of a stack (`to_stack`) on `tokens: [B, T]` (module docstring)."""
    shell = discrete_model(setup, 1)  # its embedding and readout only
    emb = {"params": {"embedding": stack["embedding"]}}
    x = shell.apply(emb, tokens, method="embed").astype(shell.acc_dtype)

    def layer(x, inputs):
        weights, lora, on = inputs
        merged = dict(weights)
        for name, f in lora.items():
            merged[name] = weights[name] + (f["u"] @ f["v"].T).reshape(weights[name].shape)
        return x + on * block_update(merged, x, shell.dtype).astype(x.dtype), None

    x, _ = jax.lax.scan(layer, x, (stack["layers"], stack["lora"], stack["active"]))
    return shell.apply(emb, x, method="readout")


# -- training and evaluation of stacked runs ----------------------------------------------------


def _loss(logits_fn, params, batch):
    sums = scored_sums(logits_fn(params, batch["inputs"]), batch["targets"])
    return sums["loss_sum"] / jnp.maximum(sums["count"], 1)


def trainable_mask(params, lora: bool):
    """Per leaf of a stack (or of ODE parameters) 1.0 (trained) or 0.0 (frozen): with `lora`,
    the `lora` factors and the embedding table (as the paper's fine-tuning); otherwise every
    parameter but the LoRA factors. The layer mask `active` is never trained."""

    def one(path, leaf):
        keys = [str(getattr(k, "key", k)) for k in path]
        is_lora = keys[0] == "lora"
        on = (is_lora or keys[-1] == "embedding") if lora else not is_lora
        on = on and keys[0] != "active"
        return jnp.full((), float(on), leaf.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


def train_runs(logits_fn, params, batch_fn, *, steps, learning_rate, masks=None, evaluate=None):
    """Train `R` runs at once: `params` stacked `[R, ...]`, `logits_fn(params_r, inputs) ->
    logits` for one run, `batch_fn(step) -> {"inputs", "targets"}: [R, B, T]`, `masks` (stacked
    `trainable_mask`s, default all trained), Adam with a 10% warmup and cosine decay, clipping
    at 1 per run.

    `evaluate = (every, fn)` calls `fn(params)` every `every` steps and at the end.

    Returns `(params, losses: [steps, R], evaluations: {step: fn(params)})`.
    """
    block = optimizer_config(
        name="adam",
        learning_rate=learning_rate,
        warmup_steps=max(1, steps // 10),
        weight_decay=0.0,
    )
    tx = make_optimizer(block, steps)
    if masks is None:
        masks = jax.vmap(functools.partial(trainable_mask, lora=False))(params)

    @jax.jit
    def step(params, opt_state, batch):
        def one(p, s, b, m):
            loss, grads = jax.value_and_grad(functools.partial(_loss, logits_fn))(p, b)
            grads = jax.tree.map(lambda g, on: g * on, grads, m)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        return jax.vmap(one)(params, opt_state, batch, masks)

    opt_state = jax.jit(jax.vmap(tx.init))(params)
    losses, evaluations = [], {}
    for i in range(steps):
        if evaluate is not None and i % evaluate[0] == 0:
            evaluations[i] = evaluate[1](params)
        params, opt_state, loss = step(params, opt_state, batch_fn(i))
        losses.append(np.asarray(loss))
    if evaluate is not None:
        evaluations[steps] = evaluate[1](params)
    return params, np.stack(losses), evaluations


@functools.cache
def _eval_sums(logits_fn):
    """The jitted per-run `scored_sums` of `logits_fn` on one shared batch (one per function)."""

    @jax.jit
    def sums(params, batch):
        one = lambda p: scored_sums(logits_fn(p, batch["inputs"]), batch["targets"])  # noqa: E731
        return jax.vmap(one)(params)

    return sums


def eval_runs(logits_fn, params, batches) -> np.ndarray:
    """Mean loss over the scored positions of `batches` (shared by all runs), per run: `[R]`."""
    total = [_eval_sums(logits_fn)(params, b) for b in batches]
    loss = sum(s["loss_sum"] for s in total) / sum(s["count"] for s in total)
    return np.asarray(loss, np.float64)


def stack_runs(trees):
    """A list of `R` pytrees of equal structure as one pytree with a leading run axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def run(tree, r: int):
    """Run `r` of a stacked pytree."""
    return jax.tree.map(lambda leaf: leaf[r], tree)


# -- the cached experiments ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """The ODE transformers (`N` Euler steps) and the discrete transformers (`N` layers) of
    `setup.seeds`, pretrained on the `python` corpus, each seed on its own batches; parameters
    stacked over seeds. Losses `[steps, R]` (training), `[R]` (held-out)."""

    setup: LMSetup
    ode_init: dict
    ode_params: dict
    ode_losses: np.ndarray
    ode_eval: np.ndarray
    discrete_params: dict  # stacks (`to_stack`) of `N` layers
    discrete_losses: np.ndarray
    discrete_eval: np.ndarray
    ode_param_count: int
    discrete_param_count: int


def _count(tree) -> int:
    return int(sum(np.prod(leaf.shape[1:]) for leaf in jax.tree.leaves(tree)))


@functools.cache
def pretrained(setup: LMSetup) -> Pretrained:
    """Train both families on `setup.seeds` (cached: every claim of a run shares them)."""
    n, tokens = setup.num_steps, jnp.zeros((1, setup.seq_len), jnp.int32)
    datasets = [lm_data("python", setup.seq_len, setup.batch_size, s)[0] for s in setup.seeds]
    batch_fn = functools.partial(stacked_batch, datasets)
    evals = eval_batches(setup, "python")
    common = dict(steps=setup.pretrain_steps, learning_rate=setup.learning_rate)

    model = ode_model(setup)
    init = jax.jit(model.init)
    ode_init = stack_runs([init(jax.random.key(s), tokens)["params"] for s in setup.seeds])
    ode_params, ode_losses, _ = train_runs(ode_logits_fn(setup), ode_init, batch_fn, **common)

    stacks = [init_stack(setup, n, n, jax.random.key(s)) for s in setup.seeds]
    discrete, discrete_losses, _ = train_runs(
        stack_logits_fn(setup), stack_runs(stacks), batch_fn, **common
    )
    lora_free = {k: v for k, v in discrete.items() if k not in ("lora", "active")}
    return Pretrained(
        setup,
        ode_init,
        ode_params,
        ode_losses,
        eval_runs(ode_logits_fn(setup), ode_params, evals),
        discrete,
        discrete_losses,
        eval_runs(stack_logits_fn(setup), discrete, evals),
        _count(ode_params),
        _count(lora_free),
    )


def finetune_counts(setup: LMSetup) -> tuple[int, int, int]:
    """The step counts the ODE model is resampled at: `(N / 2, N, 2 N)`."""
    return setup.num_steps // 2, setup.num_steps, 2 * setup.num_steps


@dataclasses.dataclass(frozen=True)
class Finetuned:
    """Fine-tuning on the `markdown` corpus (the same batches for every variant) of
    `variants`: `("ode", M, mode)` the pretrained ODE model of `setup.finetune_seed` resampled at
    `M` steps by `evaluate_at`, `("discrete", N, mode)` the pretrained discrete model, and
    `("scratch", N, "full")` a fresh discrete model; `mode` "full" or "lora". `curves[step]:
    [R]` held-out losses on the markdown corpus every `finetune_steps / 3` steps (step 0:
    before fine-tuning)."""

    setup: LMSetup
    variants: tuple[tuple[str, int, str], ...]
    curves: dict[int, np.ndarray]
    losses: np.ndarray  # [finetune_steps, R] training losses

    def final(self) -> dict[tuple[str, int, str], float]:
        """The held-out loss of each variant after fine-tuning."""
        last = self.curves[max(self.curves)]
        return {v: float(last[r]) for r, v in enumerate(self.variants)}


@functools.cache
def finetuned(setup: LMSetup) -> Finetuned:
    """Fine-tune the variants of `Finetuned` (cached)."""
    pre = pretrained(setup)
    r = setup.seeds.index(setup.finetune_seed)
    n, top = setup.num_steps, 2 * setup.num_steps
    ode_params = run(pre.ode_params, r)
    discrete = pad_stack(run(pre.discrete_params, r), top)
    keys = iter(jax.random.split(jax.random.key(1000 + setup.finetune_seed), 16))
    variants, stacks = [], []
    for mode in ("full", "lora"):
        for m in finetune_counts(setup):
            variants.append(("ode", m, mode))
            stacks.append(resample(setup, ode_params, m, top, next(keys)))
        variants.append(("discrete", n, mode))
        stacks.append(discrete)
    variants.append(("scratch", n, "full"))
    stacks.append(init_stack(setup, n, top, next(keys)))
    masks = [trainable_mask(s, lora=v[2] == "lora") for s, v in zip(stacks, variants, strict=True)]
    data, _ = lm_data("markdown", setup.seq_len, setup.batch_size, 1000)
    evals = eval_batches(setup, "markdown")
    count = len(variants)

    def batch_fn(i):
        b = data.batch(i)
        return {k: np.broadcast_to(v, (count, *v.shape)) for k, v in b.items()}

    fn = stack_logits_fn(setup)
    _, losses, curves = train_runs(
        fn,
        stack_runs(stacks),
        batch_fn,
        steps=setup.finetune_steps,
        learning_rate=setup.finetune_learning_rate,
        masks=stack_runs(masks),
        evaluate=(max(1, setup.finetune_steps // 3), lambda p: eval_runs(fn, p, evals)),
    )
    return Finetuned(setup, tuple(variants), curves, losses)
