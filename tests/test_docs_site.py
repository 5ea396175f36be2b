"""The documentation site builds offline and strictly, and fetches nothing from the network when opened.

``mkdocs build --strict`` (mkdocs.yml) fails on a broken link or anchor, a page left out of nav, and a docstring
griffe cannot render; the built pages may load scripts, styles, fonts and images only from the site itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (the docs extra: pip install -e '.[docs]')")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
# attributes through which a page makes the browser fetch something
FETCHING = {"script": ("src",), "link": ("href",), "img": ("src", "srcset"), "iframe": ("src",), "source": ("src",),
            "video": ("src",), "audio": ("src",), "embed": ("src",), "object": ("data",)}
REMOTE = re.compile(r"^\s*(?:https?:)?//", re.IGNORECASE)
CSS_REMOTE = re.compile(r"(?:@import\s+|url\(\s*)['\"]?(?:https?:)?//", re.IGNORECASE)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], check=False,
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return out


class _Fetches(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.remote: list[str] = []
        self.mermaid = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for name in FETCHING.get(tag, ()):
            if values.get(name) and REMOTE.match(values[name] or ""):
                self.remote.append(f"<{tag} {name}={values[name]}>")
        if "mermaid" in (values.get("class") or "").split():  # Material fetches mermaid from a CDN for these
            self.mermaid = True


def test_the_site_builds_strictly_with_every_page(site):
    pages = {path.stem for path in (ROOT / "docs").glob("*.md")}
    built = {path.stem for path in site.glob("*.html")}
    assert pages <= built and "index" in built
    assert {path.stem for path in (ROOT / "docs" / "api").glob("*.md")} <= {p.stem for p in (site / "api").glob("*.html")}


def test_the_home_page_is_the_readme_with_links_into_the_site(site):
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "attnscope shows what a transformer" in home
    assert 'href="long-inputs.html"' in home and 'src="img/head_view.png"' in home and "docs/" not in re.findall(
        r'(?:href|src)="([^"]*)"', home)


def test_the_api_reference_is_generated_from_the_docstrings(site):
    reference = (site / "api" / "extract.html").read_text(encoding="utf-8")
    assert 'id="attnscope.extract"' in reference and "extract_corpus" in reference


# a reST role as Markdown leaves it: ":func:" before the code span of its target
LITERAL_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const|type):(?:<code>|`)")


def test_no_page_shows_a_literal_rest_role(site):
    """scripts/griffe_roles.py turns the docstrings' roles into links (where the site documents the target) or code."""
    shown = {str(page.relative_to(site)): LITERAL_ROLE.findall(page.read_text(encoding="utf-8"))
             for page in site.rglob("*.html")}
    assert not {page: roles for page, roles in shown.items() if roles}
    experiments = (site / "api" / "experiments.html").read_text(encoding="utf-8")
    # attribution_patching's docstring says :func:`~.patching.activation_patching` (relative, shown short)
    assert 'href="#attnscope.experiments.activation_patching"><code>activation_patching</code></a>' in experiments
    # a target the site does not document stays code, with its full path as a tooltip
    assert '<span title="attnscope.experiments.interventions.head_mask"><code>head_mask</code></span>' in experiments


def test_the_site_fetches_nothing_from_the_network(site):
    remote, mermaid = [], []
    for page in site.rglob("*.html"):
        parser = _Fetches()
        parser.feed(page.read_text(encoding="utf-8"))
        remote += [f"{page.relative_to(site)}: {fetch}" for fetch in parser.remote]
        mermaid += [str(page.relative_to(site))] * parser.mermaid
    for sheet in site.rglob("*.css"):
        if CSS_REMOTE.search(sheet.read_text(encoding="utf-8", errors="replace")):
            remote.append(f"{sheet.relative_to(site)}: a remote @import or url()")
    assert not remote, f"the site fetches from the network: {remote}"
    assert not mermaid, f"a mermaid diagram makes the theme load mermaid from a CDN: {mermaid}"


def test_the_configuration_keeps_the_build_strict_and_offline():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["strict"] is True and config["theme"]["font"] is False
    assert config["validation"]["nav"]["omitted_files"] == "warn"
    assert config["validation"]["links"]["not_found"] == "warn" and config["validation"]["links"]["anchors"] == "warn"


def test_the_network_check_catches_a_cdn_script_a_font_and_a_mermaid_diagram():
    parser = _Fetches()
    parser.feed('<script src="https://cdn.example/x.js"></script><link rel="stylesheet" href="//fonts.example/f.css">'
                '<img src="img/local.png"><pre class="mermaid">graph</pre>')
    assert parser.remote == ['<script src=https://cdn.example/x.js>', '<link href=//fonts.example/f.css>']
    assert parser.mermaid
    assert CSS_REMOTE.search("@import url('https://fonts.example/css')") and not CSS_REMOTE.search("url(x.woff2)")
