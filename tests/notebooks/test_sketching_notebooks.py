"""The sketching notebooks execute top to bottom under a real Jupyter kernel, from the repo root,
and are committed without outputs."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ("sparse_embeddings.ipynb", "coordinated_sampling.ipynb")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        f"{name} must be committed without outputs"
    )
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{name} drew no figure"
