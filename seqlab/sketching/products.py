"""Matrix product sketches from a shared seed (Daliri, Freire, Li, Musco, arXiv 2501.17836).

Two parties hold `A: [n_A, d]` and `B: [n_B, d']` whose rows carry integer keys (a join key, or
the row index); the product of interest is `A^T B = sum over keys in both of a_key b_key^T`. Each
party sketches alone, knowing only a shared integer `seed`; `estimate_product(SA, SB)` estimates
`A^T B: [d, d']` from the two sketches.

Sampling sketches (`RowSketch`). A row with key `i` draws `u_i = u(seed, i)` uniform in `(0, 1]`
from a stateless hash (`sparse.hashed_uniforms`; the same draw for priority and threshold
sampling), so its fate depends on `(seed, i, a_i)` and the
scale `tau`, never on its position. Row `i` is kept iff `u_i < ||a_i||^2 tau`, i.e. with
probability `p_i(A) = min(1, ||a_i||^2 tau_A)`:

  * priority sampling (`priority_sketch`): `rank_i = u_i / ||a_i||^2`, `tau` the `(k+1)`-th
    smallest rank; exactly `k` rows are kept (all non-zero rows when there are at most `k`).
  * threshold sampling (`threshold_sketch`): `tau = k / ||A||_F^2`; `k` rows are kept in
    expectation (at most `k`).

The estimate is `W = sum_{i in S_A and S_B} a_i b_i^T / P_i` with `P_i = min(1, ||a_i||^2 tau_A,
||b_i||^2 tau_B)` when the seeds agree (coordinated: one `u_i` decides both) and
`P_i = p_i(A) p_i(B)` when they differ (independent). Conditioned on the other rows, `P_i` is the
exact probability that row `i` is in both sketches, so `E[W] = A^T B`; the variance is
`E||W - A^T B||_F^2 <= 2/(k-1) ||A||_F^2 ||B||_F^2` (priority) and `<= 2/k ...` (threshold).

Linear sketches (`LinearSketch`), the baselines: `SA = S A` with `S: [k, n]` drawn column by column
from the row keys, `W = (SA)^T (SB)`, `E||W - A^T B||_F^2 <= 2/k ||A||_F^2 ||B||_F^2` for both:

  * `jl_sketch`: column `S[:, i] = g(key_i) / sqrt(k)`, `g` standard normal;
  * `countsketch`: column `S[:, i] = sigma(key_i) e_{h(key_i)}`, one random sign in a hashed row.

Storage accounting (`storage`, in stored numbers): a kept row costs its non-zero values plus their
column indices plus its key, `min(2 nnz, d) + 1` (a row with more than `d/2` non-zeros is stored
densely without indices), plus one number for `tau`; a linear sketch costs `k d` whatever the
sparsity. With `s` non-zeros per row and equal storage, sampling keeps `~ S / (2s + 1)` rows and a
linear sketch `S / d`, so its error bound is smaller by about `sqrt(d / (2s + 1))`: the advantage is
for sparse rows; with dense rows there is none.

Sampling decisions are piecewise constant in the data: the estimate is differentiable in the values
of the kept rows (almost everywhere), not through which rows are kept.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp

from seqlab.ops.checks import check_positive_int
from seqlab.sketching.sparse import (
    COUNTSKETCH,
    JL,
    SAMPLING,
    SparseVectors,
    as_vectors,
    base_key,
    block_rows,
    hashed_buckets,
    hashed_normals,
    hashed_uniforms,
    nonzeros,
    squared_norms,
)

# The estimate multiplies densified rows (a matmul) instead of scattering the `[slots, s_A, s_B]`
# outer products when `DENSE_ESTIMATE s_A s_B >= d d'`: a scattered product costs a few ns, a
# matmul's multiply-add a few hundredths.
DENSE_ESTIMATE = 64


@flax.struct.dataclass
class RowSketch:
    """Sampled rows of a matrix: `slots` rows (the kept ones flagged in `kept`), each stored
    sparsely. The order of the slots is unspecified (priority sketches store ascending ranks,
    threshold sketches that did not overflow a fixed order of the row positions).

    Attributes:
      keys: `[slots]` int32 row keys.
      indices, values: `[slots, s]` the rows (`SparseVectors` layout, zero values are padding).
      norms_sq: `[slots]` squared norms `||a_i||^2` of the stored rows.
      kept: `[slots]` bool, the rows in the sketch (other slots are unused).
      tau: scalar, row `i` is kept with probability `min(1, norms_sq_i * tau)`.
      seed: scalar int, the shared seed.
      truncated: scalar bool, True when more rows qualified than there were slots (threshold
        sampling with a `capacity`; the estimate is then biased).
      dim: number of columns `d`.
    """

    keys: jax.Array
    indices: jax.Array
    values: jax.Array
    norms_sq: jax.Array
    kept: jax.Array
    tau: jax.Array
    seed: jax.Array
    truncated: jax.Array
    dim: int = flax.struct.field(pytree_node=False)


@flax.struct.dataclass
class LinearSketch:
    """`S A: [k, d]` for a `[k, n]` random matrix `S` drawn from the row keys and `seed`; `kind` is
    `"jl"` or `"countsketch"`."""

    sketch: jax.Array
    seed: jax.Array
    kind: str = flax.struct.field(pytree_node=False)


def _rows_and_keys(A, keys) -> tuple[SparseVectors | jax.Array, jax.Array]:
    """Validate `A` (`[n, d]` dense or `SparseVectors` with values `[n, s]`) and `keys: [n]`.

    Dense `A` stays dense (the sketches have dense paths that never build `[n, d]` indices).
    """
    rows = as_vectors("A", A)
    shape = rows.values.shape if isinstance(rows, SparseVectors) else rows.shape
    if len(shape) != 2:
        raise ValueError(f"A must hold rows [n, d] (or SparseVectors [n, s]), got {shape}")
    n = shape[0]
    if n == 0:
        raise ValueError("A must hold at least one row, got 0")
    if keys is None:
        return rows, jnp.arange(n, dtype=jnp.int32)
    if not jnp.issubdtype(jnp.result_type(keys), jnp.integer):
        raise ValueError(f"keys must be an integer array [n], got dtype {jnp.result_type(keys)}")
    if jnp.shape(keys) != (n,):
        raise ValueError(f"keys must have shape [n] = [{n}], got {jnp.shape(keys)}")
    return rows, jnp.asarray(keys).astype(jnp.int32)


def _norms_sq(rows) -> jax.Array:
    """`||a_i||^2: [n]` of `SparseVectors` or dense `[n, d]` rows."""
    if isinstance(rows, SparseVectors):
        return squared_norms(rows)
    return jnp.sum(rows * rows, axis=-1)


def _take(rows, order: jax.Array) -> tuple[jax.Array, jax.Array, int]:
    """`(indices, values, dim)` of the rows `order` (dense rows get all `d` column indices)."""
    if isinstance(rows, SparseVectors):
        return rows.indices[order], rows.values[order], rows.dim
    d = rows.shape[1]
    return jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32), (order.shape[0], d)), rows[order], d


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _seed(seed) -> jax.Array:
    if not jnp.issubdtype(jnp.result_type(seed), jnp.integer) or jnp.ndim(seed) != 0:
        raise ValueError(f"seed must be an integer scalar, got {seed!r}")
    return jnp.asarray(seed, jnp.int32)


def _ranks(w: jax.Array, keys: jax.Array, seed: jax.Array) -> jax.Array:
    """`rank_i = u(seed, key_i) / ||a_i||^2: [n]` (`inf` for zero rows)."""
    u = hashed_uniforms(base_key(seed, SAMPLING), keys, w.dtype)
    return jnp.where(w > 0, u / jnp.where(w > 0, w, 1), jnp.inf)


def _lowest(rank: jax.Array, q: int, bound=None) -> tuple[jax.Array, jax.Array]:
    """`(the q smallest ranks ascending, their rows)`, `q <= n`.

    With `bound` (a scalar), the rows with `rank < bound` are compacted first and the top_k runs
    over at most `_CANDIDATES q` of them; that is exact whenever at least `q` and at most
    `_CANDIDATES q` ranks lie below `bound`, else the plain top_k over all `n` runs (`lax.cond`).
    """
    n = rank.shape[0]

    def full(_):
        neg, order = jax.lax.top_k(-rank, q)
        return -neg, order

    if bound is None or n <= 2 * _CANDIDATES * q:
        return full(None)
    below = rank < bound
    count = jnp.sum(below)

    def candidates(_):
        cand, _ = _compact(below, _CANDIDATES * q)
        neg, pick = jax.lax.top_k(-jnp.where(jnp.arange(cand.shape[0]) < count, rank[cand],
                                             jnp.inf), q)  # fmt: skip
        return -neg, cand[pick]

    return jax.lax.cond((count >= q) & (count <= _CANDIDATES * q), candidates, full, None)


def _smallest(rank: jax.Array, tau_of_ranks, slots: int, bound=None):
    """`(order [slots], kept [slots], tau, truncated)`: the `slots` lowest ranks, ascending, with
    `tau = tau_of_ranks(the min(slots + 1, n) smallest ranks)` (`bound`: see `_lowest`)."""
    sorted_ranks, order = _lowest(rank, min(slots + 1, rank.shape[0]), bound)
    # Materialize the selection once: without the barrier XLA on CPU recomputed the hash and
    # top_k for each output (measured 50 ms instead of 4 ms for n = 1e5 rows).
    sorted_ranks, order = jax.lax.optimization_barrier((sorted_ranks, order))
    tau = tau_of_ranks(sorted_ranks)
    # `<=`: priority's tau is the (k+1)-th smallest rank, and a float32 tie of the k-th with it
    # must still keep k rows (`<` kept k - 1); for a fixed tau it differs from `<` on a null event.
    kept = (sorted_ranks[:slots] <= tau) & jnp.isfinite(sorted_ranks[:slots])
    # Overflow iff a row beyond the slots qualifies, i.e. the (slots+1)-th smallest rank does.
    truncated = sorted_ranks[slots] < tau if rank.shape[0] > slots else jnp.array(False)
    return order[:slots], kept, tau, truncated


# Priority sampling first keeps the rows with rank below `2 (k + 1) / ||A||_F^2` (about `2 (k + 1)`
# rows when no row is heavy, at most `_CANDIDATES (k + 1)` used) and runs its top_k over those:
# XLA's top_k over all n = 1e5 rows took 0.6 ms on CPU, the compaction and small top_k 0.2 ms.
_CANDIDATES = 4


# Columns of the mask in `_compact`: its prefix count is `_COMPACT` unrolled row additions and one
# cumulative sum over `n / _COMPACT` column totals (jnp.cumsum over all n took 0.85 ms on CPU for
# n = 1e5, this 0.1 ms).
_COMPACT = 32


def _compact(mask: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """`(order [slots], count)`: the indices of the `count` True entries of `mask: [n]` in slots
    `0..count-1` (in a fixed order, not ascending; the rest 0), when `count <= slots`.

    The mask is read as a `[_COMPACT, n / _COMPACT]` grid numbered column by column: slot `j`
    finds its column by a binary search in the columns' cumulative counts, then its row among
    that column's `_COMPACT` entries (no scatter of `n` entries).
    """
    n = mask.shape[0]
    cols = -(-n // _COMPACT)
    grid = jnp.pad(mask, (0, _COMPACT * cols - n)).reshape(_COMPACT, cols).astype(jnp.int32)
    upto = [grid[0]]  # True entries in rows 0..r of each column
    for r in range(1, _COMPACT):
        upto.append(upto[-1] + grid[r])
    ends = jnp.cumsum(upto[-1])  # True entries in columns 0..c
    slot = jnp.arange(slots, dtype=jnp.int32)
    col = jnp.minimum(jnp.searchsorted(ends, slot, side="right"), cols - 1)
    within = slot - (ends[col] - upto[-1][col])  # rank of the slot inside its column
    row = jnp.sum(jnp.stack(upto)[:, col] <= within[None, :], axis=0)
    count = ends[-1]
    return jnp.where(slot < count, row * cols + col, 0).astype(jnp.int32), count


def _sketch(rows, w, keys, seed, order, kept, tau, truncated) -> RowSketch:
    """The `RowSketch` of the rows `order` (`kept` flags the sampled ones)."""
    indices, values, dim = _take(rows, order)
    return RowSketch(
        keys=keys[order],
        indices=indices,
        values=values,
        norms_sq=w[order],
        kept=kept,
        tau=tau,
        seed=seed,
        truncated=truncated,
        dim=dim,
    )


def priority_sketch(A, k: int, seed, keys=None) -> RowSketch:
    """Priority sample of `k` rows of `A` (module docstring).

    Args:
      A: `[n, d]` dense, or `SparseVectors` with `indices, values: [n, s]` and `dim = d`.
      k: rows to keep (static).
      seed: integer scalar shared by the parties.
      keys: `[n]` integer row keys in `[0, 2^31)`, unique within `A`; default the row index.

    Returns a `RowSketch` with `min(k, n)` slots and `tau` the `(k+1)`-th smallest rank
    `u_i / ||a_i||^2` (`inf` when `n <= k`: every non-zero row is kept with probability 1).
    """
    check_positive_int("k", k)
    rows, keys = _rows_and_keys(A, keys)
    return _priority(rows, keys, _seed(seed), k)


@functools.partial(jax.jit, static_argnums=3)
def _priority(rows, keys: jax.Array, seed: jax.Array, k: int) -> RowSketch:
    n = keys.shape[0]

    def tau(sorted_ranks):
        return sorted_ranks[k] if n > k else jnp.array(jnp.inf, sorted_ranks.dtype)

    w = jax.lax.optimization_barrier(_norms_sq(rows))  # see `_threshold`
    total = jnp.sum(w)
    bound = 2 * (k + 1) / jnp.where(total > 0, total, 1)
    order, kept, tau, truncated = _smallest(_ranks(w, keys, seed), tau, min(k, n), bound)
    return _sketch(rows, w, keys, seed, order, kept, tau, truncated)


def threshold_sketch(A, k: int, seed, keys=None, capacity: int | None = None) -> RowSketch:
    """Threshold sample of `A`: row `i` is kept iff `u_i <= k ||a_i||^2 / ||A||_F^2` (expected
    number of kept rows `sum_i min(1, k ||a_i||^2 / ||A||_F^2) <= k`).

    `A`, `seed`, `keys` as in `priority_sketch`. The sketch has `capacity` slots (default `n`, which
    can never overflow); with a smaller capacity the lowest-ranked qualifying rows are stored and
    `truncated` reports an overflow (the estimate is then biased). Without overflow the qualifying
    rows are compacted in `O(n)` (no sort); an overflow costs a top_k over the `n` ranks.
    """
    check_positive_int("k", k)
    rows, keys = _rows_and_keys(A, keys)
    n = keys.shape[0]
    capacity = n if capacity is None else capacity
    check_positive_int("capacity", capacity)
    return _threshold(rows, keys, _seed(seed), k, min(capacity, n))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _threshold(rows, keys, seed, k: int, slots: int) -> RowSketch:
    # The barrier keeps XLA from summing the squares twice (per row and in total), which on CPU
    # materialized the `[n, d]` squares of dense rows.
    w = jax.lax.optimization_barrier(_norms_sq(rows))
    total = jnp.sum(w)
    tau = jnp.where(total > 0, k / jnp.where(total > 0, total, 1), 0).astype(w.dtype)
    # rank <= tau  <=>  u <= w tau; the strict `<` here differs only on a null event.
    rank = _ranks(w, keys, seed)
    qualify = rank < tau
    n = rank.shape[0]

    def compact(_):  # every qualifying row fits: O(n), in the fixed order of `_compact`
        order, count = _compact(qualify, slots)
        return order, jnp.arange(slots) < count, jnp.array(False)

    def lowest(_):  # overflow: keep the lowest ranks (a top_k over n)
        order, kept, _, truncated = _smallest(rank, lambda _: tau, slots)
        return order, kept, truncated

    if slots >= n:  # cannot overflow
        order, kept, truncated = compact(None)
    else:
        order, kept, truncated = jax.lax.cond(jnp.sum(qualify) <= slots, compact, lowest, None)
    return _sketch(rows, w, keys, seed, order, kept, tau, truncated)


def _linear(A, k: int, seed, keys, kind: str) -> LinearSketch:
    check_positive_int("k", k)
    rows, keys = _rows_and_keys(A, keys)
    return _linear_core(rows, keys, _seed(seed), k, kind)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _linear_core(rows, keys, seed, k: int, kind: str) -> LinearSketch:
    if not isinstance(rows, SparseVectors):
        return LinearSketch(_linear_dense(rows, keys, seed, k, kind), seed, kind)
    key = base_key(seed, JL if kind == "jl" else COUNTSKETCH)
    lanes = jnp.arange(k)[None, :, None]
    if kind == "jl":
        g = hashed_normals(key, keys, k, rows.values.dtype) / jnp.sqrt(k).astype(rows.values.dtype)
        if k * rows.slots <= rows.dim:  # scatter the [n, k, s] products: memory n k s <= n d
            contrib = g[:, :, None] * rows.values[:, None, :]
            cols = jnp.broadcast_to(rows.indices[:, None, :], contrib.shape)
            sketch = jnp.zeros((k, rows.dim), rows.values.dtype).at[lanes, cols].add(contrib)
        else:  # rows this full are cheaper dense: G^T A with A as [n, d]
            n = rows.batch_shape[0]
            dense = jnp.zeros((n, rows.dim), rows.values.dtype)
            dense = dense.at[jnp.arange(n)[:, None], rows.indices].add(rows.values)
            sketch = g.T @ dense
    else:
        bucket, sign = hashed_buckets(key, keys, k)
        contrib = sign[:, None].astype(rows.values.dtype) * rows.values  # [n, s]
        sketch = (
            jnp.zeros((k, rows.dim), rows.values.dtype)
            .at[bucket[:, None], rows.indices]
            .add(contrib)
        )
    return LinearSketch(sketch, seed, kind)


def _linear_dense(A: jax.Array, keys, seed, k: int, kind: str) -> jax.Array:
    """`S A: [k, d]` for dense `A: [n, d]` with temporaries `O(k d)` beyond `A`: JL is one
    matmul `G^T A`; CountSketch adds the signed rows into their buckets by blocks of rows."""
    n, d = A.shape
    if kind == "jl":
        g = hashed_normals(base_key(seed, JL), keys, k, A.dtype) / jnp.sqrt(k).astype(A.dtype)
        return g.T @ A
    bucket, sign = hashed_buckets(base_key(seed, COUNTSKETCH), keys, k)
    sign = sign.astype(A.dtype)
    rows = block_rows(n, d)
    if rows == n:
        return jnp.zeros((k, d), A.dtype).at[bucket].add(sign[:, None] * A)

    def body(i, sketch):
        # The last block is shifted back to end at row n; rows before i * rows are already in.
        start = jnp.minimum(i * rows, n - rows)
        block = jax.lax.dynamic_slice_in_dim(A, start, rows, 0)
        first = jnp.arange(rows) + start >= i * rows
        weight = jnp.where(first, jax.lax.dynamic_slice_in_dim(sign, start, rows), 0)
        where = jax.lax.dynamic_slice_in_dim(bucket, start, rows)
        return sketch.at[where].add(weight[:, None] * block)

    return jax.lax.fori_loop(0, -(-n // rows), body, jnp.zeros((k, d), A.dtype))


def jl_sketch(A, k: int, seed, keys=None) -> LinearSketch:
    """Gaussian Johnson-Lindenstrauss sketch `S A: [k, d]`, `S[:, i] = g(seed, key_i) / sqrt(k)`.

    `A`, `seed`, `keys` as in `priority_sketch`; sparse rows cost `O(k s)` each (memory
    `min(n k s, n d)`: rows with `k s > d` are multiplied densely); dense `[n, d]` rows are one
    matmul. Storage `k d` numbers (`storage`).
    """
    return _linear(A, k, seed, keys, "jl")


def countsketch(A, k: int, seed, keys=None) -> LinearSketch:
    """CountSketch `S A: [k, d]`: row `i` of `A` is added with sign `sigma(seed, key_i)` into row
    `h(seed, key_i)` of the sketch; dense `[n, d]` rows are added by blocks of rows (memory
    `O(k d)` beyond `A`). Storage `k d` numbers (`storage`)."""
    return _linear(A, k, seed, keys, "countsketch")


def estimate_product(SA, SB) -> jax.Array:
    """The estimate of `A^T B: [d, d']` from sketches of `A` and `B` of the same kind.

    Two `RowSketch`es (priority or threshold, possibly one of each): the sum over keys kept in both
    of `a_i b_i^T / P_i` (module docstring; coordinated when the seeds agree, independent
    otherwise). Two `LinearSketch`es of one kind, `k` and seed: `(SA)^T (SB)`.
    """
    if isinstance(SA, LinearSketch) and isinstance(SB, LinearSketch):
        if SA.kind != SB.kind or SA.sketch.shape[0] != SB.sketch.shape[0]:
            raise ValueError(
                f"SA and SB must be linear sketches of one kind and size, got {SA.kind} "
                f"[{SA.sketch.shape[0]}, .] and {SB.kind} [{SB.sketch.shape[0]}, .]"
            )
        if _concrete(SA.seed) and _concrete(SB.seed) and int(SA.seed) != int(SB.seed):
            raise ValueError(f"SA and SB must share the seed, got {int(SA.seed)}, {int(SB.seed)}")
        return SA.sketch.T @ SB.sketch
    if not (isinstance(SA, RowSketch) and isinstance(SB, RowSketch)):
        raise ValueError(
            f"SA and SB must both be RowSketch or both LinearSketch, got {type(SA).__name__} and "
            f"{type(SB).__name__}"
        )
    return _estimate_rows(SA, SB)


@jax.jit
def _estimate_rows(SA: RowSketch, SB: RowSketch) -> jax.Array:
    # Match every slot of SA with the slot of SB holding the same key (keys are unique per table).
    order = jnp.argsort(SB.keys)
    pos = jnp.clip(jnp.searchsorted(SB.keys[order], SA.keys), 0, SB.keys.shape[0] - 1)
    j = order[pos]
    both = SA.kept & SB.kept[j] & (SB.keys[j] == SA.keys)
    p_a = jnp.minimum(1, SA.norms_sq * SA.tau)
    p_b = jnp.minimum(1, SB.norms_sq[j] * SB.tau)
    prob = jnp.where(SA.seed == SB.seed, jnp.minimum(p_a, p_b), p_a * p_b)
    weight = jnp.where(both, 1 / jnp.where(both, prob, 1), 0)  # [slots_A]
    dtype = jnp.result_type(SA.values, SB.values)
    vb, ib = SB.values[j], SB.indices[j]
    s_a, s_b = SA.values.shape[1], SB.values.shape[1]
    if DENSE_ESTIMATE * s_a * s_b >= SA.dim * SB.dim:
        # Full rows: one matmul of the densified rows, slots (d + d') + d d' memory.
        slots = jnp.broadcast_to(jnp.arange(SA.values.shape[0])[:, None], SA.indices.shape)
        da = _scatter_add(
            (SA.values.shape[0], SA.dim),
            slots,
            SA.indices,
            (weight[:, None] * SA.values).astype(dtype),
        )
        slots = jnp.broadcast_to(slots[:, :1], ib.shape)
        db = _scatter_add((SA.values.shape[0], SB.dim), slots, ib, vb.astype(dtype))
        return jnp.matmul(da.T, db, precision=jax.lax.Precision.HIGHEST)
    contrib = weight[:, None, None] * SA.values[:, :, None] * vb[:, None, :]  # [slots, s_A, s_B]
    rows_i = jnp.broadcast_to(SA.indices[:, :, None], contrib.shape)
    cols_i = jnp.broadcast_to(ib[:, None, :], contrib.shape)
    return _scatter_add((SA.dim, SB.dim), rows_i, cols_i, contrib.astype(dtype))


def _scatter_add(shape: tuple[int, int], rows, cols, values) -> jax.Array:
    """`zeros(shape).at[rows, cols].add(values)`, through flat indices `rows * shape[1] + cols`
    where they fit in int32: XLA's CPU scatter into a 2-D operand took 91 ms for 64k updates into
    `[1e4, 1e3]`, the flat one 18 ms (most of it zeroing the output)."""
    if shape[0] * shape[1] >= 2**31:
        return jnp.zeros(shape, values.dtype).at[rows, cols].add(values)
    flat = rows.astype(jnp.int32) * shape[1] + cols.astype(jnp.int32)
    return jnp.zeros(shape[0] * shape[1], values.dtype).at[flat].add(values).reshape(shape)


def storage(sketch) -> jax.Array:
    """Stored numbers (module docstring): `sum over kept rows of (min(2 nnz, d) + 1) + 1` for a
    `RowSketch`, `k d` for a `LinearSketch`."""
    if isinstance(sketch, LinearSketch):
        return jnp.asarray(sketch.sketch.size, jnp.int32)
    if not isinstance(sketch, RowSketch):
        raise ValueError(f"sketch must be a RowSketch or LinearSketch, got {type(sketch).__name__}")
    nnz = nonzeros(SparseVectors(sketch.indices, sketch.values, sketch.dim))
    per_row = jnp.minimum(2 * nnz, sketch.dim) + 1
    return jnp.sum(jnp.where(sketch.kept, per_row, 0)) + 1
