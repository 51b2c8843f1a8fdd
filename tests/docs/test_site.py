"""The built documentation site in a real browser: headless Chromium (Debian's `chromium`) driven
by Playwright opens pages of `site/` (`python -m docs.build`) served over HTTP, and each page
renders: its title, its equations as MathML with a size, its images loaded, its cross-references
as links, and no console error, page error or failed request.

Marked `site` (excluded by default): CI runs `python -m docs.build`, then `pytest -m site`.
`SEQLAB_SITE` names another built site; `SEQLAB_CHROMIUM` another browser binary.
"""

import functools
import http.server
import os
import pathlib
import threading

import pytest

pytestmark = pytest.mark.site

ROOT = pathlib.Path(__file__).resolve().parents[2]
SITE = pathlib.Path(os.environ.get("SEQLAB_SITE", ROOT / "site"))
CHROMIUM = os.environ.get("SEQLAB_CHROMIUM", "/usr/bin/chromium")
# The flags of a closed network: no background services that would try to reach Google.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    if not (SITE / "index.html").is_file():
        pytest.fail(f"no built site in {SITE}: run python -m docs.build first")
    handler = functools.partial(Quiet, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


def visit(browser, url: str, search: str | None = None) -> dict:
    """Open `url` and measure what rendered; with `search`, also type it into the search box
    (keyboard shortcut "s") and count the results."""
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    problems = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    page.goto(url, wait_until="load")
    page.wait_for_load_state("networkidle")
    seen = page.evaluate(
        """() => ({
        title: document.title,
        h1: document.querySelector("article h1")?.textContent ?? "",
        math: [...document.querySelectorAll("article math")].map(m => {
          const r = m.getBoundingClientRect();
          return {width: r.width, height: r.height, display: m.getAttribute("display"),
                  css: getComputedStyle(m).display};
        }),
        images: [...document.querySelectorAll("article img")].map(i => ({
          src: i.getAttribute("src"), loaded: i.complete && i.naturalWidth > 0})),
        links: document.querySelectorAll("article a.autorefs-internal").length,
      })"""
    )
    if search is not None:
        page.keyboard.press("s")
        page.keyboard.type(search)
        page.locator(".md-search-result__item").first.wait_for(timeout=10_000)
        seen["results"] = page.locator(".md-search-result__item").count()
    page.close()
    return {**seen, "problems": problems}


def test_home_and_search(server, browser):
    seen = visit(browser, f"{server}/index.html", search="gated delta")
    assert seen["results"] > 0  # the search index loaded and answers
    assert seen["title"].startswith("seqlab"), seen["title"]
    assert seen["images"] and all(i["loaded"] for i in seen["images"]), seen["images"]
    assert seen["links"] > 0  # the tour's `seqlab.ops.sequence_parallel` and others
    assert not seen["problems"], seen["problems"]


def test_api_page(server, browser):
    seen = visit(browser, f"{server}/api/ops.html")
    assert "seqlab.ops" in seen["title"] and "seqlab.ops" in seen["h1"], seen["title"]
    blocks = [m for m in seen["math"] if m["display"] == "block"]
    assert len(blocks) >= 5, seen["math"]  # the ops' recurrences, e.g. the gated delta rule
    # Laid out by the browser's MathML engine (CSS display "math" / "block math"), with a size.
    assert all("math" in m["css"] for m in seen["math"]), seen["math"]
    assert all(m["width"] > 5 and m["height"] > 8 for m in seen["math"]), seen["math"]
    assert seen["links"] > 0
    assert not seen["problems"], seen["problems"]


def test_theory_page(server, browser):
    seen = visit(browser, f"{server}/theory/ssm_bottleneck.html")
    assert "(2501.00658)" in seen["title"] and seen["h1"].startswith("ssm_bottleneck"), seen
    figures = [i for i in seen["images"] if "figures/" in i["src"]]
    assert len(figures) >= 3 and all(i["loaded"] for i in figures), seen["images"]
    assert not seen["problems"], seen["problems"]


def test_notebook_page(server, browser):
    seen = visit(browser, f"{server}/notebooks/metastability.html")
    outputs = [i for i in seen["images"] if "_files/" in i["src"]]
    assert len(outputs) >= 10 and all(i["loaded"] for i in outputs), seen["images"]
    assert not seen["problems"], seen["problems"]
