"""`python -m docs.build [--report DIR] [--jobs N]`: the documentation site, built into `site/`.

Every page is generated, so the site shows what the code and its runs say:

- **Home and guides** from sections of README.md and WORKSPACE.md (one copy of each text);
- **Theory**: a page per paper, its README (what each claim checks and how) followed by this
  build's run of `python -m theory` at quick size (claims in parallel over `--jobs` processes, one
  paper each) with kind, statement, expectation, measured summary, verdict and figures; or the
  run already in `--report DIR` (a `python -m theory --out DIR` folder, `--full` ones too);
- **Notebooks**: the committed notebooks with their outputs (`python -m docs.notebooks`
  re-executes them; `tests/notebooks` fails when their outputs are stale);
- **API reference**: every name in `__all__` of the public packages (`API`), by mkdocstrings,
  after a check that each has a docstring.

The pages go to `build/docs/`, the site to `site/` (open `site/index.html`). MkDocs runs in strict
mode: a warning (a broken link or cross-reference, a formula that does not render) fails the
build, as does a public name without a docstring or a claim that raised.
"""

import argparse
import concurrent.futures
import datetime
import html
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import time

import griffe
import nbformat
from mkdocs.commands.build import build as mkdocs_build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort
from nbconvert import MarkdownExporter

from theory import registry, runner

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "mkdocs.yml"
SRC = ROOT / "build" / "docs"  # the generated pages (mkdocs.yml's docs_dir)
SITE = ROOT / "site"

# The API reference: one page per public package, every name of its `__all__` (a module
# without one, the kernels' `api` modules, lists its public module-level names), then the public
# modules it does not export, whole.
API = {
    "seqlab.ops": ("seqlab.ops.sequence_parallel",),
    "seqlab.kernels.gated_delta.api": (),
    "seqlab.kernels.kda.api": (),
    "seqlab.modules": ("seqlab.modules.mamba_variants",),
    "seqlab.dynamics": (),
    "seqlab.sketching": (),
    "seqlab.analysis": (),
    "seqlab.train": ("seqlab.train.workdir", "seqlab.train.aot"),
    "seqlab.interop": (),
    "seqlab.serving": (),
}
# The kernel contracts (the README beside each kernel package) open their API pages.
CONTRACTS = {
    "seqlab.kernels.gated_delta.api": ROOT / "seqlab/kernels/gated_delta/README.md",
    "seqlab.kernels.kda.api": ROOT / "seqlab/kernels/kda/README.md",
}

# Guide pages: (file name, title, [(source file, "## heading" of the section to include)]).
GUIDES = (
    ("install.md", "Install, the main job, the tests", [("README.md", "Quickstart")]),
    ("commands.md", "Commands", [("WORKSPACE.md", "Commands")]),
    (
        "training.md",
        "Training",
        [
            ("README.md", "Train a model"),
            ("WORKSPACE.md", "Training on accelerators"),
            ("WORKSPACE.md", "Pretrained checkpoints (Hugging Face)"),
        ],
    ),
    (
        "layout.md",
        "Layout and conventions",
        [("WORKSPACE.md", "Layout"), ("WORKSPACE.md", "Conventions (DESIGN.md section 2)")],
    ),
    ("recipes.md", "Add an op, kernel, module, claim or config", [("WORKSPACE.md", "Recipes")]),
)

# Methods a class defines for the framework to call, not for its users: Flax's `setup` and the
# mixer contract's `check_fields` (run at construction; `seqlab.modules.Mixer` documents it).
HOOKS = ("setup", "check_fields")

FILTERS = json.dumps(["!^_", *(f"!^{name}$" for name in HOOKS)])  # members the pages leave out

LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
VERDICT_BLOCK = re.compile(
    r"## Verdicts at [^\n]*\n\s*<!-- verdicts (quick|full): generated, do not edit -->.*?"
    r"<!-- /verdicts \1 -->\n?",
    re.S,
)


class BuildError(Exception):
    """A reason the site cannot be built (printed, exit status 1)."""


def write(relative: str, text: str) -> str:
    """Write the page `relative` (to `SRC`); returns `relative` for the nav."""
    path = SRC / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return relative


def section(source: pathlib.Path, heading: str) -> str:
    """The `## heading` section of the markdown file `source`, with its subsections, without the
    heading line; its relative links and images point at files copied beside the page."""
    lines = source.read_text().splitlines()
    try:
        start = lines.index(f"## {heading}")
    except ValueError:
        raise BuildError(f"{source.name} has no section '## {heading}'") from None
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return with_assets("\n".join(lines[start + 1 : end]).strip(), source.parent)


def with_assets(text: str, base: pathlib.Path) -> str:
    """`text` with each relative link to a file under `base` copied to the same place under
    `SRC` (an image, a figure); links to other markdown files or folders are refused."""

    def copy(match: re.Match) -> str:
        target = match[2]
        if re.match(r"^[a-z]+:|^#", target):
            return match[0]
        path = (base / target).resolve()
        if not path.is_file() or path.suffix == ".md":
            raise BuildError(f"a page links to {target!r}, which the site does not hold")
        relative = path.relative_to(ROOT)
        (SRC / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, SRC / relative)
        return match[0]

    return LINK.sub(copy, text)


def home_page() -> str:
    readme = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    intro = readme.split("\n", 1)[1].strip()
    tour = section(ROOT / "README.md", "A tour")
    return write("index.md", f"# seqlab\n\n{intro}\n\n## A tour\n\n{tour}\n")


def guide_pages() -> list:
    pages = []
    for name, title, parts in GUIDES:
        body = "\n\n".join(section(ROOT / source, heading) for source, heading in parts)
        pages.append({title: write(f"guides/{name}", f"# {title}\n\n{body}\n")})
    return pages


# ---- theory -------------------------------------------------------------------------------------


def run_theory(out: pathlib.Path, jobs: int) -> pathlib.Path:
    """Run every paper's claims at quick size, one `python -m theory --only PAPER` process per
    paper, `jobs` at a time (the longest first), into `out/PAPER/`; merge them into
    `out/claims.json` and `out/figures/`. Returns `out`."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    def one(paper: str) -> tuple[str, int, float]:
        start = time.perf_counter()
        with open(out / f"{paper}.log", "w") as log:
            command = [sys.executable, "-m", "theory", "--only", paper, "--out", str(out / paper)]
            rc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        return paper, rc, time.perf_counter() - start

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for paper, rc, seconds in pool.map(one, sorted(registry.PAPERS, key=_recorded_seconds)):
            print(f"  theory: {paper} ran in {seconds:.0f} s (exit {rc})", flush=True)
            if rc != 0:
                tail = (out / f"{paper}.log").read_text()[-3000:]
                raise BuildError(f"python -m theory --only {paper} exited {rc}:\n{tail}")
    records = []
    for paper in registry.PAPERS:
        records += json.loads((out / paper / "claims.json").read_text())
        shutil.copytree(out / paper / "figures", out / "figures", dirs_exist_ok=True)
    (out / "claims.json").write_text(json.dumps(records, indent=2) + "\n")
    (out / "run.json").write_text(json.dumps(run_info(jobs)) + "\n")
    return out


def _recorded_seconds(paper: str) -> float:
    """Minus the seconds of claims that the quick verdict block of the paper's README records
    (0 when none does): sorting by it starts the longest papers first."""
    readme = (ROOT / "theory" / paper / "README.md").read_text()
    block = re.search(r"<!-- verdicts quick.*?<!-- /verdicts quick -->", readme, re.S)
    found = block and re.search(r"; (\d+) s of claims\)", block[0])
    return -float(found[1]) if found else 0.0


def run_info(jobs: int) -> dict:
    """How this build ran the claims (at quick size, `jobs` processes), for `run.json`."""
    versions = {m: importlib.metadata.version(m) for m in ("jax", "jaxlib", "numpy", "scipy")}
    return dict(
        size="quick size",
        date=datetime.date.today().isoformat(),
        python=platform.python_version(),
        versions=versions,
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        jobs=jobs,
    )


def report_info(report: pathlib.Path) -> dict:
    """How the report in `report` was made: this build's `run.json`, else its report.md title."""
    if (report / "run.json").is_file():
        return json.loads((report / "run.json").read_text())
    report_md = report / "report.md"
    title = report_md.read_text().split("\n", 1)[0] if report_md.is_file() else ""
    size = next((s for s in ("paper size", "quick size") if s in title), "size not recorded")
    return dict(size=size, date=None)


def _text(value: str) -> str:
    """Plain text for a markdown page: no HTML, no math delimiters, no table breaks."""
    return html.escape(value, quote=False).replace("$", r"\$").replace("|", r"\|")


def _claims_table(records: list[dict], link: bool) -> list[str]:
    md = ["| claim | paper | kind | verdict | measured |", "|---|---|---|---|---|"]
    for r in records:
        claim = (
            f"[`{r['id']}`]({r['paper']}.md#{r['id']})" if link else f"[`{r['id']}`](#{r['id']})"
        )
        md.append(
            f"| {claim} | {r['paper']} | {r['kind']} | **{r['verdict']}** | {_text(r['summary'])} |"
        )
    return md


def _run_line(info: dict, records: list[dict]) -> str:
    seconds = sum(r["seconds"] for r in records)
    made = f"made on {info['date']} " if info.get("date") else ""
    env = ""
    if "versions" in info:
        versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items())
        env = f"(Python {info['python']}, {versions}; {info['machine']}) "
    return (
        f"Measured by `python -m theory` at {info['size']}, {made}{env}"
        f"in {seconds:.0f} s of claims. "
        "These verdicts are this run's, generated with the site; the paper's README text above "
        "them was written by people and may quote other runs."
    )


def theory_pages(report: pathlib.Path) -> list:
    """The theory overview and a page per paper, from the report folder `report`."""
    records = json.loads((report / "claims.json").read_text())
    info = report_info(report)
    if not all("figures" in r for r in records):
        raise BuildError(f"{report}/claims.json has no figure lists: rerun python -m theory")
    shutil.copytree(report / "figures", SRC / "theory" / "figures", dirs_exist_ok=True)
    shutil.copyfile(report / "claims.json", SRC / "theory" / "claims.json")
    papers = registry.load_papers(registry.PAPERS)
    overview = [
        "# Theory: the claims, measured",
        "",
        "Each claim of the papers is a function that sets up, measures and decides; its kind says "
        "what its verdict is evidence of: "
        + "; ".join(f"**{k}**, {v}" for k, v in registry.KINDS.items())
        + ". Only the first kind is evidence about a paper.",
        "",
        _run_line(info, records),
        "",
        f"{len(records)} claims: {runner.counts(records)}. The whole measurement of each is in "
        "[claims.json](claims.json).",
        "",
        *_claims_table(records, link=True),
    ]
    nav = [{"Overview": write("theory/index.md", "\n".join(overview) + "\n")}]
    for paper in papers:
        ran = [r for r in records if r["paper"] == paper.name]
        readme_path = ROOT / "theory" / paper.name / "README.md"
        readme = with_assets(
            VERDICT_BLOCK.sub("", readme_path.read_text()).strip(), readme_path.parent
        )
        md = [readme, "", "## Measured by this build", "", _run_line(info, ran), ""]
        if not ran:
            md += ["No claim of this paper is in the report."]
        else:
            md += [f"{len(ran)} claims: {runner.counts(ran)}.", "", *_claims_table(ran, link=False)]
        for r in ran:
            md += [
                "",
                f"### `{r['id']}`: {r['verdict']} {{#{r['id']}}}",
                "",
                f"*Kind*: {r['kind']} ({registry.KINDS[r['kind']]}). "
                f"*Seconds*: {r['seconds']:.1f}.",
                "",
                f"*Statement*: {_text(r['statement'])}",
                "",
                f"*Measured*: {_text(r['summary'])}",
                "",
                "*Expected*:",
                "",
                "```json",
                json.dumps(r["expected"], indent=1),
                "```",
            ]
            md += [f"\n![{r['id']}]({f})" for f in r["figures"]]
        nav.append({paper.title: write(f"theory/{paper.name}.md", "\n".join(md) + "\n")})
    return nav


# ---- notebooks ----------------------------------------------------------------------------------


def notebook_pages() -> list:
    """The committed notebooks, outputs included, as pages (their images beside them)."""
    exporter = MarkdownExporter()
    nav = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        if code and not any(c.get("outputs") for c in code):
            raise BuildError(
                f"{path.name} is committed without outputs: run python -m docs.notebooks"
            )
        if any(o.output_type == "error" for c in code for o in c.get("outputs", [])):
            raise BuildError(f"{path.name} is committed with an error in its outputs")
        body, resources = exporter.from_notebook_node(
            nb, resources={"output_files_dir": f"{path.stem}_files"}
        )
        for name, data in resources["outputs"].items():
            (SRC / "notebooks" / name).parent.mkdir(parents=True, exist_ok=True)
            (SRC / "notebooks" / name).write_bytes(data)
        title = nb.cells[0].source.splitlines()[0].lstrip("# ").strip()
        note = (
            f"\n\n*The notebook `notebooks/{path.name}` as committed, with its outputs "
            "(`python -m docs.notebooks` re-executes it).*\n"
        )
        first, rest = body.split("\n", 1) if body.startswith("# ") else ("", body)
        nav.append({title: write(f"notebooks/{path.stem}.md", first + note + rest)})
    return nav


# ---- API reference ------------------------------------------------------------------------------


def _target(obj: griffe.Object | griffe.Alias):
    """The object an alias points at; None for an alias into another package (e.g. flax)."""
    try:
        return obj.final_target if obj.is_alias else obj
    except griffe.AliasResolutionError:
        return None


def _load() -> griffe.ModulesCollection:
    """seqlab as griffe reads it (the model mkdocstrings renders), aliases resolved."""
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)])
    loader.load("seqlab")
    loader.resolve_aliases(implicit=False, external=False)
    return loader.modules_collection


def _shadowed(module: griffe.Module, name: str) -> bool:
    """Whether `module`'s own function or class `name` is what its package exports as `name`."""
    member = module.members.get(name)
    return member is not None and not member.is_alias and (member.is_function or member.is_class)


def _exports(module: griffe.Module) -> list[str]:
    if module.exports is not None:
        return [str(n) for n in module.exports]
    return [n for n, m in module.members.items() if not n.startswith("_") and not m.is_alias]


DOCUMENTED = (*API, *(module for extra in API.values() for module in extra))


def undocumented(packages=DOCUMENTED) -> list[str]:
    """The public names of `packages` without a docstring: each exported name, the public
    members of an exported module, and the methods a public class defines itself (`HOOKS`
    aside)."""
    collection = _load()
    missing = []
    for package in packages:
        module = collection[package]
        for name in _exports(module):
            obj = module.members.get(name)
            if obj is None:
                missing.append(f"{package}.{name} (in __all__, not defined)")
                continue
            target = _target(obj)
            if target is None:
                continue  # documented where it is defined
            if not target.docstring:
                missing.append(f"{package}.{name}")
            members = target.members.items() if target.is_module or target.is_class else ()
            for member_name, member in members:
                if member_name.startswith("_") or member.is_alias or member.inherited:
                    continue
                if target.is_class and (not member.is_function or member_name in HOOKS):
                    continue
                if not member.docstring:
                    missing.append(f"{package}.{name}.{member_name}")
    return missing


def api_pages() -> list:
    """A page per package of `API`: its docstring, then per defining module its docstring (where
    the equations are) and the names it exports."""
    collection = _load()
    nav = []
    for package in API:
        module = collection[package]
        md = []
        if package in CONTRACTS:  # the contract is the page's title and first part
            readme = CONTRACTS[package]
            md += [with_assets(readme.read_text().strip(), readme.parent), ""]
        md += [f"{'##' if package in CONTRACTS else '#'} `{package}`", "", f"::: {package}"]
        md += ["    options:", "      members: false", "      show_root_heading: false", ""]
        # Defining module -> the paths to render of the names it exports; a name that shadows
        # its module (`seqlab.ops.kda` is a function of `seqlab.ops.kda`, which griffe resolves
        # to the module) is rendered by its full path, and the module's heading takes its id.
        groups: dict[str, list[str]] = {}
        modules: dict[str, griffe.Module] = {}
        external = []
        for name in _exports(module):
            target = _target(module.members[name])
            if target is None:
                external.append((name, module.members[name].target_path))
            elif target.is_module and not _shadowed(target, name):
                groups.setdefault(target.path, [])  # an exported module: all of it
            else:
                owner = target if target.is_module else target.parent
                path = f"{owner.path}.{name}" if target.is_module else f"{package}.{name}"
                groups.setdefault(owner.path, []).append(path)
                modules[owner.path] = owner
        level = 3 if package in CONTRACTS else 2
        for owner, paths in groups.items():
            if not owner.startswith(f"{package}."):
                pass  # defined in another documented package (its page holds the module)
            elif paths:  # the module's docstring (where the equations are), then the names
                doc = modules[owner].docstring
                md += [f"{'#' * level} Module `{owner}` {{#{owner}}}", ""]
                md += [doc.value if doc else "", ""]
            else:
                md += [f"::: {owner}", "    options:", f"      heading_level: {level}"]
                md += [f"      filters: {FILTERS}", ""]
            for path in paths:
                md += [f"::: {path}", "    options:", f"      heading_level: {level + 1}", ""]
        for name, path in external:
            md += [f"`{package}.{name}` is `{path}`, re-exported.", ""]
        for extra in API[package]:
            md += [f"::: {extra}", "    options:", f"      heading_level: {level}"]
            md += [f"      filters: {FILTERS}", ""]
        nav.append({package: write(f"api/{package.removeprefix('seqlab.')}.md", "\n".join(md))})
    return nav


# ---- the site -----------------------------------------------------------------------------------


def build(report: pathlib.Path | None, jobs: int) -> None:
    missing = undocumented()
    if missing:
        raise BuildError("public names without a docstring:\n  " + "\n  ".join(missing))
    if SRC.exists():
        shutil.rmtree(SRC)
    SRC.mkdir(parents=True)
    if report is None:
        start = time.perf_counter()
        print(f"running the claims at quick size ({jobs} processes) ...", flush=True)
        report = run_theory(ROOT / "build" / "theory-report", jobs)
        print(f"  theory: {time.perf_counter() - start:.0f} s", flush=True)
    nav = [
        {"Home": home_page()},
        {"Guides": guide_pages()},
        {"Theory": theory_pages(report)},
        {"Notebooks": notebook_pages()},
        {"API reference": api_pages()},
    ]
    start = time.perf_counter()
    config = load_config(config_file=str(CONFIG), strict=True, nav=nav)
    try:
        mkdocs_build(config)
    except Abort as e:
        raise BuildError(f"mkdocs: {e}") from e
    print(f"  mkdocs: {time.perf_counter() - start:.0f} s; the site: {SITE}/index.html", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m docs.build", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--report",
        type=pathlib.Path,
        help="a `python -m theory --out DIR` folder to show instead of running the claims",
    )
    parser.add_argument("--jobs", type=int, default=2, help="claim processes at once (default 2)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be positive, got {args.jobs}")
    if args.report is not None and not (args.report / "claims.json").is_file():
        parser.error(f"--report {str(args.report)!r} holds no claims.json")
    try:
        build(args.report, args.jobs)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
