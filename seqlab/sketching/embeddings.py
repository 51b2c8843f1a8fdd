"""Embeddings of sparse vectors (Silwal, Woodruff, Zhang, arXiv 2502.19865).

Birthday map (linear): hash each coordinate `i` of `R^d` to a bucket `h(i)` in `[0, m)` with a
random sign `sigma(i)`; `(Ax)_b = sum_{i: h(i) = b} sigma(i) x_i`. If `h` is injective on
`supp(x)`, `Ax` is a signed permutation of the non-zeros of `x`, so `||Ax||_p = ||x||_p` for every
`p` at once; for an `s`-sparse `x` that fails with probability at most `s(s-1) / (2m)`.

Max map (non-linear, for non-negative vectors): `T` independent hashes `h_r` into `m` buckets and

    f(x)_{r, b} = max({0} U {x_i : h_r(i) = b}),        f(x) in R^{T m}.

The max over a bucket is 1-Lipschitz in the sup norm, so `|f(x)_{r,b} - f(y)_{r,b}| <= max over
the bucket of |x_i - y_i|`, with equality when the bucket holds a single coordinate of
`supp(x) U supp(y)`. Hence `T^{-1/p} ||f(x) - f(y)||_p <= ||x - y||_p` for every `p` (the map never
expands), and a coordinate isolated in most repetitions is counted in full. The `{0}` makes the
map the same for dense and sparse inputs; on non-negative vectors it changes nothing, on signed
ones it is where the map breaks (`f(-e_1) = f(0) = 0`).
"""

import math

import flax.struct
import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_positive_int
from seqlab.sketching.sparse import (
    SparseVectors,
    as_vectors,
    block_rows,
    hashed_buckets,
    map_row_blocks,
)


def _flat(x: SparseVectors) -> tuple[jax.Array, jax.Array]:
    """`(indices, values)` of `x` as `[N, s]`, `N` the product of the batch shape."""
    return x.indices.reshape(-1, x.slots), x.values.reshape(-1, x.slots)


@flax.struct.dataclass
class SparseMap:
    """The birthday map `R^d -> R^m` (module docstring); `apply(x)` for `x: [..., d]` dense or
    `SparseVectors` returns `[..., m]`. The hash is recomputed from `key` per coordinate, so the
    map stores no `[d]` table.

    Cost: `SparseVectors` with `s` slots, `O(N s)` (one hash per slot, never a `[d]` array); dense
    `[N, d]`, the `d` coordinates are hashed once per call and the rows are summed into buckets
    by blocks of rows: time `O(N d)`, memory `O(N m)` beyond the input."""

    key: jax.Array
    d: int = flax.struct.field(pytree_node=False)
    m: int = flax.struct.field(pytree_node=False)
    signed: bool = flax.struct.field(pytree_node=False, default=True)

    def buckets(self, indices: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`(h(i), sigma(i))` for an integer array of coordinates (signs are +1 if not signed)."""
        bucket, sign = hashed_buckets(self.key, indices, self.m)
        return bucket, sign if self.signed else jnp.ones_like(sign)

    def apply(self, x) -> jax.Array:
        """`Ax: [..., m]` for `x: [..., d]` or `SparseVectors` of dimension `d`."""
        x = as_vectors("x", x, self.d)
        if isinstance(x, SparseVectors):
            return _birthday_apply(self, x)
        return _birthday_apply_dense(self, x)

    def injective_on(self, x) -> jax.Array:
        """`[...]` bool: whether `h` is injective on the support of each vector of `x`."""
        x = as_vectors("x", x, self.d)
        if not isinstance(x, SparseVectors):
            return _injective_dense(self, x)
        idx, vals = _flat(x)
        bucket, _ = self.buckets(idx)
        nz = vals != 0
        same = (bucket[:, :, None] == bucket[:, None, :]) & nz[:, :, None] & nz[:, None, :]
        collisions = jnp.sum(same, axis=(1, 2)) - jnp.sum(nz, axis=1)  # off-diagonal pairs
        return (collisions == 0).reshape(x.batch_shape)


@jax.jit
def _birthday_apply(emb: SparseMap, x: SparseVectors) -> jax.Array:
    idx, vals = _flat(x)
    bucket, sign = emb.buckets(idx)
    rows = jnp.arange(vals.shape[0])[:, None]
    y = jnp.zeros((vals.shape[0], emb.m), vals.dtype).at[rows, bucket].add(sign * vals)
    return y.reshape(*x.batch_shape, emb.m)


@jax.jit
def _birthday_apply_dense(emb: SparseMap, x: jax.Array) -> jax.Array:
    """`x: [..., d]` dense: `(Ax)_b = sum_{h(i) = b} sigma(i) x_i` with each coordinate hashed
    once, by blocks of rows (`sparse.map_row_blocks`)."""
    flat = x.reshape(-1, emb.d)
    bucket, sign = emb.buckets(jnp.arange(emb.d, dtype=jnp.int32))  # [d] each
    sign = sign.astype(x.dtype)[:, None]

    def block(rows):  # [r, d] -> [r, m]: a scatter over the coordinate axis of the transpose
        return jnp.zeros((emb.m, rows.shape[0]), x.dtype).at[bucket].add(rows.T * sign).T

    y = map_row_blocks(block, flat, emb.m, x.dtype, block_rows(flat.shape[0], emb.d))
    return y.reshape(*x.shape[:-1], emb.m)


@jax.jit
def _injective_dense(emb: SparseMap, x: jax.Array) -> jax.Array:
    """`[...]` bool for dense `x: [..., d]`: no bucket holds two non-zeros (counts `[N, m]`)."""
    flat = x.reshape(-1, emb.d)
    bucket, _ = emb.buckets(jnp.arange(emb.d, dtype=jnp.int32))

    def block(rows):  # [r, d] -> [r, m] non-zeros per bucket
        nz = (rows.T != 0).astype(jnp.int32)
        return jnp.zeros((emb.m, rows.shape[0]), jnp.int32).at[bucket].add(nz).T

    counts = map_row_blocks(block, flat, emb.m, jnp.int32, block_rows(flat.shape[0], emb.d))
    return jnp.all(counts <= 1, axis=-1).reshape(x.shape[:-1])


def birthday_embedding(key: jax.Array, d: int, m: int, *, signed: bool = True) -> SparseMap:
    """The birthday map from `R^d` to `R^m` drawn from `key` (see `SparseMap`).

    `m = birthday_dimension(s, failure)` makes the expected fraction of `s`-sparse vectors whose
    every `l_p` norm is preserved exactly at least `1 - failure`.
    """
    check_positive_int("d", d)
    check_positive_int("m", m)
    return SparseMap(key, d, m, bool(signed))


@flax.struct.dataclass
class MaxMap:
    """The max map `R^d -> R^{T m}` (module docstring), `T = repetitions`; `apply(x)` for
    non-negative `x: [..., d]` dense or `SparseVectors` returns `[..., T * m]` (repetition-major).
    Compare images with `distance`, which rescales by `T^{-1/p}`.

    Cost: `SparseVectors` with `s` slots, `O(N s T)`; dense `[N, d]`, the `T d` buckets are hashed
    once per call and the rows are maxed into buckets by blocks of rows: time `O(N d T)`, memory
    `O(N m T + T d)` beyond the input."""

    key: jax.Array
    d: int = flax.struct.field(pytree_node=False)
    m: int = flax.struct.field(pytree_node=False)
    repetitions: int = flax.struct.field(pytree_node=False)

    def buckets(self, indices: jax.Array) -> jax.Array:
        """`h_r(i): [T, *indices.shape]` int32, the bucket of each coordinate in each repetition."""
        reps = jnp.arange(self.repetitions)
        return jax.vmap(lambda r: hashed_buckets(jax.random.fold_in(self.key, r), indices, self.m))(
            reps
        )[0]

    def apply(self, x) -> jax.Array:
        """`f(x): [..., T * m]` for `x: [..., d]` or `SparseVectors` of dimension `d`."""
        x = as_vectors("x", x, self.d)
        if isinstance(x, SparseVectors):
            return _max_apply(self, x)
        return _max_apply_dense(self, x)

    def distance(self, fx: jax.Array, fy: jax.Array, p: float) -> jax.Array:
        """`T^{-1/p} ||fx - fy||_p` over the last axis (`p = inf`: the plain max), the estimate of
        `||x - y||_p` from images `fx, fy: [..., T * m]`."""
        return lp_distance(fx, fy, p) * self.repetitions ** (-1 / p if math.isfinite(p) else 0)


@jax.jit
def _max_apply(emb: MaxMap, x: SparseVectors) -> jax.Array:
    idx, vals = _flat(x)
    bucket = jnp.moveaxis(emb.buckets(idx), 0, 1)  # [N, T, s]
    n, t = vals.shape[0], emb.repetitions
    rows = jnp.arange(n)[:, None, None]
    reps = jnp.arange(t)[None, :, None]
    src = jnp.broadcast_to(vals[:, None, :], bucket.shape)
    y = jnp.zeros((n, t, emb.m), vals.dtype).at[rows, reps, bucket].max(src)  # max with the {0}
    return y.reshape(*x.batch_shape, t * emb.m)


@jax.jit
def _max_apply_dense(emb: MaxMap, x: jax.Array) -> jax.Array:
    """`x: [..., d]` dense: `f(x)_{r, b} = max({0} U {x_i : h_r(i) = b})`, each coordinate hashed
    once per repetition, by blocks of rows and one repetition at a time."""
    flat = x.reshape(-1, emb.d)
    buckets = emb.buckets(jnp.arange(emb.d, dtype=jnp.int32))  # [T, d]

    def block(rows):  # [r, d] -> [r, T m]
        rows_t = rows.T

        def rep(bucket):  # [d] -> [m, r], the max with the {0} of the zero fill
            return jnp.zeros((emb.m, rows.shape[0]), x.dtype).at[bucket].max(rows_t)

        return jnp.moveaxis(jax.lax.map(rep, buckets), 2, 0).reshape(rows.shape[0], -1)

    t, m = emb.repetitions, emb.m
    y = map_row_blocks(block, flat, t * m, x.dtype, block_rows(flat.shape[0], emb.d + t * m))
    return y.reshape(*x.shape[:-1], t * m)


def max_embedding(key: jax.Array, d: int, m: int, repetitions: int) -> MaxMap:
    """The max map from `R^d` to `R^{repetitions * m}` drawn from `key` (see `MaxMap`).

    `(m, repetitions) = max_embedding_dimension(s, n, eps)` preserves every pairwise `l_p`
    distance of `n` non-negative `s`-sparse vectors within `[1 - eps, 1]`, for all `p >= 1` at
    once, with probability `1 - delta`; `linf_dimension(s, n)` makes `l_inf` distances exact.
    """
    check_positive_int("d", d)
    check_positive_int("m", m)
    check_positive_int("repetitions", repetitions)
    return MaxMap(key, d, m, repetitions)


def lp_distance(x: jax.Array, y: jax.Array, p: float) -> jax.Array:
    """`||x - y||_p` over the last axis for `p >= 1` or `p = inf`."""
    if not (p == math.inf or p >= 1):
        raise ValueError(f"p must be >= 1 or inf, got {p!r}")
    diff = jnp.abs(x - y)
    top = jnp.max(diff, axis=-1)
    if p == math.inf:
        return top
    # ||v||_p = max|v| * ||v / max|v|| ||_p keeps v^p in range for large p.
    scale = jnp.where(top > 0, top, 1)
    return top * jnp.sum((diff / scale[..., None]) ** p, axis=-1) ** (1 / p)
