"""Pure-JAX ops: the reference oracles and the public dispatchers (`impl=...`).

No `pallas_call` and no Flax here; kernels live in `seqlab.kernels` and are reached through the
dispatchers.
"""

from seqlab.ops.conv import causal_conv1d, causal_conv1d_step
from seqlab.ops.gated_delta import gated_delta_rule, gated_delta_rule_step
from seqlab.ops.norm import gated_rms_norm, l2_normalize, rms_norm
from seqlab.ops.selective_scan import selective_scan
from seqlab.ops.ssd import ssd, ssd_step

__all__ = [
    "causal_conv1d",
    "causal_conv1d_step",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "gated_rms_norm",
    "l2_normalize",
    "rms_norm",
    "selective_scan",
    "ssd",
    "ssd_step",
]
