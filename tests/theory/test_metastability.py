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
    m = outcome.measured
    assert sum(m["histogram"].values()) == 24
    assert m["frequency_of_predicted"] == m["histogram"].get(4, 0) / 24
    assert m["most_frequent_count"] == max(m["histogram"], key=m["histogram"].get)
    assert outcome.verdict == ("holds" if m["most_frequent_count"] == 4 else "fails")


def test_metastable_then_merge_claim_holds_small(tmp_path):
    ctx = _ctx(tmp_path, "metastable_then_merge")
    outcome = claims.metastable_then_merge(ctx, size=(32, 8, 9.0))
    _check_outcome(outcome)
    assert outcome.verdict == "holds"
    m = outcome.measured
    assert m["median_time_held"] >= 3 * m["median_formation_time"]


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
