"""Jacobian influence: how strongly each input token moves an output.

For a map `fn` applied to one sequence `x: [T, D]`, the influence of token `s` on an output `y` is
the norm of the Jacobian block `dy / dx_s`. Two views share one computation:

- `token_influence(fn, x)`: `fn` returns any array (a final state, a logit, a loss); the result
  holds, for every output element, the Euclidean norm of its gradient with respect to each token.
- `jacobian_influence(fn, x)`: `fn` is a sequence map `[T, D] -> [T, D']` (a mixer, a model); the
  result is the `[T, T]` matrix `I[t, s] = ||dy_t / dx_s||_F`.

Both are computed with `jax.jacrev` (one vector-Jacobian product per output element, vmapped), are
jit-compatible, and batch with `jax.vmap`:

    jax.vmap(lambda x: jacobian_influence(fn, x))(xs)   # xs: [B, T, D] -> [B, T, T]

`module_influence(module, params, x)` applies the matrix view to any Flax sequence module taking
`[B, T, D]` (every mixer, a `Block`), and to a `LanguageModel` through
`method="logits_from_embeddings"` (influence of input embeddings on logits).

The result has the dtype of the Jacobian (that of `fn`'s output for a floating `x`).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_floating, check_shape


def token_influence(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """Influence of each token of `x` on each element of `fn(x)`.

    `I[i, s] = ||d fn(x)[i] / d x_s||_2` (the norm runs over the `D` features of token `s`).

    Args:
      fn: a differentiable map from `[T, D]` to an array of any shape `S`.
      x: `[T, D]`, one sequence.

    Returns:
      `[*S, T]`.
    """
    check_floating("x", x)
    check_shape("x", x, (None, None), "[T, D]")
    jac = jax.jacrev(fn)(x)  # [*S, T, D]
    return jnp.sqrt(jnp.sum(jnp.square(jac), axis=-1))


def jacobian_influence(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """The token-to-token influence matrix of a sequence map.

    `I[t, s] = ||dy_t / dx_s||_F` with `y = fn(x)`; for a causal map `I` is lower triangular.

    Args:
      fn: a differentiable map `[T, D] -> [T, D']`.
      x: `[T, D]`, one sequence.

    Returns:
      `[T, T]`, rows indexed by the output token `t`, columns by the input token `s`.
    """
    check_floating("x", x)
    check_shape("x", x, (None, None), "[T, D]")
    out = jax.eval_shape(fn, x)
    if len(out.shape) != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(
            f"fn must map x [T, D] = {tuple(x.shape)} to [T, D'] with T = {x.shape[0]}, "
            f"got output shape {tuple(out.shape)}"
        )
    per_feature = token_influence(fn, x)  # [T, D', T]
    return jnp.sqrt(jnp.sum(jnp.square(per_feature), axis=1))


def module_influence(module, params, x: jax.Array, *, method=None) -> jax.Array:
    """`jacobian_influence` of a Flax module applied to one sequence `x: [T, D]`.

    The module (or its `method`) must map `[1, T, D] -> [1, T, D']`: any mixer (`Mamba`, `Mamba2`,
    `GatedDeltaNet`, `Attention`), a `Block`, or a `LanguageModel` with
    `method="logits_from_embeddings"`. Returns `I: [T, T]`, `I[t, s] = ||dy_t / dx_s||_F`.
    """
    check_floating("x", x)
    check_shape("x", x, (None, None), "[T, D]")

    def fn(x):
        return module.apply(params, x[None], method=method)[0]

    return jacobian_influence(fn, x)
