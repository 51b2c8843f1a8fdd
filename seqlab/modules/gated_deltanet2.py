"""Gated DeltaNet-2 mixer: the delta rule with separate erase and write gates per channel.

For `x: [B, T, d_model]`, `H = num_heads` heads with keys of width `K = head_dim` and values of
width `V = expand_v * head_dim` (one value head per key head):

    q, k, v = silu(causal_conv1d(q_proj x)), ...       # [H, K], [H, K], [H, V]; one conv each
    q, k    = q / ||q||, k / ||k||                     # per head, in float32
    g       = -exp(A_log) * softplus(f_b(f_a x) + dt_bias)   # [H, K], log-decay per key channel
    b       = sigmoid(b_proj x)                        # [H, K], erase gate (times 2 with
                                                       #   allow_neg_eigval)
    w       = sigmoid(w_proj x)                        # [H, V], write gate
    S_t     = Diag(exp(g_t)) S_{t-1};  S_t += k_t (w_t * v_t - S_t^T (b_t * k_t))^T   # [K, V]
    o_t     = S_t^T q_t / sqrt(K)
    out     = o_proj(rms_norm(o) * sigmoid(g_b(g_a x)))  # RMSNorm over V, weight shared by heads

With `b = w = beta` (a scalar per head) this is Kimi Delta Attention; with a scalar decay as well,
Gated DeltaNet. The recurrence is `seqlab.ops.gdn2` (DESIGN.md 3.7), the decay
`seqlab.ops.kda_gate`.

Where the layer comes from and what seqlab chose. There is no authoritative reference to check
against: the recurrence is DESIGN.md 3.7's (`impl="recurrent"` is its definition). The layout
around it (low-rank decay projection through `V` as KDA, `A_log: [H]`,
`dt_bias: [H, K]`, full-rank `b_proj: d_model -> H K` and `w_proj: d_model -> H V` without bias,
the sigmoid-gated output RMSNorm with a low-rank output gate whose second factor has a bias, the
defaults `num_heads=16`, `head_dim=128`, `expand_v=1`, `conv_size=4`, `norm_eps=1e-5`, and the
initialization `A ~ U(1, 16]`, `dt` log-uniform in `[1e-3, 1e-1]` floored at `1e-4`) is that of
flash-linear-attention's `fla.layers.GatedDeltaNet2` (which says it adapts NVlabs'
GatedDeltaNet-2). seqlab's choices: one value head per key head (`seqlab.ops.gdn2` requires
`H == HV`, so there is no `num_v_heads`); Flax's default (LeCun normal) initializer for the
projections rather than PyTorch's uniform; the sigmoid-gated RMSNorm composed from `rms_norm`
(`seqlab.ops.gated_rms_norm` gates with SiLU).

`init_cache`/`step` decode one token at a time from a cache holding the last `W - 1` inputs of the
q, k and v convolutions and the state `[B, H, K, V]` in float32 (float64 for float64 compute).
"""

import math
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.modules import initializers
from seqlab.modules.mixer import Mixer, extend_qkv, pad_identity, sequence_op
from seqlab.modules.norm import RMSNorm
from seqlab.ops.checks import check_positive_int
from seqlab.ops.conv import causal_conv1d, causal_conv1d_step
from seqlab.ops.gdn2 import gdn2, gdn2_step
from seqlab.ops.kda import kda_gate
from seqlab.ops.norm import l2_normalize

_A_INIT_RANGE = (1.0, 16.0)
_DT_MIN, _DT_MAX, _DT_INIT_FLOOR = 1e-3, 1e-1, 1e-4


class GatedDeltaNet2(Mixer):
    """Gated DeltaNet-2 mixer: `[B, T, d_model] -> [B, T, d_model]` (see the module docstring).

    Attributes:
      d_model: model width.
      num_heads: heads `H` (query, key and value alike).
      head_dim: query/key head width `K`.
      expand_v: value head width `V = expand_v * head_dim` (must be an integer).
      conv_size: width `W` of the causal depthwise convolutions on q, k and v.
      allow_neg_eigval: erase gate `b = 2 sigmoid(.)` in (0, 2) (eigenvalues of the transition
        down to -1, Grazzi et al., arXiv 2411.12537).
      norm_eps: epsilon of the output RMSNorm.
      impl: implementation of `seqlab.ops.gdn2` (None: auto). Decoding always uses `gdn2_step`.
      chunk_size: chunk length of the chunked implementation.
      dtype: compute dtype; states and gates accumulate in `promote_types(dtype, float32)`.
      param_dtype: parameter dtype.
      seq_axis: the mesh axis the time axis is split over when the module runs inside
        `shard_map` (sequence parallelism); None: the whole sequence is local. Decoding ignores
        it.
    """

    d_model: int
    num_heads: int = 16
    head_dim: int = 128
    expand_v: float = 1
    conv_size: int = 4
    allow_neg_eigval: bool = False
    norm_eps: float = 1e-5
    impl: str | None = None
    chunk_size: int = 64
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    seq_axis: str | None = None

    @property
    def head_v_dim(self) -> int:
        """`V = expand_v * head_dim`."""
        return round(self.expand_v * self.head_dim)

    def check_fields(self) -> None:
        for name in ("d_model", "num_heads", "head_dim", "conv_size", "chunk_size"):
            check_positive_int(name, getattr(self, name))
        v_dim = self.expand_v * self.head_dim
        if not (v_dim > 0 and math.isclose(v_dim, round(v_dim))):
            raise ValueError(
                f"expand_v * head_dim must be a positive integer, got expand_v={self.expand_v} "
                f"with head_dim={self.head_dim}"
            )

    def setup(self):
        pd = self.param_dtype
        h, k_dim, v_dim = self.num_heads, self.head_dim, self.head_v_dim
        key_dim, value_dim = h * k_dim, h * v_dim
        dense = partial(nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=pd)
        self.q_proj, self.k_proj, self.v_proj = dense(key_dim), dense(key_dim), dense(value_dim)
        self.f_a, self.f_b = dense(v_dim), dense(key_dim)  # low-rank decay projection
        self.b_proj, self.w_proj = dense(key_dim), dense(value_dim)
        self.g_a, self.g_b = dense(v_dim), dense(value_dim, use_bias=True)  # low-rank output gate
        self.o_proj = dense(self.d_model)
        conv_init = initializers.uniform(self.conv_size**-0.5)  # PyTorch's depthwise Conv1d
        self.q_conv = self.param("q_conv", conv_init, (self.conv_size, key_dim), pd)
        self.k_conv = self.param("k_conv", conv_init, (self.conv_size, key_dim), pd)
        self.v_conv = self.param("v_conv", conv_init, (self.conv_size, value_dim), pd)
        self.A_log = self.param("A_log", initializers.a_log(*_A_INIT_RANGE), (h,), pd)
        dt_init = initializers.dt_bias(_DT_MIN, _DT_MAX, _DT_INIT_FLOOR)
        self.dt_bias = self.param("dt_bias", dt_init, (h, k_dim), pd)
        self.o_norm = RMSNorm(eps=self.norm_eps, param_dtype=pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, d_model]` -> `[B, T, d_model]` in `dtype`."""
        op = sequence_op(gdn2, self.seq_axis)
        o, _ = op(**self.op_inputs(x), chunk_size=self.chunk_size, impl=self.impl)
        return self._output(o, x)

    def op_inputs(self, x: jax.Array) -> dict:
        """The operands of `gdn2` for `x: [B, T, d_model]`, as `__call__` passes them.

        Returns `{"q", "k": [B, T, H, K] (unit norm per head), "v": [B, T, H, V] in dtype,
        "g", "b": [B, T, H, K], "w": [B, T, H, V]}`, the gates in float32 (float64 for float64
        compute).
        """
        self.check_sequence(x)

        def conv(proj, weight):
            return jax.nn.silu(sequence_op(causal_conv1d, self.seq_axis)(proj(x), weight))

        q, k, v = self._heads(
            conv(self.q_proj, self.q_conv),
            conv(self.k_proj, self.k_conv),
            conv(self.v_proj, self.v_conv),
        )
        g, b, w = self._gates(x)
        return {"q": q, "k": k, "v": v, "g": g, "b": b, "w": w}

    def zero_cache(self, batch_size: int, max_len: int) -> dict:
        """`{"q_conv", "k_conv": [B, W - 1, H K], "v_conv": [B, W - 1, H V]` in dtype,
        `"state": [B, H, K, V]` in acc_dtype`}`."""
        width, key_dim = self.conv_size - 1, self.num_heads * self.head_dim
        return {
            "q_conv": jnp.zeros((batch_size, width, key_dim), self.dtype),
            "k_conv": jnp.zeros((batch_size, width, key_dim), self.dtype),
            "v_conv": jnp.zeros((batch_size, width, self.num_heads * self.head_v_dim), self.dtype),
            "state": jnp.zeros(
                (batch_size, self.num_heads, self.head_dim, self.head_v_dim), self.acc_dtype
            ),
        }

    def step(self, x_t: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """One decoding step: `x_t: [B, d_model]` -> `(y_t: [B, d_model], new_cache)`."""
        self.check_token(x_t)
        q, q_conv = causal_conv1d_step(self.q_proj(x_t), cache["q_conv"], self.q_conv)
        k, k_conv = causal_conv1d_step(self.k_proj(x_t), cache["k_conv"], self.k_conv)
        v, v_conv = causal_conv1d_step(self.v_proj(x_t), cache["v_conv"], self.v_conv)
        q, k, v = self._heads(jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v))
        g, b, w = self._gates(x_t)
        o, state = gdn2_step(q, k, v, g, b, w, cache["state"])
        new_cache = {"q_conv": q_conv, "k_conv": k_conv, "v_conv": v_conv, "state": state}
        return self._output(o, x_t), new_cache

    def extend(self, x: jax.Array, cache: dict, lengths=None) -> tuple[jax.Array, dict]:
        """`x: [B, T, d_model]` continuing from `cache`, row `b`'s first `lengths[b]` tokens real:
        `(y: [B, T, d_model], cache after the real tokens)` (see `seqlab.modules.mixer`). Pads
        are identity tokens of the op: `g = 0`, `b = 0`, `w = 0`."""
        lengths, real = self.check_extend(x, lengths)
        q, k, v, convs = extend_qkv(self, x, cache, lengths)
        q, k, v = self._heads(q, k, v)
        g, b, w = (pad_identity(a, real) for a in self._gates(x))
        o, state = gdn2(
            q,
            k,
            v,
            g,
            b,
            w,
            initial_state=cache["state"],
            output_final_state=True,
            chunk_size=self.chunk_size,
            impl=self.impl,
        )
        return self._output(o, x), {**convs, "state": state.astype(cache["state"].dtype)}

    def _heads(self, q: jax.Array, k: jax.Array, v: jax.Array):
        """Split heads: `q, k: [..., H K] -> [..., H, K]` (unit norm), `v -> [..., H, V]`."""
        q = l2_normalize(q.reshape(*q.shape[:-1], self.num_heads, self.head_dim))
        k = l2_normalize(k.reshape(*k.shape[:-1], self.num_heads, self.head_dim))
        return q, k, v.reshape(*v.shape[:-1], self.num_heads, self.head_v_dim)

    def _gates(self, x: jax.Array):
        """Log-decay `g: [..., H, K]` (`kda_gate` of the low-rank projection), erase gate
        `b = sigmoid(b_proj x): [..., H, K]` (times 2 with `allow_neg_eigval`) and write gate
        `w = sigmoid(w_proj x): [..., H, V]`, all in the accumulation dtype."""
        acc, lead = self.acc_dtype, x.shape[:-1]
        f = self.f_b(self.f_a(x)).reshape(*lead, self.num_heads, self.head_dim)
        g = kda_gate(f, self.A_log, self.dt_bias).astype(acc)
        b = jax.nn.sigmoid(self.b_proj(x).astype(acc)).reshape(f.shape)
        w = jax.nn.sigmoid(self.w_proj(x).astype(acc))
        w = w.reshape(*lead, self.num_heads, self.head_v_dim)
        return g, 2.0 * b if self.allow_neg_eigval else b, w

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """`o_proj(rms_norm(o) * sigmoid(g_b(g_a x)))` for `o: [..., H, V]`, `x: [..., d_model]`;
        the norm and the gate in the accumulation dtype, as `gated_rms_norm`."""
        acc = self.acc_dtype
        gate = self.g_b(self.g_a(x)).reshape(o.shape)
        o = (self.o_norm(o.astype(acc)) * jax.nn.sigmoid(gate.astype(acc))).astype(self.dtype)
        return self.o_proj(o.reshape(*o.shape[:-2], self.num_heads * self.head_v_dim))
