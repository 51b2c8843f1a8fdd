"""Mixture-of-experts ops: top-k routing and the sorted (dropless) dispatch of tokens to SwiGLU
experts. `seqlab.modules.moe.MoE` owns the parameters and calls these.

Two implementations of `routed_swiglu` (`impl`), the same function:

- "sorted": the `N` tokens are repeated once per chosen expert, the `N * k` assignments sorted by
  expert id, and every expert projection is one `jax.lax.ragged_dot` over the sorted rows with the
  per-expert group sizes; the rows are then unsorted, weighted and summed over `k`. No capacity, no
  token dropped. On TPU and GPU `ragged_dot` lowers to XLA's ragged-dot instruction (meant to cost
  `N * k` token FFNs; not measured here). On CPU jax (0.10, 0.11) lowers it to a dense dot over the
  `E` groups with the rows outside each group masked (`E * N * k` token FFNs), and `ragged_dot`
  cannot be vmapped over another axis than 0 (so no `jax.jacrev` through it).
- "dense": a `lax.scan` over the experts, each applied to every token and weighted by its routing
  weight (zero for the experts a token did not choose): `E * N` token FFNs, memory `O(N F)`,
  vmappable. The default on CPU, where it is `k` times cheaper than "sorted".

Gradients flow through both and through the routing weights; the expert ids carry none.
"""

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_choice, check_floating, check_positive_int, check_shape

IMPLS = ("sorted", "dense")


def top_k_routing(
    logits: jax.Array, top_k: int, *, normalize: bool = True
) -> tuple[jax.Array, jax.Array]:
    """`(weights, experts)`, both `[..., k]`: the `k` largest of `softmax(logits)` in decreasing
    order (renormalized to sum 1 with `normalize`) and their expert ids (int32).

    `logits: [..., E]`; the softmax runs in float32 (float64 for float64 logits), the weights are
    returned in that dtype. Ties go to the lower expert id.
    """
    check_floating("logits", logits)
    check_positive_int("top_k", top_k)
    if top_k > logits.shape[-1]:
        raise ValueError(f"top_k must be <= the number of experts {logits.shape[-1]}, got {top_k}")
    acc = jnp.promote_types(logits.dtype, jnp.float32)
    probs = jax.nn.softmax(logits.astype(acc), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def routed_swiglu(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    *,
    impl: str | None = None,
) -> jax.Array:
    """`y_n = sum_j weights[n, j] * SwiGLU_{experts[n, j]}(x_n)` with
    `SwiGLU_e(x) = (silu(x gate[e]) * (x up[e])) down[e]`.

    `x: [N, D]`; `weights: [N, k]` (cast to `x.dtype` before they scale the expert outputs, as
    transformers does); `experts: [N, k]` int; `gate, up: [E, D, F]`; `down: [E, F, D]`.
    `impl`: None (auto: "dense" on CPU, "sorted" elsewhere), "sorted" or "dense" (module
    docstring). Returns `[N, D]` in `x.dtype`.
    """
    check_choice("impl", impl, (None, *IMPLS))
    check_floating("x", x)
    check_shape("x", x, (None, None), "[N, D]")
    n, d = x.shape
    check_shape("weights", weights, (n, None), "[N, k]")
    k = weights.shape[1]
    check_shape("experts", experts, (n, k), "[N, k]")
    num_experts, _, f = gate.shape
    check_shape("gate", gate, (num_experts, d, f), "[E, D, F]")
    check_shape("up", up, (num_experts, d, f), "[E, D, F]")
    check_shape("down", down, (num_experts, f, d), "[E, F, D]")
    if impl is None:
        impl = "dense" if jax.default_backend() == "cpu" else "sorted"
    if impl == "dense":
        return _dense(x, weights, experts, gate, up, down)
    return _sorted(x, weights, experts, gate, up, down)


def _dense(x, weights, experts, gate, up, down):
    """Every expert on every token, one expert at a time, weighted by `[N, E]` routing weights."""
    num_experts = gate.shape[0]
    dense_weights = jnp.zeros((x.shape[0], num_experts), x.dtype)
    dense_weights = dense_weights.at[jnp.arange(x.shape[0])[:, None], experts].add(
        weights.astype(x.dtype)
    )

    def expert(y, e):
        w_gate, w_up, w_down, w = e
        hidden = jax.nn.silu(x @ w_gate.astype(x.dtype)) * (x @ w_up.astype(x.dtype))
        return y + w[:, None] * (hidden @ w_down.astype(x.dtype)), None

    y, _ = jax.lax.scan(expert, jnp.zeros_like(x), (gate, up, down, dense_weights.T))
    return y


def _sorted(x, weights, experts, gate, up, down):
    """Sorted dispatch through `ragged_dot` (module docstring)."""
    n, d = x.shape
    k, num_experts = weights.shape[1], gate.shape[0]
    flat = experts.reshape(-1)  # [N k], assignment a = n k + j
    order = jnp.argsort(flat, stable=True)  # sorted position -> assignment
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[order // k]  # [N k, D], the token of each sorted assignment

    def matmul(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs.astype(x.dtype), group_sizes)

    hidden = jax.nn.silu(matmul(rows, gate)) * matmul(rows, up)
    out = matmul(hidden, down)  # [N k, D], sorted order
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    out = out[inverse].reshape(n, k, d)  # assignment order
    return jnp.einsum("nk,nkd->nd", weights.astype(x.dtype), out)
