"""Generation over the modules' cache API (`LanguageModel.init_cache`, `extend`, `step`, `verify`,
`accept`): batched prefill and a jit-compiled decode loop (`generate`), next-token sampling
(`sample`) and greedy speculative decoding with a draft model (`speculative_generate`). Imports
`seqlab.modules` and `seqlab.ops`, never `seqlab.train`.
"""

from seqlab.serving.generate import Generation, decode, generate, prefill
from seqlab.serving.sampling import sample
from seqlab.serving.speculative import SpeculativeGeneration, speculative_generate

__all__ = [
    "Generation",
    "SpeculativeGeneration",
    "decode",
    "generate",
    "prefill",
    "sample",
    "speculative_generate",
]
