"""Checkpoints of a run's state with orbax: the only orbax import of the repository.

`Checkpointer(directory, every=..., keep=...)` wraps `orbax.checkpoint.CheckpointManager`: a save at
every step that is a multiple of `every` (or any step when forced), the newest `keep` kept,
writes in the background (async) so training continues while the files land. A checkpoint is
committed atomically (written to a temporary folder, then renamed), so a process killed mid-save
leaves the previous checkpoint as the latest.

`restore_params(directory, target)` reads only the parameters of another run's latest checkpoint
(to initialize a fine-tuning run from it), read-only.
"""

import pathlib

import jax
import orbax.checkpoint as ocp
from flax.traverse_util import flatten_dict, unflatten_dict


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
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        """The step of the newest committed checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, *, force: bool = False) -> bool:
        """Start saving `state` as `step` if `step` is a multiple of `every` (or `force`) and not
        saved yet; True if a save started. (The interval is decided here, not by orbax's policy,
        which also saves the first step and skips steps while a save is in flight.)"""
        if not (force or step % self.every == 0) or step in self._manager.all_steps():
            return False
        return self._manager.save(step, args=ocp.args.StandardSave(state), force=True)

    def restore(self, target, step: int | None = None):
        """The state saved at `step` (default: the latest), with the structure, dtypes and
        shardings of `target` (a pytree of arrays or `jax.ShapeDtypeStruct`s with `.sharding`)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError("no checkpoint to restore")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def wait(self) -> None:
        """Block until every started save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


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
