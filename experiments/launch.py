"""The one training entry point (DESIGN.md 3.6).

    python -m experiments.launch --config=experiments/configs/NAME.py[:ARG] --workdir=DIR \
        [--config.KEY=VALUE ...] [--distributed]

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
"""

import functools
import pathlib
import signal
import sys
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from seqlab.train import mesh as mesh_lib
from seqlab.train.checkpoint import Checkpointer, restore_params
from seqlab.train.data import make_datasets
from seqlab.train.metrics import MetricsWriter
from seqlab.train.models import build_model
from seqlab.train.optim import make_optimizer, make_schedule
from seqlab.train.step import create_state, eval_step, means, train_step

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
    """Everything built from a validated config, before anything compiles."""

    def __init__(self, config, devices=None):
        validate(config)
        self.mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.fsdp, devices)
        n = mesh_lib.num_devices(self.mesh)
        if config.batch_size % n:
            raise ValueError(
                f"config.batch_size = {config.batch_size} must be divisible by the {n} devices "
                f"of the mesh (data={self.mesh.shape['data']}, fsdp={self.mesh.shape['fsdp']})"
            )
        self.train_data, self.eval_data, vocab_size = make_datasets(
            config.data, batch_size=config.batch_size, seed=config.seed
        )
        self.model = build_model(config.model, vocab_size)
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

    batch_sharding = mesh_lib.batch_sharding(run.mesh)
    repl = mesh_lib.replicated(run.mesh)
    step_fn = jax.jit(
        train_step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, repl),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        functools.partial(eval_step, run.model.apply),
        in_shardings=(shardings.params, batch_sharding),
        out_shardings=repl,
    )
    previous_handler = _Stop.install()
    try:
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


_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "folder of the run's checkpoints and metrics")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() first")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if _DISTRIBUTED.value:
        mesh_lib.initialize_distributed()
    try:
        result = train(_CONFIG.value, _WORKDIR.value)
    except ValueError as error:
        sys.exit(f"config error: {error}")
    if result["status"] == "nonfinite":
        sys.exit(f"stopped: non-finite loss at step {result['step']}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
