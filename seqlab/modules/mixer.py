"""The contract every sequence mixer implements (Mamba, Mamba2, GatedDeltaNet, Attention).

A mixer maps `x: [B, T, d_model] -> [B, T, d_model]` causally and can decode token by token:

    __call__(x)                    the layer on a whole sequence
    op_inputs(x) -> dict           the keyword arguments it feeds its op (`selective_scan`, `ssd`,
                                   `gated_delta_rule`, `attention`), as `__call__` passes them, for
                                   measurements that need the op's operands
    init_cache(batch_size, max_len) -> dict   the zero decoding cache; a recurrent state is under
                                   `"state"`, convolution inputs under `"conv"` (or `"<x>_conv"`)
    step(x_t, cache) -> (y_t, cache)          one token, `x_t: [B, d_model]`; equal to `__call__`
                                   token by token
    extend(x, cache, lengths=None) -> (y, cache)   the layer on `x: [B, T, d_model]` continuing
                                   from `cache`, through the sequence path (the chunked op with an
                                   initial state, the convolution from the cached inputs, attention
                                   against the cached keys), not token by token
    verify(x, cache) -> (y, trail)            `n` (draft) tokens `x: [B, n, d_model]` from `cache`;
                                   `y` equals `step` token by token, `trail` holds what rebuilds
                                   the cache after any prefix of them
    accept(trail, m) -> cache                 the cache after each row's first `m[b]` tokens of
                                   the `verify` that made `trail`, `m: [B]` int in `[0, n]`

`extend` semantics (prefill and chunked prefill). `lengths: [B]` int (None: all `T`) gives each
row's real tokens, its first `lengths[b]` (right padding, `0 <= lengths[b] <= T`). The returned
cache is the cache after each row's last real token, as if the pads had never been fed;
`lengths[b] = 0` leaves row `b`'s cache unchanged; `y` at pad positions is unspecified. So
`extend(x, init_cache(B, L))[0] == __call__(x)`, `extend` equals `step` token by token at the real
positions and in the final cache, and two chained `extend` calls equal one. The recurrent mixers
make every pad an identity token of their op (log-decay 0 and write 0: `g = 0` and `beta = 0` (or
`b = w = 0`) for the delta rules, a step `dt = 0` for the Mamba scans), so the op's final state is
the state after the real tokens, and gather each row's convolution inputs at its own length
(`extend_conv`). `Attention` keeps per-row positions and writes real tokens only.

`verify`/`accept` (speculative decoding). For the recurrent mixers (`Mixer.verify`) the trail is
the start cache and the cache after every token, stacked along a leading token axis (a `lax.scan`
of `step`, so `accept` is bit-for-bit the cache of stepping `m[b]` tokens, under `jax.jit` as
`step`). `Attention`'s trail is the cache after all `n` tokens and the old contents of the `n`
slots they overwrote (a ring buffer overwrites keys a rollback still needs), not `n` caches.

Fields are validated when the mixer is constructed (`check_fields`), so a bad size fails before any
tracing; inputs are checked by `check_sequence` / `check_token` before any heavy work.
"""

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from seqlab.ops import sequence_parallel
from seqlab.ops.checks import accumulation_dtype, check_floating, check_positive_int, check_shape
from seqlab.ops.conv import causal_conv1d


class Mixer(nn.Module):
    """Base of the sequence mixers: field validation at construction and the shared input checks.

    Subclasses declare the fields `d_model` and `dtype` and implement `check_fields()` (raise
    `ValueError` naming the first bad field), `op_inputs`, `__call__`, `zero_cache(batch_size,
    max_len)` (the cache `init_cache` returns once the sizes are checked), `step` and `extend`;
    `verify`/`accept` here serve the recurrent mixers (`Attention` has its own).
    """

    def __post_init__(self):
        self.check_fields()
        super().__post_init__()

    @property
    def acc_dtype(self) -> jnp.dtype:
        """States, gates and decays: float32, or float64 for a float64 compute dtype."""
        return accumulation_dtype(self.dtype)

    def check_sequence(self, x: jax.Array) -> None:
        """`x` must be a floating `[B, T, d_model]` array."""
        check_floating("x", x)
        check_shape("x", x, (None, None, self.d_model), "[B, T, d_model]")

    def check_token(self, x_t: jax.Array) -> None:
        """`x_t` must be a floating `[B, d_model]` array."""
        check_floating("x_t", x_t)
        check_shape("x_t", x_t, (None, self.d_model), "[B, d_model]")

    def init_cache(self, batch_size: int, max_len: int) -> dict:
        """The zero decoding cache for `batch_size` sequences of up to `max_len` tokens (recurrent
        mixers ignore `max_len`: their cache does not grow)."""
        check_positive_int("batch_size", batch_size)
        check_positive_int("max_len", max_len)
        return self.zero_cache(batch_size, max_len)

    def check_extend(self, x: jax.Array, lengths) -> tuple[jax.Array, jax.Array]:
        """Check `x: [B, T, d_model]` and `lengths` of `extend`; return `(lengths: [B] int32,
        real: [B, T] bool)`, `real[b, t] = t < lengths[b]`."""
        self.check_sequence(x)
        lengths = check_lengths("lengths", lengths, *x.shape[:2])
        return lengths, jnp.arange(x.shape[1]) < lengths[:, None]

    def verify(self, x: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """Run the `n` tokens `x: [B, n, d_model]` from `cache` with `step` (a `lax.scan`):
        `(y: [B, n, d_model], trail)`, `trail = {"start": cache, "caches": the cache after each
        token, every leaf [n, ...]}`."""
        self.check_sequence(x)

        def token(carry, x_t):
            y_t, carry = self.step(x_t, carry)
            return carry, (y_t, carry)

        _, (y, caches) = jax.lax.scan(token, cache, jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(y, 0, 1), {"start": cache, "caches": caches}

    def accept(self, trail: dict, m: jax.Array) -> dict:
        """The cache after each row's first `m[b]` tokens of the `verify` that made `trail`,
        `m: [B]` int in `[0, n]`: row `b` of `start` (`m[b] = 0`) or of `caches[m[b] - 1]`."""
        check_trail(trail, ("start", "caches"))
        leaf = jax.tree.leaves(trail["caches"])[0]
        m = check_counts("m", m, leaf.shape[1])
        rows = jnp.arange(m.shape[0])

        def pick(start, caches):
            return jnp.concatenate([start[None], caches])[m, rows]

        return jax.tree.map(pick, trail["start"], trail["caches"])


def check_lengths(name: str, lengths, batch: int, length: int) -> jax.Array:
    """Per-row token counts `lengths: [B]` integer (None: all `length`) as `[B]` int32."""
    if lengths is None:
        return jnp.full((batch,), length, jnp.int32)
    return check_counts(name, lengths, batch)


def check_counts(name: str, counts, batch: int) -> jax.Array:
    """Per-row token counts `counts: [B]` integer as `[B]` int32."""
    dtype = jnp.result_type(counts) if counts is not None else None
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must be a [B] integer array, got {dtype}")
    check_shape(name, counts, (batch,), "[B]")
    return jnp.asarray(counts, jnp.int32)


def check_trail(trail, keys: tuple[str, ...]) -> None:
    """`trail` must be the dict of `keys` that `verify` returns."""
    if not isinstance(trail, dict) or set(trail) != set(keys):
        got = tuple(trail) if isinstance(trail, dict) else type(trail).__name__
        raise ValueError(f"trail must be what verify returns, a dict of {keys}, got {got}")


def pad_identity(a: jax.Array, real: jax.Array) -> jax.Array:
    """`a: [B, T, ...]` with the pad tokens (`real: [B, T]` False) set to 0."""
    return jnp.where(real.reshape(real.shape + (1,) * (a.ndim - 2)), a, 0).astype(a.dtype)


def extend_conv(x, state, weight, bias, lengths) -> tuple[jax.Array, jax.Array]:
    """`causal_conv1d` of `x: [B, T, D]` continuing from `state: [B, W - 1, D]` (the previous
    inputs), and the state after each row's first `lengths[b]` inputs: the `W - 1` inputs before
    position `lengths[b]` of `concat(state, x)`. Returns `(y: [B, T, D], state: [B, W - 1, D])`."""
    y = causal_conv1d(x, weight, bias, initial_state=state)
    inputs = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W - 1 + T, D]
    width = state.shape[1]

    def tail(row, n):
        return jax.lax.dynamic_slice_in_dim(row, n, width, axis=0)

    return y, jax.vmap(tail)(inputs, lengths)


def extend_qkv(mixer, x, cache, lengths) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
    """The delta-rule mixers' `silu(causal_conv1d(proj(x)))` of q, k and v for `extend`, each
    convolution continued from its cache entry (`"q_conv"`, `"k_conv"`, `"v_conv"`) and cut at
    each row's length: `(q, k, v: [B, T, channels], convs: the three new cache entries)`."""
    out, convs = [], {}
    for name in ("q", "k", "v"):
        weight, state = getattr(mixer, f"{name}_conv"), cache[f"{name}_conv"]
        y, convs[f"{name}_conv"] = extend_conv(
            getattr(mixer, f"{name}_proj")(x), state, weight, None, lengths
        )
        out.append(jax.nn.silu(y))
    return (*out, convs)


def sequence_op(op: Callable, seq_axis: str | None) -> Callable:
    """The sequence op `op` of `seqlab.ops` (`causal_conv1d`, `selective_scan`, `ssd`,
    `gated_delta_rule`, `kda`, `gdn2`, `gated_delta_product`) over the whole sequence: `op` itself
    when `seq_axis` is None; otherwise its namesake in `seqlab.ops.sequence_parallel` on this
    device's piece of the time axis, split over the mesh axis `seq_axis` of the enclosing
    `jax.shard_map` (the mixers' `seq_axis` field)."""
    if seq_axis is None:
        return op
    return functools.partial(getattr(sequence_parallel, op.__name__), axis_name=seq_axis)


def check_dt_init(dt_min: float, dt_max: float, dt_init_floor: float) -> None:
    """The range of the initial step sizes of the Mamba-style mixers: `0 < dt_min <= dt_max`,
    `dt_init_floor >= 0`."""
    if not 0 < dt_min <= dt_max:
        raise ValueError(
            "dt_min, dt_max must satisfy 0 < dt_min <= dt_max, "
            f"got dt_min={dt_min}, dt_max={dt_max}"
        )
    if dt_init_floor < 0:
        raise ValueError(f"dt_init_floor must be >= 0, got {dt_init_floor}")
