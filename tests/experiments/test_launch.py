"""Tests of `python -m experiments.launch`: every config runs with `runlocal`; a 20-step lm run
prints a short log; sharded training on the 4 fake CPU devices matches one device; bad configs
fail before compiling; a non-finite loss stops the run at its step and keeps the good checkpoint;
a run killed with SIGKILL, then stopped with SIGTERM, its latest checkpoint damaged, and resumed
twice logs exactly the losses of an uninterrupted run; a workdir whose checkpoints are all damaged
exits with a message naming it."""

import importlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from experiments import launch, plot
from experiments.configs import lm as lm_config
from experiments.configs import mqar as mqar_config
from seqlab.train.checkpoint import STEP_METADATA, Checkpointer
from seqlab.train.metrics import read_metrics
from seqlab.train.step import create_state
from tests.conftest import assert_close

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _check_run(workdir, total: int, log_every: int):
    records = read_metrics(workdir)
    assert [r["step"] for r in records] == list(range(log_every, total + 1, log_every))
    assert all(np.isfinite(r["loss"]) for r in records)
    assert any(k.startswith("eval/") for k in records[-1])
    assert (workdir / "config.json").is_file()
    assert list((workdir / "tensorboard").glob("events.out.tfevents.*"))
    ckpt = Checkpointer(workdir / "checkpoints", every=1, keep=1)
    assert ckpt.latest_step() == total
    ckpt.close()
    return records


CONFIGS = sorted(
    p.stem
    for p in (ROOT / "experiments" / "configs").glob("*.py")
    if p.stem not in {"__init__", "base"}
)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_has_the_contract_keys_and_a_valid_runlocal(name):
    """DESIGN.md 3.6: every config accepts `runlocal` and has total_steps, seed, checkpoint_every;
    its runlocal variant passes validation (model, data, optimizer, mesh) and is a few steps."""
    module = importlib.import_module(f"experiments.configs.{name}")
    config = module.get_config("runlocal")
    for key in ("total_steps", "seed", "checkpoint_every"):
        assert key in config
    assert config.total_steps <= 20
    launch.build(config)  # raises ValueError for anything invalid; compiles nothing
    assert "python -m experiments.launch" in module.__doc__


@pytest.mark.parametrize(
    "model", ["mamba", *(pytest.param(m, marks=pytest.mark.slow) for m in mqar_config.MODELS[1:])]
)
def test_mqar_runlocal(tmp_path, model):
    config = mqar_config.get_config(f"model={model},runlocal")
    assert launch.train(config, str(tmp_path)) == {"status": "done", "step": config.total_steps}
    _check_run(tmp_path, config.total_steps, config.log_every)
    plot.plot([str(tmp_path)], str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 0


def _others_info(log: str) -> list[str]:
    """The INFO lines of `log` (absl format, `I...`) not from the project's own loop.py or
    checkpoint.py: orbax's and jax's, quiet at the default verbosity (their warnings show)."""
    own = re.compile(r"^I\d{4} [\d:.]+ +\d+ (loop|checkpoint)\.py:\d+\]")
    return [line for line in log.splitlines() if line[:1] == "I" and not own.match(line)]


def _command(workdir, *flags) -> list[str]:
    return [sys.executable, "-m", "experiments.launch", f"--workdir={workdir}", *flags]


def test_lm_runlocal_bytes_from_the_command_line_prints_a_short_log(tmp_path):
    """20 steps: the progress lines, evaluations and checkpoint lines, under 40 lines in all
    (orbax's INFO lines, ~190 before, are quiet at the default verbosity); the run is complete.
    Then every checkpoint damaged: a relaunch exits 1 with a message naming the folder."""
    workdir = tmp_path / "bytes"
    command = _command(workdir, "--config=experiments/configs/lm.py:runlocal")
    done = subprocess.run(
        [*command, "--config.total_steps=20"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) < 40, "\n".join(lines)
    assert "step 20/20 loss" in done.stderr and "saved checkpoint of step 20" in done.stderr
    assert _others_info(done.stderr) == []
    _check_run(workdir, 20, lm_config.get_config("runlocal").log_every)

    for step_dir in (workdir / "checkpoints").iterdir():
        (step_dir / STEP_METADATA).write_text("{garbage")
    done = subprocess.run(
        [*command, "--config.total_steps=24"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1
    assert f"checkpoint error: no checkpoint in {workdir / 'checkpoints'} reads back" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # the token-file data path itself is tested in tests/train/test_data.py
def test_lm_runlocal_token_file(tmp_path):
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 300, 4000).astype(np.int32))
    config = lm_config.get_config("data=tokens,model=attention,runlocal")  # compiles fastest
    with config.unlocked():
        config.data.update(path=str(tmp_path / "ids.npy"), vocab_size=300)
    assert launch.train(config, str(tmp_path / "tokens"))["status"] == "done"
    _check_run(tmp_path / "tokens", config.total_steps, config.log_every)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("model.name", "transformer", "model.name"),
        ("total_steps", 0, "config.total_steps"),
        ("batch_size", 6, "divisible by the 4 devices"),
        ("data.seq_len", -3, "config.data.seq_len"),
        ("data.name", "wiki", "data.name"),
        ("model.d_model", 0, "model.d_model"),
        ("optimizer.name", "lion", "optimizer.name"),
        ("mesh.fsdp", 3, "mesh.fsdp"),
    ],
)
def test_bad_config_fails_before_anything_compiles(tmp_path, key, value, match):
    config = mqar_config.get_config("runlocal")
    parent, _, leaf = key.rpartition(".")
    block = launch.get(config, parent) if parent else config
    with config.unlocked():
        block[leaf] = value
    with pytest.raises(ValueError, match=match):
        launch.train(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # failed before the checkpointer or writer started


def _losses(workdir):
    return [(r["step"], r["loss"]) for r in read_metrics(workdir)]


def test_sharded_training_matches_one_device(tmp_path):
    """float64 runs on meshes (1, 1) and (2, 2) (batch split 4 ways, parameters and optimizer
    state sharded 2 ways): the same losses and parameters. The attention model compiles fastest;
    the placement does not depend on the mixer."""
    params = {}
    for data, fsdp in ((1, 1), (2, 2)):
        config = mqar_config.get_config("model=attention,runlocal")
        config.model.dtype = "float64"
        config.mesh.data, config.mesh.fsdp = data, fsdp
        config.log_every = 1
        workdir = tmp_path / f"{data}x{fsdp}"
        launch.train(config, str(workdir))
        ckpt = Checkpointer(workdir / "checkpoints", every=1, keep=1)
        params[data, fsdp] = ckpt.restore(_abstract_state(config)).params
        ckpt.close()
        if (data, fsdp) != (1, 1):
            expected, got = _losses(tmp_path / "1x1"), _losses(workdir)
            assert [s for s, _ in got] == [s for s, _ in expected]
            assert_close(np.array([v for _, v in got]), np.array([v for _, v in expected]))
            assert_close(params[data, fsdp], params[1, 1])


def _abstract_state(config):
    """The shapes and dtypes of the run's state, on one device."""
    config = config.copy_and_resolve_references()
    config.mesh.data, config.mesh.fsdp = 1, 1
    built = launch.build(config, jax.devices()[:1])
    init = lambda key: create_state(built.model, built.tx, key, config.data.seq_len)  # noqa: E731
    return jax.eval_shape(init, jax.random.key(0))


def test_nonfinite_loss_stops_at_its_step_and_keeps_the_good_checkpoint(tmp_path, caplog):
    config = mqar_config.get_config("model=attention,runlocal")
    config.total_steps = 4
    assert launch.train(config, str(tmp_path))["status"] == "done"
    good = read_metrics(tmp_path)
    # Resume with an absurd learning rate: the update of step 5 sends the parameters to ~1e30.
    config.total_steps = 8
    config.optimizer.learning_rate = 1e30
    result = launch.train(config, str(tmp_path))
    assert result == {"status": "nonfinite", "step": 6}
    assert "not finite at step 6" in caplog.text
    assert read_metrics(tmp_path) == good + read_metrics(tmp_path)[len(good) :]
    assert all(r["step"] < 6 for r in read_metrics(tmp_path))
    ckpt = Checkpointer(tmp_path / "checkpoints", every=1, keep=1)
    assert ckpt.latest_step() == 4
    state = ckpt.restore(_abstract_state(config))
    ckpt.close()
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.params))


# --- subprocesses: preemption -------------------------------------------------------------------

TOTAL = 200
_PREEMPT_FLAGS = [
    "--config=experiments/configs/mqar.py:model=attention,runlocal",
    f"--config.total_steps={TOTAL}",
    "--config.checkpoint_every=20",
    "--config.log_every=1",
    "--config.eval_every=100",
    "--config.data.seq_len=64",
    "--config.batch_size=32",
]


def _launch(workdir, *flags) -> subprocess.Popen:
    """Start a run; its log goes to `workdir.log` (a pipe nobody reads would fill and block it)."""
    command = _command(workdir, *_PREEMPT_FLAGS, *flags)
    with open(f"{workdir}.log", "a") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=ROOT, env=os.environ.copy(), stdout=log, stderr=log)


def _log(workdir) -> str:
    return pathlib.Path(f"{workdir}.log").read_text()


def _committed(workdir) -> list[int]:
    folder = workdir / "checkpoints"
    return (
        sorted(int(p.name) for p in folder.glob("*") if p.name.isdigit()) if folder.exists() else []
    )


def _signal_after_checkpoint(proc, workdir, sig, after: int, timeout: float = 300) -> None:
    """Send `sig` once a checkpoint newer than step `after` is committed (the run still going)."""
    deadline = time.monotonic() + timeout
    while not [s for s in _committed(workdir) if s > after]:
        assert proc.poll() is None, _log(workdir)[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be interrupted: make it longer"
    proc.send_signal(sig)


def test_sigkill_and_sigterm_then_resume_log_the_losses_of_an_uninterrupted_run(tmp_path):
    """The last resume finds its latest checkpoint truncated: it resumes one interval earlier,
    replays, and still logs the losses of the reference (run with `--verbosity=1`, which shows
    orbax's own lines, quiet in the other runs)."""
    reference = _launch(tmp_path / "reference", "--verbosity=1")
    run = _launch(tmp_path / "run")
    _signal_after_checkpoint(run, tmp_path / "run", signal.SIGKILL, after=0)
    assert run.wait() == -signal.SIGKILL
    killed_at = _committed(tmp_path / "run")[-1]

    run = _launch(tmp_path / "run")  # resumes from `killed_at`
    _signal_after_checkpoint(run, tmp_path / "run", signal.SIGTERM, after=killed_at)
    assert run.wait() == 0, _log(tmp_path / "run")[-3000:]
    assert "SIGTERM: saved the checkpoint of step" in _log(tmp_path / "run")
    stopped_at = read_metrics(tmp_path / "run")[-1]["step"]
    assert _committed(tmp_path / "run")[-1] == stopped_at < TOTAL
    earlier = _committed(tmp_path / "run")[-2]

    for data in (tmp_path / "run" / "checkpoints" / str(stopped_at)).glob("default/d/*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    run = _launch(tmp_path / "run")
    assert run.wait() == 0 and reference.wait() == 0
    log = _log(tmp_path / "run")
    assert f"skipped the damaged checkpoint of step {stopped_at} (ValueError: OUT_OF_RANGE" in log
    assert f"resumed from the checkpoint of step {earlier}" in log
    assert (tmp_path / "run" / "checkpoints" / f"{stopped_at}.damaged").is_dir()
    assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")  # exact
    assert [s for s, _ in _losses(tmp_path / "run")] == list(range(1, TOTAL + 1))
    assert _others_info(log) == [] and len(_others_info(_log(tmp_path / "reference"))) > 10


def test_config_error_message_from_the_command_line(tmp_path):
    command = [
        sys.executable,
        "-m",
        "experiments.launch",
        f"--workdir={tmp_path}",
        "--config=experiments/configs/mqar.py:runlocal",
        "--config.batch_size=6",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "config error: config.batch_size = 6 must be divisible by the 4 devices" in done.stderr
