"""How a checkpoint's tensors become seqlab parameters and back: `Rule`s and `Architecture`s.

A `Rule` ties a group of Hugging Face tensors to a group of seqlab parameters (paths
`"blocks_0/mixer/in_proj/kernel"`) with two functions, each the inverse of the other: `to_seqlab`
(HF arrays -> parameter arrays) and `to_hf`. Most rules are one tensor to one parameter (a
transposed `nn.Linear` weight, a copied vector); fused projections split one tensor into several
parameters and expert weights stack several tensors into one. The functions use `jax.numpy`, so
`jax.eval_shape` gives every expected HF shape from the model's parameter shapes before any data
is read.
"""

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax.numpy as jnp

from seqlab.modules.lm import LanguageModel


@dataclass(frozen=True)
class Rule:
    """`hf` tensors <-> `params` parameters (see the module docstring)."""

    hf: tuple[str, ...]
    params: tuple[str, ...]
    to_seqlab: Callable[..., tuple]
    to_hf: Callable[..., tuple]


@dataclass(frozen=True)
class Architecture:
    """A Hugging Face architecture (`config.json`'s `architectures[0]`) seqlab converts.

    Attributes:
      name: e.g. "MambaForCausalLM".
      to_model: `(hf_config, options) -> LanguageModel keyword arguments`; raises
        `NotImplementedError` naming the config key of an option seqlab does not implement.
      to_config: `LanguageModel -> hf_config` (the inverse; `hf.save_hf` checks that it is).
      rules: `LanguageModel -> list[Rule]`, covering every parameter once.
      ignored: name prefixes of checkpoint tensors the CausalLM forward does not use (reported,
        never read), e.g. Qwen3-Next's multi-token-prediction head `mtp.`.
      options: the keyword options of `to_model` and their defaults.
      options_of: `LanguageModel -> options` that give it back from its config (for saving).
    """

    name: str
    to_model: Callable[[Mapping, Mapping], dict]
    to_config: Callable[[LanguageModel], dict]
    rules: Callable[[LanguageModel], list[Rule]]
    ignored: tuple[str, ...] = ()
    options: Mapping = dataclasses.field(default_factory=dict)
    options_of: Callable[[LanguageModel], dict] = lambda model: {}


def require(config, key: str, allowed, what: str):
    """`config[key]` (or its default when absent), which must be in `allowed`; otherwise
    `NotImplementedError` naming the key."""
    value = config.get(key, allowed[0])
    if value not in allowed:
        raise NotImplementedError(f"config {key}={value!r}: seqlab implements {what} only")
    return value


def positive_int(config, key: str) -> int:
    """`config[key]`, a positive int, or `ValueError` naming the key."""
    if key not in config:
        raise ValueError(f"config {key} is missing")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config {key} must be a positive int, got {value!r}")
    return value


def head_rules(model: LanguageModel, embedding: str, norm: str) -> list[Rule]:
    """The embedding, final norm and (untied) head, `lm_head.weight`."""
    rules = [copy(embedding, "embedding/embedding"), copy(norm, "embedding/norm/weight")]
    if not model.tie_embeddings:
        rules.append(copy("lm_head.weight", "embedding/head"))
    return rules


def linear(hf: str, path: str) -> Rule:
    """`nn.Linear.weight: [out, in]` <-> Dense `kernel: [in, out]` (or a bare `[in, out]` param)."""
    return Rule((hf,), (path,), lambda w: (w.T,), lambda k: (k.T,))


def copy(hf: str, path: str) -> Rule:
    """The same array on both sides (vectors: norms, biases, `A_log`, `D`, embeddings)."""
    return Rule((hf,), (path,), lambda a: (a,), lambda a: (a,))


def conv(hf: str, path: str) -> Rule:
    """Depthwise `nn.Conv1d.weight: [C, 1, W]` <-> `[W, C]` (last tap on the current token)."""
    return Rule((hf,), (path,), lambda w: (w[:, 0, :].T,), lambda w: (w.T[:, None, :],))


def split_conv(hf: str, paths: tuple[str, ...], widths: tuple[int, ...]) -> Rule:
    """One depthwise conv over concatenated channels <-> one `[W, C_i]` weight per part: a
    depthwise convolution acts per channel, so the fused one is the separate ones side by side."""
    cuts = _cuts(widths)

    def to_seqlab(w):
        return tuple(part[:, 0, :].T for part in jnp.split(w, cuts, axis=0))

    def to_hf(*parts):
        return (jnp.concatenate([p.T[:, None, :] for p in parts], axis=0),)

    return Rule((hf,), paths, to_seqlab, to_hf)


def grouped_linear(hf: str, paths: tuple[str, ...], groups: int, widths: tuple[int, ...]) -> Rule:
    """A fused `nn.Linear.weight` whose output rows are grouped (per head): each of the `groups`
    groups holds a part of `widths[i]` rows for each of `paths` in turn <-> one Dense kernel
    `[in, groups * widths[i]]` per part (group-major columns)."""
    cuts = _cuts(widths)

    def to_seqlab(w):
        parts = jnp.split(w.reshape(groups, sum(widths), w.shape[-1]), cuts, axis=1)
        return tuple(p.reshape(-1, w.shape[-1]).T for p in parts)

    def to_hf(*kernels):
        parts = [k.T.reshape(groups, -1, k.shape[0]) for k in kernels]
        return (jnp.concatenate(parts, axis=1).reshape(-1, kernels[0].shape[0]),)

    return Rule((hf,), paths, to_seqlab, to_hf)


def stack_linear(hfs: tuple[str, ...], path: str) -> Rule:
    """Several `nn.Linear.weight: [out, in]` (one per expert) <-> one `[E, in, out]` parameter."""

    def to_seqlab(*ws):
        return (jnp.stack([w.T for w in ws]),)

    def to_hf(stacked):
        return tuple(jnp.swapaxes(stacked, 1, 2))

    return Rule(hfs, (path,), to_seqlab, to_hf)


def _cuts(widths: tuple[int, ...]) -> list[int]:
    """Split points of consecutive parts of `widths` (for `jnp.split`)."""
    cuts, total = [], 0
    for width in widths[:-1]:
        total += width
        cuts.append(total)
    return cuts


def fields(module) -> dict:
    """The dataclass fields of an (unbound) Flax module, defaults filled in."""
    skip = ("parent", "name")
    return {
        f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.name not in skip
    }


# Fields whose None means a value a property computes (`dt_rank=None` is `ceil(d_model / 16)`).
_DEFAULTED = {
    "dt_rank": "effective_dt_rank",
    "num_v_heads": "v_heads",
    "num_kv_heads": "kv_heads",
    "head_dim": "head_size",
}


def _normalized(mixer) -> dict:
    """The fields of `mixer` with the `_DEFAULTED` ones resolved (so that `None` and the value it
    stands for compare equal), a full-head `rotary_dim` as None."""
    out = fields(mixer)
    for field, prop in _DEFAULTED.items():
        if field in out and hasattr(mixer, prop):
            out[field] = getattr(mixer, prop)
    if out.get("rotary_dim") is not None and out["rotary_dim"] == out.get("head_dim"):
        out["rotary_dim"] = None
    return out


def mixer_fields(model: LanguageModel, kind: str) -> dict:
    """The fields of the mixer of pattern character `kind` in `model`, defaults filled in and
    the `_DEFAULTED` ones resolved (`_normalized`)."""
    return _normalized(model.make_mixer(kind))
