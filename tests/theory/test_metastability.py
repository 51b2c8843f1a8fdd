"""The measurements behind the metastability claims on known inputs, and every claim at a small
size: it runs, writes its figure, returns JSON-able values, and its verdict follows its rule."""

import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

from seqlab.dynamics import token_flow
from theory import runner
from theory.metastability import claims, measures
from theory.registry import Context, Outcome

matplotlib.use("Agg")


def _ctx(tmp_path: pathlib.Path, claim_id: str) -> Context:
    return Context(claim_id, False, jax.random.key(0), tmp_path / "figures")


def _check_outcome(outcome: Outcome) -> None:
    assert isinstance(outcome, Outcome)
    runner.to_json(outcome.measured), runner.to_json(outcome.expected)  # JSON-able
    assert all(pathlib.Path(f).is_file() for f in outcome.figures) and outcome.figures


def test_clusters_on_known_configurations():
    theta = np.concatenate([c + np.linspace(-0.01, 0.01, 5) for c in (0.0, 2.0, 4.0)])
    x = np.asarray(token_flow.on_circle(theta))
    counts, clustered = measures.cluster_history(np.stack([x, x.astype(np.float32)]))
    np.testing.assert_array_equal(counts, [3, 3])
    np.testing.assert_array_equal(clustered, [True, True])  # widest 0.02 < TIGHT
    # A straggler is a cluster of its own, unless clusters must hold a share of the particles;
    # a wide straggler-free configuration is then still not clustered.
    lone = np.asarray(token_flow.on_circle(np.append(theta, 1.0)))
    assert measures.cluster_history(lone[None])[0][0] == 4
    assert measures.cluster_history(lone[None], share=0.1)[0][0] == 3
    loose = np.asarray(token_flow.on_circle(np.array([0.0, 0.06, 0.12, 2.0])))
    counts, clustered = measures.cluster_history(loose[None])
    assert counts[0] == 2 and not clustered[0]  # one cluster spans 0.12 > TIGHT
    spread = np.asarray(token_flow.on_circle(np.linspace(0, 2 * np.pi, 200, endpoint=False)))
    assert [v.tolist() for v in measures.cluster_history(spread)] == [1, False]


def test_random_start_states_are_metastable_states_of_uniform_runs():
    key = jax.random.key(3)
    ts, counts, clustered, states = measures.random_start_states(
        key, 4, 32, 9.0, horizon=20.0, per_unit=4, normalized=True
    )
    assert ts.shape == (41,) and counts.shape == clustered.shape == (4, 41)
    assert ts[-1] == pytest.approx(20.0, rel=1e-5)  # units of 1 / lambda_k*
    for c, k, state in zip(counts, clustered, states, strict=True):
        assert state == measures.metastable(ts, c, k, measures.PERSIST)
    x0 = measures.uniform_starts(key, 4, 32)
    assert x0.shape == (4, 32, 2) and x0.dtype == jnp.float32


def test_one_step_and_energies_follow_the_flow():
    with jax.enable_x64(True):
        x0 = measures.uniform_starts(jax.random.key(1), 1, 16).astype(jnp.float64)
        traj = measures.flows(
            x0, jnp.full(1, 3.0), jnp.full(1, 0.5), n_steps=8, n_saves=4, normalized=False
        )
        stepped = measures.one_step(traj.xs[0, :-1], 3.0, 0.125, n_steps=2)
        np.testing.assert_allclose(stepped, traj.xs[0, 1:], atol=1e-12)
        e = measures.energies(traj.xs[0], 3.0)
        assert e.shape == (5,) and np.all(np.diff(np.asarray(e)) > 0)  # USA ascends E
    rate = measures.rate_of(9.0, False)
    assert rate == token_flow.growth_rate(4, 9.0, 2, normalized=False)  # k* = 4 at beta = 9
    assert measures.flows(x0, jnp.full(1, 3.0), jnp.full(1, 0.5), n_steps=8, n_saves=4,
                          normalized=False, block_size=8).xs.shape == (1, 5, 16, 2)  # fmt: skip


def test_metastable_finds_the_first_persistent_count():
    ts = np.arange(12.0)
    counts = np.array([9, 7, 5, 4, 4, 3, 3, 3, 3, 3, 2, 2])
    clustered = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], bool)
    # 5 holds 1, 4 holds 2: too short; 3 holds from t = 5 to t = 10.
    assert measures.metastable(ts, counts, clustered, 4.0) == (3, 5.0, 10.0)
    assert measures.metastable(ts, counts, clustered, 1.0) == (5, 2.0, 3.0)
    assert measures.metastable(ts, counts, clustered, 20.0) is None
    never = np.full(12, 3)
    assert measures.metastable(ts, never, clustered, 4.0) == (3, 2.0, np.inf)


def test_perturbation_gives_every_mode_the_same_amplitude():
    eps, modes = 1e-6, np.arange(1, 9)
    with jax.enable_x64(True):
        x = token_flow.on_circle(jnp.asarray(measures.perturbed(64, modes, eps)))
        amps = np.asarray(token_flow.mode_amplitudes(x, modes))
    np.testing.assert_allclose(amps, eps / 2, rtol=1e-4)  # linear in eps up to O(eps^2)


def test_growth_rates_claim_holds_small(tmp_path):
    outcome = claims.growth_rates_circle(_ctx(tmp_path, "growth_rates_circle"), size=(32, 4.0, 4))
    _check_outcome(outcome)
    assert outcome.verdict == "holds"
    assert outcome.measured["sa_max_rel_err"] <= claims.GROWTH_RTOL
    assert outcome.measured["fastest_mode"] == token_flow.dominant_mode(4.0, 2) == 3


def test_growth_rates_sphere_claim_holds_small(tmp_path):
    outcome = claims.growth_rates_sphere(_ctx(tmp_path, "growth_rates_sphere"), size=(200, 4.0, 3))
    _check_outcome(outcome)
    assert outcome.verdict == "holds"
    assert outcome.measured["fastest_mode"] == token_flow.dominant_mode(4.0, 3) == 2


def test_zonal_perturbation_excites_one_degree():
    # The lattice response at t = 0: the degree-k amplitude moves by O(eps), the others by
    # O(eps^2) plus the lattice's own quadrature error, which the base run cancels.
    base = token_flow.fibonacci_sphere(500)
    moved = measures.zonal_perturbation(base, 3, 1e-5)
    np.testing.assert_allclose(np.linalg.norm(moved, axis=1), 1.0, atol=1e-14)
    shift = [
        measures.zonal_amplitude(moved, k) - measures.zonal_amplitude(base, k)
        for k in (1, 2, 3, 4, 5)
    ]
    assert abs(shift[2]) > 1e-6
    assert max(abs(v) for i, v in enumerate(shift) if i != 2) < 1e-3 * abs(shift[2])


def test_dominant_mode_count_claim_holds_small(tmp_path):
    ctx = _ctx(tmp_path, "dominant_mode_count")
    outcome = claims.dominant_mode_count(ctx, size=(64, (1.0, 4.0, 9.0)))
    _check_outcome(outcome)
    assert outcome.verdict == "holds"
    np.testing.assert_array_equal(outcome.measured["cluster_count"], [1, 3, 4])
    np.testing.assert_array_equal(outcome.measured["fastest_mode"], [1, 3, 4])


def test_random_start_frequency_follows_its_rule(tmp_path):
    ctx = _ctx(tmp_path, "random_start_frequency")
    outcome = claims.random_start_frequency(ctx, size=(48, 24, 9.0))
    _check_outcome(outcome)
    m, e = outcome.measured, outcome.expected
    assert sum(m["histogram"].values()) == 24
    assert m["frequency_of_predicted"] == m["histogram"].get(4, 0) / 24
    p = e["frequency_of_predicted"]
    assert 0 < p < 1 and abs(sum(e["race_estimate"].values()) - 1) < 1e-9
    within = abs(m["frequency_of_predicted"] - p) <= 3 * np.sqrt(p * (1 - p) / 24)
    assert outcome.verdict == ("holds" if within else "fails")


def test_usa_energy_monotone_claim_holds_small(tmp_path):
    outcome = claims.usa_energy_monotone(_ctx(tmp_path, "usa_energy_monotone"), size=(32, 9.0))
    _check_outcome(outcome)
    assert outcome.verdict == "holds"
    assert outcome.measured["energy_end"] > outcome.measured["energy_start"]


def test_energy_can_decrease_without_the_gradient_structure():
    # The energy check can fail: E_beta rises along SA and USA with Q = K = V = I
    # (dE/dt = (1/n^2) sum_i Z_i |v_i|^2 with Z_i = n or the softmax normalizer), but not along a
    # flow with a random value map V, where dE/dt = sum_i <grad_i E, v_i> takes both signs.
    beta, rng = 3.0, np.random.default_rng(0)
    rates = {"sa": [], "usa": [], "random V": []}
    for _ in range(20):
        x = rng.normal(size=(6, 3))
        x = jnp.asarray(x / np.linalg.norm(x, axis=1, keepdims=True))
        V = jnp.asarray(rng.normal(size=(3, 3)))
        for name, kwargs in [
            ("sa", {}),
            ("usa", {"normalized": False}),
            ("random V", {"normalized": False, "V": V}),
        ]:
            v = token_flow.vector_field(x, beta=beta, **kwargs)
            _, rate = jax.jvp(lambda y: token_flow.energy(y, beta=beta), (x,), (v,))
            rates[name].append(float(rate))
    assert min(rates["sa"]) >= 0 and min(rates["usa"]) >= 0
    assert min(rates["random V"]) < 0


# --- formation, phase, mean field, lifetime, frequency, bridge ---


def test_first_crossing_and_linear_fit():
    ts = np.linspace(0, 4, 9)
    amplitudes = np.stack([0.01 * np.exp(2 * ts), 0.001 * np.exp(ts), np.full(9, 0.6)])
    got = measures.first_crossing(ts, amplitudes, 0.5)
    np.testing.assert_allclose(got[0], np.log(50) / 2, rtol=1e-12)  # log-linear: exact
    assert np.isnan(got[1]) and np.isnan(got[2])  # never within the window; already above
    slope, err = measures.linear_fit([1, 2, 3, 4], [3, 5, 7, 9])
    assert slope == pytest.approx(2) and err == pytest.approx(0, abs=1e-12)
    with pytest.raises(ValueError, match="x and y must be 1-D"):
        measures.linear_fit([1, 2], [1, 2])


def test_saturation_time_is_the_log_of_the_initial_amplitude():
    # The property behind t_sat ~ ln(n) / (2 lambda): a mode started at amplitude a saturates at
    # ln(1/2a) / lambda plus a constant, so dividing a by e^2 delays it by 2 / lambda_k (USA,
    # beta = 4, k* = 3, equally spaced particles). A wrong rate would shift it by 2 / rate.
    beta, k, n = 4.0, 3, 96
    rate = measures.rate_of(beta, False)
    with jax.enable_x64(True):
        starts = [measures.perturbed(n, [k], 2 * a) for a in (1e-4, 1e-4 * np.exp(-2))]
        x0 = token_flow.on_circle(jnp.asarray(np.stack(starts)))
        traj = measures.flows(x0, jnp.full(2, beta), jnp.full(2, 12 / rate), n_steps=480,
                              n_saves=240, normalized=False)  # fmt: skip
        amps = np.asarray(measures.fourier_history(traj.xs, jnp.asarray([k])))[..., 0]
    t = measures.first_crossing(np.asarray(traj.ts[0]) * rate, np.abs(amps), measures.SATURATION)
    assert t[1] - t[0] == pytest.approx(2.0, abs=0.02)


def test_race_estimate_and_race_times():
    rng = np.random.default_rng(0)
    np.testing.assert_allclose(measures.race_estimate([1.0] * 4, 100, 0.5, 40_000, rng), 0.25,
                               atol=0.01)  # fmt: skip
    assert measures.race_estimate([1.0, 3.0], 100, 0.5, 10_000, rng)[1] > 0.99
    # One mode: mean t_sat = (ln(1/2) + ln(n)/2 - E ln|xi|) / lambda, slope 1/2 in ln n exactly.
    times = measures.race_times([2.0], [100, 100 * np.e**2])
    assert times[1] - times[0] == pytest.approx(1.0, abs=1e-9)


def test_cluster_centres_and_their_error():
    k, phase = 3, 0.7
    centres = (phase + 2 * np.pi * np.arange(k)) / k
    theta = np.concatenate([c + np.linspace(-0.02, 0.02, 20) for c in centres] + [[2.9]])
    x = np.asarray(token_flow.on_circle(theta))
    assert len(measures.cluster_centres(x)) == 4  # the straggler at 2.9 too
    found = measures.cluster_centres(x, min_share=0.05)
    np.testing.assert_allclose(np.sort(np.mod(found, 2 * np.pi)), np.sort(centres), atol=1e-9)
    assert measures.centre_error(found, phase, k) == pytest.approx(0, abs=1e-9)
    # Negative control: the antiphase pattern (centres half a spacing away) scores 1, the
    # claim's threshold 1/4 rejects it.
    assert measures.centre_error(found, phase + np.pi, k) == pytest.approx(1.0)


def test_clusters_form_at_the_peaks_of_the_initial_mode():
    # The phase property at a small size, deterministic: equally spaced particles with a small
    # k* = 3 mode of phase 1.1 on top of a weaker k = 2 mode form 3 clusters centred at
    # (1.1 + 2 pi m) / 3 (USA, beta = 4).
    beta, k, n, phase = 4.0, 3, 120, 1.1
    theta = measures.equally_spaced(n)
    # A displacement -eps sin(k theta - phase) / k adds eps cos(k theta - phase) to the density.
    theta = theta - 2e-3 * np.sin(k * theta - phase) / k - 1e-3 * np.sin(2 * theta + 0.3) / 2
    rate = measures.rate_of(beta, False)
    with jax.enable_x64(True):
        x0 = token_flow.on_circle(jnp.asarray(theta))
        c0 = complex(token_flow.fourier_modes(x0, [k])[0])
        x1 = token_flow.integrate(x0, beta=beta, t1=10 / rate, n_steps=200, n_saves=1,
                                  normalized=False).xs[-1]  # fmt: skip
    centres = measures.cluster_centres(np.asarray(x1), min_share=0.05)
    assert len(centres) == k
    assert measures.centre_error(centres, np.angle(c0), k) < 0.1
    assert np.angle(c0) == pytest.approx(phase, abs=1e-6)


@pytest.mark.slow
def test_cluster_phase_claim_small(tmp_path):
    outcome = claims.cluster_phase(_ctx(tmp_path, "cluster_phase"), size=(256, 12))
    _check_outcome(outcome)
    m = outcome.measured
    decided = m["runs_with_k_star_clusters"] >= 8
    expected = ("holds" if m["median_error"] <= 0.25 else "fails") if decided else "inconclusive"
    assert outcome.verdict == expected


@pytest.mark.slow
def test_formation_and_mean_field_claims_small(tmp_path):
    size = ((64, 128, 256), (6, 6, 6))
    formation = claims.formation_time(_ctx(tmp_path, "formation_time"), size=size)
    _check_outcome(formation)
    m = formation.measured
    assert m["runs_not_saturated"] == 0
    assert formation.verdict == ("holds" if 0.4 <= m["slope"] <= 0.6 else "fails")
    outcome = claims.mean_field_limit(_ctx(tmp_path, "mean_field_limit"), size=size)
    _check_outcome(outcome)
    slope = outcome.measured["slope"]
    assert outcome.verdict == ("holds" if -0.6 <= slope <= -0.4 else "fails") and slope < 0


def test_mean_field_negative_control():
    # The same measure against the linearized solution of another beta (rates off by about 60%):
    # the error stops shrinking with n, the slope leaves [-0.6, -0.4] and the claim would fail.
    ks, rms, wrong = np.arange(1, 9), [], []
    for n, r in ((64, 6), (256, 6), (1024, 6)):
        ts, _, modes, _ = measures.saturation_runs(jax.random.key(n), r, n, 4.0)
        stop = int(np.argmin(np.abs(ts - 1.0))) + 1
        m = modes[:, :stop].astype(np.complex128)
        t1 = ts[stop - 1] / measures.rate_of(4.0, False)
        for beta, out in ((4.0, rms), (3.0, wrong)):
            rel = measures.linearization_errors(m[:, 0], m[:, -1], ks, t1, beta)
            out.append(np.sqrt(np.mean(rel**2)))
    slope, _ = measures.linear_fit(np.log([64, 256, 1024]), np.log(rms))
    wrong_slope, _ = measures.linear_fit(np.log([64, 256, 1024]), np.log(wrong))
    assert -0.6 <= slope <= -0.4
    assert wrong_slope > -0.3


def test_lifetimes_and_censored_median():
    states = [(3, 1.0, 5.0), None, (4, 2.0, np.inf), (3, 0.5, 2.5)]
    np.testing.assert_array_equal(measures.lifetimes(states), [4.0, np.inf, 2.0])
    assert measures.censored_median([4.0, np.inf, 2.0]) == 4.0
    assert measures.censored_median([np.inf, np.inf, 2.0]) == np.inf
    assert np.isnan(measures.censored_median([]))


@pytest.mark.slow
def test_metastable_lifetime_claim_follows_its_rule(tmp_path):
    ctx = _ctx(tmp_path, "metastable_lifetime")
    outcome = claims.metastable_lifetime(ctx, size=(32, 6, 60.0))
    _check_outcome(outcome)
    steps = outcome.measured["longer_at_each_step"]
    medians = outcome.measured["median_lifetime"]
    assert len(steps) == 3 and len(medians) == 4
    if any(s is False for s in steps):
        assert outcome.verdict == "fails"
    else:
        assert outcome.verdict == ("holds" if all(steps) else "inconclusive")


def test_attention_module_gives_the_token_flow():
    with jax.enable_x64(True):
        rng = np.random.default_rng(4)
        x = rng.normal(size=(7, 3))
        x = jnp.asarray(x / np.linalg.norm(x, axis=1, keepdims=True))
        module, params = measures.identity_attention(3, 2.5)
        update = measures.attention_update(module, params, x)
        w = np.exp(2.5 * np.asarray(x) @ np.asarray(x).T)
        np.testing.assert_allclose(update, (w / w.sum(1, keepdims=True)) @ x, atol=1e-13)
        # The softmax weights hold every token: not the causal mask's lower triangle.
        one = module.apply(params, measures.embed(x, module.d_model)[None])[0, 0, 1:4]
        assert np.abs(one - x[0]).max() < 1e-13 and np.abs(update[0] - x[0]).max() > 1e-3


@pytest.mark.slow
def test_attention_bridge_claim_small(tmp_path):
    ctx = _ctx(tmp_path, "attention_bridge")
    outcome = claims.attention_bridge(ctx, size=(8, 3, (8, 16, 32)))
    _check_outcome(outcome)
    assert outcome.verdict == "holds"
    assert outcome.measured["field_error"] <= 1e-12
