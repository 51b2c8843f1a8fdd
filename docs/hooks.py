"""MkDocs hooks of the site (`docs/mkdocs.yml`): equations to MathML, seqlab names to links.

- `pymdownx.arithmatex` marks `$...$` and `$$...$$` in pages and docstrings; they become MathML
  here (latex2mathml), which browsers render without JavaScript or a CDN. A formula that does not
  convert fails the build, naming the page.
- Inline code that names a documented object (`` `seqlab.ops.ssd` ``) becomes a cross-reference:
  an optional autoref, resolved by mkdocs-autorefs after every page is rendered (names that are
  not documented, private modules say, stay plain code).
"""

import html
import re

from latex2mathml.converter import convert
from mkdocs.exceptions import PluginError

MATH = re.compile(
    r'<(?P<tag>span|div) class="arithmatex">\s*\\(?P<open>[(\[])(?P<tex>.*?)\\[)\]]\s*</(?P=tag)>',
    re.S,
)
UNKNOWN = re.compile(r">(\\[A-Za-z]+)<")
# `<pre>` blocks and links, where names stay as they are.
PRE = re.compile(r"(<pre.*?</pre>|<a .*?</a>)", re.S)


def _mathml(match: re.Match, where: str) -> str:
    tex = html.unescape(match["tex"]).strip()
    display = "block" if match["open"] == "[" else "inline"
    try:
        mathml = convert(tex, display=display)
    except Exception as e:  # latex2mathml raises several types; name the formula and the page
        raise PluginError(f"{where}: cannot render the formula {tex!r}: {e}") from e
    unknown = UNKNOWN.findall(mathml)  # latex2mathml passes commands it lacks through as text
    if unknown:
        raise PluginError(f"{where}: the formula {tex!r} uses {unknown}, which MathML lacks")
    return mathml


def _link_names(text: str) -> str:
    return re.sub(
        r"<code>(seqlab(?:\.\w+)+)</code>",
        lambda m: f'<autoref identifier="{m[1]}" optional><code>{m[1]}</code></autoref>',
        text,
    )


def on_page_content(html_text: str, page, **kwargs) -> str:
    html_text = MATH.sub(lambda m: _mathml(m, page.file.src_path), html_text)
    parts = PRE.split(html_text)  # odd indices: <pre> blocks and links, left alone
    return "".join(p if i % 2 else _link_names(p) for i, p in enumerate(parts))
