"""Mamba-1 (`MambaForCausalLM`) and Mamba-2 (`Mamba2ForCausalLM`) checkpoints of Hugging Face
transformers <-> `LanguageModel(pattern="m" * L)` / `pattern="2" * L` without MLPs.

Both are `backbone.embeddings`, `L` pre-norm residual blocks `x + mixer(RMSNorm(x))`
(`backbone.layers.{i}.norm`, `.mixer`), the final `backbone.norm_f` and `lm_head` (tied to the
embedding unless `tie_word_embeddings` is false), exactly `LanguageModel`'s structure.

Mamba-1 tensors (`nn.Linear` weights are `[out, in]`): `in_proj [2 d_inner, d]`, `conv1d [d_inner,
1, W]` (+ bias), `x_proj [dt_rank + 2 N, d_inner]` (rows `dt | B | C`), `dt_proj [d_inner,
dt_rank]` + bias (seqlab's `dt_bias`: `dt = softplus(dt_proj(x) + b)` in both), `A_log [d_inner,
N]`, `D`, `out_proj`. Mamba-2: `in_proj [2 d_inner + 2 G N + H, d]` (rows `z | x B C | dt`, as
seqlab's), `conv1d` over `x B C`, `dt_bias, A_log, D: [H]`, `norm [d_inner]`, `out_proj`.

The Mamba-2 output norm: transformers' pure-torch `Mamba2Mixer` normalizes the gated output over
all `d_inner` channels; `mamba_ssm` (the authors' kernels, which trained the published checkpoints)
and seqlab normalize each of the `G = n_groups` groups. They agree for `G = 1`. Loading defaults to
the per-group norm; the option `hf_mamba2_norm=True` reproduces transformers
(`Mamba2(norm_per_group=False)`).
"""

import math

from seqlab.interop.rules import (
    Architecture,
    Rule,
    conv,
    copy,
    head_rules,
    linear,
    mixer_fields,
    positive_int,
    require,
)
from seqlab.modules.lm import LanguageModel

PREFIX = "backbone."


def _lm_common(config, pattern_char: str) -> dict:
    require(config, "hidden_act", ("silu",), "the SiLU activation")
    layers = positive_int(config, "num_hidden_layers")
    return dict(
        vocab_size=positive_int(config, "vocab_size"),
        d_model=positive_int(config, "hidden_size"),
        pattern=pattern_char * layers,
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
    )


def _config_common(model: LanguageModel, model_type: str, architecture: str) -> dict:
    return dict(
        architectures=[architecture],
        model_type=model_type,
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        num_hidden_layers=len(model.pattern),
        layer_norm_epsilon=model.norm_eps,
        hidden_act="silu",
        tie_word_embeddings=model.tie_embeddings,
        residual_in_fp32=True,
    )


# -- Mamba-1 ------------------------------------------------------------------------------------


def mamba_to_model(config, options) -> dict:
    del options
    hidden = positive_int(config, "hidden_size")
    expand = config.get("expand", 2)
    intermediate = config.get("intermediate_size", expand * hidden)
    if not isinstance(expand, int) or intermediate != expand * hidden:
        raise NotImplementedError(
            f"config expand={expand!r}, intermediate_size={intermediate!r}: seqlab's Mamba needs "
            "intermediate_size = expand * hidden_size with an integer expand"
        )
    rank = config.get("time_step_rank", "auto")
    mamba = dict(
        d_state=positive_int(config, "state_size"),
        conv_size=positive_int(config, "conv_kernel"),
        expand=expand,
        dt_rank=math.ceil(hidden / 16) if rank == "auto" else rank,
        use_bias=bool(config.get("use_bias", False)),
        conv_bias=bool(config.get("use_conv_bias", True)),
    )
    return dict(
        **_lm_common(config, "m"),
        mamba=mamba,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
    )


def mamba_to_config(model: LanguageModel) -> dict:
    m = mixer_fields(model, "m")
    return dict(
        **_config_common(model, "mamba", "MambaForCausalLM"),
        state_size=m["d_state"],
        conv_kernel=m["conv_size"],
        expand=m["expand"],
        intermediate_size=m["expand"] * model.d_model,
        time_step_rank=m["dt_rank"],
        use_bias=m["use_bias"],
        use_conv_bias=m["conv_bias"],
    )


def _backbone_rules(model: LanguageModel, mixer_rules) -> list[Rule]:
    """The embedding, head and per layer `i` the norm and `mixer_rules(hf_prefix, seqlab_prefix)`
    (`backbone.layers.{i}.mixer.` <-> `blocks_{i}/mixer/`)."""
    rules = head_rules(model, PREFIX + "embeddings.weight", PREFIX + "norm_f.weight")
    for i in range(len(model.pattern)):
        hf, sl = f"{PREFIX}layers.{i}.", f"blocks_{i}/"
        rules.append(copy(hf + "norm.weight", sl + "mixer_norm/weight"))
        rules += mixer_rules(hf + "mixer.", sl + "mixer/")
    return rules


def mamba_rules(model: LanguageModel) -> list[Rule]:
    m = mixer_fields(model, "m")

    def mixer(hf: str, to: str) -> list[Rule]:
        rules = [
            linear(hf + "in_proj.weight", to + "in_proj/kernel"),
            conv(hf + "conv1d.weight", to + "conv_weight"),
            linear(hf + "x_proj.weight", to + "x_proj"),
            linear(hf + "dt_proj.weight", to + "dt_proj"),
            copy(hf + "dt_proj.bias", to + "dt_bias"),
            copy(hf + "A_log", to + "A_log"),
            copy(hf + "D", to + "D"),
            linear(hf + "out_proj.weight", to + "out_proj/kernel"),
        ]
        if m["conv_bias"]:
            rules.append(copy(hf + "conv1d.bias", to + "conv_bias"))
        if m["use_bias"]:
            rules.append(copy(hf + "in_proj.bias", to + "in_proj/bias"))
            rules.append(copy(hf + "out_proj.bias", to + "out_proj/bias"))
        return rules

    return _backbone_rules(model, mixer)


MAMBA = Architecture("MambaForCausalLM", mamba_to_model, mamba_to_config, mamba_rules, options={})


# -- Mamba-2 ------------------------------------------------------------------------------------


def mamba2_to_model(config, options) -> dict:
    require(config, "use_bias", (False,), "projections without bias")
    require(config, "use_conv_bias", (True,), "a convolution with bias")
    require(config, "rms_norm", (True,), "the gated RMSNorm output")
    limit = tuple(config.get("time_step_limit", (0.0, float("inf"))))
    if limit != (0.0, float("inf")):
        raise NotImplementedError(f"config time_step_limit={limit}: seqlab does not clamp dt")
    hidden = positive_int(config, "hidden_size")
    expand = config.get("expand", 2)
    head_dim, heads = positive_int(config, "head_dim"), positive_int(config, "num_heads")
    if not isinstance(expand, int) or expand * hidden != heads * head_dim:
        raise ValueError(
            f"config expand={expand!r}, num_heads={heads}, head_dim={head_dim}: need an integer "
            f"expand with expand * hidden_size = num_heads * head_dim"
        )
    mamba2 = dict(
        d_state=positive_int(config, "state_size"),
        head_dim=head_dim,
        expand=expand,
        n_groups=positive_int(config, "n_groups"),
        conv_size=positive_int(config, "conv_kernel"),
        chunk_size=positive_int(config, "chunk_size"),
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        norm_per_group=not options["hf_mamba2_norm"],
    )
    return dict(
        **_lm_common(config, "2"),
        mamba2=mamba2,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def mamba2_to_config(model: LanguageModel) -> dict:
    m = mixer_fields(model, "2")
    d_inner = m["expand"] * model.d_model
    return dict(
        **_config_common(model, "mamba2", "Mamba2ForCausalLM"),
        state_size=m["d_state"],
        head_dim=m["head_dim"],
        num_heads=d_inner // m["head_dim"],
        expand=m["expand"],
        n_groups=m["n_groups"],
        conv_kernel=m["conv_size"],
        chunk_size=m["chunk_size"],
        use_bias=False,
        use_conv_bias=True,
        rms_norm=True,
    )


def mamba2_rules(model: LanguageModel) -> list[Rule]:
    def mixer(hf: str, to: str) -> list[Rule]:
        return [
            linear(hf + "in_proj.weight", to + "in_proj/kernel"),
            conv(hf + "conv1d.weight", to + "conv_weight"),
            copy(hf + "conv1d.bias", to + "conv_bias"),
            copy(hf + "dt_bias", to + "dt_bias"),
            copy(hf + "A_log", to + "A_log"),
            copy(hf + "D", to + "D"),
            copy(hf + "norm.weight", to + "norm_weight"),
            linear(hf + "out_proj.weight", to + "out_proj/kernel"),
        ]

    return _backbone_rules(model, mixer)


MAMBA2 = Architecture(
    "Mamba2ForCausalLM",
    mamba2_to_model,
    mamba2_to_config,
    mamba2_rules,
    options={"hf_mamba2_norm": False},
    options_of=lambda model: {"hf_mamba2_norm": not mixer_fields(model, "2")["norm_per_group"]},
)
