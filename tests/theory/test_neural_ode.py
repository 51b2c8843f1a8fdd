"""The properties behind the neural-ODE claims on tiny untrained models: the adapter integrates the
model's own flow, the spectra and exponents are those of its weights and Jacobian, finite
differences converge to the exponents, the Euler discretizations converge with the step count;
the stacked discrete models of `runs` are the `DiscreteTransformer`s they stand for and LoRA runs
move only LoRA factors and the embedding; each claim's decision on constructed inputs where the
statement holds and where it does not (the negative controls); the claims run end to end at a
tiny size (slow)."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seqlab.analysis import lyapunov, spectra
from seqlab.modules.ode_transformer import ODETransformer
from tests.conftest import assert_close
from theory.neural_ode import claims, measures, runs, train
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


# -- the stacked discrete models of `runs` -----------------------------------------------------

TINY_LM = dataclasses.replace(
    runs.LM_QUICK,
    d_model=8,
    num_heads=2,
    d_ff=12,
    time_features=3,
    hidden=4,
    num_steps=2,
    seq_len=6,
    batch_size=2,
    lora_rank=2,
)


@functools.cache
def _tiny_lm():
    """`(ode params, discrete params of 2 layers, tokens [2, 6])` of `TINY_LM` (float32)."""
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, runs.VOCAB, (2, 6)), jnp.int32)
    ode = jax.jit(runs.ode_model(TINY_LM).init)(jax.random.key(1), tokens)["params"]
    ode = jax.tree.map(
        lambda p: p + 0.2 * jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape), ode
    )
    discrete = jax.jit(runs.discrete_model(TINY_LM, 2).init)(jax.random.key(2), tokens)["params"]
    return ode, discrete, tokens


def test_stacks_are_the_discrete_models_they_stand_for():
    ode, discrete, tokens = _tiny_lm()
    logits = jax.jit(functools.partial(runs.stacked_logits, TINY_LM))  # one shape: 4 layers
    want = jax.jit(runs.discrete_model(TINY_LM, 2).apply)({"params": discrete}, tokens)
    stack = runs.to_stack(discrete, 2, 4, 2, jax.random.key(0))
    assert_close(logits(stack, tokens), want)  # inactive padding changes nothing
    padded = runs.pad_stack(runs.to_stack(discrete, 2, 2, 2, jax.random.key(0)), 4)
    assert_close(logits(padded, tokens), want)
    jax.tree.map(np.testing.assert_array_equal, padded["layers"], stack["layers"])
    ode_apply = jax.jit(runs.ode_model(TINY_LM).apply, static_argnames="num_steps")
    resampled = runs.resample(TINY_LM, ode, 3, 4, jax.random.key(0))  # evaluate_at at 3 steps
    assert_close(logits(resampled, tokens), ode_apply({"params": ode}, tokens, num_steps=3))
    moved = dict(stack, lora={k: {**f, "u": f["u"] + 0.1} for k, f in stack["lora"].items()})
    assert float(jnp.max(jnp.abs(logits(moved, tokens) - want))) > 1e-3  # LoRA acts


def test_lora_runs_move_only_lora_and_the_embedding():
    _, discrete, tokens = _tiny_lm()
    stacks = [runs.to_stack(discrete, 2, 3, 2, jax.random.key(r)) for r in range(2)]
    masks = [
        runs.trainable_mask(s, lora=lora) for s, lora in zip(stacks, (True, False), strict=True)
    ]
    batch = {"inputs": np.asarray(tokens), "targets": np.roll(np.asarray(tokens), -1, axis=1)}
    params, losses, _ = runs.train_runs(
        runs.stack_logits_fn(TINY_LM),
        runs.stack_runs(stacks),
        lambda i: {k: np.stack([v, v]) for k, v in batch.items()},
        steps=3,
        learning_rate=1e-2,
        masks=runs.stack_runs(masks),
    )
    assert losses.shape == (3, 2)
    lora_run, full_run = runs.run(params, 0), runs.run(params, 1)
    for name in ("layers", "active"):  # frozen in the LoRA run: bit-identical
        jax.tree.map(np.testing.assert_array_equal, lora_run[name], stacks[0][name])
    assert np.abs(lora_run["lora"]["wq"]["u"]).max() > 0
    table = lora_run["embedding"]["embedding"]
    assert not np.array_equal(table, stacks[0]["embedding"]["embedding"])
    jax.tree.map(  # the final norm is frozen
        np.testing.assert_array_equal, lora_run["embedding"]["norm"], stacks[0]["embedding"]["norm"]
    )
    jax.tree.map(np.testing.assert_array_equal, full_run["lora"], stacks[1]["lora"])
    assert not np.array_equal(full_run["layers"]["wq"], stacks[1]["layers"]["wq"])
    np.testing.assert_array_equal(full_run["layers"]["wq"][2], 0.0)  # the padded layer


# -- the decisions, where the statement holds and where it does not -----------------------------


def test_positive_share_reads_the_sign_of_ov_and_the_decision_can_fail():
    rng = np.random.default_rng(0)
    wv = rng.standard_normal((4, 6, 2, 3))  # [S, D, H, K]
    ov = lambda wo: np.asarray(  # noqa: E731
        jax.vmap(spectra.ov_eigenvalues)(jnp.asarray(wv), jnp.asarray(wo))
    )
    copying = ov(np.transpose(wv, (0, 2, 3, 1)))  # W_O = W_V^T: W_V W_O is PSD, attractive
    repulsive = ov(-np.transpose(wv, (0, 2, 3, 1)))
    np.testing.assert_allclose(measures.positive_share(copying), 1.0)
    np.testing.assert_allclose(measures.positive_share(repulsive), 0.0)
    ts = np.arange(4) / 4
    late_positive = np.stack([repulsive[0], repulsive[1], copying[2], copying[3]])
    share = measures.positive_share(late_positive)
    assert measures.early_late(ts, share) == (0.0, 1.0)
    assert claims.ov_sign_decision(ts, np.stack([share] * 3))[0]
    # Negative controls: repulsive late depths, and a random (initialization-like) spectrum.
    assert not claims.ov_sign_decision(ts, np.stack([share[::-1]] * 3))[0]
    random = ov(rng.standard_normal((4, 2, 3, 6)))
    assert not claims.ov_sign_decision(ts, np.stack([measures.positive_share(random)] * 3))[0]


def test_pair_exponents_are_the_top_exponents_of_the_jacobian_blocks():
    model, params, tokens = _tiny(jnp.float64)
    x0 = measures.initial_state(model, params, tokens)
    lam = measures.pair_exponents(model, params, x0, 3)
    flow = lambda x: lyapunov.integrate(measures.token_field(model, params), x, num_steps=3)  # noqa: E731
    jac = np.asarray(jax.jit(jax.jacfwd(flow))(x0))  # [T, D, T, D]
    for q in range(T_LEN):
        for i in range(q + 1):
            top = np.linalg.svd(jac[q, :, i, :], compute_uv=False)[0]
            np.testing.assert_allclose(lam[q, i], np.log(top), rtol=1e-9)
    assert np.all(np.isneginf(lam[np.triu_indices(T_LEN, 1)]))  # causal


def test_recall_pairs_hits_and_the_kv_decision():
    inputs = np.array([3, 9, 5, 12, 0, 5, 7, 3])  # keys 3, 5 with values 9, 12; queries at 5, 7
    targets = np.full(8, -100)
    targets[5], targets[7] = 12, 9
    pairs = measures.recall_pairs(inputs, targets, -100)
    assert pairs == [(5, 2, 3), (7, 0, 1)]
    lam = np.full((8, 8), -1.0)
    lam[5, 3], lam[7, 4] = 2.0, 2.0  # query 5 points at its value; query 7 at a wrong token
    np.testing.assert_array_equal(measures.kv_hits(lam, pairs), [True, False])
    assert measures.chance_rate(pairs) == pytest.approx((2 / 5 + 2 / 7) / 2)
    assert claims.kv_decision(np.ones(12, bool), 0.2) == (True, True)
    # Negative controls: hits at chance level fail; too few queries cannot decide.
    assert claims.kv_decision(np.arange(12) % 4 == 0, 0.2)[0] is False
    assert claims.kv_decision(np.ones(3, bool), 0.2)[1] is False


def _finals(ode_full, ode_lora, discrete, scratch):
    counts = (2, 4, 8)
    final = {("scratch", 4, "full"): scratch}
    for mode, values in (("full", ode_full), ("lora", ode_lora)):
        final |= {("ode", m, mode): v for m, v in zip(counts, values, strict=True)}
    final |= {("discrete", 4, "full"): discrete[0], ("discrete", 4, "lora"): discrete[1]}
    return final, counts


def test_the_fig6_decisions_hold_and_fail():
    paper_like, counts = _finals([2.2, 2.1, 2.05], [2.6, 2.5, 2.45], (2.06, 2.55), 3.0)
    assert claims.beats_scratch(paper_like, counts)[0]
    assert claims.more_steps_better(paper_like, counts)[0]
    assert claims.ode_beats_discrete(paper_like, counts)[0]
    # Negative controls: scratch wins at N/2; fewer steps fine-tune better; discrete LoRA wins.
    worse, _ = _finals([3.1, 2.1, 2.05], [2.4, 2.5, 2.6], (2.06, 2.3), 3.0)
    assert not claims.beats_scratch(worse, counts)[0]
    assert not claims.more_steps_better(worse, counts)[0]
    assert not claims.ode_beats_discrete(worse, counts)[0]


def test_comparable_is_a_perplexity_ratio():
    assert claims.comparable([2.0, 2.1, 2.0], [2.0, 2.0, 2.05])[0]
    assert not claims.comparable([2.2, 2.2, 2.2], [2.0, 2.0, 2.0])[0]  # 22% higher perplexity


@pytest.mark.slow
def test_claims_run_at_a_tiny_size(tmp_path, monkeypatch):
    tiny_setup = dataclasses.replace(
        train.QUICK, d_model=16, d_ff=32, seq_len=8, train_steps=20, eval_batches=1, num_steps=4
    )
    tiny_lm = dataclasses.replace(
        TINY_LM, seq_len=16, pretrain_steps=6, finetune_steps=4, eval_batches=1
    )
    monkeypatch.setattr(train, "setup_for", lambda full: tiny_setup)
    monkeypatch.setattr(runs, "lm_setup_for", lambda full: tiny_lm)
    for claim in claims.PAPER.claims:
        ctx = Context(claim.id, False, jax.random.key(0), tmp_path)
        outcome = claim.measure(ctx)
        assert outcome.verdict in ("holds", "fails", "inconclusive")
        assert all(p.is_file() for p in outcome.figures)
