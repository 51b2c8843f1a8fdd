"""The properties behind the neural-ODE claims on a tiny untrained ODETransformer: the adapter
integrates the model's own flow, the spectra and exponents are those of its weights and Jacobian,
finite differences converge to the exponents, the Euler discretizations converge with the step
count; the claims themselves run end to end at a tiny size (slow)."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seqlab.analysis import lyapunov
from seqlab.modules.ode_transformer import ODETransformer
from tests.conftest import assert_close
from theory.neural_ode import claims, measures, train
from theory.registry import Context

T_LEN, VOCAB = 5, 11


@functools.cache
def _tiny(dtype):
    """`(model, params, tokens: [T])` of a tiny model in `dtype` (cached: init compiles slowly)."""
    model = ODETransformer(
        vocab_size=VOCAB,
        d_model=8,
        num_heads=2,
        d_ff=10,
        num_steps=3,
        time_features=3,
        hidden=4,
        dtype=dtype,
        param_dtype=dtype,
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, T_LEN), jnp.int32)

    @jax.jit
    def init(key):
        # A_j start small; give the time dependence some weight as training would.
        params = model.init(key, tokens[None])["params"]
        return jax.tree.map(
            lambda p: p + 0.3 * jnp.sin(jnp.arange(p.size).reshape(p.shape)), params
        )

    params = init(jax.random.key(0))
    return model, params, tokens


@pytest.fixture(scope="module", params=[jnp.float32, jnp.float64], ids=["float32", "float64"])
def tiny(request):
    return _tiny(request.param)


def test_adapter_integrates_the_models_own_flow(tiny):
    model, params, tokens = tiny

    @jax.jit
    def both(tokens):  # 4 steps, not the model's default 3: num_steps passes through
        x0 = measures.initial_state(model, params, tokens)
        x1 = lyapunov.integrate(measures.token_field(model, params), x0, num_steps=4)
        ours = model.apply({"params": params}, x1[None], method="readout")[0]
        return ours, model.apply({"params": params}, tokens[None], num_steps=4)[0]

    ours, logits = both(tokens)
    assert_close(ours, logits)


def test_depth_spectra_are_those_of_the_weights():
    model, params, _ = _tiny(jnp.float64)
    ts = np.array([0.0, 0.3, 1.0])
    got = measures.depth_spectra(model, params, jnp.asarray(ts))
    for s, t in enumerate(ts):
        w = {
            k: np.asarray(v)
            for k, v in model.apply({"params": params}, t, method="weights").items()
        }
        for h in range(model.num_heads):
            qk = np.linalg.eigvals(w["wq"][:, h] @ w["wk"][:, h].T)  # [D, D], rank K
            top = qk[np.argsort(-np.abs(qk))][: got["qk"].shape[-1]]
            np.testing.assert_allclose(np.sort_complex(got["qk"][s, h]), np.sort_complex(top))
        mlp = np.linalg.eigvals(w["w1"] @ w["w2"])
        np.testing.assert_allclose(np.sort_complex(got["mlp"][s]), np.sort_complex(mlp))


def test_magnitude_trend_sees_rise_and_fall():
    ts = np.linspace(0.0, 1.0, 9)
    phases = np.exp(1j * np.arange(6)).reshape(2, 3)
    rising = (1.0 + ts)[:, None, None] * phases  # |lambda| = 1 + t: slope 1, mean 1.5
    got = measures.magnitude_trend(ts, rising)
    np.testing.assert_allclose(got["mean_abs_slope"], 1.0)
    np.testing.assert_allclose(got["mean_abs_relative_slope"], 1.0 / 1.5)
    assert got["mean_abs_relative_slope"] >= claims.RISE
    falling = measures.magnitude_trend(ts, rising[::-1])
    assert falling["mean_abs_relative_slope"] < claims.RISE  # the verdict's check can fail


def test_token_exponents_match_the_jacobian_and_finite_differences():
    model, params, tokens = _tiny(jnp.float64)
    x0 = measures.initial_state(model, params, tokens)
    lam, mu, top = measures.token_exponents(model, params, x0, 3)
    flow = lambda x: lyapunov.integrate(measures.token_field(model, params), x, num_steps=3)  # noqa: E731
    jac = np.asarray(jax.jit(jax.jacfwd(flow))(x0))  # [T, D, T, D]
    d = x0.shape[1]
    for i in range(T_LEN):
        block = jac[:, :, i, :].reshape(T_LEN * d, d)  # all outputs w.r.t. token i
        assert_close(lam[i], np.log(np.linalg.svd(block, compute_uv=False)))
        assert_close(mu[i], np.log(np.abs(np.diagonal(np.linalg.qr(block)[1]))))
    growth = measures.perturbation_growth(model, params, x0, 3)
    fd, linear = growth(top[2])
    assert_close(linear, lam[2, 0])
    errors = np.abs(np.asarray(fd) - lam[2, 0])
    assert errors[-1] <= claims.FD_TOLERANCE and errors[-1] <= errors[-2] / 3  # the claim's test
    # Another token's top exponent is not this direction's growth: the comparison can fail.
    assert np.abs(np.asarray(fd)[-1] - lam[0, 0]) > claims.FD_TOLERANCE


def test_euler_discretizations_converge_with_the_step_count():
    # Explicit Euler is first order: |logits_N - logits_2N| halves as N doubles (for smooth W(t)),
    # which is what lets a model trained at N steps run at 2N.
    model, params, tokens = _tiny(jnp.float64)
    logits = jax.jit(
        lambda params, tokens: [
            model.apply({"params": params}, tokens[None], num_steps=n) for n in (8, 16, 32)
        ]
    )(jax.tree.map(lambda p: p * 0.3, params), tokens)  # a milder flow
    gaps = [float(jnp.max(jnp.abs(a - b))) for a, b in itertools.pairwise(logits)]
    ratios = np.array(gaps[:-1]) / np.array(gaps[1:])
    assert 1.6 < ratios[0] < 2.5, ratios


def test_eval_loss_is_the_mean_scored_cross_entropy():
    model, params, _ = _tiny(jnp.float32)
    rng = np.random.default_rng(1)
    inputs = rng.integers(0, VOCAB, (3, T_LEN)).astype(np.int32)
    targets = np.where(rng.random((3, T_LEN)) < 0.5, rng.integers(0, VOCAB, (3, T_LEN)), -100)
    targets[0, 0] = 1  # at least one scored position
    batches = ({"inputs": inputs, "targets": targets.astype(np.int32)},) * 2
    got = train.eval_loss(model, params, batches, 2)
    logits = jax.jit(lambda x: model.apply({"params": params}, x, num_steps=2))(inputs)
    scored = targets != -100
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, np.where(scored, targets, 0))
    np.testing.assert_allclose(got, float(jnp.sum(nll * scored) / scored.sum()), rtol=1e-5)


@pytest.mark.slow
def test_claims_run_at_a_tiny_size(tmp_path, monkeypatch):
    tiny_setup = dataclasses.replace(
        train.QUICK, d_model=16, d_ff=32, seq_len=8, train_steps=20, eval_batches=1, num_steps=4
    )
    monkeypatch.setattr(train, "setup_for", lambda full: tiny_setup)
    for claim in claims.PAPER.claims:
        ctx = Context(claim.id, False, jax.random.key(0), tmp_path)
        outcome = claim.measure(ctx)
        assert outcome.verdict in ("holds", "fails", "inconclusive")
        assert all(p.is_file() for p in outcome.figures)
