"""Self-contained HTML views of an AttentionRecord: one file, or a notebook object.

The page is a fixed skeleton: a container element, the CSS and JS shipped in ``static/``
(inlined, no CDN, no network), and the payload in ``<script type="application/json">`` that the
JS reads with ``JSON.parse``. The JS builds everything else from the payload.

>>> page = view(rec)                        # doctest: +SKIP
>>> page.save("views.html")                 # doctest: +SKIP
>>> page                                    # in Jupyter / JupyterLab: displays the views  # doctest: +SKIP
"""

from __future__ import annotations

import html
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING

from ..records.attention import AttentionRecord
from .payload import LongPayload, Payload, build_payload, to_json

if TYPE_CHECKING:
    from ..analysis.mixing import Mixing

# the order matters: later files use what earlier ones define on window.AttnscopeViews
SCRIPTS = ("decode.js", "scene.js", "head_view.js", "model_view.js", "neuron_view.js", "long_view.js", "app.js")
STYLES = ("views.css",)

# No external resource may load: scripts and styles are inline, images are data:/blob: URLs.
CONTENT_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                  "img-src data: blob:; connect-src data: blob:")

# the root's text is what a reader without JavaScript sees; the views replace it when they draw
FRAGMENT = Template("""<div class="attnscope-root" id="$uid">$summary</div>
<style>$css</style>
<script type="application/json" id="$uid-payload">$payload</script>
<script>$js
AttnscopeViews.mount(document.getElementById("$uid"),
  JSON.parse(document.getElementById("$uid-payload").textContent), $options);
</script>""")

DOCUMENT = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="$policy">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
</head>
<body style="margin:0">
$fragment
</body>
</html>
""")


@cache
def static_text(names: tuple[str, ...]) -> str:
    """The shipped files ``names`` from ``present/static``, joined."""
    folder = resources.files("attnscope.present").joinpath("static")
    return "\n".join(folder.joinpath(name).read_text(encoding="utf-8") for name in names)


def write_page(path: str | Path, page: str) -> Path:
    """Write an HTML page (one clear error line if the file cannot be written) and return its path."""
    from ..files import written

    path = Path(path)
    with written(path) as temporary:
        temporary.write_text(page, encoding="utf-8")
    return path


@dataclass(frozen=True, eq=False)
class AttentionView:
    """The views of one record: ``_repr_html_`` for notebooks, :meth:`save` / :meth:`to_html` for files.

    ``payload`` is a record's payload (``payload.schema.json``) or a long input's
    (``longview.schema.json``, from :func:`attnscope.present.long_view`); the page draws either.
    """

    payload: Payload | LongPayload

    @property
    def views(self) -> list[str]:
        return list(self.payload["views"])

    def fragment(self, element_id: str | None = None, *, from_address: bool = False) -> str:
        """The views as an HTML fragment; each call gets its own element id unless one is given.

        ``from_address``: the page reads its starting view from the address
        (``views.html#view=neuron&layer=2&head=3&query=5``); only for standalone files.
        """
        uid = element_id or f"attnscope-{uuid.uuid4().hex[:12]}"
        options = json.dumps({"hash": from_address})
        return FRAGMENT.substitute(uid=uid, summary=html.escape(summary(self.payload)), css=static_text(STYLES),
                                   js=static_text(SCRIPTS), payload=to_json(self.payload), options=options)

    def to_html(self) -> str:
        """A complete offline HTML document (scripts, styles and data inline; no network).

        Its address can choose the starting view: ``views.html#view=neuron&layer=2&head=3&query=5``
        (0-indexed; ``kind=`` picks the kind of attention, ``norms=1`` the norms, ``measure=alti`` a
        shipped context-mixing measure and ``rollout=1`` its rollout instead of the layer's map).
        """
        return DOCUMENT.substitute(policy=CONTENT_POLICY, title=html.escape(self.payload["title"]),
                                   fragment=self.fragment("attnscope-view", from_address=True))

    def _repr_html_(self) -> str:
        # Jupyter and JupyterLab run inline scripts of trusted outputs; no require.js is involved.
        return self.fragment()

    def save(self, path: str | Path) -> Path:
        """Write the self-contained HTML file and return its path."""
        return write_page(path, self.to_html())

    def with_notes(self, notes: Sequence[str]) -> AttentionView:
        """The same views with ``notes`` first among the lines the page shows above them."""
        return AttentionView({**self.payload, "notes": [*notes, *self.payload["notes"]]})  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"AttentionView(views={self.views}, title={self.payload['title']!r})"


def summary(payload: Payload | LongPayload) -> str:
    """One line saying what the page draws, for readers without JavaScript (and the widget's text form)."""
    if "tokens" in payload:  # a long input's page
        shape = f"{len(payload['tokens'])} tokens"  # type: ignore[typeddict-item]
    else:
        model = payload["model"]  # type: ignore[typeddict-item]
        shape = (f"{model['n_layers']} layers x {model['n_heads']} heads, "
                 f"{len(payload['sides']['input']['tokens'])} tokens")  # type: ignore[typeddict-item]
    return (f"attnscope {', '.join(payload['views'])} view of {payload['title']} ({shape}): "
            "the drawing needs JavaScript")


def view(record: AttentionRecord, views: str | list[str] | tuple[str, ...] = "all", *, norms: bool = True,
         compress: bool = True, title: str | None = None, layer: int | None = None,
         heads: Sequence[int] | None = None, include_layers: Sequence[int] | None = None,
         mixing: Mapping[str, Mixing] | Sequence[Mixing] | None = None) -> AttentionView:
    """The interactive views of ``record``: ``views`` is ``"all"`` or one or more of head, model, neuron.

    The neuron view needs a record extracted with ``qkv=True``; ``"all"`` leaves it out (with a note
    on the page) when there are no queries and keys. ``norms=False`` drops the norm toggle's data.
    As BertViz's arguments: ``layer`` and ``heads`` choose what the page opens on, ``include_layers``
    ships only those layers (a smaller page); all 0-indexed. ``mixing``: context-mixing measures of
    the same text (``attnscope.mixing``), offered by the page's measure control beside α and
    ‖αf(x)‖ (:func:`attnscope.view_text` computes them for you).

    >>> view(rec, layer=2, heads=[0, 5], include_layers=[0, 1, 2])   # doctest: +SKIP
    >>> view(rec, mixing=[attnscope.mixing(model, text, method="alti")])   # doctest: +SKIP
    """
    return AttentionView(build_payload(record, views, norms=norms, compress=compress, title=title, layer=layer,
                                       heads=heads, include_layers=include_layers, mixing=mixing))


def head_view(record: AttentionRecord, *, norms: bool = True, title: str | None = None, layer: int | None = None,
              heads: Sequence[int] | None = None, include_layers: Sequence[int] | None = None) -> AttentionView:
    """Only the head view of ``record`` (BertViz's ``head_view``; arguments as :func:`view`)."""
    return view(record, "head", norms=norms, title=title, layer=layer, heads=heads, include_layers=include_layers)


def model_view(record: AttentionRecord, *, norms: bool = True, title: str | None = None,
               include_layers: Sequence[int] | None = None) -> AttentionView:
    """Only the model view (layers x heads thumbnails) of ``record`` (BertViz's ``model_view``)."""
    return view(record, "model", norms=norms, title=title, include_layers=include_layers)


def neuron_view(record: AttentionRecord, *, norms: bool = True, title: str | None = None, layer: int | None = None,
                heads: Sequence[int] | None = None) -> AttentionView:
    """Only the neuron view of ``record`` (needs queries and keys: extract with ``qkv=True``)."""
    return view(record, "neuron", norms=norms, title=title, layer=layer, heads=heads)
