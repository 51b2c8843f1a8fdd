"""Tests of the Mosaic GPU kernels `seqlab.kernels.gated_delta.pallas_gpu` on a CPU-only machine.

The kernels run in the Mosaic GPU interpret mode (race detection on, uninitialized memory NaN)
against a `lax.scan` over chunks of `chunk.chunk_step` (forward) and `jax.vjp` of that scan
(backward), at the kernel contract's layout; and they lower for CUDA through `jax.export`, whose
module must carry the Mosaic GPU custom call.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

from seqlab.kernels.gated_delta import chunk, pallas_gpu
from tests.conftest import assert_close

C = pallas_gpu.CHUNK
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

# float32 inputs multiply as bfloat16 hi/lo splits (three products, the lo*lo term dropped:
# ~2^-17 relative per operand). The forward meets the float32 table; gradients chain about three
# times more products and reach |grad| ~ 30 from unit-scale inputs, so their absolute error is
# ~1e-4 (measured up to 1.9x the table's atol): this looser pair is for float32 gradients only.
F32_GRAD_TOL = dict(rtol=5e-4, atol=3e-4)
# bfloat16 inputs: besides the inputs, the kernels round v_new, w, A to bfloat16 for the
# tensor cores (as flash-linear-attention does), and gradients reach |grad| ~ 30: their absolute
# error grows with that scale (measured up to 1.3x the table's atol of 3e-2), hence atol 6e-2.
BF16_GRAD_TOL = dict(rtol=3e-2, atol=6e-2)


def contract_inputs(seed, b, h, n, dk, dv, dtype, starts):
    """Inputs in the kernel contract's layout; `starts[row]`: segment starts (token positions)."""
    r = np.random.default_rng(seed)
    t = n * C
    k = r.normal(size=(b, h, t, dk))
    seg_ids = np.zeros((b, t), np.int64)
    for row, positions in enumerate(starts):
        for p in positions:
            seg_ids[row, p:] += 1
    change = np.concatenate([np.zeros((b, 1), bool), seg_ids[:, 1:] != seg_ids[:, :-1]], axis=1)
    x = dict(
        q=r.normal(size=(b, h, t, dk)) * dk**-0.5,
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=r.normal(size=(b, h, t, dv)),
    )
    x = {name: jnp.asarray(a, dtype) for name, a in x.items()}
    g = np.log(r.uniform(0.8, 1.0, size=(b, h, n, C)))
    x["gamma"] = jnp.asarray(np.cumsum(g, axis=-1), F32)
    x["beta"] = jnp.asarray(r.uniform(0.05, 1.0, size=(b, h, n, C)), F32)
    x["seg"] = jnp.asarray(np.cumsum(change.reshape(b, n, C), axis=-1), F32)
    x["h0"] = jnp.asarray(r.normal(size=(b, h, dk, dv)), F32)
    return x


def reference(q, k, v, gamma, beta, seg, h0):
    """`(o, h_final, states)` by `lax.scan` of `chunk.chunk_step` per (batch, head), float32."""

    def per_head(q, k, v, gamma, beta, seg, h0):
        n = gamma.shape[0]
        q, k, v = (x.astype(F32).reshape(n, C, -1) for x in (q, k, v))

        def step(s, xs):
            q_, k_, v_, g_, b_, s_ = xs
            col, row = (lambda x: x[:, None]), (lambda x: x[None, :])
            o, s_next = chunk.chunk_step(s, q_, k_, v_, col(g_), row(g_), col(b_), col(s_), row(s_))
            return s_next, (o, s)

        final, (o, states) = lax.scan(step, h0, (q, k, v, gamma, beta, seg))
        return o.reshape(n * C, -1), final, states

    heads = jax.vmap(per_head, in_axes=(0, 0, 0, 0, 0, None, 0))
    return jax.vmap(heads)(q, k, v, gamma, beta, seg, h0)


def kernel_forward(x, *, interpret=True):
    return pallas_gpu.forward(**x, chunk_size=C, save_states=True, interpret=interpret)


def kernel_backward(x, states, do, dh_final, *, interpret=True):
    args = {name: x[name] for name in ("q", "k", "v", "gamma", "beta", "seg")}
    return pallas_gpu.backward(
        **args, states=states, do=do, dh_final=dh_final, chunk_size=C, interpret=interpret
    )


def assert_no_races():
    assert not gpu_callbacks.get_races().races_found, "interpret mode detected a race"


def cotangents(seed, x, dtype):
    r = np.random.default_rng(seed)
    do = jnp.asarray(r.normal(size=x["v"].shape), dtype)
    return do, jnp.asarray(r.normal(size=x["h0"].shape), F32)


# (dtype, B, H, N, K, V, segment starts per row): starts inside chunks and on a chunk boundary.
FAST = [
    (F32, 2, 1, 2, 64, 64, [(20, 100), (64,)]),
    (BF16, 1, 1, 2, 128, 128, [(20, 100)]),
]
SLOW = [
    (F32, 2, 2, 3, 64, 128, [(5,), (64, 130)]),
    (BF16, 2, 1, 2, 128, 128, [(20, 100), (64,)]),
    (BF16, 1, 2, 3, 64, 64, [(1, 63, 64, 65)]),
    (BF16, 2, 1, 2, 128, 64, [(), (127,)]),
    (BF16, 1, 1, 3, 64, 128, [()]),
]
FORWARD_ONLY = [(F32, 1, 2, 2, 128, 128, [(70,)])]  # float32 K = 128: forward only (shared memory)


def _cases(fast, slow):
    return [pytest.param(*case, id=f"{case[0]}-K{case[4]}-V{case[5]}") for case in fast] + [
        pytest.param(
            *case, id=f"{case[0]}-K{case[4]}-V{case[5]}-N{case[3]}", marks=pytest.mark.slow
        )
        for case in slow
    ]


@pytest.mark.parametrize("dtype, b, h, n, dk, dv, starts", _cases(FAST, SLOW + FORWARD_ONLY))
def test_forward_matches_chunk_scan(dtype, b, h, n, dk, dv, starts):
    x = contract_inputs(0, b, h, n, dk, dv, dtype, starts)
    o, h_final, states = jax.jit(kernel_forward)(x)
    assert_no_races()
    o_ref, h_ref, states_ref = reference(**x)
    assert o.dtype == dtype and h_final.dtype == states.dtype == F32
    assert_close(o, o_ref, dtype, err_msg="o")
    assert_close(h_final, h_ref, dtype, err_msg="h_final")
    assert_close(states, states_ref, dtype, err_msg="states")


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(F32, id="float32"), pytest.param(BF16, id="bfloat16", marks=pytest.mark.slow)],
)
def test_forward_without_saved_states(dtype):
    """The primal-only path (`save_states=False`; float32 stages o in the state buffer)."""
    x = contract_inputs(8, 1, 1, 2, 64, 64, dtype, [(33,)])
    o, h_final, states = jax.jit(
        lambda x: pallas_gpu.forward(**x, chunk_size=C, save_states=False, interpret=True)
    )(x)
    assert_no_races()
    assert states is None
    o_ref, h_ref, _ = reference(**x)
    assert_close(o, o_ref, dtype, err_msg="o")
    assert_close(h_final, h_ref, dtype, err_msg="h_final")


# float32 runs its default-suite backward through test_op_pallas_gpu_matches_chunked.
@pytest.mark.parametrize("dtype, b, h, n, dk, dv, starts", _cases(FAST[1:], FAST[:1] + SLOW))
def test_backward_matches_vjp_of_chunk_scan(dtype, b, h, n, dk, dv, starts):
    x = contract_inputs(1, b, h, n, dk, dv, dtype, starts)
    do, dh_final = cotangents(2, x, dtype)
    _, _, states = reference(**x)  # the chunk-start states the forward saves (tested above)
    grads = jax.jit(kernel_backward)(x, states, do, dh_final)
    assert_no_races()

    def forward(q, k, v, gamma, beta, h0):
        o, h_final, _ = reference(q, k, v, gamma, beta, x["seg"], h0)
        return o, h_final

    names = ("q", "k", "v", "gamma", "beta", "h0")
    _, vjp = jax.vjp(forward, *(x[name].astype(F32) for name in names))
    expected = vjp((do.astype(F32), dh_final))
    tol = F32_GRAD_TOL if dtype == F32 else BF16_GRAD_TOL
    for name, got, want in zip(names, grads, expected, strict=True):
        assert got.shape == want.shape and got.dtype == F32, name
        np.testing.assert_allclose(
            np.asarray(got, np.float64), np.asarray(want, np.float64), err_msg=f"d{name}", **tol
        )


def _custom_calls(fn, *args):
    module = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    return set(re.findall(r"custom_call @(\w+)", module))


@pytest.mark.parametrize(
    "dtype, dk, dv", [(BF16, 128, 128), (F32, 64, 64), pytest.param(F32, 128, 128, id="f32-fwd")]
)
def test_exports_for_cuda_with_mosaic_gpu_calls(dtype, dk, dv):
    x = contract_inputs(3, 1, 2, 2, dk, dv, dtype, [(10,)])
    calls = _custom_calls(lambda x: kernel_forward(x, interpret=False), x)
    assert any(name.startswith("mosaic_gpu") for name in calls), calls
    if dtype == F32 and dk == 128:
        return  # the float32 K = 128 backward is unsupported (see test_rejects_unsupported)
    states = jnp.zeros((1, 2, 2, dk, dv), F32)
    do, dh_final = cotangents(4, x, dtype)
    calls = _custom_calls(
        lambda x, s, do, dh: kernel_backward(x, s, do, dh, interpret=False), x, states, do, dh_final
    )
    assert any(name.startswith("mosaic_gpu") for name in calls), calls


def test_rejects_unsupported_and_bad_inputs():
    x = contract_inputs(5, 1, 1, 2, 64, 64, F32, [()])
    with pytest.raises(NotImplementedError, match="chunk_size"):
        pallas_gpu.forward(**x, chunk_size=32, save_states=False, interpret=True)
    wide = contract_inputs(5, 1, 1, 2, 96, 64, F32, [()])
    with pytest.raises(NotImplementedError, match="K=96"):
        pallas_gpu.forward(**wide, chunk_size=C, save_states=False, interpret=True)
    half = {**x, **{n: x[n].astype(jnp.float16) for n in ("q", "k", "v")}}
    with pytest.raises(NotImplementedError, match="float32 or bfloat16"):
        pallas_gpu.forward(**half, chunk_size=C, save_states=False, interpret=True)
    with pytest.raises(ValueError, match="seg"):
        pallas_gpu.forward(**{**x, "seg": x["seg"][:, :1]}, chunk_size=C, save_states=False,
                           interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="h0"):
        pallas_gpu.forward(**{**x, "h0": x["h0"][..., :32]}, chunk_size=C, save_states=False,
                           interpret=True)  # fmt: skip
    big = contract_inputs(5, 1, 1, 2, 128, 64, F32, [()])
    states = jnp.zeros((1, 1, 2, 128, 64), F32)
    do, dh_final = cotangents(6, big, F32)
    with pytest.raises(NotImplementedError, match="shared memory"):
        kernel_backward(big, states, do, dh_final)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(F32, id="float32"), pytest.param(BF16, id="bfloat16", marks=pytest.mark.slow)],
)
def test_op_pallas_gpu_matches_chunked(dtype):
    """`gated_delta_rule(impl="pallas_gpu", interpret=True)` against `impl="chunked"`: T not a
    multiple of the chunk, grouped heads, initial state, packed segments; output, final state and
    every gradient."""
    from seqlab.ops import gated_delta_rule

    b, t, h, hv, d = 1, 100, 1, 2, 64
    r = np.random.default_rng(7)
    k = r.normal(size=(b, t, h, d))
    x = dict(
        q=r.normal(size=(b, t, h, d)),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=r.normal(size=(b, t, hv, d)),
        g=np.log(r.uniform(0.8, 1.0, size=(b, t, hv))),
        beta=r.uniform(0.05, 1.0, size=(b, t, hv)),
        initial_state=r.normal(size=(b, hv, d, d)),
    )
    x = {name: jnp.asarray(a, dtype if name in ("q", "k", "v") else F32) for name, a in x.items()}
    segment_ids = jnp.asarray(np.repeat([[3, 9, 4]], [30, 50, 20], axis=1), jnp.int32)

    def run(impl):
        def loss(x):
            o, s = gated_delta_rule(
                **x, segment_ids=segment_ids, output_final_state=True, impl=impl,
                interpret=impl == "pallas_gpu",
            )  # fmt: skip
            o32 = o.astype(F32)
            return jnp.sum(jnp.sin(o32) * o32) + jnp.sum(jnp.cos(s) * s), (o, s)

        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
        return out, grads

    (o, s), grads = run("pallas_gpu")
    assert_no_races()
    (o_ref, s_ref), grads_ref = run("chunked")
    assert_close(o, o_ref, dtype, err_msg="o")
    assert_close(s, s_ref, dtype, err_msg="final_state")
    tol = F32_GRAD_TOL if dtype == F32 else BF16_GRAD_TOL
    for name in x:
        np.testing.assert_allclose(
            np.asarray(grads[name], np.float64),
            np.asarray(grads_ref[name], np.float64),
            err_msg=f"d{name}",
            **tol,
        )
