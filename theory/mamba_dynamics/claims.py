"""Claims of Vo et al., "Demystifying the token dynamics of deep selective state space models"
(arXiv 2410.03292), measured on `seqlab.modules.mamba.Mamba`.

The continuous-time token dynamics are driven by the interaction matrix `M = S_C^T S_B` (d_inner x
d_inner, rank <= N): tokens converge when the symmetric part of `M` is negative definite and diverge
when it is positive definite. Refinement 1 ties `S_B = diag(lambda) S_C`, so that
`M = S_C^T diag(lambda) S_C` has the signs of `lambda` by construction.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.analysis import rates
from seqlab.dynamics import mamba_ode
from seqlab.modules.mamba import Mamba
from theory.mamba_dynamics import figures, measures, train
from theory.mamba_dynamics.measures import REL_TOL
from theory.registry import Context, Outcome, Paper, verdict

PAPER = Paper("mamba_dynamics", "Vo et al., token dynamics of selective SSMs (2410.03292)")


@PAPER.claim(
    "sign_constraint_spectra",
    "With S_B = diag(lambda) S_C (Refinement 1), the interaction matrix M = S_C^T S_B of every "
    "random init has a symmetric part with eigenvalues >= 0 for sign_constraint='pos', <= 0 for "
    "'neg' and of both signs for 'mixed' (zero meaning |eig| <= 1e-5 ||M||_2), and rank(M) <= N "
    "(singular values above 1e-5 ||M||_2) in all three.",
    kind="construction",
)
def sign_constraint_spectra(ctx: Context) -> Outcome:
    d_model, d_state, inits = ctx.size((8, 4, 32), (16, 16, 256))
    constraints = ("pos", "neg", "mixed", None)  # None: the unconstrained contrast
    summaries = {
        c: measures.spectrum_summary(
            measures.interaction_matrices(
                Mamba(d_model=d_model, d_state=d_state, sign_constraint=c),
                jax.random.fold_in(ctx.key, i),
                inits,
            )
        )
        for i, c in enumerate(constraints)
    }
    pos, neg, mixed = (summaries[c]["eig"] for c in ("pos", "neg", "mixed"))
    checks = dict(
        pos_min_eig=pos.min(),  # >= -REL_TOL
        neg_max_eig=neg.max(),  # <= REL_TOL
        mixed_fraction_both_signs=np.mean((mixed.min(1) < -REL_TOL) & (mixed.max(1) > REL_TOL)),
        max_rank=max(int(summaries[c]["rank"].max()) for c in ("pos", "neg", "mixed")),
    )
    holds = (
        checks["pos_min_eig"] >= -REL_TOL
        and checks["neg_max_eig"] <= REL_TOL
        and checks["mixed_fraction_both_signs"] == 1.0
        and checks["max_rank"] <= d_state
    )
    free = summaries[None]
    path = ctx.figure()
    figures.spectra(path, summaries, d_state)
    return Outcome(
        measured=dict(
            **checks,
            inits_per_constraint=inits,
            d_inner=2 * d_model,
            max_asymmetry=max(summaries[c]["asymmetry"].max() for c in ("pos", "neg", "mixed")),
            unconstrained_fraction_both_signs=np.mean(
                (free["eig"].min(1) < -REL_TOL) & (free["eig"].max(1) > REL_TOL)
            ),
            unconstrained_max_rank=int(free["rank"].max()),
        ),
        expected=dict(
            pos_min_eig=f">= -{REL_TOL}",
            neg_max_eig=f"<= {REL_TOL}",
            mixed_fraction_both_signs=1.0,
            max_rank=f"<= N = {d_state}",
        ),
        verdict=verdict(bool(holds)),
        summary=f"pos min eig {checks['pos_min_eig']:.2g}, neg max eig {checks['neg_max_eig']:.2g} "
        f"(holds iff within +-{REL_TOL}); mixed of both signs "
        f"{checks['mixed_fraction_both_signs']:.0%} (needs 100%); max rank {checks['max_rank']} "
        f"(<= {d_state})",
        figures=(path,),
    )


# -- token dynamics (the continuous-time limit, seqlab.dynamics.mamba_ode) -------------------------


def _one_d_setup(ctx: Context, sign: float):
    """`(mu, s, a, x0: [trials, L])` of `measures.one_d_draws` at the context's size."""
    trials, length = ctx.size((3, 4), (16, 8))
    return measures.one_d_draws(ctx.key, trials, length, sign)


@PAPER.claim(
    "convergence_1d",
    "1-D tokens with mu = S_C^T S_B < 0 all converge to 0: every |x_l(t)| is non-increasing, "
    "sqrt(t) |x_l(t)| stays bounded (changes by < 5% over the last two decades of t), and "
    "sqrt(t) x_1(t) -> sign(x_1(0)) / sqrt(2 |mu| ln 2) (derived from the ODE) within 1% at "
    "t = 1e6 (quick) / 0.1% at t = 1e8 (full).",
    kind="paper",
)
def convergence_1d(ctx: Context) -> Outcome:
    mu, s, a, x0 = _one_d_setup(ctx, sign=-1.0)
    t1, tol = ctx.size((1e6, 1e-2), (1e8, 1e-3))
    runs = [measures.solve_1d(*args, t1) for args in zip(mu, s, a, x0, strict=True)]
    ts = runs[0]["ts"]
    late = ts >= ts[-1] / 100
    max_rise, drift, limit_err = [], [], []
    for run, m in zip(runs, mu, strict=True):
        mag = np.abs(run["xs"])  # [S, L]
        max_rise.append(float(np.max(np.diff(mag, axis=0) / mag[:-1])))
        scaled = np.sqrt(ts[late])[:, None] * mag[late]
        drift.append(float(np.max(np.abs(scaled / scaled[-1] - 1.0))))
        got = np.sqrt(ts[-1]) * run["xs"][-1, 0]
        want = np.sign(run["xs"][0, 0]) * measures.convergence_limit(m)
        limit_err.append(abs(got / want - 1.0))
    all_ok = all(r["ok"] and not r["blew_up"] for r in runs)
    # float32 rounding of |x| between saves: 1e-6 relative.
    holds = all_ok and max(max_rise) <= 1e-6 and max(drift) < 0.05 and max(limit_err) <= tol
    path = ctx.figure()
    figures.tokens_1d(path, runs, "mu < 0: |x_l(t)| and sqrt(t)|x_l(t)|", mu, scaled_limit=True)
    return Outcome(
        measured=dict(
            integrations_ok=all_ok,
            max_relative_rise_of_abs_x=max(max_rise),
            max_drift_of_sqrt_t_abs_x_last_two_decades=max(drift),
            token1_limit_relative_error=limit_err,
            t_end=float(ts[-1]),
        ),
        expected=dict(
            max_relative_rise_of_abs_x="<= 1e-6 (non-increasing up to float32 rounding)",
            max_drift_of_sqrt_t_abs_x_last_two_decades="< 0.05",
            token1_limit="1/sqrt(2|mu| ln 2)",
            token1_limit_relative_error=f"<= {tol}",
        ),
        verdict=verdict(holds),
        summary=f"max relative rise of |x| {max(max_rise):.2g} (holds iff <= 1e-6), sqrt(t)|x| "
        f"drift {max(drift):.2g} (< 0.05), limit error {max(limit_err):.2g} (<= {tol:g})",
        figures=(path,),
    )


@PAPER.claim(
    "fast_divergence_blowup",
    "1-D tokens with mu > 0 and s x_1(0) > 0 blow up in finite time; token 1 (which evolves on "
    "its own) blows up at the time T* = int_{x_1(0)}^{inf} dx / (mu x^3 softplus(s x)) derived "
    "from the ODE: the integrator's stop at |x_1| >= 30 is within 1e-3 of T*, and the whole "
    "system blows up no later (within 1e-3).",
    kind="paper",
)
def fast_divergence_blowup(ctx: Context) -> Outcome:
    mu, s, a, x0 = _one_d_setup(ctx, sign=1.0)
    x0[:, 0] = np.abs(x0[:, 0])  # s > 0: s x_1(0) > 0
    t1, threshold = 1e3, 30.0  # float32: steps near |x| = 30 are still ~1e-5 of t
    rel_err, system_first, predicted, measured_t, systems = [], [], [], [], []
    for m, ss, aa, x in zip(mu, s, a, x0, strict=True):
        alone = measures.solve_1d(m, ss, aa, x[:1], t1, threshold)
        system = measures.solve_1d(m, ss, aa, x, t1, threshold)
        systems.append(system)
        t_star = measures.time_to_reach(m, ss, float(x[0]), math.inf)
        predicted.append(t_star)
        measured_t.append(alone["t_end"] if alone["blew_up"] else math.inf)
        rel_err.append(abs(measured_t[-1] / t_star - 1.0))
        system_first.append(system["blew_up"] and system["t_end"] <= measured_t[-1] * (1 + 1e-3))
    holds = max(rel_err) <= 1e-3 and all(system_first)
    path = ctx.figure()
    figures.blowup(path, systems[0], predicted, measured_t)
    return Outcome(
        measured=dict(
            token1_blowup_time=measured_t,
            relative_error=rel_err,
            system_blew_up_no_later=system_first,
            threshold=threshold,
        ),
        expected=dict(
            token1_blowup_time=predicted,
            relative_error="<= 1e-3 (T* - t(|x|=30) is ~1e-4 T*; the crossing step overshoots)",
        ),
        verdict=verdict(holds),
        summary=f"token-1 blow-up time within {max(rel_err):.2g} of T* (holds iff <= 1e-3); system "
        f"no later in {sum(system_first)}/{len(system_first)} trials (needs all)",
        figures=(path,),
    )


@PAPER.claim(
    "fast_divergence_mixed_signs",
    "1-D tokens with mu > 0 and mixed signs, the first token with s x_l(0) > 0 at l0 > 1 (tokens "
    "before it with s x_l(0) < 0): the system blows up in finite time (norm 30, then norm 100 or "
    "a stalled integration within 1% of that time), no later than the comparison bound "
    "min over {l: s x_l(0) > 0} of T*(x_l(0)) (+1e-3 relative); the tokens before l0, a closed "
    "system by causality, diverge slowly: integrated alone up to t = 1e4 they do not blow up, "
    "every |x_l| is non-decreasing and at least doubles.",
    kind="paper",
)
def fast_divergence_mixed_signs(ctx: Context) -> Outcome:
    trials, length = ctx.size((4, 6), (16, 8))
    t1 = 1e4
    mu, s, a, x0, l0 = measures.first_positive_draws(ctx.key, trials, length)
    blew, within, prefix_ok, rows = [], [], [], []
    for m, ss, aa, x, first in zip(mu, s, a, x0, l0, strict=True):
        seen = measures.observe_1d(m, ss, aa, x, t1)
        bound = measures.blowup_bound(m, ss, x)
        prefix = np.where(np.arange(length) < first - 1, x, 0.0).astype(np.float32)
        before = measures.observe_1d(m, ss, aa, prefix, t1)  # zeros: tokens < l0 alone
        blew.append(seen["label"] == "blows_up")
        within.append(blew[-1] and seen["t_blowup"] <= bound * (1 + 1e-3))
        prefix_ok.append(before["label"] == "diverges" and before["monotone"] == "up")
        rows.append(
            dict(
                l0=int(first),
                t_blowup=seen["t_blowup"],
                bound=bound,
                growth_at_blowup=seen["ratio"].round(3),
                prefix_label=before["label"],
                prefix_growth_by_t1=before["ratio"].round(2),
            )
        )
    holds = all(blew) and all(within) and all(prefix_ok)
    path = ctx.figure()
    figures.mixed_blowup(path, rows)
    earlier = [r["growth_at_blowup"][: r["l0"] - 1] for r in rows]
    return Outcome(
        measured=dict(
            draws=rows,
            blew_up=blew,
            within_bound=within,
            prefix_diverges_slowly=prefix_ok,
            max_growth_of_earlier_tokens_at_blowup=float(max(e.max() for e in earlier)),
        ),
        expected=dict(
            blew_up=True,
            within_bound="t_blowup <= min T* (1 + 1e-3)",
            prefix_diverges_slowly=True,
        ),
        verdict=verdict(holds),
        summary=f"blow-up in {sum(blew)}/{trials} draws (l0 = {[r['l0'] for r in rows]}), "
        f"within the bound in {sum(within)}/{trials}; tokens before l0 alone diverge slowly in "
        f"{sum(prefix_ok)}/{trials} (holds iff all); at the blow-up they had grown by at most "
        f"x{max(e.max() for e in earlier):.2f}",
        figures=(path,),
    )


@PAPER.claim(
    "slow_divergence",
    "1-D tokens with mu > 0 and s x_l(0) < 0 for every l diverge slowly: no blow-up (|x| < 1e6) "
    "up to t = 1e6 (quick) / 1e8 (full); token 1 follows t(x) = int dy / (mu y^3 softplus(s y)) "
    "(1e-3 relative); |x_l| grows at most like (ln t)^l (fitted exponent of |x_l| against ln t "
    "over the last two decades <= l). The order of the tokens' sizes at the final time is "
    "reported, not decided (the text we could read states the rates, not a strict order).",
    kind="paper",
)
def slow_divergence(ctx: Context) -> Outcome:
    mu, s, a, x0 = _one_d_setup(ctx, sign=1.0)
    x0, length = -np.abs(x0), x0.shape[1]  # s > 0: s x_l(0) < 0 for all l
    t1 = ctx.size(1e6, 1e8)
    runs = [measures.solve_1d(*args, t1, max_norm=1e6) for args in zip(mu, s, a, x0, strict=True)]
    ts = runs[0]["ts"]
    late = ts >= ts[-1] / 100
    exponents, ordered, pairs_up, t_err = [], [], [], []
    for run, m, ss in zip(runs, mu, s, strict=True):
        mag = np.abs(run["xs"])
        if run["blew_up"] or not run["ok"]:
            exponents.append([math.nan] * length)
            ordered.append(False)
            pairs_up.append(math.nan)
            t_err.append(math.nan)
            continue
        ln_t = np.log(ts[late])
        exponents.append([rates.power_exponent(ln_t, mag[late, l]) for l in range(length)])
        ordered.append(bool(np.all(np.diff(mag[-1]) > 0)))
        pairs_up.append(float(np.mean(np.diff(mag[-1]) > 0)))
        t_back = measures.time_to_reach(m, ss, float(run["xs"][0, 0]), float(run["xs"][-1, 0]))
        t_err.append(abs(t_back / ts[-1] - 1.0))
    no_blowup = all(r["ok"] and not r["blew_up"] for r in runs)
    exponent_over_l = np.asarray(exponents) / np.arange(1, length + 1)  # NaN for a failed run
    within = bool(np.all(exponent_over_l <= 1))
    first_last = np.asarray(exponents)[:, [0, -1]].T  # [2, trials]: the rates are alike
    follows = no_blowup and max(t_err) <= 1e-3
    holds = no_blowup and follows and within
    path = ctx.figure()
    figures.tokens_1d(path, runs, "mu > 0, s x_l(0) < 0: |x_l(t)|", mu, scaled_limit=False)
    return Outcome(
        measured=dict(
            no_blowup=no_blowup,
            token1_quadrature_relative_error=t_err,
            growth_exponent_vs_ln_t=exponents,
            later_tokens_larger_per_trial=ordered,
            fraction_of_adjacent_pairs_increasing=pairs_up,
            final_abs_x=[np.abs(r["xs"][-1]).round(3) for r in runs],
        ),
        expected=dict(
            no_blowup=True,
            token1_quadrature_relative_error="<= 1e-3",
            growth_exponent_vs_ln_t="<= l for token l",
            later_tokens_larger_per_trial="reported",
        ),
        verdict=verdict(holds),
        summary=f"no blow-up {no_blowup}; quadrature error {np.nanmax(t_err):.2g} (<= 1e-3); "
        f"max exponent / l {np.nanmax(exponent_over_l):.2g} (<= 1); mean exponent of token 1 / "
        f"L {np.nanmean(first_last[0]):.2f} / {np.nanmean(first_last[1]):.2f}; "
        f"(reported) |x_1| < .. < |x_L| in {sum(ordered)}/{len(ordered)} trials",
        figures=(path,),
    )


@PAPER.claim(
    "dichotomy_1d",
    "1-D tokens over random draws of every sign, a third in each scenario of the criterion "
    "(measures.scenario_draws: |mu|, |s|, a ~ U[0.5, 2], |x_l(0)| ~ U[0.5, 1.5], random signs "
    "within the scenario), up to t = 1e4: either all tokens converge or "
    "all diverge, as the criterion says: mu < 0: every |x_l| non-increasing and <= |x_l(0)| / 10; "
    "mu > 0: every |x_l| non-decreasing, and a finite-time blow-up (norm 30, then norm 100 or a "
    "stalled integration within 1%) iff some s x_l(0) > 0; with none, every |x_l| at least "
    "doubles. Holds iff every draw is classified as its criterion predicts.",
    kind="paper",
)
def dichotomy_1d(ctx: Context) -> Outcome:
    draws, length = ctx.size((12, 4), (48, 8))
    t1 = 1e4
    mu, s, a, x0 = measures.scenario_draws(ctx.key, draws, length)
    expected_label = {"converges": ("converges", "down"), "fast": ("blows_up", "up")}
    expected_label["slow"] = ("diverges", "up")
    rows, agree = [], []
    for m, ss, aa, x in zip(mu, s, a, x0, strict=True):
        scenario = measures.scenario_1d(m, ss, x)
        seen = measures.observe_1d(m, ss, aa, x, t1)
        agree.append((seen["label"], seen["monotone"]) == expected_label[scenario] and seen["ok"])
        rows.append(
            dict(
                mu=float(m),
                s=float(ss),
                scenario=scenario,
                label=seen["label"],
                monotone=seen["monotone"],
                ratio=seen["ratio"],
            )
        )
    counts = {c: sum(r["scenario"] == c for r in rows) for c in ("converges", "fast", "slow")}
    holds = all(agree)
    path = ctx.figure()
    figures.dichotomy(path, rows)
    return Outcome(
        measured=dict(draws=rows, agree=agree, scenario_counts=counts),
        expected=dict(
            converges="every |x_l| non-increasing, ratio <= 0.1",
            fast="blow-up, every |x_l| non-decreasing",
            slow="no blow-up, every |x_l| non-decreasing, ratio >= 2",
        ),
        verdict=verdict(holds),
        summary=f"{sum(agree)}/{draws} draws as the criterion predicts (holds iff all); "
        f"scenarios: {counts['converges']} converge, {counts['fast']} fast, {counts['slow']} slow",
        figures=(path,),
    )


@PAPER.claim(
    "two_d_definite",
    "2-D tokens driven by the interaction matrices of many random sign-constrained Mambas "
    "(d_model=1, d_inner=2, M = S_C^T diag(lambda) S_C, A^d = -I), each from its own random x(0): "
    "with both eigenvalues positive (sign_constraint='pos') every token of every run diverges "
    "(blow-up or norm x10 by t = 1e6), with both negative ('neg') every token converges (norm "
    "/10); the indefinite case ('mixed') is reported as measured (fractions of runs).",
    kind="paper",
)
def two_d_definite(ctx: Context) -> Outcome:
    fields, length = ctx.size((6, 4), (32, 8))
    t1 = 1e6
    ts = measures.save_times(t1)
    outcomes, trajectories = {}, {}
    for i, constraint in enumerate(("pos", "neg", "mixed")):
        count = fields if constraint != "mixed" else max(3, fields // 2)
        labels, trajs, eigs = [], [], []
        for j in range(count):
            k_field, k_x = jax.random.split(jax.random.fold_in(jax.random.fold_in(ctx.key, i), j))
            field = measures.mamba_2d_field(constraint, k_field)
            x0 = jax.random.normal(k_x, (length, 2), jnp.float32)
            traj = mamba_ode.integrate(x0, field, t1=t1, ts=ts)
            xs = np.asarray(traj.xs, np.float64)
            labels.append(measures.classify(xs, bool(traj.blew_up)) if bool(traj.ok) else "failed")
            trajs.append(xs)
            m = np.asarray(field.M, np.float64)
            eigs.append(np.linalg.eigvalsh((m + m.T) / 2))
        outcomes[constraint] = dict(
            runs=count,
            eigenvalue_range=[float(np.min(eigs)), float(np.max(eigs))],
            **{c: labels.count(c) / count for c in sorted(set(labels))},
        )
        trajectories[constraint] = trajs
    pos_div, neg_conv = outcomes["pos"].get("diverges", 0), outcomes["neg"].get("converges", 0)
    holds = pos_div == 1.0 and neg_conv == 1.0
    mixed = ", ".join(f"{k} {v:.0%}" for k, v in outcomes["mixed"].items() if isinstance(v, float))
    path = ctx.figure()
    figures.phase(path, trajectories, outcomes)
    return Outcome(
        measured=outcomes,
        expected=dict(pos={"diverges": 1.0}, neg={"converges": 1.0}, mixed="reported"),
        verdict=verdict(holds),
        summary=f"pos: every token diverges in {pos_div:.0%} of {fields} random M; neg: every "
        f"token converges in {neg_conv:.0%} (holds iff both 100%); mixed (reported): {mixed}",
        figures=(path,),
    )


@PAPER.claim(
    "higher_dim_definite",
    "D-dimensional tokens (D = 3 quick / 4 full) with a random non-symmetric M whose symmetric "
    "part is definite (M = Q diag(+-U[0.5, 2]) Q^T + skew), random S_delta and a: positive "
    "definite: ||x_1(t)|| is non-decreasing at every save (1e-6 relative) up to the blow-up or "
    "t = 1e6 and ends above ||x_1(0)||; negative definite: every token converges to 0 like "
    "t^-1/2 (every ||x_l(1e6)|| <= ||x_l(0)|| / 10, and the fitted exponent of ||x_l|| against "
    "t over the last two decades within 0.05 of -1/2).",
    kind="paper",
)
def higher_dim_definite(ctx: Context) -> Outcome:
    dim, length, draws = ctx.size((3, 4, 4), (4, 8, 16))
    t1 = 1e6
    ts = measures.save_times(t1)
    runs = {"pos": [], "neg": []}
    for i, (name, sign) in enumerate((("pos", 1.0), ("neg", -1.0))):
        for j in range(draws):
            k_field, k_x = jax.random.split(jax.random.fold_in(jax.random.fold_in(ctx.key, i), j))
            field = measures.definite_field(k_field, dim, sign)
            x0 = jax.random.normal(k_x, (length, dim), jnp.float32)
            first = measures.token_norms(x0, field, ts, max_norm=30.0)
            if name == "pos":  # dense saves up to the stop, for the monotonicity of ||x_1||
                dense = measures.dense_times(first["t_end"])
                first = measures.token_norms(x0, field, dense, max_norm=30.0)
            runs[name].append(first)
    all_ok = all(r["ok"] for r in runs["pos"]) and all(
        r["ok"] and not r["blew_up"] for r in runs["neg"]
    )
    rises = [measures.norm_x1_min_step(r) for r in runs["pos"]]  # >= -1e-6: non-decreasing
    ends_above = [
        bool(r["norms"][np.isfinite(r["norms"]).all(1), 0][-1] > r["norms"][0, 0] * (1 + 1e-6))
        for r in runs["pos"]
    ]
    pos_diverged = [r["blew_up"] for r in runs["pos"]]
    decays = [measures.decay_summary(r) for r in runs["neg"]]
    ratios, exponents = np.asarray([d[0] for d in decays]), np.asarray([d[1] for d in decays])
    pos_holds = min(rises) >= -1e-6 and all(ends_above)
    # NaN (a stopped run) compares False: it fails the check.
    neg_holds = bool(np.all(ratios <= 0.1) and np.all(np.abs(exponents + 0.5) <= 0.05))
    holds = all_ok and pos_holds and neg_holds
    path = ctx.figure()
    figures.higher_dim(path, runs)
    return Outcome(
        measured=dict(
            dim=dim,
            tokens=length,
            draws=draws,
            integrations_ok=all_ok,
            pos_min_relative_step_of_norm_x1=min(rises),
            pos_norm_x1_ends_above_start=ends_above,
            pos_blew_up=pos_diverged,
            neg_max_ratio_end_over_start=float(ratios.max()),
            neg_exponents=exponents.round(4),
        ),
        expected=dict(
            pos_min_relative_step_of_norm_x1=">= -1e-6",
            pos_norm_x1_ends_above_start=True,
            neg_max_ratio_end_over_start="<= 0.1",
            neg_exponents="within 0.05 of -0.5",
        ),
        verdict=verdict(holds),
        summary=f"pos definite: min relative step of ||x_1|| {min(rises):.2g} (>= -1e-6), "
        f"blow-up in {sum(pos_diverged)}/{draws}; neg definite: max ||x_l(t1)||/||x_l(0)|| "
        f"{ratios.max():.2g} (<= 0.1), exponents {exponents.min():.3f}..{exponents.max():.3f} "
        "(within 0.05 of -0.5)",
        figures=(path,),
    )


@PAPER.claim(
    "depth_limit",
    "The token ODE is the depth limit of a real Mamba layer: a residual stack x <- x + tau * "
    "S6(x) with shared weights (seqlab selective_scan on the module's own x_proj, dt_proj and A, "
    "A^d = -a_d I, no skip or gate) approaches the integrated ODE at t = n tau = 1 with error "
    "O(tau): "
    "halving tau halves the error (ratio in [1.7, 2.3]) for tau = 1/8 .. 1/64.",
    kind="consistency",
)
def depth_limit(ctx: Context) -> Outcome:
    d_model, length, t1 = ctx.size((2, 6, 1.0), (4, 16, 1.0))
    k_model, k_x = jax.random.split(ctx.key)
    model, params = measures.scalar_decay_mamba(d_model, k_model)
    field = mamba_ode.field_from_mamba(model, params)
    x0 = 0.5 * jax.random.normal(k_x, (length, model.d_inner), jnp.float32)
    exact = mamba_ode.integrate(x0, field, t1=t1, ts=jnp.asarray([t1], jnp.float32))
    taus = [1 / 8, 1 / 16, 1 / 32, 1 / 64]
    errors = []
    for tau in taus:
        stacked = measures.residual_stack(model, params, x0, tau, round(t1 / tau))
        errors.append(float(jnp.max(jnp.abs(stacked - exact.xs[0]))))
    ratios = [errors[i] / errors[i + 1] for i in range(len(errors) - 1)]
    finite = bool(exact.ok) and not bool(exact.blew_up)  # a blow-up before t1 decides nothing
    holds = finite and all(1.7 <= r <= 2.3 for r in ratios)
    path = ctx.figure()
    figures.depth_limit(path, taus, errors, t1)
    return Outcome(
        measured=dict(
            taus=taus,
            errors=errors,
            halving_ratios=ratios,
            max_abs_x=float(jnp.max(jnp.abs(exact.xs[0]))),
        ),
        expected=dict(halving_ratios="in [1.7, 2.3] (first order)"),
        verdict=verdict(holds, decidable=finite),
        summary="error ratios per halving of tau "
        + ", ".join(f"{r:.3g}" for r in ratios)
        + " (holds iff all in [1.7, 2.3])"
        + ("" if finite else "; the ODE blew up before t = 1: undecided"),
        figures=(path,),
    )


# -- the refinements, trained (theory.mamba_dynamics.train) ---------------------------------------

# Paper size (`--full`): 2 blocks of width 32 (d_state 8) on MQAR with 32 tokens, 32 symbols and 4
# pairs, 600 AdamW steps of 32 sequences at lr 1e-2, three seeds per arm. The quick run
# trains nothing: compiling one arm costs ~9 CPU-s whatever the size, and the four arms would take
# the quick run of this paper over its budget, so at quick size these claims are inconclusive.
FULL_SETUP = train.Setup(32, 32, 4, 32, 2, 8, 32, 600, 1e-2, 4)
NOT_TRAINED = Outcome(
    measured=dict(trained=False),
    expected=dict(trained="at --full"),
    verdict="inconclusive",
    summary="not trained at quick size (four compiled models are over the quick budget): run "
    "with --full",
)


def _describe(setup: train.Setup) -> str:
    return (
        f"MQAR (T={setup.seq_len}, V={setup.vocab_size}, {setup.num_kv_pairs} pairs), "
        f"{setup.num_layers}x Mamba width {setup.d_model}, {setup.train_steps} steps, "
        f"seeds {list(setup.seeds)}"
    )


def _accuracies(results: dict) -> str:
    return "; ".join(
        f"{arm} " + "/".join(f"{a:.2f}" for a in r["accuracy"]) for arm, r in results.items()
    )


@PAPER.claim(
    "refinement1_sign_constraint",
    "Refinement 1 (excluding the convergent scenario, S_B = diag(lambda) S_C with lambda > 0) "
    "improves accuracy: trained on MQAR with 3 seeds per arm (theory.mamba_dynamics.train, "
    "FULL_SETUP; not trained at quick size), the "
    "positive-definite Mamba ('pos') beats the negative-definite one ('neg', the convergent "
    "scenario) and the unconstrained baseline. Each comparison by train.compare: holds iff every "
    "'pos' seed beats every seed of the other arm (one-sided rank test, p = 0.05), fails iff "
    "the mean accuracy of 'pos' is not above the other's, inconclusive otherwise or when no run "
    "beats chance + 0.05. The claim holds iff both comparisons hold, fails iff one fails.",
    kind="paper",
)
def refinement1_sign_constraint(ctx: Context) -> Outcome:
    if not ctx.full:
        return NOT_TRAINED
    setup = FULL_SETUP
    results = {arm: train.train_arm(setup, arm) for arm in ("pos", "neg", "none")}
    acc = {arm: r["accuracy"] for arm, r in results.items()}
    vs_neg = train.compare(acc["neg"], acc["pos"], setup.chance)
    vs_none = train.compare(acc["none"], acc["pos"], setup.chance)
    decisions = (vs_neg["decision"], vs_none["decision"])
    path = ctx.figure()
    figures.refinement(path, results, setup.chance, "Refinement 1: sign-constrained S_B")
    return Outcome(
        measured=dict(
            setup=_describe(setup),
            accuracy=acc,
            pos_vs_neg=vs_neg,
            pos_vs_none=vs_none,
            final_train_loss={a: r["train_loss"][:, -10:].mean(1) for a, r in results.items()},
        ),
        expected=dict(pos_vs_neg="holds", pos_vs_none="holds"),
        verdict=verdict(
            decisions == ("holds", "holds"),
            decidable="fails" in decisions or decisions == ("holds", "holds"),
        ),
        summary=f"accuracy per seed {_accuracies(results)} (chance {setup.chance:.2f}); pos vs "
        f"neg {vs_neg['decision']} ({vs_neg['mean_difference']:+.3f}), pos vs none "
        f"{vs_none['decision']} ({vs_none['mean_difference']:+.3f})",
        figures=(path,),
    )


@PAPER.claim(
    "refinement2_reorder",
    "Refinement 2 (token reordering by importance score, Mamba(reorder=True) in every block) "
    "improves accuracy over the same Mamba without it: trained on MQAR with 3 seeds per arm "
    "(theory.mamba_dynamics.train, FULL_SETUP; not trained at quick size), decided by "
    "train.compare: holds iff every reordering seed "
    "beats every baseline seed (p = 0.05), fails iff its mean accuracy is not above the "
    "baseline's, inconclusive otherwise or when no run beats chance + 0.05.",
    kind="paper",
)
def refinement2_reorder(ctx: Context) -> Outcome:
    if not ctx.full:
        return NOT_TRAINED
    setup = FULL_SETUP
    results = {arm: train.train_arm(setup, arm) for arm in ("reorder", "none")}
    result = train.compare(
        results["none"]["accuracy"], results["reorder"]["accuracy"], setup.chance
    )
    path = ctx.figure()
    figures.refinement(path, results, setup.chance, "Refinement 2: token reordering")
    return Outcome(
        measured=dict(
            setup=_describe(setup),
            accuracy={arm: r["accuracy"] for arm, r in results.items()},
            comparison=result,
            final_train_loss={a: r["train_loss"][:, -10:].mean(1) for a, r in results.items()},
        ),
        expected=dict(comparison="holds"),
        verdict=verdict(
            result["decision"] == "holds", decidable=result["decision"] != "inconclusive"
        ),
        summary=f"accuracy per seed {_accuracies(results)} (chance {setup.chance:.2f}); "
        f"reorder vs none {result['decision']} ({result['mean_difference']:+.3f}, pairs won "
        f"{result['pairs_won']:.0%})",
        figures=(path,),
    )
