"""Tests of seqlab.train.checkpoint: exact round trip of a train state (sharded too), the save
interval, keep-N, the latest step, one log line per committed save, errors; a damaged latest
checkpoint (truncated, a file deleted, garbage metadata) is skipped, kept aside and logged, and
the previous one restored; all damaged is an error naming the folder."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqlab.train import mesh as mesh_lib
from seqlab.train.checkpoint import STEP_METADATA, Checkpointer, CheckpointError, restore_params


def _state(scale: float):
    return {
        "params": {"w": jnp.arange(24, dtype=jnp.float32).reshape(6, 4) * scale},
        "opt": (jnp.full((3,), scale, jnp.float64), jnp.asarray(7, jnp.int32)),
    }


def test_interval_keep_and_exact_restore(tmp_path):
    ckpt = Checkpointer(tmp_path / "c", every=2, keep=2)
    assert ckpt.latest_step() is None
    started = [ckpt.save(step, _state(step)) for step in range(1, 7)]
    assert started == [False, True, False, True, False, True]
    assert ckpt.save(7, _state(7), force=True)
    assert not ckpt.save(7, _state(8), force=True)  # already saved: never overwritten
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
    restored = ckpt.restore(_state(0.0), step=6)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(_state(6)), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()
    reopened = Checkpointer(tmp_path / "c", every=2, keep=2)
    assert reopened.latest_step() == 7
    np.testing.assert_array_equal(
        reopened.restore(_state(0.0))["params"]["w"], _state(7)["params"]["w"]
    )
    reopened.close()


def test_restore_takes_the_target_sharding(tmp_path):
    mesh = mesh_lib.make_mesh(2, 2)
    state = _state(3.0)
    shardings = mesh_lib.state_shardings(state, mesh)
    ckpt = Checkpointer(tmp_path, every=1, keep=1)
    ckpt.save(1, jax.device_put(state, shardings))
    ckpt.wait()
    target = jax.device_put(_state(0.0), shardings)
    restored = ckpt.restore(target)
    assert restored["params"]["w"].sharding == shardings["params"]["w"]
    np.testing.assert_array_equal(
        np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"])
    )
    ckpt.close()


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="every"):
        Checkpointer(tmp_path, every=0, keep=1)
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, every=1, keep=0)
    ckpt = Checkpointer(tmp_path / "empty", every=1, keep=1)
    with pytest.raises(ValueError, match="no checkpoint"):
        ckpt.restore(_state(0.0))
    ckpt.close()


def test_restore_params_reads_the_params_only_and_keeps_what_the_source_lacks(tmp_path):
    ckpt = Checkpointer(tmp_path, every=1, keep=2)
    ckpt.save(1, _state(1.0))
    ckpt.save(2, _state(2.0))
    ckpt.wait()
    ckpt.close()
    target = {"w": jnp.zeros((6, 4), jnp.float32), "lora_u": jnp.full((3,), 0.5, jnp.float32)}
    params, kept = restore_params(tmp_path, target)
    assert kept == ["lora_u"]
    np.testing.assert_array_equal(params["w"], _state(2.0)["params"]["w"])  # the latest step
    np.testing.assert_array_equal(params["lora_u"], target["lora_u"])
    assert Checkpointer(tmp_path, every=1, keep=2).all_steps() == [1, 2]  # nothing written


def test_restore_params_errors(tmp_path):
    ckpt = Checkpointer(tmp_path / "run", every=1, keep=1)
    ckpt.save(1, _state(1.0))
    ckpt.wait()
    ckpt.close()
    with pytest.raises(ValueError, match="no checkpoint folder"):
        restore_params(tmp_path / "missing", {"w": jnp.zeros((6, 4))})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint in"):
        restore_params(tmp_path / "empty", {"w": jnp.zeros((6, 4))})
    with pytest.raises(ValueError, match=r"parameter w has shape \(6, 4\) in the checkpoint"):
        restore_params(tmp_path / "run", {"w": jnp.zeros((4, 6))})
    with pytest.raises(ValueError, match=r"has parameters the model lacks: \['w'\]"):
        restore_params(tmp_path / "run", {"v": jnp.zeros((6, 4))})


def _saved(directory, steps) -> Checkpointer:
    ckpt = Checkpointer(directory, every=1, keep=len(steps))
    for step in steps:
        ckpt.save(step, _state(step))
    ckpt.close()
    return Checkpointer(directory, every=1, keep=len(steps))


def test_one_log_line_per_committed_save(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="seqlab.train.checkpoint")
    ckpt = Checkpointer(tmp_path, every=2, keep=2)
    for step in range(1, 6):
        ckpt.save(step, _state(step))
    ckpt.wait()
    saved = [r.getMessage() for r in caplog.records if r.name == "seqlab.train.checkpoint"]
    assert saved == ["saved checkpoint of step 2", "saved checkpoint of step 4"]
    ckpt.close()


def _truncate(step_dir, pattern="default/d/*"):
    """Halve the files of the checkpoint matching `pattern` (default: the merged OCDBT data
    files, as a disk that filled up; TensorStore then reads past their end)."""
    for path in step_dir.glob(pattern):
        if path.is_file():
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _delete_database(step_dir):
    """Delete the files of the merged OCDBT database (arrays and their `.zarray` metadata)."""
    for path in [step_dir / "default" / "manifest.ocdbt", *(step_dir / "default" / "d").iterdir()]:
        path.unlink()


def _garbage_step_metadata(step_dir):
    (step_dir / STEP_METADATA).write_text("{garbage")


def _garbage_tree_metadata(step_dir):
    (step_dir / "default" / "_METADATA").write_text("{garbage")


@pytest.mark.parametrize(
    "damage", [_truncate, _delete_database, _garbage_step_metadata, _garbage_tree_metadata]
)
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_previous_restored(
    tmp_path, caplog, damage
):
    ckpt = _saved(tmp_path, [2, 4])
    assert ckpt.restore_readable(_state(0.0))[1] == 4  # intact: the latest
    damage(tmp_path / "4")
    caplog.set_level(logging.INFO, logger="seqlab.train.checkpoint")
    state, step = ckpt.restore_readable(_state(0.0))
    assert step == 2
    np.testing.assert_array_equal(state["params"]["w"], _state(2)["params"]["w"])
    skipped = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelno == logging.WARNING
    assert "checkpoint of step 4 (" in skipped[0].getMessage()
    assert len(skipped[0].getMessage()) < 500  # the first line of the error, shortened
    assert "4.damaged" in skipped[0].getMessage()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4.damaged"]
    assert ckpt.all_steps() == [2] and ckpt.latest_step() == 2  # orbax reread the folder
    assert ckpt.save(4, _state(4.0))  # the step is saved again; the damaged copy stays aside
    ckpt.close()
    assert Checkpointer(tmp_path, every=1, keep=2).restore_readable(_state(0.0))[1] == 4


def test_all_damaged_is_an_error_naming_the_folder_and_renames_nothing(tmp_path):
    ckpt = _saved(tmp_path / "run", [2, 4])
    _truncate(tmp_path / "run" / "2", pattern="**/*")
    _garbage_step_metadata(tmp_path / "run" / "4")
    with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path / 'run'} reads back"):
        ckpt.restore_readable(_state(0.0))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["2", "4"]
    ckpt.close()
    empty = Checkpointer(tmp_path / "empty", every=1, keep=1)
    assert empty.restore_readable(_state(0.0)) is None
    empty.close()
