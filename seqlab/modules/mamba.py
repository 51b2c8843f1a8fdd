"""The Mamba-1 mixer (Gu & Dao 2023), with the paper variants of `seqlab.modules.mamba_variants`.

Per token (`x: [B, T, d_model]`, `d_inner = expand * d_model`, `N = n_ones + d_state + n_zeros`):

    x, z  = split(in_proj(x))                              # [B, T, d_inner] each
    u     = silu(causal_conv1d(x))                         # depthwise, width conv_size
    delta = W_dt (S_dt u);  B = S_B u;  C = S_C u          # x_proj then dt_proj (bias in the scan)
    y     = selective_scan(u, delta, A, B, C, D, z, delta_bias=b_dt, delta_softplus=True)
    out   = out_proj(y)

with `A = -exp(A_log)` for the learnable channels, `D = 1` at init and `S_dt: [dt_rank, d_inner]`,
`S_B, S_C: [N, d_inner]` the linear maps from the post-conv token to the scan's inputs.

With `reorder=True` (token reordering, Vo et al. arXiv 2410.03292, "Refinement 2") the post-conv
tokens and the gate are permuted by a soft sort of importance scores before the scan, and the
scan's output is permuted back:

    s_l = w^T (S_delta u_l + b_dt)                         # S_delta = W_dt S_dt, [B, T]
    P   = soft_sort(s, tau)                                # [B, T, T], rows sum to 1
    y   = P^T selective_scan(P u, ..., z = P z)            # B, C, delta recomputed from P u
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.modules import initializers
from seqlab.modules import mamba_variants as variants
from seqlab.modules.mixer import Mixer, check_dt_init, extend_conv, pad_identity, sequence_op
from seqlab.ops.checks import check_choice, check_floating, check_positive_int, check_shape
from seqlab.ops.conv import causal_conv1d, causal_conv1d_step
from seqlab.ops.selective_scan import selective_scan
from seqlab.ops.softsort import soft_sort


class Mamba(Mixer):
    """Mamba-1 mixer: `x [B, T, d_model] -> [B, T, d_model]`.

    Polarization (`polarize=(n_ones, n_zeros)`, Wang et al., arXiv 2501.00658): the state gets
    `n_ones` channels in front of the `d_state` learnable ones with pre-exponential `A` fixed at
    exactly 0 (decay exactly 1), and `n_zeros` channels behind them with `A` fixed at
    `polar_zero_A` (`mamba_variants.polarized_state_matrix`). B and C are still produced by x_proj
    for every channel.

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
      conv_size: width of the causal depthwise convolution.
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
      seq_axis: the mesh axis the time axis is split over when the module runs inside
        `shard_map` (sequence parallelism); None: the whole sequence is local. Decoding ignores
        it; `reorder` needs the whole sequence.

    Unlike the authors' code (Fsoft-AIC/Mamba-token-dynamic, MambaVision), reordering is a
    per-layer option (theirs reorders only the first block of a stage), the gate `z` is permuted
    with the tokens, and the output is permuted back to the input order (theirs leaves it sorted).
    """

    d_model: int
    d_state: int = 16
    conv_size: int = 4
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
    seq_axis: str | None = None

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

    def check_fields(self) -> None:
        for name in ("d_model", "d_state", "conv_size", "expand"):
            check_positive_int(name, getattr(self, name))
        if self.dt_rank is not None:
            check_positive_int("dt_rank", self.dt_rank)
        check_dt_init(self.dt_min, self.dt_max, self.dt_init_floor)
        counts = self.polarize if isinstance(self.polarize, tuple | list) else ()
        if len(counts) != 2 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts
        ):
            raise ValueError(f"polarize must be (n_ones, n_zeros), ints >= 0, got {self.polarize}")
        if not self.polar_zero_A <= 0:
            raise ValueError(f"polar_zero_A must be <= 0, got {self.polar_zero_A}")
        check_choice("sign_constraint", self.sign_constraint, variants.SIGN_CONSTRAINTS)
        if not self.reorder_tau > 0:
            raise ValueError(f"reorder_tau must be > 0, got {self.reorder_tau}")
        if self.reorder and self.seq_axis is not None:
            raise ValueError("reorder sorts the whole sequence: it needs seq_axis=None")
        if self.sign_constraint == "mixed" and self.n_total < 2:
            raise ValueError("sign_constraint='mixed' needs at least 2 state channels in all")

    def setup(self):
        d_inner, rank, n, pd = self.d_inner, self.effective_dt_rank, self.n_total, self.param_dtype
        dense = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=pd)
        self.in_proj = nn.Dense(
            2 * d_inner, kernel_init=initializers.uniform(self.d_model**-0.5), **dense
        )
        conv_init = initializers.uniform(self.conv_size**-0.5)  # depthwise: fan_in = conv_size
        self.conv_weight = self.param("conv_weight", conv_init, (self.conv_size, d_inner), pd)
        self.conv_bias_param = (
            self.param("conv_bias", conv_init, (d_inner,), pd) if self.conv_bias else None
        )
        # x_proj, flax layout [in, out]: columns [dt | B | C], or [dt | P] with a sign constraint.
        x_init = initializers.uniform(d_inner**-0.5)
        width = rank + (n if self.sign_constraint else 2 * n)
        self.x_proj = self.param("x_proj", x_init, (d_inner, width), pd)
        if self.sign_constraint:
            self.lambda_theta = self.param("lambda_theta", x_init, (n,), pd)
        self.dt_proj = self.param("dt_proj", initializers.uniform(rank**-0.5), (rank, d_inner), pd)
        dt_init = initializers.dt_bias(self.dt_min, self.dt_max, self.dt_init_floor)
        self.dt_bias = self.param("dt_bias", dt_init, (d_inner,), pd)
        self.A_log = self.param("A_log", initializers.s4d_real, (d_inner, self.d_state), pd)
        self.D = self.param("D", nn.initializers.ones, (d_inner,), pd)
        if self.reorder:
            self.importance = self.param("importance", x_init, (d_inner,), pd)
        self.out_proj = nn.Dense(
            self.d_model, kernel_init=initializers.uniform(d_inner**-0.5), **dense
        )

    # -- parameters seen as maps --------------------------------------------------------------

    def x_proj_maps(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(S_dt: [dt_rank, d_inner], S_B: [N, d_inner], S_C: [N, d_inner])` in param_dtype.

        `dt_low_t = S_dt u_t`, `B_t = S_B u_t`, `C_t = S_C u_t` for the post-conv token `u_t`.
        """
        rank, n = self.effective_dt_rank, self.n_total
        w = self.x_proj.T  # [out, d_inner]
        if self.sign_constraint is None:
            return w[:rank], w[rank : rank + n], w[rank + n :]
        s_b, s_c = variants.sign_constrained_maps(w[rank:], self.lambda_theta, self.sign_constraint)
        return w[:rank], s_b, s_c

    def interaction_matrix(self) -> jax.Array:
        """`M = S_C^T S_B: [d_inner, d_inner]` in float32 (float64 for float64 parameters).

        The token-interaction matrix of Vo et al.: `y_l = sum_{j<=l} (u_l^T M u_j) ...`.
        """
        _, s_b, s_c = self.x_proj_maps()
        acc = jnp.promote_types(s_c.dtype, jnp.float32)
        return s_c.astype(acc).T @ s_b.astype(acc)

    def state_matrix(self) -> jax.Array:
        """`A: [d_inner, N]`: exactly 0, then `-exp(A_log)`, then `polar_zero_A` (polarization),
        in `acc_dtype`."""
        learned = -jnp.exp(self.A_log.astype(self.acc_dtype))
        return variants.polarized_state_matrix(learned, self.polarize, self.polar_zero_A)

    # -- forward --------------------------------------------------------------------------------

    def _in_proj(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`x: [..., d_model] -> (x_inner, z)`, both `[..., d_inner]` in the compute dtype."""
        return jnp.split(self.in_proj(x.astype(self.dtype)), 2, axis=-1)

    def _conv_params(self) -> tuple[jax.Array, jax.Array | None]:
        """`(weight: [conv_size, d_inner], bias: [d_inner] or None)` in the compute dtype."""
        bias = self.conv_bias_param
        weight = self.conv_weight.astype(self.dtype)
        return weight, None if bias is None else bias.astype(self.dtype)

    def _delta(self, u: jax.Array, s_dt: jax.Array) -> jax.Array:
        """`delta = W_dt (S_dt u): [B, T, d_inner]` before its bias, in the compute dtype."""
        dt_low = jnp.einsum("btd,rd->btr", u, s_dt.astype(self.dtype))
        return jnp.einsum("btr,rd->btd", dt_low, self.dt_proj.astype(self.dtype))

    def _scan_inputs(self, u: jax.Array, z: jax.Array | None) -> dict:
        """Keyword arguments of `selective_scan` from the post-conv tokens `u` and gate `z`."""
        s_dt, s_b, s_c = (s.astype(self.dtype) for s in self.x_proj_maps())
        return dict(
            u=u,
            delta=self._delta(u, s_dt),
            A=self.state_matrix(),
            B=jnp.einsum("btd,nd->btn", u, s_b),
            C=jnp.einsum("btd,nd->btn", u, s_c),
            D=self.D.astype(self.acc_dtype),
            z=z,
            delta_bias=self.dt_bias.astype(self.acc_dtype),
            delta_softplus=True,
        )

    def _tokens(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`x: [B, T, d_model] -> (u, z)`: post-conv tokens and gate, `[B, T, d_inner]`."""
        self.check_sequence(x)
        x_inner, z = self._in_proj(x)
        conv = sequence_op(causal_conv1d, self.seq_axis)
        return jax.nn.silu(conv(x_inner, *self._conv_params())), z

    def s6_inputs(self, u: jax.Array) -> dict:
        """`selective_scan` keyword arguments of the bare S6 map on post-conv tokens
        `u: [B, T, d_inner]`: no skip (`D=None`) and no gate, the layer whose depth limit is the
        token ODE of Vo et al. (`seqlab.dynamics.mamba_ode`)."""
        check_floating("u", u)
        check_shape("u", u, (None, None, self.d_inner), "[B, T, d_inner]")
        return {**self._scan_inputs(u.astype(self.dtype), None), "D": None}

    def importance_scores(self, u: jax.Array) -> jax.Array:
        """`s_l = w^T (S_delta u_l + b_dt): [B, T]` for post-conv tokens `u: [B, T, d_inner]`
        (reorder only), with `S_delta u = W_dt S_dt u`, the scan's `delta` before its bias."""
        delta = self._delta(u, self.x_proj_maps()[0])
        bias, w = (p.astype(self.dtype) for p in (self.dt_bias, self.importance))
        return variants.importance_scores(delta, bias, w)

    def _inputs_and_order(self, x: jax.Array) -> tuple[dict, jax.Array | None]:
        """`(scan inputs, P or None)`: with reorder, the inputs are those of `P u` and `P z`."""
        u, z = self._tokens(x)
        if not self.reorder:
            return self._scan_inputs(u, z), None
        perm = soft_sort(self.importance_scores(u), self.reorder_tau, hard=self.reorder_hard)
        return self._scan_inputs(*variants.reorder(perm, u, z)), perm

    def sort_matrix(self, x: jax.Array) -> jax.Array:
        """The reordering matrix `P: [B, T, T]` of `x: [B, T, d_model]` (reorder only): row `i`
        picks (softly) the token of `i`-th smallest importance score. See `soft_sort`."""
        if not self.reorder:
            raise ValueError("sort_matrix needs reorder=True")
        return self._inputs_and_order(x)[1]

    def op_inputs(self, x: jax.Array) -> dict:
        """The `selective_scan` keyword arguments for `x: [B, T, d_model]`.

        `selective_scan(**op_inputs(x))` is the mixer's output before out_proj,
        `[B, T, d_inner]` (with `reorder`, in the sorted order: `__call__` multiplies it by `P^T`).
        `u, delta, z: [B, T, d_inner]` and `B, C: [B, T, N]` are in the compute dtype;
        `A: [d_inner, N]` and `D, delta_bias: [d_inner]` in `acc_dtype`. Add `initial_state` and
        `return_final_state=True` to read the SSM state.
        """
        return self._inputs_and_order(x)[0]

    def __call__(self, x: jax.Array) -> jax.Array:
        """`x: [B, T, d_model] -> [B, T, d_model]` in the compute dtype."""
        inputs, perm = self._inputs_and_order(x)
        y = sequence_op(selective_scan, self.seq_axis)(**inputs, impl=self.impl)
        if perm is not None:
            y = variants.restore_order(perm, y)
        return self.out_proj(y)

    # -- decoding -------------------------------------------------------------------------------

    def zero_cache(self, batch_size: int, max_len: int) -> dict:
        """`{"conv": [batch_size, conv_size - 1, d_inner] (compute dtype), "state":
        [batch_size, d_inner, N] (acc_dtype)}`."""
        self._check_decodable()
        return {
            "conv": jnp.zeros((batch_size, self.conv_size - 1, self.d_inner), self.dtype),
            "state": jnp.zeros((batch_size, self.d_inner, self.n_total), self.acc_dtype),
        }

    def step(self, x_t: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """One decoding step: `x_t: [B, d_model] -> (y_t: [B, d_model], new cache)`."""
        self._check_decodable()
        self.check_token(x_t)
        x_inner, z = self._in_proj(x_t)
        conv_out, conv_state = causal_conv1d_step(x_inner, cache["conv"], *self._conv_params())
        inputs = self._scan_inputs(jax.nn.silu(conv_out)[:, None], z[:, None])
        y, state = selective_scan(
            **inputs, initial_state=cache["state"], return_final_state=True, impl=self.impl
        )
        return self.out_proj(y[:, 0]), {"conv": conv_state, "state": state}

    def extend(self, x: jax.Array, cache: dict, lengths=None) -> tuple[jax.Array, dict]:
        """`x: [B, T, d_model]` continuing from `cache`, row `b`'s first `lengths[b]` tokens real:
        `(y: [B, T, d_model], cache after the real tokens)` (see `seqlab.modules.mixer`). Pads
        are identity tokens of the scan: a step `dt = 0` (`h = exp(0 A) h + 0 B u`)."""
        self._check_decodable()
        lengths, real = self.check_extend(x, lengths)
        x_inner, z = self._in_proj(x)
        conv_out, conv = extend_conv(x_inner, cache["conv"], *self._conv_params(), lengths)
        inputs = self._scan_inputs(jax.nn.silu(conv_out), z)
        # dt = softplus(delta + b_dt) as the scan computes it, then 0 at the pads.
        dt = jax.nn.softplus(inputs["delta"].astype(self.acc_dtype) + inputs.pop("delta_bias"))
        inputs.update(delta=pad_identity(dt, real), delta_softplus=False)
        y, state = selective_scan(
            **inputs, initial_state=cache["state"], return_final_state=True, impl=self.impl
        )
        return self.out_proj(y), {"conv": conv, "state": state.astype(cache["state"].dtype)}

    def _check_decodable(self) -> None:
        if self.reorder:
            raise NotImplementedError(
                "Mamba(reorder=True) cannot decode step by step: the token order depends on the "
                "importance scores of the whole sequence, including tokens not yet seen"
            )
