"""The delta rule with decay, shared by `gated_delta_rule`, `kda` and `gdn2`.

Per value head, a state `S: [K, V]` decays, takes a write and is read:

    S_t = Diag(exp(g_t)) S_{t-1}                  g_t: a scalar per head, or [K] per key channel
    S_t = S_t + k_t (w_t * v_t - S_t^T e_t)^T     e_t: the erase key [K]; w_t: the write gate
    o_t = S_t^T q_t                               (q pre-scaled)

An op supplies its write rule `(k_t, *gates_t) -> (e_t, w_t)`: the gated delta rule and KDA erase
with `e = beta k` and write with `w = beta`; Gated DeltaNet-2 with `e = b * k` (a gate per key
channel) and `w` per value channel.

`chunked_form` is the WY / UT form. In a chunk of C tokens with chunk-local cumulative log-gate
`gamma` (restarting at every segment start) and, for tokens `i >= j` of one segment,
`Gamma_ij = Diag(exp(gamma_i - gamma_j))`:

    A     = (I + strict_lower([e_i^T Gamma_ij k_j]_ij))^{-1}
    u     = A (w * v),    W = A (exp(gamma) * e)
    v_new = u - W S,      o = (q exp(gamma)) S + [q_i^T Gamma_ij k_j]_ij v_new
    S'    = Diag(exp(gamma_C)) S + (k exp(gamma_C - gamma))^T v_new

With a scalar gate `Gamma_ij` is a number and the pair products `a_i^T Gamma_ij b_j` are one
masked matmul. With a gate per key channel they are `sum_c a_ic b_jc exp(gamma_ic - gamma_jc)`,
which cannot be split into `exp(gamma_i) exp(-gamma_j)`: the second factor overflows once a
chunk's cumulative log-gate passes ~-88 (float32). `channel_pairs` uses sub-chunks of 16 tokens
(as flash-linear-attention does): across sub-chunks, through the first token `r` of the later
sub-chunk, `exp(gamma_i - gamma_r) exp(gamma_r - gamma_j)` with both exponents <= 0; inside a
sub-chunk, every `exp(gamma_i - gamma_j)` explicitly. No exponent is ever positive, so the form
stays finite (forward and gradients) for cumulative log-gates down to any value.

Shapes: `q, k, e: [B, T, HV, K]`, `v: [B, T, HV, V]`, `g: [B, T, HV]` or `[B, T, HV, K]`,
`w: [B, T, HV, 1]` or `[B, T, HV, V]`, states `[B, HV, K, V]`; chunked `[B, N, C, ...]`.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from seqlab.ops import _chunked

einsum = _chunked.einsum

# Tokens per sub-chunk of the per-channel pair products (the largest divisor of the chunk up to it).
SUB_CHUNK = 16
# Rows per diagonal block of the blocked triangular solve (`solve_unit_lower`).
SOLVE_BLOCK = 16


def beta_write(k, beta):
    """The write rule of the gated delta rule and KDA: `e = beta k`, `w = beta`."""
    return beta[..., None] * k, beta[..., None]


def token_step(write_rule, state, xs):
    """One token: `state: [B, HV, K, V]`; `xs = (q_t, k_t, v_t, g_t, *gates_t)` with q_t
    (pre-scaled), k_t `[B, HV, K]`, v_t `[B, HV, V]`, g_t `[B, HV]` or `[B, HV, K]`."""
    q_t, k_t, v_t, g_t, *gates_t = xs
    e_t, w_t = write_rule(k_t, *gates_t)
    state = _chunked.decay_state(jnp.exp(g_t), state)
    u_t = w_t * v_t - einsum("bhkv,bhk->bhv", state, e_t)
    state = state + k_t[..., :, None] * u_t[..., None, :]
    return state, einsum("bhkv,bhk->bhv", state, q_t)


class Decays(NamedTuple):
    """Masked decays of one chunk layout, broadcastable against heads-major `[B, N, HV, C, K]`
    keys (`_chunked.heads_major`).

    to_token: `[B, N, HV, C, 1 | K]`, `exp(gamma_i)` for tokens in the incoming state's segment.
    to_end: `[B, N, HV, C, 1 | K]`, `exp(gamma_C - gamma_j)` for tokens in the chunk's last segment.
    state_to_end: `[B, N, HV]` or `[B, N, HV, K]`, `exp(gamma_C)` if the incoming segment spans it.
    pairs: `(lefts, b) -> [[B, N, HV, C, C] per a in lefts]` for heads-major `b` and lefts,
      `a_i^T Gamma_ij b_j` for `i >= j` in one segment, else 0 (lefts share the work on `b`).
    """

    to_token: jax.Array
    to_end: jax.Array
    state_to_end: jax.Array
    pairs: object


def scalar_decays(g: jax.Array, seg: jax.Array, incoming: jax.Array) -> Decays:
    """`Decays` of a gate per head, `g: [B, N, C, HV]`, `seg: [B, N, C]`, `incoming: [B, N, 1]`
    (`_chunked.incoming_segment`)."""
    d = _chunked.chunk_decays(g, seg, incoming)

    def pairs(lefts, b):
        return [einsum("bnhik,bnhjk->bnhij", a, b) * d.intra for a in lefts]

    to_token, to_end = (
        _chunked.heads_major(x)[..., None] for x in (d.state_to_token, d.token_to_end)
    )
    return Decays(to_token, to_end, d.state_to_end, pairs)


def channel_decays(g: jax.Array, seg: jax.Array, incoming: jax.Array) -> Decays:
    """`Decays` of a gate per key channel, `g: [B, N, C, HV, K]`, `seg: [B, N, C]`, `incoming:
    [B, N, 1]` (`_chunked.incoming_segment`)."""
    c = g.shape[2]
    in_carry, in_last = seg == incoming, seg == seg[:, :, -1:]  # [B, N, C]
    same = (seg[:, :, :, None] == seg[:, :, None, :]) & jnp.tril(jnp.ones((c, c), bool))
    # Cumulative log-gate restarting at segment starts (a masked matmul, as `chunk_decays`).
    gamma = einsum("bnij,bnjhk->bnihk", same.astype(g.dtype), g)  # [B, N, C, HV, K]
    to_token = _masked_exp(in_carry[..., None, None], gamma)
    to_end = _masked_exp(in_last[..., None, None], gamma[:, :, -1:] - gamma)
    state_to_end = _masked_exp(in_carry[:, :, -1, None, None], gamma[:, :, -1])
    token_major_pairs = channel_pairs(gamma, seg, same)

    def pairs(lefts, b):
        token_major = _chunked.token_major
        return token_major_pairs([token_major(a) for a in lefts], token_major(b))

    to_token, to_end = (_chunked.heads_major(x) for x in (to_token, to_end))
    return Decays(to_token, to_end, state_to_end, pairs)


def channel_pairs(gamma: jax.Array, seg: jax.Array, same: jax.Array):
    """`(lefts, b) -> [sum_c a_ic b_jc exp(gamma_ic - gamma_jc) for a in lefts]`, each masked to
    `same: [B, N, C, C]`, by sub-chunks of `s` tokens (module docstring). `gamma: [B, N, C, HV,
    K]`; `seg: [B, N, C]`; `b` and every `a`: `[B, N, C, HV, K]`.

    Across sub-chunks, one batched matmul through the reference tokens. Inside a sub-chunk, one
    diagonal offset `p = i - j` at a time: `b` and `gamma` shifted down by p rows, an exact
    `exp(gamma_i - gamma_{i - p})` per channel and a sum over channels, placed on the p-th
    subdiagonal of the sub-chunk's block: per row a batched matrix-vector product with the
    `[s, K]` shifted and decayed rows of `b` (on CPU several times faster than one contraction
    over `[s, s, K]` blocks, or than elementwise sums).
    """
    b_, n, c, hv = gamma.shape[:4]
    s = math.gcd(c, SUB_CHUNK)
    m = c // s

    def blocks(x):  # [B, N, C, ...] -> [B, N, M, S, ...]
        return x.reshape(b_, n, m, s, *x.shape[3:])

    def shifted(x, p):  # row i holds row i - p of x (zeros for i < p)
        return jnp.pad(x, [(0, 0), (0, 0), (p, 0)] + [(0, 0)] * (x.ndim - 3))[:, :, :c]

    idx = jnp.arange(c)
    ref = (idx // s) * s  # reference token r of each token's sub-chunk
    # Across sub-chunks: token i of sub-chunk I (r = I s) and token j < r of the same segment.
    same_as_ref = seg == seg[:, :, ref]  # [B, N, C]: token i shares its reference's segment
    from_ref = _masked_exp(same_as_ref[..., None, None], gamma - gamma[:, :, ref])  # [B,N,C,HV,K]
    refs = blocks(gamma[:, :, ref])[:, :, :, 0]  # [B, N, M, HV, K]: gamma_r of each sub-chunk
    before = (idx[None, :] < (jnp.arange(m) * s)[:, None])[None, None]  # [1, 1, M, C]: j < r
    before = before & (seg[:, :, None, :] == blocks(seg)[:, :, :, :1])  # and seg_j == seg_r
    to_ref = _masked_exp(before[..., None, None], refs[:, :, :, None] - gamma[:, :, None])
    # Inside a sub-chunk, offset p: rows i with i mod s >= p whose token i - p is in i's segment.
    offsets = []
    for p in range(s):
        valid = ((idx % s) >= p)[None, None] & (seg == shifted(seg, p))  # [B, N, C]
        offsets.append(_masked_exp(valid[..., None, None], gamma - shifted(gamma, p)))
    # place[p, i, j] = 1 where j = i - p inside one sub-chunk.
    place = (idx[None, :, None] - idx[None, None, :] == jnp.arange(s)[:, None, None]) & (
        (idx[:, None] // s) == (idx[None, :] // s)
    )
    place = place.astype(gamma.dtype)

    def pairs(lefts, b):
        right = b[:, :, None] * to_ref  # [B, N, M, C, HV, K]
        rights = jnp.stack([shifted(b, p) * decay for p, decay in enumerate(offsets)], axis=-2)
        out = []
        for a in lefts:
            across = einsum("bnmihk,bnmjhk->bnhmij", blocks(a * from_ref), right)
            inside = einsum("bnihk,bnihpk->bnihp", a, rights)  # [B, N, C, HV, S]
            out.append(across.reshape(b_, n, hv, c, c) + einsum("bnihp,pij->bnhij", inside, place))
        return out

    return pairs


def _masked_exp(mask: jax.Array, x: jax.Array) -> jax.Array:
    """`exp(x)` where `mask`, else 0; `x` is masked before `exp`, so a masked-out positive
    exponent can neither overflow nor poison the gradient with `0 * inf`."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


class Intra(NamedTuple):
    """The chunk-parallel part of the chunked form: what the state pass and the outputs need,
    heads-major (`_chunked.heads_major`).

    u: `[B, N, HV, C, V]`; w: `[B, N, HV, C, K]` (`v_new = u - w S`); k_end: `[B, N, HV, C, K]`,
    keys decayed to the chunk end; q_in: `[B, N, HV, C, K]`, queries decayed from the chunk
    start; scores: `[B, N, HV, C, C]`, `q_i^T Gamma_ij k_j`; state_to_end: `[B, N, HV (, K)]`.
    """

    u: jax.Array
    w: jax.Array
    k_end: jax.Array
    q_in: jax.Array
    scores: jax.Array
    state_to_end: jax.Array


def intra_chunk(write_rule, q, k, v, g, seg, incoming, *gates) -> Intra:
    """`Intra` of chunked inputs `[B, N, C, ...]` (module docstring); `incoming: [B, N, 1]`, the
    segment of the state entering each chunk, is an input because `map_chunks` passes the chunks
    one at a time (a chunk alone cannot tell whether a segment starts at its first token)."""
    decays = (scalar_decays if g.ndim == 4 else channel_decays)(g, seg, incoming)
    # Heads-major from here on: every product over a chunk's tokens is a batched matmul.
    q, k, v, *gates = (_chunked.heads_major(x) for x in (q, k, v, *gates))
    e, w = write_rule(k, *gates)
    erase_k, scores = decays.pairs((e, q), k)  # [B, N, HV, C, C], masked to one segment
    # u = A (w v), W = A (exp(gamma) e), A = (I + strict_lower(erase_k))^{-1}: one solve.
    rhs = jnp.concatenate([w * v, decays.to_token * e], axis=-1)  # [B, N, HV, C, V + K]
    uw = solve_unit_lower(erase_k, rhs)
    dv = v.shape[-1]
    return Intra(
        uw[..., :dv], uw[..., dv:], k * decays.to_end, q * decays.to_token, scores,
        decays.state_to_end,
    )  # fmt: skip


def solve_unit_lower(a: jax.Array, rhs: jax.Array) -> jax.Array:
    """`X = (I + L)^{-1} rhs` with `L` the strictly lower part of `a: [..., C, C]`, `rhs:
    [..., C, R]`; any C (padded to a multiple of the block inside).

    Blocked forward substitution, backward stable (no explicit inverse of `I + L`): the diagonal
    `s x s` blocks `D_m` of `I + L` (s = `SOLVE_BLOCK`) are inverted by column-oriented forward
    substitution, all at once; then, block row by block row,

        X_m = D_m^{-1} (rhs_m - L_{m,<m} X_{<m}),

    a few batched matmuls (on CPU far cheaper than `lax.linalg.triangular_solve`, which runs
    LAPACK per matrix). The derivative is the solve's own (`jax.custom_jvp`):
    `dX = (I + L)^{-1} (d rhs - strict_lower(dA) X)`, linear in the tangent, so reverse mode
    transposes it into the backward substitution with `(I + L)^T`.
    """
    c = a.shape[-1]
    s = min(SOLVE_BLOCK, c)
    pad = -c % s  # zero rows and columns: identity rows of I + L, zero rows of X
    if pad:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, pad), (0, pad)])
        rhs = jnp.pad(rhs, [(0, 0)] * (rhs.ndim - 2) + [(0, pad), (0, 0)])
    return _solve_blocked(a, rhs)[..., :c, :]


@jax.custom_jvp
def _solve_blocked(a, rhs):
    """`solve_unit_lower` for C a multiple of the block."""
    return _substitute(_diagonal_inverses(a), a, rhs)


@_solve_blocked.defjvp
def _solve_blocked_jvp(primals, tangents):
    a, rhs = primals
    da, drhs = tangents
    inverses = _diagonal_inverses(a)
    x = _substitute(inverses, a, rhs)
    dx = _substitute(inverses, a, drhs - einsum("...ij,...jd->...id", jnp.tril(da, -1), x))
    return x, dx


def _diagonal_inverses(a: jax.Array) -> jax.Array:
    """`[..., M, s, s]`: the inverses of the diagonal blocks of `I + strict_lower(a)`.

    Column-oriented forward substitution: `D = E_0 E_1 ... E_{s-2}` with `E_j = I + l_j e_j^T`
    (`l_j` the j-th column of the block's strictly lower part), so `D^{-1} = E_{s-2}^{-1} ...
    E_0^{-1}` and `E_j^{-1} X = X - l_j (e_j^T X)`: s - 1 rank-one updates of `[s, s]` blocks."""
    s = min(SOLVE_BLOCK, a.shape[-1])
    m = a.shape[-1] // s
    blocks = jnp.stack([a[..., i * s : (i + 1) * s, i * s : (i + 1) * s] for i in range(m)], -3)
    blocks = jnp.where(jnp.tri(s, k=-1, dtype=bool), blocks, 0.0)
    x = jnp.broadcast_to(jnp.eye(s, dtype=a.dtype), blocks.shape)
    for j in range(s - 1):
        x = x - blocks[..., :, j, None] * x[..., None, j, :]
    return x


def _substitute(inverses: jax.Array, a: jax.Array, rhs: jax.Array) -> jax.Array:
    """Block forward substitution `X_m = D_m^{-1} (rhs_m - L_{m,<m} X_{<m})` (linear in `rhs`);
    `inverses: [..., M, s, s]` from `_diagonal_inverses(a)`."""
    m, s = inverses.shape[-3], inverses.shape[-1]
    rows = []
    for i in range(m):
        r = rhs[..., i * s : (i + 1) * s, :]
        if i:
            done = jnp.concatenate(rows, axis=-2)
            r = r - einsum("...ij,...jd->...id", a[..., i * s : (i + 1) * s, : i * s], done)
        rows.append(einsum("...ij,...jd->...id", inverses[..., i, :, :], r))
    return jnp.concatenate(rows, axis=-2)


def map_chunks(f, *xs):
    """`f` of chunked arrays `[B, N, C, ...]`, one chunk at a time (`lax.map`), recomputed in the
    backward pass (`jax.checkpoint`): the transients of a chunk (per-channel decays are
    `[C, 16, K]` per chunk and head) then live for one chunk, not for all, and only `f`'s
    inputs are saved for the gradient."""
    one_at_a_time = [jnp.moveaxis(x, 1, 0)[:, :, None] for x in xs]  # [N, B, 1, C, ...]
    out = jax.lax.map(lambda x: jax.checkpoint(f)(*x), one_at_a_time)
    return jax.tree.map(lambda y: jnp.moveaxis(y[:, :, 0], 0, 1), out)


def chunked_form(write_rule, chunk_size, scan, q, k, v, g, *rest, state_every=None):
    """The WY chunked form (module docstring) as `_chunked.run` calls it: `rest = (*gates, state,
    seg)`, inputs in the accumulation dtype, q pre-scaled.

    Everything but the state passing is chunk-parallel; `scan` passes the state (the contract of
    `_chunked.scan_chunk_states`: a `lax.scan` for `"chunked"`, the GPU kernel for the gated
    delta rule's `"pallas_gpu"`). With per-channel gates the chunk-parallel part runs chunk by
    chunk (`map_chunks`), so that the backward pass's memory grows like `T (K + V + C)`.

    Returns `(o, final)`, and with `state_every = N` (a multiple of `chunk_size`) also the states
    after tokens `N, 2N, ...`, `[B, T // N, HV, K, V]`, read off the chunk boundaries."""
    *gates, state, seg = rest
    t = q.shape[1]
    q, k, v, g, *gates = (_chunked.pad_and_chunk(x, chunk_size) for x in (q, k, v, g, *gates))
    seg = _chunked.pad_and_chunk(seg, chunk_size, edge=True)
    incoming = _chunked.incoming_segment(seg)
    intra = functools.partial(intra_chunk, write_rule)
    if g.ndim == 4:  # a gate per head: all chunks at once
        parts = intra(q, k, v, g, seg, incoming, *gates)
    else:
        parts = map_chunks(intra, q, k, v, g, seg, incoming, *gates)
    # The scan's contract is token-major; the default scan cancels these transposes.
    token_major = (_chunked.token_major(x) for x in (parts.k_end, parts.u, parts.w))
    final, states, v_new = scan(state, *token_major, parts.state_to_end)
    o = einsum("bnhck,bnhkv->bnhcv", parts.q_in, states)
    o = o + einsum("bnhij,bnhjv->bnhiv", parts.scores, _chunked.heads_major(v_new))
    o = _chunked.token_major(o)
    if state_every is None:
        return _chunked.unchunk(o, t), final
    states = _chunked.every_state(states, final, state_every // chunk_size, t // state_every)
    return _chunked.unchunk(o, t), final, states
