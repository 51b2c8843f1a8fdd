"""Target dimensions with explicit constants, as functions of sparsity `s`, data size `|X|`, `eps`.

Each function states the event it guarantees and the union or tail bound behind its constant:

* `birthday_dimension(s, failure)`: the birthday map is injective on the support of a fixed
  `s`-sparse vector except with probability `<= C(s, 2) / m` (union bound over pairs), so
  `m = ceil(s (s - 1) / (2 failure))` preserves every `l_p` norm of that vector exactly with
  probability `>= 1 - failure`: in expectation a `1 - failure` fraction of any data set.
* `max_embedding_dimension(s, n, eps, delta)`: `m = ceil(4 s / eps)` buckets make a coordinate of
  `supp(x) U supp(y)` (at most `2s` coordinates) share its bucket with probability `q < 2s / m <=
  eps / 2` per repetition. Over `T` independent repetitions the number of failures exceeds
  `eps T` with probability `<= exp(-eps T / 6)` (Chernoff, mean `<= eps T / 2`), and a union over
  the `n (n - 1) / 2` pairs and `2s` coordinates gives `T = ceil(6 ln(n (n - 1) s / delta) / eps)`.
  Then for every pair and every `p >= 1`: `(1 - eps) ||x - y||_p <= T^{-1/p} ||f(x) - f(y)||_p <=
  ||x - y||_p` (each coordinate counted in full in `>= (1 - eps) T` repetitions, and
  `(1 - eps)^{1/p} >= 1 - eps`); also `l_inf` exactly. Dimension `m T = O(s log(n s) / eps^2)`.
* `linf_dimension(s, n, delta)`: `m = 4 s` isolates the coordinate of the largest `|x_i - y_i|`
  with probability `> 1/2` per repetition; `T = ceil(log2(n (n - 1) / (2 delta)))` repetitions make
  every pair's `l_inf` distance exact with probability `>= 1 - delta`. `m T = O(s log n)`.
* `product_sketch_rows(eps, delta, method)`: rows `k` such that `||W - A^T B||_F <= eps ||A||_F
  ||B||_F` with probability `>= 1 - delta`, by Markov on the second moment `E||W - A^T B||_F^2 <=
  c ||A||_F^2 ||B||_F^2` with `c = 2 / (k - 1)` (priority) or `2 / k` (threshold, jl,
  countsketch).
"""

import math

from seqlab.ops.checks import check_choice, check_positive_int

METHODS = ("priority", "threshold", "jl", "countsketch")


def _check_unit(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and 0 < value < 1):
        raise ValueError(f"{name} must be a number in (0, 1), got {value!r}")


def _check_points(n_points: int) -> None:
    check_positive_int("n_points", n_points)
    if n_points < 2:
        raise ValueError(f"n_points must be >= 2 (a data set with a pair), got {n_points}")


def birthday_dimension(s: int, failure: float = 0.01) -> int:
    """`m` such that an `s`-sparse vector's norms all survive the birthday map exactly with
    probability `>= 1 - failure`: `ceil(s (s - 1) / (2 failure))`, at least 1."""
    check_positive_int("s", s)
    _check_unit("failure", failure)
    return max(1, math.ceil(s * (s - 1) / (2 * failure)))


def collision_bound(s: int, m: int) -> float:
    """Upper bound `min(1, s (s - 1) / (2 m))` on the probability that a hash into `m` buckets is
    not injective on `s` fixed coordinates."""
    check_positive_int("s", s)
    check_positive_int("m", m)
    return min(1.0, s * (s - 1) / (2 * m))


def max_embedding_dimension(
    s: int, n_points: int, eps: float, delta: float = 0.01
) -> tuple[int, int]:
    """`(m, repetitions)` of the max map keeping all pairwise `l_p` distances of `n_points`
    non-negative `s`-sparse vectors in `[1 - eps, 1]` times the truth, for all `p >= 1` at once,
    with probability `>= 1 - delta` (module docstring)."""
    check_positive_int("s", s)
    _check_points(n_points)
    _check_unit("eps", eps)
    _check_unit("delta", delta)
    m = math.ceil(4 * s / eps)
    reps = math.ceil(6 * math.log(n_points * (n_points - 1) * s / delta) / eps)
    return m, reps


def linf_dimension(s: int, n_points: int, delta: float = 0.01) -> tuple[int, int]:
    """`(m, repetitions)` of the max map keeping every pairwise `l_inf` distance of `n_points`
    non-negative `s`-sparse vectors exactly, with probability `>= 1 - delta`."""
    check_positive_int("s", s)
    _check_points(n_points)
    _check_unit("delta", delta)
    return 4 * s, max(1, math.ceil(math.log2(n_points * (n_points - 1) / (2 * delta))))


def product_sketch_rows(eps: float, delta: float, method: str) -> int:
    """Rows `k` giving Frobenius error `<= eps ||A||_F ||B||_F` with probability `>= 1 - delta`
    (module docstring); `method` one of `METHODS`."""
    _check_unit("eps", eps)
    _check_unit("delta", delta)
    check_choice("method", method, METHODS)
    k = math.ceil(2 / (delta * eps**2))
    return k + 1 if method == "priority" else k
