"""Kimi Delta Attention mixer (Kimi Team, "Kimi Linear", arXiv 2510.26692).

For `x: [B, T, d_model]`, `H = num_heads` query/key heads of width `K = head_dim` and
`HV = num_v_heads` value heads of width `V = expand_v * head_dim` (grouped value attention when
`HV > H`: value head `j` reads query/key head `j // (HV / H)`):

    q, k, v = silu(causal_conv1d(q_proj x)), ...       # [H, K], [H, K], [HV, V]; one conv each
    q, k    = q / ||q||, k / ||k||                     # per head, in float32
    f       = f_b(f_a x)                               # [HV, K], low rank: d_model -> V -> HV K
    g       = -exp(A_log) * softplus(f + dt_bias)      # [HV, K], log-decay per key channel
            (or gate_lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), in (gate_lower_bound, 0))
    beta    = sigmoid(b_proj x)                        # [HV]; times 2 with allow_neg_eigval
    S_t     = Diag(exp(g_t)) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T   # [K, V]
    o_t     = S_t^T q_t / sqrt(K)
    out     = o_proj(rms_norm(o) * sigmoid(g_b(g_a x)))  # RMSNorm over V, weight shared by heads

The gate is `seqlab.ops.kda_gate`, the recurrence `seqlab.ops.kda`. Layout, defaults and
initialization follow flash-linear-attention's `fla.layers.KimiDeltaAttention` (the authors'
layer; per-value-head `A_log: [HV]` and `dt_bias: [HV, K]` as in its grouped-value version):
`num_heads=16`, `head_dim=128`, `expand_v=1`, `conv_size=4` without conv bias, `norm_eps=1e-5`,
L2-norm epsilon 1e-6, no projection biases except the output gate's second factor `g_b`,
`A ~ U(1, 16]`, `dt` log-uniform in `[1e-3, 1e-1]` floored at `1e-4` (`dt_bias =
softplus^{-1}(dt)`, one per value head and key channel). With `gate_lower_bound` set, `A_log`
starts at 0 (`A = 1`), fla's initialization for its bounded ("safe") gate. The projections use
Flax's default (LeCun normal) initializer rather than PyTorch's uniform; the sigmoid-gated
RMSNorm is composed here from `rms_norm` (`seqlab.ops.gated_rms_norm` gates with SiLU).

`init_cache`/`step` decode one token at a time from a cache holding the last `W - 1` inputs of the
q, k and v convolutions and the state `[B, HV, K, V]` in float32 (float64 for float64 compute).
"""

import math

import flax.linen as nn
import jax

from seqlab.modules import initializers
from seqlab.modules.gated_deltanet import GatedDeltaNet
from seqlab.modules.mixer import sequence_op
from seqlab.modules.norm import RMSNorm
from seqlab.ops.kda import kda, kda_gate, kda_step

_A_INIT_RANGE = (1.0, 16.0)
_DT_MIN, _DT_MAX, _DT_INIT_FLOOR = 1e-3, 1e-1, 1e-4


class KimiDeltaAttention(GatedDeltaNet):
    """Kimi Delta Attention mixer: `[B, T, d_model] -> [B, T, d_model]` (see the module docstring).

    Gated DeltaNet's layer (q/k/v projections and convolutions, heads, decoding cache and step)
    with KDA's gates, output gate and recurrence (`seqlab.ops.kda`, `kda_step`); `op_inputs`
    returns `g: [B, T, HV, K]`, one log-decay per key channel.

    Attributes:
      d_model: model width.
      num_heads: query/key heads `H`.
      head_dim: query/key head width `K`.
      num_v_heads: value heads `HV` (None: `num_heads`); a multiple of `num_heads`.
      expand_v: value head width `V = expand_v * head_dim` (must be an integer).
      conv_size: width `W` of the causal depthwise convolutions on q, k and v.
      allow_neg_eigval: `beta = 2 sigmoid(.)` in (0, 2), so that the transition `I - beta k k^T`
        can have eigenvalue down to -1 (Grazzi et al., arXiv 2411.12537).
      gate_lower_bound: None, or a negative float `L`: the bounded gate
        `g = L * sigmoid(exp(A_log) (f + dt_bias))` in `(L, 0)`.
      norm_eps: epsilon of the output RMSNorm.
      impl: implementation of `seqlab.ops.kda` (None: auto). Decoding always uses `kda_step`.
      chunk_size: chunk length of the chunked implementation.
      dtype: compute dtype; states and gates accumulate in `promote_types(dtype, float32)`.
      param_dtype: parameter dtype.
    """

    # GatedDeltaNet's fields, with fla's KDA defaults where they differ, and KDA's own.
    num_heads: int = 16
    head_dim: int = 128
    expand_v: float = 1
    allow_neg_eigval: bool = False
    gate_lower_bound: float | None = None

    def check_fields(self) -> None:
        super().check_fields()
        bound = self.gate_lower_bound
        if bound is not None and not (isinstance(bound, int | float) and -math.inf < bound < 0):
            raise ValueError(f"gate_lower_bound must be None or a negative float, got {bound!r}")

    def _setup_gates(self, dense):
        """The low-rank decay and output-gate projections, beta's, `A_log: [HV]`,
        `dt_bias: [HV, K]` and the output norm."""
        pd = self.param_dtype
        hv, k_dim, v_dim = self.v_heads, self.head_dim, self.head_v_dim
        self.f_a, self.f_b = dense(v_dim), dense(hv * k_dim)  # low-rank decay projection
        self.b_proj = dense(hv)
        self.g_a, self.g_b = dense(v_dim), dense(hv * v_dim, use_bias=True)  # low-rank output gate
        if self.gate_lower_bound is None:
            a_init = initializers.a_log(*_A_INIT_RANGE)
        else:
            a_init = nn.initializers.zeros
        self.A_log = self.param("A_log", a_init, (hv,), pd)
        dt_init = initializers.dt_bias(_DT_MIN, _DT_MAX, _DT_INIT_FLOOR)
        self.dt_bias = self.param("dt_bias", dt_init, (hv, k_dim), pd)
        self.o_norm = RMSNorm(eps=self.norm_eps, param_dtype=pd)

    def _op(self, seq_axis=None, **kwargs):
        """The recurrence over a sequence: `kda` (split over `seq_axis`: see `sequence_op`)."""
        return sequence_op(kda, seq_axis)(**kwargs)

    def _op_step(self, *args):
        """One token of the recurrence: `kda_step`."""
        return kda_step(*args)

    def _gates(self, x: jax.Array):
        """Log-decay `g: [..., HV, K]` (`kda_gate` of the low-rank projection) and
        `beta = sigmoid(b_proj x): [..., HV]` (times 2 with `allow_neg_eigval`), both in the
        accumulation dtype."""
        f = self.f_b(self.f_a(x)).reshape(*x.shape[:-1], self.v_heads, self.head_dim)
        g = kda_gate(f, self.A_log, self.dt_bias, lower_bound=self.gate_lower_bound)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(self.acc_dtype))
        return g.astype(self.acc_dtype), 2.0 * beta if self.allow_neg_eigval else beta

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """`o_proj(rms_norm(o) * sigmoid(g_b(g_a x)))` for `o: [..., HV, V]`, `x: [..., d_model]`;
        the norm and the gate in the accumulation dtype, as `gated_rms_norm`."""
        acc = self.acc_dtype
        gate = self.g_b(self.g_a(x)).reshape(o.shape)
        o = (self.o_norm(o.astype(acc)) * jax.nn.sigmoid(gate.astype(acc))).astype(self.dtype)
        return self.o_proj(o.reshape(*o.shape[:-2], self.v_heads * self.head_v_dim))
