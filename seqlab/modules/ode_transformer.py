"""Neural-ODE transformer (Tong et al., "Neural ODE Transformers", arXiv 2503.01329).

One block whose weights are functions of a continuous depth `t in [0, 1]`, integrated by explicit
Euler with a step count chosen at call time:

    e(t)  = [t, sin(1000 t w_i), cos(1000 t w_i)],  w_i = 10000^(-i/n), i < n = time_features
    h(t)  = Lin2(SiLU(Lin1(e(t))))                  [hidden], its own network per weight
    W(t)  = sum_j h_j(t) A_j + B  (+ U V^T)         every attention and MLP weight
    g(t)  = 1 + sum_j h_j(t) F_j                    LayerNorm scales, F zero-initialized
    f(t, x) = Attn(LN(x) g_attn(t); W_q, W_k, W_v, W_o (t)) + MLP(LN(x) g_mlp(t); W_1, W_2 (t))
    x_0 = E[tokens],  x_{k+1} = x_k + dt f(k dt, x_k),  dt = 1 / num_steps
    logits = LayerNorm(x_N) E^T                     tied embedding

The attention and MLP branches are parallel (both read `x`); attention is causal softmax attention
with RoPE (`seqlab.ops.attention`), the MLP is `gelu(x W_1) W_2`; nothing has a bias. As in the
paper's code (SDML-KU/qkvflow) every generated weight and every norm scale has its own time network
`h`; unlike it, the Euler times start at `t_0 = 0` (theirs at `dt`) and there are no biases.

Initialization: `B` as an ordinary transformer (`N(0, 1 / fan_in)`), `A_j` with a tenth of that
scale spread over the `hidden` directions, so the initial weights vary mildly with `t` and training
starts like a weight-shared transformer.

LoRA (`lora_rank = r > 0`): a time-independent low-rank delta `U V^T` on every generated attention
and MLP weight, viewed as a `[fan_in, fan_out]` matrix: `U: [fan_in, r]` zero-initialized (so LoRA
starts as the identity change), `V: [fan_out, r]` normal with variance `1/r`; parameters named
`lora_u`, `lora_v`. No `alpha / r` factor: the learning rate of the fine-tuning run sets the scale.

`evaluate_at(model, variables, num_steps)` samples the ordinary `num_steps`-layer
`DiscreteTransformer` with the same logits.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.modules import initializers
from seqlab.modules.embedding import TiedEmbedding
from seqlab.ops.attention import attention, rope
from seqlab.ops.checks import accumulation_dtype, check_floating, check_positive_int, check_shape

_LN_EPS = 1e-5
_TIME_SCALE = 0.1  # init scale of the time-dependent part A relative to the constant part B
_TIME_STRETCH = 1000.0  # e(t) reads sin(1000 t w_i): depths in [0, 1] span many periods
_MAX_PERIOD = 10000.0
BLOCK_WEIGHTS = ("wq", "wk", "wv", "wo", "w1", "w2", "ln_attn", "ln_mlp")


def time_embedding(t: jax.Array, num_features: int) -> jax.Array:
    """Sinusoidal depth embedding `e(t) = [t, sin(1000 t w_i), cos(1000 t w_i)]`, `i < n`.

    `w_i = 10000^(-i/n)`. `t: [...]` floating -> `[..., 2 n + 1]` in `t.dtype`.
    """
    freqs = _MAX_PERIOD ** -(jnp.arange(num_features, dtype=t.dtype) / num_features)  # [n]
    angle = _TIME_STRETCH * t[..., None] * freqs  # [..., n]
    return jnp.concatenate([t[..., None], jnp.sin(angle), jnp.cos(angle)], axis=-1)


class _TimeNet(nn.Module):
    """`h(t) = Lin2(SiLU(Lin1(e(t))))`: `e: [..., E]` -> `[..., hidden]`."""

    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, e: jax.Array) -> jax.Array:
        def dense(name: str) -> nn.Dense:
            return nn.Dense(
                self.hidden, dtype=self.param_dtype, param_dtype=self.param_dtype, name=name
            )

        return dense("lin2")(nn.silu(dense("lin1")(e)))


class TimeLinear(nn.Module):
    """A weight that depends on depth: `W(t) = sum_j h_j(t) A_j + B (+ U V^T)`.

    `__call__(e: [..., E]) -> [..., *in_shape, *out_shape]` for the time embedding `e` of one or
    several times. Parameters: `time` (the network `h`), `A: [hidden, *in_shape, *out_shape]`,
    `B: [*in_shape, *out_shape]`, and with `lora_rank = r > 0` `lora_u: [fan_in, r]` (zeros),
    `lora_v: [fan_out, r]`.
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    hidden: int
    lora_rank: int = 0
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, e: jax.Array) -> jax.Array:
        shape = (*self.in_shape, *self.out_shape)
        fan_in, fan_out = math.prod(self.in_shape), math.prod(self.out_shape)
        std = fan_in**-0.5
        init_a = initializers.normal(_TIME_SCALE * std / math.sqrt(self.hidden))
        a = self.param("A", init_a, (self.hidden, *shape), self.param_dtype)
        b = self.param("B", initializers.normal(std), shape, self.param_dtype)
        h = _TimeNet(self.hidden, self.param_dtype, name="time")(e)  # [..., hidden]
        w = jnp.tensordot(h, a, axes=1) + b  # sum_j h_j A_j + B: [..., *shape]
        if self.lora_rank:
            r = self.lora_rank
            u = self.param("lora_u", nn.initializers.zeros, (fan_in, r), self.param_dtype)
            v = self.param(
                "lora_v", nn.initializers.normal(r**-0.5), (fan_out, r), self.param_dtype
            )
            w = w + (u @ v.T).reshape(shape)
        return w


class TimeNormScale(nn.Module):
    """A LayerNorm scale that depends on depth: `g(t) = 1 + sum_j h_j(t) F_j`, `F` zeros at init.

    `__call__(e: [..., E]) -> [..., features]`. Parameters: `time` (the network `h`),
    `F: [hidden, features]`.
    """

    features: int
    hidden: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, e: jax.Array) -> jax.Array:
        f = self.param("F", nn.initializers.zeros, (self.hidden, self.features), self.param_dtype)
        return 1 + _TimeNet(self.hidden, self.param_dtype, name="time")(e) @ f


def block_update(weights: dict, x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The parallel block `Attn(LN(x) g_attn) + MLP(LN(x) g_mlp)` with the weights of one depth.

    Args:
      weights: `wq, wk, wv: [D, H, K]`, `wo: [H, K, D]`, `w1: [D, F]`, `w2: [F, D]`,
        `ln_attn, ln_mlp: [D]` (the dict `ODETransformer.weights(t)` returns).
      x: `[B, T, D]` hidden states.
      dtype: compute dtype of the projections; LayerNorm and softmax run in float32 or wider.

    Returns:
      `[B, T, D]` in `dtype`; token `t` depends on tokens `<= t` only (causal attention).
    """
    acc = accumulation_dtype(dtype)
    w = {name: value.astype(dtype) for name, value in weights.items()}
    positions = jnp.arange(x.shape[1], dtype=jnp.int32)
    normed = jax.nn.standardize(x.astype(acc), axis=-1, epsilon=_LN_EPS)  # (x - mean) / std

    a = (normed * weights["ln_attn"].astype(acc)).astype(dtype)
    q = rope(jnp.einsum("btd,dhk->bthk", a, w["wq"]), positions)
    k = rope(jnp.einsum("btd,dhk->bthk", a, w["wk"]), positions)
    v = jnp.einsum("btd,dhk->bthk", a, w["wv"])
    o = attention(q, k, v, q_positions=positions, k_positions=positions)
    attn = jnp.einsum("bthk,hkd->btd", o, w["wo"])

    m = (normed * weights["ln_mlp"].astype(acc)).astype(dtype)
    mlp = jax.nn.gelu(m @ w["w1"]) @ w["w2"]
    return attn + mlp


def _check_sizes(module) -> None:
    for name in ("vocab_size", "d_model", "num_heads", "d_ff"):
        check_positive_int(name, getattr(module, name))
    if module.d_model % module.num_heads:
        raise ValueError(
            f"d_model = {module.d_model} must be divisible by num_heads = {module.num_heads}"
        )
    if (module.d_model // module.num_heads) % 2:
        raise ValueError(
            f"d_model // num_heads must be even for RoPE, got {module.d_model // module.num_heads}"
        )


class _TiedLM(nn.Module):
    """Shared by both models: the tied embedding and LayerNorm readout (`TiedEmbedding`)."""

    def _setup_embedding(self):
        self.embedding = TiedEmbedding(
            self.vocab_size, self.d_model, "layer", _LN_EPS, self.dtype, self.param_dtype
        )

    @property
    def acc_dtype(self) -> jnp.dtype:
        """The residual stream and the logits: float32, or float64 for a float64 model."""
        return accumulation_dtype(self.dtype)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def embed(self, tokens: jax.Array) -> jax.Array:
        """`tokens: [B, T]` int -> `x_0 = E[tokens]: [B, T, D]` in `dtype`."""
        check_shape("tokens", tokens, (None, None), "[B, T]")
        return self.embedding.embed(tokens)

    def readout(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, D]` -> logits `LayerNorm(x) E^T: [B, T, V]` in float32 (float64 for a
        float64 model)."""
        check_shape("x", x, (None, None, self.d_model), "[B, T, d_model]")
        return self.embedding.readout(x)


class ODETransformer(_TiedLM):
    """Transformer as an ODE in depth (see the module docstring).

    `__call__(tokens: [B, T] int, *, num_steps=None) -> logits [B, T, V]`;
    `embed(tokens) -> [B, T, D]`; `weights(t) -> dict` (every block weight at depth `t`);
    `vector_field(t, x: [B, T, D]) -> dx/dt: [B, T, D]`; `readout(x) -> logits`.

    Attributes:
      vocab_size, d_model, d_ff: the sizes of the vocabulary, the residual stream and the MLP.
      num_heads: attention heads, of width `d_model // num_heads` (even).
      num_steps: default Euler step count on `[0, 1]` (`dt = 1 / num_steps`).
      time_features: `n`, the number of frequencies of `e(t)` (`2 n + 1` features).
      hidden: width of every time network `h(t)`, the number of `A_j` per weight.
      lora_rank: 0 for none; `r > 0` adds `U V^T` (parameters named `lora_*`) to every attention
        and MLP weight.
      dtype: compute dtype; param_dtype: parameter dtype (the weights `W(t)` are generated in it).
    """

    vocab_size: int
    d_model: int
    num_heads: int
    d_ff: int
    num_steps: int = 12
    time_features: int = 16
    hidden: int = 64
    lora_rank: int = 0
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        _check_sizes(self)
        for name in ("num_steps", "time_features", "hidden"):
            check_positive_int(name, getattr(self, name))
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int):
            raise ValueError(f"lora_rank must be an int >= 0, got {self.lora_rank!r}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be an int >= 0, got {self.lora_rank!r}")
        super().__post_init__()

    def setup(self):
        self._setup_embedding()
        d, h, k, f = self.d_model, self.num_heads, self.head_dim, self.d_ff

        def linear(in_shape, out_shape, name):
            return TimeLinear(
                in_shape, out_shape, self.hidden, self.lora_rank, self.param_dtype, name=name
            )

        def scale(name):
            return TimeNormScale(d, self.hidden, self.param_dtype, name=name)

        self.wq, self.wk, self.wv = (linear((d,), (h, k), name) for name in ("wq", "wk", "wv"))
        self.wo = linear((h, k), (d,), "wo")
        self.w1 = linear((d,), (f,), "w1")
        self.w2 = linear((f,), (d,), "w2")
        self.ln_attn, self.ln_mlp = scale("ln_attn"), scale("ln_mlp")

    def weights(self, t) -> dict[str, jax.Array]:
        """Every block weight at depth `t` (a scalar, or `[N]` for `N` depths at once).

        Returns `wq, wk, wv: [..., D, H, K]`, `wo: [..., H, K, D]`, `w1: [..., D, F]`,
        `w2: [..., F, D]`, `ln_attn, ln_mlp: [..., D]` in `param_dtype`, with `...` the shape of
        `t`.
        """
        t = jnp.asarray(t, self.param_dtype)
        if t.ndim > 1:
            raise ValueError(f"t must be a scalar or have shape [N], got shape {t.shape}")
        e = time_embedding(t, self.time_features)
        return {name: getattr(self, name)(e) for name in BLOCK_WEIGHTS}

    def vector_field(self, t, x: jax.Array) -> jax.Array:
        """`dx/dt = f(t, x)` for hidden states `x: [B, T, D]` at scalar depth `t`; `[B, T, D]` in
        `x.dtype`."""
        check_floating("x", x)
        check_shape("x", x, (None, None, self.d_model), "[B, T, d_model]")
        check_shape("t", t, (), "[] (a scalar)")
        return block_update(self.weights(t), x, self.dtype).astype(x.dtype)

    def __call__(self, tokens: jax.Array, *, num_steps: int | None = None) -> jax.Array:
        """`tokens: [B, T]` int -> logits `[B, T, V]` after `num_steps` Euler steps (default
        `self.num_steps`; a Python int, static under `jit`)."""
        num_steps = self.num_steps if num_steps is None else num_steps
        check_positive_int("num_steps", num_steps)
        x0 = self.embed(tokens).astype(self.acc_dtype)
        dt = 1.0 / num_steps
        ts = jnp.arange(num_steps, dtype=self.param_dtype) / num_steps  # t_k = k dt

        def euler(x, weights_k):  # x_{k+1} = x_k + dt f(t_k, x_k)
            return x + dt * block_update(weights_k, x, self.dtype).astype(x.dtype), None

        x, _ = jax.lax.scan(euler, x0, self.weights(ts))
        return self.readout(x)


class DiscreteBlock(nn.Module):
    """One layer of `DiscreteTransformer`: `x + block_update(weights, x)` with its own weights
    (the names and shapes of `ODETransformer.weights`); `x: [B, T, D]` in the residual dtype."""

    d_model: int
    num_heads: int
    d_ff: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d, h, f = self.d_model, self.num_heads, self.d_ff
        k = d // h
        shapes = {
            "wq": (d, h, k),
            "wk": (d, h, k),
            "wv": (d, h, k),
            "wo": (h, k, d),
            "w1": (d, f),
            "w2": (f, d),
        }
        weights = {
            name: self.param(
                name,
                initializers.normal((d if name != "w2" else f) ** -0.5),
                shape,
                self.param_dtype,
            )
            for name, shape in shapes.items()
        }
        for name in ("ln_attn", "ln_mlp"):
            weights[name] = self.param(name, nn.initializers.ones, (d,), self.param_dtype)
        return x + block_update(weights, x, self.dtype).astype(x.dtype)


class DiscreteTransformer(_TiedLM):
    """An ordinary `num_layers`-layer transformer of parallel blocks (`DiscreteBlock`), tied
    embedding and final LayerNorm: the discrete model `evaluate_at` samples.

    `__call__(tokens: [B, T] int) -> logits [B, T, V]`; `embed`, `readout` as `ODETransformer`.
    """

    vocab_size: int
    d_model: int
    num_heads: int
    d_ff: int
    num_layers: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        _check_sizes(self)
        check_positive_int("num_layers", self.num_layers)
        super().__post_init__()

    def setup(self):
        self._setup_embedding()
        self.blocks = [
            DiscreteBlock(self.d_model, self.num_heads, self.d_ff, self.dtype, self.param_dtype)
            for _ in range(self.num_layers)
        ]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """`tokens: [B, T]` int -> logits `[B, T, V]`."""
        x = self.embed(tokens).astype(self.acc_dtype)
        for block in self.blocks:
            x = block(x)
        return self.readout(x)


def evaluate_at(
    model: ODETransformer, variables: dict, num_steps: int
) -> tuple[DiscreteTransformer, dict]:
    """The `num_steps`-layer transformer that computes `model` at `num_steps` Euler steps.

    Layer `k` holds the weights at `t_k = k / num_steps` with `dt` folded into the output
    projections (`W_o`, `W_2`), so `x_{k+1} = x_k + dt f(t_k, x_k)` is an ordinary residual layer
    (LoRA deltas are merged in).

    Args:
      model: the `ODETransformer`.
      variables: `{"params": params}` of `model`, as passed to `model.apply`.
      num_steps: the number of layers (`dt = 1 / num_steps`).

    Returns:
      `(discrete, discrete_variables)` with `discrete.apply(discrete_variables, tokens)` equal to
      `model.apply(variables, tokens, num_steps=num_steps)`.
    """
    check_positive_int("num_steps", num_steps)
    if "params" not in variables:
        raise ValueError("variables must be the dict {'params': params} of the model")
    params = variables["params"]
    ts = jnp.arange(num_steps, dtype=model.param_dtype) / num_steps
    stacked = model.apply(variables, ts, method="weights")  # each [num_steps, ...]
    dt = 1.0 / num_steps
    stacked = {**stacked, "wo": stacked["wo"] * dt, "w2": stacked["w2"] * dt}
    discrete = DiscreteTransformer(
        vocab_size=model.vocab_size,
        d_model=model.d_model,
        num_heads=model.num_heads,
        d_ff=model.d_ff,
        num_layers=num_steps,
        dtype=model.dtype,
        param_dtype=model.param_dtype,
    )
    layers = {
        f"blocks_{k}": {name: value[k] for name, value in stacked.items()} for k in range(num_steps)
    }
    return discrete, {"params": {"embedding": params["embedding"], **layers}}
