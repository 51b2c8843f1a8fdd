"""Checkpoints of a run's state with orbax: the only orbax (and TensorStore) import of the
repository.

`Checkpointer(directory, every=..., keep=...)` wraps `orbax.checkpoint.CheckpointManager`: a save at
every step that is a multiple of `every` (or any step when forced), the newest `keep` kept,
writes in the background (async) so training continues while the files land. A checkpoint is
committed atomically (written to a temporary folder, then renamed), so a process killed mid-save
leaves the previous checkpoint as the latest.

A checkpoint damaged after its commit (a truncated or deleted file, garbage in a metadata file) is
skipped by `restore_readable`, which restores the newest checkpoint that reads back completely and
keeps each newer damaged one aside as `STEP.damaged` in the same folder (a name orbax ignores).
"Reads back" is checked byte by byte (every value of the checkpoint's OCDBT databases, read by
process 0 with TensorStore) before orbax restores it: a restore that orbax aborts midway prints
pages of asyncio tracebacks.
Logging: one line per committed checkpoint (`saved checkpoint of step N`, at INFO on the
`seqlab.train.checkpoint` logger) and one per damaged checkpoint skipped (WARNING).

`restore_params(directory, target)` reads only the parameters of another run's latest checkpoint
(to initialize a fine-tuning run from it), read-only.
"""

import json
import logging
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

# orbax's per-step metadata (JSON) at the top of every step folder: restoring does not need it
# (orbax logs an error and goes on when it is garbage), so `restore_readable` parses it itself.
STEP_METADATA = "_CHECKPOINT_METADATA"
# The suffix of a damaged step folder kept aside (orbax reads only all-digit step names).
DAMAGED = ".damaged"
# The first line of a TensorStore error holds its whole JSON spec: the log keeps this much of it.
REASON_CHARS = 240


class CheckpointError(RuntimeError):
    """Checkpoints are present but none reads back completely."""


class Checkpointer:
    """Saves and restores a pytree of arrays (a `TrainState`) under `directory`.

    Attributes:
      directory: absolute or relative folder of the checkpoints (created when missing).
      every: save interval in steps (> 0).
      keep: how many of the newest checkpoints to keep (> 0).
      async_save: write in a background thread.
    """

    def __init__(self, directory, *, every: int, keep: int, async_save: bool = True):
        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.every = every
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._unconfirmed: int | None = None  # the step of a save not yet logged as committed

    def latest_step(self) -> int | None:
        """The step of the newest committed checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every committed checkpoint, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, *, force: bool = False) -> bool:
        """Start saving `state` as `step` if `step` is a multiple of `every` (or `force`) and not
        saved yet; True if a save started. (The interval is decided here, not by orbax's policy,
        which also saves the first step and skips steps while a save is in flight.)"""
        if self._unconfirmed is not None and not self._manager.is_saving_in_progress():
            self._confirm()
        if not (force or step % self.every == 0) or step in self._manager.all_steps():
            return False
        self._manager.wait_until_finished()  # orbax's save would wait too; log the previous one
        self._confirm()
        started = self._manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self._unconfirmed = step if started else None
        return started

    def _confirm(self) -> None:
        """Log the commit of the last save started (call once it is finished)."""
        if self._unconfirmed is not None:
            log.info("saved checkpoint of step %d", self._unconfirmed)
            self._unconfirmed = None

    def restore(self, target, step: int | None = None):
        """The state saved at `step` (default: the latest), with the structure, dtypes and
        shardings of `target` (a pytree of arrays or `jax.ShapeDtypeStruct`s with `.sharding`)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError("no checkpoint to restore")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def restore_readable(self, target) -> tuple[object, int] | None:
        """`(state, step)` of the newest checkpoint that reads back completely, or None when
        there is none at all.

        A checkpoint reads back when its step metadata parses as JSON, every value of its OCDBT
        databases reads in full (`_read_databases`, on process 0), and `restore(target, step)`
        succeeds on every process. Each newer one that does not is logged (its step and the
        first line of the error) and renamed aside to `STEP.damaged` (by process 0; every process
        then rereads the folder). Raises `CheckpointError` naming `directory` when checkpoints
        exist but none reads back; then nothing is renamed (the same cause, e.g. a model that
        changed, may fail them all)."""
        damaged = []
        for step in reversed(self.all_steps()):
            state, error = self._read_back(step, target)
            if error is None:
                self._set_aside(damaged)
                return state, step
            damaged.append((step, error))
        if not damaged:
            return None
        reasons = "; ".join(f"step {step}: {error}" for step, error in damaged)
        raise CheckpointError(f"no checkpoint in {self.directory} reads back ({reasons})")

    def _read_back(self, step: int, target) -> tuple[object, str | None]:
        """`(state, None)` if the checkpoint of `step` reads back on every process, else
        `(None, why)`. The bytes are checked (and the verdict shared) before orbax restores, so
        that every process restores or none does."""
        step_dir = self.directory / str(step)

        def check():
            json.loads((step_dir / STEP_METADATA).read_text())
            if jax.process_index() == 0:
                _read_databases(step_dir)

        error = _shared(_error_of(check))
        if error is not None:
            return None, error
        restored = []

        def restore():
            restored.append(jax.block_until_ready(self.restore(target, step)))

        error = _shared(_error_of(restore))
        return (None, error) if error else (restored[0], None)

    def _set_aside(self, damaged: list[tuple[int, str]]) -> None:
        """Log and rename the folders of the `(step, error)` pairs to `STEP.damaged`."""
        if not damaged:
            return
        for step, error in damaged:
            aside = _aside_path(self.directory, step)
            log.warning(
                "skipped the damaged checkpoint of step %d (%s); kept aside as %s",
                step,
                error,
                aside.name,
            )
            if jax.process_index() == 0:
                (self.directory / str(step)).rename(aside)
        steps = "_".join(str(step) for step, _ in damaged)
        ocp.multihost.sync_global_processes(f"seqlab_set_aside_{steps}")
        self._manager.reload()

    def wait(self) -> None:
        """Block until every started save is committed."""
        self._manager.wait_until_finished()
        self._confirm()

    def close(self) -> None:
        """Wait for the started saves, then release orbax's threads."""
        self._manager.close()
        self._confirm()


def _error_of(fn) -> str | None:
    """None if `fn()` returns, else its error's type and first line (TensorStore's carry their
    whole spec: cut at `REASON_CHARS`). Any error counts: reading back is all that is asked."""
    try:
        fn()
    except Exception as exc:  # any failure to read back is damage
        first = (str(exc).splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first[:REASON_CHARS]}"
    return None


def _shared(error: str | None) -> str | None:
    """`error`, or a stand-in when it is None here but not on another process (multi-host: a
    collective, every process calls it)."""
    if jax.process_count() > 1:
        failed = multihost_utils.process_allgather(np.int32(error is not None))
        if error is None and failed.any():
            return "unreadable on another process"
    return error


def _read_databases(step_dir: pathlib.Path) -> None:
    """Read every value of every OCDBT database (an item folder with a `manifest.ocdbt`) of a
    step folder, raising TensorStore's error for a truncated or missing file. Orbax's own restore
    fails on them too, but its aborted reads then flood stderr with asyncio tracebacks."""
    for manifest in sorted(step_dir.glob("*/manifest.ocdbt")):
        store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{manifest.parent}/"}).result()
        reads = [store.read(key) for key in store.list().result()]
        for read in reads:
            read.result()


def _aside_path(directory: pathlib.Path, step: int) -> pathlib.Path:
    """`directory/STEP.damaged`, or `STEP.damaged.N` with the first N free."""
    path, n = directory / f"{step}{DAMAGED}", 1
    while path.exists():
        path, n = directory / f"{step}{DAMAGED}.{n}", n + 1
    return path


def restore_params(directory, target: dict) -> tuple[dict, list[str]]:
    """The `params` of the latest checkpoint under `directory`, placed like `target`.

    `target`: the parameters of the new model (arrays, or `jax.ShapeDtypeStruct`s with
    `.sharding`), nested dicts. A parameter of `target` that the checkpoint lacks (e.g. LoRA
    factors added for fine-tuning) keeps its value from `target`. Returns the parameters and the
    sorted `"a/b/c"` paths of those kept. Raises `ValueError` when there is no checkpoint, when the
    checkpoint has a parameter `target` lacks, or one of another shape. Nothing is written.
    """
    directory = pathlib.Path(directory).absolute()
    if not directory.is_dir():
        raise ValueError(f"no checkpoint folder {directory}")
    options = ocp.CheckpointManagerOptions(read_only=True)
    handler = ocp.PyTreeCheckpointHandler()
    with ocp.CheckpointManager(directory, options=options, item_handlers=handler) as manager:
        step = manager.latest_step()
        if step is None:
            raise ValueError(f"no checkpoint in {directory}")
        saved = flatten_dict(dict(manager.item_metadata(step).tree["params"]), sep="/")
        wanted = flatten_dict(dict(target), sep="/")
        extra = sorted(set(saved) - set(wanted))
        if extra:
            raise ValueError(
                f"the checkpoint in {directory} has parameters the model lacks: {extra}"
            )
        for path, meta in saved.items():
            if tuple(meta.shape) != tuple(wanted[path].shape):
                raise ValueError(
                    f"parameter {path} has shape {tuple(meta.shape)} in the checkpoint in "
                    f"{directory}, {tuple(wanted[path].shape)} in the model"
                )
        abstract = {
            "params": unflatten_dict(
                {p: ocp.utils.to_shape_dtype_struct(wanted[p]) for p in saved}, sep="/"
            )
        }
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        args = ocp.args.PyTreeRestore(abstract, restore_args=restore_args, partial_restore=True)
        restored = flatten_dict(manager.restore(step, args=args)["params"], sep="/")
    kept = sorted(set(wanted) - set(saved))
    return unflatten_dict({**wanted, **restored}, sep="/"), kept
