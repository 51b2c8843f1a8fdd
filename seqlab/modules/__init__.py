"""Flax linen modules: own parameters and initialization, call `seqlab.ops`; no new math here.

Mixers follow one contract (`seqlab.modules.mixer.Mixer`): `__call__`, `op_inputs`, `init_cache`,
`step`. Paper variants of Mamba are in `seqlab.modules.mamba_variants`; shared initializers in
`seqlab.modules.initializers`.
"""

from seqlab.modules.attention import Attention
from seqlab.modules.block import Block, MambaBlock
from seqlab.modules.embedding import TiedEmbedding
from seqlab.modules.gated_deltanet import GatedDeltaNet
from seqlab.modules.gated_deltanet2 import GatedDeltaNet2
from seqlab.modules.gated_deltaproduct import GatedDeltaProduct
from seqlab.modules.kda import KimiDeltaAttention
from seqlab.modules.lm import (
    MIXERS,
    MLPS,
    PRESETS,
    LanguageModel,
    count_params,
    preset,
)
from seqlab.modules.mamba import Mamba
from seqlab.modules.mamba2 import Mamba2
from seqlab.modules.mixer import Mixer
from seqlab.modules.mlp import SwiGLU
from seqlab.modules.moe import MoE
from seqlab.modules.norm import RMSNorm
from seqlab.modules.ode_transformer import DiscreteTransformer, ODETransformer, evaluate_at

__all__ = [
    "MIXERS",
    "MLPS",
    "PRESETS",
    "Attention",
    "Block",
    "DiscreteTransformer",
    "GatedDeltaNet",
    "GatedDeltaNet2",
    "GatedDeltaProduct",
    "KimiDeltaAttention",
    "LanguageModel",
    "Mamba",
    "Mamba2",
    "MambaBlock",
    "Mixer",
    "MoE",
    "ODETransformer",
    "RMSNorm",
    "SwiGLU",
    "TiedEmbedding",
    "count_params",
    "evaluate_at",
    "preset",
]
