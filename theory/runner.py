"""Run claims and write the report: `DIR/claims.json`, `DIR/report.md`, `DIR/figures/*.png`.

`python -m theory [--out DIR] [--full] [--only NAME[,NAME]] [--seed N] [--model PATH]` runs every
paper of `registry.PAPERS` (with `--model`, only the claims that measure a given model, on it);
`python -m theory.<paper>` runs one paper. The exit status is 0 when every claim ran, whatever its
verdict; 1 when a claim raised (its record says so, and the others still run); 2 when the command
line names no claim or a model that cannot be loaded.
"""

import datetime
import importlib.metadata
import json
import math
import pathlib
import platform
import sys
import time
import traceback
import zlib
from collections.abc import Sequence

import jax
import matplotlib
import numpy as np
from absl import flags

from seqlab.interop import load_hf
from seqlab.train.workdir import load_model as load_workdir_model
from theory import registry

FIELDS = (
    "id",
    "paper",
    "kind",
    "statement",
    "summary",
    "measured",
    "expected",
    "verdict",
    "seconds",
    "figures",  # paths relative to the report folder
)
README_DIR = pathlib.Path(__file__).parent  # holds theory/<paper>/README.md


def to_json(value):
    """`value` with arrays and numpy scalars as Python lists and numbers; non-finite as strings."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        return to_json(np.asarray(value).tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot write {type(value).__name__} to claims.json: {value!r}")


def load_model(path) -> registry.GivenModel:
    """The model at `path`: a Hugging Face model directory (`config.json` naming its
    `architectures`, read by `seqlab.interop`) or a seqlab workdir (`config.json` and
    `checkpoints/`, e.g. written by `python -m experiments.convert` or `experiments.launch`)."""
    path = pathlib.Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"--model {str(path)!r} has no config.json")
    if "architectures" in json.loads(config.read_text()):
        converted = load_hf(path)
        return registry.GivenModel(converted.model, converted.params, str(path))
    model, params = load_workdir_model(path)
    return registry.GivenModel(model, params, str(path))


def run_claim(
    claim: registry.Claim,
    *,
    out_dir: pathlib.Path,
    full: bool,
    seed: int,
    model: registry.GivenModel | None = None,
):
    """Run one claim (on `model` when given); returns `(record, error)` where `error` is None or
    the traceback text."""
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(claim.id.encode()))
    ctx = registry.Context(claim.id, full, key, out_dir / "figures", model)
    start = time.perf_counter()
    try:
        outcome = claim.measure(ctx)
        missing = [str(f) for f in outcome.figures if not pathlib.Path(f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"claim {claim.id} reported figures it did not write: {missing}"
            )
        record = dict(
            measured=to_json(outcome.measured),
            expected=to_json(outcome.expected),
            verdict=outcome.verdict,
            summary=outcome.summary,
            figures=[pathlib.Path(f).relative_to(out_dir).as_posix() for f in outcome.figures],
        )
        error = None
    except Exception as e:
        error = traceback.format_exc()
        record = dict(
            measured={"error": f"{type(e).__name__}: {e}"},
            expected={},
            verdict="inconclusive",
            summary=f"could not run: {type(e).__name__}: {e}".splitlines()[0],
            figures=[],
        )
    seconds = round(time.perf_counter() - start, 2)
    base = dict(
        id=claim.id, paper=claim.paper, kind=claim.kind, statement=claim.statement, seconds=seconds
    )
    return {**base, **record}, error


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(records: Sequence[dict]) -> str:
    """A plain-text table of the records: id, paper, kind, verdict, seconds, summary."""
    rows = [("id", "paper", "kind", "verdict", "seconds", "summary")]
    rows += [
        (
            r["id"],
            r["paper"],
            r["kind"],
            r["verdict"],
            f"{r['seconds']:.1f}",
            _cut(r["summary"], 100),
        )
        for r in records
    ]
    rows.insert(1, tuple("-" * len(c) for c in rows[0]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _by_kind(records: Sequence[dict]) -> list[tuple[str, list[dict]]]:
    """The records grouped by kind, in the order of `registry.KINDS`, empty kinds left out."""
    groups = [(kind, [r for r in records if r["kind"] == kind]) for kind in registry.KINDS]
    return [(kind, rs) for kind, rs in groups if rs]


def _verdict_table(records: Sequence[dict], column: str) -> list[str]:
    """A markdown table: claim, the record's `column` ("paper" or "kind"), verdict, summary."""
    md = [f"| claim | {column} | verdict | measured |", "|---|---|---|---|"]
    for r in records:
        summary = r["summary"].replace("|", "\\|")
        md.append(f"| `{r['id']}` | {r[column]} | **{r['verdict']}** | {summary} |")
    return md


def counts(records: Sequence[dict]) -> str:
    """How many records have each verdict: "holds 3, fails 2"."""
    n = {v: sum(r["verdict"] == v for r in records) for v in registry.VERDICTS}
    return ", ".join(f"{k} {v}" for k, v in n.items() if v)


def write_report(records: Sequence[dict], out_dir: pathlib.Path, *, full: bool) -> None:
    """Write `claims.json` (the fields of DESIGN.md 3.5, the summary and the figures) and
    `report.md`.

    The report groups the claims by kind (the papers' results first), with a table per kind and,
    per claim, its statement, what is expected, the measured summary and the figures; the whole
    measurement is in `claims.json`.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    claims = [{k: r[k] for k in FIELDS} for r in records]
    (out_dir / "claims.json").write_text(json.dumps(claims, indent=2) + "\n")

    size = "paper size (--full)" if full else "quick size"
    md = [f"# Claims report ({size})", "", f"{len(records)} claims: {counts(records)}."]
    for kind, group in _by_kind(records):
        md += ["", f"## {kind}: {registry.KINDS[kind]} ({counts(group)})", ""]
        md += _verdict_table(group, "paper")
    for kind, group in _by_kind(records):
        for r in group:
            md += [
                "",
                f"### `{r['id']}` ({r['paper']}, {kind}): {r['verdict']}",
                "",
                r["statement"],
            ]
            md += ["", f"Expected: `{json.dumps(r['expected'])}`", "", f"Measured: {r['summary']}"]
            md += [f"\n![{r['id']}]({f})" for f in r["figures"]]
    md += ["", "The whole measurement of each claim is in `claims.json`."]
    (out_dir / "report.md").write_text("\n".join(md) + "\n")


def _cpu_name() -> str:
    """The CPU's model name (Linux), else the processor string."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor()


def readme_block(records: Sequence[dict], *, full: bool, command: str) -> str:
    """The generated verdict section of a paper's README: how it was run, and the table."""
    versions = ", ".join(
        f"{m} {importlib.metadata.version(m)}" for m in ("jax", "jaxlib", "numpy", "scipy")
    )
    size = "paper size" if full else "quick size"
    seconds = sum(r["seconds"] for r in records)
    md = [
        f"Verdicts at {size}, written by `{command}` on {datetime.date.today().isoformat()} "
        f"(Python {platform.python_version()}, {versions}; {platform.machine()} "
        f"{_cpu_name()}; {seconds:.0f} s of claims). Every claim is seeded from `--seed` and its "
        "id, so a run at the same package versions on the same kind of CPU gives the same numbers; "
        "on another CPU XLA may round float32 differently, which moves the trained claims' "
        "numbers slightly and can flip a verdict that sits at its threshold.",
        "",
        *_verdict_table(records, "kind"),
    ]
    return "\n".join(md)


def write_readme(path: pathlib.Path, records: Sequence[dict], *, full: bool, command: str) -> None:
    """Replace the README's `<!-- verdicts quick|full -->` block (appended when it has none)."""
    size = "full" if full else "quick"
    begin, end = f"<!-- verdicts {size}: generated, do not edit -->", f"<!-- /verdicts {size} -->"
    block = f"{begin}\n{readme_block(records, full=full, command=command)}\n{end}"
    text = path.read_text()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        title = "paper size (`--full`)" if full else "quick size"
        text = text.rstrip("\n") + f"\n\n## Verdicts at {title}\n\n{block}\n"
    path.write_text(text)


def run(
    papers: Sequence[registry.Paper],
    *,
    out: str | pathlib.Path = "report",
    full: bool = False,
    only: Sequence[str] = (),
    seed: int = 0,
    readmes: pathlib.Path | None = None,
    command: str = "python -m theory --readme",
    model: str | None = None,
) -> int:
    """Run the selected claims of `papers`, write the report, print the table; the exit status.

    With `readmes` (a folder holding `<paper>/README.md`), also write the verdict block of the
    README of every paper whose claims all ran (none raised), crediting `command`. With `model`
    (a path for `load_model`), run only the claims declared `on_model`, on that model (no README
    is written: the verdicts are the model's, not the paper's setting).
    """
    try:
        claims = registry.select(papers, only, on_model=model is not None)
        given = None if model is None else load_model(model)
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if given is not None:
        readmes = None
        print(f"measuring {given.source}: pattern {given.model.pattern!r}", flush=True)
    matplotlib.use("Agg")
    out_dir = pathlib.Path(out)
    records, errors = [], []
    for claim in claims:
        print(f"running {claim.id} ...", flush=True)
        record, error = run_claim(claim, out_dir=out_dir, full=full, seed=seed, model=given)
        records.append(record)
        if error is not None:
            errors.append(claim.id)
            print(f"claim {claim.id} raised:\n{error}", file=sys.stderr, flush=True)
    write_report(records, out_dir, full=full)
    print(format_table(records))
    print(f"wrote {out_dir / 'claims.json'} and {out_dir / 'report.md'}")
    if readmes is not None:
        for paper in papers:
            ids = [c.id for c in paper.claims]
            ran = [r for r in records if r["paper"] == paper.name]
            if [r["id"] for r in ran] != ids or any(i in errors for i in ids):
                print(
                    f"not writing the README of {paper.name}: not all its claims ran",
                    file=sys.stderr,
                )
                continue
            path = pathlib.Path(readmes) / paper.name / "README.md"
            write_readme(path, ran, full=full, command=command)
            print(f"wrote the verdicts of {path}")
    if errors:
        print(f"error: claims that could not run: {errors}", file=sys.stderr)
        return 1
    return 0


def main_for(papers: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS):
    """An `absl.app` main running the papers named `papers`.

    Defines the flags `--out`, `--full`, `--only`, `--seed`, `--model`, `--readme` in
    `flag_values` on first use (not at import, so that importing the runner adds no flags to
    another program).
    """
    if "only" not in flag_values:
        flags.DEFINE_string(
            "out",
            "report",
            "Report folder: claims.json, report.md, figures/.",
            flag_values=flag_values,
        )
        flags.DEFINE_bool(
            "full", False, "Paper size instead of the quick size.", flag_values=flag_values
        )
        flags.DEFINE_list(
            "only", [], "Claim ids or paper names to run (default: all).", flag_values=flag_values
        )
        flags.DEFINE_integer(
            "seed", 0, "Base seed; each claim folds in a hash of its id.", flag_values=flag_values
        )
        flags.DEFINE_string(
            "model",
            None,
            "A seqlab workdir or Hugging Face model directory: run the claims that measure a "
            "given model on it.",
            flag_values=flag_values,
        )
        flags.DEFINE_bool(
            "readme",
            False,
            "Also write the verdicts into theory/<paper>/README.md of each paper that ran whole.",
            flag_values=flag_values,
        )

    def main(argv):
        if len(argv) > 1:
            print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
            return 2
        f = flag_values
        module = "theory" if len(papers) > 1 else f"theory.{papers[0]}"
        command = " ".join(
            [f"python -m {module} --readme", *(["--full"] if f.full else []), f"--seed {f.seed}"]
            + ([f"--only {','.join(f.only)}"] if f.only else [])
        )
        return run(
            registry.load_papers(papers),
            out=f.out,
            full=f.full,
            only=f.only,
            seed=f.seed,
            readmes=README_DIR if f.readme else None,
            command=command,
            model=f.model,
        )

    return main
