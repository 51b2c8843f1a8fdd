"""Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs"): the SSD layer of `mamba_ssm`.

For `x: [B, T, d_model]`, with `d_inner = expand * d_model`, `H = d_inner / head_dim` heads of width
`P = head_dim`, `G = n_groups` groups of state width `N = d_state`:

    z, xBC, dt  = split(in_proj(x))                     # [d_inner], [d_inner + 2 G N], [H]
    x, B, C     = split(silu(causal_conv1d(xBC)))       # [H, P], [G, N], [G, N]
    dt          = softplus(dt + dt_bias)                # [H], per head
    A           = -exp(A_log)                           # [H], per head
    S_t         = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T    # [N, P] per head; G groups share B, C
    y_t         = S_t^T C_t + D x_t
    out         = out_proj(norm(y, z))

The recurrence is `seqlab.ops.ssd` with `q = C`, `k = B`, `v = dt * x`, `g = dt * A`. The output
norm follows `mamba_ssm`: an RMSNorm over each of the `G` groups of `d_inner / G` channels, gated by
`silu(z)`, by default applied after the gate (`norm_before_gate=False`:
`rms_norm(y * silu(z))`); `norm_before_gate=True` gives `rms_norm(y) * silu(z)`. Hugging Face
transformers' `Mamba2Mixer` (its pure-torch path, `torch_forward`, through 4.57) normalizes over
all `d_inner` channels at once whatever `G` is, which differs from `mamba_ssm` when `G > 1`:
`norm_per_group=False` gives that behaviour, so a converted checkpoint reproduces either
(`seqlab.interop`).

Initialization follows `mamba_ssm.modules.mamba2.Mamba2` (`A ~ U(1, 16]`, `dt` log-uniform in
`[dt_min, dt_max]` floored at `dt_init_floor` and stored as `dt_bias = softplus^{-1}(dt)`, `D = 1`,
depthwise conv `U(-1/sqrt(W), 1/sqrt(W))` as PyTorch's default, conv bias on, projections without
bias). The projections use Flax's default (LeCun normal) initializer rather than PyTorch's uniform.

`init_cache`/`step` decode one token at a time from a cache holding the last `W - 1` conv inputs and
the state `[B, H, N, P]` in float32 (float64 for float64 compute).
"""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.modules import initializers
from seqlab.modules.mixer import Mixer, check_dt_init, extend_conv, pad_identity, sequence_op
from seqlab.ops.checks import check_positive_int
from seqlab.ops.conv import causal_conv1d, causal_conv1d_step
from seqlab.ops.norm import gated_rms_norm, rms_norm
from seqlab.ops.ssd import ssd, ssd_step


class Mamba2(Mixer):
    """Mamba-2 mixer: `[B, T, d_model] -> [B, T, d_model]` (see the module docstring).

    Attributes:
      d_model: model width.
      d_state: state width `N` per group (`mamba_ssm` default 128).
      head_dim: head width `P` (default 64); `expand * d_model` must be a multiple of it.
      expand: `d_inner = expand * d_model`.
      n_groups: groups `G` sharing `B` and `C` (and normalized together); divides the heads.
      conv_size: width `W` of the causal depthwise convolution over `(x, B, C)`.
      chunk_size: chunk length of the chunked SSD (forwarded to `seqlab.ops.ssd`).
      impl: implementation of `seqlab.ops.ssd` (None: auto). Decoding always uses `ssd_step`.
      dt_min, dt_max, dt_init_floor: range of the initial step size `softplus(dt_bias)`.
      A_init_range: range `(low, high]` of the initial decay rates `A = exp(A_log)`.
      norm_eps: epsilon of the output RMSNorm (1e-5 as `mamba_ssm`).
      norm_before_gate: `rms_norm(y) * silu(z)` instead of `mamba_ssm`'s `rms_norm(y * silu(z))`.
      norm_per_group: one RMSNorm per group of `d_inner / G` channels (`mamba_ssm`); False: one
        over all `d_inner` channels (transformers' `Mamba2Mixer`). Equal when `G = 1`.
      dtype: compute dtype; states and gates accumulate in `promote_types(dtype, float32)`.
      param_dtype: parameter dtype.
      seq_axis: the mesh axis the time axis is split over when the module runs inside
        `shard_map` (sequence parallelism); None: the whole sequence is local. Decoding ignores
        it.
    """

    d_model: int
    d_state: int = 128
    head_dim: int = 64
    expand: int = 2
    n_groups: int = 1
    conv_size: int = 4
    chunk_size: int = 64
    impl: str | None = None
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    A_init_range: tuple[float, float] = (1.0, 16.0)
    norm_eps: float = 1e-5
    norm_before_gate: bool = False
    norm_per_group: bool = True
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    seq_axis: str | None = None

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def num_heads(self) -> int:
        return self.d_inner // self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: `x`, `B` and `C`."""
        return self.d_inner + 2 * self.n_groups * self.d_state

    def check_fields(self) -> None:
        for name in ("d_model", "d_state", "head_dim", "expand", "n_groups", "conv_size"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("chunk_size", self.chunk_size)
        if self.d_inner % self.head_dim:
            raise ValueError(
                f"head_dim must divide d_inner = expand * d_model = {self.d_inner}, "
                f"got head_dim={self.head_dim}"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"n_groups must divide the number of heads {self.num_heads}, "
                f"got n_groups={self.n_groups}"
            )
        check_dt_init(self.dt_min, self.dt_max, self.dt_init_floor)
        low, high = self.A_init_range
        if not 0 <= low < high:
            raise ValueError(
                f"A_init_range must be (low, high) with 0 <= low < high, got {low, high}"
            )

    def setup(self):
        heads, pd = self.num_heads, self.param_dtype
        dense = partial(nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=pd)
        self.in_proj = dense(2 * self.d_inner + 2 * self.n_groups * self.d_state + heads)
        kernel_init = initializers.uniform(self.conv_size**-0.5)  # PyTorch's depthwise Conv1d
        self.conv_weight = self.param(
            "conv_weight", kernel_init, (self.conv_size, self.conv_dim), pd
        )
        self.conv_bias = self.param("conv_bias", kernel_init, (self.conv_dim,), pd)
        dt_init = initializers.dt_bias(self.dt_min, self.dt_max, self.dt_init_floor)
        self.dt_bias = self.param("dt_bias", dt_init, (heads,), pd)
        self.A_log = self.param("A_log", initializers.a_log(*self.A_init_range), (heads,), pd)
        self.D = self.param("D", nn.initializers.ones, (heads,), pd)
        self.norm_weight = self.param("norm_weight", nn.initializers.ones, (self.d_inner,), pd)
        self.out_proj = dense(self.d_model)

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, d_model]` -> `[B, T, d_model]` in `dtype`."""
        inputs, x_heads, z = self._features(x)
        o, _ = sequence_op(ssd, self.seq_axis)(**inputs, chunk_size=self.chunk_size, impl=self.impl)
        return self._output(o, x_heads, z)

    def op_inputs(self, x: jax.Array) -> dict:
        """The operands of `seqlab.ops.ssd` for `x: [B, T, d_model]`, as `__call__` passes them:
        `{"q": C, "k": B: [B, T, G, N], "v": dt x: [B, T, H, P]` in dtype, `"g": dt A: [B, T, H]`
        in `acc_dtype`}."""
        return self._features(x)[0]

    def _features(self, x: jax.Array) -> tuple[dict, jax.Array, jax.Array]:
        """`(ssd operands, x: [B, T, H, P], z: [B, T, d_inner])` of `x: [B, T, d_model]`."""
        self.check_sequence(x)
        z, xbc, dt = self._split(self.in_proj(x))
        conv = sequence_op(causal_conv1d, self.seq_axis)
        xbc = jax.nn.silu(conv(xbc, self.conv_weight, self.conv_bias))
        x_heads, q, k, v, g = self._ssm_inputs(xbc, dt)
        return dict(q=q, k=k, v=v, g=g), x_heads, z

    def zero_cache(self, batch_size: int, max_len: int) -> dict:
        """`{"conv": [B, W - 1, d_inner + 2 G N] in dtype, "state": [B, H, N, P] in acc_dtype}`."""
        return {
            "conv": jnp.zeros((batch_size, self.conv_size - 1, self.conv_dim), self.dtype),
            "state": jnp.zeros(
                (batch_size, self.num_heads, self.d_state, self.head_dim), self.acc_dtype
            ),
        }

    def step(self, x_t: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """One decoding step: `x_t: [B, d_model]` -> `(y_t: [B, d_model], new_cache)`."""
        self.check_token(x_t)
        z, xbc, dt = self._split(self.in_proj(x_t))
        xbc, conv = causal_conv1d_step(xbc, cache["conv"], self.conv_weight, self.conv_bias)
        x_heads, q, k, v, g = self._ssm_inputs(jax.nn.silu(xbc), dt)
        o, state = ssd_step(q, k, v, g, cache["state"])
        return self._output(o, x_heads, z), {"conv": conv, "state": state}

    def extend(self, x: jax.Array, cache: dict, lengths=None) -> tuple[jax.Array, dict]:
        """`x: [B, T, d_model]` continuing from `cache`, row `b`'s first `lengths[b]` tokens real:
        `(y: [B, T, d_model], cache after the real tokens)` (see `seqlab.modules.mixer`). Pads
        are identity tokens of the op: a step `dt = 0`, so `g = dt A = 0` and `v = dt x = 0`."""
        lengths, real = self.check_extend(x, lengths)
        z, xbc, dt = self._split(self.in_proj(x))
        xbc, conv = extend_conv(xbc, cache["conv"], self.conv_weight, self.conv_bias, lengths)
        x_heads, q, k, v, g = self._ssm_inputs(jax.nn.silu(xbc), dt)
        o, state = ssd(
            q=q,
            k=k,
            v=pad_identity(v, real),
            g=pad_identity(g, real),
            initial_state=cache["state"],
            output_final_state=True,
            chunk_size=self.chunk_size,
            impl=self.impl,
        )
        new_cache = {"conv": conv, "state": state.astype(cache["state"].dtype)}
        return self._output(o, x_heads, z), new_cache

    def _split(self, zxbcdt: jax.Array):
        """`[..., 2 d_inner + 2 G N + H]` -> `z: [..., d_inner]`, `xBC: [..., conv_dim]`,
        `dt: [..., H]`."""
        return jnp.split(zxbcdt, [self.d_inner, self.d_inner + self.conv_dim], axis=-1)

    def _ssm_inputs(self, xbc: jax.Array, dt: jax.Array):
        """Heads and SSD operands from the convolved `xBC: [..., conv_dim]` and raw `dt: [..., H]`.

        Returns `x: [..., H, P]` and the `ssd` operands `q = C, k = B: [..., G, N]`,
        `v = dt x: [..., H, P]`, `g = dt A: [..., H]` (`g` in the accumulation dtype).
        """
        lead = xbc.shape[:-1]
        gn = self.n_groups * self.d_state
        x, b, c = jnp.split(xbc, [self.d_inner, self.d_inner + gn], axis=-1)
        x = x.reshape(*lead, self.num_heads, self.head_dim)
        b = b.reshape(*lead, self.n_groups, self.d_state)
        c = c.reshape(*lead, self.n_groups, self.d_state)
        acc = self.acc_dtype
        dt = jax.nn.softplus(dt.astype(acc) + self.dt_bias.astype(acc))
        g = -jnp.exp(self.A_log.astype(acc)) * dt
        v = (x.astype(acc) * dt[..., None]).astype(self.dtype)
        return x, c, b, v, g

    def _output(self, o: jax.Array, x: jax.Array, z: jax.Array) -> jax.Array:
        """`out_proj(norm(o + D x, z))` for `o, x: [..., H, P]`, `z: [..., d_inner]`."""
        acc = self.acc_dtype
        y = o.astype(acc) + self.D.astype(acc)[:, None] * x.astype(acc)
        y = y.reshape(*y.shape[:-2], self.d_inner)
        return self.out_proj(self._gated_norm(y, z.astype(acc)).astype(self.dtype))

    def _gated_norm(self, y: jax.Array, z: jax.Array) -> jax.Array:
        """RMSNorm over each of the `G` channel groups of `y: [..., d_inner]` (over all channels
        without `norm_per_group`), gated by silu(z)."""
        n = self.n_groups if self.norm_per_group else 1

        def groups(a):
            return a.reshape(*a.shape[:-1], n, self.d_inner // n)

        weight = groups(self.norm_weight)  # [G, d_inner / G]
        if self.norm_before_gate:
            norm = jax.vmap(partial(gated_rms_norm, eps=self.norm_eps), (-2, -2, 0), -2)
            out = norm(groups(y), groups(z), weight)
        else:
            norm = jax.vmap(partial(rms_norm, eps=self.norm_eps), (-2, 0), -2)
            out = norm(groups(y * jax.nn.silu(z)), weight)
        return out.reshape(y.shape)
