"""Hugging Face model directories on disk: `config.json` and safetensors weights, one file
(`model.safetensors`) or several with an index (`model.safetensors.index.json`, whose
`weight_map` names the shard of every tensor).

Reading is lazy and per tensor: `HFDirectory` lists names, shapes and dtypes from the file headers
without reading data, and `get(name)` reads one tensor (the `safetensors` package's numpy API,
memory-mapped). Writing streams tensors into shards that close when the next tensor would take
them past `max_shard_bytes` (a tensor larger than that gets a shard of its own), so with shards a
converted model is held once, plus one shard.
"""

import json
import pathlib
from collections.abc import Iterable

import ml_dtypes  # also registers bfloat16 with numpy, for reading BF16 tensors
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors dtype names -> numpy dtypes (those a model checkpoint holds).
DTYPES = {
    "F64": np.dtype("float64"),
    "F32": np.dtype("float32"),
    "F16": np.dtype("float16"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("int64"),
    "I32": np.dtype("int32"),
}


class HFDirectory:
    """A local Hugging Face model directory, read lazily.

    Attributes:
      path: the directory.
      config: the parsed `config.json`.
      files: tensor name -> the safetensors file holding it.
    """

    def __init__(self, path):
        self.path = pathlib.Path(path).expanduser()
        if not self.path.is_dir():
            raise ValueError(f"path {str(self.path)!r} is not a directory")
        config = self.path / CONFIG
        if not config.is_file():
            raise ValueError(f"path {str(self.path)!r} has no {CONFIG}")
        self.config = json.loads(config.read_text())
        self.files = self._weight_files()
        self._headers = {}  # file -> {name: (shape, dtype)}

    def _weight_files(self) -> dict[str, pathlib.Path]:
        index, single = self.path / INDEX, self.path / SINGLE
        if index.is_file() and single.is_file():
            raise ValueError(f"path {str(self.path)!r} has both {SINGLE} and {INDEX}")
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map")
            files = {name: self.path / shard for name, shard in weight_map.items()}
            for shard in sorted(set(files.values())):
                if not shard.is_file():
                    raise ValueError(f"{index} names the shard {shard.name}, which is missing")
            return files
        if not single.is_file():
            raise ValueError(f"path {str(self.path)!r} has neither {SINGLE} nor {INDEX}")
        with safe_open(single, framework="np") as f:
            return dict.fromkeys(f.keys(), single)

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self.files)

    def _header(self, name: str) -> tuple[tuple[int, ...], str]:
        file = self.files[name]
        if file not in self._headers:
            with safe_open(file, framework="np") as f:
                names = f.keys()
                slices = {key: f.get_slice(key) for key in names}
                self._headers[file] = {
                    key: (tuple(s.get_shape()), s.get_dtype()) for key, s in slices.items()
                }
        if name not in self._headers[file]:
            raise ValueError(f"tensor {name} is indexed in {file.name} but not stored there")
        return self._headers[file][name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from its file's header (no data read)."""
        return self._header(name)[0]

    def dtype(self, name: str) -> str:
        """The safetensors dtype name of tensor `name` ("F32", "BF16", ...)."""
        return self._header(name)[1]

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as a numpy array (its stored dtype)."""
        if self.dtype(name) not in DTYPES:
            raise ValueError(
                f"tensor {name} has dtype {self.dtype(name)}, not one of {sorted(DTYPES)}"
            )
        with safe_open(self.files[name], framework="np") as f:
            return f.get_tensor(name)


def write(
    path,
    config: dict,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    max_shard_bytes: int | None = None,
) -> list[pathlib.Path]:
    """Write a Hugging Face model directory: `config.json` and the `(name, array)` pairs of
    `tensors`, in order, as `model.safetensors` or, when they exceed `max_shard_bytes`, as shards
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`. Tensors are consumed
    one at a time and a shard is written as soon as it is full. The weight files of an earlier
    save in `path` are removed first (as transformers' `save_pretrained` does), so that no reader
    picks stale ones. Returns the weight files."""
    path = pathlib.Path(path)
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    path.mkdir(parents=True, exist_ok=True)
    for stale in [path / SINGLE, path / INDEX, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    (path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards: list[list[str]] = []
    pending: dict[str, np.ndarray] = {}
    seen: set[str] = set()
    pending_bytes, total = 0, 0

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            save_file(pending, path / f"shard-{len(shards):05d}.tmp", metadata={"format": "pt"})
            shards.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, array in tensors:
        array = np.ascontiguousarray(array)
        if max_shard_bytes and pending and pending_bytes + array.nbytes > max_shard_bytes:
            flush()
        if name in seen:
            raise ValueError(f"tensor {name} is written twice")
        seen.add(name)
        pending[name] = array
        pending_bytes += array.nbytes
        total += array.nbytes
    flush()
    if not shards:
        raise ValueError("tensors is empty: a checkpoint needs at least one tensor")
    if len(shards) == 1:
        target = path / SINGLE
        (path / "shard-00000.tmp").replace(target)
        return [target]
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        target = path / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (path / f"shard-{i:05d}.tmp").replace(target)
        files.append(target)
        weight_map.update(dict.fromkeys(names, target.name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
