"""Tests of seqlab.train.models: names to patterns, polarization, presets, dtypes, errors (no
model is run: building a LanguageModel only validates its fields)."""

import jax.numpy as jnp
import ml_collections
import pytest

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
    ],
)
def test_names_build_their_stacks(name, pattern):
    model = build_model(_block(name=name), vocab_size=11)
    assert model.pattern == pattern and model.vocab_size == 11 and model.d_ff is None
    assert model.mamba.get("polarize") == ((1, 1) if name == "polar_mamba" else None)


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
