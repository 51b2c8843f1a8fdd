"""Checkpoints of other libraries in and out: Hugging Face model directories (`config.json` and
safetensors) of `MambaForCausalLM`, `Mamba2ForCausalLM` and `Qwen3NextForCausalLM` <->
`seqlab.modules.LanguageModel` and its parameters.

    from seqlab.interop import load_hf, save_hf
    model, params, architecture, ignored = load_hf("path/to/mamba-130m-hf")
    save_hf(model, params, "path/to/out")

Reads safetensors with the `safetensors` package's numpy API (no torch). May import
`seqlab.modules` and `seqlab.ops`, never `seqlab.train`; `python -m experiments.convert` turns a
directory into a training workdir and back.
"""

from seqlab.interop.hf import ARCHITECTURES, Converted, config_of, load_hf, model_of, save_hf

__all__ = ["ARCHITECTURES", "Converted", "config_of", "load_hf", "model_of", "save_hf"]
