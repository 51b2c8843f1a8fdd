"""Sparse vectors as `indices + values`, and the stateless hashes every sketch derives from a seed.

Representation (`SparseVectors`): a batch of vectors in `R^dim` stored as `indices: [..., s]` int32
and `values: [..., s]` floating, `s` slots per vector. Padding convention: a slot whose value is 0
contributes nothing (its index must still lie in `[0, dim)`; use 0). Indices of the non-zero slots
of one vector must be distinct. Every map and sketch in `seqlab.sketching` touches only the `s`
slots, never a `[..., dim]` array, so `dim` may be huge.

Why not `jax.experimental.sparse.BCOO`: its batched layout is the same pair of arrays, but it is
experimental, its padding convention (out-of-range indices) has changed between releases, and we
need nothing from its sparse rules; a plain pair of arrays is stable across jax 0.10 and 0.11.

Hashing: a row's or a coordinate's random fate is a hash of `(base, id)`, `base` the key of the
seed and `id` the integer row key or coordinate index, so it depends only on `(seed, id)`, never on
the position of the row in its table: two parties that sketch their tables separately with the
same seed draw the same numbers for the same keys. Buckets, signs and normals use threefry
(`jax.random.fold_in(base, id)`); the sampling uniforms, one per row of every table sketched, use
a keyed integer mixer (`mix_bits`): threefry's rounds run as an XLA while loop over the whole
`[n]` array on CPU, 1.1 ms for 1e5 rows against 0.1 ms for the mixer, more than the rest of a
priority sketch.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_floating, check_positive_int

# Domain tags folded into the base key so that different sketches built from one seed draw
# independent numbers.
SAMPLING, JL, COUNTSKETCH = 0, 1, 2


@flax.struct.dataclass
class SparseVectors:
    """Vectors in `R^dim`: `indices: [..., s]` int32 and `values: [..., s]`; zero-valued slots are
    padding (see the module docstring)."""

    indices: jax.Array
    values: jax.Array
    dim: int = flax.struct.field(pytree_node=False)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.values.shape[:-1]

    @property
    def slots(self) -> int:
        return self.values.shape[-1]


def sparse_vectors(indices, values, dim: int) -> SparseVectors:
    """Validated `SparseVectors`: `indices` integer and `values` floating, both `[..., s]`.

    Index ranges are checked only when the indices are concrete (not under `jit`).
    """
    check_positive_int("dim", dim)
    check_floating("values", values)
    if not jnp.issubdtype(jnp.result_type(indices), jnp.integer):
        raise ValueError(f"indices must be an integer array, got dtype {jnp.result_type(indices)}")
    if jnp.shape(indices) != jnp.shape(values) or jnp.ndim(values) < 1:
        raise ValueError(
            f"indices and values must have the same shape [..., s], got {jnp.shape(indices)} "
            f"and {jnp.shape(values)}"
        )
    if not isinstance(indices, jax.core.Tracer) and jnp.size(indices):
        lo, hi = int(jnp.min(indices)), int(jnp.max(indices))
        if lo < 0 or hi >= dim:
            raise ValueError(f"indices must lie in [0, dim={dim}), got range [{lo}, {hi}]")
    return SparseVectors(jnp.asarray(indices, jnp.int32), jnp.asarray(values), dim)


def from_dense(x: jax.Array, slots: int) -> SparseVectors:
    """`x: [..., d]` as `SparseVectors` with `slots` slots: its `slots` entries of largest magnitude
    (exact when every vector has at most `slots` non-zeros; the rest of the slots are padding)."""
    check_floating("x", x)
    check_positive_int("slots", slots)
    if jnp.ndim(x) < 1 or slots > jnp.shape(x)[-1]:
        raise ValueError(f"x must be [..., d] with d >= slots = {slots}, got {jnp.shape(x)}")
    _, idx = jax.lax.top_k(jnp.abs(x), slots)
    vals = jnp.take_along_axis(x, idx, axis=-1)
    idx = jnp.where(vals == 0, 0, idx)  # padding convention: zero value, index 0
    return SparseVectors(idx.astype(jnp.int32), vals, x.shape[-1])


def to_dense(x: SparseVectors) -> jax.Array:
    """`[..., dim]` dense array of `x` (for tests and small `dim` only)."""
    flat_i = x.indices.reshape(-1, x.slots)
    flat_v = x.values.reshape(-1, x.slots)
    rows = jnp.arange(flat_v.shape[0])[:, None]
    dense = jnp.zeros((flat_v.shape[0], x.dim), x.values.dtype).at[rows, flat_i].add(flat_v)
    return dense.reshape(*x.batch_shape, x.dim)


def as_vectors(name: str, x, dim: int | None = None) -> "SparseVectors | jax.Array":
    """`x` validated and left as it is: `SparseVectors`, or a dense `[..., d]` array.

    Dense inputs are never expanded to `[..., d]` index arrays: the maps and sketches treat them
    with paths that hash each of the `d` coordinates once. Raises `ValueError` naming `name` when
    `x` is not floating, has rank 0, its indices and values disagree, or its dimension is not
    `dim`.
    """
    if isinstance(x, SparseVectors):
        check_floating(f"{name}.values", x.values)
        if not jnp.issubdtype(jnp.result_type(x.indices), jnp.integer):
            raise ValueError(
                f"{name}.indices must be an integer array, got dtype {jnp.result_type(x.indices)}"
            )
        if jnp.shape(x.indices) != jnp.shape(x.values) or jnp.ndim(x.values) < 1:
            raise ValueError(
                f"{name}.indices and {name}.values must have the same shape [..., s], got "
                f"{jnp.shape(x.indices)} and {jnp.shape(x.values)}"
            )
        if dim is not None and x.dim != dim:
            raise ValueError(f"{name} must be vectors of dimension {dim}, got dim = {x.dim}")
        return x
    check_floating(name, x)
    if jnp.ndim(x) < 1 or (dim is not None and jnp.shape(x)[-1] != dim):
        want = "[..., d]" if dim is None else f"[..., {dim}]"
        raise ValueError(f"{name} must have shape {want}, got {jnp.shape(x)}")
    return jnp.asarray(x)


def as_sparse(name: str, x, dim: int | None = None) -> SparseVectors:
    """`x` (dense `[..., d]` or `SparseVectors`) as `SparseVectors`; dense rows use all `d` slots
    (their `[..., d]` index array is built here: inside `jit` it stays a fused iota).

    Raises `ValueError` naming `name` when `x` is not floating or its dimension is not `dim`.
    """
    x = as_vectors(name, x, dim)
    if isinstance(x, SparseVectors):
        return x
    idx = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    return SparseVectors(idx, x, x.shape[-1])


# Dense `[N, d]` inputs are processed in blocks of rows holding about this many entries: a block
# (a few MB) stays in cache, and the temporaries of a map are `O(block + N m)`, not `O(N d)`
# (measured on CPU, d = 1e5, m = 1e4: 0.7 to 1.3 ns per entry for blocks of 1 to 4 rows, 2.4 ns
# for 64 rows).
BLOCK_ENTRIES = 2**19


def block_rows(n: int, width: int, entries: int | None = None) -> int:
    """Rows per block for `n` rows whose per-row work touches `width` entries: in `[1, n]`
    (`entries` per block, default `BLOCK_ENTRIES`)."""
    entries = BLOCK_ENTRIES if entries is None else entries
    return max(1, min(n, entries // max(width, 1)))


def map_row_blocks(fn, x: jax.Array, out_width: int, out_dtype, rows: int) -> jax.Array:
    """`fn` applied to `x: [n, d]` by blocks of `rows` rows: `[n, out_width]`.

    `fn: [rows, d] -> [rows, out_width]` must act on each row alone. The last block is shifted back
    to end at row `n` (its overlap with the previous block is computed twice and written with the
    same values), so `x` is never padded or copied.
    """
    n = x.shape[0]
    if n <= rows:
        return fn(x)
    blocks = -(-n // rows)

    def body(i, y):
        start = jnp.minimum(i * rows, n - rows)
        block = jax.lax.dynamic_slice_in_dim(x, start, rows, 0)
        return jax.lax.dynamic_update_slice_in_dim(y, fn(block).astype(out_dtype), start, 0)

    return jax.lax.fori_loop(0, blocks, body, jnp.zeros((n, out_width), out_dtype))


def squared_norms(x: SparseVectors) -> jax.Array:
    """`||x||_2^2: [...]` (padding contributes 0)."""
    if x.slots <= 32:
        # Slot by slot: XLA on CPU reduces a short minor axis poorly (0.44 ms for [1e5, 8]
        # float32 against 0.14 ms for the unrolled sum).
        return functools.reduce(jnp.add, (x.values[..., j] ** 2 for j in range(x.slots)))
    return jnp.sum(x.values * x.values, axis=-1)


def nonzeros(x: SparseVectors) -> jax.Array:
    """Number of non-zero values per vector, `[...]` int32."""
    return jnp.sum(x.values != 0, axis=-1, dtype=jnp.int32)


def base_key(seed, tag: int) -> jax.Array:
    """The PRNG key of a shared integer `seed` for the sketch family `tag`."""
    return jax.random.fold_in(jax.random.key(seed), tag)


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer: a bijection of uint32 in which every input bit flips every output
    bit with probability ~1/2."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def mix_bits(key: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two uint32 words per entry of `ids`, a keyed hash of `(key, id)`.

        `h0 = F(F(id xor k0) xor k1)`, `h1 = F(F(h0 + c) xor k2) xor k3`, with `F` = `_fmix32`,
        `(k0..k3)` the threefry key data of `key` and of `fold_in(key, 1)`, `c` = 0x9E3779B9.

    Each word is a bijection of `id` for a fixed key; different keys (seeds) give unrelated
    bijections.
    """
    k0, k1 = jax.random.key_data(key).reshape(-1)[:2].astype(jnp.uint32)
    k2, k3 = jax.random.key_data(jax.random.fold_in(key, 1)).reshape(-1)[:2].astype(jnp.uint32)
    x = ids.astype(jnp.uint32)
    h0 = _fmix32(_fmix32(x ^ k0) ^ k1)
    h1 = _fmix32(_fmix32(h0 + jnp.uint32(0x9E3779B9)) ^ k2) ^ k3
    return h0, h1


@functools.partial(jax.jit, static_argnums=2)
def hashed_uniforms(key: jax.Array, ids: jax.Array, dtype) -> jax.Array:
    """`u(id)` uniform in `(0, 1]`, one per entry of the integer array `ids` (any shape), a
    function of `(key, id)` alone (`mix_bits`: 24 random bits for float32 and narrower dtypes, 53
    for float64)."""
    h0, h1 = mix_bits(key, ids)
    if jnp.dtype(dtype) == jnp.float64:
        u = h0.astype(jnp.float64) * 2.0**-32 + (h1 >> 11).astype(jnp.float64) * 2.0**-53
        return 1 - u  # u in [0, 1 - 2^-53]: exact, so 1 - u is in (0, 1]
    u = (h0 >> 8).astype(jnp.float32) * 2.0**-24
    return (1 - u).astype(dtype)


@functools.partial(jax.jit, static_argnums=(2, 3))
def hashed_normals(key: jax.Array, ids: jax.Array, k: int, dtype) -> jax.Array:
    """`g(id): [..., k]` standard normal per entry of `ids`, a function of `(key, id)` alone."""
    flat = ids.reshape(-1)
    g = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(key, i), (k,), dtype))(flat)
    return g.reshape(*ids.shape, k)


@jax.jit
def hashed_buckets(key: jax.Array, ids: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """`(bucket in [0, m) int32, sign in {-1, +1} int32)` per entry of `ids`, from `(key, id)`
    (`m` may be traced: one compilation serves every bucket count).

        `bucket = bits mod m` of 32 random bits: each bucket's probability is within `m / 2^32` of
        `1/m` (relative), far below any effect measured here.
    """
    flat = ids.reshape(-1)
    bits = jax.vmap(lambda i: jax.random.bits(jax.random.fold_in(key, i), (2,), jnp.uint32))(flat)
    bucket = (bits[:, 0] % jnp.asarray(m, jnp.uint32)).astype(jnp.int32)
    sign = 1 - 2 * (bits[:, 1] & 1).astype(jnp.int32)
    return bucket.reshape(ids.shape), sign.reshape(ids.shape)
