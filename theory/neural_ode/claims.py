"""Claims of Tong et al., "Neural ODE Transformers: Analyzing Internal Dynamics and Adaptive
Fine-tuning" (arXiv 2503.01329), measured on small `seqlab.modules.ode_transformer.ODETransformer`s
trained inside the claims: byte-level language models (`theory/neural_ode/runs.py`: three seeds
of the ODE model and of the discrete transformer of matched depth and width, pretrained on the
`ode_lm.py` corpus and fine-tuned on another) and one model on multi-query associative recall
(`theory/neural_ode/train.py`).

Every block weight is a function of continuous depth `t` in [0, 1]; the hidden states of a sequence,
`x: [T, D]`, follow `dx/dt = f(t, x)` (parallel attention and MLP branches), integrated by explicit
Euler with `num_steps` steps. The spectra come from `seqlab.analysis.spectra` on
`model.apply(params, t, method="weights")`; the exponents from `seqlab.analysis.lyapunov` on the
model's vector field through the same Euler scheme, so they are those of the model's own discrete
flow map.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from seqlab.train.data import IGNORE
from theory.neural_ode import figures, measures, runs, train
from theory.neural_ode.measures import ALL_EPS
from theory.registry import Context, Outcome, Paper, verdict

PAPER = Paper("neural_ode", "Tong et al., neural ODE transformers (2503.01329)")

# A language model counts as trained when its held-out loss is at most this fraction of log 256
# (a uniform guess over bytes); the MQAR model when its query accuracy is at least RECALLS (a
# model that knows the values in context but not which one goes with the query scores 1 / P).
LM_TRAINED_FRACTION = 0.75
RECALLS = 0.8
# "Comparable or better": the ODE model's mean held-out loss is at most log(1.05) above the
# discrete model's (its perplexity at most 5% higher).
COMPARABLE = float(np.log(1.05))
# "Increases with t": the fitted line of the mean |lambda| rises by at least 10% of its mean level
# over t in [0, 1].
RISE = 0.1
# "Predominantly positive": at least 60% of the eigenvalue magnitude has a positive real part.
POSITIVE = 0.6
# Lyapunov interpretability: the top exponent points at the matching key or value for at least
# HIT of the queries, and at least twice as often as a random earlier token.
HIT = 0.5
MIN_QUERIES = 10
# Step counts of fine-tuning: "no worse" within STEP_TOL nats.
STEP_TOL = 0.01
# Finite differences (`measures.ALL_EPS`): agreement within FD_TOLERANCE at the smallest `eps`,
# where the error fell >= 3x over the last decade of `eps` (a linear regime, not a chance crossing).
FD_TOLERANCE = 0.02


def _trained(ctx: Context) -> train.Trained:
    return train.trained(train.setup_for(ctx.full))


def _trained_with_sequence(ctx: Context) -> tuple[train.Trained, jax.Array]:
    """The trained MQAR model and `x(0): [T, D]` of its first evaluation sequence."""
    tr = _trained(ctx)
    tokens = jnp.asarray(tr.eval_data[0]["inputs"][0])
    return tr, measures.initial_state(tr.model, tr.params, tokens)


def _lm_trained(losses) -> bool:
    return bool(np.all(np.asarray(losses) <= LM_TRAINED_FRACTION * np.log(runs.VOCAB)))


def _fmt(values) -> str:
    return ", ".join(f"{v:.3g}" for v in np.ravel(values))


# -- the language task: ODE against discrete -----------------------------------------------------


def comparable(ode_losses, discrete_losses) -> tuple[bool, float]:
    """`(holds, gap)`: the gap of the mean held-out losses (ODE - discrete, nats) and whether it
    is at most `COMPARABLE`."""
    gap = float(np.mean(ode_losses) - np.mean(discrete_losses))
    return gap <= COMPARABLE, gap


@PAPER.claim(
    "ode_vs_discrete_lm",
    "The neural-ODE transformer performs comparably to or better than the vanilla transformer "
    "of the same configuration (the paper's Tables 1-2, GPT and Llama configurations on "
    "OpenWebText and WikiText-103). Measured: the ODE transformer at N Euler steps against the "
    "discrete transformer of N layers (`DiscreteTransformer`, the model `evaluate_at` samples) "
    "of the same width, heads and MLP width, both trained with the same optimizer and steps on "
    "the bytes of the `ode_lm.py` corpus, 3 seeds each; holds iff the mean held-out loss of the "
    "ODE models is at most log(1.05) nats above the discrete models' (perplexity at most 5% "
    "higher); inconclusive when a model did not train (held-out loss > 0.75 log 256).",
    kind="paper",
)
def ode_vs_discrete_lm(ctx: Context) -> Outcome:
    pre = runs.pretrained(runs.lm_setup_for(ctx.full))
    holds, gap = comparable(pre.ode_eval, pre.discrete_eval)
    path = ctx.figure()
    figures.lm_comparison(path, pre)
    return Outcome(
        measured=dict(
            ode_eval_loss=pre.ode_eval,
            discrete_eval_loss=pre.discrete_eval,
            mean_gap_nats=gap,
            perplexity_ratio=float(np.exp(gap)),
            ode_parameters=pre.ode_param_count,
            discrete_parameters=pre.discrete_param_count,
            num_steps=pre.setup.num_steps,
            seeds=list(pre.setup.seeds),
        ),
        expected=dict(mean_gap_nats=f"<= log(1.05) = {COMPARABLE:.4f}"),
        verdict=verdict(holds, decidable=_lm_trained([*pre.ode_eval, *pre.discrete_eval])),
        summary=f"held-out loss ODE {_fmt(pre.ode_eval)} vs discrete {_fmt(pre.discrete_eval)}; "
        f"mean gap {gap:+.3g} nats (holds iff <= {COMPARABLE:.3g})",
        figures=(path,),
    )


# -- spectra along depth, three seeds -------------------------------------------------------------


@functools.cache
def _seed_spectra(setup: runs.LMSetup, which: str) -> tuple[np.ndarray, list[dict]]:
    """The Euler depths `t_k = k / N` and, per seed, the three spectra there of the pretrained
    ODE models (`which = "trained"`) or of their initialization (`"init"`), cached."""
    pre = runs.pretrained(setup)
    params = pre.ode_params if which == "trained" else pre.ode_init
    ts = np.arange(setup.num_steps) / setup.num_steps
    model = runs.ode_model(setup)
    per_seed = [
        measures.depth_spectra(model, runs.run(params, r), jnp.asarray(ts, jnp.float32))
        for r in range(len(setup.seeds))
    ]
    return ts, per_seed


@PAPER.claim(
    "qk_eigenvalue_trend",
    "The magnitudes of the eigenvalues of W_Q(t) W_K(t)^T grow with depth t in a trained ODE "
    "transformer (the paper's spectral analysis, against the weight sharing of particle "
    "models). Measured on the 3 language models of `ode_vs_discrete_lm`: per head, the "
    "eigenvalues at the model's own Euler depths t_k = k/N (the only weights it uses); holds iff "
    "for every seed the least-squares line of the mean |lambda| rises by at least 10% of its "
    "mean over [0, 1] (relative slope >= 0.1); inconclusive when a model did not train. The "
    "same at initialization, and for W_V W_O and W_1 W_2, is reported.",
    kind="paper",
)
def qk_eigenvalue_trend(ctx: Context) -> Outcome:
    pre = runs.pretrained(runs.lm_setup_for(ctx.full))
    ts, trained = _seed_spectra(pre.setup, "trained")
    _, init = _seed_spectra(pre.setup, "init")
    slopes = {
        f"{name}_{kind}": [
            measures.magnitude_trend(ts, s[kind])["mean_abs_relative_slope"] for s in spectra
        ]
        for name, spectra in (("trained", trained), ("init", init))
        for kind in ("qk", "ov", "mlp")
    }
    qk = np.asarray(slopes["trained_qk"])
    path = ctx.figure()
    figures.seed_spectra(path, ts, trained, init)
    return Outcome(
        measured=dict(
            relative_slopes=slopes,
            trained_qk_mean_abs=[
                measures.magnitude_trend(ts, s["qk"])["mean_abs"] for s in trained
            ],
            eval_loss=pre.ode_eval,
        ),
        expected=dict(trained_qk_relative_slope=f">= {RISE} for every seed"),
        verdict=verdict(bool(np.all(qk >= RISE)), decidable=_lm_trained(pre.ode_eval)),
        summary=f"relative slope of mean |lambda(W_Q W_K^T)| along t_k per seed {_fmt(qk)} "
        f"(holds iff every one >= {RISE}); at init {_fmt(slopes['init_qk'])}",
        figures=(path,),
    )


def ov_sign_decision(ts, shares) -> tuple[bool, np.ndarray, np.ndarray]:
    """`(holds, early, late)` for `shares: [R, S]` (`positive_share` per seed and depth):
    holds iff the late share (t >= 1/2) is at least `POSITIVE` for every seed and its seed mean
    exceeds the early one's."""
    early, late = np.array([measures.early_late(ts, s) for s in shares]).T
    return bool(np.all(late >= POSITIVE) and late.mean() > early.mean()), early, late


@PAPER.claim(
    "ov_eigenvalue_sign",
    "The eigenvalues of W_V(t) W_O(t) are predominantly positive near the output (late depths): "
    "the paper reads positive OV eigenvalues as attraction between tokens (copying) and "
    "negative ones as repulsion. Measured on the 3 language models of `ode_vs_discrete_lm`, at "
    "the Euler depths t_k = k/N, per depth the share of the eigenvalue magnitude (all heads) "
    "with a positive real part; holds iff its mean over t >= 1/2 is at least 0.6 for every seed "
    "and the seed mean over t >= 1/2 exceeds the one over t < 1/2; inconclusive when a model did "
    "not train. The share at initialization (about 0.5) is reported.",
    kind="paper",
)
def ov_eigenvalue_sign(ctx: Context) -> Outcome:
    pre = runs.pretrained(runs.lm_setup_for(ctx.full))
    ts, trained = _seed_spectra(pre.setup, "trained")
    _, init = _seed_spectra(pre.setup, "init")
    shares = np.array([measures.positive_share(s["ov"]) for s in trained])
    init_shares = np.array([measures.positive_share(s["ov"]) for s in init])
    holds, early, late = ov_sign_decision(ts, shares)
    path = ctx.figure()
    figures.ov_sign(path, ts, shares, init_shares, trained[0]["ov"])
    return Outcome(
        measured=dict(
            positive_share_by_depth=shares,
            early_share=early,
            late_share=late,
            init_positive_share_by_depth=init_shares,
        ),
        expected=dict(late_share=f">= {POSITIVE} per seed", late_mean="> early mean"),
        verdict=verdict(holds, decidable=_lm_trained(pre.ode_eval)),
        summary=f"positive share of OV eigenvalues at t >= 1/2 per seed {_fmt(late)} (holds iff "
        f"each >= {POSITIVE}), at t < 1/2 {_fmt(early)} (late mean must exceed early mean)",
        figures=(path,),
    )


# -- Lyapunov exponents as token sensitivity, on MQAR ---------------------------------------------


def kv_decision(hits: np.ndarray, chance: float) -> tuple[bool, bool]:
    """`(holds, decidable)`: the hit rate is at least `HIT` and twice `chance`; decidable with
    at least `MIN_QUERIES` queries."""
    rate = float(np.mean(hits)) if len(hits) else 0.0
    return rate >= HIT and rate >= 2 * chance, len(hits) >= MIN_QUERIES


@PAPER.claim(
    "lyapunov_kv_interpretability",
    "Lyapunov exponents reveal which input tokens the prediction at a position is sensitive to "
    "(the paper's token-level sensitivity analysis: per input token, the largest exponent for "
    "the output at the predicted position). Measured on the MQAR model: for every query "
    "position q of the first evaluation batch, the exact top exponent of the flow-map block "
    "dx_q(1)/dx_i(0) for every earlier input token i < q; holds iff the token with the largest "
    "exponent is the query's matching key or its value for at least 50% of the queries and at "
    "least twice as often as a uniformly random earlier token; inconclusive when the model does "
    "not recall (query accuracy < 0.8) or there are fewer than 10 queries.",
    kind="paper",
)
def lyapunov_kv_interpretability(ctx: Context) -> Outcome:
    tr = _trained(ctx)
    accuracy = train.eval_metrics(tr.model, tr.params, tr.eval_data, tr.setup.num_steps)["accuracy"]
    batch = tr.eval_data[0]
    rows = ctx.size(6, 8)
    hits, pairs_all, maps = [], [], []
    for b in range(rows):
        tokens = jnp.asarray(batch["inputs"][b])
        x0 = measures.initial_state(tr.model, tr.params, tokens)
        lam = measures.pair_exponents(tr.model, tr.params, x0, tr.setup.num_steps)
        pairs = measures.recall_pairs(batch["inputs"][b], batch["targets"][b], IGNORE)
        hits.append(measures.kv_hits(lam, pairs))
        pairs_all += pairs
        maps.append(lam)
    hits = np.concatenate(hits)
    chance = measures.chance_rate(pairs_all)
    holds, enough = kv_decision(hits, chance)
    rate = float(hits.mean())
    path = ctx.figure()
    figures.kv_exponents(
        path,
        maps[0],
        measures.recall_pairs(batch["inputs"][0], batch["targets"][0], IGNORE),
        batch["inputs"][0],
        rate,
        chance,
    )
    return Outcome(
        measured=dict(
            hit_rate=rate,
            chance_rate=chance,
            queries=len(hits),
            query_accuracy=accuracy,
            exponents_first_row=maps[0],
        ),
        expected=dict(hit_rate=f">= {HIT} and >= 2 x chance"),
        verdict=verdict(holds, decidable=enough and accuracy >= RECALLS),
        summary=f"top exponent at the matching key/value for {rate:.2f} of {len(hits)} queries "
        f"(holds iff >= {HIT} and >= 2 x chance {chance:.2f}); query accuracy {accuracy:.2f} "
        f"(decidable iff >= {RECALLS})",
        figures=(path,),
    )


# -- Lyapunov exponents against finite differences --------------------------------------------


@PAPER.claim(
    "lyapunov_matches_finite_difference",
    "The finite-time Lyapunov exponents of the trained model's flow (per token i: exponents of "
    "the sensitivity of all outputs x(1) to token i's input, through the model's own Euler "
    "flow) are the growth rates of small perturbations: perturbing token i's embedding by eps v "
    "and integrating the nonlinear flow, (1/tau) log(|x'(1) - x(1)| / eps) converges to the top "
    "flow-Jacobian exponent for v the top right singular vector, to the first QR exponent for v "
    "the first frame vector, and to log|J v| for a random v (first, middle and last token, "
    "float32). Holds iff at eps = 1e-3 every probe is within 0.02 and the error fell from "
    "eps = 1e-2 to 1e-3 by at least 3x (or is below 1e-3): the linear regime, where the error "
    "is first order in eps.",
    kind="consistency",
)
def lyapunov_matches_finite_difference(ctx: Context) -> Outcome:
    tr, x0 = _trained_with_sequence(ctx)
    length, d = x0.shape
    lam, mu, top = measures.token_exponents(tr.model, tr.params, x0, tr.setup.num_steps)
    growth = measures.perturbation_growth(tr.model, tr.params, x0, tr.setup.num_steps)
    probes = sorted({0, length // 2, length - 1})
    rows = {}
    for i, key in zip(probes, jax.random.split(ctx.key, len(probes)), strict=True):
        directions = {
            "top": (top[i], lam[i, 0]),
            "qr_first": (jnp.zeros_like(x0).at[i, 0].set(1.0), mu[i, 0]),
            "random": (
                jnp.zeros_like(x0).at[i].set(measures.unit(jax.random.normal(key, (d,), x0.dtype))),
                None,
            ),
        }
        for name, (v, exponent) in directions.items():
            fd, linear = growth(v)
            predicted = linear if exponent is None else exponent
            rows[f"token{i}_{name}"] = dict(
                predicted=float(predicted), fd=np.asarray(fd, np.float64)
            )
    errors = {k: np.abs(r["fd"] - r["predicted"]) for k, r in rows.items()}
    converged = all(e[-1] <= FD_TOLERANCE for e in errors.values())
    first_order = all(e[-1] <= max(e[-2] / 3, 1e-3) for e in errors.values())
    volume_gap = float(np.max(np.abs(mu.sum(axis=1) - lam.sum(axis=1))))
    path = ctx.figure()
    figures.lyapunov(path, lam, mu, rows, FD_TOLERANCE)
    return Outcome(
        measured=dict(
            max_abs_error_by_eps={
                f"{e:g}": max(float(v[j]) for v in errors.values()) for j, e in enumerate(ALL_EPS)
            },
            converged=converged,
            first_order=first_order,
            top_exponent_by_token=lam[:, 0],
            first_qr_exponent_by_token=mu[:, 0],
            max_qr_vs_svd_volume_gap=volume_gap,
            probes={k: dict(predicted=r["predicted"], fd=r["fd"]) for k, r in rows.items()},
        ),
        expected=dict(
            max_abs_error_at_eps_1e_3=f"<= {FD_TOLERANCE}",
            error_ratio_1e_2_over_1e_3=">= 3 (or error < 1e-3)",
            max_qr_vs_svd_volume_gap="0 (sum of QR = sum of SVD exponents)",
        ),
        verdict=verdict(converged and first_order),
        summary=f"largest error at eps = 1e-3: {max(float(e[-1]) for e in errors.values()):.2g} "
        f"(holds iff <= {FD_TOLERANCE}), first order in eps {first_order}; top exponents "
        f"{float(lam[:, 0].min()):.2g}..{float(lam[:, 0].max()):.2g}",
        figures=(path,),
    )


# -- Fig. 6: resample at another step count, fine-tune on another corpus ------------------------

FIG6 = (
    "Setting (the paper's Fig. 6): the ODE model of `ode_vs_discrete_lm` (N steps; seed 0 at "
    "quick size) is resampled by `evaluate_at` into discrete models of N/2, N and 2N layers and "
    "fine-tuned on another corpus (the repository's Markdown files), fully or with LoRA (rank "
    "4, quick; per-layer U V^T on every attention and MLP weight, embedding trained too, as the "
    "paper's code); against the discrete N-layer model of the same pretraining fine-tuned the "
    "same two ways, and a discrete N-layer model trained from scratch for as many steps; every "
    "variant sees the same batches; verdicts on held-out Markdown loss after fine-tuning."
)


def _fig6(ctx: Context):
    """`(final losses by variant, (N/2, N, 2N), figure path)` of the fine-tuning runs."""
    setup = runs.lm_setup_for(ctx.full)
    ft = runs.finetuned(setup)
    path = ctx.figure()
    figures.finetune(path, ft, runs.finetune_counts(setup))
    return ft.final(), runs.finetune_counts(setup), path


def beats_scratch(final: dict, counts) -> tuple[bool, dict]:
    """`(holds, margins)`: every fully fine-tuned resample ends below the scratch model;
    `margins[M] = scratch - ode(M)` nats."""
    scratch = final["scratch", counts[1], "full"]
    margins = {m: scratch - final["ode", m, "full"] for m in counts}
    return all(v > 0 for v in margins.values()), margins


@PAPER.claim(
    "finetune_beats_scratch",
    "Fine-tuning the resampled ODE model reaches a lower loss than training from scratch for "
    "the same number of steps, at every resampled depth (Fig. 6, full-rank panels: 18 -> 24, "
    "18, 12 and 9 layers against GPT from scratch). " + FIG6 + " Holds iff the fully "
    "fine-tuned N/2-, N- and 2N-layer resamples all end below the scratch model.",
    kind="paper",
)
def finetune_beats_scratch(ctx: Context) -> Outcome:
    final, counts, path = _fig6(ctx)
    holds, margins = beats_scratch(final, counts)
    return Outcome(
        measured=dict(
            final_loss={str(k): v for k, v in final.items()},
            margin_over_scratch={str(m): v for m, v in margins.items()},
        ),
        expected=dict(margin_over_scratch="> 0 at N/2, N and 2N"),
        verdict=verdict(holds),
        summary=f"scratch minus fine-tuned loss at {counts} layers: "
        f"{_fmt(list(margins.values()))} nats (holds iff all > 0)",
        figures=(path,),
    )


def more_steps_better(final: dict, counts) -> tuple[bool, dict]:
    """`(holds, losses)`: in both modes, `loss(2N) <= loss(N) + STEP_TOL` and `loss(N) <=
    loss(N/2) + STEP_TOL`; `losses[mode] = [loss(N/2), loss(N), loss(2N)]`."""
    losses = {mode: [final["ode", m, mode] for m in counts] for mode in ("full", "lora")}
    ok = all(b <= a + STEP_TOL and c <= b + STEP_TOL for a, b, c in losses.values())
    return ok, losses


@PAPER.claim(
    "finetune_more_steps_better",
    "After resampling, more Euler steps fine-tune to a lower loss: 18 -> 24 below 18 -> 18 "
    "below 18 -> 12 below 18 -> 9 (Fig. 6, OpenWebText panels, full rank and LoRA; the "
    "full-rank WikiText panel ends in the reverse order as the deeper models overfit). "
    + FIG6
    + " Holds iff, fully and with LoRA, loss(2N) <= loss(N) + 0.01 and loss(N) <= loss(N/2) + "
    "0.01 nats.",
    kind="paper",
)
def finetune_more_steps_better(ctx: Context) -> Outcome:
    final, counts, path = _fig6(ctx)
    holds, losses = more_steps_better(final, counts)
    return Outcome(
        measured=dict(loss_at_half_n_2n=losses, counts=list(counts)),
        expected=dict(order=f"loss(2N) <= loss(N) <= loss(N/2), each within {STEP_TOL}"),
        verdict=verdict(holds),
        summary="held-out loss at N/2, N, 2N: full "
        + _fmt(losses["full"])
        + "; LoRA "
        + _fmt(losses["lora"])
        + f" (holds iff non-increasing within {STEP_TOL})",
        figures=(path,),
    )


def ode_beats_discrete(final: dict, counts) -> tuple[bool, dict]:
    """`(holds, gaps)`: with LoRA the N- and 2N-step resamples end below the discrete model;
    fully, the 2N-step resample ends within `COMPARABLE` of it. `gaps` are ODE - discrete."""
    n = counts[1]
    gaps = {f"lora_{m}": final["ode", m, "lora"] - final["discrete", n, "lora"] for m in counts[1:]}
    gaps[f"full_{counts[2]}"] = final["ode", counts[2], "full"] - final["discrete", n, "full"]
    holds = all(v < 0 for k, v in gaps.items() if k.startswith("lora"))
    return holds and gaps[f"full_{counts[2]}"] <= COMPARABLE, gaps


@PAPER.claim(
    "finetune_ode_vs_discrete",
    "The resampled ODE model fine-tunes at least as well as the discrete transformer: with LoRA "
    "it ends below it (Fig. 6 LoRA panels: ours 18 -> 24 and 18 -> 18 below GPT 24 -> 24), "
    "fully it is comparable (full-rank panels: 18 -> 24 close to GPT 24 -> 24). "
    + FIG6
    + " Holds iff with LoRA the N- and 2N-step resamples end below the discrete model with LoRA "
    "and, fully fine-tuned, the 2N-step resample ends at most log(1.05) nats above the "
    "discrete model.",
    kind="paper",
)
def finetune_ode_vs_discrete(ctx: Context) -> Outcome:
    final, counts, path = _fig6(ctx)
    holds, gaps = ode_beats_discrete(final, counts)
    return Outcome(
        measured=dict(
            gaps_ode_minus_discrete=gaps, final_loss={str(k): v for k, v in final.items()}
        ),
        expected=dict(lora="< 0", full=f"<= {COMPARABLE:.4f}"),
        verdict=verdict(holds),
        summary="ODE minus discrete held-out loss: "
        + ", ".join(f"{k} {v:+.3g}" for k, v in gaps.items())
        + f" (holds iff LoRA < 0, full <= {COMPARABLE:.3g})",
        figures=(path,),
    )
