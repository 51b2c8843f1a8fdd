"""The claim registry and `python -m theory`: schema of claims.json, report, exit statuses."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from matplotlib.figure import Figure

from theory import registry, runner

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIELDS = set(runner.FIELDS)
assert {"id", "paper", "kind", "statement", "measured", "expected", "verdict", "seconds"} <= FIELDS


def _toy_paper() -> registry.Paper:
    """A paper whose claims hold, fail, and raise, measured from their context."""
    paper = registry.Paper("toy", "A toy paper")

    @paper.claim("toy_holds", "A uniform draw lies in [0, 1).", kind="paper")
    def holds(ctx):
        value = float(np.random.default_rng(ctx.size(1, 2)).uniform())
        path = ctx.figure()
        fig = Figure(figsize=(2, 2))
        fig.subplots().plot([0, value])
        fig.savefig(path)
        return registry.Outcome(
            measured={"value": np.float32(value), "draws": np.arange(2)},
            expected={"range": [0, 1]},
            verdict=registry.verdict(0 <= value < 1),
            summary=f"draw {value:.3g} (holds iff in [0, 1))",
            figures=(path,),
        )

    @paper.claim("toy_fails", "One equals two.", kind="construction")
    def fails(ctx):
        return registry.Outcome({"lhs": 1}, {"rhs": 2}, registry.verdict(1 == 2), "1 | 2")

    @paper.claim("toy_raises", "This claim cannot run.", kind="consistency")
    def raises(ctx):
        raise RuntimeError("no such device")

    return paper


def _read(out):
    return json.loads((out / "claims.json").read_text())


def test_a_failed_claim_is_a_finding_not_an_error(tmp_path, capsys):
    status = runner.run([_toy_paper()], out=tmp_path, only=["toy_holds", "toy_fails"])
    assert status == 0
    records = _read(tmp_path)
    assert [r["id"] for r in records] == ["toy_holds", "toy_fails"]
    assert all(set(r) == FIELDS for r in records)
    assert [r["verdict"] for r in records] == ["holds", "fails"]
    assert records[0]["measured"] == {
        "value": pytest.approx(records[0]["measured"]["value"]),
        "draws": [0, 1],
    }
    assert (tmp_path / "figures" / "toy_holds.png").is_file()
    assert [r["kind"] for r in records] == ["paper", "construction"]
    assert records[0]["summary"].startswith("draw ")
    report = (tmp_path / "report.md").read_text()
    assert "![toy_holds](figures/toy_holds.png)" in report
    assert "**fails**" in report
    # Grouped by kind, the papers' results first; per claim its statement, expectation, summary.
    assert report.index("## paper: a result") < report.index("## construction: true by")
    assert "One equals two." in report and 'Expected: `{"rhs": 2}`' in report
    assert "| `toy_fails` | toy | **fails** | 1 \\| 2 |" in report  # "|" cannot break the table
    table = capsys.readouterr().out
    assert "toy_fails" in table and "fails" in table


def test_a_raising_claim_makes_the_run_fail_but_the_others_run(tmp_path, capsys):
    status = runner.run([_toy_paper()], out=tmp_path)  # all claims of the paper
    assert status == 1
    records = {r["id"]: r for r in _read(tmp_path)}
    assert set(records) == {"toy_holds", "toy_fails", "toy_raises"}
    assert records["toy_raises"]["verdict"] == "inconclusive"
    assert records["toy_raises"]["measured"] == {"error": "RuntimeError: no such device"}
    assert records["toy_holds"]["verdict"] == "holds"
    assert "no such device" in capsys.readouterr().err


def test_only_selects_by_paper_and_id_and_rejects_unknown_names(tmp_path, capsys):
    paper = _toy_paper()
    assert [c.id for c in registry.select([paper], ["toy"])] == [c.id for c in paper.claims]
    assert [c.id for c in registry.select([paper], ["toy_fails"])] == ["toy_fails"]
    assert runner.run([paper], out=tmp_path, only=["toy_fails", "nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "claims.json").exists()


def test_registry_rejects_bad_verdicts_kinds_summaries_and_duplicate_ids():
    with pytest.raises(ValueError, match="verdict must be one of"):
        registry.Outcome({}, {}, "probably", "x")
    with pytest.raises(ValueError, match="summary must be one non-empty line"):
        registry.Outcome({}, {}, "holds", "two\nlines")
    with pytest.raises(ValueError, match="summary must be one non-empty line"):
        registry.Outcome({}, {}, "holds", "")
    paper = _toy_paper()
    with pytest.raises(ValueError, match="kind must be one of"):
        paper.claim("toy_new", "A claim.", kind="folklore")
    with pytest.raises(ValueError, match="already registered"):
        paper.claim("toy_fails", "again", kind="paper")(lambda ctx: None)
    assert registry.verdict(True, decidable=False) == "inconclusive"


def test_every_listed_paper_registers_claims():
    papers = registry.load_papers()
    assert [p.name for p in papers] == list(registry.PAPERS)
    assert all(p.claims for p in papers)
    registry.select(papers)  # ids are unique across papers


def test_readme_verdicts_are_written_from_the_run(tmp_path):
    (tmp_path / "toy").mkdir()
    readme = tmp_path / "toy" / "README.md"
    readme.write_text("# toy\n\nHow the claims are measured.\n")
    paper = _toy_paper()
    paper.claims.pop()  # toy_raises: a paper with a raising claim gets no README (below)
    kw = dict(out=tmp_path / "report", readmes=tmp_path, command="python -m toy --readme")
    assert runner.run([paper], **kw) == 0
    text = readme.read_text()
    assert text.startswith("# toy\n\nHow the claims are measured.\n\n## Verdicts at quick size")
    assert "written by `python -m toy --readme`" in text
    assert "| `toy_holds` | paper | **holds** | draw " in text
    assert "| `toy_fails` | construction | **fails** | 1 \\| 2 |" in text
    # A second run replaces the block in place, and a full-size run adds its own block.
    readme.write_text(text + "\nNotes after the block.\n")
    assert runner.run([paper], **kw) == 0
    assert runner.run([paper], full=True, **kw) == 0
    text = readme.read_text()
    assert text.count("<!-- verdicts quick") == 1 and text.count("<!-- verdicts full") == 1
    assert "Notes after the block." in text
    # Not all claims ran (--only, or one raised): the README is left as it was.
    assert runner.run([paper], only=["toy_fails"], **kw) == 0
    assert runner.run([_toy_paper()], **kw) == 1
    assert readme.read_text() == text


def test_each_papers_readme_has_a_generated_verdict_table_of_its_claims():
    """The README's quick-size table lists the paper's claims with their kinds, as registered."""
    for paper in registry.load_papers():
        text = (runner.README_DIR / paper.name / "README.md").read_text()
        begin = "<!-- verdicts quick: generated, do not edit -->"
        assert begin in text, paper.name
        block = text.split(begin, 1)[1].split("<!-- /verdicts quick -->", 1)[0]
        assert (
            f"`python -m theory.{paper.name} --readme" in block
            or "`python -m theory --readme" in block
        )
        rows = [line.split(" | ")[:2] for line in block.splitlines() if line.startswith("| `")]
        assert rows == [[f"| `{c.id}`", c.kind] for c in paper.claims], paper.name


def test_a_claim_measures_the_same_twice_from_the_same_seed(tmp_path):
    """The quick run is seeded: a claim's record does not depend on the run (nor on the machine)."""
    (claim,) = registry.select(
        registry.load_papers(["ssm_bottleneck"]), ["polar_zero_channel_forgets"]
    )
    first, _ = runner.run_claim(claim, out_dir=tmp_path / "a", full=False, seed=0)
    second, _ = runner.run_claim(claim, out_dir=tmp_path / "b", full=False, seed=0)
    drop = ("seconds",)
    assert {k: v for k, v in first.items() if k not in drop} == {
        k: v for k, v in second.items() if k not in drop
    }


def test_main_rejects_an_unknown_claim_name(tmp_path, capsys):
    flag_values = flags.FlagValues()  # absl's global FLAGS may already hold another program's --out
    main = runner.main_for(registry.PAPERS, flag_values)
    status = main(flag_values(["theory", "--only=no_such_claim", f"--out={tmp_path}"]))
    assert status != 0
    err = capsys.readouterr().err
    assert "no_such_claim" in err and "polar_zero_channel_forgets" in err


def test_cli_end_to_end(tmp_path):
    out = tmp_path / "report"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "theory", "--only", "polar_zero_channel_forgets", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (record,) = _read(out)
    assert set(record) == FIELDS
    assert record["id"] == "polar_zero_channel_forgets"
    assert record["paper"] == "ssm_bottleneck"
    assert record["verdict"] in registry.VERDICTS
    assert isinstance(record["seconds"], float)
    assert (out / "figures" / "polar_zero_channel_forgets.png").stat().st_size > 0
    assert "figures/polar_zero_channel_forgets.png" in (out / "report.md").read_text()
    assert "polar_zero_channel_forgets" in proc.stdout  # the printed table


def _mamba_lm():
    from seqlab.modules.lm import LanguageModel

    model = LanguageModel(vocab_size=23, d_model=16, pattern="mm", mamba={"d_state": 4})
    params = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))["params"]
    return model, params


def test_model_flag_runs_the_claims_that_take_a_model(tmp_path, capsys):
    """`--model` loads a workdir (or a Hugging Face directory), runs only the `on_model` claims,
    hands them the model, and writes no README; a path that is neither exits 2."""
    from seqlab.train.workdir import save_model

    paper = registry.Paper("toy", "A toy paper")

    @paper.claim("toy_own", "Measures only its own model.", kind="paper")
    def own(ctx):
        raise AssertionError("not on_model: must not run with --model")

    @paper.claim("toy_given", "Reads the given model.", kind="construction", on_model=True)
    def given(ctx):
        vocab = ctx.model.model.vocab_size
        return registry.Outcome({"vocab": vocab}, {"vocab": 23}, registry.verdict(vocab == 23), "v")

    _, params = _mamba_lm()
    block = {
        "name": "lm",
        "lm": {"vocab_size": 23, "d_model": 16, "pattern": "mm", "mamba": {"d_state": 4}},
        "dtype": "float32",
    }
    save_model(tmp_path / "wd", block, params)
    status = runner.run([paper], out=tmp_path / "out", model=str(tmp_path / "wd"))
    assert status == 0
    assert [(r["id"], r["verdict"]) for r in _read(tmp_path / "out")] == [("toy_given", "holds")]
    assert runner.run([paper], out=tmp_path / "o2", model=str(tmp_path / "none")) == 2
    assert "has no config.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="measures a given model"):
        registry.select([paper], ["toy_own"], on_model=True)
