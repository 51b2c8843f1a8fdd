"""Gated DeltaProduct mixer (Siems et al., "DeltaProduct", arXiv 2502.10297).

For `x: [B, T, d_model]`, `n = num_householder` writes per token, `H = num_heads` query/key heads
of width `K = head_dim`, `HV = num_v_heads` value heads of width `V = expand_v * head_dim`
(grouped value attention when `HV > H`):

    q       = silu(causal_conv1d(q_proj x))            # [H, K]
    k, v    = silu(causal_conv1d(k_proj x)), ...       # [n, H, K], [n, HV, V]: n keys and values
    q, k    = q / ||q||, k / ||k||                     # per head (and per write), in float32
    beta    = sigmoid(b_proj x)                        # [n, HV]; times 2 with allow_neg_eigval
    g       = -exp(A_log) * softplus(a_proj x + dt_bias)   # [HV], Mamba-2 gate (0 without
                                                       #   use_forget_gate)
    S       = exp(g_t) S;  then for j < n:  S += k_tj (beta_tj (v_tj - S^T k_tj))^T   # [K, V]
    o_t     = S^T q_t / sqrt(K)
    out     = o_proj(rms_norm(o) * silu(g_proj x))      # plain rms_norm(o) without use_output_gate

The token's transition is the product of `n` generalized Householder matrices
`I - beta_tj k_tj k_tj^T` (eigenvalues in [-1, 1] with `allow_neg_eigval`). The recurrence is
`seqlab.ops.gated_delta_product`, which takes the writes token-major: write `j` of token `t` is row
`t * n + j` of `k: [B, T n, H, K]`, `v: [B, T n, HV, V]`, `beta: [B, T n, HV]`.

Layout, defaults and initialization follow flash-linear-attention's `fla.layers.GatedDeltaProduct`
(the authors contributed it there): the `n` keys, values and betas of a token are the `n` slices
`(n, heads, width)` of one projection each (`k_proj: d_model -> n H K`, `v_proj -> n HV V`,
`b_proj -> n HV`, no biases), each with its short convolution over all `n H K` (`n HV V`)
channels; `num_heads=6`, `head_dim=256`, `expand_v=2`, `num_householder=2`,
`allow_neg_eigval=True`, `conv_size=4` without conv bias, `norm_eps=1e-5`, L2-norm epsilon 1e-6,
`A ~ U(0, 16]`, `dt` log-uniform in `[1e-3, 1e-1]` floored at `1e-4`; `use_forget_gate=False`
and `use_output_gate=False` give the ungated DeltaProduct of the paper's language models. The
projections use Flax's default (LeCun normal) initializer rather than fla's Xavier uniform with
gain 2^-2.5.

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
from seqlab.ops.gated_delta_product import gated_delta_product, gated_delta_product_step
from seqlab.ops.norm import l2_normalize

_A_INIT_RANGE = (0.0, 16.0)
_DT_MIN, _DT_MAX, _DT_INIT_FLOOR = 1e-3, 1e-1, 1e-4


class GatedDeltaProduct(Mixer):
    """Gated DeltaProduct mixer: `[B, T, d_model] -> [B, T, d_model]` (see the module docstring).

    Attributes:
      d_model: model width.
      num_heads: query/key heads `H`.
      head_dim: query/key head width `K`.
      num_v_heads: value heads `HV` (None: `num_heads`); a multiple of `num_heads`.
      expand_v: value head width `V = expand_v * head_dim` (must be an integer).
      num_householder: delta-rule writes `n` per token (1: Gated DeltaNet's recurrence).
      allow_neg_eigval: `beta = 2 sigmoid(.)` in (0, 2): Householder eigenvalues down to -1.
      use_forget_gate: the decay `g`; without it `g = 0` (no `a_proj`, `A_log`, `dt_bias`).
      use_output_gate: `rms_norm(o) * silu(g_proj x)`; without it `rms_norm(o)` (no `g_proj`).
      conv_size: width `W` of the causal depthwise convolutions on q, k and v.
      norm_eps: epsilon of the output RMSNorm.
      impl: implementation of `seqlab.ops.gated_delta_product` (None: auto). Decoding always uses
        `gated_delta_product_step`.
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
    num_householder: int = 2
    allow_neg_eigval: bool = True
    use_forget_gate: bool = True
    use_output_gate: bool = True
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
        for name in ("d_model", "num_heads", "head_dim", "num_householder", "conv_size"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("chunk_size", self.chunk_size)
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
        pd, n, hv = self.param_dtype, self.num_householder, self.v_heads
        key_dim, value_dim = self.num_heads * self.head_dim, hv * self.head_v_dim
        dense = partial(nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=pd)
        self.q_proj, self.k_proj = dense(key_dim), dense(n * key_dim)
        self.v_proj, self.b_proj = dense(n * value_dim), dense(n * hv)
        self.o_proj = dense(self.d_model)
        conv_init = initializers.uniform(self.conv_size**-0.5)  # PyTorch's depthwise Conv1d
        self.q_conv = self.param("q_conv", conv_init, (self.conv_size, key_dim), pd)
        self.k_conv = self.param("k_conv", conv_init, (self.conv_size, n * key_dim), pd)
        self.v_conv = self.param("v_conv", conv_init, (self.conv_size, n * value_dim), pd)
        if self.use_forget_gate:
            self.a_proj = dense(hv)
            self.A_log = self.param("A_log", initializers.a_log(*_A_INIT_RANGE), (hv,), pd)
            dt_init = initializers.dt_bias(_DT_MIN, _DT_MAX, _DT_INIT_FLOOR)
            self.dt_bias = self.param("dt_bias", dt_init, (hv,), pd)
        if self.use_output_gate:
            self.g_proj = dense(value_dim)
        self.o_norm = RMSNorm(eps=self.norm_eps, param_dtype=pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, d_model]` -> `[B, T, d_model]` in `dtype`."""
        op = sequence_op(gated_delta_product, self.seq_axis)
        o, _ = op(**self.op_inputs(x), chunk_size=self.chunk_size, impl=self.impl)
        return self._output(o, x)

    def op_inputs(self, x: jax.Array) -> dict:
        """The operands of `gated_delta_product` for `x: [B, T, d_model]`, as `__call__` passes
        them.

        Returns `{"q": [B, T, H, K], "k": [B, T n, H, K]` (unit norm per head), `"v":
        [B, T n, HV, V]` in dtype, `"g": [B, T, HV], "beta": [B, T n, HV]` in float32 (float64 for
        float64 compute), `"num_householder": n}`; write `j` of token `t` is row `t n + j`.
        """
        self.check_sequence(x)
        batch, length, _ = x.shape

        def conv(proj, weight):
            return jax.nn.silu(sequence_op(causal_conv1d, self.seq_axis)(proj(x), weight))

        q, k, v = self._heads(
            conv(self.q_proj, self.q_conv),
            conv(self.k_proj, self.k_conv),
            conv(self.v_proj, self.v_conv),
        )
        g, beta = self._gates(x)
        n = self.num_householder
        return {
            "q": q,
            "k": k.reshape(batch, length * n, *k.shape[-2:]),
            "v": v.reshape(batch, length * n, *v.shape[-2:]),
            "g": g,
            "beta": beta.reshape(batch, length * n, self.v_heads),
            "num_householder": n,
        }

    def zero_cache(self, batch_size: int, max_len: int) -> dict:
        """`{"q_conv": [B, W - 1, H K], "k_conv": [B, W - 1, n H K], "v_conv":
        [B, W - 1, n HV V]` in dtype, `"state": [B, HV, K, V]` in acc_dtype`}`."""
        width, n = self.conv_size - 1, self.num_householder
        key_dim, value_dim = self.num_heads * self.head_dim, self.v_heads * self.head_v_dim
        return {
            "q_conv": jnp.zeros((batch_size, width, key_dim), self.dtype),
            "k_conv": jnp.zeros((batch_size, width, n * key_dim), self.dtype),
            "v_conv": jnp.zeros((batch_size, width, n * value_dim), self.dtype),
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
        o, state = gated_delta_product_step(q, k, v, g, beta, cache["state"])
        new_cache = {"q_conv": q_conv, "k_conv": k_conv, "v_conv": v_conv, "state": state}
        return self._output(o, x_t), new_cache

    def extend(self, x: jax.Array, cache: dict, lengths=None) -> tuple[jax.Array, dict]:
        """`x: [B, T, d_model]` continuing from `cache`, row `b`'s first `lengths[b]` tokens real:
        `(y: [B, T, d_model], cache after the real tokens)` (see `seqlab.modules.mixer`). Pads
        are identity tokens of the op: `g = 0` and `beta = 0` for all `n` writes."""
        lengths, real = self.check_extend(x, lengths)
        batch, length, _ = x.shape
        q, k, v, convs = extend_qkv(self, x, cache, lengths)
        q, k, v = self._heads(q, k, v)
        g, beta = (pad_identity(a, real) for a in self._gates(x))
        n = self.num_householder
        o, state = gated_delta_product(
            q,
            k.reshape(batch, length * n, *k.shape[-2:]),
            v.reshape(batch, length * n, *v.shape[-2:]),
            g,
            beta.reshape(batch, length * n, self.v_heads),
            num_householder=n,
            initial_state=cache["state"],
            output_final_state=True,
            chunk_size=self.chunk_size,
            impl=self.impl,
        )
        return self._output(o, x), {**convs, "state": state.astype(cache["state"].dtype)}

    def _heads(self, q: jax.Array, k: jax.Array, v: jax.Array):
        """Split heads: `q: [..., H K] -> [..., H, K]`, `k: [..., n H K] -> [..., n, H, K]` (unit
        norm), `v: [..., n HV V] -> [..., n, HV, V]`."""
        n, lead = self.num_householder, q.shape[:-1]
        q = l2_normalize(q.reshape(*lead, self.num_heads, self.head_dim))
        k = l2_normalize(k.reshape(*lead, n, self.num_heads, self.head_dim))
        return q, k, v.reshape(*lead, n, self.v_heads, self.head_v_dim)

    def _gates(self, x: jax.Array):
        """Log-decay `g = -exp(A_log) softplus(a_proj x + dt_bias): [..., HV]` (zeros without
        the forget gate) and `beta = sigmoid(b_proj x): [..., n, HV]` (times 2 with
        `allow_neg_eigval`), both in the accumulation dtype."""
        acc, lead = self.acc_dtype, x.shape[:-1]
        if self.use_forget_gate:
            dt = jax.nn.softplus(self.a_proj(x).astype(acc) + self.dt_bias.astype(acc))
            g = -jnp.exp(self.A_log.astype(acc)) * dt
        else:
            g = jnp.zeros((*lead, self.v_heads), acc)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(acc))
        beta = beta.reshape(*lead, self.num_householder, self.v_heads)
        return g, 2.0 * beta if self.allow_neg_eigval else beta

    def _output(self, o: jax.Array, x: jax.Array) -> jax.Array:
        """`o_proj(rms_norm(o) * silu(g_proj x))` (or `o_proj(rms_norm(o))`) for
        `o: [..., HV, V]`, `x: [..., d_model]`."""
        gate = self.g_proj(x).reshape(o.shape) if self.use_output_gate else None
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(*o.shape[:-2], self.v_heads * self.head_v_dim))
