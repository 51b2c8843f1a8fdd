"""The model registry: a `LanguageModel` (or an `ODETransformer`) from the `model` block of an
experiment config.

    name        a key of `PATTERNS` (the stack is `PATTERNS[name](num_layers)`), or a preset of
                `seqlab.modules.lm.PRESETS` (its own size; `num_layers` and `d_model` are ignored)
    d_model, num_layers, d_ff (0: blocks without MLP)
    mamba, mamba2, gdn, attention   keyword arguments of the mixers (see `LanguageModel`)
    kda, gdn2, gdp   the same for Kimi Delta Attention, Gated DeltaNet-2, Gated DeltaProduct
                (optional: a config without the block gets the mixer's defaults)
    dtype       "float32" | "bfloat16" | "float64": compute dtype; parameters are float32
                (float64 for a float64 model)

`ode_transformer` is the neural-ODE transformer of `seqlab.modules.ode_transformer`: `num_layers`
is its default Euler step count, `d_model` and `d_ff` its sizes, and the block `ode` holds
`num_heads`, `time_features`, `hidden` and `lora_rank`.

`lm` builds `LanguageModel(**model.lm)` from a block holding every keyword argument of it (the
form `python -m experiments.convert` writes for a converted Hugging Face checkpoint); its
`vocab_size` must be the data's.

`polar_mamba` is Mamba with `polarize=(1, 1)` (one never-forgetting and one fast-forgetting state
channel per inner channel, Wang et al. arXiv 2501.00658), unless the `model.mamba` block sets
`polarize` itself.
"""

from collections.abc import Callable

import jax.numpy as jnp

from seqlab.modules.lm import PRESETS, LanguageModel, preset
from seqlab.modules.ode_transformer import ODETransformer
from seqlab.ops.checks import check_choice, check_positive_int

PATTERNS: dict[str, Callable[[int], str]] = {
    "mamba": lambda n: "m" * n,
    "polar_mamba": lambda n: "m" * n,
    "mamba2": lambda n: "2" * n,
    "gdn": lambda n: "g" * n,
    "kda": lambda n: "k" * n,
    "gdn2": lambda n: "n" * n,
    "gdp": lambda n: "p" * n,
    "attention": lambda n: "a" * n,
    # Gated DeltaNet and global attention alternating, Gated DeltaNet first.
    "hybrid": lambda n: ("ga" * n)[:n],
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


ODE_TRANSFORMER = "ode_transformer"
LM = "lm"


def model_names() -> list[str]:
    """Every name `build_model` accepts."""
    return sorted([*PATTERNS, ODE_TRANSFORMER, LM]) + sorted(PRESETS)


def build_model(model, vocab_size: int) -> LanguageModel | ODETransformer:
    """The model of the config block `model` over `vocab_size` tokens."""
    check_choice("model.dtype", model.dtype, sorted(DTYPES))
    param_dtype = jnp.float64 if model.dtype == "float64" else jnp.float32
    dtypes = dict(dtype=DTYPES[model.dtype], param_dtype=param_dtype)
    check_choice("model.name", model.name, model_names())
    if model.name in PRESETS:
        return preset(model.name, vocab_size=vocab_size, **dtypes)
    if model.name == LM:
        kwargs = model.lm.to_dict() if hasattr(model.lm, "to_dict") else dict(model.lm)
        if kwargs.get("vocab_size") != vocab_size:
            raise ValueError(
                f"model.lm.vocab_size = {kwargs.get('vocab_size')} but the data has "
                f"{vocab_size} tokens"
            )
        return LanguageModel(**kwargs, **dtypes)
    for field in ("d_model", "num_layers"):
        check_positive_int(f"model.{field}", model[field])
    if model.d_ff < 0:
        raise ValueError(f"model.d_ff must be >= 0 (0: no MLP), got {model.d_ff}")
    if model.name == ODE_TRANSFORMER:
        return ODETransformer(
            vocab_size=vocab_size,
            d_model=model.d_model,
            num_heads=model.ode.num_heads,
            d_ff=model.d_ff,
            num_steps=model.num_layers,
            time_features=model.ode.time_features,
            hidden=model.ode.hidden,
            lora_rank=model.ode.lora_rank,
            **dtypes,
        )
    mamba = dict(model.mamba)
    if model.name == "polar_mamba":
        mamba.setdefault("polarize", (1, 1))
    return LanguageModel(
        vocab_size=vocab_size,
        d_model=model.d_model,
        pattern=PATTERNS[model.name](model.num_layers),
        d_ff=model.d_ff or None,
        mamba=mamba,
        mamba2=dict(model.mamba2),
        gdn=dict(model.gdn),
        **{name: dict(model.get(name) or {}) for name in ("kda", "gdn2", "gdp")},
        attention=dict(model.attention),
        **dtypes,
    )
