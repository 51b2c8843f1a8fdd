"""Pure-JAX ops: the reference oracles and the public dispatchers (`impl=...`).

No `pallas_call` and no Flax here; kernels live in `seqlab.kernels` and are reached through the
dispatchers. `checks` holds the argument checks the whole library uses.
"""

from seqlab.ops.attention import attention, rope
from seqlab.ops.conv import causal_conv1d, causal_conv1d_step
from seqlab.ops.gated_delta import gated_delta_rule, gated_delta_rule_step
from seqlab.ops.gated_delta_product import gated_delta_product, gated_delta_product_step
from seqlab.ops.gdn2 import gdn2, gdn2_step
from seqlab.ops.kda import kda, kda_gate, kda_step
from seqlab.ops.moe import routed_swiglu, top_k_routing
from seqlab.ops.norm import gated_rms_norm, l2_normalize, rms_norm
from seqlab.ops.selective_scan import selective_scan
from seqlab.ops.softsort import soft_sort
from seqlab.ops.ssd import ssd, ssd_step

__all__ = [
    "attention",
    "causal_conv1d",
    "causal_conv1d_step",
    "gated_delta_product",
    "gated_delta_product_step",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "gated_rms_norm",
    "gdn2",
    "gdn2_step",
    "kda",
    "kda_gate",
    "kda_step",
    "l2_normalize",
    "rms_norm",
    "rope",
    "routed_swiglu",
    "selective_scan",
    "soft_sort",
    "ssd",
    "ssd_step",
    "top_k_routing",
]
