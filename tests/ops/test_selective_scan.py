"""Tests for seqlab.ops.selective_scan: the reference against the equation, the parallel path
against the reference (forward, final state, every gradient), dtypes, errors, jit, causality."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqlab.ops.selective_scan import selective_scan
from tests.conftest import assert_close

ALL_OPTIONS = frozenset({"D", "z", "delta_bias", "delta_softplus", "initial_state"})
# No optional input, each one alone, and all of them.
OPTION_SETS = [frozenset(), *(frozenset({o}) for o in sorted(ALL_OPTIONS)), ALL_OPTIONS]
FLOAT_ARGS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")


def make_inputs(seed, batch, length, dim, state, dtype, options=ALL_OPTIONS):
    """Random arguments for `selective_scan` as a dict; absent options are left out.

    Without softplus, `delta` is drawn positive (a step size); `A` is negative, as in Mamba.
    """
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)

    softplus = "delta_softplus" in options
    delta = (
        normal(batch, length, dim)
        if softplus
        else jnp.asarray(rng.uniform(0.05, 0.6, (batch, length, dim)), dtype)
    )
    args = dict(
        u=normal(batch, length, dim),
        delta=delta,
        A=-jnp.exp(normal(dim, state, scale=0.5)),
        B=normal(batch, length, state),
        C=normal(batch, length, state),
    )
    if "D" in options:
        args["D"] = normal(dim)
    if "z" in options:
        args["z"] = normal(batch, length, dim)
    if "delta_bias" in options:
        args["delta_bias"] = normal(dim, scale=0.2 if softplus else 0.02)
    if "initial_state" in options:
        args["initial_state"] = normal(batch, dim, state)
    return args, dict(delta_softplus=softplus)


@functools.partial(jax.jit, static_argnames=("delta_softplus", "impl", "return_final_state"))
def _jitted(args, *, delta_softplus, impl, return_final_state):
    return selective_scan(
        **args, delta_softplus=delta_softplus, impl=impl, return_final_state=return_final_state
    )


def run(args, flags, impl, return_final_state=False):
    """`selective_scan` under `jit` (eager dispatch of the many small ops dominates otherwise)."""
    return _jitted(args, **flags, impl=impl, return_final_state=return_final_state)


def numpy_loop(args, flags):
    """The equation of DESIGN.md 3.1, one scalar at a time, in float64."""
    a = {k: np.asarray(v, np.float64) for k, v in args.items()}
    u, delta, A, B, C = a["u"], a["delta"], a["A"], a["B"], a["C"]
    batch, length, dim = u.shape
    state = A.shape[1]
    y = np.zeros((batch, length, dim))
    h_final = np.zeros((batch, dim, state))
    for b in range(batch):
        for d in range(dim):
            h = np.array(a["initial_state"][b, d]) if "initial_state" in a else np.zeros(state)
            for t in range(length):
                dt = delta[b, t, d] + a.get("delta_bias", np.zeros(dim))[d]
                if flags["delta_softplus"]:
                    dt = np.log1p(np.exp(dt))
                for n in range(state):
                    h[n] = np.exp(dt * A[d, n]) * h[n] + dt * B[b, t, n] * u[b, t, d]
                out = sum(h[n] * C[b, t, n] for n in range(state))
                if "D" in a:
                    out += a["D"][d] * u[b, t, d]
                if "z" in a:
                    gate = a["z"][b, t, d]
                    out *= gate / (1.0 + np.exp(-gate))
                y[b, t, d] = out
            h_final[b, d] = h
    return y, h_final


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: "+".join(sorted(o)) or "none")
def test_sequential_matches_numpy_loop(options):
    args, flags = make_inputs(0, 2, 5, 3, 2, jnp.float64, options)
    y, h = run(args, flags, "sequential", return_final_state=True)
    y_ref, h_ref = numpy_loop(args, flags)
    assert_close(y, jnp.asarray(y_ref))
    assert_close(h, jnp.asarray(h_ref))


@functools.partial(jax.jit, static_argnames=("impl", "delta_softplus"))
def outputs_and_grads(args, weights, *, impl, delta_softplus):
    """`(y, h_L)` and the gradient of `<y, wy> + <h_L, wh>` in every floating input."""

    def loss(args):
        y, h = selective_scan(
            **args, delta_softplus=delta_softplus, impl=impl, return_final_state=True
        )
        return jnp.sum(y * weights[0]) + jnp.sum(h * weights[1]), (y, h)

    (_, out), grads = jax.value_and_grad(loss, has_aux=True)(args)
    return out, grads


def check_parallel_against_sequential(args, flags, dtype):
    """Forward, final state and every gradient of the two implementations agree."""
    batch, length, dim = args["u"].shape
    state = args["A"].shape[1]
    rng = np.random.default_rng(1)
    weights = (
        jnp.asarray(rng.standard_normal((batch, length, dim)), dtype),
        jnp.asarray(
            rng.standard_normal((batch, dim, state)), jnp.promote_types(dtype, jnp.float32)
        ),
    )
    softplus = flags["delta_softplus"]
    ref, ref_grads = outputs_and_grads(args, weights, impl="sequential", delta_softplus=softplus)
    out, grads = outputs_and_grads(args, weights, impl="parallel", delta_softplus=softplus)
    assert set(grads) == set(args)
    assert out[0].dtype == dtype
    assert out[1].dtype == ref[1].dtype == jnp.promote_types(dtype, jnp.float32)
    assert_close(out[0], ref[0], err_msg="y")
    assert_close(out[1], ref[1], err_msg="final state")
    for name in args:
        assert grads[name].dtype == args[name].dtype, name
        assert_close(grads[name], ref_grads[name], err_msg=f"d/d{name}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("length", [1, 7, 64, 257])
def test_parallel_matches_sequential(length, dtype):
    args, flags = make_inputs(length, 2, length, 4, 3, dtype)
    check_parallel_against_sequential(args, flags, dtype)


@pytest.mark.parametrize("options", OPTION_SETS[:-1], ids=lambda o: "+".join(sorted(o)) or "none")
def test_parallel_matches_sequential_options(options):
    # All options together run in every case above; here each alone, and none. 70 tokens span
    # full chunks of the parallel path and a padded one.
    args, flags = make_inputs(2, 2, 70, 3, 2, jnp.float64, options)
    check_parallel_against_sequential(args, flags, jnp.float64)


@pytest.mark.parametrize("impl", ["sequential", "parallel"])
def test_bfloat16_inputs_accumulate_in_float32(impl):
    args32, flags = make_inputs(3, 2, 80, 4, 3, jnp.float32)
    args16 = {k: v.astype(jnp.bfloat16) for k, v in args32.items()}
    rounded = {k: v.astype(jnp.float32) for k, v in args16.items()}
    y, h = run(args16, flags, impl, return_final_state=True)
    y_ref, h_ref = run(rounded, flags, "sequential", return_final_state=True)
    assert y.dtype == jnp.bfloat16
    assert h.dtype == jnp.float32
    assert_close(y, y_ref, jnp.bfloat16)
    # The state never touches bfloat16 after the inputs are read: float32 agreement.
    assert_close(h, h_ref, jnp.float32)

    def loss(u, args):
        return jnp.sum(run({**args, "u": u}, flags, impl).astype(jnp.float32))

    grad = jax.jit(jax.grad(loss))
    du = grad(args16["u"], args16)
    du_ref = grad(rounded["u"], rounded)
    assert du.dtype == jnp.bfloat16
    assert_close(du, du_ref, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
def test_auto_impl(dtype):
    args, flags = make_inputs(4, 1, 3, 2, 2, dtype)
    y, h = run(args, flags, None, return_final_state=True)
    assert (y.dtype, h.dtype) == (dtype, dtype)
    assert (y.shape, h.shape) == ((1, 3, 2), (1, 2, 2))
    assert_close((y, h), run(args, flags, "sequential", return_final_state=True))
    assert run(args, flags, None).shape == (1, 3, 2)


# Every example compiles both paths for a new shape: 6 examples keep the file in its time budget.
@settings(max_examples=6)
@given(
    batch=st.integers(1, 2),
    length=st.integers(1, 40),
    dim=st.integers(1, 4),
    state=st.integers(1, 4),
    options=st.sets(st.sampled_from(sorted(ALL_OPTIONS))),
)
def test_parallel_matches_sequential_hypothesis(batch, length, dim, state, options):
    args, flags = make_inputs(length, batch, length, dim, state, jnp.float64, frozenset(options))
    ref = run(args, flags, "sequential", return_final_state=True)
    out = run(args, flags, "parallel", return_final_state=True)
    assert_close(out, ref)


BAD_INPUTS = [
    ("u", lambda a: {**a, "u": a["u"][0]}, "u must have rank 3"),
    ("u", lambda a: {**a, "u": a["u"].astype(jnp.int32)}, "u must be a floating"),
    (
        "delta",
        lambda a: {**a, "delta": a["delta"][:, :-1]},
        r"delta must have shape \[batch, L, D\]",
    ),
    ("A", lambda a: {**a, "A": a["A"][:-1]}, r"A must have shape \[D, N\]"),
    ("A", lambda a: {**a, "A": a["A"][0]}, "A must have rank 2"),
    ("B", lambda a: {**a, "B": a["B"][..., :-1]}, r"B must have shape \[batch, L, N\]"),
    ("C", lambda a: {**a, "C": a["C"][:1]}, r"C must have shape \[batch, L, N\]"),
    ("C", lambda a: {**a, "C": a["C"].astype(jnp.int32)}, "C must be a floating"),
    ("D", lambda a: {**a, "D": a["D"][:-1]}, r"D must have shape \[D\]"),
    ("z", lambda a: {**a, "z": a["z"][:, :-1]}, r"z must have shape \[batch, L, D\]"),
    ("delta_bias", lambda a: {**a, "delta_bias": a["delta_bias"][None]}, "delta_bias must have"),
    (
        "initial_state",
        lambda a: {**a, "initial_state": a["initial_state"][..., :-1]},
        r"initial_state must have shape \[batch, D, N\]",
    ),
]


@pytest.mark.parametrize(("name", "corrupt", "match"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("impl", ["sequential", "parallel"])
def test_bad_inputs_raise(name, corrupt, match, impl):
    args, flags = make_inputs(5, 2, 4, 3, 2, jnp.float32)
    with pytest.raises(ValueError, match=match):
        run(corrupt(args), flags, impl)


def test_unknown_impl_raises():
    args, flags = make_inputs(5, 1, 4, 2, 2, jnp.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        run(args, flags, "pallas")


@pytest.mark.parametrize("impl", ["sequential", "parallel"])
def test_jit_matches_eager(impl):
    args, flags = make_inputs(6, 2, 9, 3, 2, jnp.float32)
    fn = functools.partial(selective_scan, **flags, impl=impl, return_final_state=True)
    assert_close(jax.jit(fn)(**args), fn(**args))


@pytest.mark.parametrize("impl", ["sequential", "parallel"])
def test_gradient_is_causal(impl):
    # 70 tokens span two chunks of the parallel path.
    args, flags = make_inputs(7, 1, 70, 2, 2, jnp.float64)

    def y_of_u(u):
        return run({**args, "u": u}, flags, impl)[0]  # [L, D]

    jac = jax.jit(jax.jacrev(y_of_u))(args["u"])[:, :, 0]  # [L, D, L, D]: dy_t / du_s
    per_pair = np.abs(np.asarray(jac)).sum(axis=(1, 3))  # [t, s]
    assert np.all(np.triu(per_pair, k=1) == 0.0), "y_t depends on a later u_s"
    assert np.all(np.tril(per_pair, k=-1)[1:, :-1].max(axis=1) > 0.0), "no dependence on the past"
