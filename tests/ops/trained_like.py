"""Inputs of the gated delta rule that look like a trained model's, and the error measure.

Random unit keys are nearly orthogonal, which hides the instability of a chunked solve; after the
short convolution and L2 norm of a trained Gated DeltaNet, neighbouring keys are similar. Here
keys follow a random walk on the sphere with a chosen neighbouring cosine (1 = identical keys),
write strengths can sit near 1 and gates can be strong (state wiped within a few tokens) or
zero (no decay at all). Imported by the tests and by `benchmarks/gated_delta_accuracy.py`; it
imports nothing from the test configuration.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    """One input regime. `gate`: "mild" (g = log U(0.8, 1)), "zero" (g = 0), "strong"
    (g = log U(0.001, 0.05)), "extreme" (each token g = 0 or log 1e-9, half each)."""

    cosine: float
    beta: tuple[float, float] = (0.05, 1.0)
    gate: str = "mild"
    segments: bool = False
    groups: int = 1
    t: int = 100
    d: int = 64
    seed: int = 0

    @property
    def name(self) -> str:
        parts = [f"cos{self.cosine}", f"beta{self.beta[0]}-{self.beta[1]}", self.gate]
        parts += ["segments"] * self.segments + [f"groups{self.groups}"] * (self.groups > 1)
        return "-".join(parts)


def correlated_keys(rng: np.random.Generator, shape, cosine: float) -> np.ndarray:
    """Unit keys `[B, T, H, K]` with `<k_t, k_{t-1}> ~ cosine` (exactly 1 when cosine is 1)."""
    t, d = shape[1], shape[-1]
    step = rng.normal(size=shape) / np.sqrt(d)
    keys = np.empty(shape)
    keys[:, 0] = step[:, 0] * np.sqrt(d)
    for i in range(1, t):
        keys[:, i] = cosine * keys[:, i - 1] + np.sqrt(1 - cosine**2) * step[:, i]
        keys[:, i] /= np.linalg.norm(keys[:, i], axis=-1, keepdims=True)
    return keys / np.linalg.norm(keys, axis=-1, keepdims=True)


def inputs(case: Case, b: int = 1, h: int = 1) -> dict:
    """float64 numpy arguments of `gated_delta_rule`, and `segment_ids` when `case.segments`."""
    rng = np.random.default_rng(case.seed)
    hv, t, d = h * case.groups, case.t, case.d
    gates = {
        "mild": lambda: np.log(rng.uniform(0.8, 1.0, size=(b, t, hv))),
        "zero": lambda: np.zeros((b, t, hv)),
        "strong": lambda: np.log(rng.uniform(0.001, 0.05, size=(b, t, hv))),
        "extreme": lambda: np.where(rng.uniform(size=(b, t, hv)) < 0.5, 0.0, np.log(1e-9)),
    }
    x = dict(
        q=correlated_keys(rng, (b, t, h, d), case.cosine),
        k=correlated_keys(rng, (b, t, h, d), case.cosine),
        v=rng.normal(size=(b, t, hv, d)),
        g=gates[case.gate](),
        beta=rng.uniform(*case.beta, size=(b, t, hv)),
        initial_state=rng.normal(size=(b, hv, d, d)) * 0.5,
    )
    if case.segments:
        cuts = sorted(rng.choice(np.arange(1, t), 2, replace=False))
        x["segment_ids"] = np.searchsorted(cuts, np.arange(t), side="right")[None].repeat(b, 0)
    return x


def cast(x: dict, dtype) -> dict:
    """q, k, v in `dtype`; gates, write strengths and the state in float32 (float64 kept)."""
    out = {}
    for name, a in x.items():
        if name == "segment_ids":
            out[name] = jnp.asarray(a, jnp.int32)
        elif name in ("q", "k", "v"):
            out[name] = jnp.asarray(a, dtype)
        else:
            out[name] = jnp.asarray(a, jnp.float64 if dtype == jnp.float64 else jnp.float32)
    return out


def forward_and_grads(fn, x: dict, seed: int = 1) -> dict:
    """`fn(**x) -> (o, final)`; returns o, final and the gradient of a fixed random linear loss
    in o and final with respect to every floating argument (float64 numpy arrays)."""
    floats = {n: a for n, a in x.items() if n != "segment_ids"}
    extra = {n: a for n, a in x.items() if n == "segment_ids"}
    o_shape = x["v"].shape
    rng = np.random.default_rng(seed)
    w_o = rng.normal(size=o_shape)
    w_s = rng.normal(size=x["initial_state"].shape)

    def loss(floats):
        o, final = fn(**floats, **extra)
        dt = final.dtype
        value = jnp.sum(o.astype(dt) * w_o.astype(dt)) + jnp.sum(final * w_s.astype(dt))
        return value, (o, final)

    (_, (o, final)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(floats)
    out = {"o": o, "final_state": final, **{f"d{n}": g for n, g in grads.items()}}
    return {n: np.asarray(a).astype(np.float64) for n, a in out.items()}


def rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    """`||got - want|| / ||want||` (Frobenius), the relative RMS error."""
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))
