"""Every notebook in notebooks/ executes top to bottom under a real Jupyter kernel ("python3"), from
the repo root, draws its figures, and is committed with the outputs that this execution gives
(`python -m docs.notebooks` regenerates them), so that a code host shows its plots."""

import nbformat
import pytest

from docs import notebooks

NAMES = [p.name for p in notebooks.paths()]
# The theory notebooks draw one figure per claim; the sketching ones at least one.
MIN_FIGURES = {
    "mamba_dynamics.ipynb": 3,
    "ssm_bottleneck.ipynb": 3,
    "metastability.ipynb": 10,
    "neural_ode.ipynb": 2,
}


# The two that take longest (25-40 s each on 2 cores) run with -m slow; their claims are also
# asserted in tests/theory.
SLOW = ("metastability.ipynb", "coordinated_sampling.ipynb")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in NAMES]
)
def test_notebook_executes_to_its_committed_outputs(name):
    path = notebooks.NOTEBOOKS / name
    committed = nbformat.read(path, as_version=4)
    fresh = notebooks.execute(path)  # raises CellExecutionError on the first failing cell
    errors = [o for c in fresh.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    images = notebooks.texts(fresh)
    count = sum(text == "<image/png>" for cell in images for text in cell)
    assert count >= MIN_FIGURES.get(name, 1), f"{name} drew {count} figures"
    stale = notebooks.stale_outputs(committed, fresh)
    assert not stale, (
        f"{name}: committed outputs are stale (python -m docs.notebooks {name}):\n"
        + ("\n".join(stale))
    )


def test_stale_outputs_are_found():
    """The comparison itself: a changed number, a missing figure and extra text are stale; the
    last digits of a float, rounding errors and numpy's column padding are not."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(x)")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="rates: [0.5    0.4464]\n"),
        nbformat.v4.new_output("display_data", data={"image/png": "AAAA", "text/plain": "<Fig>"}),
    ]
    nb.cells = [cell]

    def variant(text, image=True):
        other = nbformat.from_dict(nb)
        other.cells[0].outputs[0].text = text
        if not image:
            other.cells[0].outputs.pop()
        return other

    assert notebooks.stale_outputs(nb, variant("rates: [0.5    0.4464]\n")) == []
    assert notebooks.stale_outputs(nb, variant("rates: [0.5001 0.4464]\n")) == []
    assert notebooks.stale_outputs(nb, variant("rates: [0.5    0.4474]\n"))
    assert notebooks.stale_outputs(nb, variant("rates: [0.5    4e-7]\n"))  # 0.4464 is not tiny
    assert notebooks.stale_outputs(nb, variant("rates: [0.5    0.4464]\n", image=False))
    assert notebooks.stale_outputs(nb, variant("rates: [0.5    0.4464 1.]\n"))
    assert notebooks.stale_outputs(nb, variant("speeds: [0.5    0.4464]\n"))
    # Warnings print absolute paths, which differ between checkouts and environments.
    tiny = "error 2.0122792321330962e-16\n"
    nb.cells[0].outputs[0].text = tiny
    assert notebooks.stale_outputs(nb, variant("error 4.440892098500626e-16\n")) == []
    warn = "/{}/theory/m.py:152: RuntimeWarning: overflow\n/{}/site-packages/jax/x.py:1: W\n"
    nb.cells[0].outputs[0].text = warn.format("work/main", "work/main/.venv/lib/python3.11")
    assert not notebooks.stale_outputs(nb, variant(warn.format("tmp/t1/p", "usr/lib/python3.12")))
    assert notebooks.stale_outputs(nb, variant(warn.format("tmp/t1/p", "x").replace("152", "153")))


def test_every_paper_has_a_notebook():
    from theory import registry

    assert {f"{paper}.ipynb" for paper in registry.PAPERS} <= set(NAMES)
