"""Tests of the Mosaic GPU state-pass kernel `seqlab.kernels.gated_delta.pallas_gpu`.

On a CPU-only machine the kernel runs in the Mosaic GPU interpret mode (race detection on,
uninitialized memory NaN) against a `lax.scan` of the same recurrence (forward, reversed with
`y`, and the custom VJP against autodiff of the scan), the public op against `impl="chunked"`,
and the kernel lowers for CUDA through `jax.export`, whose module must carry the Mosaic GPU
custom call. With `SEQLAB_GPU_KERNELS=compiled` (on a Hopper GPU) the same tests compile the
kernel for the chip instead of interpreting it.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from seqlab.kernels.gated_delta import pallas_gpu, vjp
from seqlab.ops import gated_delta_rule
from tests.ops.recurrences import forward_and_grads, inputs, segment_rows
from tests.ops.trained_like import rel_rms

INTERPRET = os.environ.get("SEQLAB_GPU_KERNELS", "interpret") != "compiled"
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
# The kernel multiplies float32 values as bfloat16 (hi, lo) pairs: 16 significant bits, so each
# product errs by ~2^-17 of its terms' magnitude rather than of its own. Entries that are small
# next to their terms (cancellation) then miss an elementwise float32 tolerance although the
# whole array is float32-accurate in norm (measured relative RMS error <= 8e-6 against the
# float32 scan, forward and VJP): the kernel's outputs are compared in relative RMS.
SPLIT_REL_RMS = 3e-5


def assert_rel_rms(got, want, tol, err_msg):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = rel_rms(got, want)
    assert err <= tol, f"{err_msg}: relative RMS error {err:.2e} > {tol:.0e}"


def assert_no_races():
    if INTERPRET:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

        assert not gpu_callbacks.get_races().races_found, "interpret mode detected a race"


def scan_inputs(seed, b, h, n, c, dk, dv, *, with_y):
    """Kernel arguments of unit scale; decays in (0.5, 1) with one zero (a segment start)."""
    r = np.random.default_rng(seed)
    x = dict(
        a=r.normal(size=(b, h, n, c, dk)) * dk**-0.5,
        b=r.normal(size=(b, h, n, dk, c)) * c**-0.5,
        x=r.normal(size=(b, h, n, c, dv)),
        d=r.uniform(0.5, 1.0, size=(b, h, n)),
        h0=r.normal(size=(b, h, dk, dv)),
    )
    x["d"][..., -1] = 0.0
    if with_y:
        x["y"] = r.normal(size=(b, h, n, dk, dv))
    return {name: jnp.asarray(a, F32) for name, a in x.items()}


def reference(a, b, x, d, h0, y=None, *, reverse=False):
    """`lax.scan` per (batch, head) of `out = x + a S`, `S' = d S + b out (+ y)`."""

    def per_head(a, b, x, d, h0, y):
        def step(s, xs):
            a_n, b_n, x_n, d_n, y_n = xs
            hi = lax.Precision.HIGHEST
            out = x_n + jnp.matmul(a_n, s, precision=hi)
            s_next = d_n * s + jnp.matmul(b_n, out, precision=hi)
            return (s_next if y_n is None else s_next + y_n), (s, out)

        final, (states, out) = lax.scan(step, h0, (a, b, x, d, y), reverse=reverse)
        return states, out, final

    return jax.vmap(jax.vmap(per_head))(a, b, x, d, h0, y)


# (B, H, N, C, K, V, reversed with y)
FAST = [(1, 2, 3, 64, 64, 64, False), (1, 1, 2, 64, 128, 128, True)]
SLOW = [(2, 1, 3, 64, 64, 128, True), (1, 2, 2, 64, 128, 64, False), (1, 1, 2, 128, 64, 64, True)]


def _cases():
    def ident(case):
        return f"B{case[0]}H{case[1]}N{case[2]}C{case[3]}K{case[4]}V{case[5]}" + "-rev" * case[6]

    fast = [pytest.param(*case, id=ident(case)) for case in FAST]
    return fast + [pytest.param(*case, id=ident(case), marks=pytest.mark.slow) for case in SLOW]


@pytest.mark.parametrize("b, h, n, c, dk, dv, rev", _cases())
def test_state_scan_matches_lax_scan(b, h, n, c, dk, dv, rev):
    x = scan_inputs(0, b, h, n, c, dk, dv, with_y=rev)
    got = pallas_gpu.state_scan(**x, reverse=rev, interpret=INTERPRET)
    assert_no_races()
    want = reference(**x, reverse=rev)
    for name, g, w in zip(("states", "out", "final"), got, want, strict=True):
        assert_rel_rms(g, w, SPLIT_REL_RMS, name)


@pytest.mark.parametrize("b, h, n, c, dk, dv, rev", _cases()[:1] + _cases()[2:3])
def test_state_scan_vjp_matches_autodiff_of_lax_scan(b, h, n, c, dk, dv, rev):
    del rev  # the VJP itself runs the kernel in reverse
    x = scan_inputs(1, b, h, n, c, dk, dv, with_y=False)
    r = np.random.default_rng(2)
    shapes = jax.eval_shape(lambda x: reference(**x), x)
    cot = jax.tree.map(lambda s: jnp.asarray(r.normal(size=s.shape), F32), shapes)
    names = ("a", "b", "x", "d", "h0")

    def kernel(*args):
        return vjp.state_scan(64, INTERPRET, *args)

    def ref(*args):
        return reference(*args)

    _, pull = jax.vjp(kernel, *(x[n] for n in names))
    got = pull(cot)
    assert_no_races()
    _, pull_ref = jax.vjp(ref, *(x[n] for n in names))
    for name, g, w in zip(names, got, pull_ref(cot), strict=True):
        assert_rel_rms(g, w, SPLIT_REL_RMS, f"d{name}")


def _float_round_trips(fn, x):
    """The float32 -> bfloat16 -> float32 conversion pairs in the jaxpr of `fn(x)`."""
    jaxpr = jax.make_jaxpr(fn)(x).jaxpr
    to_bf16 = {e.outvars[0] for e in jaxpr.eqns if e.outvars[0].aval.dtype == BF16}
    return [
        e for e in jaxpr.eqns
        if e.primitive.name == "convert_element_type" and set(e.invars) & to_bf16
    ]  # fmt: skip


def test_xla_split_has_no_float_round_trip_and_is_float32_accurate():
    """XLA's GPU pipeline removes float32 -> bfloat16 -> float32 conversion pairs (excess
    precision), which zeroed `lo` on an H200: the XLA-side split has no such pair (the
    in-register `split` has one, which shows the check can fail), and `hi + lo` keeps ~16 bits."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=4096), F32)
    assert _float_round_trips(pallas_gpu.split, x)
    assert not _float_round_trips(pallas_gpu.split_in_xla, x)
    hi, lo = jax.jit(pallas_gpu.split_in_xla)(x)
    assert rel_rms(pallas_gpu.join(hi, lo), x) <= 2**-15


def _custom_calls(fn, *args):
    module = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
    return re.findall(r"stablehlo.custom_call @(\w+)", module)


@pytest.mark.parametrize("dk, dv", [(64, 64), (128, 128)])
def test_exports_for_cuda_with_mosaic_gpu_calls(dk, dv):
    """The forward and the VJP lower for CUDA on this CPU, one Mosaic GPU call per pass."""
    x = scan_inputs(3, 1, 2, 2, 64, dk, dv, with_y=False)
    args = tuple(x[n] for n in ("a", "b", "x", "d", "h0"))

    def fwd(*args):
        return vjp.state_scan(64, False, *args)

    def grad(*args):
        return jax.grad(lambda *z: sum(jnp.sum(o**2) for o in fwd(*z)), argnums=range(5))(*args)

    assert _custom_calls(fwd, *args).count("mosaic_gpu_v2") == 1
    assert _custom_calls(grad, *args).count("mosaic_gpu_v2") == 2


def test_rejects_unsupported_and_bad_inputs():
    x = scan_inputs(5, 1, 1, 2, 64, 64, 64, with_y=False)
    short = scan_inputs(5, 1, 1, 2, 32, 64, 64, with_y=False)
    with pytest.raises(NotImplementedError, match="chunk_size=32"):
        pallas_gpu.state_scan(**short, reverse=False, interpret=True)
    wide = scan_inputs(5, 1, 1, 2, 64, 96, 64, with_y=False)
    with pytest.raises(NotImplementedError, match="K=96"):
        pallas_gpu.state_scan(**wide, reverse=False, interpret=True)
    with pytest.raises(NotImplementedError, match="block_v=32"):
        pallas_gpu.state_scan(**x, reverse=False, block_v=32, interpret=True)
    with pytest.raises(ValueError, match="x: expected shape"):
        pallas_gpu.state_scan(**{**x, "x": x["x"][..., :1, :]}, reverse=False, interpret=True)
    with pytest.raises(ValueError, match="h0: expected shape"):
        pallas_gpu.state_scan(**{**x, "h0": x["h0"][..., :32]}, reverse=False, interpret=True)
    big = scan_inputs(5, 1, 1, 2, 128, 128, 128, with_y=True)
    with pytest.raises(NotImplementedError, match="shared memory"):
        pallas_gpu.state_scan(**big, reverse=True, interpret=True)
    q = jnp.zeros((1, 64, 1, 64), jnp.float16)
    with pytest.raises(NotImplementedError, match="float32 or bfloat16"):
        gated_delta_rule(q, q, q, q[..., 0], q[..., 0], impl="pallas_gpu", interpret=True)
    f32 = (q.astype(F32),) * 3, q[..., 0].astype(F32), q[..., 0].astype(F32)
    with pytest.raises(NotImplementedError, match="chunk_size=48"):
        gated_delta_rule(*f32[0], *f32[1:], impl="pallas_gpu", chunk_size=48, interpret=True)
    k256 = jnp.zeros((1, 64, 1, 256), F32)
    with pytest.raises(NotImplementedError, match="K=256"):
        gated_delta_rule(k256, k256, q.astype(F32), *f32[1:], impl="pallas_gpu", interpret=True)


@pytest.mark.parametrize(
    "dtype, dk, dv, chunk, want",
    [
        (F32, 128, 256, 64, "pallas_gpu"),
        (BF16, 32, 96, 128, "pallas_gpu"),  # padded to K = 64, V = 128
        (BF16, 256, 512, 64, "chunked"),  # K > 128: the state block does not fit in registers
        (F32, 64, 64, 32, "chunked"),  # the kernel's chunks are 64 or 128
        (jnp.dtype(jnp.float64), 64, 64, 64, "chunked"),  # no float64 kernel
    ],
)
def test_auto_on_hopper_picks_the_kernel_where_it_runs(monkeypatch, dtype, dk, dv, chunk, want):
    """`impl=None` on a Hopper GPU: the kernel where it takes the inputs, else `"chunked"`
    (the explicit name raises instead, above)."""
    from seqlab.ops import _chunked
    from seqlab.ops import gated_delta as gd

    monkeypatch.setattr(_chunked, "target_platform", lambda: "gpu")
    monkeypatch.setattr(_chunked, "_has_kernel_hardware", lambda platform: platform == "gpu")
    assert gd.resolve_impl(None, dtype, dk, dv, chunk) == want
    if want == "chunked":
        with pytest.raises(NotImplementedError, match="impl='pallas_gpu'"):
            gd.resolve_impl("pallas_gpu", dtype, dk, dv, chunk)


@pytest.mark.parametrize(
    "dtype, dk, dv",
    [
        pytest.param(F32, 64, 64, id="float32"),
        # K and V the kernel does not take as they are: zero-padded to K = 64, V = 128.
        pytest.param(F32, 32, 96, id="float32-padded"),
        pytest.param(BF16, 64, 64, id="bfloat16", marks=pytest.mark.slow),
    ],
)
def test_op_pallas_gpu_matches_chunked(dtype, dk, dv):
    """`gated_delta_rule(impl="pallas_gpu")` against `impl="chunked"`: T not a multiple of the
    chunk, grouped heads, initial state, packed segments; output, final state, every gradient.
    Both share the chunk-parallel XLA part, so they differ only by the state pass."""
    x = inputs(7, 1, 100, 1, 2, dk, dv, F32)
    x = {n: a.astype(dtype) if n in ("q", "k", "v") else a for n, a in x.items()}
    seg = segment_rows([[30, 50, 20]])

    def op(impl):
        def fn(**x):
            return gated_delta_rule(
                **x, segment_ids=seg, impl=impl, interpret=INTERPRET and impl == "pallas_gpu"
            )

        return fn

    (o, s), grads = forward_and_grads(op("pallas_gpu"), x)
    assert_no_races()
    (o_ref, s_ref), grads_ref = forward_and_grads(op("chunked"), x)
    # float32: the state pass's split products (SPLIT_REL_RMS; measured <= 5.4e-6). bfloat16:
    # both round o to bfloat16 (2^-9 relative) and an entry near a rounding boundary may round
    # either way, which the gradients inherit through o (measured <= 2.0e-4, dq): 1e-3.
    tol = SPLIT_REL_RMS if dtype == F32 else 1e-3
    pairs = [("o", o, o_ref), ("final_state", s, s_ref)]
    pairs += [(f"d{n}", grads[n], grads_ref[n]) for n in grads_ref]
    for name, g, w in pairs:
        assert_rel_rms(g, w, tol, name)


def _mesh(axis_type):
    axis_types = (getattr(jax.sharding.AxisType, axis_type),) * 2
    return jax.make_mesh((2, 2), ("data", "heads"), axis_types, devices=jax.devices()[:4])


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_under_a_mesh_the_kernel_runs_per_shard(axis_type):
    """Under a `(data, heads)` mesh the whole op (chunk-parallel XLA part and kernel) runs per
    shard in a `shard_map`: the CUDA export puts the Mosaic GPU calls (forward; forward and
    reverse pass with the gradient) inside the manual computation. Interpreting the kernel on 4
    devices at once is not possible here (jax 0.10's GPU interpreter deadlocks on 2 cores; jax
    0.11's reports another device's barriers as leaked), so the numerics of the per-shard
    wrapper are checked with the same op around the `lax.scan` state pass below."""
    x = inputs(3, 2, 40, 2, 2, 64, 64, F32)

    def fn(x):
        return gated_delta_rule(**x, impl="pallas_gpu")[0]

    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        placed = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("data")))
        for f, kernels in ((fn, 1), (jax.grad(lambda x: jnp.sum(fn(x))), 2)):
            module = jax.export.export(jax.jit(f), platforms=["cuda"])(placed).mlir_module()
            manual = module[module.index("manual_computation") :]
            assert re.findall(r"custom_call @(\w+)", manual).count("mosaic_gpu_v2") == kernels


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_per_shard_chunked_form_matches_unsharded(axis_type):
    """`api.per_shard` with the op's specs around the chunked form (the XLA part of
    `"pallas_gpu"`, here with its `lax.scan` state pass): same values and gradients."""
    from seqlab.kernels.gated_delta import api
    from seqlab.ops import gated_delta as gd

    x = inputs(3, 2, 40, 2, 2, 64, 64, F32)
    x = {**x, "seg": jnp.zeros((2, 40), jnp.int32)}
    bthd, bh = (api.BATCH, None, api.HEADS), (api.BATCH, api.HEADS)
    specs = (bthd, bthd, bthd, bthd, bthd, bh, (api.BATCH,))
    names = ("q", "k", "v", "g", "beta", "initial_state", "seg")

    def loss(x):
        args = tuple(x[n] for n in names)
        o, final = api.per_shard(
            functools.partial(gd._chunked_form, chunk_size=64), args, specs, (bthd, bh)
        )
        return jnp.sum(jnp.sin(o) * o) + jnp.sum(jnp.cos(final) * final), (o, final)

    floats = {n: a for n, a in x.items() if n != "seg"}

    def run(floats, seg):
        return jax.jit(jax.value_and_grad(lambda f: loss({**f, "seg": seg}), has_aux=True))(floats)

    (_, want), want_grads = run(floats, x["seg"])
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        placed = jax.device_put(floats, jax.sharding.NamedSharding(mesh, jax.P("data")))
        seg = jax.device_put(x["seg"], jax.sharding.NamedSharding(mesh, jax.P("data")))
        (_, got), got_grads = run(placed, seg)
    for name, g, w in [*zip(("o", "final"), got, want, strict=True),
                       *((f"d{n}", got_grads[n], want_grads[n]) for n in want_grads)]:  # fmt: skip
        # The same math per shard; XLA compiles the per-shard program with other fusions and
        # reduction orders, so float32 round-off differs (measured 1.1e-6).
        assert_rel_rms(g, w, 1e-5, name)
