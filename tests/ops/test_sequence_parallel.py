"""Sequence parallelism (`seqlab.ops.sequence_parallel`): every op with its time axis split over a
mesh axis equals the single-device op of `seqlab.ops` on the global sequence, in outputs, final
states and every gradient (inputs and initial state): T divisible and not by the shard count,
`segment_ids` changing inside a shard and exactly at a shard boundary, an initial state, grouped
heads, correlated keys and write strengths near 1; then the argument errors.

Meshes: the axis "seq" over the 4 fake CPU devices of `tests/conftest.py`, or over 2 of them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from seqlab import ops
from seqlab.ops import sequence_parallel as sp
from tests.conftest import assert_close
from tests.ops.recurrences import gdn2_inputs, inputs, kda_inputs, ssd_inputs
from tests.ops.trained_like import correlated_keys

B, H, DK, DV = 2, 1, 8, 6
N_WRITES = 2  # Householder writes per token of gated_delta_product


def seq_mesh(shards: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:shards]), ("seq",))


def segments(t: int, cuts) -> jnp.ndarray:
    """`[B, T]` ids: row 0 changes at `cuts`, row 1 keeps one id."""
    row = np.searchsorted(np.asarray(cuts), np.arange(t), side="right")
    return jnp.asarray(np.stack([row, np.full(t, 7)]), jnp.int32)


def delta_inputs(make, seed, t, hv, *, rows_per_token=1):
    """`make`'s inputs (`tests/ops/recurrences.py`, float32) with correlated keys (neighbouring
    cosine 0.95) and write strengths near 1 (0.9..1) where the op has beta."""
    rng = np.random.default_rng(seed)
    x = make(seed, B, t * rows_per_token, H, hv, DK, DV, jnp.float32)
    x["k"] = jnp.asarray(correlated_keys(rng, x["k"].shape, 0.95), jnp.float32)
    if "beta" in x:
        x["beta"] = jnp.asarray(rng.uniform(0.9, 1.0, x["beta"].shape), jnp.float32)
    if rows_per_token > 1:  # q and g have one row per token
        x["q"], x["g"] = x["q"][:, :t], x["g"][:, :t]
    return x


def product_inputs(seed, t, hv):
    return delta_inputs(inputs, seed, t, hv, rows_per_token=N_WRITES)


# op name -> (inputs, static keyword arguments). The sharding does not depend on the impl: the
# chunked forms (impl None on CPU) run for the gated delta rule and SSD; kda, gdn2 and
# gated_delta_product run their token-by-token references, whose compilation is 4x cheaper (their
# chunked forms equal the references in tests/ops/test_recurrences.py).
RECURRENCES = {
    "gated_delta_rule": (functools.partial(delta_inputs, inputs), {}),
    "kda": (functools.partial(delta_inputs, kda_inputs), {"impl": "recurrent"}),
    "gdn2": (functools.partial(delta_inputs, gdn2_inputs), {"impl": "recurrent"}),
    "gated_delta_product": (
        product_inputs,
        {"num_householder": N_WRITES, "impl": "recurrent"},
    ),
    "ssd": (functools.partial(delta_inputs, ssd_inputs), {}),
}


def grads_of(fn, args, cotangents):
    """Value of `fn(*args)` and the gradients w.r.t. every arg of `<fn(*args), cotangents>`."""

    def loss(*a):
        return sum(jnp.vdot(o, c) for o, c in zip(fn(*a), cotangents, strict=True))

    return fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def random_like(tree, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), tree)


def check_against_op(name, sharded, single, args, seed=0):
    """Outputs and every gradient of `sharded` and `single` (same arguments) agree."""
    cotangents = random_like(jax.eval_shape(single, *args), seed)
    got, got_grads = jax.jit(functools.partial(grads_of, sharded))(args, cotangents)
    want, want_grads = jax.jit(functools.partial(grads_of, single))(args, cotangents)
    assert_close(got, want, err_msg=f"{name}: outputs")
    assert_close(got_grads, want_grads, err_msg=f"{name}: gradients")


@pytest.mark.parametrize("op_name", list(RECURRENCES))
def test_recurrence_matches_single_device(op_name):
    """4 shards, T = 22 (padded to 24, 6 tokens per shard), segments changing at t = 6 (a shard
    boundary) and t = 9 (inside shard 1), initial state, grouped heads except gdn2 (H = HV)."""
    make, static = RECURRENCES[op_name]
    t, hv = 22, 1 if op_name == "gdn2" else 2
    x = make(seed=3, t=t, hv=hv)
    x["segment_ids"] = segments(t, [6, 9])
    names = [n for n in x if n not in ("initial_state", "segment_ids")]
    seg = x["segment_ids"]
    kw = dict(static, output_final_state=True, chunk_size=4)
    sharded = sp.shard_time(op_name, seq_mesh(4), **kw)

    def run_sharded(*a):
        return sharded(*a[:-1], initial_state=a[-1], segment_ids=seg)

    def run_single(*a):
        return getattr(ops, op_name)(*a[:-1], initial_state=a[-1], segment_ids=seg, **kw)

    args = (*(x[n] for n in names), x["initial_state"])
    check_against_op(op_name, run_sharded, run_single, args)


def test_per_shard_function_inside_shard_map_float64():
    """`gated_delta_rule` of this module in a hand-written `jax.shard_map` (2 shards, T = 16
    divisible, float64, no segments, default initial state): the final state leaves with
    `out_specs=P()` under the default `check_vma=True`."""
    x = delta_inputs(inputs, seed=5, t=16, hv=2)
    del x["initial_state"]
    x = {n: a.astype(jnp.float64) for n, a in x.items()}
    kw = dict(output_final_state=True, impl="recurrent")
    local = functools.partial(sp.gated_delta_rule, axis_name="seq", **kw)
    specs = tuple(P(None, "seq") for _ in x)
    sharded = jax.shard_map(
        lambda *a: local(*a), mesh=seq_mesh(2), in_specs=specs, out_specs=(P(None, "seq"), P())
    )
    single = functools.partial(ops.gated_delta_rule, **kw)
    check_against_op("gated_delta_rule", sharded, single, tuple(x.values()))


def test_tpu_kernel_pieces_under_unchecked_shard_map():
    """The pieces run by the Mosaic TPU kernel (`impl="pallas"`: interpreted on CPU), as the
    sequence-parallel train step on a TPU runs them: inside a `shard_map` with
    `check_vma=False` (the kernel's backward mixes typed and untyped values), 2 shards of 16
    tokens, the local value width `V + K` of the identity columns, outputs and gradients."""
    x = delta_inputs(inputs, seed=6, t=32, hv=2)
    kw = dict(output_final_state=True, chunk_size=16)
    local = functools.partial(sp.gated_delta_rule, axis_name="seq", impl="pallas", **kw)
    specs = (*(P(None, "seq") for _ in range(5)), P())
    sharded = jax.shard_map(
        lambda *a: local(*a[:-1], initial_state=a[-1]),
        mesh=seq_mesh(2),
        in_specs=specs,
        out_specs=(P(None, "seq"), P()),
        check_vma=False,
    )

    def single(*a):
        return ops.gated_delta_rule(*a[:-1], initial_state=a[-1], impl="chunked", **kw)

    args = (*(x[n] for n in ("q", "k", "v", "g", "beta")), x["initial_state"])
    check_against_op("gated_delta_rule", sharded, single, args)


@pytest.mark.parametrize(
    ("shards", "t", "softplus"), [(4, 22, True), (2, 16, False)], ids=["pad-softplus", "divisible"]
)
def test_selective_scan_matches_single_device(shards, t, softplus):
    """Every argument's gradient, with `delta_bias` under softplus (padding `delta = -inf`) and
    without (padding `delta = -delta_bias`), skip `D`, gate `z` and an initial state."""
    rng = np.random.default_rng(1)
    d, n = 5, 3

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    delta = normal(B, t, d) if softplus else jnp.asarray(rng.uniform(0.1, 1, (B, t, d)), "f4")
    args = (
        normal(B, t, d), delta, -jnp.exp(normal(d, n)), normal(B, t, n), normal(B, t, n),
        normal(d), normal(B, t, d), jnp.asarray(rng.uniform(0, 0.5, d), jnp.float32),
        normal(B, d, n),
    )  # fmt: skip
    kw = dict(delta_softplus=softplus, return_final_state=True)
    sharded = sp.shard_time("selective_scan", seq_mesh(shards), **kw)

    def run_sharded(*a):
        return sharded(*a[:7], delta_bias=a[7], initial_state=a[8])

    def run_single(*a):
        return ops.selective_scan(*a[:7], delta_bias=a[7], initial_state=a[8], **kw)

    check_against_op("selective_scan", run_sharded, run_single, args)


@pytest.mark.parametrize(("shards", "t"), [(4, 22), (2, 16)], ids=["pad", "divisible"])
def test_causal_conv1d_matches_single_device(shards, t):
    """Halo exchange of `W - 1 = 3` inputs; with padding, zeros before `initial_state`."""
    rng = np.random.default_rng(2)
    d = 5
    args = tuple(
        jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((B, t, d), (4, d), (d,), (B, 3, d))
    )
    sharded = sp.shard_time("causal_conv1d", seq_mesh(shards), return_final_state=True)

    def run_sharded(x, w, b, s):
        return sharded(x, w, b, initial_state=s)

    def run_single(x, w, b, s):
        return ops.causal_conv1d(x, w, b, initial_state=s, return_final_state=True)

    check_against_op("causal_conv1d", run_sharded, run_single, args)


@pytest.mark.parametrize("window", [None, 3, 9], ids=["global", "halo", "window-gathered"])
def test_attention_matches_single_device(window):
    """4 shards, T = 22 (6 tokens per shard): global attention and a window longer than a shard
    gather k and v; `window = 3` takes the previous shard's last 2 keys. Grouped heads."""
    rng = np.random.default_rng(4)
    t = 22
    shapes = ((B, t, 4, DK), (B, t, 2, DK), (B, t, 2, DV))
    args = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)
    sharded = sp.shard_time("attention", seq_mesh(4), window=window)
    positions = jnp.arange(t)

    def run_single(q, k, v):
        return ops.attention(q, k, v, q_positions=positions, k_positions=positions, window=window)

    check_against_op("attention", lambda *a: (sharded(*a),), lambda *a: (run_single(*a),), args)


def test_shard_time_errors():
    mesh = seq_mesh(2)
    with pytest.raises(ValueError, match="op_name"):
        sp.shard_time("mamba", mesh)
    with pytest.raises(ValueError, match="axis_name"):
        sp.shard_time("ssd", mesh, axis_name="time")
    with pytest.raises(ValueError, match=r"static_kwargs.*window"):
        sp.shard_time("ssd", mesh, window=4)
    x = delta_inputs(inputs, 0, 8, 2)
    with pytest.raises(ValueError, match="beta"):  # the op's own check, on the global shapes
        sp.shard_time("gated_delta_rule", mesh)(x["q"], x["k"], x["v"], x["g"], x["beta"][:, :4])
    conv = sp.shard_time("causal_conv1d", seq_mesh(4))
    with pytest.raises(ValueError, match="W - 1 = 3 tokens per shard"):
        conv(jnp.zeros((1, 8, 2)), jnp.zeros((4, 2)))


def test_per_shard_axis_name_error():
    local = functools.partial(sp.ssd, axis_name="time")
    x = delta_inputs(ssd_inputs, 0, 8, 2)
    sharded = jax.shard_map(
        lambda q, k, v, g: local(q, k, v, g)[0], mesh=seq_mesh(2),
        in_specs=P(None, "seq"), out_specs=P(None, "seq"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="axis_name 'time'"):
        sharded(x["q"], x["k"], x["v"], x["g"])
