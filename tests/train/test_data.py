"""Tests of seqlab.train.data: each task against a brute-force reading of its definition,
determinism in (seed, stream, step), the MQAR gap law, text windows, and errors."""

import ml_collections
import numpy as np
import pytest

from seqlab.train.data import IGNORE, batch_rng, make_datasets, synthetic, text

MQAR = dict(batch_size=64, seq_len=48, vocab_size=40, num_kv_pairs=6)


def test_mqar_matches_its_definition():
    """Keys from [1, V/2) and values from [V/2, V), distinct per row; every scored position holds a
    key of the prefix, at an even offset of the query region, and its target is that key's value;
    exactly P positions are scored."""
    batch = synthetic.mqar(batch_rng(3, 0, 5), **MQAR)
    inputs, targets = batch["inputs"], batch["targets"]
    assert inputs.shape == targets.shape == (64, 48)
    assert inputs.dtype == targets.dtype == np.int32
    p, half = MQAR["num_kv_pairs"], MQAR["vocab_size"] // 2
    for row_in, row_t in zip(inputs, targets, strict=True):
        keys, values = row_in[0 : 2 * p : 2], row_in[1 : 2 * p : 2]
        assert len(set(keys)) == p and len(set(values)) == p
        assert keys.min() >= 1 and keys.max() < half
        assert values.min() >= half and values.max() < MQAR["vocab_size"]
        value_of = dict(zip(keys.tolist(), values.tolist(), strict=True))
        scored = np.flatnonzero(row_t != IGNORE)
        assert len(scored) == p
        assert np.all(scored >= 2 * p) and np.all((scored - 2 * p) % 2 == 0)
        assert sorted(row_in[scored].tolist()) == sorted(keys.tolist())
        for t in scored:
            assert row_t[t] == value_of[row_in[t]]
        assert np.all(row_in[2 * p :] < MQAR["vocab_size"]) and np.all(row_in >= 0)


@pytest.mark.parametrize("num_kv_pairs", [1, 2])
def test_mqar_gap_law(num_kv_pairs):
    """Gap inclusion frequencies match sequential weighted sampling without replacement with
    weights (g + 1)^(a - 1): exact probabilities for P = 1, 2 computed by enumeration."""
    a, seq_len, rows = 0.3, 16, 20000
    p = num_kv_pairs
    batch = synthetic.mqar(
        batch_rng(0, 0, 0),
        batch_size=rows,
        seq_len=seq_len,
        vocab_size=64,
        num_kv_pairs=p,
        power_a=a,
    )
    gaps = (np.argwhere(batch["targets"] != IGNORE)[:, 1] - 2 * p) // 2
    space = (seq_len - 2 * p) // 2
    w = np.arange(1, space + 1) ** (a - 1.0)
    w /= w.sum()
    if p == 1:
        expected = w
    else:  # P(g in sample) = w_g + sum_{h != g} w_h w_g / (1 - w_h)
        expected = np.array(
            [
                w[g] + sum(w[h] * w[g] / (1 - w[h]) for h in range(space) if h != g)
                for g in range(space)
            ]
        )
    freq = np.bincount(gaps, minlength=space) / rows
    sigma = np.sqrt(expected * (1 - expected) / rows)
    np.testing.assert_array_less(np.abs(freq - expected), 5 * sigma)


def test_selective_copying_matches_its_definition():
    batch = synthetic.selective_copying(
        batch_rng(1, 0, 2), batch_size=16, seq_len=40, vocab_size=12, num_tokens=5
    )
    for row_in, row_t in zip(batch["inputs"], batch["targets"], strict=True):
        context, markers = row_in[:35], row_in[35:]
        data = context[context != 0]
        assert len(data) == 5 and np.all(data >= 2)
        assert np.all(markers == 1)
        np.testing.assert_array_equal(row_t[35:], data)
        assert np.all(row_t[:35] == IGNORE)


def test_induction_heads_matches_its_definition():
    batch = synthetic.induction_heads(batch_rng(1, 0, 2), batch_size=16, seq_len=20, vocab_size=9)
    for row_in, row_t in zip(batch["inputs"], batch["targets"], strict=True):
        triggers = np.flatnonzero(row_in == 1)
        assert len(triggers) == 2 and triggers[1] == 19 and triggers[0] <= 17
        assert row_t[19] == row_in[triggers[0] + 1]
        assert np.all(row_t[:19] == IGNORE)


def _config(**data):
    return ml_collections.ConfigDict(data)


MQAR_CONFIG = dict(
    name="mqar",
    seq_len=32,
    vocab_size=64,
    num_kv_pairs=(2, 4),
    eval_num_kv_pairs=(4, 8),
    power_a=0.01,
)


def test_datasets_are_deterministic_in_seed_stream_and_step():
    train, evals, vocab = make_datasets(_config(**MQAR_CONFIG), batch_size=4, seed=7)
    again, _, _ = make_datasets(_config(**MQAR_CONFIG), batch_size=4, seed=7)
    other_seed, _, _ = make_datasets(_config(**MQAR_CONFIG), batch_size=4, seed=8)
    assert vocab == 64 and sorted(evals) == ["kv4", "kv8"]
    for step in (0, 1, 17):
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(train.batch(step)[key], again.batch(step)[key])
    assert not np.array_equal(train.batch(2)["inputs"], train.batch(4)["inputs"])
    assert not np.array_equal(train.batch(2)["inputs"], other_seed.batch(2)["inputs"])
    assert not np.array_equal(evals["kv4"].batch(0)["inputs"], train.batch(1)["inputs"])
    # The training mixture cycles through the kv counts by step.
    assert [(train.batch(s)["targets"] != IGNORE).sum() for s in range(3)] == [8, 16, 8]


def test_bytes_and_token_file_windows(tmp_path):
    corpus = bytes(range(256)) * 3
    (tmp_path / "a.txt").write_bytes(corpus[:300])
    (tmp_path / "b.txt").write_bytes(corpus[300:])
    data = _config(
        name="bytes",
        seq_len=16,
        paths=(str(tmp_path / "a.txt"), str(tmp_path / "b.txt")),
        eval_fraction=0.25,
    )
    train, evals, vocab = make_datasets(data, batch_size=5, seed=0)
    assert vocab == 256
    flat = np.frombuffer(corpus, np.uint8).astype(np.int32)
    for batch, lo, hi in ((train.batch(3), 0, 576), (evals[""].batch(3), 576, 768)):
        np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
        for row_in, row_t in zip(batch["inputs"], batch["targets"], strict=True):
            start = (
                int(
                    np.flatnonzero(
                        np.all(
                            np.lib.stride_tricks.sliding_window_view(flat[lo:hi], 16) == row_in,
                            axis=1,
                        )
                    )[0]
                )
                + lo
            )
            assert row_t[-1] == flat[start + 16] and start + 16 < hi
    ids = np.random.default_rng(0).integers(0, 1000, 500).astype(np.uint16)
    np.save(tmp_path / "ids.npy", ids)
    tokens = text.load_token_file(str(tmp_path / "ids.npy"))
    assert isinstance(tokens, np.memmap)
    data = _config(
        name="tokens", seq_len=8, path=str(tmp_path / "ids.npy"), vocab_size=1000, eval_fraction=0.1
    )
    train, _, vocab = make_datasets(data, batch_size=3, seed=1)
    batch = train.batch(0)
    assert vocab == 1000 and batch["inputs"].dtype == np.int32
    for row in batch["inputs"]:
        hits = np.all(np.lib.stride_tricks.sliding_window_view(ids[:450], 8) == row, axis=1)
        assert hits.any()


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (synthetic.mqar, dict(MQAR, num_kv_pairs=13), "seq_len"),
        (synthetic.mqar, dict(MQAR, vocab_size=12), "vocab_size"),
        (synthetic.mqar, dict(MQAR, batch_size=0), "batch_size"),
        (synthetic.mqar, dict(MQAR, power_a=0.0), "power_a"),
        (
            synthetic.selective_copying,
            dict(batch_size=2, seq_len=8, vocab_size=9, num_tokens=5),
            "seq_len",
        ),
        (synthetic.induction_heads, dict(batch_size=2, seq_len=8, vocab_size=2), "vocab_size"),
    ],
)
def test_bad_sizes_raise(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(batch_rng(0, 0, 0), **kwargs)


def test_bad_configs_raise(tmp_path):
    with pytest.raises(ValueError, match=r"data\.name"):
        make_datasets(_config(name="nope"), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        make_datasets(_config(**{**MQAR_CONFIG, "eval_num_kv_pairs": (9,)}), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="paths"):
        make_datasets(
            _config(name="bytes", seq_len=4, paths=(str(tmp_path / "x"),), eval_fraction=0.1),
            batch_size=2,
            seed=0,
        )
    with pytest.raises(ValueError, match="step"):
        batch_rng(0, 0, -1)
