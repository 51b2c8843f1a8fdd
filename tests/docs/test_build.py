"""The pieces of `python -m docs.build` (the `docs` extra): the docstring check, sections of the
guides, formulas to MathML and names to cross-references. The whole build runs in CI
(`.ci/run`), with warnings as errors, and `test_site.py` opens its pages in Chromium."""

import types

import pytest

pytest.importorskip("mkdocs", reason="the `docs` extra")

from mkdocs.exceptions import PluginError

from docs import build, hooks


def test_every_public_name_has_a_docstring():
    assert build.undocumented() == []


def test_a_missing_docstring_is_found(monkeypatch):
    import griffe

    real = griffe.GriffeLoader.load

    def load(self, name, *args, **kwargs):
        module = real(self, name, *args, **kwargs)
        module.members["ops"].members["ssd"].members["ssd"].docstring = None
        return module

    monkeypatch.setattr(griffe.GriffeLoader, "load", load)
    # `seqlab.ops.ssd` is the function of the module it shadows (both documented on one page).
    assert build.undocumented(("seqlab.ops",)) == ["seqlab.ops.ssd.ssd"]


def test_section_takes_a_heading_with_its_subsections(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "SRC", tmp_path / "src")
    (tmp_path / "fig.png").write_bytes(b"png")
    source = tmp_path / "README.md"
    source.write_text("# T\n\n## A\n\none ![f](fig.png)\n\n### A.1\n\ntwo\n\n## B\n\nthree\n")
    monkeypatch.setattr(build, "ROOT", tmp_path)
    assert build.section(source, "A") == "one ![f](fig.png)\n\n### A.1\n\ntwo"
    assert (tmp_path / "src" / "fig.png").read_bytes() == b"png"  # the image travels along
    with pytest.raises(build.BuildError, match="no section '## C'"):
        build.section(source, "C")
    source.write_text("## A\n\nsee [the guide](OTHER.md)\n")
    with pytest.raises(build.BuildError, match=r"OTHER\.md"):
        build.section(source, "A")


def test_formulas_become_mathml():
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="api/ops.md"))
    html = (
        '<p>with <span class="arithmatex">\\(\\gamma &lt; 0\\)</span></p>'
        '<div class="arithmatex">\\[S_t = e^{g_t} S_{t-1}\\]</div>'
    )
    out = hooks.on_page_content(html, page)
    assert "arithmatex" not in out and out.count("<math") == 2
    assert 'display="block"' in out and 'display="inline"' in out
    assert "&#x0003C;" in out or "&lt;" in out  # the unescaped "<" came through as an operator
    for bad in ("x^", "\\operatorname{diag}(x) \\foo y"):  # incomplete; an unknown command
        with pytest.raises(PluginError, match=r"api/ops\.md"):
            hooks.on_page_content(f'<span class="arithmatex">\\({bad}\\)</span>', page)


def test_names_become_optional_cross_references():
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="index.md"))
    html = (
        "<p>see <code>seqlab.ops.ssd</code> and <code>jax.lax.scan</code></p>"
        "<pre><code>seqlab.ops.ssd</code></pre>"
        '<a href="x"><code>seqlab.ops.kda</code></a>'
    )
    out = hooks.on_page_content(html, page)
    assert out.count("<autoref") == 1
    assert '<autoref identifier="seqlab.ops.ssd" optional><code>seqlab.ops.ssd</code>' in out
    assert "<pre><code>seqlab.ops.ssd</code></pre>" in out
