"""`python -m experiments.convert` both ways, and fine-tuning a converted checkpoint with
`experiments.launch` (`experiments/configs/finetune.py`, `init_from`)."""

import json

import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from experiments import convert, launch
from experiments.configs import finetune
from seqlab.interop import load_hf
from seqlab.train.workdir import load_model
from tests.interop import hf_models
from tests.interop.hf_models import torch


def test_convert_finetune_and_back(tmp_path, capsys):
    source = hf_models.save(hf_models.build("mamba", vocab_size=256), tmp_path / "hf")
    workdir, tuned, out = tmp_path / "converted", tmp_path / "tuned", tmp_path / "back"
    assert convert.main(["--from", str(source), "--to", str(workdir)]) == 0
    assert "MambaForCausalLM" in capsys.readouterr().out
    config = json.loads((workdir / "config.json").read_text())
    assert (
        config["model"]["name"] == "lm" and config["source"]["architecture"] == "MambaForCausalLM"
    )

    converted = load_hf(source)
    model, params = load_model(workdir)
    assert model == converted.model
    for key, value in flatten_dict(converted.params, sep="/").items():
        assert np.array_equal(np.asarray(flatten_dict(params, sep="/")[key]), value), key

    run = finetune.get_config(f"from={workdir},data=bytes,runlocal")
    assert launch.train(run, str(tuned))["status"] == "done"
    tuned_model, tuned_params = load_model(tuned)
    assert tuned_model == model
    # Started from the converted parameters (8 small steps away), not from a fresh init.
    before = np.asarray(params["embedding"]["embedding"])
    after = np.asarray(tuned_params["embedding"]["embedding"])
    assert 0 < np.linalg.norm(after - before) < 0.05 * np.linalg.norm(before)

    assert convert.main(["--from", str(tuned), "--to-hf", str(out)]) == 0
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_models.CLASSES["mamba"].from_pretrained(out)(tokens).logits.numpy()
    logits = tuned_model.apply({"params": tuned_params}, jnp.asarray(tokens.numpy()))
    rel = np.linalg.norm(np.asarray(logits) - expected) / np.linalg.norm(expected)
    assert rel <= 1e-5


def test_convert_errors_exit_1_before_writing(tmp_path, capsys):
    assert convert.main(["--from", str(tmp_path / "nothing"), "--to", str(tmp_path / "w")]) == 1
    assert "is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
    assert convert.main(["--from", str(tmp_path), "--to-hf", str(tmp_path / "h")]) == 1
    assert "has no config.json" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
