"""Qwen3-Next (`Qwen3NextForCausalLM` of Hugging Face transformers) <-> `LanguageModel`.

The model (`model.embed_tokens`, `model.layers.{i}`, `model.norm`, untied `lm_head`): every layer
is `x + mixer(norm(x))`, then `x + mlp(norm(x))` (`input_layernorm`, `post_attention_layernorm`),
all norms zero-centred RMSNorms (scale `1 + weight`). Layer `i`'s mixer is, by
`config.layer_types[i]`:

- "linear_attention" -> Gated DeltaNet ('g'): `in_proj_qkvz` fuses the q, k, v and output-gate
  projections grouped by key head (per key head `h`: `q_h [K] | k_h [K] | v [r V] | z [r V]` for
  `r = HV / H` value heads per key head), `in_proj_ba` the beta and gate inputs (per key head
  `b [r] | a [r]`), one depthwise conv runs over `q | k | v` (the same as one conv each); then
  `g = -exp(A_log) softplus(a + dt_bias)`, `beta = sigmoid(b)`, L2-normalized q and k, the gated
  delta rule, a per-head RMSNorm (weight not zero-centred) gated by `silu(z)`, `out_proj`: exactly
  `GatedDeltaNet(num_v_heads=HV)`.
- "full_attention" -> gated attention ('a'): `q_proj` emits per head the query and an output gate
  (`[q_h | gate_h]`, seqlab's `q_proj` and `g_proj`), zero-centred q/k RMSNorms, RoPE on the first
  `partial_rotary_factor * head_dim` channels, grouped-query softmax attention, the output times
  `sigmoid(gate)`, `o_proj`.

The MLP is the sparse mixture of experts ('e': softmax router, top-k, renormalized when
`norm_topk_prob`, a shared expert scaled by `sigmoid(shared_expert_gate(x))`) on layers with
`(i + 1) % decoder_sparse_step == 0` outside `mlp_only_layers`, a SwiGLU of width
`intermediate_size` ('d') elsewhere. The multi-token-prediction tensors of released checkpoints
(`mtp.*`, which transformers does not load either) are listed as ignored, never read.
"""

from seqlab.interop.rules import (
    Architecture,
    Rule,
    copy,
    grouped_linear,
    head_rules,
    linear,
    mixer_fields,
    positive_int,
    require,
    split_conv,
    stack_linear,
)
from seqlab.modules.lm import LanguageModel

MIXER_OF = {"linear_attention": "g", "full_attention": "a"}
LAYER_OF = {v: k for k, v in MIXER_OF.items()}


def layer_types(config) -> list[str]:
    """`config.layer_types`, or transformers' default (full attention every 4th layer)."""
    layers = positive_int(config, "num_hidden_layers")
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        types = [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
        ]
    if len(types) != layers or set(types) - set(MIXER_OF):
        raise ValueError(
            f"config layer_types must list {layers} of {sorted(MIXER_OF)}, got {types!r}"
        )
    return list(types)


def is_sparse(config, i: int) -> bool:
    """Whether layer `i` has the mixture of experts (transformers' `Qwen3NextDecoderLayer`)."""
    step = config.get("decoder_sparse_step", 1)
    return (
        i not in config.get("mlp_only_layers", [])
        and config.get("num_experts", 0) > 0
        and (i + 1) % step == 0
    )


def to_model(config, options) -> dict:
    del options
    require(config, "hidden_act", ("silu",), "the SiLU activation")
    require(config, "attention_bias", (False,), "attention without biases")
    require(config, "rope_scaling", (None,), "plain RoPE (no rope_scaling)")
    types = layer_types(config)
    layers = len(types)
    mlps = "".join("e" if is_sparse(config, i) else "d" for i in range(layers))
    eps = float(config.get("rms_norm_eps", 1e-6))
    head_dim = positive_int(config, "head_dim")
    rotary = int(head_dim * config.get("partial_rotary_factor", 0.25))
    key_dim, value_dim = (positive_int(config, f"linear_{x}_head_dim") for x in ("key", "value"))
    model = dict(
        vocab_size=positive_int(config, "vocab_size"),
        d_model=positive_int(config, "hidden_size"),
        pattern="".join(MIXER_OF[t] for t in types),
        mlp_pattern=mlps,
        norm_eps=eps,
        zero_centered_norm=True,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        gdn=dict(
            num_heads=positive_int(config, "linear_num_key_heads"),
            head_dim=key_dim,
            num_v_heads=positive_int(config, "linear_num_value_heads"),
            expand_v=value_dim / key_dim,
            conv_size=positive_int(config, "linear_conv_kernel_dim"),
            norm_eps=eps,
        ),
        attention=dict(
            num_heads=positive_int(config, "num_attention_heads"),
            num_kv_heads=positive_int(config, "num_key_value_heads"),
            head_dim=head_dim,
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rotary_dim=None if rotary == head_dim else rotary,
            qk_norm=True,
            zero_centered_norm=True,
            norm_eps=eps,
            output_gate=True,
        ),
    )
    if "d" in mlps:
        model["d_ff"] = positive_int(config, "intermediate_size")
    if "e" in mlps:
        model["moe"] = dict(
            d_ff=positive_int(config, "moe_intermediate_size"),
            num_experts=positive_int(config, "num_experts"),
            top_k=positive_int(config, "num_experts_per_tok"),
            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
            shared_d_ff=positive_int(config, "shared_expert_intermediate_size"),
        )
    return model


def to_config(model: LanguageModel) -> dict:
    if set(model.pattern) - set(LAYER_OF):
        raise ValueError(f"pattern {model.pattern!r} has mixers Qwen3-Next lacks (it has g, a)")
    if "-" in model.mlps:
        raise ValueError("Qwen3-Next has an MLP in every block; mlp_pattern has '-'")
    layers = len(model.pattern)
    config = dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        vocab_size=model.vocab_size,
        hidden_size=model.d_model,
        num_hidden_layers=layers,
        layer_types=[LAYER_OF[c] for c in model.pattern],
        rms_norm_eps=model.norm_eps,
        tie_word_embeddings=model.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        rope_scaling=None,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, c in enumerate(model.mlps) if c == "d"],
        intermediate_size=model.d_ff or 1,
        num_experts=0,
    )
    # Both mixers' sizes are needed even when one is absent: transformers reads them all.
    gdn, attention = mixer_fields(model, "g"), _attention_fields(model)
    config.update(
        linear_num_key_heads=gdn["num_heads"],
        linear_num_value_heads=gdn["num_v_heads"],
        linear_key_head_dim=gdn["head_dim"],
        linear_value_head_dim=round(gdn["expand_v"] * gdn["head_dim"]),
        linear_conv_kernel_dim=gdn["conv_size"],
        num_attention_heads=attention["num_heads"],
        num_key_value_heads=attention["num_kv_heads"],
        head_dim=attention["head_dim"],
        rope_theta=attention["rope_theta"],
        partial_rotary_factor=(attention["rotary_dim"] or attention["head_dim"])
        / attention["head_dim"],
    )
    if "e" in model.mlps:
        moe = model.make_mlp("e")
        config.update(
            num_experts=moe.num_experts,
            num_experts_per_tok=moe.top_k,
            moe_intermediate_size=moe.d_ff,
            shared_expert_intermediate_size=moe.shared_d_ff,
            norm_topk_prob=moe.norm_topk_prob,
        )
    return config


def _attention_fields(model: LanguageModel) -> dict:
    if "a" in model.pattern:
        return mixer_fields(model, "a")
    # No attention layer: any valid sizes (they build no tensor).
    return dict(num_heads=1, num_kv_heads=1, head_dim=2, rope_theta=10000.0, rotary_dim=None)


def rules(model: LanguageModel) -> list[Rule]:
    out = head_rules(model, "model.embed_tokens.weight", "model.norm.weight")
    for i, (mixer, mlp) in enumerate(zip(model.pattern, model.mlps, strict=True)):
        hf, sl = f"model.layers.{i}.", f"blocks_{i}/"
        out += [
            copy(hf + "input_layernorm.weight", sl + "mixer_norm/weight"),
            copy(hf + "post_attention_layernorm.weight", sl + "mlp_norm/weight"),
        ]
        if mixer == "g":
            out += _gdn_rules(model, hf + "linear_attn.", sl + "mixer/")
        else:
            out += _attention_rules(model, hf + "self_attn.", sl + "mixer/")
        if mlp == "e":
            out += _moe_rules(model, hf + "mlp.", sl + "mlp/")
        else:
            out += _swiglu_rules(hf + "mlp.", sl + "mlp/")
    return out


def _swiglu_rules(hf: str, sl: str) -> list[Rule]:
    return [
        linear(hf + "gate_proj.weight", sl + "gate/kernel"),
        linear(hf + "up_proj.weight", sl + "up/kernel"),
        linear(hf + "down_proj.weight", sl + "down/kernel"),
    ]


def _gdn_rules(model: LanguageModel, hf: str, sl: str) -> list[Rule]:
    f = mixer_fields(model, "g")
    heads, k, v_heads = f["num_heads"], f["head_dim"], f["num_v_heads"]
    v, r = round(f["expand_v"] * k), v_heads // heads
    projections = tuple(sl + p + "/kernel" for p in ("q_proj", "k_proj", "v_proj", "g_proj"))
    gates = (sl + "b_proj/kernel", sl + "a_proj/kernel")
    convs = tuple(sl + c for c in ("q_conv", "k_conv", "v_conv"))
    return [
        # Per key head: q [K] | k [K] | v [r V] | z [r V], and b [r] | a [r].
        grouped_linear(hf + "in_proj_qkvz.weight", projections, heads, (k, k, r * v, r * v)),
        grouped_linear(hf + "in_proj_ba.weight", gates, heads, (r, r)),
        split_conv(hf + "conv1d.weight", convs, (heads * k, heads * k, v_heads * v)),
        copy(hf + "dt_bias", sl + "dt_bias"),
        copy(hf + "A_log", sl + "A_log"),
        copy(hf + "norm.weight", sl + "o_norm/weight"),
        linear(hf + "out_proj.weight", sl + "o_proj/kernel"),
    ]


def _attention_rules(model: LanguageModel, hf: str, sl: str) -> list[Rule]:
    f = mixer_fields(model, "a")
    heads, dim = f["num_heads"], f["head_dim"]
    query_and_gate = (sl + "q_proj/kernel", sl + "g_proj/kernel")
    return [
        # Per head: the query [D], then the output gate [D].
        grouped_linear(hf + "q_proj.weight", query_and_gate, heads, (dim, dim)),
        linear(hf + "k_proj.weight", sl + "k_proj/kernel"),
        linear(hf + "v_proj.weight", sl + "v_proj/kernel"),
        linear(hf + "o_proj.weight", sl + "o_proj/kernel"),
        copy(hf + "q_norm.weight", sl + "q_norm/weight"),
        copy(hf + "k_norm.weight", sl + "k_norm/weight"),
    ]


def _moe_rules(model: LanguageModel, hf: str, sl: str) -> list[Rule]:
    moe = model.make_mlp("e")
    experts = range(moe.num_experts)
    out = [linear(hf + "gate.weight", sl + "router/kernel")]
    for proj in ("gate", "up", "down"):
        names = tuple(f"{hf}experts.{e}.{proj}_proj.weight" for e in experts)
        out.append(stack_linear(names, sl + proj))
    out += _swiglu_rules(hf + "shared_expert.", sl + "shared_expert/")
    out.append(linear(hf + "shared_expert_gate.weight", sl + "shared_gate/kernel"))
    return out


QWEN3_NEXT = Architecture("Qwen3NextForCausalLM", to_model, to_config, rules, ignored=("mtp.",))
