"""Images of sparse vectors under hashing maps, kept sparse, and the sparse JL transform.

A hashing map sends coordinate `i` of `R^d` to `k` buckets of `R^m` with weights; the image of an
`s`-sparse vector has at most `k s` non-zeros. `compact_image` keeps it as `SparseVectors` of
dimension `m` with `k s` slots (slots landing in one bucket are summed into the first of them),
so norms of images cost `O(N k s log(k s))` whatever `m`: the `[N, m]` array of `apply` is never
built, and `m` may be in the millions.

- `merge_slots(indices, values)`: per vector, sum the values of slots with equal indices.
- `compact_image(emb, x)`: the image of `x` under the birthday map `emb` (`SparseMap`) as
  `SparseVectors`; `to_dense(compact_image(emb, x)) == emb.apply(x)`.
- `compact_max_image(emb, x)`: the same for the max map (`MaxMap`), one sparse vector of
  dimension `m` per repetition.
- `sparse_jl(key, d, m, k)` -> `SparseJL`: the block sparse JL transform (Kane-Nelson's block
  construction): `m = k b` buckets in `k` blocks of `b`; coordinate `i` goes to one bucket
  `j b + h_j(i)` of each block `j` with weight `sigma_j(i) / sqrt(k)`, the `(h_j, sigma_j)` those
  of `k` independent birthday maps into `b` buckets. If the `k s` (bucket) images of an
  `s`-sparse `x` are distinct, `||A x||_2 = ||x||_2` exactly (each `x_i^2` is counted `k` times
  with weight `1/k`); `k = 1` is the birthday map.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_choice, check_positive_int
from seqlab.sketching.embeddings import MaxMap, SparseMap, birthday_embedding
from seqlab.sketching.sparse import SparseVectors, as_vectors, to_dense


def merge_slots(
    indices: jax.Array, values: jax.Array, combine: str = "sum"
) -> tuple[jax.Array, jax.Array]:
    """`(indices, values): [..., k]` with the values of equal indices of one vector combined by
    `combine` (`"sum"` or `"max"`).

    One slot of each group of equal indices (the first in order) holds the group's sum (or
    maximum), the others become padding (index 0, value 0); slots may be reordered. With `"sum"`,
    norms over the last axis of the returned values are those of `sum_j values_j e_{indices_j}`.
    Cost: `O(k^2)` per vector by an equality table for `k <= 32` (no sort), else a sort,
    `O(k log k)` (a sort is slow on CPU for short rows).
    """
    check_choice("combine", combine, ("sum", "max"))
    if jnp.shape(indices) != jnp.shape(values) or jnp.ndim(values) < 1:
        raise ValueError(
            f"indices and values must have the same shape [..., k], got {jnp.shape(indices)} "
            f"and {jnp.shape(values)}"
        )
    return _merge(jnp.asarray(indices, jnp.int32), jnp.asarray(values), combine)


SMALL_MERGE = 32  # slots per vector up to which `merge_slots` uses the equality table


@functools.partial(jax.jit, static_argnums=2)
def _merge(indices, values, combine):
    k = indices.shape[-1]
    if k <= SMALL_MERGE:
        same = indices[..., :, None] == indices[..., None, :]  # [..., k, k]
        earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # slot l < j
        first = ~jnp.any(same & earlier, axis=-1)
        if combine == "sum":
            total = jnp.sum(jnp.where(same, values[..., None, :], 0), axis=-1)
        else:
            total = jnp.max(jnp.where(same, values[..., None, :], -jnp.inf), axis=-1)
        return jnp.where(first, indices, 0), jnp.where(first, total, 0)
    order = jnp.argsort(indices, axis=-1)
    idx = jnp.take_along_axis(indices, order, axis=-1)
    val = jnp.take_along_axis(values, order, axis=-1)
    first = jnp.concatenate(
        [jnp.ones_like(idx[..., :1], bool), idx[..., 1:] != idx[..., :-1]], axis=-1
    )
    run = jnp.cumsum(first, axis=-1) - 1  # run number of each slot
    flat_run, flat_val = run.reshape(-1, k), val.reshape(-1, k)
    if combine == "sum":
        sums = jax.vmap(lambda r, v: jnp.zeros_like(v).at[r].add(v))(flat_run, flat_val)
    else:
        sums = jax.vmap(lambda r, v: jnp.full_like(v, -jnp.inf).at[r].max(v))(flat_run, flat_val)
    run_total = jnp.take_along_axis(sums.reshape(val.shape), run, axis=-1)
    return jnp.where(first, idx, 0), jnp.where(first, run_total, 0)


def compact_image(emb: SparseMap, x: SparseVectors) -> SparseVectors:
    """The birthday map's image `A x` of `x: SparseVectors` (dimension `emb.d`, `s` slots) as
    `SparseVectors` of dimension `emb.m` with `s` slots."""
    x = as_vectors("x", x, emb.d)
    if not isinstance(x, SparseVectors):
        raise ValueError("x must be SparseVectors (compact images are for sparse inputs)")
    bucket, sign = emb.buckets(x.indices)  # one compilation for every m
    idx, val = merge_slots(bucket, sign.astype(x.values.dtype) * x.values)
    return SparseVectors(idx, val, emb.m)


def compact_max_image(emb: MaxMap, x: SparseVectors) -> SparseVectors:
    """The max map's image `f(x)` of `x: SparseVectors` (dimension `emb.d`, batch `[...]`, `s`
    slots) as `SparseVectors` of batch `[..., T]` (one vector of dimension `emb.m` per repetition)
    with `s` slots: `f(x)_{r, b} = max({0} U {x_i : h_r(i) = b})`, so that
    `to_dense(compact_max_image(emb, x)).reshape(*batch, T * m) == emb.apply(x)`."""
    x = as_vectors("x", x, emb.d)
    if not isinstance(x, SparseVectors):
        raise ValueError("x must be SparseVectors (compact images are for sparse inputs)")
    return _max_image(emb, x)


@jax.jit
def _max_image(emb: MaxMap, x: SparseVectors) -> SparseVectors:
    bucket = jnp.moveaxis(emb.buckets(x.indices), 0, -2)  # [..., T, s]
    values = jnp.broadcast_to(x.values[..., None, :], bucket.shape)
    idx, val = _merge(bucket, values, "max")
    return SparseVectors(idx, jnp.maximum(val, 0), emb.m)  # the {0} of every bucket


@flax.struct.dataclass
class SparseJL:
    """The block sparse JL transform `R^d -> R^m`, `m = k * block` (module docstring).

    `image(x)` for `SparseVectors` with `s` slots returns `SparseVectors` of dimension `m` with
    `k s` slots, cost `O(N k s log(k s))`; `apply(x)` its dense `[..., m]` (small `m` only).
    """

    maps: tuple[SparseMap, ...]  # the k birthday maps into `block` buckets
    d: int = flax.struct.field(pytree_node=False)
    block: int = flax.struct.field(pytree_node=False)

    @property
    def k(self) -> int:
        return len(self.maps)

    @property
    def m(self) -> int:
        return self.k * self.block

    def slots(self, x: SparseVectors) -> tuple[jax.Array, jax.Array]:
        """`(buckets, weighted values): [..., k s]`, the `k` slots of each slot of `x` before
        slots landing in one bucket are summed (`image` sums them)."""
        x = as_vectors("x", x, self.d)
        if not isinstance(x, SparseVectors):
            raise ValueError("x must be SparseVectors (compact images are for sparse inputs)")
        idx, val = [], []
        scale = jnp.asarray(self.k, x.values.dtype) ** -0.5
        for j, emb in enumerate(self.maps):
            bucket, sign = emb.buckets(x.indices)
            idx.append(bucket + j * self.block)
            val.append(sign.astype(x.values.dtype) * x.values * scale)
        return jnp.concatenate(idx, -1), jnp.concatenate(val, -1)

    def image(self, x: SparseVectors) -> SparseVectors:
        """`A x` as `SparseVectors` of dimension `m` with `k s` slots."""
        return SparseVectors(*merge_slots(*self.slots(x)), self.m)

    def apply(self, x: SparseVectors) -> jax.Array:
        """`A x: [..., m]` dense."""
        return to_dense(self.image(x))


def sparse_jl(key: jax.Array, d: int, m: int, k: int) -> SparseJL:
    """The block sparse JL transform from `R^d` to `R^m` with `k` non-zeros per column, drawn from
    `key`; `m` must be a multiple of `k` (blocks of `m / k` buckets)."""
    check_positive_int("d", d)
    check_positive_int("m", m)
    check_positive_int("k", k)
    if m % k:
        raise ValueError(f"m must be a multiple of k = {k} (k blocks of m / k buckets), got {m}")
    maps = tuple(birthday_embedding(jax.random.fold_in(key, j), d, m // k) for j in range(k))
    return SparseJL(maps, d, m // k)
