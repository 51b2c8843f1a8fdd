"""Tiny random Hugging Face models of each architecture seqlab converts, built with transformers
(a test-only dependency: the `interop` extra) and saved as model directories."""

import pathlib

import pytest

# The `interop` extra (CI installs it): without torch and transformers these modules are skipped.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 67

CONFIGS = {
    # Mamba-1, tied head, conv and projection biases on (every optional tensor present).
    "mamba": lambda: transformers.MambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=4,
        num_hidden_layers=2,
        conv_kernel=4,
        expand=2,
        time_step_rank=3,
        use_bias=True,
    ),
    # Mamba-2 with 2 groups (where transformers' norm differs from mamba_ssm's), untied head.
    "mamba2": lambda: transformers.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=8,
        n_groups=2,
        expand=2,
        chunk_size=8,
    ),
    # Qwen3-Next: both mixers, MoE and dense MLPs (mlp_only_layers), grouped value heads
    # (4 value heads on 2 key heads), grouped-query attention, partial rotary embedding.
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        mlp_only_layers=[1],
    ),
}

CLASSES = {
    "mamba": transformers.MambaForCausalLM,
    "mamba2": transformers.Mamba2ForCausalLM,
    "qwen3_next": transformers.Qwen3NextForCausalLM,
}


def build(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The random model `name` (its transformers init, then every parameter moved by N(0, 0.1^2)
    so that norms, biases and gates are not at their constant inits), in eval mode."""
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = CLASSES[name](config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def save(model: torch.nn.Module, path: pathlib.Path, **kwargs) -> pathlib.Path:
    """`save_pretrained` to `path` (safetensors); returns `path`."""
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path
