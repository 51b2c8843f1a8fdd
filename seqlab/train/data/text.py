"""Language-modeling data from text: the bytes of text files, or token ids from a `.npy` file.

Batches are random windows of a 1-D token array: `inputs = tokens[o : o + T]`,
`targets = tokens[o + 1 : o + T + 1]` for `B` offsets `o` drawn from the generator of the step (see
`synthetic.batch_rng`), so a batch is a pure function of `(seed, stream, step)`. A `.npy` token file
is opened as a read-only memmap: only the windows a batch touches are read.
"""

import pathlib
from collections.abc import Sequence

import numpy as np


def read_bytes(paths: Sequence[str]) -> np.ndarray:
    """The bytes of the files in `paths`, concatenated: `[N] uint8` (tokens 0..255)."""
    if isinstance(paths, str) or not paths:
        raise ValueError(f"paths must be a non-empty sequence of file paths, got {paths!r}")
    missing = [p for p in paths if not pathlib.Path(p).is_file()]
    if missing:
        raise ValueError(f"paths: no such files {missing}")
    return np.concatenate([np.frombuffer(pathlib.Path(p).read_bytes(), np.uint8) for p in paths])


def load_token_file(path: str) -> np.ndarray:
    """Token ids of a `.npy` file as a read-only memmap: `[N]` integer."""
    if not pathlib.Path(path).is_file():
        raise ValueError(f"path: no such file {path!r}")
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"path must hold a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}"
        )
    return tokens


def split_tokens(tokens: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """`(train, eval)`: the first `1 - eval_fraction` of `tokens` and the rest (views, no copy)."""
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    cut = round(len(tokens) * (1 - eval_fraction))
    return tokens[:cut], tokens[cut:]


def windows(
    rng: np.random.Generator, *, tokens: np.ndarray, batch_size: int, seq_len: int
) -> dict[str, np.ndarray]:
    """`batch_size` random windows of `tokens: [N]`: `inputs, targets: [B, T] int32`."""
    if len(tokens) < seq_len + 1:
        raise ValueError(f"tokens must hold >= seq_len + 1 = {seq_len + 1}, got {len(tokens)}")
    offsets = rng.integers(0, len(tokens) - seq_len, batch_size)
    rows = np.asarray(tokens[offsets[:, None] + np.arange(seq_len + 1)], np.int32)
    return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
