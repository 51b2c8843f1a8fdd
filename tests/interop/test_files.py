"""Hugging Face model directories on disk (`seqlab.interop.files`): sharding, stale files, and bad
directories. No torch needed."""

import json

import numpy as np
import pytest

from seqlab.interop import files


def _tensors(sizes):
    return [(f"t{i}", np.full(n, i, np.float32)) for i, n in enumerate(sizes)]


def test_single_file_and_shards(tmp_path):
    assert files.write(tmp_path / "one", {"a": 1}, _tensors([3, 4])) == [
        tmp_path / "one" / files.SINGLE
    ]
    # 40-byte shards: t0 (16 B) and t1 (24 B) fill one; t2 (400 B) is larger than a shard and gets
    # its own; t3 opens a third.
    written = files.write(tmp_path / "many", {"a": 1}, _tensors([4, 6, 100, 2]), max_shard_bytes=40)
    assert [f.name for f in written] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "many" / files.INDEX).read_text())
    assert index["weight_map"] == {
        "t0": written[0].name,
        "t1": written[0].name,
        "t2": written[1].name,
        "t3": written[2].name,
    }
    assert index["metadata"]["total_size"] == 4 * (4 + 6 + 100 + 2)
    directory = files.HFDirectory(tmp_path / "many")
    assert directory.names() == ["t0", "t1", "t2", "t3"]
    assert directory.shape("t2") == (100,) and directory.dtype("t2") == "F32"
    np.testing.assert_array_equal(directory.get("t3"), np.full(2, 3, np.float32))


def test_a_new_save_removes_the_weight_files_of_the_old_one(tmp_path):
    files.write(tmp_path, {}, _tensors([4, 6, 100]), max_shard_bytes=40)
    files.write(tmp_path, {}, _tensors([5]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [files.CONFIG, files.SINGLE]
    files.write(tmp_path, {}, _tensors([4, 6]), max_shard_bytes=20)
    assert not (tmp_path / files.SINGLE).exists()
    assert files.HFDirectory(tmp_path).names() == ["t0", "t1"]


def test_bad_writes_and_directories(tmp_path):
    with pytest.raises(ValueError, match="tensors is empty"):
        files.write(tmp_path / "a", {}, [])
    with pytest.raises(ValueError, match="tensor t0 is written twice"):
        files.write(tmp_path / "b", {}, _tensors([2]) * 2)
    with pytest.raises(ValueError, match="max_shard_bytes must be > 0"):
        files.write(tmp_path / "c", {}, _tensors([2]), max_shard_bytes=0)
    files.write(tmp_path / "d", {}, _tensors([2]))
    (tmp_path / "d" / files.INDEX).write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match=r"has both model\.safetensors and"):
        files.HFDirectory(tmp_path / "d")
    (tmp_path / "d" / files.SINGLE).unlink()
    (tmp_path / "d" / files.INDEX).write_text(json.dumps({"shards": []}))
    with pytest.raises(ValueError, match="has no weight_map"):
        files.HFDirectory(tmp_path / "d")
