"""Training data: synthetic tasks and text, each batch a pure function of `(seed, stream, step)`.

`make_datasets(data_config, batch_size=..., seed=...)` turns the `data` block of an experiment
config into a training `Dataset`, named evaluation `Dataset`s and the vocabulary size. The `data`
block has `name` and the fields of that task:

    mqar               seq_len, vocab_size, num_kv_pairs (tuple: training cycles through it by
                       step), eval_num_kv_pairs (tuple: one evaluation set each), power_a
    selective_copying  seq_len, vocab_size, num_tokens
    induction_heads    seq_len, vocab_size
    bytes              seq_len, paths (tuple of text files), eval_fraction; vocabulary 256
    tokens             seq_len, path (a `.npy` of token ids), vocab_size, eval_fraction
"""

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from seqlab.train.data import synthetic, text
from seqlab.train.data.synthetic import IGNORE, batch_rng

__all__ = [
    "DATASETS",
    "IGNORE",
    "Dataset",
    "batch_rng",
    "make_datasets",
    "synthetic",
    "text",
    "vocab_size",
]

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One stream of batches: `batch(step) -> {"inputs", "targets"}`, each `[B, T] int32`.

    `make(rng, step)` builds the batch from the generator `batch_rng(seed, stream, step)`.
    """

    make: Callable[[np.random.Generator, int], Batch]
    seed: int
    stream: int

    def batch(self, step: int) -> Batch:
        """The batch of `step`: a function of (seed, stream, step) alone, so a resumed run reads
        the same batches."""
        return self.make(batch_rng(self.seed, self.stream, step), step)


def _ignore_step(fn: Callable[..., Batch], **kwargs) -> Callable[[np.random.Generator, int], Batch]:
    return lambda rng, step: fn(rng, **kwargs)


def _mqar(data, batch_size: int, seed: int):
    counts = tuple(data.num_kv_pairs)
    if not counts:
        raise ValueError("data.num_kv_pairs must list at least one count")
    common = dict(
        batch_size=batch_size,
        seq_len=data.seq_len,
        vocab_size=data.vocab_size,
        power_a=data.power_a,
    )
    # Fail on a bad size now, not at the first batch.
    for count in {*counts, *data.eval_num_kv_pairs}:
        synthetic.mqar(batch_rng(0, 0, 0), **{**common, "batch_size": 1}, num_kv_pairs=count)

    def train(rng, step):
        return synthetic.mqar(rng, **common, num_kv_pairs=counts[step % len(counts)])

    evals = {
        f"kv{count}": Dataset(_ignore_step(synthetic.mqar, **common, num_kv_pairs=count), seed, i)
        for i, count in enumerate(data.eval_num_kv_pairs, start=1)
    }
    return Dataset(train, seed, 0), evals, data.vocab_size


def _synthetic(fn, fields: tuple[str, ...], data, batch_size: int, seed: int):
    kwargs = dict(batch_size=batch_size, **{name: data[name] for name in fields})
    fn(batch_rng(0, 0, 0), **{**kwargs, "batch_size": 1})  # validates the sizes
    make = _ignore_step(fn, **kwargs)
    return Dataset(make, seed, 0), {"": Dataset(make, seed, 1)}, data.vocab_size


def _text(tokens: np.ndarray, vocab_size: int, data, batch_size: int, seed: int):
    train_tokens, eval_tokens = text.split_tokens(tokens, data.eval_fraction)
    for part in (train_tokens, eval_tokens):
        text.windows(batch_rng(0, 0, 0), tokens=part, batch_size=1, seq_len=data.seq_len)
    sizes = dict(batch_size=batch_size, seq_len=data.seq_len)
    train = _ignore_step(text.windows, tokens=train_tokens, **sizes)
    evals = _ignore_step(text.windows, tokens=eval_tokens, **sizes)
    return Dataset(train, seed, 0), {"": Dataset(evals, seed, 1)}, vocab_size


def _bytes(data, batch_size: int, seed: int):
    return _text(text.read_bytes(tuple(data.paths)), vocab_size(data), data, batch_size, seed)


def _tokens(data, batch_size: int, seed: int):
    tokens = text.load_token_file(data.path)
    return _text(tokens, data.vocab_size, data, batch_size, seed)


DATASETS = {
    "mqar": _mqar,
    "selective_copying": functools.partial(
        _synthetic, synthetic.selective_copying, ("seq_len", "vocab_size", "num_tokens")
    ),
    "induction_heads": functools.partial(
        _synthetic, synthetic.induction_heads, ("seq_len", "vocab_size")
    ),
    "bytes": _bytes,
    "tokens": _tokens,
}
"""`data.name` -> the function building its train and eval `Dataset`s from the config block."""


def vocab_size(data) -> int:
    """The vocabulary size of the config block `data`, without opening any file."""
    if data.name not in DATASETS:
        raise ValueError(f"data.name must be one of {sorted(DATASETS)}, got {data.name!r}")
    return 256 if data.name == "bytes" else data.vocab_size


def make_datasets(data, *, batch_size: int, seed: int) -> tuple[Dataset, dict[str, Dataset], int]:
    """`(train, evals, vocab_size)` for the config block `data` (see the module docstring).

    Raises `ValueError` naming the field for an unknown task or bad sizes, before any batch of the
    run is drawn (each task is built once at batch size 1 to check its sizes).
    """
    if data.name not in DATASETS:
        raise ValueError(f"data.name must be one of {sorted(DATASETS)}, got {data.name!r}")
    return DATASETS[data.name](data, batch_size, seed)
