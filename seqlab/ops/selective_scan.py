r"""Mamba-1 selective scan: a diagonal, input-dependent linear recurrence per channel and state.

For every batch `b`, channel `d` and state `n` (time `t = 0..L-1`, `h_{-1} = initial_state`):

$$
\Delta_t = \operatorname{softplus}(\delta_t + \delta_{\mathrm{bias}})
\ \text{(if delta\_softplus, else } \delta_t + \delta_{\mathrm{bias}}), \qquad
h_t[n] = e^{\Delta_t A_{dn}}\, h_{t-1}[n] + \Delta_t\, B_t[n]\, u_t
$$

$$
y_t = \sum_n h_t[n]\, C_t[n] + D_d\, u_t,
\quad \text{then } y_t \leftarrow y_t \operatorname{silu}(z_t) \text{ when z is given.}
$$

Two implementations of the recurrence share the discretization and the output epilogue:

- `"sequential"`: `lax.scan` over tokens, the definition of correct; autodiff through the scan
  stores every state `[B, L, D, N]` for the backward pass.
- `"parallel"`: sequential over chunks of `_CHUNK` (16) tokens, an associative scan inside each
  chunk. A `jax.custom_vjp` saves only the state entering each chunk (`[L / _CHUNK, B, D, N]`); its
  backward is a reverse scan over chunks that recomputes the chunk's states and runs the adjoint
  recurrence `lambda_t = C_t dy_t + a_{t+1} lambda_{t+1}` with a reverse associative scan.

With `state_every = N` both also return the states after tokens `N, 2N, ...` (a prefix cache):
`"sequential"` keeps every N-th state of a scan over blocks of N tokens, `"parallel"` the chunk
boundaries of chunks of `gcd(N, _CHUNK)` tokens, differentiated by the same custom VJP.

States, decays and exponentials are computed in float32 (float64 for float64 inputs).
`impl=None` picks `"sequential"`: on CPU it was faster than `"parallel"` in every measured case
(parallel/sequential 1.3-3.1x, forward and forward+backward, L = 1024-16384, D=256, N=16; section
`selective_scan (CPU)` of benchmarks/RESULTS.md). `"parallel"` needs far less memory for the
backward pass (compiled temporaries 57 MiB against 442 MiB at L=4096). Accelerators are not
measured yet; the choice is the same there until they are.
"""

import functools
import math

import jax
import jax.numpy as jnp

from seqlab.ops._chunked import scan_blocks, scan_tokens
from seqlab.ops.checks import (
    accumulation_dtype,
    check_choice,
    check_floating,
    check_positive_int,
    check_shape,
)

IMPLS = ("sequential", "parallel")
"""The values of `selective_scan(impl=...)` besides None."""
# Tokens per chunk of the parallel path. On CPU (L=4096, D=256, N=16, batch 2) the forward time
# hardly depends on it and the backward was fastest at 8, then 16, then 64; 16 halves the saved
# states of 8. Not yet measured on accelerators, where longer chunks mean fewer serial steps.
_CHUNK = 16


def selective_scan(
    u: jax.Array,
    delta: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None = None,
    z: jax.Array | None = None,
    *,
    delta_bias: jax.Array | None = None,
    delta_softplus: bool = False,
    initial_state: jax.Array | None = None,
    return_final_state: bool = False,
    impl: str | None = None,
    state_every: int | None = None,
):
    """Mamba-1 selective scan (see the module docstring for the equations).

    Args:
      u: `[batch, L, D]` input.
      delta: `[batch, L, D]` step sizes (before `delta_bias` and softplus).
      A: `[D, N]` state matrix (real, usually negative).
      B: `[batch, L, N]` input projection.
      C: `[batch, L, N]` output projection.
      D: `[D]` skip connection, or None.
      z: `[batch, L, D]` gate, or None; the output is multiplied by `silu(z)`.
      delta_bias: `[D]`, added to `delta`, or None.
      delta_softplus: apply softplus to `delta (+ delta_bias)`.
      initial_state: `[batch, D, N]` state before the first token (zeros by default).
      return_final_state: also return the state after the last token.
      impl: None (auto, `"sequential"`), `"sequential"` or `"parallel"`.
      state_every: a positive int `M` to also return the states after every M tokens (a prefix
        cache: running the scan on tokens `[j M, L)` from `initial_state=states[:, j - 1]`
        gives the outputs and final state of the full run there). Any M for both impls
        (`"parallel"` then runs chunks of `gcd(M, 16)` tokens: M a multiple of 16 keeps its
        speed).

    Returns:
      `y: [batch, L, D]` in `u.dtype`; with `return_final_state`, `(y, h_L: [batch, D, N])` with
      `h_L` in float32 (float64 for float64 inputs). With `state_every = M`, `states:
      [batch, L // M, D, N]` (the dtype of `h_L`), the states after tokens `M, 2M, ...`, is
      appended: `(y, states)`, or `(y, h_L, states)` with `return_final_state`.
    """
    impl = "sequential" if impl is None else impl
    check_choice("impl", impl, IMPLS)
    if state_every is not None:
        check_positive_int("state_every", state_every)
    _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state)
    batch, _, dim = u.shape
    acc = accumulation_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)

    dt = delta.astype(acc)
    if delta_bias is not None:
        dt = dt + delta_bias.astype(acc)
    if delta_softplus:
        dt = jax.nn.softplus(dt)
    h0 = (
        jnp.zeros((batch, dim, A.shape[1]), acc)
        if initial_state is None
        else initial_state.astype(acc)
    )
    uf = u.astype(acc)
    args = (uf, dt, A.astype(acc), B.astype(acc), C.astype(acc), h0)
    if impl == "sequential":
        y, h_last, *states = _scan_sequential(*args, state_every=state_every)
    else:
        y, h_last, *states = _scan_parallel(*args, state_every=state_every)

    if D is not None:
        y = y + D.astype(acc) * uf
    if z is not None:
        y = y * jax.nn.silu(z.astype(acc))
    y = y.astype(u.dtype)
    if state_every is None:
        return (y, h_last) if return_final_state else y
    return (y, h_last, *states) if return_final_state else (y, *states)


def _check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state) -> None:
    """Validate ranks, sizes and dtypes; every error names the argument."""
    named = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)
    named["initial_state"] = initial_state
    for name, x in named.items():
        if x is not None:
            check_floating(name, x)
    check_shape("u", u, (None, None, None), "[batch, L, D]")
    batch, length, dim = u.shape
    check_shape("delta", delta, (batch, length, dim), "[batch, L, D]")
    check_shape("A", A, (dim, None), "[D, N]")
    state = A.shape[1]
    check_shape("B", B, (batch, length, state), "[batch, L, N]")
    check_shape("C", C, (batch, length, state), "[batch, L, N]")
    if D is not None:
        check_shape("D", D, (dim,), "[D]")
    if z is not None:
        check_shape("z", z, (batch, length, dim), "[batch, L, D]")
    if delta_bias is not None:
        check_shape("delta_bias", delta_bias, (dim,), "[D]")
    if initial_state is not None:
        check_shape("initial_state", initial_state, (batch, dim, state), "[batch, D, N]")


def _scan_sequential(u, dt, A, B, C, h0, state_every=None):
    """Token-by-token reference.

    `u, dt: [b, L, D]`, `A: [D, N]`, `B, C: [b, L, N]`, `h0: [b, D, N]`. Returns
    `(y: [b, L, D], h_L: [b, D, N])` without the skip term and the gate, and with
    `state_every = M` also the states after tokens `M, 2M, ...`, `[b, L // M, D, N]` (a scan
    over blocks of M tokens keeps only those).
    """

    def step(h, inputs):
        u_t, dt_t, B_t, C_t = inputs  # [b, D], [b, D], [b, N], [b, N]
        h = jnp.exp(dt_t[:, :, None] * A) * h + (dt_t * u_t)[:, :, None] * B_t[:, None, :]
        return h, jnp.einsum("bdn,bn->bd", h, C_t)

    if state_every is None:
        h_last, y = scan_tokens(step, h0, (u, dt, B, C))
        return y, h_last
    h_last, y, states = scan_blocks(step, h0, (u, dt, B, C), state_every)
    return y, h_last, states


# ---------------------------------------------------------------------------------------------
# Parallel path: sequential over chunks, associative scan within a chunk, custom VJP.
# ---------------------------------------------------------------------------------------------


def _combine(earlier, later):
    """Compose two affine maps `h -> a h + x`: first `earlier`, then `later`."""
    a1, x1 = earlier
    a2, x2 = later
    return a1 * a2, a2 * x1 + x2


def _linear_scan(a, x, reverse=False):
    """The linear recurrence `h_t = a_t h_{t-1} + x_t` along axis 1, from `h_{-1} = 0`.

    With `reverse`, `h_t = a_t h_{t+1} + x_t` from the end. `a, x: [b, T, D, N]`; returns `h`.
    """
    return jax.lax.associative_scan(_combine, (a, x), axis=1, reverse=reverse)[1]


def _chunk_states(u, dt, A, B, h_in):
    """All states of one chunk. `u, dt: [b, T, D]`, `B: [b, T, N]`, `h_in: [b, D, N]`.

    Returns `(a, h)`, both `[b, T, D, N]`: the decays `a_t = exp(dt_t A)` and the states `h_t`.
    """
    a = jnp.exp(dt[..., None] * A)
    x = (dt * u)[..., None] * B[:, :, None, :]
    x = x.at[:, 0].add(a[:, 0] * h_in)  # fold the incoming state into the first token
    return a, _linear_scan(a, x)


def _scan_parallel(u, dt, A, B, C, h0, state_every=None):
    """`_scan_sequential` (same arguments and results) by the chunked scan: chunks of
    `min(_CHUNK, L)` tokens, or of `gcd(state_every, _CHUNK)` tokens with `state_every = M`,
    whose chunk-end states include those after tokens `M, 2M, ...`."""
    if state_every is None:
        return _scan_chunked(u, dt, A, B, C, h0, min(_CHUNK, u.shape[1]), False)
    chunk = math.gcd(state_every, _CHUNK)
    y, h_last, h_ends = _scan_chunked(u, dt, A, B, C, h0, chunk, True)
    every = state_every // chunk  # chunks per state
    states = h_ends[every - 1 :: every][: u.shape[1] // state_every]
    return y, h_last, jnp.moveaxis(states, 0, 1)


def _to_chunks(x, chunk):
    """`[b, L, ...] -> [num_chunks, b, chunk, ...]`, zero-padding the end.

    Padded tokens have `dt = 0` (decay 1) and `u = 0` (no input), so they leave the state unchanged.
    """
    length = x.shape[1]
    num_chunks = -(-length // chunk)
    x = jnp.pad(x, [(0, 0), (0, num_chunks * chunk - length)] + [(0, 0)] * (x.ndim - 2))
    x = x.reshape(x.shape[0], num_chunks, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _from_chunks(x, length):
    """`[num_chunks, b, T, ...] -> [b, L, ...]`, dropping the padding."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _chunked_forward(u, dt, A, B, C, h0, chunk):
    """Returns `(y, h_L, h_in)`, `h_in: [num_chunks, b, D, N]` the state entering each chunk."""
    chunks = [_to_chunks(x, chunk) for x in (u, dt, B, C)]

    def chunk_step(h_in, inputs):
        u_c, dt_c, B_c, C_c = inputs
        _, h = _chunk_states(u_c, dt_c, A, B_c, h_in)
        return h[:, -1], (jnp.einsum("btdn,btn->btd", h, C_c), h_in)

    h_last, (y, h_in) = jax.lax.scan(chunk_step, h0, chunks)
    return _from_chunks(y, u.shape[1]), h_last, h_in


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _scan_chunked(u, dt, A, B, C, h0, chunk, chunk_states):
    """Chunked equivalent of `_scan_sequential` over chunks of `chunk` tokens: `(y, h_L)`, and
    with `chunk_states` also `h_ends: [num_chunks, b, D, N]`, the state after each chunk."""
    y, h_last, h_in = _chunked_forward(u, dt, A, B, C, h0, chunk)
    return (y, h_last, _chunk_ends(h_in, h_last)) if chunk_states else (y, h_last)


def _chunk_ends(h_in, h_last):
    """The state after each chunk: `h_in` shifted by one chunk, then `h_L`."""
    return jnp.concatenate([h_in[1:], h_last[None]], axis=0)


def _scan_chunked_fwd(u, dt, A, B, C, h0, chunk, chunk_states):
    y, h_last, h_in = _chunked_forward(u, dt, A, B, C, h0, chunk)
    out = (y, h_last, _chunk_ends(h_in, h_last)) if chunk_states else (y, h_last)
    return out, (u, dt, A, B, C, h_in)


def _scan_chunked_bwd(chunk, chunk_states, residuals, cotangents):
    """Reverse scan over chunks; within a chunk, recompute the states and solve the adjoint.

    With `lambda_t = dLoss/dh_t` (through all later tokens), `a_t = exp(dt_t A)` and
    `x_t = dt_t u_t B_t`:
        lambda_t = dy_t C_t + a_{t+1} lambda_{t+1},   lambda_{L-1} gets dh_L as well
        dx_t = lambda_t,   d(dt_t A) = lambda_t h_{t-1} a_t,   dC_t = sum_d dy_t h_t,
        dh0 = a_0 lambda_0.
    With `chunk_states` the last token of each chunk also gets that chunk's `dh_ends`.
    """
    u, dt, A, B, C, h_in = residuals
    dy, dh_last, *dh_ends = cotangents  # dh_ends: [[num_chunks, b, D, N]] with chunk_states
    chunks = [_to_chunks(x, chunk) for x in (u, dt, B, C, dy)]

    def chunk_step(carry, inputs):
        dh_next, dA = carry  # dh_next: the gradient reaching this chunk's last state from later
        u_c, dt_c, B_c, C_c, dy_c, h_start, *dh_end = inputs
        a, h = _chunk_states(u_c, dt_c, A, B_c, h_start)
        h_prev = jnp.concatenate([h_start[:, None], h[:, :-1]], axis=1)  # h_{t-1}
        source = dy_c[..., None] * C_c[:, :, None, :]  # [b, T, D, N]
        source = source.at[:, -1].add(sum(dh_end, dh_next))  # dh_next (+ this chunk's dh_ends)
        a_next = jnp.concatenate([a[:, 1:], jnp.ones_like(a[:, :1])], axis=1)  # a_{t+1}
        lam = _linear_scan(a_next, source, reverse=True)
        dlog_a = lam * h_prev * a  # d(dt_t A)
        ddt = jnp.einsum("btdn,dn->btd", dlog_a, A)
        dA = dA + jnp.einsum("btdn,btd->dn", dlog_a, dt_c)
        dxu = jnp.einsum("btdn,btn->btd", lam, B_c)  # d(dt_t u_t)
        ddt = ddt + dxu * u_c
        du = dxu * dt_c
        dB = jnp.einsum("btdn,btd->btn", lam, dt_c * u_c)
        dC = jnp.einsum("btd,btdn->btn", dy_c, h)
        return (a[:, 0] * lam[:, 0], dA), (du, ddt, dB, dC)

    (dh0, dA), grads = jax.lax.scan(
        chunk_step, (dh_last, jnp.zeros_like(A)), (*chunks, h_in, *dh_ends), reverse=True
    )
    du, ddt, dB, dC = (_from_chunks(g, u.shape[1]) for g in grads)
    return du, ddt, dA, dB, dC, dh0


_scan_chunked.defvjp(_scan_chunked_fwd, _scan_chunked_bwd)
