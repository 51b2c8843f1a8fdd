"""The import direction of DESIGN.md section 1, enforced on the source text.

`experiments -> train -> modules -> ops -> kernels`; dynamics/sketching/analysis may import ops and
modules; interop and serving may import modules and ops, never train; nothing in seqlab imports
theory, experiments, benchmarks, notebooks or docs.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = {"theory", "experiments", "benchmarks", "notebooks", "docs", "tests"}

# For each subpackage of seqlab, the seqlab subpackages it may import (itself always allowed).
ALLOWED = {
    "kernels": set(),
    "ops": {"kernels"},
    "modules": {"ops", "kernels"},
    "dynamics": {"ops", "modules", "kernels"},
    "sketching": {"ops", "modules", "kernels"},
    "analysis": {"ops", "modules", "kernels"},
    "train": {"modules", "ops", "kernels"},
    "interop": {"modules", "ops", "kernels"},
    "serving": {"modules", "ops", "kernels"},
}


def _imports(path: pathlib.Path) -> list[str]:
    """Absolute module names imported by a file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def _seqlab_files():
    return sorted((ROOT / "seqlab").rglob("*.py"))


@pytest.mark.parametrize("path", _seqlab_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_import_direction(path):
    parts = path.relative_to(ROOT).parts
    sub = parts[1] if len(parts) > 2 else None  # seqlab/<sub>/...; None for seqlab/__init__.py
    for name in _imports(path):
        top, _, rest = name.partition(".")
        assert top not in OUTSIDE, f"{path.name} imports {name}: seqlab never imports {top}/"
        if top != "seqlab" or sub is None or not rest:
            continue
        target = rest.split(".")[0]
        if target == sub or not (ROOT / "seqlab" / target).is_dir():
            continue
        assert sub in ALLOWED, f"seqlab/{sub}/ is not in the layering table of this test"
        assert target in ALLOWED[sub], f"seqlab/{sub}/{path.name} may not import seqlab.{target}"


def test_kernels_do_not_import_ops_or_above():
    for path in (ROOT / "seqlab" / "kernels").rglob("*.py"):
        for name in _imports(path):
            assert not name.startswith(("seqlab.ops", "seqlab.modules", "seqlab.train")), (
                f"{path} imports {name}"
            )


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The checker must flag a forbidden import; guard against a test that cannot fail."""
    bad = ROOT / "seqlab" / "ops" / "_layering_probe.py"
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self: "from seqlab.modules import x\n")
    with pytest.raises(AssertionError, match=r"may not import seqlab\.modules"):
        test_import_direction(bad)
