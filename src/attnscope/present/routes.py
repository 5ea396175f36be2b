"""The page of one route graph (``attnscope routes -o routes.html``): its figure (an inline PNG) and its edge table.

Built as an element tree (the figure's SVG and pandas' table parsed into it), never by pasting markup strings; no
script, so it opens offline anywhere.
"""

from __future__ import annotations

import base64
import io
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..attribution.routes import Routes

STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:80em}table{border-collapse:collapse;font-size:12px}"
         "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}img{max-width:100%;height:auto}")


def routes_page(graph: Routes) -> str:
    """A whole HTML page: a heading, the figure (tokens x layers, width = importance) and every kept edge."""
    figure = io.BytesIO()
    graph.plot().savefig(figure, format="png", dpi=110)
    html = ET.Element("html", lang="en")
    head = ET.SubElement(html, "head")
    ET.SubElement(head, "meta", charset="utf-8")
    ET.SubElement(head, "title").text = f"routes: {graph.model}, position {graph.position}"
    ET.SubElement(head, "style").text = STYLE
    body = ET.SubElement(html, "body")
    ET.SubElement(body, "h1").text = (f"{graph.model}: position {graph.position} "
                                      f"({graph.tokens[graph.position]!r} -> {graph.predicted!r})")
    ET.SubElement(body, "p").text = (f"{len(graph.edges)} edges above tau = {graph.tau}; layers, heads and positions "
                                     "0-indexed. Attention edges: source token -> query through the heads (heads = "
                                     "each head's share of the importance).")
    ET.SubElement(body, "img", alt="route graph: tokens on x, layers on y",
                  src="data:image/png;base64," + base64.b64encode(figure.getvalue()).decode("ascii"))
    body.append(ET.fromstring(graph.to_frame().to_html(index=False, float_format=lambda v: f"{v:.3g}", border=0)))
    return "<!DOCTYPE html>\n" + ET.tostring(html, encoding="unicode", method="html")


def save_routes_page(graph: Routes, path: str | Path) -> Path:
    """Write :func:`routes_page` to ``path``."""
    from .html import write_page

    return write_page(path, routes_page(graph))
