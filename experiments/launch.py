"""The one training entry point (DESIGN.md 3.6).

    python -m experiments.launch --config=experiments/configs/NAME.py[:ARG] --workdir=DIR \
        [--config.KEY=VALUE ...] [--distributed]
    python -m experiments.launch --config=... --compile_only [--topology=v5e:4x8]

Validates the config (unknown model or task, non-positive sizes, a batch the devices do not divide)
before anything compiles, exiting with "config error: ..." for what fails there; builds the model
from the registry (`seqlab.train.models`), the data and the optimizer, and hands them to
`seqlab.train.Trainer`, which places parameters, optimizer state and batches on a
`(data, fsdp, seq)` device mesh (`--config.mesh.seq=N` splits the time axis of every sequence over N
devices: sequence parallelism); runs jit-compiled train and eval steps; logs a progress line (step,
loss, steps/s, tokens/s, ETA), `metrics.jsonl`, `config.json` and TensorBoard events in the workdir;
saves orbax checkpoints every `checkpoint_every` steps and at the end. Launching again on the same
workdir resumes from the newest checkpoint that reads back completely (a damaged newer one is named
in one log line and kept aside as `checkpoints/STEP.damaged`) and logs the same losses as an
uninterrupted run; when checkpoints exist but none reads back, it exits 1 with "checkpoint error:
..." naming the folder. SIGTERM saves a checkpoint and exits 0; a non-finite loss or gradient stops
the run (exit 1) with the step named, leaving the checkpoints of the good steps untouched (the
metrics stay on the device between reads, every `log_every` steps and before every save, and
name the first bad step exactly; no host sync per step). `--distributed` calls
`jax.distributed.initialize()` first (several hosts). Other errors raised during training are not
config errors: they propagate with their own traceback.

Logs: by default the progress line, evaluations, one line per checkpoint saved, the resume, and
warnings and errors (the loggers `seqlab` and `experiments` at INFO, every other library at
WARNING: orbax's and jax's INFO lines stay quiet); absl's `--verbosity=1` (or `-v 1`) shows
everything.

Fine-tuning: a config with `init_from = WORKDIR` starts (step 0, fresh optimizer) from the
parameters of that run's latest checkpoint; parameters the source lacks (LoRA factors) keep their
initialization. A run that has checkpoints of its own resumes from them and never reads
`init_from`. `optimizer.trainable` restricts the updates to some parameters (`seqlab.train.optim`).

`--compile_only` compiles the train and eval steps for the run's mesh and prints, per device,
their argument, output, temporary and peak HBM bytes against the chip's HBM, the FLOPs and HBM
bytes of the compiled cost analysis, and the compile times (`seqlab.train.aot`); it exits 1 when a
step does not compile or does not fit. With `--topology` (a TPU topology as jax names it,
`v5e:4x8`, `v5p:2x4x4`, `v6e:16x16`: every host's chips, from this one process) it compiles for
that TPU slice from any machine, with libtpu installed (`pip install -e ".[tpu]"`); no TPU,
data, workdir or checkpoint is needed.
"""

import logging
import pathlib
import sys
from typing import NamedTuple

import flax.linen as nn
import optax
from absl import app, flags
from jax.sharding import Mesh
from ml_collections import config_flags

from seqlab.ops.checks import check_positive_int
from seqlab.train import Trainer, aot, build_model, make_datasets, make_optimizer, make_schedule
from seqlab.train import mesh as mesh_lib
from seqlab.train.checkpoint import CheckpointError
from seqlab.train.data import Dataset, vocab_size
from seqlab.train.step import check_sequence_parallel

_POSITIVE = (
    "total_steps",
    "batch_size",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "eval_every",
    "eval_batches",
    "data.seq_len",
)
# The run-level keys `Trainer.run` takes.
RUN_KEYS = (
    "total_steps",
    "seed",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "eval_every",
    "eval_batches",
)
# The loggers of the project's own lines, at INFO by default (`quiet_logs`).
PROJECT_LOGGERS = ("seqlab", "experiments")

log = logging.getLogger("experiments.launch")


def quiet_logs(verbosity: int) -> None:
    """At absl's default `verbosity` 0: the root logger (absl's handler, and so orbax's and jax's
    lines) at WARNING, the `PROJECT_LOGGERS` at INFO. Any other verbosity is left as absl set it
    (above 0: everything, below: warnings and errors only)."""
    if verbosity == 0:
        logging.getLogger().setLevel(logging.WARNING)
        for name in PROJECT_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)


def get(config, dotted: str):
    """`config["a"]["b"]` for `dotted = "a.b"`."""
    for part in dotted.split("."):
        config = config[part]
    return config


def validate(config) -> None:
    """Raise `ValueError` naming the key of the first bad run-level size (see `_POSITIVE`);
    the model, data and optimizer blocks are checked by their builders."""
    for key in _POSITIVE:
        check_positive_int(f"config.{key}", get(config, key))
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or config.seed < 0:
        raise ValueError(f"config.seed must be an int >= 0, got {config.seed!r}")
    init_from = config.get("init_from", "")
    if init_from and not (pathlib.Path(init_from) / "checkpoints").is_dir():
        raise ValueError(f"config.init_from = {init_from!r} is not a workdir with checkpoints")


class Build(NamedTuple):
    """What a validated config builds, before anything compiles (data None: not opened)."""

    mesh: Mesh
    model: nn.Module
    tx: optax.GradientTransformation
    data: tuple[Dataset, dict[str, Dataset]] | None


def build(config, devices=None, *, data: bool = True) -> Build:
    """The mesh over `devices` (default all), model, optimizer and (with `data`) datasets of
    `config`. Raises `ValueError` naming the key for anything invalid; compiles nothing."""
    validate(config)
    mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.seq, devices=devices)
    n = mesh_lib.batch_devices(mesh)
    if config.batch_size % n:
        raise ValueError(
            f"config.batch_size = {config.batch_size} must be divisible by the {n} devices "
            f"that split it (mesh {_mesh_text(mesh)})"
        )
    datasets = None
    if data:
        train_data, eval_data, vocab = make_datasets(
            config.data, batch_size=config.batch_size, seed=config.seed
        )
        datasets = (train_data, eval_data)
    else:
        vocab = vocab_size(config.data)
    model = build_model(config.model, vocab)
    check_sequence_parallel(model, mesh, config.data.seq_len)
    return Build(mesh, model, make_optimizer(config.optimizer, config.total_steps), datasets)


def _mesh_text(mesh: Mesh) -> str:
    """`data=D fsdp=F seq=S`."""
    return " ".join(f"{axis}={size}" for axis, size in mesh.shape.items())


def make_trainer(config, built: Build) -> Trainer:
    """The `Trainer` of `config` from its `build` (with data)."""
    schedule = make_schedule(config.optimizer, config.total_steps)
    train_data, eval_data = built.data
    return Trainer(
        built.model,
        built.tx,
        train_data,
        eval_data,
        built.mesh,
        seq_len=config.data.seq_len,
        schedule=schedule,
    )


def run_trainer(trainer: Trainer, config, workdir: str) -> dict:
    """`trainer.run` with the run-level keys of `config`; returns its result."""
    return trainer.run(
        workdir,
        **{key: config[key] for key in RUN_KEYS},
        init_from=config.get("init_from", ""),
        config=config.to_dict(),
    )


def train(config, workdir: str, devices=None) -> dict:
    """Train (or resume) the run of `config` in `workdir` on `devices` (default all).

    Returns `{"status": "done" | "sigterm" | "nonfinite", "step": last step done}`; raises
    `ValueError` for a bad config before compiling anything.
    """
    return run_trainer(make_trainer(config, build(config, devices)), config, workdir)


def compile_built(
    config, built: Build, *, label: str = "", steps=("train", "eval")
) -> list[aot.Compiled]:
    """Compile the train and eval steps (those in `steps`) of a `build` and log their table.

    Raises `aot.CompileError` for a step that does not compile; a step that compiles but exceeds
    the chip's HBM is in the result with `fits` False.
    """
    mesh = built.mesh
    compiled = aot.compile_steps(
        built.model,
        built.tx,
        mesh=mesh,
        batch_size=config.batch_size,
        seq_len=config.data.seq_len,
        steps=steps,
    )
    device = mesh.devices.flat[0]
    hbm = compiled[0].hbm
    header = (
        f"compile only: {mesh_lib.num_devices(mesh)} x {device.device_kind}"
        f"{' (' + label + ')' if label else ''}, HBM {aot.size(hbm) if hbm else 'unknown'} each;"
        f" mesh {_mesh_text(mesh)}; batch"
        f" {config.batch_size} x {config.data.seq_len} tokens; per device:"
    )
    log.info("\n%s", aot.format_report(compiled, header))
    return compiled


def compile_only(
    config, devices=None, *, label: str = "", steps=("train", "eval")
) -> list[aot.Compiled]:
    """`compile_built` of the run of `config` on `devices` (default all), no dataset opened;
    raises `ValueError` for a bad config."""
    return compile_built(config, build(config, devices, data=False), label=label, steps=steps)


_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "folder of the run's checkpoints and metrics")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() first")
_COMPILE_ONLY = flags.DEFINE_bool(
    "compile_only", False, "compile the train and eval steps, print their memory and cost, exit"
)
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "with --compile_only: a TPU topology to compile for (v5e:4x8, v6e:16x16)"
)


def _compile_main(config, built: Build) -> None:
    try:
        compiled = compile_built(config, built, label=_TOPOLOGY.value or "")
    except aot.CompileError as error:
        reason = "does not fit in HBM" if error.out_of_memory else "is rejected by the compiler"
        sys.exit(f"compile only: the {error.step} step {reason}:\n{error.__cause__}")
    too_big = [s for s in compiled if not s.fits]
    if too_big:
        needs = "; ".join(
            f"{s.name} needs {aot.size(s.peak)} of {aot.size(s.hbm)}" for s in too_big
        )
        sys.exit(f"compile only: does not fit: {needs}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if _TOPOLOGY.value and not _COMPILE_ONLY.value:
        raise app.UsageError("--topology needs --compile_only")
    if not _COMPILE_ONLY.value and not _WORKDIR.value:
        raise app.UsageError("--workdir is required (except with --compile_only)")
    quiet_logs(flags.FLAGS.verbosity)
    if _DISTRIBUTED.value:
        mesh_lib.initialize_distributed()
    config = _CONFIG.value
    try:
        devices = aot.topology_devices(_TOPOLOGY.value) if _TOPOLOGY.value else None
        built = build(config, devices, data=not _COMPILE_ONLY.value)
        trainer = None if _COMPILE_ONLY.value else make_trainer(config, built)
    except ValueError as error:
        sys.exit(f"config error: {error}")
    if trainer is None:
        _compile_main(config, built)
        return
    try:
        result = run_trainer(trainer, config, _WORKDIR.value)
    except CheckpointError as error:
        sys.exit(f"checkpoint error: {error}")
    if result["status"] == "nonfinite":
        sys.exit(f"stopped: non-finite loss at step {result['step']}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
