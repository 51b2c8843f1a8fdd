"""Helpers shared by the claims of several papers."""

from collections.abc import Sequence

import jax
import ml_collections
import numpy as np


def numpy_rng(key: jax.Array) -> np.random.Generator:
    """A numpy generator seeded from a jax key (data generation only)."""
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())


def mqar_data(
    seq_len: int, vocab_size: int, train_kv: Sequence[int], eval_kv: int
) -> ml_collections.ConfigDict:
    """The `data` block of `seqlab.train.make_datasets` for multi-query associative recall:
    training cycles through the key-value counts `train_kv` by step, evaluation uses `eval_kv`."""
    return ml_collections.ConfigDict(
        dict(
            name="mqar",
            seq_len=seq_len,
            vocab_size=vocab_size,
            num_kv_pairs=tuple(train_kv),
            eval_num_kv_pairs=(eval_kv,),
            power_a=0.01,
        )
    )
