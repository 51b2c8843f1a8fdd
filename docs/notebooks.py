"""`python -m docs.notebooks [NAME ...]`: execute the notebooks and commit them with their outputs.

The notebooks in `notebooks/` are committed executed, so that a code host shows their plots; this
command re-executes them in place (all, or the named ones). `tests/notebooks` executes each again
with `execute` and fails when its committed outputs are stale (`stale_outputs`). Both run the
kernel in the same environment (`KERNEL_ENV`), so that the numbers they print agree on one machine.
"""

import math
import os
import pathlib
import re
import sys

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# The kernel's environment over the caller's: the CPU, one device, XLA:CPU without LLVM's
# optimizations (compiling dominates a notebook's time; the arithmetic is the same IEEE one).
KERNEL_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_backend_optimization_level=0"}

# Printed numbers compare to a relative tolerance: XLA:CPU vectorizes by the host's vector width,
# so another kind of CPU rounds float32 differently, and a quantity derived from sums (a fitted
# slope, a difference) moves more than one rounding. Numbers below TINY in magnitude are rounding
# errors themselves (the notebooks print errors at 1e-16 .. 1e-9) and all count as equal. A change
# of what a notebook shows moves its numbers by far more.
RTOL = 1e-3
TINY = 1e-6
CHECKOUT = re.compile(r"/[^\s'\"<>]*?/(?=(?:seqlab|theory|experiments|notebooks|docs)/)")
SITE_PACKAGES = re.compile(r"/[^\s'\"<>]*/site-packages/")
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def paths(names=()) -> list[pathlib.Path]:
    """The notebooks named `names` (file names, with or without `.ipynb`), else all of them."""
    if not names:
        return sorted(NOTEBOOKS.glob("*.ipynb"))
    found = []
    for name in names:
        path = NOTEBOOKS / (name if name.endswith(".ipynb") else f"{name}.ipynb")
        if not path.is_file():
            raise ValueError(f"no notebook {name!r} in {NOTEBOOKS}")
        found.append(path)
    return found


def execute(path: pathlib.Path, timeout: int = 300) -> nbformat.NotebookNode:
    """The notebook at `path` executed top to bottom from the repository root under a real
    Jupyter kernel ("python3"); raises `CellExecutionError` on the first failing cell."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,  # no timestamps in the committed file
        resources={"metadata": {"path": str(ROOT)}},
    )
    client.execute(env={**os.environ, **KERNEL_ENV})
    return nb


def texts(nb: nbformat.NotebookNode) -> list[list[str]]:
    """Per code cell, its outputs as text: streams, `text/plain` results, errors, and one line
    `<image/png>` per image (images are compared by existence, not by pixels). Absolute paths,
    which warnings print, lose the checkout's and the environment's folders."""
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        out = []
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                out.append(f"{o.name}: {o.text}")
            elif o.output_type == "error":
                out.append(f"error: {o.ename}: {o.evalue}")
            else:
                data = o.get("data", {})
                if "image/png" in data:
                    out.append("<image/png>")
                elif "text/plain" in data:
                    out.append(f"result: {data['text/plain']}")
        cells.append([_relative_paths(text) for text in out])
    return cells


def _relative_paths(text: str) -> str:
    """`text` with `/any/checkout/theory/x.py` as `<repo>/theory/x.py` and
    `/any/venv/.../site-packages/jax/x.py` as `<site-packages>/jax/x.py`."""
    text = SITE_PACKAGES.sub("<site-packages>/", text)
    return CHECKOUT.sub("<repo>/", text)


def _same(committed: str, fresh: str) -> bool:
    """The two texts equal once their numbers are compared to `RTOL` (below `TINY`, equal) and
    their blanks dropped (numpy pads the columns of an array to its widest number)."""
    a, b = NUMBER.split(committed), NUMBER.split(fresh)
    if [re.sub(r"\s+", "", x) for x in a] != [re.sub(r"\s+", "", x) for x in b]:
        return False
    xs, ys = NUMBER.findall(committed), NUMBER.findall(fresh)
    return all(
        x == y
        or math.isclose(float(x), float(y), rel_tol=RTOL)
        or max(abs(float(x)), abs(float(y))) < TINY
        for x, y in zip(xs, ys, strict=True)
    )


def stale_outputs(committed: nbformat.NotebookNode, fresh: nbformat.NotebookNode) -> list[str]:
    """Where the committed notebook's outputs differ from a fresh execution's: one line per code
    cell that differs (its index, the committed and the fresh text); empty when current."""
    old, new = texts(committed), texts(fresh)
    if len(old) != len(new):
        return [f"{len(old)} code cells committed, {len(new)} executed"]
    return [
        f"code cell {i}: committed {a!r}, executed {b!r}"
        for i, (a, b) in enumerate(zip(old, new, strict=True))
        if len(a) != len(b) or not all(_same(x, y) for x, y in zip(a, b, strict=True))
    ]


def main(argv: list[str]) -> int:
    try:
        targets = paths(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in targets:
        print(f"executing {path.relative_to(ROOT)} ...", flush=True)
        nbformat.write(execute(path), path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
