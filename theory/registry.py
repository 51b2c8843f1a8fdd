"""The claim registry: papers declare claims, the runner finds the papers listed in `PAPERS`.

A paper package `theory/<name>/` has a `claims.py` that defines `PAPER = Paper(name, title)` and
decorates its measuring functions with `@PAPER.claim(id, statement, kind=...)`. A claim is a
function of a `Context` (size, PRNG key, where to put figures) returning an `Outcome`: what was
measured, what the paper predicts, a one-line summary of the measurement against its threshold,
the verdict computed from the measurement, and the figures it drew. Its `kind` says what a verdict
is evidence of (`KINDS`); only `"paper"` claims are evidence about the paper. To add a paper,
write its package and append its name to `PAPERS`.
"""

import dataclasses
import importlib
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax

# The paper packages `python -m theory` runs, in order: `theory.<name>.claims` defines `PAPER`.
PAPERS = (
    "ssm_bottleneck",
    "mamba_dynamics",
    "sparse_embeddings",
    "coordinated_sampling",
    "neural_ode",
    "metastability",
)

VERDICTS = ("holds", "fails", "inconclusive")

# What a claim's verdict is evidence of, in the order the report shows them.
KINDS = {
    "paper": "a result the paper states",
    "consistency": "seqlab's numerics agree with an independent computation",
    "construction": "true by how seqlab builds the object",
}


@dataclasses.dataclass(frozen=True)
class GivenModel:
    """A model handed to the claims (`python -m theory --model PATH`): a `LanguageModel`, its
    parameters and where they came from (a workdir or a Hugging Face directory)."""

    model: Any
    params: Any
    source: str


@dataclasses.dataclass(frozen=True)
class Context:
    """What a claim may depend on: its size, its randomness, where its figures go, and (for the
    claims declared `on_model`) a given model to measure instead of their own."""

    claim_id: str
    full: bool  # paper size when True, quick size otherwise
    key: jax.Array  # a PRNG key for this claim alone
    figures_dir: pathlib.Path
    model: GivenModel | None = None

    def size(self, quick, full):
        """`full` at paper size, `quick` otherwise."""
        return full if self.full else quick

    def figure(self, suffix: str = "") -> pathlib.Path:
        """The path of a figure of this claim: `figures_dir/<claim_id>[_<suffix>].png`."""
        self.figures_dir.mkdir(parents=True, exist_ok=True)
        name = f"{self.claim_id}_{suffix}" if suffix else self.claim_id
        return self.figures_dir / f"{name}.png"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A claim's result: JSON-able `measured`/`expected` dicts, a verdict, figure paths.

    `summary` is one line for a reader: the deciding numbers against the claim's threshold (say
    "slope 0.31 (holds iff >= 0.1)"), not the whole `measured` dict.
    """

    measured: dict[str, Any]
    expected: dict[str, Any]
    verdict: str
    summary: str
    figures: tuple[pathlib.Path, ...] = ()

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {list(VERDICTS)}, got {self.verdict!r}")
        if not self.summary or "\n" in self.summary:
            raise ValueError(f"summary must be one non-empty line, got {self.summary!r}")


def verdict(holds: bool, *, decidable: bool = True) -> str:
    """`"holds"`/`"fails"` from a measured criterion; `"inconclusive"` when it cannot decide."""
    if not decidable:
        return "inconclusive"
    return "holds" if holds else "fails"


@dataclasses.dataclass(frozen=True)
class Claim:
    id: str
    paper: str
    kind: str
    statement: str
    measure: Callable[[Context], Outcome]
    on_model: bool = False  # measures `Context.model` when one is given


class Paper:
    """The claims of one paper, in declaration order."""

    def __init__(self, name: str, title: str):
        self.name = name
        self.title = title
        self.claims: list[Claim] = []

    def claim(self, id: str, statement: str, *, kind: str, on_model: bool = False):
        """Decorator registering `fn(ctx: Context) -> Outcome` as the check of a claim.

        `kind` is one of `KINDS`; `statement` holds the claim and its thresholds, fixed before
        measuring. `on_model`: the claim measures any `LanguageModel` given as `ctx.model`
        (`python -m theory --model PATH`) in place of its own.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")

        def register(fn: Callable[[Context], Outcome]):
            if any(c.id == id for c in self.claims):
                raise ValueError(f"claim id {id!r} is already registered in paper {self.name!r}")
            self.claims.append(Claim(id, self.name, kind, statement, fn, on_model))
            return fn

        return register


def load_papers(names: Sequence[str] = PAPERS) -> list[Paper]:
    """Import `theory.<name>.claims` for each name and return their `PAPER`s."""
    return [importlib.import_module(f"theory.{name}.claims").PAPER for name in names]


def select(
    papers: Sequence[Paper], only: Sequence[str] = (), *, on_model: bool = False
) -> list[Claim]:
    """The claims of `papers` named by `only` (claim ids or paper names; all when empty), only
    those declared `on_model` when `on_model`.

    Raises `ValueError` listing the known names when a name matches nothing, or when `on_model`
    leaves no claim.
    """
    claims = _select(papers, only)
    if not on_model:
        return claims
    chosen = [c for c in claims if c.on_model]
    if not chosen:
        known = [c.id for p in papers for c in p.claims if c.on_model]
        raise ValueError(
            f"no claim of the selection measures a given model; those that do: {known}"
        )
    return chosen


def _select(papers: Sequence[Paper], only: Sequence[str]) -> list[Claim]:
    claims = [c for p in papers for c in p.claims]
    ids = [c.id for c in claims]
    if len(set(ids)) != len(ids):
        raise ValueError(f"claim ids must be unique across papers, got {ids}")
    if not only:
        return claims
    known = {p.name for p in papers} | set(ids)
    unknown = [name for name in only if name not in known]
    if unknown:
        raise ValueError(
            f"--only names no claim or paper: {unknown}; known papers: "
            f"{[p.name for p in papers]}, claims: {ids}"
        )
    return [c for c in claims if c.id in only or c.paper in only]
