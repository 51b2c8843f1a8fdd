"""The optimizer of a run, from the `optimizer` block of its config (`optimizer_config()`: the
defaults, which every config starts from).

name            "adamw" | "adam" | "sgd"
learning_rate   peak learning rate
schedule        "constant" | "cosine": linear warmup over `warmup_steps`, then constant, or a
                cosine decay to `learning_rate * final_fraction` at `total_steps`
weight_decay    decoupled weight decay (adamw only)
b1, b2, eps     Adam moments and epsilon
grad_clip       global-norm clipping threshold, or 0 for none
trainable       "" to train every parameter, or a substring: only the parameters whose path
                (e.g. "wq/lora_u") contains it are updated (clipping, moments and weight decay see
                only them); every other parameter stays bit-identical (LoRA: "lora")
"""

import jax
import ml_collections
import optax

from seqlab.ops.checks import check_choice

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine")
DEFAULTS = dict(
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


def optimizer_config(**overrides) -> ml_collections.ConfigDict:
    """An `optimizer` block: `DEFAULTS` with `overrides` replacing some of its keys (a key that
    is not one raises `ValueError`)."""
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"optimizer_config: unknown keys {unknown}; known: {sorted(DEFAULTS)}")
    return ml_collections.ConfigDict({**DEFAULTS, **overrides})


def make_schedule(opt, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the step (see the module docstring)."""
    check_choice("optimizer.schedule", opt.schedule, SCHEDULES)
    if not opt.learning_rate > 0:
        raise ValueError(f"optimizer.learning_rate must be > 0, got {opt.learning_rate}")
    if opt.warmup_steps < 0:
        raise ValueError(f"optimizer.warmup_steps must be >= 0, got {opt.warmup_steps}")
    if opt.schedule == "constant":
        if opt.warmup_steps == 0:
            return optax.constant_schedule(opt.learning_rate)
        warmup = optax.linear_schedule(0.0, opt.learning_rate, opt.warmup_steps)
        constant = optax.constant_schedule(opt.learning_rate)
        return optax.join_schedules([warmup, constant], [opt.warmup_steps])
    if opt.warmup_steps >= total_steps:
        raise ValueError(
            f"optimizer.warmup_steps must be < total_steps = {total_steps} for a cosine schedule, "
            f"got {opt.warmup_steps}"
        )
    return optax.warmup_cosine_decay_schedule(
        0.0,
        opt.learning_rate,
        opt.warmup_steps,
        total_steps,
        end_value=opt.learning_rate * opt.final_fraction,
    )


def make_optimizer(opt, total_steps: int) -> optax.GradientTransformation:
    """The optax transformation of the config block `opt` (see the module docstring)."""
    check_choice("optimizer.name", opt.name, OPTIMIZERS)
    if opt.grad_clip < 0:
        raise ValueError(f"optimizer.grad_clip must be >= 0, got {opt.grad_clip}")
    lr = make_schedule(opt, total_steps)
    if opt.name == "adamw":
        tx = optax.adamw(lr, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay)
    elif opt.name == "adam":
        tx = optax.adam(lr, opt.b1, opt.b2, opt.eps)
    else:
        tx = optax.sgd(lr)
    if opt.grad_clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(opt.grad_clip), tx)
    trainable = opt.get("trainable", "")
    if trainable:
        tx = train_only(tx, trainable)
    return tx


def param_path(path) -> str:
    """The path of a parameter as `"a/b/c"` (keys of nested dicts, indices of sequences)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def train_only(tx: optax.GradientTransformation, substring: str) -> optax.GradientTransformation:
    """`tx` on the parameters whose `param_path` contains `substring`; zero updates (and no
    optimizer state) for every other parameter."""

    def labels(params):
        names = jax.tree_util.tree_map_with_path(
            lambda path, _: "train" if substring in param_path(path) else "freeze", params
        )
        if "train" not in jax.tree.leaves(names):
            raise ValueError(f"optimizer.trainable = {substring!r} matches no parameter path")
        return names

    return optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)
