"""The one training entry point (DESIGN.md 3.6).

    python -m experiments.launch --config=experiments/configs/NAME.py[:ARG] --workdir=DIR \
        [--config.KEY=VALUE ...] [--distributed]
    python -m experiments.launch --config=... --compile_only [--topology=v5e:4x8]

Validates the config (unknown model or task, non-positive sizes, a batch the devices do not
divide) before anything compiles; builds the model from the registry (`seqlab.train.models`);
places parameters, optimizer state and batches on a `(data, fsdp)` device mesh; runs jit-compiled
train and eval steps; logs a progress line (step, loss, steps/s, tokens/s, ETA), `metrics.jsonl`,
`config.json` and TensorBoard events in the workdir; saves orbax checkpoints every
`checkpoint_every` steps and at the end. Launching again on the same workdir resumes from the
latest checkpoint and logs the same losses as an uninterrupted run. SIGTERM saves a checkpoint and
exits 0; a non-finite loss or gradient stops the run (exit 1) with the step named, leaving the
checkpoints of the good steps untouched (the step's metrics are read back after every step, one
host sync per step, so the bad step is named exactly). `--distributed` calls
`jax.distributed.initialize()` first (several hosts).

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

import functools
import pathlib
import signal
import sys
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from seqlab.train import aot
from seqlab.train import mesh as mesh_lib
from seqlab.train.checkpoint import Checkpointer, restore_params
from seqlab.train.data import make_datasets, vocab_size
from seqlab.train.metrics import MetricsWriter
from seqlab.train.models import build_model
from seqlab.train.optim import make_optimizer, make_schedule
from seqlab.train.step import create_state, jit_steps, means

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


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def validate(config) -> None:
    """Raise `ValueError` naming the key of the first bad run-level size (see `_POSITIVE`);
    the model, data and optimizer blocks are checked by their builders."""
    for key in _POSITIVE:
        value = _get(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"config.{key} must be a positive int, got {value!r}")
    if not isinstance(config.seed, int) or config.seed < 0:
        raise ValueError(f"config.seed must be an int >= 0, got {config.seed!r}")
    init_from = config.get("init_from", "")
    if init_from and not (pathlib.Path(init_from) / "checkpoints").is_dir():
        raise ValueError(f"config.init_from = {init_from!r} is not a workdir with checkpoints")


class _Run:
    """Everything built from a validated config, before anything compiles; without `data`, no
    dataset is opened (the compile-only run)."""

    def __init__(self, config, devices=None, *, data: bool = True):
        validate(config)
        self.mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.fsdp, devices)
        n = mesh_lib.num_devices(self.mesh)
        if config.batch_size % n:
            raise ValueError(
                f"config.batch_size = {config.batch_size} must be divisible by the {n} devices "
                f"of the mesh (data={self.mesh.shape['data']}, fsdp={self.mesh.shape['fsdp']})"
            )
        if data:
            self.train_data, self.eval_data, vocab = make_datasets(
                config.data, batch_size=config.batch_size, seed=config.seed
            )
        else:
            vocab = vocab_size(config.data)
        self.model = build_model(config.model, vocab)
        self.tx = make_optimizer(config.optimizer, config.total_steps)
        self.lr = make_schedule(config.optimizer, config.total_steps)


def _eval(run: _Run, eval_fn, params, num_batches: int) -> dict[str, float]:
    """Loss and accuracy of every evaluation set over its first `num_batches` batches."""
    out = {}
    for name, dataset in run.eval_data.items():
        total = None
        for i in range(num_batches):
            batch = mesh_lib.place_batch(dataset.batch(i), mesh_lib.batch_sharding(run.mesh))
            sums = eval_fn(params, batch)
            total = sums if total is None else jax.tree.map(lambda a, b: a + b, total, sums)
        prefix = f"eval/{name}/" if name else "eval/"
        out.update({prefix + k: v for k, v in means(jax.device_get(total)).items()})
    return out


class _Stop:
    """Set by SIGTERM; the loop saves and exits at the end of the current step."""

    requested = False

    @classmethod
    def install(cls):
        cls.requested = False
        return signal.signal(signal.SIGTERM, lambda *_: setattr(cls, "requested", True))


def train(config, workdir: str, devices=None) -> dict:
    """Train (or resume) the run of `config` in `workdir`.

    Returns `{"status": "done" | "sigterm" | "nonfinite", "step": last step done}`; raises
    `ValueError` for a bad config before compiling anything. `devices`: the devices of the mesh
    (default all).
    """
    run = _Run(config, devices)
    key = jax.random.key(config.seed)
    init = functools.partial(create_state, run.model, run.tx, seq_len=config.data.seq_len)
    shardings = mesh_lib.state_shardings(jax.eval_shape(init, key), run.mesh)
    state = jax.jit(init, out_shardings=shardings)(key)

    ckpt = Checkpointer(
        f"{workdir}/checkpoints", every=config.checkpoint_every, keep=config.keep_checkpoints
    )
    resume = ckpt.latest_step()
    if resume is not None:
        state = ckpt.restore(state, resume)
        logging.info("resumed from the checkpoint of step %d", resume)
    elif config.get("init_from", ""):
        params, kept = restore_params(f"{config.init_from}/checkpoints", state.params)
        state = state.replace(params=params)
        logging.info("parameters from %s; kept at their init: %s", config.init_from, kept)
    writer = MetricsWriter(workdir, resume_step=resume) if jax.process_index() == 0 else None
    if writer:
        writer.write_config(config.to_dict())

    step_fn, eval_fn = jit_steps(run.model.apply, shardings, run.mesh)
    previous_handler = _Stop.install()
    try:
        with jax.set_mesh(run.mesh):
            return _loop(config, run, state, step_fn, eval_fn, ckpt, writer)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        ckpt.close()
        if writer:
            writer.close()


def _loop(config, run, state, step_fn, eval_fn, ckpt, writer) -> dict:
    start = int(jax.device_get(state.step))
    tokens_per_step = config.batch_size * config.data.seq_len
    batch_sharding = mesh_lib.batch_sharding(run.mesh)
    t_last, step_last = time.perf_counter(), start
    for step in range(start, config.total_steps):
        batch = mesh_lib.place_batch(run.train_data.batch(step), batch_sharding)
        state, metrics = step_fn(state, batch)
        metrics = jax.device_get(metrics)
        done = step + 1
        if not metrics["finite"]:
            ckpt.wait()
            logging.error(
                "loss %s or gradient norm %s is not finite at step %d; stopping (latest "
                "checkpoint: step %s)",
                metrics["loss"],
                metrics["grad_norm"],
                done,
                ckpt.latest_step(),
            )
            return {"status": "nonfinite", "step": done}
        last = done == config.total_steps
        record = {}
        if done % config.log_every == 0 or last:
            record = {k: metrics[k] for k in ("loss", "accuracy", "grad_norm")}
            record["learning_rate"] = run.lr(step)
            now = time.perf_counter()
            rate = (done - step_last) / max(now - t_last, 1e-9)
            t_last, step_last = now, done
            eta = (config.total_steps - done) / rate
            logging.info(
                "step %d/%d loss %.4f acc %.3f | %.2f steps/s %.0f tokens/s | ETA %.0fs",
                done,
                config.total_steps,
                record["loss"],
                record["accuracy"],
                rate,
                rate * tokens_per_step,
                eta,
            )
        if done % config.eval_every == 0 or last:
            record.update(_eval(run, eval_fn, state.params, config.eval_batches))
            evals = {k: round(float(v), 4) for k, v in record.items() if k.startswith("eval/")}
            logging.info("step %d %s", done, evals)
        if record and writer:
            writer.write(done, record)
        ckpt.save(done, state, force=last or _Stop.requested)
        if _Stop.requested:
            ckpt.wait()
            logging.warning("SIGTERM: saved the checkpoint of step %d, exiting", done)
            return {"status": "sigterm", "step": done}
    ckpt.wait()
    return {"status": "done", "step": max(start, config.total_steps)}


def compile_only(
    config, devices=None, *, label: str = "", steps=("train", "eval")
) -> list[aot.Compiled]:
    """Compile the run's train and eval steps (those in `steps`) for `devices` (default all) and
    log their table.

    Raises `ValueError` for a bad config and `aot.CompileError` for a step that does not
    compile; a step that compiles but exceeds the chip's HBM is in the result with `fits` False.
    """
    run = _Run(config, devices, data=False)
    steps = aot.compile_steps(
        run.model,
        run.tx,
        mesh=run.mesh,
        batch_size=config.batch_size,
        seq_len=config.data.seq_len,
        steps=steps,
    )
    device = run.mesh.devices.flat[0]
    hbm = steps[0].hbm
    header = (
        f"compile only: {mesh_lib.num_devices(run.mesh)} x {device.device_kind}"
        f"{' (' + label + ')' if label else ''}, HBM {aot.size(hbm) if hbm else 'unknown'} each;"
        f" mesh data={run.mesh.shape['data']} fsdp={run.mesh.shape['fsdp']}; batch"
        f" {config.batch_size} x {config.data.seq_len} tokens; per device:"
    )
    logging.info("\n%s", aot.format_report(steps, header))
    return steps


_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "folder of the run's checkpoints and metrics")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() first")
_COMPILE_ONLY = flags.DEFINE_bool(
    "compile_only", False, "compile the train and eval steps, print their memory and cost, exit"
)
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "with --compile_only: a TPU topology to compile for (v5e:4x8, v6e:16x16)"
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if _TOPOLOGY.value and not _COMPILE_ONLY.value:
        raise app.UsageError("--topology needs --compile_only")
    if not _COMPILE_ONLY.value and not _WORKDIR.value:
        raise app.UsageError("--workdir is required (except with --compile_only)")
    if _DISTRIBUTED.value:
        mesh_lib.initialize_distributed()
    try:
        if _COMPILE_ONLY.value:
            devices = aot.topology_devices(_TOPOLOGY.value) if _TOPOLOGY.value else None
            steps = compile_only(_CONFIG.value, devices, label=_TOPOLOGY.value or "")
        else:
            result = train(_CONFIG.value, _WORKDIR.value)
    except ValueError as error:
        sys.exit(f"config error: {error}")
    except aot.CompileError as error:
        reason = "does not fit in HBM" if error.out_of_memory else "is rejected by the compiler"
        sys.exit(f"compile only: the {error.step} step {reason}:\n{error.__cause__}")
    if _COMPILE_ONLY.value:
        too_big = [s for s in steps if not s.fits]
        if too_big:
            sys.exit(
                "compile only: does not fit: "
                + "; ".join(
                    f"{s.name} needs {aot.size(s.peak)} of {aot.size(s.hbm)}" for s in too_big
                )
            )
    elif result["status"] == "nonfinite":
        sys.exit(f"stopped: non-finite loss at step {result['step']}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
