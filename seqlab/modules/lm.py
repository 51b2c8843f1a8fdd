"""A hybrid language model: embedding, one residual block per pattern character, tied head; presets.

`pattern` spells the stack, one character per block:

    'm'  Mamba (Mamba-1)          'a'  global causal attention
    '2'  Mamba-2                  's'  sliding-window attention (window from `attention`)
    'g'  Gated DeltaNet           'k'  Kimi Delta Attention
    'n'  Gated DeltaNet-2         'p'  Gated DeltaProduct

Every block is `Block(mixer, mlp)`: `x + mixer(RMSNorm(x))`, then `x + mlp(RMSNorm(x))` when the
block has an MLP. `mlp_pattern` spells the MLPs, one character per block:

    'd'  SwiGLU of width `d_ff`   'e'  mixture of experts (`MoE`, keyword arguments `moe`)
    '-'  none

and defaults to 'd' everywhere when `d_ff` is set, '-' otherwise. The head is tied to the
embedding (`TiedEmbedding`): `logits = RMSNorm(h) @ E^T`, in float32 (float64 for a float64
model), or has weights of its own with `tie_embeddings=False`. `zero_centered_norm` makes every
block norm and the final norm zero-centred (scale `1 + weight`, Qwen3-Next).

`python -m seqlab.modules.lm` prints the parameter count of every preset (shapes only, no
allocation).
"""

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import FrozenDict

from seqlab.modules.attention import Attention
from seqlab.modules.block import Block
from seqlab.modules.embedding import TiedEmbedding
from seqlab.modules.gated_deltanet import GatedDeltaNet
from seqlab.modules.gated_deltanet2 import GatedDeltaNet2
from seqlab.modules.gated_deltaproduct import GatedDeltaProduct
from seqlab.modules.kda import KimiDeltaAttention
from seqlab.modules.mamba import Mamba
from seqlab.modules.mamba2 import Mamba2
from seqlab.modules.mixer import check_lengths
from seqlab.modules.mlp import SwiGLU
from seqlab.modules.moe import MoE
from seqlab.ops.checks import check_positive_int, check_shape

MIXERS = {
    "m": "Mamba",
    "2": "Mamba2",
    "g": "GatedDeltaNet",
    "k": "KimiDeltaAttention",
    "n": "GatedDeltaNet2",
    "p": "GatedDeltaProduct",
    "a": "global causal Attention",
    "s": "sliding-window Attention",
}
"""Pattern letter -> the mixer a `LanguageModel` block runs for it."""
MLPS = {"d": "SwiGLU (d_ff)", "e": "mixture of experts (moe)", "-": "no MLP"}
"""MLP letter (after a mixer letter in a pattern) -> the block's MLP."""


class LanguageModel(nn.Module):
    """Token model over a stack of mixers given by `pattern` (see the module docstring).

    `__call__(tokens: [B, T] int) -> logits [B, T, vocab_size]`, the same as
    `logits_from_embeddings(embed(tokens))`; `init_cache(batch_size, max_len)` -> a tuple of
    per-block caches; `step(tokens_t: [B] int, cache) -> (logits_t [B, vocab_size],
    cache)`, equal to `__call__` token by token; `extend(tokens: [B, T], cache, lengths=None)`
    (prefill with per-row lengths), `verify(tokens: [B, n], cache) -> (logits, trail)` and
    `accept(trail, m: [B]) -> cache` (speculative decoding), as in `seqlab.modules.mixer`.

    Attributes:
      vocab_size: number of tokens.
      d_model: model width.
      pattern: one character per block from `MIXERS`.
      d_ff: hidden width of the SwiGLU MLPs ('d' in `mlp_pattern`), or None.
      mlp_pattern: one character per block from `MLPS`; None: 'd' per block when `d_ff` is set,
        '-' otherwise.
      moe: keyword arguments of `MoE` for 'e' MLPs (`d_ff`, `num_experts`, `top_k` required).
      mamba, mamba2, gdn: keyword arguments of `Mamba`, `Mamba2`, `GatedDeltaNet`.
      kda, gdn2, gdp: keyword arguments of `KimiDeltaAttention`, `GatedDeltaNet2`,
        `GatedDeltaProduct`.
      attention: keyword arguments of `Attention` for 'a' and 's' blocks (`num_heads` required;
        'a' blocks ignore `window`, 's' blocks require it).
      norm_eps: epsilon of the block norms and the final norm.
      zero_centered_norm: zero-centred block and final norms (scale `1 + weight`).
      tie_embeddings: the readout reuses the embedding; False gives it weights of its own.
      dtype: compute dtype of every layer; param_dtype: parameter dtype.
      seq_axis: the mesh axis the time axis is split over when the module runs inside
        `shard_map` (sequence parallelism), passed to every mixer; None: the whole sequence is
        local. `__call__` then maps the local piece of `tokens` to its logits; decoding ignores
        it.
    """

    vocab_size: int
    d_model: int
    pattern: str
    d_ff: int | None = None
    mamba: Mapping[str, Any] = FrozenDict()
    mamba2: Mapping[str, Any] = FrozenDict()
    gdn: Mapping[str, Any] = FrozenDict()
    kda: Mapping[str, Any] = FrozenDict()
    gdn2: Mapping[str, Any] = FrozenDict()
    gdp: Mapping[str, Any] = FrozenDict()
    attention: Mapping[str, Any] = FrozenDict()
    mlp_pattern: str | None = None
    moe: Mapping[str, Any] = FrozenDict()
    norm_eps: float = 1e-5
    zero_centered_norm: bool = False
    tie_embeddings: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    seq_axis: str | None = None

    def __post_init__(self):
        # Keyword blocks frozen (dicts to FrozenDict, lists to tuples, as from JSON configs) so
        # that the model hashes and can be a static argument of `jax.jit`.
        for field in _BLOCKS:
            object.__setattr__(self, field, _frozen(getattr(self, field)))
        check_positive_int("vocab_size", self.vocab_size)
        check_positive_int("d_model", self.d_model)
        if self.d_ff is not None:
            check_positive_int("d_ff", self.d_ff)
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"pattern must be a non-empty string over {list(MIXERS)}")
        unknown = sorted(set(self.pattern) - set(MIXERS))
        if unknown:
            raise ValueError(f"pattern has unknown characters {unknown}; known: {MIXERS}")
        if set(self.pattern) & {"a", "s"} and "num_heads" not in self.attention:
            raise ValueError("attention must set num_heads when pattern has 'a' or 's' blocks")
        if "s" in self.pattern and self.attention.get("window") is None:
            raise ValueError("attention must set window when pattern has 's' blocks")
        mlps = self.mlps
        if len(mlps) != len(self.pattern) or set(mlps) - set(MLPS):
            raise ValueError(
                f"mlp_pattern must have one character from {MLPS} per block "
                f"({len(self.pattern)}), got {self.mlp_pattern!r}"
            )
        if "d" in mlps and self.d_ff is None:
            raise ValueError("d_ff must be set when mlp_pattern has 'd' blocks")
        if "e" in mlps and not self.moe:
            raise ValueError("moe must be set when mlp_pattern has 'e' blocks")
        super().__post_init__()

    @property
    def mlps(self) -> str:
        """The MLP of every block, one character of `MLPS` each (`mlp_pattern` or its default)."""
        if self.mlp_pattern is not None:
            return self.mlp_pattern
        return ("-" if self.d_ff is None else "d") * len(self.pattern)

    def make_mixer(self, kind: str) -> nn.Module:
        """The unbound mixer of a pattern character (its `Block` adopts it)."""
        common = dict(
            d_model=self.d_model,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            seq_axis=self.seq_axis,
        )
        if kind == "m":
            return Mamba(**self.mamba, **common, parent=None)
        if kind == "2":
            return Mamba2(**self.mamba2, **common, parent=None)
        if kind == "g":
            return GatedDeltaNet(**self.gdn, **common, parent=None)
        if kind == "k":
            return KimiDeltaAttention(**self.kda, **common, parent=None)
        if kind == "n":
            return GatedDeltaNet2(**self.gdn2, **common, parent=None)
        if kind == "p":
            return GatedDeltaProduct(**self.gdp, **common, parent=None)
        window = None if kind == "a" else self.attention["window"]
        return Attention(**{**self.attention, "window": window}, **common, parent=None)

    def make_mlp(self, kind: str) -> nn.Module | None:
        """The unbound MLP of an `mlp_pattern` character (None for '-')."""
        if kind == "d":
            return SwiGLU(self.d_model, self.d_ff, self.dtype, self.param_dtype, parent=None)
        if kind == "e":
            common = dict(d_model=self.d_model, dtype=self.dtype, param_dtype=self.param_dtype)
            return MoE(**self.moe, **common, parent=None)
        return None

    def setup(self):
        self.embedding = TiedEmbedding(
            self.vocab_size,
            self.d_model,
            "rms",
            self.norm_eps,
            self.dtype,
            self.param_dtype,
            tie=self.tie_embeddings,
            zero_centered=self.zero_centered_norm,
        )
        self.blocks = [
            Block(
                mixer=self.make_mixer(kind),
                mlp=self.make_mlp(mlp),
                norm_eps=self.norm_eps,
                zero_centered_norm=self.zero_centered_norm,
            )
            for kind, mlp in zip(self.pattern, self.mlps, strict=True)
        ]

    def embed(self, tokens: jax.Array) -> jax.Array:
        """`tokens: [B, T]` (or `[B]`) int -> embeddings `[..., d_model]` in the compute dtype."""
        return self.embedding.embed(tokens)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """`tokens: [B, T]` int -> logits `[B, T, vocab_size]`."""
        _check_tokens("tokens", tokens, (None, None), "[B, T]")
        return self.logits_from_embeddings(self.embed(tokens))

    def logits_from_embeddings(self, h: jax.Array) -> jax.Array:
        """The model after its embedding: `h: [B, T, d_model]` -> logits `[B, T, vocab_size]`
        (differentiable in `h`, for influence measurements)."""
        check_shape("h", h, (None, None, self.d_model), "[B, T, d_model]")
        for block in self.blocks:
            h = block(h)
        return self.embedding.readout(h)

    def init_cache(self, batch_size: int, max_len: int) -> tuple:
        """Zero decoding cache: one mixer cache per block."""
        return tuple(block.init_cache(batch_size, max_len) for block in self.blocks)

    def step(self, tokens_t: jax.Array, cache: tuple) -> tuple[jax.Array, tuple]:
        """One decoding step: `tokens_t: [B]` int -> (logits `[B, vocab_size]`, new cache)."""
        _check_tokens("tokens_t", tokens_t, (None,), "[B]")
        self._check_cache("cache", cache)
        h = self.embed(tokens_t)
        new_cache = []
        for block, block_cache in zip(self.blocks, cache, strict=True):
            h, block_cache = block.step(h, block_cache)
            new_cache.append(block_cache)
        return self.embedding.readout(h), tuple(new_cache)

    def extend(self, tokens: jax.Array, cache: tuple, lengths=None) -> tuple[jax.Array, tuple]:
        """Prefill (or continue) from `cache` through every block's sequence path: `tokens: [B, T]`
        int, row `b`'s first `lengths[b]` real (`lengths: [B]` int, None: all `T`; right
        padding) -> (logits `[B, T, vocab_size]`, the cache after each row's real tokens).
        Logits at pad positions are unspecified; `lengths[b] = 0` leaves row `b`'s cache as it
        was. Equal to `step` token by token at the real positions."""
        _check_tokens("tokens", tokens, (None, None), "[B, T]")
        lengths = check_lengths("lengths", lengths, *tokens.shape)
        self._check_cache("cache", cache)
        h = self.embed(tokens)
        new_cache = []
        for block, block_cache in zip(self.blocks, cache, strict=True):
            h, block_cache = block.extend(h, block_cache, lengths)
            new_cache.append(block_cache)
        return self.embedding.readout(h), tuple(new_cache)

    def verify(self, tokens: jax.Array, cache: tuple) -> tuple[jax.Array, tuple]:
        """Speculative decoding's check of `n` draft tokens `tokens: [B, n]` int from `cache`:
        (logits `[B, n, vocab_size]`, equal to `step` token by token, and the trail, one per
        block, from which `accept` rebuilds the cache after any prefix)."""
        _check_tokens("tokens", tokens, (None, None), "[B, n]")
        self._check_cache("cache", cache)
        h = self.embed(tokens)
        trail = []
        for block, block_cache in zip(self.blocks, cache, strict=True):
            h, block_trail = block.verify(h, block_cache)
            trail.append(block_trail)
        return self.embedding.readout(h), tuple(trail)

    def accept(self, trail: tuple, m: jax.Array) -> tuple:
        """The cache after each row's first `m[b]` tokens (`m: [B]` int in `[0, n]`) of the
        `verify` that made `trail`, bit for bit the cache of stepping them."""
        self._check_cache("trail", trail)
        return tuple(block.accept(t, m) for block, t in zip(self.blocks, trail, strict=True))

    def _check_cache(self, name: str, cache: tuple) -> None:
        if len(cache) != len(self.blocks):
            raise ValueError(f"{name} must hold {len(self.blocks)} block caches, got {len(cache)}")


_BLOCKS = ("mamba", "mamba2", "gdn", "kda", "gdn2", "gdp", "attention", "moe")


def _frozen(value):
    """`value` with every mapping a `FrozenDict` and every list a tuple, recursively."""
    if isinstance(value, Mapping):
        return FrozenDict({k: _frozen(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _check_tokens(name: str, tokens, expected: tuple, layout: str) -> None:
    if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {jnp.result_type(tokens)}")
    check_shape(name, tokens, expected, layout)


def param_shapes(model: LanguageModel) -> dict:
    """The parameters of `model` as `jax.ShapeDtypeStruct`s (`jax.eval_shape`, nothing
    allocated): the `"params"` collection, nested dicts."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def count_params(model: LanguageModel) -> int:
    """Number of parameters of `model`, from shapes only (nothing allocated)."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(param_shapes(model)))


# ---------------------------------------------------------------------------------------------
# Presets
#
# Gated DeltaNet paper configurations (Yang, Kautz, Hatamizadeh, arXiv 2412.06464), read from the
# authors' code, NVlabs/GatedDeltaNet lit_gpt/config.py (commit 5ddd1e4). Common: vocab 32000, a
# SwiGLU MLP in every block, RMSNorm eps 1e-5, tied embeddings, sliding-window attention with window
# 2048 and 128-wide multi-head attention heads, RoPE theta 10000 on the full head.
#   GatedDeltaNet_0.4B:    11 layers, width 1536, MLP 6144, all Gated DeltaNet.
#   GatedDeltaNet_H1_0.4B: 12 layers, width 1536, MLP 6144, 12 heads, GDN/SWA alternating.
#   GatedDeltaNet_1.3B:    16 layers, width 2400, MLP 5888, all Gated DeltaNet.
#   GatedDeltaNet_H1_1.3B: 18 layers, width 2304, MLP 6144, 18 heads, GDN/SWA alternating.
# Their Gated DeltaNet layer (lit_gpt/gated_delta_net.py) is built with its defaults: 9 heads, key
# width 0.75 d_model, value width 1.5 d_model, i.e. `head_dim = d_model / 12`, `expand_v = 2`.
# As built, the "0.4B" configurations hold 0.52-0.54B parameters (the paper's text says 400M for
# them, its Table S.2 "500M" for the hybrids), the 1.3B ones 1.31-1.35B.
# H2 is "Mamba2 + Gated DeltaNet + SWA" in that order (paper, Fig. 1 and Table S.2) but has no
# configuration in the repository: its presets are reconstructed from H1's width, depth, heads and
# MLP with Mamba-2's defaults (d_state 128, head_dim 64, expand 2).

_PAPER = dict(vocab_size=32000, norm_eps=1e-5)


def _paper_gdn(d_model: int, pattern: str, d_ff: int, heads: int | None = None) -> dict:
    """A paper configuration; `heads` of the sliding-window (2048) attention of the hybrids."""
    gdn = {"num_heads": 9, "head_dim": d_model // 12, "expand_v": 2}
    config = dict(**_PAPER, d_model=d_model, pattern=pattern, d_ff=d_ff, gdn=gdn)
    if heads is not None:
        config["attention"] = {"num_heads": heads, "window": 2048}
    return config


# DeltaProduct paper configurations (Siems et al., arXiv 2502.10297), read from the authors' code,
# automl/DeltaProduct "language_modeling /model_configs/delta_product_340m_-1_1_{2,3}.json" (commit
# 38cd4e4): DeltaProduct_n[-1, 1] for n = 2, 3 Householder writes, 24 layers, width 1024, 8 heads of
# width 128 (keys and values, expand_v 1), negative eigenvalues allowed, no forget gate and no
# output gate (use_forget_gate, use_gate false), short convolutions of width 4, RMSNorm eps 1e-6
# (blocks and mixer), tied 32000-token embedding, SwiGLU MLP of fla's hidden_ratio 4, i.e. width
# 256 * ceil(int(1024 * 4 * 2 / 3) / 256) = 2816. As built they hold 0.39B (n = 2) and 0.44B (n = 3)
# parameters; "340M" is the paper's size label (that of fla's 340M configurations, n = 1).
# The Kimi Linear paper (arXiv 2510.26692) gives no small dense configuration we could read (its
# model is a 48B-parameter MoE), nor do we know a published Gated DeltaNet-2 configuration: KDA
# and Gated DeltaNet-2 have tiny presets only.


def _paper_deltaproduct(num_householder: int) -> dict:
    """DeltaProduct_n[-1, 1] at the paper's 340M size, `n = num_householder`."""
    gdp = dict(
        num_heads=8,
        head_dim=128,
        expand_v=1,
        num_householder=num_householder,
        allow_neg_eigval=True,
        use_forget_gate=False,
        use_output_gate=False,
        norm_eps=1e-6,
    )
    return dict(vocab_size=32000, d_model=1024, pattern="p" * 24, d_ff=2816, norm_eps=1e-6, gdp=gdp)


_TINY_ATTENTION = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "window": 4}
_TINY_MAMBA2 = {"d_state": 8, "head_dim": 16, "chunk_size": 4}
_TINY_GDN = {"num_heads": 2, "head_dim": 8, "chunk_size": 4}
_TINY_GDP = {**_TINY_GDN, "num_householder": 2}
_TINY = dict(vocab_size=61, d_model=32, norm_eps=1e-5)

PRESETS: dict[str, dict] = {
    "gdn-0.4b": _paper_gdn(1536, "g" * 11, 6144),
    "gdn-h1-0.4b": _paper_gdn(1536, "gs" * 6, 6144, heads=12),
    "gdn-h2-0.4b": _paper_gdn(1536, "2gs" * 4, 6144, heads=12),
    "gdn-1.3b": _paper_gdn(2400, "g" * 16, 5888),
    "gdn-h1-1.3b": _paper_gdn(2304, "gs" * 9, 6144, heads=18),
    "gdn-h2-1.3b": _paper_gdn(2304, "2gs" * 6, 6144, heads=18),
    "dp2-340m": _paper_deltaproduct(2),
    "dp3-340m": _paper_deltaproduct(3),
    # Tiny models for tests, one per pattern family (one block per pure family, to compile fast).
    "tiny-mamba": dict(**_TINY, pattern="m", mamba={"d_state": 4}),
    "tiny-polar-mamba": dict(**_TINY, pattern="m", mamba={"d_state": 4, "polarize": (1, 1)}),
    "tiny-mamba2": dict(**_TINY, pattern="2", d_ff=48, mamba2=_TINY_MAMBA2),
    "tiny-gdn": dict(**_TINY, pattern="g", d_ff=48, gdn=_TINY_GDN),
    "tiny-kda": dict(**_TINY, pattern="k", d_ff=48, kda=_TINY_GDN),
    "tiny-gdn2": dict(**_TINY, pattern="n", d_ff=48, gdn2=_TINY_GDN),
    "tiny-gdp": dict(**_TINY, pattern="p", d_ff=48, gdp=_TINY_GDP),
    "tiny-attention": dict(**_TINY, pattern="as", d_ff=48, attention=_TINY_ATTENTION),
    "tiny-h1": dict(**_TINY, pattern="gs", d_ff=48, gdn=_TINY_GDN, attention=_TINY_ATTENTION),
    # Qwen3-Next's layout (seqlab.interop): zero-centred norms, untied head, gated attention with
    # partial rotary and q/k norms, grouped value heads, mixture-of-experts and dense MLPs.
    "tiny-qwen3-next": dict(
        **_TINY,
        pattern="gga",
        mlp_pattern="ede",
        d_ff=48,
        moe={"d_ff": 16, "num_experts": 4, "top_k": 2, "shared_d_ff": 24},
        gdn={**_TINY_GDN, "num_v_heads": 4},
        attention={
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 8,
            "rotary_dim": 4,
            "qk_norm": True,
            "zero_centered_norm": True,
            "output_gate": True,
        },
        zero_centered_norm=True,
        tie_embeddings=False,
    ),
    "tiny-h2": dict(
        **_TINY,
        pattern="2gs",
        d_ff=48,
        mamba2=_TINY_MAMBA2,
        gdn=_TINY_GDN,
        attention=_TINY_ATTENTION,
    ),
}
"""Preset name -> `LanguageModel` fields (`preset(name)` builds it; `python -m seqlab.modules.lm`
prints their parameter counts)."""


def preset(name: str, **overrides) -> LanguageModel:
    """The `LanguageModel` of a preset in `PRESETS`, with keyword overrides of its fields."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {sorted(PRESETS)}, got {name!r}")
    return LanguageModel(**{**PRESETS[name], **overrides})


if __name__ == "__main__":
    for preset_name in PRESETS:
        print(f"{preset_name:18s} {count_params(preset(preset_name)):>15,d}")
