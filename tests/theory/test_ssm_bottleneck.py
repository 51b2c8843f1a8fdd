"""The properties behind the claims, on a tiny Mamba and a tiny SSM stack: they hold where the
paper says and the same measurements detect their absence elsewhere."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqlab.analysis import rates
from seqlab.modules.mamba import Mamba
from theory.ssm_bottleneck import claims, measures, mqar

T = 24


@pytest.fixture(scope="module")
def polarized():
    """Influence, step sizes and A of a random `Mamba(polarize=(1, 1))`, N = 1 + 2 + 1."""
    model = Mamba(d_model=4, d_state=2, polarize=(1, 1))
    params, x = measures.init_with_input(model, jax.random.key(0), T)
    infl, dt, A = (
        np.asarray(v, np.float64) for v in measures.influence_and_steps(model, params, x)
    )
    rho, dt_r, _ = (
        np.asarray(v, np.float64) for v in measures.retention_and_steps(model, params, x)
    )
    return dict(model=model, infl=infl, dt=dt, A=A, rho=rho, dt_r=dt_r)


def _rates(infl, dt, width):
    """Fitted decay rate per state channel, as the claim computes it."""
    s = np.arange(T - width + 1)
    tau = measures.elapsed(dt, s + width).T
    window = infl[:, :, s]
    valid = window > measures.UNDERFLOW
    log_w = np.log(np.where(valid, window, 1.0))
    return np.array(
        [-rates.pooled_slope(tau, log_w[:, n], valid[:, n]) for n in range(infl.shape[1])]
    )


def test_elapsed_is_the_step_size_still_to_come():
    dt = np.arange(1.0, 5.0)[:, None] * np.ones((1, 2))  # [T=4, d=2]: 1, 2, 3, 4
    np.testing.assert_array_equal(measures.elapsed(dt, np.array([0, 2, 4, 9]))[:, 0], [10, 7, 0, 0])


def test_smoothing_curves_are_scale_free_where_the_measure_is():
    xs = np.random.default_rng(2).normal(size=(3, 6, 4))
    got, scaled = measures.smoothing_curves(xs), measures.smoothing_curves(1e-3 * xs)
    np.testing.assert_allclose(scaled["diameter"], 1e-3 * got["diameter"], rtol=1e-5)
    np.testing.assert_allclose(
        scaled["dirichlet_energy"], 1e-6 * got["dirichlet_energy"], rtol=1e-5
    )
    np.testing.assert_allclose(
        scaled["relative_dirichlet_energy"], got["relative_dirichlet_energy"], rtol=1e-5
    )
    np.testing.assert_allclose(got["linf_diameter"], np.ptp(xs, axis=1).max(axis=1), rtol=1e-6)


def test_influence_is_causal_and_carried_by_the_one_channel(polarized):
    infl, A = polarized["infl"], polarized["A"]
    assert A[0, 0] == 0.0 and A[0, -1] == -100.0
    rates = _rates(infl, polarized["dt"], polarized["model"].conv_size)
    assert abs(rates[0]) <= 0.25  # 1-channel: no decay
    np.testing.assert_allclose(rates[1:3], -A[0, 1:3], rtol=0.25)  # learnable: rate |A_n|
    assert rates[-1] > 50  # 0-channel: fast decay (rate 100 up to the fit)


def test_unpolarized_channels_do_decay():
    # The same measurement on a plain Mamba: its first state channel (A = -1) is not a 1-channel.
    model = Mamba(d_model=4, d_state=2)
    params, x = measures.init_with_input(model, jax.random.key(1), T)
    infl, dt, A = (
        np.asarray(v, np.float64) for v in measures.influence_and_steps(model, params, x)
    )
    rates = _rates(infl, dt, model.conv_size)
    assert A[0, 0] == -1.0
    assert rates[0] > 0.5  # would fail the 1-channel criterion |rate| <= 0.25
    np.testing.assert_allclose(rates, -A[0], rtol=0.25)


def test_one_step_retention_is_the_transition(polarized):
    rho, dt, A = polarized["rho"], polarized["dt_r"], polarized["A"]  # rho: [T, d, N]
    np.testing.assert_allclose(rho, np.exp(dt[:, :, None] * A[None]), rtol=1e-5, atol=1e-7)
    assert np.all(rho[..., 0] == 1.0)  # the 1-channel keeps all of its state
    zero = rho[..., -1]
    dt_star = np.log(1 / claims.FORGET) / 100.0
    assert np.all(zero[dt >= dt_star * 1.01] <= claims.FORGET)
    assert np.all(zero[dt <= dt_star * 0.99] > claims.FORGET)
    # A weak "zero" channel (A = -1) never forgets in one step at these step sizes.
    assert np.all(rho[..., 1] > 0.5)


# -- recency and over-smoothing -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack_layers():
    return measures.stack_layers(jax.random.key(5), 4, 3)


def test_recency_fit_recovers_a_geometric_decay():
    # I[t, s] = c_b * rho^(t - s): the fitted slope is log rho exactly; above log A_max when
    # rho > A_max, which the claim's check reports as a failure.
    rho, length = 0.9, 10
    dist = np.arange(length)[:, None] - np.arange(length)[None, :]
    infl = np.stack([c * rho ** np.maximum(dist, 0) for c in (0.5, 2.0)])
    fit = measures.recency_fit(infl, min_distance=2)
    assert fit["slope"] == pytest.approx(np.log(rho), rel=1e-10)
    assert fit["slope_stderr"] < 1e-10
    assert fit["slope"] - 2 * fit["slope_stderr"] > np.log(0.85)  # rho > A_max = 0.85: fails


def test_recency_slope_of_a_mamba_is_below_log_a_max():
    model = Mamba(d_model=4, d_state=2)
    xs = jax.random.normal(jax.random.key(2), (2, T, 4), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(3), xs)
    prof = measures.recency_profile(model, params, xs, min_distance=model.conv_size)
    assert -0.01 < prof["log_a_max"] < 0.0  # the slowest channel: A = -1, dt ~ 1e-3
    assert prof["slope"] + 2 * prof["slope_stderr"] <= prof["log_a_max"]


# -- recency against A_max and linearity --------------------------------------------------------


def test_r_squared_of_a_line_and_of_a_curve():
    x = np.arange(10.0)
    assert measures.r_squared(x, 3.0 - 0.5 * x) == pytest.approx(1.0)
    assert measures.r_squared(x, np.cos(x * 2 * np.pi / 10)) < 0.2


def test_with_a_max_sets_the_largest_transition():
    model = Mamba(d_model=4, d_state=3)
    xs = jax.random.normal(jax.random.key(4), (1, 12, 4), jnp.float32)
    params = jax.jit(model.init)(jax.random.key(5), xs)
    for target in (0.5, 0.99):
        p = measures.with_a_max(model, params, xs, target)
        _, top = measures.transition_range(model.apply(p, xs, method="op_inputs"))
        assert float(jnp.max(top)) == pytest.approx(target, rel=1e-5)
        A = -np.exp(np.asarray(p["params"]["A_log"]))
        np.testing.assert_allclose(A / A[:, :1], np.arange(1, 4)[None] * np.ones((8, 1)), rtol=1e-5)
    with pytest.raises(ValueError, match="a_max"):
        measures.with_a_max(model, params, xs, 1.0)
    with pytest.raises(ValueError, match="unpolarized"):
        measures.with_a_max(Mamba(d_model=4, d_state=3, polarize=(1, 0)), params, xs, 0.5)


def _geometric(a_max, length=16, floor=0.0):
    """Influence matrices `[1, T, T]` with `I[t, s] = a_max^(t - s) + floor`."""
    dist = np.arange(length)[:, None] - np.arange(length)[None, :]
    return (a_max ** np.maximum(dist, 0) + floor)[None]


def test_rate_exponent_is_one_for_a_geometric_decay_and_zero_for_a_fixed_rate():
    a_max = np.array(claims.A_MAX_SWEEP)
    rates_ = np.array([-measures.recency_fit(_geometric(a), 2)["slope"] for a in a_max])
    assert measures.rate_exponent(rates_, a_max)["slope"] == pytest.approx(1.0, abs=1e-6)
    # Negative control: a decay rate that ignores A_max gives exponent 0, outside [0.8, 1.25].
    assert measures.rate_exponent(np.full(a_max.shape, 0.3), a_max)["slope"] == pytest.approx(0)


def test_log_influence_is_linear_without_a_one_channel_and_not_with_one():
    fit = measures.recency_fit(_geometric(0.8), 2, 12)
    assert measures.r_squared(fit["distances"], fit["profile"]) == pytest.approx(1.0)
    # A non-decaying channel (the 1-channel: a constant floor) bends the profile flat.
    fit = measures.recency_fit(_geometric(0.5, floor=3e-2), 2, 12)
    assert measures.r_squared(fit["distances"], fit["profile"]) < 0.9


def test_recency_fit_rejects_bad_distances():
    with pytest.raises(ValueError, match="max_distance"):
        measures.recency_fit(_geometric(0.5), 2, 16)


def test_recency_fit_stops_where_the_influence_underflows_float32():
    # 1e-6^r is below float32's smallest normal (1.2e-38) from r = 7: the profile keeps r = 2..6,
    # where the slope is still exact; with the profile cut to fewer than 3 points it refuses.
    fit = measures.recency_fit(_geometric(1e-6, length=20), 2, 18)
    assert list(fit["distances"]) == [2, 3, 4, 5, 6]
    assert np.all(np.isfinite(fit["profile"]))
    assert fit["slope"] == pytest.approx(np.log(1e-6), rel=1e-10)
    with pytest.raises(ValueError, match="underflow"):
        measures.recency_fit(_geometric(1e-13, length=20), 2, 18)


# -- over-smoothing -----------------------------------------------------------------------------


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), a_min=st.sampled_from([0.3, 0.9, 0.99]))
def test_normalized_stack_obeys_theorem_4_2(stack_layers, seed, a_min):
    x = jax.random.normal(jax.random.key(seed), (12, 3), jnp.float32)
    run = measures.normalized_stack(x, stack_layers, a_min)
    np.testing.assert_allclose(run["a_min"], a_min, rtol=1e-5)
    ratio = measures.sup_diameter(run["outputs"]) / measures.sup_diameter(run["inputs"])
    assert np.all(ratio <= (1 - run["a_min"] ** 11) * (1 + 1e-5))
    # Convex combinations: every output lies within its input's channel ranges.
    assert np.all(run["outputs"].max(1) <= run["inputs"].max(1) + 1e-6)
    assert np.all(run["outputs"].min(1) >= run["inputs"].min(1) - 1e-6)


def test_unnormalized_stack_breaks_the_bound(stack_layers):
    # Negative control: without the (1 - A_t) factor the states accumulate inputs, the diameter
    # grows and the claim's check fails.
    x = jax.random.normal(jax.random.key(3), (12, 3), jnp.float32)
    run = measures.normalized_stack(x, stack_layers, 0.9, normalized=False)
    ratio = measures.sup_diameter(run["outputs"]) / measures.sup_diameter(run["inputs"])
    assert np.any(ratio > 1 - run["a_min"] ** 11)


def test_without_zero_channel_is_the_mixer_with_that_channel_silenced():
    block, (params,) = measures.mixer_blocks(jax.random.key(7), 1, 4, d_state=2, polarize=(0, 1))
    ablated = measures.without_zero_channel(params, block.mixer)
    plain = type(block)(mixer=Mamba(d_model=4, d_state=2))
    x = jax.random.normal(jax.random.key(8), (1, 10, 4), jnp.float32)
    # Zeroing the 0-channel's C column removes its contribution to y = sum_n C_n h_n.
    silenced = jax.tree.map(lambda v: v, params)
    w = silenced["params"]["mixer"]["x_proj"]
    silenced["params"]["mixer"]["x_proj"] = w.at[:, -1].set(0.0)
    np.testing.assert_allclose(
        plain.apply(ablated, x), block.apply(silenced, x), rtol=1e-5, atol=1e-6
    )
    assert not np.allclose(block.apply(params, x), block.apply(silenced, x))
    with pytest.raises(ValueError, match="polarize"):
        measures.without_zero_channel(ablated, plain.mixer)
    # The stacks: the residual layer adds the bare layer's output to its input.
    bare = measures.block_stack(plain, [ablated], x[0], residual=False)
    res = measures.block_stack(plain, [ablated], x[0], residual=True)
    assert bare.shape == res.shape == (2, 10, 4)
    np.testing.assert_allclose(res[1] - res[0], bare[1], rtol=1e-5, atol=1e-6)


# -- the Table 2 decision ------------------------------------------------------------------------


def test_paired_gain():
    g = mqar.paired_gain(np.array([0.5, 0.6, 0.7]), np.array([0.4, 0.4, 0.4]))
    assert g["gain"] == pytest.approx(0.2)
    assert g["stderr"] == pytest.approx(0.1 / np.sqrt(3))
    with pytest.raises(ValueError, match="2 seeds"):
        mqar.paired_gain(np.array([0.5]), np.array([0.4]))


def _acc(d2, p2, d4, p4):
    return {(False, 2): d2, (True, 2): p2, (False, 4): d4, (True, 4): p4}


def test_table2_decision_on_the_papers_numbers_and_on_counterexamples():
    jitter = np.array([-0.01, 0.0, 0.01])
    # Table 2 (256 pairs): default 36.0 / 33.5, polarized 54.7 / 81.6 -> holds.
    paper = _acc(0.36 + jitter, 0.547 + jitter, 0.335 + jitter, 0.816 - jitter)
    assert mqar.table2_verdict(paper, chance=2 / 8192)["verdict"] == "holds"
    # Negative controls: polarization worse at 4 layers; gains that shrink with depth.
    worse = _acc(0.36 + jitter, 0.55 + jitter, 0.6 + jitter, 0.3 + jitter)
    assert mqar.table2_verdict(worse, chance=2 / 8192)["verdict"] == "fails"
    shrinking = _acc(0.3 + jitter, 0.7 + jitter, 0.3 + jitter, 0.4 + jitter)
    assert mqar.table2_verdict(shrinking, chance=2 / 8192)["verdict"] == "fails"
    # Everything at chance: nothing separates the models.
    floor = _acc(*(0.06 + jitter for _ in range(4)))
    assert mqar.table2_verdict(floor, chance=1 / 16)["verdict"] == "inconclusive"


def test_variant_masks_make_the_default_and_the_shallow_model():
    setup = dataclasses.replace(mqar.QUICK, d_model=8, d_state=2, vocab_size=16, seq_len=8)
    lm = mqar.model(setup, polarized=True, layers=2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (1, 8)))
    params = lm.init(jax.random.key(0), tokens)["params"]
    default = mqar.variant_mask(lm, params, polarized=False, layers=2)
    shallow = mqar.variant_mask(lm, params, polarized=True, layers=1)

    def masked(mask):
        return jax.tree.map(jnp.multiply, params, mask)

    # Default: the polarized model with the fixed channels' B and C columns masked is the default
    # Mamba model with those columns removed.
    plain = mqar.model(setup, polarized=False, layers=2)
    rank, n = 1, setup.d_state + 2
    keep = np.array(
        [
            i
            for i in range(rank + 2 * n)
            if i not in (rank, rank + n - 1, rank + n, rank + 2 * n - 1)
        ]
    )
    removed = jax.tree_util.tree_map_with_path(
        lambda path, v: v[:, keep] if getattr(path[-1], "key", "") == "x_proj" else v,
        masked(default),
    )
    np.testing.assert_allclose(
        lm.apply({"params": masked(default)}, tokens),
        plain.apply({"params": removed}, tokens),
        rtol=1e-5,
        atol=1e-6,
    )
    assert not np.allclose(
        lm.apply({"params": masked(default)}, tokens), lm.apply({"params": params}, tokens)
    )
    # Shallow: the second block is the identity, so the model is the 1-layer one.
    one = mqar.model(setup, polarized=True, layers=1)
    sub = {k: v for k, v in masked(shallow).items() if k != "blocks_1"}
    np.testing.assert_allclose(
        lm.apply({"params": masked(shallow)}, tokens),
        one.apply({"params": sub}, tokens),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.slow
def test_mqar_training_runs_and_reports_per_seed():
    setup = dataclasses.replace(mqar.QUICK, steps=3, warmup_steps=1, eval_batches=1)
    runs = mqar.train_all(setup)
    for key in [(p, L) for L in setup.depths for p in (False, True)]:
        run = runs[key]
        assert run["accuracy"].shape == (3,) and run["losses"].shape == (3, 3)
        assert np.all((run["accuracy"] >= 0) & (run["accuracy"] <= 1))
        assert np.all(np.isfinite(run["losses"]))


def test_model_level_claims_measure_a_hugging_face_directory(tmp_path):
    """`python -m theory --model HF_DIR --only ssm_bottleneck`: the recency and over-smoothing
    claims run on a model read by `seqlab.interop` (a random Mamba-1 written by `save_hf`)."""
    from seqlab.interop import save_hf
    from seqlab.modules.lm import LanguageModel
    from theory import registry, runner

    model = LanguageModel(vocab_size=23, d_model=16, pattern="mm", mamba={"d_state": 4})
    params = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))["params"]
    save_hf(model, params, tmp_path / "hf")
    papers = registry.load_papers(["ssm_bottleneck"])
    status = runner.run(papers, out=tmp_path / "out", model=str(tmp_path / "hf"))
    assert status == 0
    records = json.loads((tmp_path / "out" / "claims.json").read_text())
    assert {r["id"] for r in records} == {"recency_log_linear_trained", "oversmoothing_mixer"}
    for r in records:
        assert r["measured"]["model"] == str(tmp_path / "hf")
        assert r["verdict"] in ("holds", "fails")
