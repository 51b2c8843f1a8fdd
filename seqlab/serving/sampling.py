"""Next-token sampling from logits: greedy, temperature, top-k and top-p (nucleus), per row.

`sample(key, logits: [B, V])` draws one token per row:

    temperature == 0:  argmax_v logits[b, v]  (ties to the lowest id, as `torch.argmax`)
    temperature > 0:   v ~ softmax(logits[b] / temperature) restricted to
                       top_k: the k largest logits of the row (ties to the lower id), then
                       top_p: the smallest prefix of those, by decreasing probability, whose
                              probability (renormalized over the top k) reaches top_p,
                       and renormalized over what is kept.

Randomness is an explicit key: one key (split into one key per row) or `[B]` keys, row b drawn
with its own key, so a row sampled inside a batch equals the same row sampled alone with that key.
"""

import math

import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_floating, check_positive_int, check_shape


def check_sampling(temperature, top_k, top_p) -> None:
    """Raise `ValueError` unless `temperature >= 0` is finite, `top_k` is None or a positive
    int and `top_p` is None or in (0, 1]."""
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None:
        check_positive_int("top_k", top_k)
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def row_keys(key, batch: int) -> jax.Array:
    """`[batch]` typed keys from one key (split) or from `[batch]` keys (typed, or raw `uint32`
    `[batch, 2]`); `ValueError` naming `key` otherwise."""
    if key is None:
        raise ValueError("key must be a jax.random key when sampling (temperature > 0)")
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype != jnp.uint32 or key.ndim not in (1, 2):
            raise ValueError(
                f"key must be a jax.random key or [B] keys, got dtype {key.dtype}, shape "
                f"{key.shape}"
            )
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.random.split(key, batch)
    if key.shape != (batch,):
        raise ValueError(f"key must be one key or [B] = [{batch}] keys, got shape {key.shape}")
    return key


def sample(key, logits: jax.Array, *, temperature=1.0, top_k=None, top_p=None) -> jax.Array:
    """One token per row of `logits: [B, V]`: `[B]` int32 (see the module docstring).

    `key`: one key or `[B]` keys (unused, and may be None, when `temperature == 0`); `top_k` and
    `top_p` apply only when `temperature > 0`. Computed in float32 (float64 for float64 logits).
    """
    check_floating("logits", logits)
    check_shape("logits", logits, (None, None), "[B, V]")
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = row_keys(key, logits.shape[0])
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32)) / temperature
    return jax.vmap(lambda k, row: _sample_row(k, row, top_k, top_p))(keys, logits)


def _sample_row(key, logits: jax.Array, top_k, top_p) -> jax.Array:
    """A draw from `softmax(logits: [V])` restricted to its top k, then its top-p nucleus."""
    vocab = logits.shape[0]
    order = jnp.argsort(-logits, stable=True)  # decreasing; equal logits keep the lower id first
    ranked = logits[order]
    keep = jnp.ones((vocab,), bool)
    if top_k is not None:
        keep = jnp.arange(vocab) < top_k
    if top_p is not None and top_p < 1:
        probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf))
        # Keep rank r while the mass above it is below top_p: the first rank always stays.
        keep = keep & (jnp.cumsum(probs) - probs < top_p)
    choice = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf))
    return order[choice].astype(jnp.int32)
