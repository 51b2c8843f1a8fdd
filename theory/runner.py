"""Run claims and write the report: `DIR/claims.json`, `DIR/report.md`, `DIR/figures/*.png`.

`python -m theory [--out DIR] [--full] [--only NAME[,NAME]] [--seed N]` runs every paper of
`registry.PAPERS`; `python -m theory.<paper>` runs one paper. The exit status is 0 when every claim
ran, whatever its verdict; 1 when a claim raised (its record says so, and the others still run); 2
when the command line names no claim.
"""

import json
import math
import pathlib
import sys
import time
import traceback
import zlib
from collections.abc import Sequence

import jax
import matplotlib
import numpy as np
from absl import flags

from theory import registry

FIELDS = ("id", "paper", "statement", "measured", "expected", "verdict", "seconds")


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


def run_claim(claim: registry.Claim, *, out_dir: pathlib.Path, full: bool, seed: int):
    """Run one claim; returns `(record, error)` where `error` is None or the traceback text."""
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(claim.id.encode()))
    ctx = registry.Context(claim.id, full, key, out_dir / "figures")
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
            figures=[pathlib.Path(f).relative_to(out_dir).as_posix() for f in outcome.figures],
        )
        error = None
    except Exception as e:
        error = traceback.format_exc()
        record = dict(
            measured={"error": f"{type(e).__name__}: {e}"},
            expected={},
            verdict="inconclusive",
            figures=[],
        )
    seconds = round(time.perf_counter() - start, 2)
    base = dict(id=claim.id, paper=claim.paper, statement=claim.statement, seconds=seconds)
    return {**base, **record}, error


def _short(values: dict, width: int = 60) -> str:
    """`k=v` pairs with numbers to 3 significant digits, cut at `width` characters."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v[:4]) + (", ...]" if len(v) > 4 else "]")
        return str(v)

    text = ", ".join(f"{k}={fmt(v)}" for k, v in values.items())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(records: Sequence[dict]) -> str:
    """A plain-text table of the records: id, paper, verdict, seconds, measured."""
    rows = [("id", "paper", "verdict", "seconds", "measured")]
    rows += [
        (r["id"], r["paper"], r["verdict"], f"{r['seconds']:.1f}", _short(r["measured"]))
        for r in records
    ]
    rows.insert(1, tuple("-" * len(c) for c in rows[0]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def write_report(records: Sequence[dict], out_dir: pathlib.Path, *, full: bool) -> None:
    """Write `claims.json` (the fields of DESIGN.md 3.5) and `report.md` (table and figures)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    claims = [{k: r[k] for k in FIELDS} for r in records]
    (out_dir / "claims.json").write_text(json.dumps(claims, indent=2) + "\n")

    size = "paper size (--full)" if full else "quick size"
    md = [f"# Claims report ({size})", "", "| claim | paper | verdict | seconds | measured |"]
    md.append("|---|---|---|---|---|")
    md += [
        f"| `{r['id']}` | {r['paper']} | **{r['verdict']}** | {r['seconds']:.1f} | "
        f"{_short(r['measured'], 120)} |"
        for r in records
    ]
    for r in records:
        md += ["", f"## `{r['id']}` ({r['paper']}): {r['verdict']}", "", r["statement"], ""]
        md += ["Measured:", "", "```json", json.dumps(r["measured"], indent=1), "```", ""]
        md += ["Expected:", "", "```json", json.dumps(r["expected"], indent=1), "```"]
        md += [f"\n![{r['id']}]({f})" for f in r["figures"]]
    (out_dir / "report.md").write_text("\n".join(md) + "\n")


def run(
    papers: Sequence[registry.Paper],
    *,
    out: str | pathlib.Path = "report",
    full: bool = False,
    only: Sequence[str] = (),
    seed: int = 0,
) -> int:
    """Run the selected claims of `papers`, write the report, print the table; the exit status."""
    try:
        claims = registry.select(papers, only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    out_dir = pathlib.Path(out)
    records, errors = [], []
    for claim in claims:
        print(f"running {claim.id} ...", flush=True)
        record, error = run_claim(claim, out_dir=out_dir, full=full, seed=seed)
        records.append(record)
        if error is not None:
            errors.append(claim.id)
            print(f"claim {claim.id} raised:\n{error}", file=sys.stderr, flush=True)
    write_report(records, out_dir, full=full)
    print(format_table(records))
    print(f"wrote {out_dir / 'claims.json'} and {out_dir / 'report.md'}")
    if errors:
        print(f"error: claims that could not run: {errors}", file=sys.stderr)
        return 1
    return 0


def main_for(papers: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS):
    """An `absl.app` main running the papers named `papers`.

    Defines the flags `--out`, `--full`, `--only`, `--seed` in `flag_values` on first use (not at
    import, so that importing the runner adds no flags to another program).
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

    def main(argv):
        if len(argv) > 1:
            print(f"error: unexpected arguments {argv[1:]}", file=sys.stderr)
            return 2
        f = flag_values
        return run(registry.load_papers(papers), out=f.out, full=f.full, only=f.only, seed=f.seed)

    return main
