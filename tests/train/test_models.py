"""Tests of seqlab.train.models: names to patterns, polarization, presets, dtypes, errors (no
model is run: building a LanguageModel only validates its fields)."""

import jax.numpy as jnp
import ml_collections
import pytest

from seqlab.modules.ode_transformer import ODETransformer
from seqlab.train.models import build_model, model_names


def _block(**overrides):
    base = dict(
        name="mamba",
        d_model=16,
        num_layers=3,
        d_ff=0,
        dtype="float32",
        mamba=dict(d_state=4),
        mamba2=dict(d_state=8, head_dim=8),
        gdn=dict(num_heads=2, head_dim=8),
        attention=dict(num_heads=2),
    )
    return ml_collections.ConfigDict({**base, **overrides})


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("mamba", "mmm"),
        ("polar_mamba", "mmm"),
        ("mamba2", "222"),
        ("gdn", "ggg"),
        ("attention", "aaa"),
        ("hybrid", "gag"),
        ("kda", "kkk"),
        ("gdn2", "nnn"),
        ("gdp", "ppp"),
    ],
)
def test_names_build_their_stacks(name, pattern):
    model = build_model(_block(name=name), vocab_size=11)
    assert model.pattern == pattern and model.vocab_size == 11 and model.d_ff is None
    assert model.mamba.get("polarize") == ((1, 1) if name == "polar_mamba" else None)


def test_delta_family_blocks_are_optional_and_passed_on():
    """A config without `kda`, `gdn2`, `gdp` blocks gets the mixers' defaults (the `_block` above
    has none); given, they reach the LanguageModel."""
    assert build_model(_block(name="kda"), vocab_size=11).kda == {}
    blocks = dict(kda=dict(head_dim=8), gdn2=dict(num_heads=1), gdp=dict(num_householder=3))
    model = build_model(_block(name="gdp", **blocks), vocab_size=11)
    assert (model.kda, model.gdn2, model.gdp) == tuple(blocks.values())


def test_presets_dtypes_and_mlp():
    model = build_model(_block(name="tiny-h2", dtype="bfloat16"), vocab_size=99)
    assert model.pattern == "2gs" and model.vocab_size == 99
    assert model.dtype == jnp.bfloat16 and model.param_dtype == jnp.float32
    model = build_model(_block(dtype="float64", d_ff=24), vocab_size=5)
    assert model.param_dtype == jnp.float64 and model.d_ff == 24
    assert "gdn-0.4b" in model_names() and "polar_mamba" in model_names()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(name="rwkv"), "model.name"),
        (dict(d_model=0), "model.d_model"),
        (dict(num_layers=-1), "model.num_layers"),
        (dict(d_ff=-2), "model.d_ff"),
        (dict(dtype="float16"), "model.dtype"),
    ],
)
def test_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        build_model(_block(**overrides), vocab_size=11)


def test_ode_transformer_takes_its_step_count_from_num_layers():
    ode = dict(num_heads=4, time_features=8, hidden=12, lora_rank=3)
    model = build_model(
        _block(name="ode_transformer", d_model=32, num_layers=6, d_ff=64, ode=ode), vocab_size=9
    )
    assert isinstance(model, ODETransformer) and "ode_transformer" in model_names()
    assert (model.vocab_size, model.d_model, model.d_ff, model.num_steps) == (9, 32, 64, 6)
    assert (model.num_heads, model.time_features, model.hidden, model.lora_rank) == (4, 8, 12, 3)
    with pytest.raises(ValueError, match="d_ff must be a positive int"):
        build_model(_block(name="ode_transformer", d_ff=0, ode=ode), vocab_size=9)
