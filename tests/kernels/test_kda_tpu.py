"""The Mosaic TPU kernels of KDA (Kimi Delta Attention) in interpret mode on CPU against a float64
token-by-token recurrence (output, final state and the gradients of q, k, v, g, beta and the
initial state), lowering for TPU with `jax.export`, and a sharded run.

Interpret mode runs with race detection and NaN-filled uninitialized memory
(`pallas_tpu.INTERPRET_PARAMS`). Compiling an interpreted kernel and its gradient takes ~10 s
while running it takes ~0.3 s, so the cases share shapes and differ in data only: one compile
per dtype serves them all.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from seqlab.kernels.kda import api, chunk, pallas_tpu
from seqlab.ops import kda
from tests.conftest import assert_close
from tests.ops.trained_like import correlated_keys, rel_rms

# Rows, tokens (padded to 2 chunks of 64), q/k heads, value heads, K, V.
B, T, H, HV, DK, DV = 2, 120, 1, 2, 32, 16
CHUNK = 64
# Row 0 holds three documents (resets at tokens 50 and 57, mid-chunk; and 70 in chunk 2),
# row 1 one.
DOCUMENTS = ([50, 7, 13, 50], [T])
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def segment_ids(lengths_per_row=DOCUMENTS):
    rows = [np.repeat(np.arange(len(ls)) * 7 + 3, ls) for ls in lengths_per_row]
    return np.stack(rows).astype(np.int32)


def gates(kind: str, rng: np.random.Generator) -> np.ndarray:
    """`g [B, T, HV, K]` float64 log-decays.

    mild: log U(0.5, 1) per token and channel. channels: half the channels (drawn) decay by
    e^-300 at every token (their cumulative log-gate reaches -1.9e4 within a chunk), the rest do
    not decay. spikes: each (token, channel) 0 or -20 (half each, cumulative ~ -640 per chunk).
    """
    shape = (B, T, HV, DK)
    if kind == "mild":
        return np.log(rng.uniform(0.5, 1.0, size=shape))
    if kind == "channels":
        strong = rng.permutation(DK) < DK // 2
        return np.broadcast_to(np.where(strong, -300.0, 0.0), shape).copy()
    if kind == "spikes":
        return np.where(rng.uniform(size=shape) < 0.5, 0.0, -20.0)
    raise ValueError(kind)


def case_inputs(gate: str, *, cosine=0.95, beta=(0.9, 1.0), seed=0) -> dict:
    """float64 numpy arrays in the public layout: correlated unit keys and queries (neighbouring
    cosine `cosine`, `tests/ops/trained_like.py`), write strengths in `beta`, the initial state
    and `segment_ids`."""
    rng = np.random.default_rng(seed)
    return dict(
        q=correlated_keys(rng, (B, T, H, DK), cosine),
        k=correlated_keys(rng, (B, T, H, DK), cosine),
        v=rng.normal(size=(B, T, HV, DV)),
        g=gates(gate, rng),
        beta=rng.uniform(*beta, size=(B, T, HV)),
        initial_state=rng.normal(size=(B, HV, DK, DV)) * 0.5,
        segment_ids=segment_ids(),
    )


def reference(q, k, v, g, beta, initial_state, segment_ids):
    """The recurrence token by token (`lax.scan`), in the inputs' dtype: the state restarts from
    zero at every change of `segment_ids`, then `S = Diag(exp(g_t)) S`,
    `S += k_t (beta_t (v_t - S^T k_t))^T`, `o_t = S^T (K^-1/2 q_t)`."""
    scale = q.shape[-1] ** -0.5
    q, k = (jnp.repeat(x, v.shape[2] // q.shape[2], axis=2) for x in (q, k))
    reset = jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
        axis=1,
    )

    def step(state, x):
        q_t, k_t, v_t, g_t, beta_t, reset_t = x
        state = jnp.where(reset_t[:, None, None, None], jnp.zeros_like(state), state)
        state = jnp.exp(g_t)[..., None] * state
        error = v_t - jnp.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + k_t[..., :, None] * (beta_t[..., None] * error)[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t * scale)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, reset))
    final, o = lax.scan(step, initial_state, xs)
    return jnp.moveaxis(o, 0, 1), final


def kernel(q, k, v, g, beta, initial_state, segment_ids, chunk=CHUNK):
    """`seqlab.ops.kda` through the TPU kernel, interpreted on CPU (`impl="pallas"`)."""
    return kda(
        q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk,
        impl="pallas", output_final_state=True,
    )  # fmt: skip


def _loss(fn, floats, segment_ids, w_o, w_s):
    o, final = fn(**floats, segment_ids=segment_ids)
    dt = final.dtype
    value = jnp.sum(o.astype(dt) * w_o.astype(dt)) + jnp.sum(final * w_s.astype(dt))
    return value, (o, final)


@functools.cache
def _forward_and_grads(fn):
    """Jitted `(floats, segment_ids, w_o, w_s) -> {o, final_state, d<name>}`: one compile per
    function and shapes, shared by every case."""
    grad = jax.value_and_grad(functools.partial(_loss, fn), has_aux=True)

    def run(floats, segment_ids, w_o, w_s):
        (_, (o, final)), grads = grad(floats, segment_ids, w_o, w_s)
        return {"o": o, "final_state": final, **{f"d{n}": g for n, g in grads.items()}}

    return jax.jit(run)


def forward_and_grads(fn, x: dict, dtype, seed=1) -> dict:
    """o, final state and the gradient of a fixed random linear loss in both with respect to
    every floating input, as float64 numpy arrays; q, k, v in `dtype`, the rest float32 (float64
    when `dtype` is)."""
    rest = jnp.float64 if dtype == jnp.float64 else jnp.float32
    floats = {n: jnp.asarray(x[n], dtype if n in ("q", "k", "v") else rest) for n in NAMES}
    rng = np.random.default_rng(seed)
    w_o = jnp.asarray(rng.normal(size=x["v"].shape), rest)
    w_s = jnp.asarray(rng.normal(size=x["initial_state"].shape), rest)
    out = _forward_and_grads(fn)(floats, jnp.asarray(x["segment_ids"]), w_o, w_s)
    return {n: np.asarray(a.astype(jnp.float32), np.float64) for n, a in out.items()}


def rounded(x: dict, dtype) -> dict:
    """`x` with q, k, v rounded to `dtype` (kept float64): the reference of a `dtype` run."""
    return {
        n: np.asarray(jnp.asarray(a, dtype), np.float64) if n in ("q", "k", "v") else a
        for n, a in x.items()
    }


F32_CASES = {
    "mild-segments": dict(gate="mild"),
    "channels-decay-1e4": dict(gate="channels"),
    "spikes": dict(gate="spikes", cosine=0.5, beta=(0.05, 1.0)),
    "identical-keys": dict(gate="mild", cosine=1.0, beta=(0.99, 1.0)),
}


def test_interpret_float32_matches_the_recurrence():
    """Every output and gradient within the float32 tolerance of the float64 recurrence
    (elementwise, `tests/conftest.py`), finite where cumulative gates reach -1.9e4. The cases
    run in one test so that one process compiles the kernels once for them all."""
    for name, case in F32_CASES.items():
        x = case_inputs(**case)
        got = forward_and_grads(kernel, x, jnp.float32)
        want = forward_and_grads(reference, x, jnp.float64)
        for n, e in want.items():
            assert np.isfinite(got[n]).all(), f"{name}: {n}"
            msg = f"{name}: {n} (relative RMS error {rel_rms(got[n], e):.1e})"
            assert_close(got[n], e, jnp.float32, err_msg=msg)


# bfloat16 q/k/v: the kernel's products take bf16 operands (`chunk.chunk_step`), so beyond the
# rounding of the inputs (which the reference shares: it runs on the rounded q, k, v) the scores,
# `w`, `w S`, `q S` and `Q v_new` round their operands at 2^-9, and o itself is bf16. Measured
# relative RMS error against the float64 recurrence on the rounded inputs, every case of
# F32_CASES: <= 5.7e-3 (dq; o 5.2e-3; README.md). The bound leaves 2x room; the elementwise
# bf16 tolerance does not apply to gradients that sum many rounded products.
BF16_REL_RMS = 1.2e-2


def test_interpret_bfloat16_matches_the_recurrence():
    for gate in ("mild", "channels"):
        x = case_inputs(gate)
        got = forward_and_grads(kernel, x, jnp.bfloat16)
        want = forward_and_grads(reference, rounded(x, jnp.bfloat16), jnp.float64)
        for n, e in want.items():
            assert np.isfinite(got[n]).all(), f"{gate}: {n}"
            err = rel_rms(got[n], e)
            assert err <= BF16_REL_RMS, f"{gate}: {n} relative RMS error {err:.2e}"


def test_chunk_step_has_no_overflow_in_values_or_gradients():
    """One chunk at cumulative log-gates down to -1e4 per channel: outputs, state and every
    gradient finite and equal to the plain float64 computation (which splits nothing)."""
    c, rng = 32, np.random.default_rng(3)
    g = np.where(np.arange(DK) % 3 == 0, -320.0, np.log(rng.uniform(0.5, 1.0, size=(c, DK))))
    args = dict(
        state=rng.normal(size=(DK, DV)),
        q=rng.normal(size=(c, DK)),
        k=rng.normal(size=(c, DK)) / np.sqrt(DK),
        v=rng.normal(size=(c, DV)),
        gamma=np.cumsum(g, axis=0),
        beta_col=rng.uniform(0.5, 1.0, size=(c, 1)),
    )
    seg = np.repeat([0.0, 1.0], [20, 12])

    def loss(step, a):
        dtype = a["q"].dtype
        seg_col, seg_row = jnp.asarray(seg[:, None], dtype), jnp.asarray(seg[None], dtype)
        o, s = step(**a, seg_col=seg_col, seg_row=seg_row)
        return jnp.sum(jnp.sin(o)) + jnp.sum(jnp.cos(s)), (o, s)

    def run(step, dtype):
        a = {n: jnp.asarray(x, dtype) for n, x in args.items()}
        grad = jax.value_and_grad(functools.partial(loss, step), has_aux=True)
        (_, out), grads = jax.jit(grad)(a)
        return [np.asarray(y, np.float64) for y in (*out, *grads.values())]

    def plain(state, q, k, v, gamma, beta_col, seg_col, seg_row):
        """The chunk in float64 with `exp(gamma_i - gamma_j)` as one exponent per entry."""
        diff = gamma[:, None, :] - gamma[None, :, :]  # [C, C, K]
        mask = (jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]) & (seg_col == seg_row)
        decay = jnp.where(mask[..., None], jnp.exp(jnp.where(mask[..., None], diff, 0.0)), 0.0)
        scores_q = jnp.einsum("ic,jc,ijc->ij", q, k, decay)
        lower = beta_col * jnp.einsum("ic,jc,ijc->ij", k, k, decay) * (1 - jnp.eye(c))
        inverse = jnp.linalg.inv(jnp.eye(c) + lower)
        from_state = jnp.where(seg_col == 0, jnp.exp(gamma), 0.0)
        v_new = inverse @ (beta_col * v) - inverse @ (beta_col * from_state * k) @ state
        o = (q * from_state) @ state + scores_q @ v_new
        last = seg_col[-1, 0]
        keep = jnp.where(last == 0, jnp.exp(gamma[-1]), 0.0)
        to_end = jnp.where(seg_col == last, jnp.exp(gamma[-1] - gamma), 0.0)
        return o, keep[:, None] * state + (k * to_end).T @ v_new

    got = run(chunk.chunk_step, jnp.float32)
    want = run(plain, jnp.float64)
    for a, e in zip(got, want, strict=True):
        assert np.isfinite(a).all()
        assert_close(a, e, jnp.float32)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(dtype=jnp.float64), NotImplementedError, "float32 or bfloat16"),
        (dict(gamma=jnp.float64), NotImplementedError, "gamma must be float32"),
        (dict(t=40), ValueError, "multiple of the chunk"),
    ],
)
def test_unsupported_raises(change, error, match):
    t, c = change.get("t", 32), 16
    dtype, gamma_dtype = change.get("dtype", jnp.float32), change.get("gamma", jnp.float32)
    args = (
        jnp.zeros((1, 1, t, 16), dtype),
        jnp.zeros((1, 1, t, 16), dtype),
        jnp.zeros((1, 1, t, 16), dtype),
        jnp.zeros((1, 1, t, 16), gamma_dtype),
        jnp.zeros((1, 1, t // c, c), jnp.float32),
        jnp.zeros((1, t // c, c), jnp.float32),
        jnp.zeros((1, 1, 16, 16), jnp.float32),
    )
    with pytest.raises(error, match=match):
        api.chunked_scan(*args, block_sizes=api.BlockSizes(chunk=c), interpret=True)
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        api.BlockSizes(chunk=24)
    assert api.unsupported(jnp.bfloat16, 64) is None
    assert "float64" in api.unsupported(jnp.float64, 64)


def _export(fn, dk=128, dv=128):
    s = jax.ShapeDtypeStruct
    bf16, f32 = jnp.bfloat16, jnp.float32
    args = [s((2, 192, 2, dk), bf16), s((2, 192, 2, dk), bf16), s((2, 192, 2, dv), bf16)]
    args += [s((2, 192, 2, dk), f32), s((2, 192, 2), f32)]

    def fwd(q, k, v, g, beta):
        return fn(q, k, v, g, beta)

    def loss(*args):
        o, final = fwd(*args)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final)

    grad = jax.grad(loss, argnums=range(5))
    return [
        jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module() for f in (fwd, grad)
    ]


def _assert_kernels(modules):
    fwd, grad = modules
    for module, kernels in ((fwd, ["kda_fwd"]), (grad, ["kda_fwd", "kda_bwd"])):
        calls = re.findall(r"stablehlo.custom_call @(\w+)", module)
        assert calls.count("tpu_custom_call") == len(kernels)
        for name in kernels:
            assert name in module
    assert "kda_bwd" not in fwd


def test_export_for_tpu_contains_the_kernels():
    """`seqlab.ops.kda(impl="pallas_tpu")` lowers for TPU from a CPU-only machine, forward and
    gradient, with the kernels inside."""
    _assert_kernels(_export(functools.partial(kda, impl="pallas_tpu", output_final_state=True)))


@pytest.mark.parametrize("axis_type", ["Explicit", pytest.param("Auto", marks=pytest.mark.slow)])
def test_sharded_over_data_and_heads_matches_the_recurrence(axis_type):
    axis_types = (getattr(jax.sharding.AxisType, axis_type),) * 2
    mesh = jax.make_mesh((2, 2), ("data", "heads"), axis_types, devices=jax.devices()[:4])
    x = case_inputs("mild")
    want = forward_and_grads(reference, x, jnp.float64)  # unsharded; cheaper than the kernel
    with jax.set_mesh(mesh):
        got = forward_and_grads(kernel, x, jnp.float32)
        floats = {n: jnp.asarray(x[n], jnp.float32) for n in NAMES}
        lowered = jax.jit(kernel).lower(**floats, segment_ids=x["segment_ids"]).as_text()
    assert "manual_computation" in lowered or "shard_map" in lowered
    for n, e in want.items():
        assert_close(got[n], e, jnp.float32, err_msg=n)


def _kernel_dot_operands(dtype, *, backward: bool) -> list[str]:
    """The operand dtypes of every matmul inside the kernel (forward or backward), in order."""
    b, h, t, d, c = 1, 1, 128, 64, 64
    n = t // c
    f32 = jnp.float32
    x = [jnp.zeros((b, h, t, d), dtype)] * 3 + [jnp.zeros((b, h, t, d), f32)]
    token = [jnp.zeros((b, h, n, c), f32), jnp.zeros((b, n, c), f32)]
    state = jnp.zeros((b, h, d, d), f32)
    if backward:
        states = jnp.zeros((b, h, n, d, d), f32)
        args = (*x, *token, states, jnp.zeros((b, h, t, d), dtype), state)
        fn = functools.partial(pallas_tpu.backward, chunk_size=c, interpret=True)
    else:
        fn = functools.partial(pallas_tpu.forward, chunk_size=c, save_states=False, interpret=True)
        args = (*x, *token, state)
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append("/".join(jnp.dtype(v.aval.dtype).name for v in eqn.invars))
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_bf16_inputs_select_the_bf16_operand_matmuls():
    """Chunk 64: 3 cross-sub-chunk score products each for `Q` and `P`, `w`, `w S`, `q S` and
    `Q v_new` take the inputs' dtype as operands; `u`, the state update and the inverse's merges
    (two doublings, two products each) stay float32."""
    subs, merges = 64 // chunk.SUB_CHUNK, 2
    in_dtype = 2 * (subs - 1) + 4
    f32 = _kernel_dot_operands(jnp.float32, backward=False)
    assert set(f32) == {"float32/float32"} and len(f32) == in_dtype + 2 + 2 * merges
    bf16 = _kernel_dot_operands(jnp.bfloat16, backward=False)
    assert bf16.count("bfloat16/bfloat16") == in_dtype
    assert bf16.count("float32/float32") == 2 + 2 * merges
    backward = _kernel_dot_operands(jnp.bfloat16, backward=True)
    # Two VJP products per bf16 product, and the recomputed forward but for the two products
    # that only make `o` (`q S`, `Q v_new`: dead in the backward).
    assert backward.count("bfloat16/bfloat16") == 3 * in_dtype - 2


def test_cost_estimate_counts_the_sub_chunks():
    # chunk 64, K = V = 128: 3 cross products each for Q and P, and 16 diagonal offsets.
    want = 2 * 3 * 2 * 64 * 64 * 128 + 4 * 16 * 64 * 128
    want += 2 * 64 * 64 * 128 + 4 * 64 * 64 * 128 + 6 * 64 * 128 * 128 + 4 * 64**3 * 2
    assert pallas_tpu.chunk_flops(64, 128, 128) == want
    cost = pallas_tpu._cost((2, 4, 16), 64, 128, 128, (), backward=True)
    assert cost.flops == 3 * 2 * 4 * 16 * want


@pytest.mark.slow
@settings(max_examples=4)  # each draw compiles two interpreted kernels (~10 s)
@given(
    t=st.integers(1, 80),
    groups=st.integers(1, 2),
    chunk_size=st.sampled_from([16, 32, 128]),
    n_docs=st.integers(1, 3),
    gate=st.sampled_from(["mild", "spikes"]),
    seed=st.integers(0, 2**16),
)
def test_interpret_matches_the_recurrence_hypothesis(t, groups, chunk_size, n_docs, gate, seed):
    """Random lengths, chunk sizes (one sub-chunk, two, eight), head grouping and documents."""
    rng = np.random.default_rng(seed)
    b, h, dk, dv = 1, 1, 16, 8
    hv = h * groups
    shape = (b, t, hv, dk)
    g = np.log(rng.uniform(0.5, 1.0, size=shape))
    if gate == "spikes":
        g = np.where(rng.uniform(size=shape) < 0.5, 0.0, -40.0)
    cuts = np.sort(rng.choice(np.arange(1, t + 1), n_docs - 1))
    lengths = np.diff(np.concatenate([[0], cuts, [t]])).tolist() if t > 1 else [t]
    x = dict(
        q=rng.normal(size=(b, t, h, dk)),
        k=correlated_keys(rng, (b, t, h, dk), 0.9),
        v=rng.normal(size=(b, t, hv, dv)),
        g=g,
        beta=rng.uniform(0.05, 1.0, size=(b, t, hv)),
        initial_state=rng.normal(size=(b, hv, dk, dv)),
        segment_ids=segment_ids([lengths]),
    )
    got = forward_and_grads(functools.partial(kernel, chunk=chunk_size), x, jnp.float32)
    want = forward_and_grads(reference, x, jnp.float64)
    for n, e in want.items():
        assert_close(got[n], e, jnp.float32, err_msg=n)
