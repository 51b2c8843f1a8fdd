"""Hugging Face checkpoints <-> seqlab workdirs.

    python -m experiments.convert --from HF_DIR --to WORKDIR [--hf-mamba2-norm] [--dtype float32]
    python -m experiments.convert --from WORKDIR --to-hf HF_DIR [--hf-dtype bfloat16] \
        [--max-shard-bytes 5000000000]

The first reads a local Hugging Face model directory (`config.json` and safetensors; Mamba,
Mamba-2, Qwen3-Next: `seqlab.interop`) and writes a workdir that `experiments.launch` fine-tunes
(`experiments/configs/finetune.py:from=WORKDIR`, i.e. `init_from`), `python -m theory --model`
measures and this command converts back: `config.json` with the model block `{"name": "lm",
"lm": LanguageModel keyword arguments, "dtype"}` and an orbax checkpoint of the parameters at
step 0. The second writes any workdir whose model has a Hugging Face form (a converted one, or a
trained `mamba`/`mamba2` model without MLPs) as a directory `transformers` loads with
`from_pretrained`, sharded above `--max-shard-bytes`. Errors (unknown architecture, unsupported
option, a missing, unexpected or misshapen tensor) name what is wrong and exit 1 before anything
is written.
"""

import argparse
import pathlib
import sys

import jax.numpy as jnp
from flax.core import unfreeze

from seqlab.interop import load_hf, save_hf
from seqlab.interop.rules import fields
from seqlab.modules.lm import count_params
from seqlab.train.models import DTYPES, LM
from seqlab.train.workdir import load_model, save_model


def lm_kwargs(model) -> dict:
    """The keyword arguments of a `LanguageModel` (dtypes left out) as plain JSON-able values."""
    kwargs = {k: v for k, v in fields(model).items() if k not in ("dtype", "param_dtype")}
    return unfreeze(kwargs)


def to_workdir(source, workdir, *, dtype: str, hf_mamba2_norm: bool) -> None:
    """Convert the Hugging Face directory `source` into the workdir `workdir`."""
    param_dtype = jnp.float64 if dtype == "float64" else jnp.float32
    options = {"hf_mamba2_norm": True} if hf_mamba2_norm else {}
    converted = load_hf(source, dtype=DTYPES[dtype], param_dtype=param_dtype, **options)
    block = {"name": LM, "lm": lm_kwargs(converted.model), "dtype": dtype}
    source_info = {
        "path": str(pathlib.Path(source).expanduser().absolute()),
        "architecture": converted.architecture,
        "ignored": list(converted.ignored),
    }
    save_model(workdir, block, converted.params, extra={"source": source_info})
    print(
        f"{converted.architecture} -> {workdir}: {count_params(converted.model):,d} parameters, "
        f"pattern {converted.model.pattern!r}"
        + (
            f"; not read: {len(converted.ignored)} tensors {converted.ignored[:3]}..."
            if converted.ignored
            else ""
        )
    )


def to_hf(workdir, target, *, dtype: str | None, max_shard_bytes: int | None) -> None:
    """Write the model of `workdir` as the Hugging Face directory `target`."""
    model, params = load_model(workdir)
    arch = save_hf(model, params, target, dtype=dtype, max_shard_bytes=max_shard_bytes)
    print(f"{workdir} -> {target}: {arch.name}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.convert", description=__doc__)
    parser.add_argument("--from", dest="source", required=True, help="HF directory or workdir")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", help="the workdir to write from a Hugging Face directory")
    target.add_argument("--to-hf", help="the Hugging Face directory to write from a workdir")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="with --to")
    parser.add_argument(
        "--hf-mamba2-norm",
        action="store_true",
        help="with --to: Mamba-2 output norm over all channels, as transformers' Mamba2Mixer",
    )
    parser.add_argument(
        "--hf-dtype",
        default=None,
        choices=("float32", "bfloat16", "float16", "float64"),
        help="with --to-hf: tensor dtype (default: the parameters')",
    )
    parser.add_argument("--max-shard-bytes", type=int, default=None, help="with --to-hf")
    args = parser.parse_args(argv)
    if args.to and (args.hf_dtype or args.max_shard_bytes):
        parser.error("--hf-dtype and --max-shard-bytes go with --to-hf")
    if args.to_hf and (args.dtype != "float32" or args.hf_mamba2_norm):
        parser.error("--dtype and --hf-mamba2-norm go with --to")
    try:
        if args.to:
            to_workdir(args.source, args.to, dtype=args.dtype, hf_mamba2_norm=args.hf_mamba2_norm)
        else:
            to_hf(
                args.source, args.to_hf, dtype=args.hf_dtype, max_shard_bytes=args.max_shard_bytes
            )
    except (ValueError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
