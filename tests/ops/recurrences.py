"""The chunked linear recurrences under test, and the helpers their tests share.

`RECURRENCES` holds one row per op; `tests/ops/test_recurrences.py` checks the contract on every
row (fast impls against the `lax.scan` reference, every gradient, segments, grouped heads,
decoding steps, dtypes, bad inputs). A new op of the family is one row here, plus its numpy
reference in `tests/ops/test_<op>.py`. Imported by `tests/ops` and `tests/kernels`; pytest does
not collect it (no `test_` prefix).

Shapes: `q, k: [B, T, H, K]`, `v: [B, T, HV, V]`, gates `[B, T, HV]` (per key channel
`[B, T, HV, K]`, per value channel `[B, T, HV, V]`), states `[B, HV, K, V]`.
"""

import dataclasses
import functools
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from seqlab.ops.gated_delta import gated_delta_rule, gated_delta_rule_step
from seqlab.ops.gated_delta_product import gated_delta_product, gated_delta_product_step
from seqlab.ops.gdn2 import gdn2, gdn2_step
from seqlab.ops.kda import kda, kda_step
from seqlab.ops.ssd import ssd, ssd_step
from tests.conftest import assert_close

CHUNK_SIZES = (16, 32, 64, 128)

# ---------------------------------------------------------------------------------- inputs


def inputs(seed, b, t, h, hv, dk, dv, dtype, *, beta=True, initial_state=True):
    """Random well-conditioned inputs: unit-norm k, beta in (0, 1), log-gates in log(0.8..1)."""
    r = np.random.default_rng(seed)
    k = r.normal(size=(b, t, h, dk))
    x = dict(
        q=r.normal(size=(b, t, h, dk)),
        k=k / np.linalg.norm(k, axis=-1, keepdims=True),
        v=r.normal(size=(b, t, hv, dv)),
        g=np.log(r.uniform(0.8, 1.0, size=(b, t, hv))),
    )
    if beta:
        x["beta"] = r.uniform(0.05, 1.0, size=(b, t, hv))
    if initial_state:
        x["initial_state"] = r.normal(size=(b, hv, dk, dv))
    return {name: jnp.asarray(a, dtype) for name, a in x.items()}


ssd_inputs = functools.partial(inputs, beta=False)


def kda_inputs(seed, b, t, h, hv, dk, dv, dtype, *, initial_state=True):
    """`inputs` with a log-gate per key channel, `g: [B, T, HV, K]` in log(0.8..1)."""
    x = inputs(seed, b, t, h, hv, dk, dv, dtype, initial_state=initial_state)
    g = np.log(np.random.default_rng(seed + 1).uniform(0.8, 1.0, size=(b, t, hv, dk)))
    return dict(x, g=jnp.asarray(g, dtype))


def gdn2_inputs(seed, b, t, h, hv, dk, dv, dtype, *, initial_state=True):
    """`kda_inputs` (H = HV) with an erase gate `b: [B, T, H, K]` and a write gate
    `w: [B, T, H, V]` in (0.05, 1) in place of beta."""
    x = kda_inputs(seed, b, t, h, hv, dk, dv, dtype, initial_state=initial_state)
    r = np.random.default_rng(seed + 2)
    gates = dict(
        b=r.uniform(0.05, 1.0, size=(b, t, hv, dk)), w=r.uniform(0.05, 1.0, (b, t, hv, dv))
    )
    del x["beta"]
    return dict(x, **{n: jnp.asarray(a, dtype) for n, a in gates.items()})


# ------------------------------------------------------- Gated DeltaProduct in the test layout

HOUSEHOLDER = 2  # writes per token of the Gated DeltaProduct row


def product_inputs(seed, b, t, h, hv, dk, dv, dtype, *, initial_state=True):
    """Gated DeltaProduct's inputs in the layout of the contract tests (one row per token):
    `k: [B, T, H, n K]`, `v: [B, T, HV, n V]`, `beta: [B, T, HV, n]` hold the n writes of a
    token side by side; each written key has unit norm."""
    n = HOUSEHOLDER
    x = inputs(seed, b, t * n, h, hv, dk, dv, dtype, initial_state=initial_state)
    x["q"], x["g"] = x["q"][:, :t], x["g"][:, :t]
    for name in ("k", "v", "beta"):
        a = jnp.moveaxis(x[name].reshape(b, t, n, *x[name].shape[2:]), 2, 3)  # [B, T, H, n, ...]
        x[name] = a if name == "beta" else a.reshape(b, t, a.shape[2], -1)
    return x


def _writes(x, n):
    """`[B, T, H, n D] -> [B, T n, H, D]` (abstract arrays too); other ranks as they are (so a
    bad-input test meets the op's own check)."""
    if len(x.shape) != 4 or x.shape[-1] % n:
        return x
    b, t, h, d = x.shape
    shape = (b, t * n, h, d // n)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(shape, x.dtype)
    return jnp.moveaxis(x.reshape(b, t, h, n, d // n), 3, 2).reshape(shape)


def product_op(q, k, v, g, beta, **kw):
    """`gated_delta_product` on the layout of `product_inputs`."""
    n = HOUSEHOLDER
    beta = _writes(beta, n)
    if len(beta.shape) == 4:  # [B, T n, HV, 1]
        beta = _squeeze_last(beta)
    return gated_delta_product(q, _writes(k, n), _writes(v, n), g, beta, num_householder=n, **kw)


def _squeeze_last(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[:-1], x.dtype)
    return x[..., 0]


def product_step(q_t, k_t, v_t, g_t, beta_t, state, **kw):
    """`gated_delta_product_step` on one token of the layout of `product_inputs`."""
    n = HOUSEHOLDER

    def writes(x):  # [B, H, n D] -> [B, n, H, D]
        return jnp.moveaxis(x.reshape(*x.shape[:2], n, -1), 2, 1)

    beta_t = jnp.moveaxis(beta_t, 2, 1)
    return gated_delta_product_step(q_t, writes(k_t), writes(v_t), g_t, beta_t, state, **kw)


def ungated(x):
    """`x` with every log-gate 0 (no decay)."""
    return dict(x, g=jnp.zeros_like(x["g"]))


def abstract(x):
    """`x` with every array replaced by its `jax.ShapeDtypeStruct` (other values kept): any array
    operation on it fails, so only checks of shapes and dtypes can run."""
    return {
        n: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a
        for n, a in x.items()
    }


@st.composite
def brute_force_cases(draw, make_inputs):
    """A small float64 case `(x, chunk_size, segment_ids [B, T] numpy)`: 1-2 rows, 1-40 tokens,
    1-2 q/k heads serving 1-2 value heads each, K in 1..5, V in 1..4, 1-3 sorted documents."""
    b, t, h, groups = (draw(st.integers(1, n)) for n in (2, 40, 2, 2))
    dk, dv = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    chunk, n_docs = draw(st.sampled_from([16, 32])), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    x = make_inputs(seed, b, t, h, h * groups, dk, dv, jnp.float64)
    rng = np.random.default_rng(seed)
    seg = np.sort(rng.integers(0, n_docs, size=(b, t)), axis=1).astype(np.int32)
    return x, chunk, seg


# -------------------------------------------------------------------------------- segments


def segment_rows(lengths_per_row):
    """`segment_ids [B, T]` int32 from document lengths per row (ids need not be increasing)."""
    rows = [np.repeat(np.arange(len(ls))[::-1] * 7 + 3, ls) for ls in lengths_per_row]
    return jnp.asarray(np.stack(rows), jnp.int32)


def documents(x, lengths_per_row):
    """`(row, start, length, doc)` for every document of `segment_rows(lengths_per_row)`: `doc`
    holds the per-token arrays of `x` at that row's tokens `start .. start + length - 1`."""
    for row, lengths in enumerate(lengths_per_row):
        for start, length in zip(np.cumsum([0, *lengths[:-1]]), lengths, strict=True):
            span = slice(int(start), int(start + length))
            doc = {n: a[row : row + 1, span] for n, a in x.items() if n != "initial_state"}
            yield row, int(start), length, doc


# --------------------------------------------------------------------- running and comparing


def jitted(op, **static):
    """`jax.jit` of `op(..., output_final_state=True, **static)`: one compile per shape."""
    return jax.jit(functools.partial(op, output_final_state=True, **static))


def forward_and_grads(fn, x):
    """`(o, final_state)` of `fn(**x, output_final_state=True)` and the gradients of a generic
    loss on both with respect to every array in `x` (jitted)."""

    def loss(x):
        o, s = fn(**x, output_final_state=True)
        return jnp.sum(jnp.sin(o) * o) + jnp.sum(jnp.cos(s) * s), (o, s)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    return out, grads


def assert_all_close(got, want, dtype, **tol):
    """`((o, final_state), grads)` pairs of `forward_and_grads` agree: within the tolerance table
    for `dtype`, or within explicit `rtol`/`atol` when given."""
    (o, s), grads = got
    (o_ref, s_ref), grads_ref = want
    check = functools.partial(np.testing.assert_allclose, **tol) if tol else None
    pairs = [("o", o, o_ref), ("final_state", s, s_ref)]
    pairs += [(f"d{name}", grads[name], grads_ref[name]) for name in grads_ref]
    for name, a, e in pairs:
        if check is None:
            assert_close(a, e, dtype, err_msg=name)
        else:
            check(np.asarray(a, np.float64), np.asarray(e, np.float64), err_msg=name)


def numpy_recurrence(x, write, segment_ids=None):
    """float64 numpy loop over rows, value heads and tokens of the state `S: [K, V]`: zeroed at
    every change of `segment_ids` along t, then `S = write(S, token)` and `o_t = S^T q_t`.

    `token` maps each per-token name of `x` to its float64 slice at (row, t, head), q and k taken
    from the head serving value head j (`j // (HV // H)`). Returns `(o [B, T, HV, V], final)`.
    """
    arrays = {n: np.asarray(a, np.float64) for n, a in x.items()}
    s0 = arrays.pop("initial_state")
    b, t, h, _ = arrays["q"].shape
    hv = arrays["v"].shape[2]
    o = np.zeros(arrays["v"].shape)
    final = np.zeros(s0.shape)
    for bi, j in itertools.product(range(b), range(hv)):
        s = s0[bi, j].copy()
        for ti in range(t):
            if segment_ids is not None and ti and segment_ids[bi, ti] != segment_ids[bi, ti - 1]:
                s = np.zeros_like(s)
            token = {
                n: a[bi, ti, j // (hv // h) if n in ("q", "k") else j] for n, a in arrays.items()
            }
            s = write(s, token)
            o[bi, ti, j] = s.T @ token["q"]
        final[bi, j] = s
    return o, final


# ---------------------------------------------------------------------------- the ops' table


@dataclasses.dataclass(frozen=True)
class Recurrence:
    """One op of the family as the contract tests call it.

    name: the test id. op: `op(**arrays, initial_state=, output_final_state=, chunk_size=,
    segment_ids=, impl=, **options) -> (o, final_state)`. step: the decoding step,
    `step(*(x[n][:, t] for n in per_token), state, **options) -> (o_t, state)`.
    make_inputs: `(seed, b, t, h, hv, dk, dv, dtype, *, initial_state=True) -> dict` of the op's
    arrays (with `initial_state` unless False). per_token: the arrays with a time axis, in the
    step's order. reference: the `lax.scan` impl; fast: the impls held to it. grouped: q/k may
    have fewer heads than v (else tests pass `H = HV`). options: keyword arguments beyond the
    shared ones that op and step take alike (the step test passes them).
    """

    name: str
    op: Callable
    step: Callable
    make_inputs: Callable
    per_token: tuple[str, ...]
    reference: str = "recurrent"
    fast: tuple[str, ...] = ("chunked",)
    grouped: bool = True
    options: dict = dataclasses.field(default_factory=dict)
    adapted: bool = False
    writes_per_token: int = 1

    def inputs(self, seed, b, t, h, hv, dk, dv, dtype, **kw):
        """`make_inputs` with `H = HV` for an op without grouped heads."""
        return self.make_inputs(seed, b, t, h if self.grouped else hv, hv, dk, dv, dtype, **kw)


# The delta family beyond the gated delta rule. Their chunked forms share `seqlab.ops._delta` with
# the gated delta rule, whose row runs every contract in the default run; the family's rows of the
# contract matrix run with -m slow (`family_slow`), while their float64 comparison with packed
# documents, float32 comparison, decoding steps and bad inputs (`test_recurrences.py`), their
# brute-force numpy and trained-like checks (`test_delta_family.py`) stay in the default run.
FAMILY = ("kda", "gdn2", "gated_delta_product")


def family_slow(params):
    """`params` (`pytest.param`s whose first value is a `Recurrence`) with the rows of `FAMILY`
    marked slow."""
    return [
        pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow])
        if p.values[0].name in FAMILY
        else p
        for p in params
    ]


RECURRENCES = (
    Recurrence(
        "gated_delta_rule",
        gated_delta_rule,
        gated_delta_rule_step,
        inputs,
        ("q", "k", "v", "g", "beta"),
        options={"scale": 0.3},
    ),
    Recurrence("ssd", ssd, ssd_step, ssd_inputs, ("q", "k", "v", "g")),
    Recurrence(
        "kda", kda, kda_step, kda_inputs, ("q", "k", "v", "g", "beta"), options={"scale": 0.3}
    ),
    Recurrence(
        "gdn2",
        gdn2,
        gdn2_step,
        gdn2_inputs,
        ("q", "k", "v", "g", "b", "w"),
        grouped=False,
        options={"scale": 0.3},
    ),
    Recurrence(
        "gated_delta_product",
        product_op,
        product_step,
        product_inputs,
        ("q", "k", "v", "g", "beta"),
        options={"scale": 0.3},
        adapted=True,
        writes_per_token=HOUSEHOLDER,
    ),
)
