"""Tests of seqlab.train.metrics: records, config.json, resume truncation, TensorBoard events."""

import json

from seqlab.train.metrics import MetricsWriter, read_metrics


def test_records_resume_and_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path, resume_step=None)
    writer.write_config({"seed": 3, "model": {"name": "gdn"}})
    for step in (2, 4, 6):
        writer.write(step, {"loss": 1.0 / step})
    writer.close()
    assert json.loads((tmp_path / "config.json").read_text()) == {
        "seed": 3,
        "model": {"name": "gdn"},
    }
    assert read_metrics(tmp_path) == [{"step": s, "loss": 1.0 / s} for s in (2, 4, 6)]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    resumed = MetricsWriter(tmp_path, resume_step=4)  # a checkpoint at 4: step 6 is replayed
    resumed.write(6, {"loss": 0.5})
    resumed.close()
    assert read_metrics(tmp_path) == [
        {"step": 2, "loss": 0.5},
        {"step": 4, "loss": 0.25},
        {"step": 6, "loss": 0.5},
    ]

    fresh = MetricsWriter(tmp_path, resume_step=None)  # no checkpoint: start over
    fresh.close()
    assert read_metrics(tmp_path) == []
