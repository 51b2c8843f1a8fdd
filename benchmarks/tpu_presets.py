"""Do the `lm` presets fit TPU slices? Memory per chip of the compiled train step, from a CPU.

For each preset and TPU topology, the train step of `experiments/configs/lm.py:data=tokens,
model=PRESET` (bf16 compute, float32 parameters and AdamW state, FSDP over every chip, sequence
4096) is compiled by the real TPU compiler for the topology's abstract devices
(`seqlab.train.aot`; libtpu needed: `pip install -e ".[tpu]"`), at one sequence per chip. Then
at `b = floor((HBM - state) / temporaries)` sequences per chip, the largest batch that fits if
every temporary grew with the batch (they do not all: `b` is a lower bound), compiled to check.
The two compiles give the affine fit `peak(b)`, whose largest fitting batch is reported as a
prediction. Each compile of a 0.4B model takes minutes on a CPU; every compile's result is kept
in a JSON file (`--state`), so a run resumes where it stopped.

    python benchmarks/tpu_presets.py                      # the default pairs
    python benchmarks/tpu_presets.py --pairs=gdn-0.4b@v5e:4x8,gdn-1.3b@v6e:16x16
    python benchmarks/tpu_presets.py --write-results      # also into RESULTS.md
"""

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import cpu_model, replace_section

from experiments import launch
from experiments.configs import lm
from seqlab.train import aot

# v5e-32, v5p-64 (32 chips: v5p counts TensorCores, two per chip) and v6e-256. In the order
# they are measured: the pure Gated DeltaNets and the Mamba-2 hybrid first, on the smallest chip
# (v5e, 16 GiB), then on the others, then the other hybrids.
V5E, V5P, V6E = "v5e:4x8", "v5p:2x4x4", "v6e:16x16"
PAIRS = [
    f"gdn-0.4b@{V5E}",
    f"gdn-1.3b@{V5E}",
    f"gdn-h2-0.4b@{V5E}",
    f"gdn-1.3b@{V6E}",
    f"gdn-0.4b@{V6E}",
    f"gdn-1.3b@{V5P}",
    f"gdn-0.4b@{V5P}",
    f"gdn-h1-0.4b@{V5E}",
    f"gdn-h1-1.3b@{V5E}",
    f"gdn-h2-1.3b@{V5E}",
]
SEQ_LEN = 4096


def compile_train(preset: str, devices, per_chip: int, topology: str) -> dict:
    """Peak HBM per chip of the train step at `per_chip` sequences per chip, or the reason not."""
    config = lm.get_config(f"data=tokens,model={preset}")
    config.unlock()
    config.model.dtype = "bfloat16"
    config.mesh.update(data=1, fsdp=len(devices))
    config.data.seq_len = SEQ_LEN
    config.batch_size = per_chip * len(devices)
    try:
        (step,) = launch.compile_only(config, devices, label=topology, steps=("train",))
    except aot.CompileError as error:
        if not error.out_of_memory:
            raise
        return {"fits": False, "error": str(error.__cause__)[:300]}
    return {
        "fits": step.fits,
        "peak": step.peak,
        "hbm": step.hbm,
        "state": step.peak - step.temporaries,
        "temporaries": step.temporaries,
        "seconds": round(step.seconds, 1),
        "tflops": round(step.flops / 1e12, 2),
    }


def measure(pair: str, state: dict, save, *, bound: bool) -> dict:
    """The compile of `pair` ("preset@topology") at 1 sequence per chip, or (`bound`) at the
    lower bound of the largest batch."""
    preset, topology = pair.split("@")
    runs = state.setdefault(pair, {})
    devices = None

    def at(b: int) -> dict:
        nonlocal devices
        if str(b) not in runs:
            devices = devices or aot.topology_devices(topology)
            runs[str(b)] = compile_train(preset, devices, b, topology)
            print(json.dumps({"pair": pair, "per_chip": b, **runs[str(b)]}), flush=True)
            save()
        return runs[str(b)]

    one = at(1)
    if bound and one["fits"]:
        largest = int((one["hbm"] - one["state"]) // one["temporaries"])
        if largest > 1:
            at(largest)
    return runs


def summary(pair: str, runs: dict) -> dict:
    """The table row: peak at 1 per chip, the largest compiled batch that fits, the affine
    prediction from two compiles."""
    one = runs["1"]
    fitting = [int(b) for b, r in runs.items() if r["fits"]]
    row = {"pair": pair, "one": one, "largest": max(fitting, default=0), "predicted": None}
    sizes = sorted((int(b), r) for b, r in runs.items() if "peak" in r)
    if len(sizes) >= 2:
        (b0, r0), (b1, r1) = sizes[0], sizes[-1]
        slope = (r1["peak"] - r0["peak"]) / (b1 - b0)
        row["predicted"] = b0 + int((one["hbm"] - r0["peak"]) // slope) if slope > 0 else None
    return row


def table(rows: list[dict], state: dict) -> str:
    lines = [
        "| preset | topology (chips) | HBM per chip | peak at 1 seq/chip | fits | largest batch "
        "per chip compiled and fitting (peak) | predicted largest (affine fit) | compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        preset, topology = row["pair"].split("@")
        one = row["one"]
        chips = len(aot.topology_devices(topology))
        peak = aot.size(one["peak"]) if "peak" in one else "compiler: out of HBM"
        hbm = aot.size(one["hbm"]) if one.get("hbm") else "-"
        largest = row["largest"]
        best = state[row["pair"]].get(str(largest), {})
        compiled = f"{largest} ({aot.size(best['peak'])})" if largest else "none"
        lines.append(
            f"| {preset} | {topology} ({chips}) | {hbm} | {peak} | "
            f"{'yes' if one['fits'] else 'no'} | {compiled} | {row['predicted'] or '-'} | "
            f"{one.get('seconds', '-')} s |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default=",".join(PAIRS), help="preset@topology, comma-separated")
    parser.add_argument("--state", default="/tmp/seqlab_tpu_presets.json")
    parser.add_argument("--write-results", action="store_true", help="only the pairs measured")
    args = parser.parse_args()
    state = {}
    if os.path.exists(args.state):
        with open(args.state) as f:
            state = json.load(f)

    def save():
        with open(args.state, "w") as f:
            json.dump(state, f, indent=1)

    pairs = args.pairs.split(",")
    if not args.write_results:
        for bound in (False, True):  # every pair at 1 per chip first, then the bounds
            for pair in pairs:
                measure(pair, state, save, bound=bound)
    rows = [summary(pair, state[pair]) for pair in pairs if "1" in state.get(pair, {})]
    text = table(rows, state)
    print(text)
    if args.write_results:
        replace_section(
            "## TPU presets (compiled from a CPU)",
            "## TPU presets (compiled from a CPU)\n\n"
            f"{datetime.date.today()}, on {cpu_model()} (no TPU), libtpu from PyPI. Command: "
            "`python benchmarks/tpu_presets.py` (then `--write-results`; pairs not listed were not "
            "reached in the time the run had). Train step (forward, "
            "backward, AdamW update) of `experiments/configs/lm.py:data=tokens,model=PRESET`, "
            "bf16 compute, float32 parameters and optimizer state, FSDP over every chip, "
            f"sequence {SEQ_LEN}, the Pallas TPU kernel for Gated DeltaNet. Peak = arguments + "
            "outputs - aliased + temporaries + code, per chip, as the compiled module reports "
            "it. Largest batch: the largest per-chip batch compiled and fitting (the lower bound "
            "of the module docstring); predicted: the affine fit through the two compiles.\n\n"
            + text
            + "\n",
        )


if __name__ == "__main__":
    main()
