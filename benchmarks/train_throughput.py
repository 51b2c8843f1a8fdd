"""Training throughput of `seqlab.train.Trainer.run` against the old per-step host sync: steps/s of
the `lm` config's runlocal run, and of a larger variant.

    python benchmarks/train_throughput.py                     # runlocal and the larger variant
    python benchmarks/train_throughput.py --variants runlocal --steps 400
    python benchmarks/train_throughput.py --write-results     # also replace the section

Both loops drive the same compiled train step of one `Trainer` on the same batches from a fresh
state. "per-step sync": `Trainer.step` for every step, which reads the metrics back to the host
after each one (one host sync per step: what the loop did before, to name a non-finite step).
"run": `Trainer.run` in a fresh workdir, which keeps the metrics on the device and reads them back
every `log_every` steps (and before a save or an evaluation); its time includes the run's fixed
costs (state init, metrics files, one evaluation of `eval_batches` batches and one checkpoint at
the end), so the ratio understates the loop's gain for short runs. Each time is the median of
`--repeats` runs after a run that compiles. Variants: `runlocal` (the lm config's `runlocal`: a
width-16 model, batch 8 x 32 tokens, whose step is so small that it mostly measures dispatch) and
`larger` (the same config at d_model 128, batch 16 x 256 tokens). CPU here; on an accelerator the
sync stalls the device as well as the host.
"""

import argparse
import datetime
import shlex
import statistics
import sys
import tempfile
import time

import jax
from _common import cpu_model, gpu_model, replace_section

from experiments import launch
from experiments.configs import lm as lm_config

SECTION = "## train throughput: Trainer.run vs a host sync per step (lm config)"
VARIANTS = {
    "runlocal": {},
    "larger": {"model.d_model": 128, "data.seq_len": 256, "batch_size": 16},
}


def make_config(variant: str, steps: int):
    """The lm runlocal config with the variant's overrides, `steps` steps, one evaluation of one
    batch and one checkpoint at the end."""
    config = lm_config.get_config("runlocal")
    with config.unlocked():
        for dotted, value in VARIANTS[variant].items():
            parent, _, leaf = dotted.rpartition(".")
            (launch.get(config, parent) if parent else config)[leaf] = value
        config.update(total_steps=steps, checkpoint_every=steps, eval_every=steps, eval_batches=1)
    return config


def per_step_sync(trainer, config) -> float:
    """Seconds of `config.total_steps` steps of `Trainer.step` (metrics read back every step)."""
    start = time.perf_counter()
    state = trainer.init_state(jax.random.key(config.seed))
    for index in range(config.total_steps):
        state, metrics = trainer.step(state, index)
        if not metrics["finite"]:
            raise RuntimeError(f"non-finite step {index + 1}")
    jax.block_until_ready(state)
    return time.perf_counter() - start


def run(trainer, config) -> float:
    """Seconds of `launch.run_trainer` (`Trainer.run`) in a fresh workdir."""
    with tempfile.TemporaryDirectory() as workdir:
        start = time.perf_counter()
        result = launch.run_trainer(trainer, config, workdir)
        seconds = time.perf_counter() - start
    assert result["status"] == "done", result
    return seconds


def measure(variant: str, steps: int, repeats: int) -> tuple[float, float]:
    """Median seconds of (per-step sync, run) for `steps` steps of the variant."""
    config = make_config(variant, steps)
    trainer = launch.make_trainer(config, launch.build(config))
    per_step_sync(trainer, config)  # compiles the train step
    run(trainer, config)  # compiles the eval step
    times = {"sync": [], "run": []}
    for _ in range(repeats):  # interleaved: a slow spell of the machine hits both
        times["sync"].append(per_step_sync(trainer, config))
        times["run"].append(run(trainer, config))
    return statistics.median(times["sync"]), statistics.median(times["run"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="of " + ",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    rows = [
        "| variant | steps | per-step sync steps/s | run steps/s | run / per-step sync |",
        "|---|---|---|---|---|",
    ]
    for variant in args.variants.split(","):
        sync_s, run_s = measure(variant, args.steps, args.repeats)
        row = (
            f"| {variant} | {args.steps} | {args.steps / sync_s:,.1f} | {args.steps / run_s:,.1f}"
            f" | {sync_s / run_s:.2f} |"
        )
        rows.append(row)
        print(row, flush=True)
    device = jax.devices()[0]
    machine = cpu_model() if device.platform == "cpu" else f"{gpu_model()}; {cpu_model()}"
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    text = "\n".join(
        [
            SECTION,
            "",
            f"{datetime.date.today().isoformat()}; {machine}; {jax.device_count()} x"
            f" {device.device_kind}; jax {jax.__version__}; `{command}`.",
            "Same compiled step and batches; `run` includes one evaluation and one checkpoint at"
            f" the end; median of {args.repeats} runs after a compiling one.",
            "",
            *rows,
            "",
        ]
    )
    if args.write_results:
        replace_section(SECTION, text)
    print(text)


if __name__ == "__main__":
    main()
