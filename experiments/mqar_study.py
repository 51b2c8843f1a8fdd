"""MQAR recall accuracy against the number of key-value pairs: default vs polarized Mamba at 2 and
4 layers, and Gated DeltaNet vs Mamba-2 (the polarization study of Wang et al., arXiv 2501.00658,
at a size two CPU cores finish).

    python -m experiments.mqar_study --out=/tmp/mqar_study [--steps=N] [--seed=S] \
        [--only=mamba-2,gdn-2]

launches `experiments/configs/mqar.py:model=NAME,layers=L` once per run (each in its own workdir
`OUT/NAME-L`, resumed if it exists), reads the last evaluation of every `eval/kvN/accuracy`, and
writes `OUT/table.md` (a markdown table: one row per run, one column per kv count) and
`OUT/mqar_study.png` (accuracy against kv pairs). `--steps` and `--seed` override `total_steps`
and `seed` of every run.
"""

import pathlib
import re
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from absl import app, flags

from experiments.plot import save_figure
from seqlab.train.metrics import read_metrics

RUNS = (
    ("mamba", 2),
    ("polar_mamba", 2),
    ("mamba", 4),
    ("polar_mamba", 4),
    ("mamba2", 2),
    ("gdn", 2),
)
_OUT = flags.DEFINE_string("out", "mqar_study", "folder of the runs, the table and the plot")
_STEPS = flags.DEFINE_integer("steps", None, "total_steps of every run (default: the config's)")
_ONLY = flags.DEFINE_list("only", None, "run only these NAME-L (e.g. mamba-2,gdn-2)")
_SEED = flags.DEFINE_integer("seed", 0, "config.seed of every run (data and initialization)")


def final_accuracies(workdir) -> dict[int, float]:
    """`{kv pairs: accuracy}` from the last record of `workdir/metrics.jsonl` with evaluations."""
    evaluated = [r for r in read_metrics(workdir) if any(k.startswith("eval/") for k in r)]
    if not evaluated:
        raise ValueError(f"workdir {workdir} has no evaluation records")
    last = evaluated[-1]
    found = (re.fullmatch(r"eval/kv(\d+)/accuracy", k) for k in last)
    return {int(m.group(1)): last[m.group(0)] for m in found if m}


def table(results: dict[str, dict[int, float]], steps: dict[str, int]) -> str:
    """A markdown table: one row per run, accuracy (%) per kv count."""
    counts = sorted({c for acc in results.values() for c in acc})
    lines = [
        "| run | steps | " + " | ".join(f"kv {c}" for c in counts) + " |",
        "| --- | --- | " + " | ".join("---" for _ in counts) + " |",
    ]
    for name, acc in results.items():
        cells = " | ".join(f"{100 * acc[c]:.1f}" if c in acc else "" for c in counts)
        lines.append(f"| {name} | {steps[name]} | {cells} |")
    return "\n".join(lines) + "\n"


def figure(results: dict[str, dict[int, float]], out: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, acc in results.items():
        counts = sorted(acc)
        style = "-" if name.startswith("polar") else "--"
        ax.plot(counts, [acc[c] for c in counts], style, marker="o", label=name)
    ax.set(xscale="log", xlabel="key-value pairs", ylabel="MQAR accuracy", ylim=(-0.02, 1.02))
    ax.set_xticks(sorted({c for acc in results.values() for c in acc}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    save_figure(fig, (ax,), out, legend_size=8)


def main(argv):
    del argv
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(m, n) for m, n in RUNS if not _ONLY.value or f"{m}-{n}" in _ONLY.value]
    results, steps = {}, {}
    for model, layers in runs:
        name = f"{model}-{layers}"
        command = [
            sys.executable,
            "-m",
            "experiments.launch",
            f"--config=experiments/configs/mqar.py:model={model},layers={layers}",
            f"--workdir={out / name}",
        ]
        if _STEPS.value:
            command.append(f"--config.total_steps={_STEPS.value}")
        if _SEED.value:
            command.append(f"--config.seed={_SEED.value}")
        print(" ".join(command), flush=True)
        done = subprocess.run(command, cwd=pathlib.Path(__file__).resolve().parents[1])
        if done.returncode:  # e.g. a non-finite loss: report the run, keep its last evaluation
            print(f"{name} exited with status {done.returncode}", flush=True)
        results[name] = final_accuracies(out / name)
        steps[name] = read_metrics(out / name)[-1]["step"]
        print(name, results[name], flush=True)
    (out / "table.md").write_text(table(results, steps))
    figure(results, out / "mqar_study.png")
    print(table(results, steps))


if __name__ == "__main__":
    app.run(main)
