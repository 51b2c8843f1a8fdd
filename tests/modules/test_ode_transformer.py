"""Tests of seqlab.modules.ode_transformer: the weights W(t) against a hand computation from the
parameters, the vector field against a per-token numpy loop, the scanned Euler forward against a
loop of `vector_field` calls (values and gradients), `evaluate_at` against the continuous model,
the step count as a call-time argument, causality, LoRA at init, bad arguments."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.modules.ode_transformer import (
    BLOCK_WEIGHTS,
    DiscreteTransformer,
    ODETransformer,
    TimeLinear,
    TimeNormScale,
    evaluate_at,
    time_embedding,
)
from tests.conftest import assert_close

SIZES = dict(
    vocab_size=13, d_model=16, num_heads=2, d_ff=24, num_steps=3, time_features=4, hidden=6
)
DTYPES = [jnp.float32, jnp.float64]


def _model(dtype, lora_rank=2) -> ODETransformer:
    """The model under test; with LoRA unless told otherwise (LoRA changes the weights only)."""
    return ODETransformer(**SIZES, lora_rank=lora_rank, dtype=dtype, param_dtype=dtype)


def _tokens(seed=0, shape=(2, 7)) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, SIZES["vocab_size"], shape))


@functools.cache
def _apply(model):
    """`model.apply` under `jit` (eager applies are slow), one per model."""
    return jax.jit(model.apply, static_argnames=("method", "num_steps"))


@functools.cache
def _variables(model, seed=0):
    """Random parameters of the right structure from numpy (no sampler to compile), every array
    non-zero, so that norm scales depend on t and LoRA changes the weights."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), _tokens())
    rng = np.random.default_rng(seed)

    def draw(leaf):
        fan = leaf.shape[-2] if leaf.ndim >= 2 else 9
        return jnp.asarray(rng.standard_normal(leaf.shape) / np.sqrt(fan), leaf.dtype)

    return jax.tree.map(draw, shapes)


def _np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# ----------------------------------------------------------------------------------------------
# W(t) = sum_j h_j(t) A_j + B, by hand


def _hand_weight(p: dict, t: float, n: int) -> np.ndarray:
    """`sum_j h_j(t) A_j + B (+ U V^T)` from the parameters of one `TimeLinear` (or the scale
    `1 + h(t) F` of a `TimeNormScale`), in numpy float64."""
    freqs = 10000.0 ** (-np.arange(n) / n)
    e = np.concatenate([[t], np.sin(1000 * t * freqs), np.cos(1000 * t * freqs)])
    z = e @ p["time"]["lin1"]["kernel"] + p["time"]["lin1"]["bias"]
    h = (z / (1 + np.exp(-z))) @ p["time"]["lin2"]["kernel"] + p["time"]["lin2"]["bias"]
    if "F" in p:
        return 1 + h @ p["F"]
    w = np.tensordot(h, p["A"], axes=1) + p["B"]
    if "lora_u" in p:
        w = w + (p["lora_u"] @ p["lora_v"].T).reshape(w.shape)
    return w


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_are_affine_in_the_time_network(dtype):
    model = _model(dtype)
    variables = _variables(model)
    d, h, k, f = 16, 2, 8, 24
    shapes = dict(wq=(d, h, k), wk=(d, h, k), wv=(d, h, k), wo=(h, k, d), w1=(d, f), w2=(f, d))
    shapes.update(ln_attn=(d,), ln_mlp=(d,))
    params = _np(variables["params"])
    ts = jnp.asarray([0.0, 0.37, 1.0], dtype)
    batched = _apply(model)(variables, ts, method="weights")  # every depth at once
    assert set(batched) == set(BLOCK_WEIGHTS)
    for i, t in enumerate(np.asarray(ts)):
        for name, shape in shapes.items():
            w = batched[name][i]
            assert w.shape == shape and w.dtype == dtype, name
            assert_close(w, _hand_weight(params[name], float(t), 4), dtype, err_msg=name)
    single = _apply(model)(variables, ts[1], method="weights")  # one depth: the same weights
    assert_close(single, {name: w[1] for name, w in batched.items()}, dtype)


def test_initialization_of_the_generated_weights():
    """Norm scales `1 + h(t) F` are exactly 1 (F = 0), LoRA's `U` is zero, and the weights vary
    mildly with t. (The submodules the model is made of, initialized alone: compiling the whole
    model's initializers costs seconds; the model's own init runs in tests/experiments.)"""
    e = time_embedding(jnp.asarray([0.0, 1.0], jnp.float32), 4)  # [2, 9]
    scale = TimeNormScale(16, 6)
    np.testing.assert_array_equal(scale.apply(jax.jit(scale.init)(jax.random.key(0), e), e), 1.0)
    linear = TimeLinear((16,), (4, 8), hidden=6, lora_rank=3)  # a [D, H, K] weight
    variables = jax.jit(linear.init)(jax.random.key(1), e)
    np.testing.assert_array_equal(variables["params"]["lora_u"], 0.0)
    w = linear.apply(variables, e)  # [2, 16, 4, 8]
    change = float(jnp.linalg.norm(w[1] - w[0]) / jnp.linalg.norm(w[0]))
    assert 1e-3 < change < 0.5, change  # depth-dependent, but mildly at init
    assert 0.8 < float(jnp.std(variables["params"]["B"])) * 4 < 1.2  # B ~ N(0, 1 / fan_in = 16)


# ----------------------------------------------------------------------------------------------
# The vector field against a per-token numpy loop


def _layer_norm(v, scale):
    return (v - v.mean()) / np.sqrt(v.var() + 1e-5) * scale


def _rope(v, position, theta=10000.0):
    half = v.shape[-1] // 2
    angle = position * theta ** (-np.arange(half) * 2 / v.shape[-1])
    v1, v2 = v[:half], v[half:]
    return np.concatenate(
        [v1 * np.cos(angle) - v2 * np.sin(angle), v2 * np.cos(angle) + v1 * np.sin(angle)]
    )


def _gelu(z):
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def _naive_field(w: dict, x: np.ndarray) -> np.ndarray:
    """`Attn(LN(x) g_attn) + MLP(LN(x) g_mlp)` token by token: query `i` over keys `j <= i`."""
    batch, length, _ = x.shape
    heads, k = w["wq"].shape[1:]
    out = np.zeros_like(x)
    for b in range(batch):
        a = [_layer_norm(x[b, j], w["ln_attn"]) for j in range(length)]
        for i in range(length):
            for h in range(heads):
                q = _rope(a[i] @ w["wq"][:, h], i)
                scores = np.array(
                    [q @ _rope(a[j] @ w["wk"][:, h], j) / np.sqrt(k) for j in range(i + 1)]
                )
                p = np.exp(scores - scores.max())
                p /= p.sum()
                o = sum(p[j] * (a[j] @ w["wv"][:, h]) for j in range(i + 1))
                out[b, i] += o @ w["wo"][h]
            m = _layer_norm(x[b, i], w["ln_mlp"])
            out[b, i] += _gelu(m @ w["w1"]) @ w["w2"]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_field_equals_a_per_token_loop(dtype):
    model = _model(dtype)
    variables = _variables(model)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 16)), dtype)
    t = jnp.asarray(0.6, dtype)
    field = _apply(model)(variables, t, x, method="vector_field")
    assert field.shape == x.shape and field.dtype == dtype
    weights = _np(_apply(model)(variables, t, method="weights"))
    assert_close(field, _naive_field(weights, np.asarray(x, np.float64)), dtype)


def test_vector_field_and_logits_are_causal():
    model = _model(jnp.float64)
    variables = _variables(model)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 5, 16)))
    changed = x.at[:, 3:].add(jnp.asarray(rng.standard_normal((2, 2, 16))))
    t = jnp.asarray(0.2)
    f, g = (_apply(model)(variables, t, v, method="vector_field") for v in (x, changed))
    np.testing.assert_array_equal(f[:, :3], g[:, :3])
    assert not np.allclose(f[:, 3:], g[:, 3:])
    tokens = _tokens(5)
    later = tokens.at[:, 6].set((tokens[:, 6] + 1) % SIZES["vocab_size"])
    la, lb = (_apply(model)(variables, tok) for tok in (tokens, later))
    np.testing.assert_array_equal(la[:, :6], lb[:, :6])
    assert not np.allclose(la[:, 6], lb[:, 6])


# ----------------------------------------------------------------------------------------------
# The forward: scanned Euler, step count at call time, evaluate_at


def _euler_loop(model, variables, tokens, num_steps, apply):
    """`readout(x_N)`, `x_{k+1} = x_k + dt vector_field(k dt, x_k)`, one `apply` per step."""
    x = apply(variables, tokens, method="embed").astype(model.acc_dtype)
    for k in range(num_steps):
        t = jnp.asarray(k, model.param_dtype) / num_steps
        x = x + (1.0 / num_steps) * apply(variables, t, x, method="vector_field")
    return apply(variables, x, method="readout")


@pytest.mark.parametrize("dtype", DTYPES)
def test_call_equals_euler_over_the_vector_field_at_any_step_count(dtype):
    model = _model(dtype)
    variables = _variables(model)
    tokens = _tokens()
    # The oracle is the loop in float64 (float32 parameters cast up): the call and a float32 loop
    # differ only in rounding, which XLA's fusions order differently on different CPUs.
    model64 = _model(jnp.float64)
    variables64 = jax.tree.map(lambda a: a.astype(jnp.float64), variables)

    # float32: rounding grows through the norms of every Euler step to 8.4e-5 at 5 steps (logits
    # up to 1.2; measured on an Intel Xeon, 2e-5 on an AMD EPYC), above the table's atol 2e-5.
    def check(actual, expected):
        if dtype == jnp.float32:
            np.testing.assert_allclose(np.asarray(actual, np.float64), expected, 2e-4, 2e-4)
        else:
            assert_close(actual, expected, dtype)

    logits = _apply(model)(variables, tokens)  # the default num_steps = 3
    assert logits.shape == (2, 7, 13) and logits.dtype == dtype
    expected = _euler_loop(model64, variables64, tokens, 3, _apply(model64))
    check(logits, expected)
    # The step count is a call-time argument: same parameters, other steps, other logits.
    for num_steps in (5,):
        other = _apply(model)(variables, tokens, num_steps=num_steps)
        expected = _euler_loop(model64, variables64, tokens, num_steps, _apply(model64))
        check(other, expected)
        assert not np.allclose(other, logits, rtol=1e-3, atol=1e-3)


def test_gradients_equal_those_of_the_euler_loop_and_are_finite():
    model = _model(jnp.float64)
    variables = _variables(model)
    tokens = _tokens()

    def loss(params, forward):
        return jnp.sum(jnp.sin(forward({"params": params})))

    @jax.jit
    def grads(params):
        scanned = jax.grad(loss)(params, lambda v: model.apply(v, tokens))
        loop = jax.grad(loss)(params, lambda v: _euler_loop(model, v, tokens, 3, model.apply))
        return scanned, loop

    scanned, loop = grads(variables["params"])
    assert_close(scanned, loop)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(scanned))
    for name in ("A", "B", "lora_u", "lora_v"):  # every kind of weight parameter learns
        assert float(jnp.abs(scanned["wq"][name]).max()) > 0, name
    assert float(jnp.abs(scanned["ln_attn"]["F"]).max()) > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_evaluate_at_is_the_same_model(dtype):
    model = _model(dtype)
    variables = _variables(model)
    tokens = _tokens()
    discrete, discrete_variables = evaluate_at(model, variables, 3)
    assert isinstance(discrete, DiscreteTransformer) and discrete.num_layers == 3
    # The sampled parameters have exactly the structure the discrete model initializes.
    own = jax.eval_shape(discrete.init, jax.random.key(0), tokens)
    assert jax.tree.structure(own) == jax.tree.structure(discrete_variables)
    logits = jax.jit(discrete.apply)(discrete_variables, tokens)
    assert_close(logits, _apply(model)(variables, tokens), dtype)  # the default 3 steps


# ----------------------------------------------------------------------------------------------
# LoRA and errors


def test_lora_at_its_init_gives_the_logits_of_the_base_model():
    """`U = 0` (its init, checked above) with any `V`: bit-identical logits to `lora_rank = 0`
    with the same base parameters."""
    lora = _model(jnp.float32, lora_rank=3)
    params = dict(_variables(lora)["params"])
    lora_names = [name for name in params if "lora_u" in params[name]]
    assert sorted(lora_names) == ["w1", "w2", "wk", "wo", "wq", "wv"]
    for name in lora_names:
        params[name] = {**params[name], "lora_u": jnp.zeros_like(params[name]["lora_u"])}
    base_params = {
        name: {k: v for k, v in sub.items() if "lora" not in k} for name, sub in params.items()
    }
    base = _model(jnp.float32, lora_rank=0)
    tokens = _tokens()
    np.testing.assert_array_equal(
        _apply(lora)({"params": params}, tokens), _apply(base)({"params": base_params}, tokens)
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(d_model=15, num_heads=2), "d_model = 15 must be divisible by num_heads"),
        (dict(d_model=6, num_heads=2), "even for RoPE"),
        (dict(num_steps=0), "num_steps"),
        (dict(hidden=0), "hidden"),
        (dict(lora_rank=-1), "lora_rank"),
        (dict(d_ff=0), "d_ff"),
    ],
)
def test_bad_sizes_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        ODETransformer(**{**SIZES, **overrides})


def test_bad_call_arguments_raise():
    model = _model(jnp.float32)
    variables = _variables(model)
    with pytest.raises(ValueError, match="num_steps"):
        model.apply(variables, _tokens(), num_steps=0)
    with pytest.raises(ValueError, match=r"tokens must have rank 2 with layout \[B, T\]"):
        model.apply(variables, _tokens()[0])
    with pytest.raises(ValueError, match="tokens must be an integer array"):
        model.apply(variables, jnp.zeros((2, 7)))
    with pytest.raises(ValueError, match=r"x must have shape \[B, T, d_model\]"):
        model.apply(variables, 0.5, jnp.zeros((2, 7, 8)), method="vector_field")
    with pytest.raises(ValueError, match="t must have rank 0"):
        model.apply(variables, jnp.zeros(2), jnp.zeros((2, 7, 16)), method="vector_field")
    with pytest.raises(ValueError, match="num_steps"):
        evaluate_at(model, variables, 0)
    with pytest.raises(ValueError, match="variables must be the dict"):
        evaluate_at(model, variables["params"], 2)
