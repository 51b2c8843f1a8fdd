"""What a run leaves in its workdir: `config.json`, `metrics.jsonl` and TensorBoard events.

`metrics.jsonl` holds one JSON object per logged step, `{"step": ..., "loss": ..., ...}`, in step
order. On resume from a checkpoint at step `s`, `MetricsWriter(workdir, resume_step=s)` drops the
lines after `s` (the steps a killed run logged but did not checkpoint), so the file of a resumed
run reads as that of an uninterrupted one. TensorBoard events go to `workdir/tensorboard`
(tensorboardX); the events of the replayed steps appear twice there, the later ones last.
"""

import json
import pathlib

from tensorboardX import SummaryWriter

METRICS = "metrics.jsonl"
CONFIG = "config.json"


def read_metrics(workdir) -> list[dict]:
    """The records of `workdir/metrics.jsonl` (empty when there is none)."""
    path = pathlib.Path(workdir) / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """Appends step records to `metrics.jsonl` and TensorBoard scalars.

    Attributes:
      workdir: the run's folder (created when missing).
      resume_step: the step the run restarts from; records after it are dropped (None: none kept,
        the file starts empty).
    """

    def __init__(self, workdir, *, resume_step: int | None):
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        records = read_metrics(workdir) if resume_step is not None else []
        kept = [r for r in records if r["step"] <= resume_step]
        path = self.workdir / METRICS
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = path.open("a")
        self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

    def write_config(self, config: dict) -> None:
        """`config.json`: the run's config as plain JSON."""
        text = json.dumps(config, indent=2, sort_keys=True, default=str)
        (self.workdir / CONFIG).write_text(text + "\n")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """One record `{"step": step, **scalars}` (float values), flushed at once."""
        record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for name, value in record.items():
            if name != "step":
                self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        """Flush and close the JSON-lines file and the TensorBoard writer."""
        self._file.close()
        self._tb.close()
