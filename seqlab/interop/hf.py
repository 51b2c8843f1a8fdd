"""Hugging Face checkpoints in and out: `load_hf(path) -> Converted(model, params, ...)` and
`save_hf(model, params, path)`.

    converted = load_hf("mamba-130m-hf")               # a local directory (config + safetensors)
    logits = converted.model.apply({"params": converted.params}, tokens)
    save_hf(converted.model, converted.params, "out")  # transformers' from_pretrained reads it

Every check runs before any tensor is converted, from the config and the file headers: the
architecture must be one of `ARCHITECTURES`, every config option seqlab does not implement raises
`NotImplementedError` naming its key, and the checkpoint must hold exactly the tensors the model
needs, with the shapes it needs (computed from the model's parameter shapes by `jax.eval_shape` of
the inverse rules) and a dtype numpy reads: a missing, unexpected, misshapen or unreadable tensor
raises `ValueError` naming it. (The one check that reads data: a tied model's checkpoint that also
stores `lm_head.weight` must store the embedding there.) Tensors under an architecture's
`ignored` prefixes (heads the CausalLM forward never uses) are listed in the result, never read.
Loading then reads one rule's tensors at a time (memory-mapped), so peak memory is the converted
parameters plus the largest rule's inputs (choose `param_dtype=jnp.bfloat16` to hold a bfloat16
checkpoint at its own size); saving streams the tensors into shards.
"""

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from seqlab.interop import files
from seqlab.interop.mamba import MAMBA, MAMBA2
from seqlab.interop.qwen3_next import QWEN3_NEXT
from seqlab.interop.rules import Architecture, Rule, fields, mixer_fields
from seqlab.modules.lm import LanguageModel, param_shapes

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (MAMBA, MAMBA2, QWEN3_NEXT)}
"""The Hugging Face `architectures` names seqlab reads and writes -> their conversion rules."""
TIED_HEAD = "lm_head.weight"  # stored by some checkpoints of tied models, equal to the embedding


class Converted(NamedTuple):
    """What `load_hf` returns.

    Attributes:
      model: the `LanguageModel`.
      params: its parameters, nested dicts of numpy arrays in `param_dtype`.
      architecture: the Hugging Face architecture name.
      ignored: checkpoint tensors not read (under the architecture's `ignored` prefixes).
    """

    model: LanguageModel
    params: dict
    architecture: str
    ignored: tuple[str, ...]


def architecture_of(config: Mapping) -> Architecture:
    """The `Architecture` named by `config["architectures"]`, or `ValueError`."""
    names = config.get("architectures")
    if not isinstance(names, list) or len(names) != 1:
        raise ValueError(f"config architectures must name one architecture, got {names!r}")
    if names[0] not in ARCHITECTURES:
        raise ValueError(
            f"config architectures names {names[0]!r}; seqlab converts {sorted(ARCHITECTURES)}"
        )
    return ARCHITECTURES[names[0]]


def model_of(
    config: Mapping,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    **options,
) -> tuple[LanguageModel, Architecture]:
    """The `LanguageModel` of a Hugging Face `config` (no weights) and its architecture."""
    arch = architecture_of(config)
    unknown = sorted(set(options) - set(arch.options))
    if unknown:
        raise ValueError(f"{arch.name} takes the options {sorted(arch.options)}, got {unknown}")
    kwargs = arch.to_model(config, {**arch.options, **options})
    return LanguageModel(**kwargs, dtype=dtype, param_dtype=param_dtype), arch


def flat_shapes(model: LanguageModel) -> dict[str, jax.ShapeDtypeStruct]:
    """`"a/b/c"` -> shape and dtype of every parameter of `model` (nothing allocated)."""
    return flatten_dict(param_shapes(model), sep="/")


def _checked_rules(model: LanguageModel, arch: Architecture, shapes: dict) -> list[Rule]:
    rules = arch.rules(model)
    covered = [p for rule in rules for p in rule.params]
    if sorted(covered) != sorted(shapes):
        missing, extra = sorted(set(shapes) - set(covered)), sorted(set(covered) - set(shapes))
        raise AssertionError(f"{arch.name} rules miss parameters {missing}, name unknown {extra}")
    return rules


def hf_shapes(rules: list[Rule], shapes: dict) -> dict[str, tuple[int, ...]]:
    """The shape every checkpoint tensor must have: the inverse rules on the parameter shapes."""
    expected = {}
    for rule in rules:
        outs = jax.eval_shape(rule.to_hf, *(shapes[p] for p in rule.params))
        for name, out in zip(rule.hf, outs, strict=True):
            expected[name] = tuple(out.shape)
    return expected


def load_hf(path, *, dtype=jnp.float32, param_dtype=jnp.float32, **options) -> Converted:
    """Read the Hugging Face model directory `path` into a `LanguageModel` and its parameters.

    `dtype`, `param_dtype`: the model's compute and parameter dtypes (parameters are cast from the
    checkpoint's dtype). `options`: the architecture's (`Architecture.options`), e.g.
    `hf_mamba2_norm=True`. Raises before reading any tensor for an unknown architecture, an
    unsupported config option, or a missing, unexpected or misshapen tensor (named).
    """
    checkpoint = files.HFDirectory(path)
    model, arch = model_of(checkpoint.config, dtype=dtype, param_dtype=param_dtype, **options)
    shapes = flat_shapes(model)
    rules = _checked_rules(model, arch, shapes)
    expected = hf_shapes(rules, shapes)
    present = set(checkpoint.names())
    ignored = tuple(n for n in sorted(present) if n.startswith(arch.ignored))
    tied_copy = model.tie_embeddings and TIED_HEAD in present and TIED_HEAD not in expected
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(f"the checkpoint in {path} lacks the tensors {missing}")
    extra = sorted(present - set(expected) - set(ignored) - ({TIED_HEAD} if tied_copy else set()))
    if extra:
        raise ValueError(f"the checkpoint in {path} has tensors {arch.name} does not use: {extra}")
    for name, shape in expected.items():
        if checkpoint.shape(name) != shape:
            raise ValueError(
                f"tensor {name} has shape {checkpoint.shape(name)} in the checkpoint, "
                f"{arch.name} with this config needs {shape}"
            )
        if checkpoint.dtype(name) not in files.DTYPES:
            raise ValueError(
                f"tensor {name} has dtype {checkpoint.dtype(name)}, "
                f"not one of {sorted(files.DTYPES)}"
            )
    if tied_copy:
        _check_tied(checkpoint, expected)
    flat = {}
    for rule in rules:
        outs = rule.to_seqlab(*(checkpoint.get(name) for name in rule.hf))
        for path_, out in zip(rule.params, outs, strict=True):
            flat[path_] = np.asarray(out, dtype=shapes[path_].dtype)
    return Converted(model, unflatten_dict(flat, sep="/"), arch.name, ignored)


def _check_tied(checkpoint: files.HFDirectory, expected: dict) -> None:
    """The stored head of a tied model must be the embedding (the one tensor whose shape is
    `[vocab, d]` and which the embedding rule reads)."""
    (embedding,) = (n for n in expected if n.endswith(("embeddings.weight", "embed_tokens.weight")))
    head, table = checkpoint.get(TIED_HEAD), checkpoint.get(embedding)
    if head.shape != table.shape or not np.array_equal(head, table):
        raise ValueError(
            f"tensor {TIED_HEAD} (shape {head.shape}, {checkpoint.dtype(TIED_HEAD)}) differs from "
            f"{embedding} (shape {table.shape}, {checkpoint.dtype(embedding)}) although the config "
            "ties them"
        )


def config_of(model: LanguageModel, architecture: str | None = None) -> tuple[dict, Architecture]:
    """The Hugging Face config of `model` and its architecture (named, or the one whose config
    gives back `model`). Raises `ValueError` naming the fields no architecture can express."""
    if architecture and architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {architecture}")
    candidates = [ARCHITECTURES[architecture]] if architecture else list(ARCHITECTURES.values())
    reasons = []
    for arch in candidates:
        try:
            config = arch.to_config(model)
            dtypes = dict(dtype=model.dtype, param_dtype=model.param_dtype)
            back = model_of(config, **dtypes, **arch.options_of(model))[0]
        except (ValueError, NotImplementedError) as error:
            reasons.append(f"{arch.name}: {error}")
            continue
        differ = _differences(model, back)
        if not differ:
            return config, arch
        reasons.append(f"{arch.name} cannot express {differ}")
    raise ValueError("model has no Hugging Face form: " + "; ".join(reasons))


def _effective(model: LanguageModel) -> dict:
    """The fields of `model` that decide its function: the keyword blocks of the mixers and MLPs
    it uses, defaults filled in, and the model-level fields (`impl`s excluded)."""
    out = {
        k: v
        for k, v in fields(model).items()
        if not isinstance(v, Mapping) and k not in ("dtype", "param_dtype", "mlp_pattern")
    }
    out["mlps"] = model.mlps
    for kind in sorted(set(model.pattern)):
        out[f"mixer {kind}"] = mixer_fields(model, kind)
    for kind in sorted(set(model.mlps) - {"-"}):
        out[f"mlp {kind}"] = fields(model.make_mlp(kind))
    for block in [v for k, v in out.items() if k.startswith(("mixer", "mlp "))]:
        block.pop("impl", None)  # how, not what: the implementation and its chunking
        block.pop("chunk_size", None)
    if "d" not in model.mlps:
        out.pop("d_ff")
    return out


def _differences(a: LanguageModel, b: LanguageModel) -> list[str]:
    ea, eb = _effective(a), _effective(b)
    out = []
    for key in sorted(set(ea) | set(eb)):
        va, vb = ea.get(key), eb.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys = sorted(set(va) | set(vb))
            out += [f"{key}.{k}={va.get(k)!r}" for k in keys if va.get(k) != vb.get(k)]
        elif isinstance(va, dict) or isinstance(vb, dict):
            out.append(f"{key} ({'absent' if va is None else 'present'})")
        elif va != vb:
            out.append(f"{key}={va!r}")
    return out


def save_hf(
    model: LanguageModel,
    params: Mapping,
    path,
    *,
    architecture: str | None = None,
    dtype=None,
    max_shard_bytes: int | None = None,
) -> Architecture:
    """Write `model` with `params` as a Hugging Face model directory at `path`.

    `architecture`: the Hugging Face name (default: the one that expresses `model`, see
    `config_of`). `dtype`: the tensors' dtype (default: the parameters'). `max_shard_bytes`:
    shard the weights (`model-0000i-of-0000n.safetensors` and an index). Raises `ValueError` for
    a model no architecture expresses (naming the fields) and for parameters missing, extra or of
    the wrong shape (named), before writing anything. Returns the architecture.
    """
    config, arch = config_of(model, architecture)
    shapes = flat_shapes(model)
    flat = flatten_dict(dict(params), sep="/")
    missing, extra = sorted(set(shapes) - set(flat)), sorted(set(flat) - set(shapes))
    if missing or extra:
        raise ValueError(f"params do not fit the model: missing {missing}, unexpected {extra}")
    for key, shape in shapes.items():
        if tuple(np.shape(flat[key])) != tuple(shape.shape):
            raise ValueError(
                f"parameter {key} has shape {np.shape(flat[key])}, the model needs {shape.shape}"
            )
    rules = _checked_rules(model, arch, shapes)
    out_dtype = np.dtype(dtype) if dtype is not None else np.dtype(model.param_dtype)
    config["torch_dtype"] = str(out_dtype) if out_dtype != np.dtype("bfloat16") else "bfloat16"

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for rule in rules:
            outs = rule.to_hf(*(np.asarray(flat[p]) for p in rule.params))
            for name, out in zip(rule.hf, outs, strict=True):
                yield name, np.asarray(out).astype(out_dtype)

    files.write(path, config, tensors(), max_shard_bytes=max_shard_bytes)
    return arch


__all__ = ["ARCHITECTURES", "Converted", "config_of", "load_hf", "model_of", "save_hf"]
