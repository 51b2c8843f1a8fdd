"""`python -m experiments.launch --compile_only [--topology=...]`: the run's train and eval steps
compiled without data, workdir or accelerator, with the memory and cost their compiled modules
report. On this machine's CPU devices in the default run; for TPU topologies (libtpu's abstract
devices, the real TPU compiler) under the `aot` marker (`pytest -m aot`, the `tpu` extra)."""

import functools
import importlib
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from experiments import launch
from seqlab.train import aot
from seqlab.train import mesh as mesh_lib
from seqlab.train.step import create_state, jit_steps

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(
    p.stem
    for p in (ROOT / "experiments" / "configs").glob("*.py")
    if p.stem not in {"__init__", "base"}
)


def config(name: str, arg: str = "runlocal", **fields):
    cfg = importlib.import_module(f"experiments.configs.{name}").get_config(arg)
    cfg.unlock()
    for dotted, value in fields.items():
        *path, last = dotted.split("__")
        block = cfg
        for part in path:
            block = block[part]
        block[last] = value
    return cfg


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "experiments.launch", "--compile_only", *args]


def test_compile_only_on_this_machine_reads_no_data(tmp_path):
    """The token-file config compiles with a path that does not exist: nothing is opened."""
    cfg = config("lm", "data=tokens,runlocal", data__path=str(tmp_path / "absent.npy"))
    train, evaluate = launch.compile_only(cfg)
    for step in (train, evaluate):
        assert step.temporaries > 0 and step.flops > 0 and step.seconds > 0
        assert step.hbm is None and step.fits  # a CPU has no HBM figure to hold it against
    assert train.aliased > 0  # the donated state is written in place
    assert not train.kernels  # no Mosaic TPU kernel on a CPU


def test_compile_only_needs_no_workdir_and_prints_the_table():
    done = subprocess.run(
        command("--config=experiments/configs/mqar.py:runlocal"),
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^train .* arguments|^step .*arguments", done.stderr, re.M)
    assert re.search(r"^train +\d+\.\d+s", done.stderr, re.M)
    assert re.search(r"^eval +\d+\.\d+s", done.stderr, re.M)


def test_topology_needs_compile_only():
    done = subprocess.run(
        [sys.executable, "-m", "experiments.launch", "--config=experiments/configs/lm.py",
         "--topology=v5e:2x2", "--workdir=/tmp/unused"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--topology needs --compile_only" in done.stderr


# --- TPU topologies, by libtpu -------------------------------------------------------------------


@pytest.mark.aot
@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_compiles_for_a_tpu_slice(name):
    """Each config's runlocal run, FSDP over two chips of a v5e 2x2 slice and data over two."""
    cfg = config(name, mesh__fsdp=2)
    train, evaluate = launch.compile_only(cfg, aot.topology_devices("v5e:2x2"))
    for step in (train, evaluate):
        assert step.hbm == 16 * aot.GiB and step.fits and step.flops > 0
    if cfg.model.name in ("gdn", "hybrid"):  # impl=None is the TPU kernel on a TPU
        assert {"gated_delta_fwd", "gated_delta_bwd"} <= {n for n, _ in train.kernels}
        assert {n for n, _ in evaluate.kernels} == {"gated_delta_fwd"}


@pytest.mark.aot
def test_sequence_parallel_run_compiles_with_the_tpu_kernels():
    """`mesh.seq=2` (the time axis over 2 chips, FSDP over the other 2): the sequence-parallel
    train step compiles with the Mosaic kernels, forward and backward, on the local pieces."""
    cfg = config("lm", mesh__data=1, mesh__fsdp=2, mesh__seq=2)
    train, evaluate = launch.compile_only(cfg, aot.topology_devices("v5e:2x2"))
    assert train.fits and evaluate.fits
    assert {"gated_delta_fwd", "gated_delta_bwd"} <= {n for n, _ in train.kernels}


@pytest.mark.aot
def test_the_kernel_runs_per_shard_under_the_mesh():
    """With batches split over 4 chips the kernel sees a quarter of the batch (shard_map), not
    the whole batch gathered onto every chip."""
    cfg = config("lm", mesh__fsdp=2)
    run = launch.build(cfg, aot.topology_devices("v5e:2x2"), data=False)
    init = functools.partial(create_state, run.model, run.tx, seq_len=cfg.data.seq_len)
    state = jax.eval_shape(init, jax.random.key(0))
    shardings = mesh_lib.state_shardings(state, run.mesh)
    _, eval_fn = jit_steps(run.model.apply, shardings, run.mesh)
    params = aot.abstract(state, shardings).params
    with jax.set_mesh(run.mesh):
        hlo = eval_fn.lower(params, aot.batch_spec(8, cfg.data.seq_len, run.mesh)).compile()
    shapes = re.findall(r"%gated_delta_fwd[.\d]* = \(\w+\[(\d+),", hlo.as_text())
    assert shapes and set(shapes) == {"2"}, shapes  # batch 8 over 4 chips: 2 per kernel call


@pytest.mark.aot
def test_a_run_that_does_not_fit_exits_1_naming_the_step(tmp_path):
    """64 sequences of 32768 bytes per chip: the logits alone take 8 GiB of a v5e's 16 GiB."""
    done = subprocess.run(
        command(
            "--config=experiments/configs/lm.py:runlocal", "--topology=v5e:2x2",
            "--config.data.seq_len=32768", "--config.batch_size=256",
        ),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert re.search(
        r"compile only: (does not fit: train needs|the train step does not fit)", done.stderr
    )


@pytest.mark.aot
def test_topology_command_line():
    done = subprocess.run(
        command("--config=experiments/configs/lm.py:runlocal", "--topology=v6e:2x2"),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 x TPU v6 lite (v6e:2x2), HBM 32 GiB each" in done.stderr
    assert "train step, Mosaic kernels (VMEM): gated_delta_fwd" in done.stderr
