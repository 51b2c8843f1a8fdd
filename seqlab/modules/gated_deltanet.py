"""Gated DeltaNet mixer (Yang, Kautz, Hatamizadeh, ICLR 2025, arXiv 2412.06464).

For `x: [B, T, d_model]`, `H = num_heads` query/key heads of width `K = head_dim` and
`HV = num_v_heads` value heads of width `V = expand_v * head_dim` (grouped value attention when
`HV > H`: value head `j` reads query/key head `j // (HV / H)`):

    q, k, v = silu(causal_conv1d(q_proj x)), ...       # [H, K], [H, K], [HV, V]; one conv each
    q, k    = q / ||q||, k / ||k||                     # per head, in float32
    beta    = sigmoid(b_proj x)                        # [HV], in (0, 1)
    g       = -exp(A_log) * softplus(a_proj x + dt_bias)   # [HV], log-decay <= 0 (Mamba-2 gate)
    S_t     = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T   # [K, V] per value head
    o_t     = S_t^T q_t / sqrt(K)
    out     = o_proj(rms_norm(o) * silu(g_proj x))      # RMSNorm over V, weight shared by heads

The recurrence is `seqlab.ops.gated_delta_rule`. Defaults and initialization follow
flash-linear-attention's `fla.layers.GatedDeltaNet` (the authors' layer): `num_heads=6`,
`head_dim=256`, `expand_v=2`, `conv_size=4` without conv bias, `norm_eps=1e-5`, L2-norm epsilon
1e-6, no projection biases, `A ~ U(0, 16]`, `dt` log-uniform in `[1e-3, 1e-1]` floored at `1e-4`
(`dt_bias = softplus^{-1}(dt)`). fla sizes `num_heads * head_dim = 0.75 d_model` for about
`6 d_model^2` parameters. The projections use Flax's default (LeCun normal) initializer rather than
PyTorch's uniform.

`init_cache`/`step` decode one token at a time from a cache holding the last `W - 1` inputs of the
q, k and v convolutions and the state `[B, HV, K, V]` in float32 (float64 for float64 compute).
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
from seqlab.ops.gated_delta import gated_delta_rule, gated_delta_rule_step
from seqlab.ops.norm import l2_normalize

_A_INIT_RANGE = (0.0, 16.0)
_DT_MIN, _DT_MAX, _DT_INIT_FLOOR = 1e-3, 1e-1, 1e-4


class GatedDeltaNet(Mixer):
    """Gated DeltaNet mixer: `[B, T, d_model] -> [B, T, d_model]` (see the module docstring).

    Attributes:
      d_model: model width.
      num_heads: query/key heads `H`.
      head_dim: query/key head width `K`.
      num_v_heads: value heads `HV` (None: `num_heads`); a multiple of `num_heads`.
      expand_v: value head width `V = expand_v * head_dim` (must be an integer).
      conv_size: width `W` of the causal depthwise convolutions on q, k and v.
      norm_eps: epsilon of the output RMSNorm.
      impl: implementation of `seqlab.ops.gated_delta_rule` (None: auto). Decoding always uses
        `gated_delta_rule_step`.
      chunk_size: chunk length of the chunked implementation.
      dtype: compute dtype; states and gates accumulate in `promote_types(dtype, float32)`.
      param_dtype: parameter dtype.
      seq_axis: the mesh axis the time axis is split over when the module runs inside
        `shard_map` (sequence parallelism); None: the whole sequence is local. Decoding ignores
        it.
    """

    d_model: int
    num_heads: int = 6
    head_dim: int = 256
    num_v_heads: int | None = None
    expand_v: float = 2
    conv_size: int = 4
    norm_eps: float = 1e-5
    impl: str | None = None
    chunk_size: int = 64
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    seq_axis: str | None = None

    @property
    def v_heads(self) -> int:
        """`HV`, the number of value heads."""
        return self.num_heads if self.num_v_heads is None else self.num_v_heads

    @property
    def head_v_dim(self) -> int:
        """`V = expand_v * head_dim`."""
        return round(self.expand_v * self.head_dim)

    def check_fields(self) -> None:
        for name in ("d_model", "num_heads", "head_dim", "conv_size", "chunk_size"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("num_v_heads", self.v_heads)
        if self.v_heads % self.num_heads:
            raise ValueError(
                f"num_v_heads must be a multiple of num_heads={self.num_heads}, "
                f"got num_v_heads={self.num_v_heads}"
            )
        v_dim = self.expand_v * self.head_dim
        if not (v_dim > 0 and math.isclose(v_dim, round(v_dim))):
            raise ValueError(
                f"expand_v * head_dim must be a positive integer, got expand_v={self.expand_v} "
                f"with head_dim={self.head_dim}"
            )

    def setup(self):
        """The q/k/v projections and convolutions, the output projection, then `_setup_gates`."""
        pd = self.param_dtype
        key_dim, value_dim = self.num_heads * self.head_dim, self.v_heads * self.head_v_dim
        dense = partial(nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=pd)
        self.q_proj, self.k_proj, self.v_proj = dense(key_dim), dense(key_dim), dense(value_dim)
        self.o_proj = dense(self.d_model)
        conv_init = initializers.uniform(self.conv_size**-0.5)  # PyTorch's depthwise Conv1d
        self.q_conv = self.param("q_conv", conv_init, (self.conv_size, key_dim), pd)
        self.k_conv = self.param("k_conv", conv_init, (self.conv_size, key_dim), pd)
        self.v_conv = self.param("v_conv", conv_init, (self.conv_size, value_dim), pd)
        self._setup_gates(dense)

    def _setup_gates(self, dense):
        """The gate and output-gate projections, `A_log`, `dt_bias` and the output norm."""
        pd = self.param_dtype
        self.g_proj = dense(self.v_heads * self.head_v_dim)
        self.a_proj, self.b_proj = dense(self.v_heads), dense(self.v_heads)
        self.A_log = self.param("A_log", initializers.a_log(*_A_INIT_RANGE), (self.v_heads,), pd)
        dt_init = initializers.dt_bias(_DT_MIN, _DT_MAX, _DT_INIT_FLOOR)
        self.dt_bias = self.param("dt_bias", dt_init, (self.v_heads,), pd)
        self.o_norm = RMSNorm(eps=self.norm_eps, param_dtype=pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, d_model]` -> `[B, T, d_model]` in `dtype`."""
        chunks = dict(chunk_size=self.chunk_size, impl=self.impl)
        o, _ = self._op(**self.op_inputs(x), **chunks, seq_axis=self.seq_axis)
        return self._output(o, x)

    def _op(self, seq_axis=None, **kwargs):
        """The recurrence over a sequence: `gated_delta_rule` (split over `seq_axis`: see
        `sequence_op`)."""
        return sequence_op(gated_delta_rule, seq_axis)(**kwargs)

    def _op_step(self, *args):
        """One token of the recurrence: `gated_delta_rule_step`."""
        return gated_delta_rule_step(*args)

    def op_inputs(self, x: jax.Array) -> dict:
        """The operands of `gated_delta_rule` for `x: [B, T, d_model]`, as `__call__` passes them.

        Returns `{"q", "k": [B, T, H, K] (unit norm per head), "v": [B, T, HV, V] in dtype,
        "g", "beta": [B, T, HV]}`, `g` and `beta` in float32 (float64 for float64 compute).
        """
        self.check_sequence(x)

        def conv(proj, weight):
            return jax.nn.silu(sequence_op(causal_conv1d, self.seq_axis)(proj(x), weight))

        q, k, v = self._heads(
            conv(self.q_proj, self.q_conv),
            conv(self.k_proj, self.k_conv),
            conv(self.v_proj, self.v_conv),
        )
        g, beta = self._gates(x)
        return {"q": q, "k": k, "v": v, "g": g, "beta": beta}

    def zero_cache(self, batch_size: int, max_len: int) -> dict:
        """`{"q_conv", "k_conv": [B, W - 1, H K], "v_conv": [B, W - 1, HV V]` in dtype,
        `"state": [B, HV, K, V]` in acc_dtype`}`."""
        width, key_dim = self.conv_size - 1, self.num_heads * self.head_dim
        return {
            "q_conv": jnp.zeros((batch_size, width, key_dim), self.dtype),
            "k_conv": jnp.zeros((batch_size, width, key_dim), self.dtype),
            "v_conv": jnp.zeros((batch_size, width, self.v_heads * self.head_v_dim), self.dtype),
            "state": jnp.zeros(
                (batch_size, self.v_heads, self.head_dim, self.head_v_dim), self.acc_dtype
            ),
        }

    def step(self, x_t: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """One decoding step: `x_t: [B, d_model]` -> `(y_t: [B, d_model], new_cache)`."""
        self.check_token(x_t)
        q, q_conv = causal_conv1d_step(self.q_proj(x_t), cache["q_conv"], self.q_conv)
        k, k_conv = causal_conv1d_step(self.k_proj(x_t), cache["k_conv"], self.k_conv)
        v, v_conv = causal_conv1d_step(self.v_proj(x_t), cache["v_conv"], self.v_conv)
        q, k, v = self._heads(jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v))
        g, beta = self._gates(x_t)
        o, state = self._op_step(q, k, v, g, beta, cache["state"])
        new_cache = {"q_conv": q_conv, "k_conv": k_conv, "v_conv": v_conv, "state": state}
        return self._output(o, x_t), new_cache

    def extend(self, x: jax.Array, cache: dict, lengths=None) -> tuple[jax.Array, dict]:
        """`x: [B, T, d_model]` continuing from `cache`, row `b`'s first `lengths[b]` tokens real:
        `(y: [B, T, d_model], cache after the real tokens)` (see `seqlab.modules.mixer`). Pads
        are identity tokens of the op: `g = 0`, `beta = 0`."""
        lengths, real = self.check_extend(x, lengths)
        q, k, v, convs = extend_qkv(self, x, cache, lengths)
        q, k, v = self._heads(q, k, v)
        g, beta = (pad_identity(a, real) for a in self._gates(x))
        o, state = self._op(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            initial_state=cache["state"],
            output_final_state=True,
            chunk_size=self.chunk_size,
            impl=self.impl,
        )
        return self._output(o, x), {**convs, "state": state.astype(cache["state"].dtype)}

    def _heads(self, q: jax.Array, k: jax.Array, v: jax.Array):
        """Split heads: `q, k: [..., H K] -> [..., H, K]` (unit norm), `v -> [..., HV, V]`."""
        q = l2_normalize(q.reshape(*q.shape[:-1], self.num_heads, self.head_dim))
        k = l2_normalize(k.reshape(*k.shape[:-1], self.num_heads, self.head_dim))
        return q, k, v.reshape(*v.shape[:-1], self.v_heads, self.head_v_dim)

    def _gates(self, x: jax.Array):
        """Log-decay `g = -exp(A_log) softplus(a_proj x + dt_bias)` and `beta = sigmoid(b_proj x)`,
        both `[..., HV]` in the accumulation dtype."""
        acc = self.acc_dtype
        dt = jax.nn.softplus(self.a_proj(x).astype(acc) + self.dt_bias.astype(acc))
        g = -jnp.exp(self.A_log.astype(acc)) * dt
        return g, jax.nn.sigmoid(self.b_proj(x).astype(acc))

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """`o_proj(rms_norm(o) * silu(g_proj x))` for `o: [..., HV, V]`, `x: [..., d_model]`."""
        gate = self.g_proj(x).reshape(o.shape)
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(*o.shape[:-2], self.v_heads * self.head_v_dim))
