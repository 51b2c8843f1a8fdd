"""MoE: both dispatches (sorted ragged_dot, dense scan) against a plain all-experts reference,
routing, init, bad fields.

Each case compiles once (the layer and the reference, forward and gradients, in one jit): compiling
dominates the cost of these tiny sizes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.moe import MoE
from tests.conftest import assert_close

D_MODEL, D_FF, SHARED_D_FF, E, B, T = 8, 6, 5, 4, 2, 5


def _model(dtype=jnp.float64, **kw) -> MoE:
    kw = {"d_model": D_MODEL, "d_ff": D_FF, "num_experts": E, "top_k": 2, **kw}
    return MoE(dtype=dtype, param_dtype=dtype, **kw)


def _x(shape, dtype, key=0):
    return jax.random.normal(jax.random.key(key), shape, dtype)


def _params(model: MoE, dtype) -> dict:
    """Random parameters, every matrix ~ N(0, 1 / fan_in) (numpy draws: compiling `init` would
    cost more than the tests)."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, D_MODEL), dtype))
    rng = np.random.default_rng(1)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s.shape) / np.sqrt(s.shape[-2]), dtype), shapes
    )


def _reference(params, x, *, top_k, norm_topk_prob, shared):
    """Every expert on every token (einsum), masked by the top-k routing weights."""
    p = params["params"]
    probs = jax.nn.softmax(x @ p["router"]["kernel"], axis=-1)
    kth = jnp.sort(probs, axis=-1)[..., E - top_k, None]  # the k-th largest probability
    w = jnp.where(probs >= kth, probs, 0.0)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    hidden = jax.nn.silu(jnp.einsum("...d,edf->...ef", x, p["gate"]))
    hidden = hidden * jnp.einsum("...d,edf->...ef", x, p["up"])
    y = jnp.einsum("...ef,efd->...ed", hidden, p["down"])  # [..., E, D]
    out = jnp.einsum("...e,...ed->...d", w, y)
    if shared:
        s = p["shared_expert"]
        h = jax.nn.silu(x @ s["gate"]["kernel"]) * (x @ s["up"]["kernel"])
        out = out + jax.nn.sigmoid(x @ p["shared_gate"]["kernel"]) * (h @ s["down"]["kernel"])
    return out


def _out_and_grads(fn, params, x, cot):
    """`fn(params, x)` and the gradients of `sum(fn(params, x) * cot)` wrt params and x."""
    out, vjp = jax.vjp(fn, params, x)
    return out, vjp(cot)


@functools.cache
def _layer_and_reference(dtype, impl="sorted", **kw):
    """One jitted function: (route, layer out and grads, reference out and grads)."""
    model = _model(dtype, impl=impl, **kw)
    ref = functools.partial(
        _reference,
        top_k=model.top_k,
        norm_topk_prob=model.norm_topk_prob,
        shared=model.shared_d_ff is not None,
    )

    @jax.jit
    def run(params, x, cot):
        return (
            model.apply(params, x, method=MoE.route),
            _out_and_grads(model.apply, params, x, cot),
            _out_and_grads(ref, params, x, cot),
        )

    return model, run


# Together: top_k 1, 2 and E; shared expert or not; norm_topk_prob or not; [B, T, D] and [B, D].
CASES = {
    "top2_shared": (dict(top_k=2, shared_d_ff=SHARED_D_FF), (B, T, D_MODEL)),
    "top1_unnormalized_decode": (dict(top_k=1, norm_topk_prob=False), (B, D_MODEL)),
    "top_all": (dict(top_k=E), (B, T, D_MODEL)),
}


@pytest.mark.parametrize("impl", ["sorted", "dense"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_dense_reference(case, dtype, impl):
    kw, shape = CASES[case]
    model, run = _layer_and_reference(dtype, impl, **kw)
    params, x, cot = _params(model, dtype), _x(shape, dtype), _x(shape, dtype, key=1)
    (weights, experts), (out, grads), (ref_out, ref_grads) = run(params, x, cot)
    assert out.shape == shape and out.dtype == dtype
    assert weights.shape == experts.shape == (*shape[:-1], kw["top_k"])
    assert weights.dtype == dtype and experts.dtype == jnp.int32  # float64 routing for float64
    assert_close(out, ref_out, dtype)
    assert_close(grads, ref_grads, dtype)


def test_expert_without_tokens():
    """An expert no token picks: group size 0 in ragged_dot, zero gradient for its weights."""
    dtype = jnp.float64
    model, run = _layer_and_reference(dtype, "sorted", top_k=2, shared_d_ff=SHARED_D_FF)
    x = jnp.abs(_x((B, T, D_MODEL), dtype))  # positive inputs
    params = _params(model, dtype)
    kernel = params["params"]["router"]["kernel"].at[:, E - 1].set(-10.0)  # logit < -10 |x|_1
    params = {"params": {**params["params"], "router": {"kernel": kernel}}}
    (_, experts), (out, grads), (ref_out, ref_grads) = run(params, x, _x(x.shape, dtype, key=1))
    assert set(np.unique(np.asarray(experts))) == set(range(E - 1))  # all but the last
    assert_close(out, ref_out, dtype)
    assert_close(grads, ref_grads, dtype)
    for name in ("gate", "up", "down"):
        np.testing.assert_array_equal(np.asarray(grads[0]["params"][name][E - 1]), 0.0)


def test_route():
    """Weights: the top-k softmax probabilities, decreasing, renormalized, in the accumulation
    dtype; experts: distinct int32 ids; router_logits: `[..., E]`."""
    dtype = jnp.float32
    models = [_model(dtype, top_k=3, norm_topk_prob=norm) for norm in (True, False)]
    params, x = _params(models[0], dtype), _x((B, T, D_MODEL), dtype)

    @jax.jit
    def run(params, x):
        logits = models[0].apply(params, x, method=MoE.router_logits)
        return logits, [m.apply(params, x, method=MoE.route) for m in models]

    logits, routes = run(params, x)
    assert logits.shape == (B, T, E)
    probs = jax.nn.softmax(np.asarray(logits, np.float64), axis=-1)
    for (weights, experts), norm in zip(routes, (True, False), strict=True):
        assert weights.shape == experts.shape == (B, T, 3)
        assert weights.dtype == dtype and experts.dtype == jnp.int32
        assert np.all(np.diff(np.asarray(weights), axis=-1) <= 0)  # decreasing
        assert not np.any(np.diff(np.sort(np.asarray(experts), axis=-1), axis=-1) == 0)  # distinct
        chosen = np.take_along_axis(np.asarray(probs), np.asarray(experts), axis=-1)
        assert np.all(chosen.min(-1) >= np.sort(probs, axis=-1)[..., E - 3])  # the top 3
        assert_close(weights, chosen / chosen.sum(-1, keepdims=True) if norm else chosen, dtype)


def test_params_and_init():
    model = MoE(d_model=32, d_ff=16, num_experts=8, top_k=2, shared_d_ff=24)
    x = jnp.zeros((1, 32))
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    assert jax.tree.map(lambda a: (a.shape, a.dtype), shapes) == {
        "router": {"kernel": ((32, 8), jnp.float32)},
        "gate": ((8, 32, 16), jnp.float32),
        "up": ((8, 32, 16), jnp.float32),
        "down": ((8, 16, 32), jnp.float32),
        "shared_expert": {
            "gate": {"kernel": ((32, 24), jnp.float32)},
            "up": {"kernel": ((32, 24), jnp.float32)},
            "down": {"kernel": ((24, 32), jnp.float32)},
        },
        "shared_gate": {"kernel": ((32, 1), jnp.float32)},
    }
    no_shared = jax.eval_shape(_model().init, jax.random.key(0), jnp.zeros((1, D_MODEL)))
    assert set(no_shared["params"]) == {"router", "gate", "up", "down"}
    # The expert weights (created in setup; router_logits skips compiling the experts' forward)
    # are nn.Dense's LeCun normal per expert: std 1 / sqrt(fan-in of the [in, out] matrix).
    init = jax.jit(functools.partial(model.init, method=MoE.router_logits))
    params = init(jax.random.key(0), x)["params"]
    for name, fan_in in (("gate", 32), ("up", 32), ("down", 16)):
        std = float(jnp.std(params[name]))
        assert abs(std * np.sqrt(fan_in) - 1.0) < 0.1, (name, std)
        assert not np.allclose(params[name][0], params[name][1])  # experts differ


def test_sparse_dispatch():
    """The expert matmuls are ragged_dots over the N*k assignments, none dense over all experts."""
    model = _model(jnp.float32, top_k=2, impl="sorted")
    params, x = _params(model, jnp.float32), _x((B, T, D_MODEL), jnp.float32)
    eqns = jax.make_jaxpr(model.apply)(params, x).eqns
    ragged = [e for e in eqns if "ragged_dot" in e.primitive.name]
    assert len(ragged) == 3
    assert all(e.invars[0].aval.shape[0] == B * T * 2 for e in ragged)


def test_dense_impl_has_a_jacobian():
    """ "dense" (the CPU default) is vmappable: `jax.jacrev` through it equals the reference's,
    which "sorted" cannot give (`ragged_dot` vmaps over axis 0 only)."""
    model = _model(jnp.float64, top_k=2, impl="dense")
    params, x = _params(model, jnp.float64), _x((T, D_MODEL), jnp.float64)
    ref = functools.partial(_reference, top_k=2, norm_topk_prob=True, shared=False)
    jac = jax.jacrev(lambda v: model.apply(params, v))(x)
    assert_close(jac, jax.jacrev(lambda v: ref(params, v))(x), jnp.float64)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(d_model=0), "d_model"),
        (dict(d_ff=-1), "d_ff"),
        (dict(num_experts=0), "num_experts"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=E + 1), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(shared_d_ff=0), "shared_d_ff"),
        (dict(norm_topk_prob=1), "norm_topk_prob"),
        (dict(impl="ragged"), "impl"),
    ],
)
def test_bad_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        _model(jnp.float32, **kw)


def test_bad_input():
    model = _model(jnp.float32)
    params = _params(model, jnp.float32)
    with pytest.raises(ValueError, match="d_model"):
        jax.eval_shape(model.apply, params, jnp.zeros((2, D_MODEL + 1)))
    with pytest.raises(ValueError, match="x must be a floating"):
        jax.eval_shape(model.apply, params, jnp.zeros((2, D_MODEL), jnp.int32))
