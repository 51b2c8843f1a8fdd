"""What every benchmark script shares: timing, the machine's name, and RESULTS.md sections.

Scripts run as `python benchmarks/NAME.py`, so this module is importable as `_common`.
"""

import os
import platform
import re
import statistics
import subprocess
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def median_seconds(fn, *args, repeats: int, warmup: int = 1, sync=None) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls after `warmup` calls (compilation).

    `sync(result)` waits for the result (default: `jax.block_until_ready`).
    """
    if sync is None:
        import jax

        sync = jax.block_until_ready
    for _ in range(warmup):
        sync(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_model() -> str:
    """The CPU's model name and core count."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.*)", f.read())
        name = found.group(1).strip() if found else name
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def gpu_model() -> str:
    """The first GPU's name and memory, from nvidia-smi ("no GPU" without one)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "no GPU"
    return out.stdout.strip().splitlines()[0]


def replace_section(section: str, text: str) -> None:
    """Replace the `## section` of RESULTS.md with `text` (which starts with that heading), or
    append it when the section is new."""
    old = "# Benchmark results\n"
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            old = f.read()
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(old):
        new = pattern.sub(lambda _: text.rstrip("\n") + "\n\n", old)
    else:
        new = old.rstrip("\n") + "\n\n" + text
    with open(RESULTS, "w") as f:
        f.write(new.rstrip("\n") + "\n")
