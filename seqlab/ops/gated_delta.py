r"""The gated delta rule (Gated DeltaNet; Yang, Kautz, Hatamizadeh, arXiv 2412.06464).

Per value head, a state `S: [K, V]` decays, then takes a delta-rule write, then is read:

$$
S_t = e^{g_t} S_{t-1}, \qquad
S_t \leftarrow S_t + k_t \big(\beta_t (v_t - S_t^\top k_t)\big)^\top, \qquad
o_t = S_t^\top (\mathrm{scale}\; q_t)
$$

`"recurrent"` runs this token by token (the definition of correct). `"chunked"` is the WY / UT
form of `seqlab.ops._delta` (shared with KDA and Gated DeltaNet-2): within a chunk of C tokens
with chunk-local cumulative log-gate $\gamma$ and $\Gamma_{ij} = e^{\gamma_i - \gamma_j}$
($i \ge j$; $\odot$ is the elementwise product),

$$
A = \big(I + \operatorname{strict\_lower}(
  \operatorname{diag}(\beta) (K K^\top \odot \Gamma))\big)^{-1},
\qquad u = A (\beta v), \qquad w = A (\beta e^{\gamma} k)
$$

$$
v_{\mathrm{new}} = u - w S, \qquad
o = \mathrm{scale}\, \big[(q e^{\gamma}) S
  + ((q k^\top) \odot \Gamma)\, v_{\mathrm{new}}\big], \qquad
S' = e^{\gamma_C} S + (k\, e^{\gamma_C - \gamma})^\top v_{\mathrm{new}}
$$

so that only the state passing $S \to S'$ is sequential (over T / C chunks).
"""

import functools

import jax
import jax.numpy as jnp

from seqlab.kernels.gated_delta import api as kernel_api
from seqlab.ops import _chunk_vjp, _chunked, _delta


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    segment_ids: jax.Array | None = None,
    impl: str | None = None,
    interpret: bool = False,
    state_every: int | None = None,
):
    """Gated delta rule over a sequence.

    Args:
      q, k: `[B, T, H, K]`. Not normalized here (Gated DeltaNet L2-normalizes them before).
      v: `[B, T, HV, V]` with `HV` a multiple of `H`: q/k head `h` serves value heads
        `h * G .. h * G + G - 1`, `G = HV // H` (as `jnp.repeat(q, G, axis=2)`).
      g: `[B, T, HV]`, the log-decay (<= 0).
      beta: `[B, T, HV]`, the write strength (usually in (0, 1)).
      scale: multiplies q; defaults to `K ** -0.5`.
      initial_state: `[B, HV, K, V]`, the state before the first token of each row (zeros by
        default); with `segment_ids` it applies to each row's first segment.
      output_final_state: also return the state after the last token.
      chunk_size: tokens per chunk of `"chunked"`; T need not be a multiple.
      segment_ids: `[B, T]` int, packed documents: the state restarts from zero at every change of
        id along t; the final state is that of each row's last segment.
      impl: None (auto: the platform's Pallas kernel on TPU and Hopper GPUs where it takes the
        inputs, `"mixed"` on CPU, else `"chunked"`; `resolve_impl` says which), `"recurrent"`
        (token-by-token `lax.scan`), `"chunked"` (WY form in XLA), `"mixed"` (`"recurrent"`'s values
        without a derivative, `"chunked"`'s chunk-wise recomputing derivative under one: on CPU the
        faster of each pass, `seqlab.ops._chunk_vjp.select`), `"pallas_tpu"` (Mosaic TPU kernel),
        `"pallas_gpu"` (Mosaic GPU kernel, Hopper), `"pallas"` (the current platform's kernel;
        on CPU the TPU kernel in interpret mode). The Pallas impls take float32 or bfloat16
        inputs and `chunk_size` a multiple of 16 (the GPU kernel: 64 or 128, and K <= 128),
        and raise `NotImplementedError` otherwise.
      interpret: run the Pallas kernel in interpret mode (on CPU).
      state_every: N, a positive int, to also return the states after every N tokens (a prefix
        cache: running the op on tokens `[j N, T)` from `initial_state=states[:, j - 1]` gives
        the outputs and final state of the full run there, unless a new segment starts at
        `j N`, where it starts from zeros instead). Served by `"recurrent"` (a scan over blocks
        of N tokens) and `"chunked"` (the chunk-boundary states; N must be a multiple of
        `chunk_size`, else `ValueError`); `impl=None` then means `"chunked"`, and the Pallas
        names raise `NotImplementedError`.

    Returns:
      `(o, final_state)`: `o: [B, T, HV, V]` in `v.dtype`; `final_state: [B, HV, K, V]` in float32
      (float64 for float64 inputs) when `output_final_state`, else None. With `state_every = N`,
      `(o, final_state, states)`: `states: [B, T // N, HV, K, V]` in float32 (float64 for
      float64 inputs), the states after tokens `N, 2N, ..., (T // N) N` (with `segment_ids`,
      those of the segment running there).
    """
    dk = _chunked.validate(
        q,
        k,
        v,
        g,
        beta=beta,
        initial_state=initial_state,
        segment_ids=segment_ids,
        chunk_size=chunk_size,
    )[3]
    # "pallas" on CPU is the TPU kernel, which CPU can only interpret.
    interpret = interpret or (impl == "pallas" and _chunked.target_platform() == "cpu")
    if state_every is None:
        impl = resolve_impl(impl, q.dtype, dk, v.shape[-1], chunk_size)
    else:
        impl = _chunked.resolve_with_states(impl, state_every, chunk_size)
    scale = dk**-0.5 if scale is None else scale
    if impl.startswith("pallas"):
        block_sizes = kernel_api.BlockSizes(chunk_size)
    if impl == "pallas_tpu":
        o, final = _pallas_tpu(
            q, k, v, g, beta, initial_state, segment_ids, scale=scale, block_sizes=block_sizes,
            interpret=interpret,
        )  # fmt: skip
        return o, final if output_final_state else None
    if impl != "pallas_gpu":
        form = functools.partial(_chunked_form, chunk_size=chunk_size, state_every=state_every)
        form = _chunk_vjp.select(impl, _token_step, form, chunk_size, state_every)
    else:  # pallas_gpu: the chunked form with the kernel's state pass, per shard under a mesh
        form = functools.partial(
            _pallas_gpu, chunk_size=chunk_size, block_sizes=block_sizes, interpret=interpret
        )
    xs = (q, k, v, g, beta)
    return _chunked.run(form, xs, initial_state, segment_ids, output_final_state, scale=scale)


def resolve_impl(impl: str | None, dtype, dk: int, dv: int, chunk_size: int) -> str:
    """The implementation `gated_delta_rule(..., impl=impl)` runs for q/k/v of `dtype`, head
    widths `K = dk`, `V = dv` and `chunk_size`.

    `None` is the platform's kernel on TPU and Hopper GPUs where that kernel takes these inputs
    (`kernels.gated_delta.api.unsupported`), `"mixed"` on CPU, else `"chunked"`; an explicit kernel
    name that cannot run them raises `NotImplementedError` with the reason, never falls back.
    """
    resolved = _chunked.check_impl(impl, kernels=True)
    if resolved not in ("pallas_tpu", "pallas_gpu"):
        return resolved
    reason = kernel_api.unsupported(resolved, dtype, dk, dv, chunk_size)
    if reason is None:
        return resolved
    if impl is None:
        return "chunked"
    raise NotImplementedError(f"impl={impl!r}: {reason}; use impl='chunked' or impl=None")


def _pallas_gpu(*args, chunk_size, block_sizes, interpret):
    """The chunked form with the GPU kernel's state pass, run per shard under a mesh; `args` as
    `_chunked_form` takes them."""
    scan = functools.partial(
        kernel_api.scan_chunk_states, block_sizes=block_sizes, interpret=interpret
    )
    run = functools.partial(_chunked_form, chunk_size=chunk_size, scan=scan)
    bthd, bh = (kernel_api.BATCH, None, kernel_api.HEADS), (kernel_api.BATCH, kernel_api.HEADS)
    specs = (bthd, bthd, bthd, bthd, bthd, bh, (kernel_api.BATCH,))
    return kernel_api.per_shard(run, args, specs, (bthd, bh))


def _pallas_tpu(q, k, v, g, beta, initial_state, segment_ids, *, scale, block_sizes, interpret):
    """Lay the inputs out as the TPU kernel contract wants (`seqlab/kernels/gated_delta/
    README.md`), run the kernels, and restore `[B, T, HV, V]`."""
    b, t, hv, dv = v.shape
    dk = q.shape[-1]
    c = block_sizes.chunk
    f32 = jnp.float32

    def heads_major(x):  # [B, T, HV, D] -> [B, HV, T_pad, D]
        x = _chunked.pad_and_chunk(x, c)
        return jnp.moveaxis(x.reshape(b, -1, hv, x.shape[-1]), 2, 1)

    def per_chunk(x):  # [B, T, HV] -> [B, HV, N, C]
        return jnp.moveaxis(_chunked.pad_and_chunk(x.astype(f32), c), 3, 1)

    q, k = (_chunked.expand_heads(x, hv // q.shape[2]) for x in (q, k))
    seg = _chunked.pad_and_chunk(_chunked.segment_index(segment_ids, b, t), c, edge=True)
    incoming = jnp.concatenate([jnp.zeros((b, 1), seg.dtype), seg[:, :-1, -1]], axis=1)
    o, final = kernel_api.chunked_scan(
        heads_major(q * jnp.asarray(scale, q.dtype)),
        heads_major(k.astype(q.dtype)),
        heads_major(v.astype(q.dtype)),
        jnp.cumsum(per_chunk(g), axis=-1),
        per_chunk(beta),
        (seg - incoming[..., None]).astype(f32),
        jnp.zeros((b, hv, dk, dv), f32) if initial_state is None else initial_state.astype(f32),
        block_sizes=block_sizes,
        interpret=interpret,
    )
    return jnp.moveaxis(o, 1, 2)[:, :t].astype(v.dtype), final


def gated_delta_rule_step(q_t, k_t, v_t, g_t, beta_t, state, *, scale: float | None = None):
    """One decoding step of `gated_delta_rule`.

    Args:
      q_t, k_t: `[B, H, K]`; v_t: `[B, HV, V]`; g_t, beta_t: `[B, HV]`;
      state: `[B, HV, K, V]`; scale: defaults to `K ** -0.5`.

    Returns:
      `(o_t: [B, HV, V] in v_t.dtype, new_state: [B, HV, K, V])`, the state in float32 (float64
      for float64 inputs).
    """
    dk = _chunked.validate_step(q_t, k_t, v_t, g_t, state, beta_t=beta_t)[2]
    scale = dk**-0.5 if scale is None else scale
    return _chunked.decode_step(_token_step, q_t, k_t, v_t, (g_t, beta_t), state, scale=scale)


_token_step = functools.partial(_delta.token_step, _delta.beta_write)


def _chunked_form(*args, chunk_size, scan=_chunked.scan_chunk_states, state_every=None):
    """The WY chunked form of `seqlab.ops._delta` with the delta rule's write `(beta k, beta)`;
    `scan` passes the state (a `lax.scan` for `"chunked"`, the GPU kernel for `"pallas_gpu"`)."""
    return _delta.chunked_form(_delta.beta_write, chunk_size, scan, *args, state_every=state_every)
