"""The Mamba-1 mixer, with polarized state channels and a sign-constrained x_proj.

Per token (`x: [B, T, d_model]`, `d_inner = expand * d_model`, `N = n_ones + d_state + n_zeros`):

    x, z  = split(in_proj(x))                              # [B, T, d_inner] each
    u     = silu(causal_conv1d(x))                         # depthwise, width d_conv
    delta = W_dt (S_dt u);  B = S_B u;  C = S_C u          # x_proj then dt_proj (bias in the scan)
    y     = selective_scan(u, delta, A, B, C, D, z, delta_bias=b_dt, delta_softplus=True)
    out   = out_proj(y)

with `A = -exp(A_log)` for the learnable channels, `D = 1` at init and `S_dt: [dt_rank, d_inner]`,
`S_B, S_C: [N, d_inner]` the linear maps from the post-conv token to the scan's inputs.

With `reorder=True` (token reordering, Vo et al. arXiv 2410.03292, "Refinement 2") the post-conv
tokens and the gate are permuted by a soft sort of importance scores before the scan, and the
scan's output is permuted back:

    s_l = w^T (S_delta u_l + b_dt)                         # S_delta = W_dt S_dt, [B, T]
    P   = softsort(s, tau)                                 # [B, T, T], rows sum to 1
    y   = P^T selective_scan(P u, ..., z = P z)            # B, C, delta recomputed from P u
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.ops._checks import check_choice, check_floating, check_positive_int, check_shape
from seqlab.ops.conv import causal_conv1d, causal_conv1d_step
from seqlab.ops.selective_scan import selective_scan

SIGN_CONSTRAINTS = (None, "pos", "neg", "mixed")
_LAMBDA_FLOOR = 0.7  # |lambda| = softplus(theta) + 0.7, as in the token-dynamics authors' code


def _uniform(bound: float):
    """Uniform(-bound, bound) initializer; bound = fan_in^-0.5 is PyTorch's Linear and Conv1d
    default, which Mamba keeps for in_proj, conv, x_proj and out_proj."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _dt_bias_init(dt_min: float, dt_max: float, floor: float):
    """Mamba's dt bias: inverse-softplus of dt ~ log-uniform[dt_min, dt_max], floored at `floor`."""

    def init(key, shape, dtype=jnp.float32):
        log_dt = jax.random.uniform(key, shape, dtype, math.log(dt_min), math.log(dt_max))
        dt = jnp.maximum(jnp.exp(log_dt), jnp.asarray(floor, dtype))
        return dt + jnp.log(-jnp.expm1(-dt))  # softplus^{-1}(dt) = log(exp(dt) - 1)

    return init


def _s4d_real_init(key, shape, dtype=jnp.float32):
    """`A_log[d, n] = log(n + 1)`, so that `A = -exp(A_log) = -(1..N)` (S4D-real)."""
    del key
    return jnp.broadcast_to(jnp.log(jnp.arange(1, shape[1] + 1, dtype=dtype)), shape)


class Mamba(nn.Module):
    """Mamba-1 mixer: `x [B, T, d_model] -> [B, T, d_model]`.

    Polarization (`polarize=(n_ones, n_zeros)`, Wang et al., arXiv 2501.00658): the state gets
    `n_ones` channels in front of the `d_state` learnable ones with pre-exponential `A` fixed at
    exactly 0 (decay exactly 1: a running sum of `dt B u` that never forgets), and `n_zeros`
    channels behind them with `A` fixed at `polar_zero_A`. These `A` are constants, not parameters;
    B and C are still produced by x_proj for every channel. The "zero" channel only forgets for
    large dt: `exp(-100 dt)` is ~0.905 at dt = 1e-3 and ~4.5e-5 at dt = 0.1 (-100 is the value of
    the authors' code; it is configurable).

    Sign constraint (`sign_constraint`, Vo et al., arXiv 2410.03292, "Refinement 1"): the B-part of
    x_proj is tied to its C-part, `S_B = diag(lambda) S_C`, so that the token-interaction matrix
    `M = S_C^T S_B = S_C^T diag(lambda) S_C` is symmetric with the inertia of `lambda`:
    `lambda = softplus(theta) + 0.7` ("pos", M positive semidefinite), its negative ("neg", negative
    semidefinite), or the first `N - N // 2` entries positive and the last `N // 2` negative
    ("mixed", indefinite; the authors' code has only pos and neg). As in their code
    (Fsoft-AIC/Mamba-token-dynamic, `PosDefiniteMambav2`), `S_C` is unit upper triangular:
    `S_C = triu(P, 1) + I` for a free `P: [N, d_inner]`, so it has full rank min(N, d_inner). Unlike
    their code, which reads theta from an otherwise unused column of the x_proj weight, theta is a
    parameter of its own (`lambda_theta: [N]`, initialized like x_proj).

    Attributes:
      d_model: model width.
      d_state: learnable state channels per inner channel.
      d_conv: width of the causal depthwise convolution.
      expand: `d_inner = expand * d_model`.
      dt_rank: rank of the dt projection; None means `ceil(d_model / 16)`.
      dt_min, dt_max, dt_init_floor: range of the initial `dt = softplus(dt_bias)`.
      polarize: `(n_ones, n_zeros)` fixed state channels (see above).
      polar_zero_A: the fixed pre-exponential `A` of the "zero" channels (<= 0).
      sign_constraint: None, "pos", "neg" or "mixed" (see above).
      use_bias: biases in in_proj and out_proj.
      conv_bias: bias in the convolution.
      reorder: token reordering by importance (see the module docstring). The order depends on
        the whole sequence, so the mixer is no longer causal; `init_cache` and `step` raise
        `NotImplementedError` (a decoding step cannot reorder tokens that have not arrived).
      reorder_tau: SoftSort temperature (> 0). Small values approach a permutation; the
        authors' code uses 1, where rows of `P` average several tokens instead of permuting them.
      reorder_hard: straight-through SoftSort: the forward pass uses the exact permutation
        `one_hot(argsort(s))` (ties broken by position, so it is always a permutation), gradients
        flow through the soft matrix.
      impl: passed to `selective_scan` (None, "sequential", "parallel").
      dtype: compute dtype; param_dtype: parameter dtype.

    Unlike the authors' code (Fsoft-AIC/Mamba-token-dynamic, MambaVision), reordering is a
    per-layer option (theirs reorders only the first block of a stage), the gate `z` is permuted
    with the tokens, and the output is permuted back to the input order (theirs leaves it sorted).
    """

    d_model: int
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | None = None
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    dt_init_floor: float = 1e-4
    polarize: tuple[int, int] = (0, 0)
    polar_zero_A: float = -100.0
    sign_constraint: str | None = None
    use_bias: bool = False
    conv_bias: bool = True
    reorder: bool = False
    reorder_tau: float = 0.1
    reorder_hard: bool = False
    impl: str | None = None
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def effective_dt_rank(self) -> int:
        """`dt_rank`, or `ceil(d_model / 16)` when it is None."""
        return math.ceil(self.d_model / 16) if self.dt_rank is None else self.dt_rank

    @property
    def n_total(self) -> int:
        """State channels per inner channel: `n_ones + d_state + n_zeros`."""
        return self.polarize[0] + self.d_state + self.polarize[1]

    def __post_init__(self):
        self._validate()  # at construction: bad sizes fail before any tracing
        super().__post_init__()

    def _validate(self) -> None:
        for name in ("d_model", "d_state", "d_conv", "expand"):
            check_positive_int(name, getattr(self, name))
        if self.dt_rank is not None:
            check_positive_int("dt_rank", self.dt_rank)
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"need 0 < dt_min <= dt_max, got {self.dt_min}, {self.dt_max}")
        if self.dt_init_floor < 0:
            raise ValueError(f"dt_init_floor must be >= 0, got {self.dt_init_floor}")
        counts = self.polarize if isinstance(self.polarize, tuple | list) else ()
        if len(counts) != 2 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts
        ):
            raise ValueError(f"polarize must be (n_ones, n_zeros), ints >= 0, got {self.polarize}")
        if not self.polar_zero_A <= 0:
            raise ValueError(f"polar_zero_A must be <= 0, got {self.polar_zero_A}")
        check_choice("sign_constraint", self.sign_constraint, SIGN_CONSTRAINTS)
        if not self.reorder_tau > 0:
            raise ValueError(f"reorder_tau must be > 0, got {self.reorder_tau}")
        if self.sign_constraint == "mixed" and self.n_total < 2:
            raise ValueError("sign_constraint='mixed' needs at least 2 state channels in all")

    def setup(self):
        d_inner, rank, n = self.d_inner, self.effective_dt_rank, self.n_total
        pd = self.param_dtype
        self.in_proj = nn.Dense(
            2 * d_inner,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=pd,
            kernel_init=_uniform(self.d_model**-0.5),
        )
        conv_init = _uniform(self.d_conv**-0.5)  # depthwise: fan_in = d_conv
        self.conv_weight = self.param("conv_weight", conv_init, (self.d_conv, d_inner), pd)
        self.conv_bias_param = (
            self.param("conv_bias", conv_init, (d_inner,), pd) if self.conv_bias else None
        )
        # x_proj, flax layout [in, out]: columns [dt | B | C], or [dt | P] with a sign constraint.
        x_init = _uniform(d_inner**-0.5)
        width = rank + (n if self.sign_constraint else 2 * n)
        self.x_proj = self.param("x_proj", x_init, (d_inner, width), pd)
        if self.sign_constraint:
            self.lambda_theta = self.param("lambda_theta", x_init, (n,), pd)
        self.dt_proj = self.param("dt_proj", _uniform(rank**-0.5), (rank, d_inner), pd)
        dt_init = _dt_bias_init(self.dt_min, self.dt_max, self.dt_init_floor)
        self.dt_bias = self.param("dt_bias", dt_init, (d_inner,), pd)
        self.A_log = self.param("A_log", _s4d_real_init, (d_inner, self.d_state), pd)
        self.D = self.param("D", nn.initializers.ones, (d_inner,), pd)
        if self.reorder:
            self.importance = self.param("importance", x_init, (d_inner,), pd)
        self.out_proj = nn.Dense(
            self.d_model,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=pd,
            kernel_init=_uniform(d_inner**-0.5),
        )

    # -- parameters seen as maps --------------------------------------------------------------

    def _lambda(self) -> jax.Array:
        """`lambda: [N]`, the signed scales of `S_B = diag(lambda) S_C`."""
        magnitude = jax.nn.softplus(self.lambda_theta) + _LAMBDA_FLOOR
        n = self.n_total
        sign = {
            "pos": jnp.ones((n,), magnitude.dtype),
            "neg": -jnp.ones((n,), magnitude.dtype),
            "mixed": jnp.where(jnp.arange(n) < n - n // 2, 1, -1).astype(magnitude.dtype),
        }[self.sign_constraint]
        return sign * magnitude

    def x_proj_maps(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(S_dt: [dt_rank, d_inner], S_B: [N, d_inner], S_C: [N, d_inner])` in param_dtype.

        `dt_low_t = S_dt u_t`, `B_t = S_B u_t`, `C_t = S_C u_t` for the post-conv token `u_t`.
        """
        rank, n = self.effective_dt_rank, self.n_total
        w = self.x_proj.T  # [out, d_inner]
        s_dt = w[:rank]
        if self.sign_constraint is None:
            return s_dt, w[rank : rank + n], w[rank + n :]
        s_c = jnp.triu(w[rank:], k=1) + jnp.eye(n, self.d_inner, dtype=w.dtype)
        return s_dt, self._lambda()[:, None] * s_c, s_c

    def interaction_matrix(self) -> jax.Array:
        """`M = S_C^T S_B: [d_inner, d_inner]` in float32 (float64 for float64 parameters).

        The token-interaction matrix of Vo et al.: `y_l = sum_{j<=l} (u_l^T M u_j) ...`.
        """
        _, s_b, s_c = self.x_proj_maps()
        acc = jnp.promote_types(s_c.dtype, jnp.float32)
        return s_c.astype(acc).T @ s_b.astype(acc)

    def state_matrix(self) -> jax.Array:
        """`A: [d_inner, N]`: exactly 0, then `-exp(A_log)`, then `polar_zero_A`.

        float32 (float64 when the compute dtype is float64). The fixed channels are constants.
        """
        acc = jnp.promote_types(self.dtype, jnp.float32)
        n_ones, n_zeros = self.polarize
        learned = -jnp.exp(self.A_log.astype(acc))
        ones = jnp.zeros((self.d_inner, n_ones), acc)
        zeros = jnp.full((self.d_inner, n_zeros), self.polar_zero_A, acc)
        return jnp.concatenate([ones, learned, zeros], axis=1)

    # -- forward --------------------------------------------------------------------------------

    def _in_proj(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`x: [..., d_model] -> (x_inner, z)`, both `[..., d_inner]` in the compute dtype."""
        xz = self.in_proj(x.astype(self.dtype))
        return jnp.split(xz, 2, axis=-1)

    def _conv_params(self) -> tuple[jax.Array, jax.Array | None]:
        """`(weight: [d_conv, d_inner], bias: [d_inner] or None)` in the compute dtype."""
        bias = self.conv_bias_param
        weight = self.conv_weight.astype(self.dtype)
        return weight, None if bias is None else bias.astype(self.dtype)

    def _ssm_inputs(self, u: jax.Array, z: jax.Array) -> dict:
        """Keyword arguments of `selective_scan` from the post-conv tokens `u` and gate `z`."""
        s_dt, s_b, s_c = (s.astype(self.dtype) for s in self.x_proj_maps())
        dt_low = jnp.einsum("btd,rd->btr", u, s_dt)
        return dict(
            u=u,
            delta=jnp.einsum("btr,rd->btd", dt_low, self.dt_proj.astype(self.dtype)),
            A=self.state_matrix(),
            B=jnp.einsum("btd,nd->btn", u, s_b),
            C=jnp.einsum("btd,nd->btn", u, s_c),
            D=self.D.astype(jnp.promote_types(self.dtype, jnp.float32)),
            z=z,
            delta_bias=self.dt_bias.astype(jnp.promote_types(self.dtype, jnp.float32)),
            delta_softplus=True,
        )

    def s6_inputs(self, u: jax.Array) -> dict:
        """`selective_scan` keyword arguments of the bare S6 map on post-conv tokens
        `u: [B, T, d_inner]`: no skip (`D=None`) and no gate, the layer whose depth limit is the
        token ODE of Vo et al. (`seqlab.dynamics.mamba_ode`)."""
        check_floating("u", u)
        check_shape("u", u, (None, None, self.d_inner), "[B, T, d_inner]")
        return {**self._ssm_inputs(u.astype(self.dtype), None), "D": None}

    def _tokens(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`x: [B, T, d_model] -> (u, z)`: post-conv tokens and gate, `[B, T, d_inner]`."""
        check_floating("x", x)
        check_shape("x", x, (None, None, self.d_model), "[B, T, d_model]")
        x_inner, z = self._in_proj(x)
        return jax.nn.silu(causal_conv1d(x_inner, *self._conv_params())), z

    def importance_scores(self, u: jax.Array) -> jax.Array:
        """`s_l = w^T (S_delta u_l + b_dt): [B, T]` for post-conv tokens `u: [B, T, d_inner]`
        (reorder only), with `S_delta u = W_dt S_dt u`, the scan's `delta` before its bias."""
        s_dt = self.x_proj_maps()[0].astype(self.dtype)
        delta = jnp.einsum("btd,rd->btr", u, s_dt) @ self.dt_proj.astype(self.dtype)
        return (delta + self.dt_bias.astype(self.dtype)) @ self.importance.astype(self.dtype)

    def sort_matrix(self, x: jax.Array) -> jax.Array:
        """The reordering matrix `P: [B, T, T]` of `x: [B, T, d_model]` (reorder only): row `i`
        picks (softly) the token of `i`-th smallest importance score. See `soft_sort`."""
        if not self.reorder:
            raise ValueError("sort_matrix needs reorder=True")
        return self._inputs_and_order(x)[1]

    def _inputs_and_order(self, x: jax.Array) -> tuple[dict, jax.Array | None]:
        """`(scan inputs, P or None)`: with reorder, the inputs are those of `P u` and `P z`."""
        u, z = self._tokens(x)
        if not self.reorder:
            return self._ssm_inputs(u, z), None
        perm = soft_sort(self.importance_scores(u), self.reorder_tau, hard=self.reorder_hard)
        u, z = (jnp.einsum("bij,bjd->bid", perm, v) for v in (u, z))
        return self._ssm_inputs(u, z), perm

    def scan_inputs(self, x: jax.Array) -> dict:
        """The `selective_scan` keyword arguments for `x: [B, T, d_model]`.

        `selective_scan(**scan_inputs(x))` is the mixer's output before out_proj,
        `[B, T, d_inner]` (with `reorder`, in the sorted order: `__call__` multiplies it by `P^T`).
        `u, delta, z: [B, T, d_inner]` and `B, C: [B, T, N]` are in the compute dtype;
        `A: [d_inner, N]` and `D, delta_bias: [d_inner]` in float32 (float64 for a float64 compute
        dtype). Add `initial_state` and `return_final_state=True` to read the SSM state.
        """
        return self._inputs_and_order(x)[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, d_model] -> [B, T, d_model]` in the compute dtype."""
        inputs, perm = self._inputs_and_order(x)
        y = selective_scan(**inputs, impl=self.impl)
        if perm is not None:  # back to the input order: y <- P^T y (the inverse of a permutation)
            y = jnp.einsum("bij,bid->bjd", perm, y)
        return self.out_proj(y)

    # -- decoding -------------------------------------------------------------------------------

    def _check_decodable(self) -> None:
        if self.reorder:
            raise NotImplementedError(
                "Mamba(reorder=True) cannot decode step by step: the token order depends on the "
                "importance scores of the whole sequence, including tokens not yet seen"
            )

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """Zero decoding cache.

        `{"conv": [batch_size, d_conv - 1, d_inner] (compute dtype), "ssm": [batch_size, d_inner, N]
        (float32, float64 for a float64 compute dtype)}`. `max_len` is unused (Mamba's state has a
        fixed size); it is part of the interface every mixer shares.
        """
        self._check_decodable()
        check_positive_int("batch_size", batch_size)
        del max_len
        acc = jnp.promote_types(self.dtype, jnp.float32)
        return {
            "conv": jnp.zeros((batch_size, self.d_conv - 1, self.d_inner), self.dtype),
            "ssm": jnp.zeros((batch_size, self.d_inner, self.n_total), acc),
        }

    def step(self, x_t: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """One decoding step: `x_t: [B, d_model] -> (y_t: [B, d_model], new cache)`.

        Token by token it computes what `__call__` computes on the whole sequence.
        """
        self._check_decodable()
        check_floating("x_t", x_t)
        check_shape("x_t", x_t, (None, self.d_model), "[B, d_model]")
        x_inner, z = self._in_proj(x_t)
        conv_out, conv_state = causal_conv1d_step(x_inner, cache["conv"], *self._conv_params())
        u = jax.nn.silu(conv_out)
        inputs = self._ssm_inputs(u[:, None], z[:, None])
        y, ssm_state = selective_scan(
            **inputs, initial_state=cache["ssm"], return_final_state=True, impl=self.impl
        )
        return self.out_proj(y[:, 0]), {"conv": conv_state, "ssm": ssm_state}


def soft_sort(scores: jax.Array, tau: float, *, hard: bool = False) -> jax.Array:
    """SoftSort (Prillo and Eisenschlos, 2020) in ascending order: `scores: [B, T] -> P: [B, T, T]`.

    `P[b, i, j] = softmax_j(-|sorted_i - s_j| / tau)` with `sorted = sort(s)` ascending, so `P s`
    approaches `sorted` as `tau -> 0`. With `hard`, the forward value is the exact permutation
    matrix `one_hot(argsort(s))` (a stable sort: ties keep their order) and the gradient is that of
    the soft matrix (straight-through). Computed in float32 or wider.
    """
    s = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    ordered = jnp.sort(s, axis=-1)
    soft = jax.nn.softmax(-jnp.abs(ordered[:, :, None] - s[:, None, :]) / tau, axis=-1)
    if hard:
        exact = jax.nn.one_hot(jnp.argsort(s, axis=-1, stable=True), s.shape[-1], dtype=s.dtype)
        soft = soft + jax.lax.stop_gradient(exact - soft)
    return soft.astype(scores.dtype)
