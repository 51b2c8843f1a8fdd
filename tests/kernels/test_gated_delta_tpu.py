"""The Mosaic TPU kernels of the gated delta rule: interpret mode on CPU against the chunked oracle
(output, final state, every gradient), lowering for TPU with `jax.export`, and sharded runs.

Interpret mode runs with race detection and NaN-filled uninitialized memory
(`pallas_tpu.INTERPRET_PARAMS`); shapes stay small because interpreting is slow.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from seqlab.kernels.gated_delta import api, pallas_tpu
from seqlab.ops.gated_delta import gated_delta_rule
from tests.ops.recurrences import assert_all_close, forward_and_grads, inputs, segment_rows

CASES = {
    # T not a multiple of the chunk, grouped heads (HV = 2 H), initial state, packed segments.
    "f32-k64-state-segments": dict(dtype=jnp.float32, t=100, chunk=64, d=64, state=True, seg=True),
    "f32-k128-plain": dict(dtype=jnp.float32, t=75, chunk=32, d=128, state=False, seg=False),
    "bf16-k64-state-segments": dict(
        dtype=jnp.bfloat16, t=100, chunk=64, d=64, state=True, seg=True
    ),
}


def case_inputs(dtype, t, d, state, seg, b=1, seed=0):
    x = inputs(seed, b, t, 1, 2, d, d, dtype, initial_state=state)
    if state:
        x["initial_state"] = x["initial_state"].astype(jnp.float32)
    if seg:
        x["segment_ids"] = segment_rows([[t // 3, 17, t - t // 3 - 17]] * b)
    return x


def op(impl, chunk, **kw):
    segment_ids = kw.pop("segment_ids", None)

    def fn(**x):
        return gated_delta_rule(**x, segment_ids=segment_ids, chunk_size=chunk, impl=impl, **kw)

    return fn


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpret_matches_chunked_oracle(name):
    c = CASES[name]
    x = case_inputs(c["dtype"], c["t"], c["d"], c["state"], c["seg"])
    seg = {"segment_ids": x.pop("segment_ids")} if c["seg"] else {}
    got = forward_and_grads(op("pallas_tpu", c["chunk"], interpret=True, **seg), x)
    want = forward_and_grads(op("chunked", c["chunk"], **seg), x)
    assert_all_close(got, want, c["dtype"])


def test_pallas_on_cpu_is_the_interpreted_tpu_kernel():
    x = case_inputs(jnp.float32, 20, 64, True, False)
    got = gated_delta_rule(**x, impl="pallas", chunk_size=16, output_final_state=True)
    want = gated_delta_rule(**x, impl="chunked", chunk_size=16, output_final_state=True)
    assert_all_close((got, {}), (want, {}), jnp.float32)
    with pytest.raises(ValueError, match="interpret"):  # no silent switch to interpret mode
        gated_delta_rule(**x, impl="pallas_tpu", chunk_size=16)


def test_unused_final_state_gradient():
    """Cotangent of the final state is zero when it is not returned."""
    x = case_inputs(jnp.float32, 40, 64, True, False)

    def loss(impl, **kw):
        return jax.grad(lambda x: jnp.sum(gated_delta_rule(**x, chunk_size=32, impl=impl, **kw)[0]))

    assert_close_tree = functools.partial(assert_all_close, dtype=jnp.float32)
    got = loss("pallas_tpu", interpret=True)(x)
    want = loss("chunked")(x)
    assert_close_tree(((jnp.zeros(()), jnp.zeros(())), got), ((jnp.zeros(()), jnp.zeros(())), want))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(dtype=jnp.float64), "float32 or bfloat16"),
        (dict(chunk_size=24), "multiple of 16"),
    ],
)
def test_unsupported_raises_not_implemented(change, match):
    x = case_inputs(change.get("dtype", jnp.float32), 20, 64, False, False)
    with pytest.raises(NotImplementedError, match=match):
        gated_delta_rule(
            **x, impl="pallas_tpu", interpret=True, chunk_size=change.get("chunk_size", 16)
        )


def _export(platform, impl, d=128):
    s = jax.ShapeDtypeStruct
    args = [s((2, 192, 2, d), jnp.bfloat16)] * 3 + [s((2, 192, 2), jnp.float32)] * 2

    def fwd(q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, impl=impl, output_final_state=True)

    def loss(*args):
        o, final = fwd(*args)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final)

    grad = jax.grad(loss, argnums=range(5))
    return [
        jax.export.export(jax.jit(f), platforms=[platform])(*args).mlir_module()
        for f in (fwd, grad)
    ]


def test_export_for_tpu_contains_the_kernels():
    fwd, grad = _export("tpu", "pallas_tpu")
    for module, kernels in (
        (fwd, ["gated_delta_fwd"]),
        (grad, ["gated_delta_fwd", "gated_delta_bwd"]),
    ):
        assert re.findall(r"stablehlo.custom_call @(\w+)", module).count("tpu_custom_call") == len(
            kernels
        )
        for name in kernels:
            assert name in module
    assert "gated_delta_bwd" not in fwd


def test_export_of_the_public_op_for_cuda_contains_the_gpu_kernels():
    fwd, grad = _export("cuda", "pallas_gpu")
    calls = [re.findall(r"stablehlo.custom_call @(\w+)", m) for m in (fwd, grad)]
    assert [c.count("mosaic_gpu_v2") for c in calls] == [1, 2]


@pytest.mark.parametrize("axis_type", ["Explicit", pytest.param("Auto", marks=pytest.mark.slow)])
def test_sharded_over_data_and_heads_matches_unsharded(axis_type):
    axis_types = (getattr(jax.sharding.AxisType, axis_type),) * 2
    mesh = jax.make_mesh((2, 2), ("data", "heads"), axis_types, devices=jax.devices()[:4])
    x = inputs(3, 2, 40, 2, 2, 64, 64, jnp.float32)
    fn = op("pallas_tpu", 32, interpret=True)
    want = forward_and_grads(fn, x)
    with jax.set_mesh(mesh):
        placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        got = forward_and_grads(fn, placed)
        lowered = jax.jit(lambda x: fn(**x)).lower(placed).as_text()
    assert "manual_computation" in lowered or "shard_map" in lowered
    assert_all_close(got, want, jnp.float32)


def test_mesh_that_does_not_divide_heads_raises():
    mesh = jax.make_mesh((1, 4), ("data", "heads"), devices=jax.devices()[:4])
    x = inputs(4, 1, 16, 1, 2, 64, 64, jnp.float32)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="heads size 2"):
        gated_delta_rule(**x, impl="pallas_tpu", interpret=True, chunk_size=16)


def test_block_sizes_are_data():
    assert api.BlockSizes().chunk == 64
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        api.BlockSizes(chunk=40)
    assert pallas_tpu.INTERPRET_PARAMS.detect_races
    np.testing.assert_equal(pallas_tpu.INTERPRET_PARAMS.uninitialized_memory, "nan")


@settings(max_examples=3)  # each draw interprets two kernels: keep the default run short
@given(
    t=st.integers(1, 70),
    groups=st.integers(1, 2),
    chunk=st.sampled_from([16, 32]),
    n_docs=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_interpret_matches_chunked_oracle_hypothesis(t, groups, chunk, n_docs, seed):
    """Random lengths, chunk sizes, head grouping and packed documents, small K = V = 16."""
    x = inputs(seed, 1, t, 1, groups, 16, 16, jnp.float32)
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, t + 1), n_docs - 1))
    lengths = np.diff(np.concatenate([[0], cuts, [t]])).tolist() if t > 1 else [t]
    seg = segment_rows([lengths])
    got = forward_and_grads(op("pallas_tpu", chunk, interpret=True, segment_ids=seg), x)
    want = forward_and_grads(op("chunked", chunk, segment_ids=seg), x)
    assert_all_close(got, want, jnp.float32)


def _kernel_dot_operands(dtype, *, backward: bool) -> list[str]:
    """The operand dtypes of every matmul inside the TPU kernel (forward or backward), in order."""
    b, h, t, d, c = 1, 1, 128, 64, 64
    n = t // c
    f32 = jnp.float32
    x = [jnp.zeros((b, h, t, d), dtype)] * 3
    token = [jnp.zeros((b, h, n, c), f32), jnp.zeros((b, h, n, c), f32), jnp.zeros((b, n, c), f32)]
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
    """float32 inputs: every in-kernel matmul on float32 operands. bf16 inputs: six of the eight
    products of a chunk on bf16 operands, `u`, the state update and the inverse's merges in
    float32 (`chunk.chunk_step`); in the backward, their VJPs likewise."""
    merges = 2  # chunk 64: inverse blocks of 16 merged twice, two products each
    f32 = _kernel_dot_operands(jnp.float32, backward=False)
    assert set(f32) == {"float32/float32"} and len(f32) == 8 + 2 * merges
    bf16 = _kernel_dot_operands(jnp.bfloat16, backward=False)
    assert bf16.count("bfloat16/bfloat16") == 6
    assert bf16.count("float32/float32") == 2 + 2 * merges
    backward = _kernel_dot_operands(jnp.bfloat16, backward=True)
    # Two VJP products per bf16 product, and the recomputed forward but for the two products
    # that only make `o` (`q S`, `scores v_new`: dead in the backward).
    assert backward.count("bfloat16/bfloat16") == 2 * 6 + 6 - 2
