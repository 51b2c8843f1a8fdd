"""Loss and accuracy curves of runs, from their `metrics.jsonl`, to a PNG.

    python -m experiments.plot WORKDIR [WORKDIR ...] [--out curves.png]

Left panel: training loss against step, one line per workdir. Right panel: every evaluation
accuracy (`eval/.../accuracy`) against step, one colour per workdir and one line style per
evaluation set. The label of a run is its workdir's folder name.
"""

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from absl import app, flags

from seqlab.train.metrics import read_metrics


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """`(steps, values)` of the records that have `key`."""
    rows = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def save_figure(fig, axes, out, *, legend_size: int) -> None:
    """Grid and legend on every one of `axes`, then `fig` written to the PNG `out` and closed."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot(workdirs: list[str], out: str) -> None:
    """Draw the curves of `workdirs` into the PNG `out` (see the module docstring)."""
    runs = {pathlib.Path(w).name: read_metrics(w) for w in workdirs}
    empty = [w for w, (name, records) in zip(workdirs, runs.items(), strict=True) if not records]
    if empty:
        raise ValueError(f"workdirs without metrics.jsonl records: {empty}")
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    styles = ("-", "--", ":", "-.")
    for i, (name, records) in enumerate(runs.items()):
        color = f"C{i % 10}"  # one colour per run, one line style per evaluation set
        ax_loss.plot(*series(records, "loss"), color=color, label=name)
        keys = sorted({k for r in records for k in r if k.startswith("eval/") and "accuracy" in k})
        for j, key in enumerate(keys):
            label = f"{name} {key[5:-9] or 'eval'}"
            steps, values = series(records, key)
            ax_acc.plot(steps, values, styles[j % 4], color=color, marker="o", label=label)
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(-0.02, 1.02), title="evaluation accuracy")
    save_figure(fig, (ax_loss, ax_acc), out, legend_size=7)


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("give at least one WORKDIR")
    plot(argv[1:], _OUT.value)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    # Defined only when run: `experiments.mqar_study` imports `save_figure` and has its own --out.
    _OUT = flags.DEFINE_string("out", "curves.png", "the PNG to write")
    app.run(main)
