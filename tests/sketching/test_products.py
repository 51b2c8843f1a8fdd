"""Product sketches against plain numpy definitions; unbiasedness, coordination, position
independence, storage accounting, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqlab.sketching import (
    countsketch,
    estimate_product,
    from_dense,
    jl_sketch,
    priority_sketch,
    storage,
    threshold_sketch,
)
from seqlab.sketching import sparse as sp
from tests.conftest import assert_close

N, D, DB, K = 40, 12, 5, 8


def _tables(seed=0, s=None, dtype=jnp.float64):
    """`A: [N, D]` (rows with `s` non-zeros when given), `B: [N, DB]`, distinct scattered keys."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(N, D)) * rng.uniform(0.1, 3, (N, 1))  # unequal row norms
    if s is not None:
        A *= np.argsort(rng.random((N, D)), axis=1) < s
    B = rng.normal(size=(N, DB))
    keys = rng.choice(10**6, N, replace=False)
    return jnp.asarray(A, dtype), jnp.asarray(B, dtype), jnp.asarray(keys, jnp.int32)


def _uniforms(seed, keys, dtype):
    return np.asarray(sp.hashed_uniforms(sp.base_key(seed, sp.SAMPLING), keys, dtype), np.float64)


def _reference_sample(A, keys, seed, k, method):
    """`{key: (row, ||row||^2)}` of the kept rows and `tau`, by sorting in numpy (float64, with
    the uniforms the sketch draws in `A`'s dtype)."""
    u = _uniforms(seed, keys, A.dtype)
    A = np.asarray(A, np.float64)
    w = np.sum(A**2, axis=1)
    rank = np.where(w > 0, u / np.where(w > 0, w, 1), np.inf)
    priority_tau = np.sort(rank)[k] if len(rank) > k else np.inf
    tau = priority_tau if method == "priority" else k / w.sum()
    kept = {int(key): (A[i], w[i]) for i, key in enumerate(np.asarray(keys)) if rank[i] < tau}
    return kept, tau


def _reference_estimate(sa, sb, coordinated):
    (kept_a, tau_a), (kept_b, tau_b) = sa, sb
    d, db = next(iter(kept_a.values()))[0].size, next(iter(kept_b.values()))[0].size
    W = np.zeros((d, db))
    for key in set(kept_a) & set(kept_b):
        (a, wa), (b, wb) = kept_a[key], kept_b[key]
        pa, pb = min(1, wa * tau_a), min(1, wb * tau_b)
        W += np.outer(a, b) / (min(pa, pb) if coordinated else pa * pb)
    return W


@pytest.mark.parametrize("method", ["priority", "threshold"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_sampling_matches_reference(method, dtype):
    A, B, keys = _tables(1, dtype=dtype)
    sketch = priority_sketch if method == "priority" else threshold_sketch
    for seed_b in (7, 8):  # coordinated, then independent
        SA, SB = sketch(A, K, 7, keys), sketch(B, K, seed_b, keys)
        ref_a = _reference_sample(A, keys, 7, K, method)
        ref_b = _reference_sample(B, keys, seed_b, K, method)
        got = {int(k) for k, kept in zip(SA.keys, SA.kept, strict=True) if kept}
        assert got == set(ref_a[0])
        if method == "priority":
            assert len(got) == K
        want = _reference_estimate(ref_a, ref_b, coordinated=seed_b == 7)
        assert_close(estimate_product(SA, SB), want.astype(dtype))
        assert not bool(SA.truncated)


def test_priority_keeps_every_row_when_k_exceeds_n_and_is_exact():
    A, B, keys = _tables(2)
    A = A.at[3].set(0.0)  # a zero row is never kept and costs nothing
    SA, SB = priority_sketch(A, N + 5, 0, keys), priority_sketch(B, N, 0, keys)
    assert SA.kept.sum() == N - 1 and np.isinf(float(SA.tau))
    assert_close(estimate_product(SA, SB), A.T @ B)


def test_priority_keeps_k_rows_when_the_kth_rank_ties_tau():
    # Two equal rows under one key have the same rank exactly: the k-th smallest equals tau.
    A = jnp.asarray([[1.0, 2.0], [1.0, 2.0], [0.5, 0.0]], jnp.float32)
    keys = jnp.asarray([5, 5, 9], jnp.int32)
    u = _uniforms(3, keys, jnp.float32)
    k = 1 if u[0] / 5 < u[2] / 0.25 else 2  # the tied pair at positions k - 1 and k
    SA = priority_sketch(A, k, 3, keys)
    assert int(SA.kept.sum()) == k


def test_join_on_keys_is_exact_with_all_rows_kept():
    A, B, keys = _tables(3)
    keys_b = jnp.concatenate([keys[10:], jnp.arange(10**6, 10**6 + 10, dtype=jnp.int32)])
    SA, SB = priority_sketch(A, N, 5, keys), priority_sketch(B, N, 5, keys_b)
    want = A[10:].T @ B[: N - 10]  # rows of A with keys[10:] meet rows 0..N-11 of B
    assert_close(estimate_product(SA, SB), want)


def test_sketch_does_not_depend_on_row_position():
    A, B, keys = _tables(4)
    perm = np.random.default_rng(0).permutation(N)
    for sketch in (priority_sketch, threshold_sketch):
        S1, S2 = sketch(A, K, 3, keys), sketch(A[perm], K, 3, keys[perm])
        assert set(np.asarray(S1.keys)[np.asarray(S1.kept)]) == set(
            np.asarray(S2.keys)[np.asarray(S2.kept)]
        )
        # Threshold tau = k / ||A||_F^2 differs only by the rounding of the sum's order.
        assert float(S1.tau) == pytest.approx(float(S2.tau), rel=1e-12)
        SB = sketch(B, K, 3, keys)
        assert_close(estimate_product(S2, SB), estimate_product(S1, SB))


def test_coordination_keeps_the_same_rows():
    A, _, keys = _tables(5)
    SA, SA2 = priority_sketch(A, K, 11, keys), priority_sketch(2 * A, K, 11, keys)
    assert np.array_equal(np.sort(SA.keys), np.sort(SA2.keys))  # same ranks up to a factor
    other = priority_sketch(A, K, 12, keys)
    assert not np.array_equal(np.sort(SA.keys), np.sort(other.keys))


def test_sparse_rows_give_the_same_sketches():
    A, B, keys = _tables(6, s=3)
    As = from_dense(A, 4)
    for sketch in (priority_sketch, jl_sketch, countsketch):  # threshold shares priority's path
        dense = estimate_product(sketch(A, K, 2, keys), sketch(B, K, 2, keys))
        sparse = estimate_product(sketch(As, K, 2, keys), sketch(B, K, 2, keys))
        assert_close(sparse, dense)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_linear_sketches_match_explicit_matrices(dtype):
    A, _, keys = _tables(7, dtype=dtype)
    g = np.asarray(sp.hashed_normals(sp.base_key(4, sp.JL), keys, K, dtype), np.float64)
    S = g.T / np.sqrt(K)  # [K, N]
    assert_close(jl_sketch(A, K, 4, keys).sketch, (S @ np.asarray(A, np.float64)).astype(dtype))
    bucket, sign = (
        np.asarray(a) for a in sp.hashed_buckets(sp.base_key(4, sp.COUNTSKETCH), keys, K)
    )
    C = np.zeros((K, N))
    C[bucket, np.arange(N)] = sign
    assert_close(countsketch(A, K, 4, keys).sketch, (C @ np.asarray(A, np.float64)).astype(dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_jl_paths_agree_for_sparse_and_full_rows(dtype):
    """Rows with `k s <= d` are scattered, fuller ones multiplied densely: both equal `S A`."""
    rng = np.random.default_rng(13)
    dim = 200
    idx = np.stack([rng.choice(dim, 3, replace=False) for _ in range(N)])
    vals = rng.normal(size=(N, 3))
    keys = jnp.arange(N, dtype=jnp.int32)
    dense = np.zeros((N, dim))
    np.put_along_axis(dense, idx, vals, axis=1)
    g = np.asarray(sp.hashed_normals(sp.base_key(1, sp.JL), keys, K, dtype), np.float64)
    want = (g.T / np.sqrt(K)) @ dense
    sparse_rows = sp.sparse_vectors(jnp.asarray(idx), jnp.asarray(vals, dtype), dim)
    assert dim >= K * 3  # the scatter path
    assert_close(jl_sketch(sparse_rows, K, 1, keys).sketch, want.astype(dtype))
    assert_close(jl_sketch(jnp.asarray(dense, dtype), K, 1, keys).sketch, want.astype(dtype))


def _mean_error(estimator, A, B, trials):
    """`||mean of trials - A^T B||_F` over seeds 0..trials-1."""
    return _errors(estimator, A, B, trials)[0]


def _errors(estimator, A, B, trials):
    """`(||mean W - A^T B||_F, E||W - A^T B||_F^2 / (||A||^2 ||B||^2), its standard error)`."""
    W = jax.vmap(estimator)(jnp.arange(trials))
    scale2 = float(jnp.sum(A**2) * jnp.sum(B**2))
    err2 = np.asarray(jnp.sum((W - A.T @ B) ** 2, axis=(1, 2))) / scale2
    return float(jnp.linalg.norm(W.mean(0) - A.T @ B)), err2.mean(), err2.std() / np.sqrt(trials)


def test_all_estimators_are_unbiased_within_the_variance_bound():
    A, B, keys = _tables(8)
    trials = 400
    scale = float(jnp.linalg.norm(A) * jnp.linalg.norm(B))
    # E||mean - A^T B||^2 <= 2/(K-1) scale^2 / trials: allow 3 standard deviations of that.
    allowed = 3 * scale * np.sqrt(2 / (K - 1) / trials)
    bounds = {priority_sketch: 2 / (K - 1), threshold_sketch: 2 / K, jl_sketch: 2 / K}
    bounds[countsketch] = 2 / K
    for sketch, bound in bounds.items():

        def est(seed, sketch=sketch):
            return estimate_product(sketch(A, K, seed, keys), sketch(B, K, seed, keys))

        bias, mse, se = _errors(est, A, B, trials)
        assert bias < allowed, sketch.__name__
        assert mse - 3 * se <= bound, sketch.__name__

    # Independent seeds are unbiased too.
    def indep(seed):
        return estimate_product(
            priority_sketch(A, K, seed, keys), priority_sketch(B, K, seed + 10**5, keys)
        )

    assert _mean_error(indep, A, B, trials) < 3 * allowed

    # The check has power: coordinated sketches weighted as if independent are biased.
    def wrong(seed):
        SA, SB = threshold_sketch(A, K, seed, keys), threshold_sketch(B, K, seed, keys)
        return estimate_product(SA, SB.replace(seed=SB.seed + 1))

    assert _mean_error(wrong, A, B, trials) > allowed


def test_storage_counts_values_indices_and_keys():
    A, _, keys = _tables(9, s=3)
    SA = priority_sketch(from_dense(A, 3), K, 0, keys)
    assert int(storage(SA)) == K * (2 * 3 + 1) + 1
    dense = priority_sketch(jnp.ones((N, D)), K, 0, keys)
    assert int(storage(dense)) == K * (D + 1) + 1  # dense rows need no indices
    assert int(storage(jl_sketch(A, K, 0, keys))) == K * D
    assert int(storage(countsketch(A, K, 0, keys))) == K * D


def test_threshold_capacity_reports_truncation():
    A, _, keys = _tables(10)
    full = threshold_sketch(A, K, 1, keys)
    kept = int(full.kept.sum())
    small = threshold_sketch(A, K, 1, keys, capacity=max(kept - 1, 1))
    assert bool(small.truncated) and not bool(full.truncated)


def test_estimates_are_differentiable_in_the_values():
    A, B, keys = _tables(12)
    for sketch in (priority_sketch, jl_sketch):

        def loss(A, sketch=sketch):
            return jnp.sum(estimate_product(sketch(A, K, 0, keys), sketch(B, K, 0, keys)) ** 2)

        g = jax.grad(loss)(A)
        assert g.shape == A.shape and bool(jnp.all(jnp.isfinite(g)))
        assert float(jnp.linalg.norm(g)) > 0
    # JL is linear in A: the gradient is exact against a finite difference.
    direction = jnp.asarray(np.random.default_rng(0).normal(size=A.shape))
    h = 1e-6
    fd = (loss(A + h * direction, jl_sketch) - loss(A - h * direction, jl_sketch)) / (2 * h)
    np.testing.assert_allclose(jnp.vdot(jax.grad(loss)(A, jl_sketch), direction), fd, rtol=1e-6)


def test_bad_input_raises():
    A, B, keys = _tables(11)
    with pytest.raises(ValueError, match="k must be a positive int"):
        priority_sketch(A, 0, 0)
    with pytest.raises(ValueError, match=r"keys must have shape \[n\]"):
        priority_sketch(A, K, 0, keys[:3])
    with pytest.raises(ValueError, match="keys must be an integer"):
        threshold_sketch(A, K, 0, keys.astype(float))
    with pytest.raises(ValueError, match="seed must be an integer scalar"):
        jl_sketch(A, K, 1.5)
    with pytest.raises(ValueError, match="A must hold rows"):
        countsketch(A[None], K, 0)
    with pytest.raises(ValueError, match="A must be a floating"):
        priority_sketch(A.astype(int), K, 0)
    with pytest.raises(ValueError, match="SA and SB must both be"):
        estimate_product(priority_sketch(A, K, 0), jl_sketch(B, K, 0))
    with pytest.raises(ValueError, match="one kind and size"):
        estimate_product(jl_sketch(A, K, 0), countsketch(B, K, 0))
    with pytest.raises(ValueError, match="must share the seed"):
        estimate_product(jl_sketch(A, K, 0), jl_sketch(B, K, 1))


@given(seed=st.integers(0, 2**20), overlap=st.integers(0, N))
def test_mixed_sketches_on_a_partial_join_match_the_reference(seed, overlap):
    """A priority sketch of A and a threshold sketch of B from one seed: only keys in both tables
    contribute, with the coordinated weights of the reference."""
    k = 5
    A, B, keys = _tables(seed % 5)
    keys_b = jnp.concatenate([keys[:overlap], keys[overlap:] + 2 * 10**6])
    SA, SB = priority_sketch(A, k, seed, keys), threshold_sketch(B, k, seed, keys_b)
    W = np.asarray(estimate_product(SA, SB))
    ref_a = _reference_sample(A, keys, seed, k, "priority")
    ref_b = _reference_sample(B, keys_b, seed, k, "threshold")
    if not set(ref_a[0]) & set(ref_b[0]):
        assert np.all(W == 0)
        return
    assert set(ref_a[0]) & set(ref_b[0]) <= set(np.asarray(keys[:overlap]).tolist())
    assert_close(W, _reference_estimate(ref_a, ref_b, coordinated=True))


def test_large_tables_take_the_fast_selections_and_match_the_reference():
    """n = 2000 rows, k = 8: priority sampling selects among the ranks below 2(k+1)/||A||_F^2
    (then a small top_k), threshold sampling with 4k slots compacts the qualifying rows; with a
    heavy row the candidates are too few and priority falls back to the full top_k. Every case
    keeps exactly the reference's rows with its tau."""
    rng = np.random.default_rng(14)
    n, k = 2000, 8
    A = rng.normal(size=(n, 3))
    heavy = A.copy()
    heavy[7] *= 1e3  # one row holds most of ||A||_F^2: few ranks lie below the bound
    keys = jnp.asarray(rng.choice(10**6, n, replace=False), jnp.int32)
    for table in (A, heavy):
        table = jnp.asarray(table)
        for method, sketch in (
            ("priority", priority_sketch(table, k, 3, keys)),
            ("threshold", threshold_sketch(table, k, 3, keys, capacity=4 * k)),
        ):
            kept, tau = _reference_sample(table, keys, 3, k, method)
            got = {int(key) for key, on in zip(sketch.keys, sketch.kept, strict=True) if on}
            assert got == set(kept), method
            assert float(sketch.tau) == pytest.approx(tau, rel=1e-12)
            assert not bool(sketch.truncated)


def test_compaction_finds_every_true_entry():
    from seqlab.sketching.products import _compact

    rng = np.random.default_rng(15)
    n = 4097  # not a multiple of the 32 columns
    compact = jax.jit(_compact, static_argnums=1)
    for p in (0.0, 0.001, 0.01, 0.5, 1.0):
        mask = rng.random(n) < p
        order, count = (np.asarray(a) for a in compact(jnp.asarray(mask), n))
        assert int(count) == mask.sum()
        assert sorted(order[: int(count)].tolist()) == np.flatnonzero(mask).tolist()
        assert np.all(order[int(count) :] == 0)


def test_dense_rows_match_sparse_rows_on_every_path():
    """Blocked CountSketch of dense `[n, d]` rows against the explicit matrix: 300 x 2000 rows
    exceed BLOCK_ENTRIES, two blocks, the last shifted back over the first (whose rows it must
    not add twice)."""
    from seqlab.sketching import sparse

    rng = np.random.default_rng(16)
    n, d, s = 300, 2000, 3
    assert sparse.block_rows(n, d) < n
    A = np.zeros((n, d))
    for row in A:
        row[rng.choice(d, s, replace=False)] = rng.normal(size=s)
    dense = jnp.asarray(A)
    keys = jnp.asarray(rng.choice(10**6, n, replace=False), jnp.int32)
    key = sp.base_key(5, sp.COUNTSKETCH)
    bucket, sign = (np.asarray(a) for a in sp.hashed_buckets(key, keys, K))
    C = np.zeros((K, n))
    C[bucket, np.arange(n)] = sign
    assert_close(countsketch(dense, K, 5, keys).sketch, C @ A)


@pytest.mark.slow  # ~2.5 s CPU of compilation
def test_dense_sketches_need_no_n_d_temporaries():
    """Compiled temporaries of the four sketches of a dense `[4096, 2048]` float32 table (one
    executable) stay below a tenth of the table (they were `n d` int32 indices, and `n d` squares
    for threshold)."""
    n, d = 4096, 2048

    def build(a):
        return (
            priority_sketch(a, K, 0),
            threshold_sketch(a, K, 0, capacity=4 * K),
            jl_sketch(a, K, 0),
            countsketch(a, K, 0),
        )

    table = jax.ShapeDtypeStruct((n, d), jnp.float32)
    temp = jax.jit(build).lower(table).compile().memory_analysis().temp_size_in_bytes
    assert temp < n * d * 4 / 10, temp


def test_bad_sizes_and_ranks_name_the_argument():
    A, _, keys = _tables(17)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        threshold_sketch(A, K, 0, keys, capacity=-1)
    with pytest.raises(ValueError, match="k must be a positive int"):
        jl_sketch(A, -3, 0)
    with pytest.raises(ValueError, match="A must hold at least one row"):
        priority_sketch(A[:0], K, 0)
    with pytest.raises(ValueError, match=r"A must hold rows \[n, d\]"):
        threshold_sketch(A[0], K, 0)
    bad = sp.SparseVectors(jnp.zeros((N, 2), jnp.int32), jnp.ones((N, 3)), D)
    with pytest.raises(ValueError, match=r"A.indices and A.values must have the same shape"):
        priority_sketch(bad, K, 0)
