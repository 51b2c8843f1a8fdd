"""The training loop: `Trainer(model, tx, train_data, eval_data, mesh, seq_len=...)`.

`trainer.run(workdir, total_steps=..., seed=...)` trains (or resumes) a run in `workdir`: the state
is initialized from `seed` (or the parameters of `init_from`'s latest checkpoint), placed on the
`(data, fsdp, seq)` mesh, and updated by the jit-compiled train step on `train_data.batch(step)`;
every `log_every` steps a progress line (step, loss, steps/s, tokens/s, ETA) and a record of
`metrics.jsonl` and TensorBoard, every `eval_every` steps the loss and accuracy of every evaluation
set over its first `eval_batches` batches, every `checkpoint_every` steps (and at the end) an orbax
checkpoint. A workdir with checkpoints resumes from the newest one that reads back completely (a
damaged newer one is logged and kept aside, `Checkpointer.restore_readable`; none readable raises
`CheckpointError`) and, since every batch is a function of its step, logs the same losses as an
uninterrupted run.

No host sync per step: the steps are dispatched back to back and their metrics stay on the device
until the loop needs them, every `log_every` steps, before a checkpoint save or an evaluation, at
the end and on SIGTERM; then all of them since the previous read come back at once.

Stops: SIGTERM (during `run`) saves a checkpoint at the end of the current step and returns
status `"sigterm"`; a non-finite loss or gradient norm returns `"nonfinite"` naming the first such
step from the metrics read back (the train step skips that update; the steps after it, dispatched
before the read, are discarded with the state; metrics are read back before every save, so no
checkpoint follows a non-finite step).

Logging (python `logging`, logger `seqlab.train.loop`, at INFO): the progress line, evaluations,
the resume; checkpoints are logged by `seqlab.train.checkpoint`.

Without a workdir, `init_state` / `state_from`, `step` and `evaluate` drive the same compiled
steps by hand (e.g. fine-tuning loops in `theory/`).
"""

import logging
import signal
import time

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import Mesh

from seqlab.ops.checks import check_positive_int
from seqlab.train import mesh as mesh_lib
from seqlab.train.checkpoint import Checkpointer, CheckpointError, restore_params
from seqlab.train.data import Dataset
from seqlab.train.metrics import MetricsWriter
from seqlab.train.step import (
    TrainState,
    batch_sums,
    check_sequence_parallel,
    create_state,
    evaluate_batches,
    jit_steps,
)

log = logging.getLogger(__name__)


class Trainer:
    """The compiled steps of `model` with optimizer `tx` on `mesh`, and the loop around them.

    Attributes:
      model: a token model, `model.apply({"params": p}, inputs [B, T]) -> logits [B, T, V]`.
      tx: the optimizer (`seqlab.train.optim.make_optimizer`).
      train_data: the training stream (`Dataset`: batch `{"inputs", "targets"}` of a step).
      eval_data: named evaluation streams (`{}`: none); metric keys `eval/NAME/...`, `eval/...`
        for the name `""`.
      mesh: a `(data, fsdp, seq)` mesh (`seqlab.train.mesh.make_mesh`); batches split over all of
        it, their time axis over `seq` (sequence parallelism, `seqlab.train.step.batch_sums`).
      seq_len: T of the `[1, T]` batch the parameters are initialized on; a multiple of `seq`.
      schedule: the learning rate by step, logged as `learning_rate` (None: not logged).
      stop_requested: set by SIGTERM during `run` (or by the caller): the loop saves and returns
        at the end of the current step.
    """

    def __init__(
        self,
        model: nn.Module,
        tx: optax.GradientTransformation,
        train_data: Dataset,
        eval_data: dict[str, Dataset],
        mesh: Mesh,
        *,
        seq_len: int,
        schedule: optax.Schedule | None = None,
    ):
        check_positive_int("seq_len", seq_len)
        check_sequence_parallel(model, mesh, seq_len)
        self.model, self.tx, self.mesh, self.schedule = model, tx, mesh, schedule
        self.train_data, self.eval_data, self.seq_len = train_data, eval_data, seq_len
        self.stop_requested = False
        abstract = jax.eval_shape(self._create, jax.random.key(0))
        self.shardings = mesh_lib.state_shardings(abstract, mesh)
        self._batch_sharding = mesh_lib.batch_sharding(mesh)
        self._train_fn, self._eval_fn = jit_steps(
            model.apply, self.shardings, mesh, sums_fn=batch_sums(model, mesh)
        )
        # One jitted init per trainer (a bound method jitted per call would compile per call).
        self._init_fn = jax.jit(self._create, out_shardings=self.shardings)

    def _create(self, key: jax.Array) -> TrainState:
        return create_state(self.model, self.tx, key, self.seq_len)

    def init_state(self, key: jax.Array) -> TrainState:
        """Step 0: parameters initialized with `key`, a fresh optimizer state, on the mesh."""
        return self._init_fn(key)

    def state_from(self, params) -> TrainState:
        """Step 0 at (a copy of) `params` with a fresh optimizer state, on the mesh. The copy
        keeps the caller's `params` alive: the train step donates the state it is given."""

        def create(params):
            return TrainState.create(apply_fn=self.model.apply, params=params, tx=self.tx)

        copied = jax.tree.map(jnp.copy, params)
        return jax.jit(create, out_shardings=self.shardings)(copied)

    def step(self, state: TrainState, index: int) -> tuple[TrainState, dict]:
        """One update on `train_data.batch(index)`; `state` is donated. Returns the new state and
        the host metrics `loss`, `accuracy`, `grad_norm`, `finite` (when not finite, the state is
        the input's: the update is skipped)."""
        state, metrics = self._dispatch(state, index)
        return state, jax.device_get(metrics)

    def _dispatch(self, state: TrainState, index: int) -> tuple[TrainState, dict]:
        """`step` without the read back: the metrics stay on the device (no host sync)."""
        batch = mesh_lib.place_batch(self.train_data.batch(index), self._batch_sharding)
        with jax.set_mesh(self.mesh):
            return self._train_fn(state, batch)

    def evaluate(self, params, num_batches: int) -> dict[str, float]:
        """`eval/[NAME/]loss` and `eval/[NAME/]accuracy` of every evaluation set over its first
        `num_batches` batches (all their scored positions pooled)."""
        out = {}
        with jax.set_mesh(self.mesh):
            for name, dataset in self.eval_data.items():
                batches = (
                    mesh_lib.place_batch(dataset.batch(i), self._batch_sharding)
                    for i in range(num_batches)
                )
                prefix = f"eval/{name}/" if name else "eval/"
                means = evaluate_batches(self._eval_fn, params, batches)
                out.update({prefix + k: v for k, v in means.items()})
        return out

    def run(
        self,
        workdir: str,
        *,
        total_steps: int,
        seed: int,
        checkpoint_every: int = 200,
        keep_checkpoints: int = 3,
        log_every: int = 20,
        eval_every: int = 200,
        eval_batches: int = 4,
        init_from: str = "",
        config: dict | None = None,
    ) -> dict:
        """Train (or resume) the run in `workdir` up to `total_steps` (module docstring).

        `init_from`: a workdir whose latest checkpoint's parameters start a run that has no
        checkpoint of its own (parameters it lacks keep their init). `config`: written to
        `config.json`. Returns `{"status": "done" | "sigterm" | "nonfinite", "step": last step}`.
        Raises `CheckpointError` (naming `workdir/checkpoints`) when the workdir has checkpoints
        but none reads back. Only process 0 writes metrics and renames a damaged checkpoint;
        every process writes its checkpoint shards.
        """
        for name, value in (
            ("total_steps", total_steps),
            ("checkpoint_every", checkpoint_every),
            ("keep_checkpoints", keep_checkpoints),
            ("log_every", log_every),
            ("eval_every", eval_every),
            ("eval_batches", eval_batches),
        ):
            check_positive_int(name, value)
        state = self.init_state(jax.random.key(seed))
        ckpt = Checkpointer(f"{workdir}/checkpoints", every=checkpoint_every, keep=keep_checkpoints)
        try:
            restored = ckpt.restore_readable(state)
        except CheckpointError:
            ckpt.close()
            raise
        resume = None
        if restored is not None:
            state, resume = restored
            log.info("resumed from the checkpoint of step %d", resume)
        elif init_from:
            params, kept = restore_params(f"{init_from}/checkpoints", state.params)
            state = state.replace(params=params)
            log.info("parameters from %s; kept at their init: %s", init_from, kept)
        writer = MetricsWriter(workdir, resume_step=resume) if jax.process_index() == 0 else None
        if writer and config is not None:
            writer.write_config(config)
        self.stop_requested = False
        previous = signal.signal(signal.SIGTERM, self._request_stop)
        try:
            return self._loop(state, ckpt, writer, total_steps, log_every, eval_every, eval_batches)
        finally:
            signal.signal(signal.SIGTERM, previous)
            ckpt.close()
            if writer:
                writer.close()

    def _request_stop(self, *_) -> None:
        self.stop_requested = True

    def _loop(self, state, ckpt, writer, total_steps, log_every, eval_every, eval_batches):
        start = int(jax.device_get(state.step))
        progress = _Progress(start, total_steps)
        tokens_per_step = self.train_data.batch(start)["inputs"].size
        pending = []  # (step done, metrics on the device) not read back yet
        for step in range(start, total_steps):
            state, metrics = self._dispatch(state, step)
            done = step + 1
            pending.append((done, metrics))
            last = done == total_steps
            logs, evals = done % log_every == 0 or last, done % eval_every == 0 or last
            if not (logs or evals or self.stop_requested or done % ckpt.every == 0):
                continue
            read, pending = jax.device_get(pending), []
            bad = next(((i, m) for i, m in read if not m["finite"]), None)
            if bad is not None:
                ckpt.wait()
                log.error(
                    "loss %s or gradient norm %s is not finite at step %d; stopping (latest "
                    "checkpoint: step %s)",
                    bad[1]["loss"],
                    bad[1]["grad_norm"],
                    bad[0],
                    ckpt.latest_step(),
                )
                return {"status": "nonfinite", "step": bad[0]}
            metrics = read[-1][1]
            record = {}
            if logs:
                record = {k: metrics[k] for k in ("loss", "accuracy", "grad_norm")}
                if self.schedule is not None:
                    record["learning_rate"] = self.schedule(step)
                progress.log(done, record, tokens_per_step)
            if evals:
                results = self.evaluate(state.params, eval_batches)
                record.update(results)
                log.info("step %d %s", done, {k: round(v, 4) for k, v in results.items()})
            if record and writer:
                writer.write(done, record)
            ckpt.save(done, state, force=last or self.stop_requested)
            if self.stop_requested:
                ckpt.wait()
                log.warning("SIGTERM: saved the checkpoint of step %d, exiting", done)
                return {"status": "sigterm", "step": done}
        ckpt.wait()
        return {"status": "done", "step": max(start, total_steps)}


class _Progress:
    """The progress line: rate since the previous line, tokens/s and the ETA."""

    def __init__(self, start: int, total_steps: int):
        self.total_steps = total_steps
        self.t_last, self.step_last = time.perf_counter(), start

    def log(self, done: int, record: dict, tokens_per_step: int) -> None:
        now = time.perf_counter()
        rate = (done - self.step_last) / max(now - self.t_last, 1e-9)
        self.t_last, self.step_last = now, done
        log.info(
            "step %d/%d loss %.4f acc %.3f | %.2f steps/s %.0f tokens/s | ETA %.0fs",
            done,
            self.total_steps,
            record["loss"],
            record["accuracy"],
            rate,
            rate * tokens_per_step,
            (self.total_steps - done) / rate,
        )
