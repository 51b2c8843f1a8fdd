"""Tests of seqlab.train.mesh on the 4 fake CPU devices: mesh shapes, the FSDP placement rule,
global batches assembled from host slices (split over sequences and over time), errors."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from seqlab.train import mesh as mesh_lib


def test_make_mesh_shapes():
    assert jax.device_count() == 4
    assert dict(mesh_lib.make_mesh(-1, 1).shape) == {"data": 4, "fsdp": 1, "seq": 1}
    assert dict(mesh_lib.make_mesh(-1, 2).shape) == {"data": 2, "fsdp": 2, "seq": 1}
    assert dict(mesh_lib.make_mesh(1, 1).shape) == {"data": 1, "fsdp": 1, "seq": 1}
    assert dict(mesh_lib.make_mesh(-1, 1, 2).shape) == {"data": 2, "fsdp": 1, "seq": 2}
    assert dict(mesh_lib.make_mesh(1, 2, 2).shape) == {"data": 1, "fsdp": 2, "seq": 2}
    assert mesh_lib.num_devices(mesh_lib.make_mesh(1, 2)) == 2
    assert mesh_lib.batch_devices(mesh_lib.make_mesh(-1, 1, 2)) == 2


@pytest.mark.parametrize(
    "data, fsdp, seq, match",
    [
        (-1, 3, 1, "mesh.fsdp"),
        (0, 1, 1, "mesh.data"),
        (4, 2, 1, "exceeds"),
        (1, 0, 1, "mesh.fsdp"),
        (1, 1, 0, "mesh.seq"),
        (-1, 1, 3, "mesh.seq"),
        (2, 2, 2, "exceeds"),
    ],
)
def test_make_mesh_errors(data, fsdp, seq, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.make_mesh(data, fsdp, seq)


def test_leaf_spec_shards_the_largest_divisible_axis():
    assert mesh_lib.leaf_spec((6, 8), 2) == PartitionSpec(None, "fsdp")
    assert mesh_lib.leaf_spec((8, 6), 4) == PartitionSpec("fsdp", None)
    assert mesh_lib.leaf_spec((6, 3), 4) == PartitionSpec()
    assert mesh_lib.leaf_spec((), 4) == PartitionSpec()
    assert mesh_lib.leaf_spec((8, 6), 1) == PartitionSpec()


def test_state_and_batch_placement():
    mesh = mesh_lib.make_mesh(2, 2)
    tree = {"w": np.zeros((6, 8), np.float32), "b": np.zeros((3,), np.float32)}
    shardings = mesh_lib.state_shardings(tree, mesh)
    assert shardings["w"].spec == PartitionSpec(None, "fsdp")
    assert shardings["b"].spec == PartitionSpec()
    batch = {"inputs": np.arange(8 * 5, dtype=np.int32).reshape(8, 5)}
    placed = mesh_lib.place_batch(batch, mesh_lib.batch_sharding(mesh))
    np.testing.assert_array_equal(np.asarray(placed["inputs"]), batch["inputs"])
    rows = sorted(int(s.data[0, 0]) // 5 for s in placed["inputs"].addressable_shards)
    assert rows == [0, 2, 4, 6]  # four distinct slices of 2 rows


def test_batches_split_over_sequences_and_time():
    """Mesh (2, 1, 2): each device holds 2 of the 4 sequences and 3 of their 6 tokens."""
    mesh = mesh_lib.make_mesh(2, 1, 2)
    batch = {"inputs": np.arange(4 * 6, dtype=np.int32).reshape(4, 6)}
    placed = mesh_lib.place_batch(batch, mesh_lib.batch_sharding(mesh))
    np.testing.assert_array_equal(np.asarray(placed["inputs"]), batch["inputs"])
    blocks = sorted(divmod(int(s.data[0, 0]), 6) for s in placed["inputs"].addressable_shards)
    assert blocks == [(0, 0), (0, 3), (2, 0), (2, 3)]  # (first row, first token) of each device
    assert {s.data.shape for s in placed["inputs"].addressable_shards} == {(2, 3)}
    with pytest.raises(ValueError, match=r"mesh\.seq = 2 must divide seq_len = 5"):
        mesh_lib.check_seq_len(5, mesh)
