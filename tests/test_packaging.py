"""Every folder of the library is a regular package, so that a wheel holds it.

`pyproject.toml` finds packages with setuptools' `find` (not `find_namespace`), which skips a
folder without `__init__.py`: an editable install still imports it, a wheel does not ship it
(`seqlab/kernels/gated_delta` was such a folder until the documentation build found it).
"""

import pathlib

from setuptools import find_packages

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_folder_with_python_files_is_packaged():
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("seqlab", "theory", "experiments")
        for p in (ROOT / top).rglob("*.py")
    }
    packaged = set(find_packages(str(ROOT), include=["seqlab*", "theory*", "experiments*"]))
    assert folders - packaged == set()
