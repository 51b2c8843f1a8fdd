"""Chunk-wise recomputation for the chunked forms: derivatives whose memory grows like T (K + V).

Autodiff of a chunked form keeps every intra-chunk `[C, C]` matrix and intermediate of all chunks
at once (about 15-30 T (K + V) floats per head for the gated delta rule, its forward alone
13 T (K + V)). `recomputing(form, chunk_size)` is the same form with a derivative rule that runs
it one block of `M` chunks (`L = M C` tokens) at a time and keeps only the inputs and the states
entering the blocks. With `x_n` block n's tokens, `seg_n` their segment index and `S_n` the state
entering it:

    primal:    (o, S_T) = form(x, S_0, seg)          the whole sequence at once, no derivative
                                                     (or another form of the op: `primal`)
    tangent:   (o_n, S_{n+1}), (do_n, dS_{n+1}) = jvp of (S, x_n) -> form(x_n, c_n S, seg_n)
               at (S_n, x_n) along (dS_n, dx_n): one `lax.scan` over the blocks carrying
               (S, dS) from (S_0, dS_0)
    backward:  the transpose of that scan: a reverse scan over the blocks carrying the state
               cotangent; block n recomputes its forward from the saved S_n (`jax.checkpoint`)
               and maps (do_n, dS_{n+1}) to dS_n and the cotangents of x_n.

`c_n` is 1 when the state enters block n and 0 when a new segment starts at its first token: a
form run on the block alone sees its first token as the start of its sequence, so it would
carry `S_n` into that token's segment (`_delta.intra_chunk`, `incoming`). The factor zeroes the
carried state and its cotangent alike.

The rule is a `jax.custom_jvp`: forward mode (`jax.jvp`, `jax.jacfwd`) runs the tangent scan,
reverse mode (`jax.grad`, `jax.vjp`) keeps what its transpose needs, which is the blocked inputs
and the states `S_n` (`O(T (K + V) + (T / L) K V)` floats per head), plus one block's transients
while it runs. Under a derivative the values come from the block-by-block pass: the same
arithmetic per chunk as the whole-sequence form, equal to rounding.

Shapes: inputs `[B, T, HV, ...]` (q/k already repeated to `HV` heads), states `[B, HV, K, V]`,
`seg: [B, T]` int; blocked `[n, B, L, ...]` with `n = ceil(T / L)` blocks, time-major for the scan.
"""

import functools

import jax
import jax.numpy as jnp

from seqlab.ops import _chunked
from seqlab.ops.checks import check_positive_int


def recomputing(form, chunk_size: int, *, chunks_per_block: int = 1, primal=None):
    """`form` with the chunk-wise recomputing derivative rule (module docstring).

    Args:
      form: a chunked form, `form(q, k, v, *gates, state, seg) -> (o, final)` as `_chunked.run`
        calls it (inputs `[B, T, HV, ...]` in the accumulation dtype, `state: [B, HV, K, V]`,
        `seg: [B, T]` int segment index); zero-padded tokens must be inert (`pad_and_chunk`).
      chunk_size: the form's chunk size C.
      chunks_per_block: M, the chunks recomputed together per step of the derivative's scan
        (the transients of M chunks live at once; fewer, larger steps).
      primal: the function that computes the values without a derivative, another form of the
        same op with `form`'s signature (`"mixed"`: the recurrent scan); `form` by default.

    Returns:
      `f(q, k, v, *gates, state, seg) -> (o: [B, T, HV, V], final: [B, HV, K, V])`, `primal`
      without a derivative, differentiable (forward and reverse mode) in every floating input.
    """
    check_positive_int("chunk_size", chunk_size)
    check_positive_int("chunks_per_block", chunks_per_block)
    block = chunk_size * chunks_per_block

    primal = form if primal is None else primal

    @jax.custom_jvp
    def f(*args):
        return primal(*args)

    @f.defjvp
    def f_jvp(primals, tangents):
        *xs, state, seg = primals
        *dxs, dstate, _ = tangents  # seg's tangent is float0
        seg_blocks = _blocked(seg, block, edge=True)
        carries = _carries(seg_blocks).astype(state.dtype)

        def step(carry, inputs):
            x_n, dx_n, c_n, seg_n = inputs

            def block_form(s, x):
                return form(*x, _chunked.decay_state(c_n, s), seg_n)

            (o_n, s_next), (do_n, ds_next) = jax.jvp(block_form, (carry[0], x_n), (carry[1], dx_n))
            return (s_next, ds_next), (o_n, do_n)

        inputs = (
            tuple(_blocked(x, block) for x in xs),
            tuple(_blocked(dx, block) for dx in dxs),
            carries,
            seg_blocks,
        )
        step = jax.checkpoint(step, prevent_cse=False)
        (final, dfinal), (o, do) = jax.lax.scan(step, (state, dstate), inputs)
        t = seg.shape[1]
        return (_unblocked(o, t), final), (_unblocked(do, t), dfinal)

    return f


def select(impl: str, token_step, form, chunk_size: int, state_every: int | None):
    """The form `_chunked.run` runs for an op's XLA `impl`.

    Args:
      impl: `"recurrent"` (the token-by-token scan of `token_step`), `"chunked"` (`form` with the
        recomputing derivative) or `"mixed"` (the recurrent scan without a derivative, `form`'s
        recomputing derivative under one: the faster of each pass on CPU).
      token_step: the op's `token_step(state, x_t) -> (state, o_t)` (`_chunked.recurrent`).
      form: the op's chunked form, built with `state_every`.
      chunk_size: `form`'s chunk size.
      state_every: N or None. With N, `"chunked"` is `form` itself, whose prefix states are read
        off the whole-sequence pass's chunk boundaries (`"mixed"` is refused before this:
        `_chunked.resolve_with_states`).
    """
    recurrent = functools.partial(_chunked.recurrent, token_step, state_every=state_every)
    if impl == "recurrent":
        return recurrent
    if state_every is not None:
        return form
    return recomputing(form, chunk_size, primal=recurrent if impl == "mixed" else None)


def _blocked(x: jax.Array, block: int, *, edge: bool = False) -> jax.Array:
    """`[B, T, ...] -> [n, B, L, ...]`, time padded to `n L` as `_chunked.pad_and_chunk` pads
    (zeros, which are inert tokens; `edge` for segment indices)."""
    return jnp.moveaxis(_chunked.pad_and_chunk(x, block, edge=edge), 1, 0)


def _unblocked(x: jax.Array, length: int) -> jax.Array:
    """`[n, B, L, ...] -> [B, T, ...]`, dropping the padding."""
    return _chunked.unchunk(jnp.moveaxis(x, 0, 1), length)


def _carries(seg_blocks: jax.Array) -> jax.Array:
    """`[n, B]` bool from the blocked segment index `[n, B, L]`: the state enters block n (its
    first token continues the segment of the token before; always for the first block)."""
    first, last = seg_blocks[:, :, 0], seg_blocks[:, :, -1]
    return jnp.concatenate([jnp.ones_like(first[:1], bool), first[1:] == last[:-1]], axis=0)
