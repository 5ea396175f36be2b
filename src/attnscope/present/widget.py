"""The views as a notebook widget (anywidget: JupyterLab, Notebook 7, VS Code) with lazy data.

The widget draws with the same JS as the HTML views (``static/*.js``, joined into one ES module
with ``static/widget.js``; shipped in the package, no CDN). Unlike the HTML views it does not
carry the record: its payload holds tokens, shapes and scales only, and the page asks the kernel
for each layer it is about to draw (:func:`~attnscope.present.payload.layer_arrays`), so a saved
notebook stays small whatever the input's length. The selection is in traitlets a user reads,
sets and observes from Python:

>>> w = widget(rec)                          # doctest: +SKIP
>>> w                                        # in a notebook: displays the views  # doctest: +SKIP
>>> w.layer = 3; w.heads = [0, 5]            # the drawing follows              # doctest: +SKIP
>>> w.observe(lambda change: print(change.new), names="selected_token")         # doctest: +SKIP

Where no kernel runs (a notebook viewed as a file) the output shows one line of text saying what
the widget draws; :meth:`AttentionWidget.to_view` gives the self-contained HTML views for files.
Needs the ``notebook`` extra: ``pip install "attnscope[notebook]"``.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from ..errors import AttnscopeError
from ..records.attention import AttentionRecord
from .html import SCRIPTS, STYLES, AttentionView, static_text, summary
from .payload import Payload, build_payload, layer_arrays

if TYPE_CHECKING:
    from ..analysis.mixing import Mixing

try:
    import anywidget
    import traitlets
except ImportError as missing:  # pragma: no cover - the notebook extra is not installed
    raise AttnscopeError(f"the notebook widget needs {missing.name}: pip install \"attnscope[notebook]\"") from None

# the views the widget draws come from the same files as the HTML views; the long view is another page
WIDGET_SCRIPTS = tuple(name for name in SCRIPTS if name != "long_view.js") + ("widget.js",)


class AttentionWidget(anywidget.AnyWidget):  # type: ignore[misc]
    """The head, model and neuron views of one record in a notebook, drawing layers fetched on demand.

    Traitlets (0-indexed, read, set and observe them from Python): ``layer`` (the layer drawn),
    ``heads`` (the heads shown), ``selected_token`` (the query token whose lines are shown alone
    and whose row the neuron view draws; None for none), ``view`` (``head``, ``model`` or ``neuron``).
    """

    _esm = traitlets.Unicode().tag(sync=True)
    _css = traitlets.Unicode().tag(sync=True)
    payload = traitlets.Dict().tag(sync=True)
    layer = traitlets.Int(0).tag(sync=True)
    heads = traitlets.List(traitlets.Int()).tag(sync=True)
    selected_token = traitlets.Int(None, allow_none=True).tag(sync=True)
    view = traitlets.Unicode("head").tag(sync=True)

    def __init__(self, record: AttentionRecord, payload: Payload, **selection: Any) -> None:
        self._record = record
        starting = {"heads": list(range(record.n_heads)), "view": payload["views"][0], **selection}
        super().__init__(_esm=static_text(WIDGET_SCRIPTS), _css=static_text(STYLES), payload=dict(payload), **starting)
        self.on_msg(self._answer)

    # ---- what the page asks -----------------------------------------------------------------
    def _answer(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        """Send the layer the page asked for (``{type: "fetch", id, kind, field, layer}``)."""
        if not isinstance(content, dict) or content.get("type") != "fetch":
            return
        try:
            kind = self._record.kinds[int(content["kind"])]
            packed = layer_arrays(self._record, kind, str(content["field"]), self._checked_layer(content["layer"]))
            self.send({"type": "layer", "id": content["id"], "packed": packed})
        except (AttnscopeError, LookupError, TypeError, ValueError) as error:
            self.send({"type": "layer", "id": content.get("id"), "error": f"cannot fetch that layer: {error}"})

    def _checked_layer(self, value: Any) -> int:
        layer = int(value)
        if not 0 <= layer < self._n_layers:
            raise AttnscopeError(f"layer {layer} is outside 0-{self._n_layers - 1}")
        return layer

    @property
    def _n_layers(self) -> int:
        return max(int(kind["attention"]["shape"][0]) for kind in self.payload["kinds"])

    # ---- the selection, checked when set from Python ------------------------------------------
    @traitlets.validate("layer")
    def _valid_layer(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if not 0 <= value < self._n_layers:
            raise traitlets.TraitError(f"layer {value}: choose a 0-indexed layer from 0 to {self._n_layers - 1}")
        return value

    @traitlets.validate("heads")
    def _valid_heads(self, proposal: Any) -> list[int]:
        heads = sorted({int(head) for head in proposal["value"]})
        n_heads = self._record.n_heads
        if not heads or not all(0 <= head < n_heads for head in heads):
            raise traitlets.TraitError(f"heads {proposal['value']}: choose 0-indexed heads from 0 to {n_heads - 1}")
        return heads

    @traitlets.validate("selected_token")
    def _valid_token(self, proposal: Any) -> int | None:
        value = proposal["value"]
        n_tokens = max(len(side["tokens"]) for side in self.payload["sides"].values())
        if value is not None and not 0 <= int(value) < n_tokens:
            raise traitlets.TraitError(f"selected_token {value}: choose a 0-indexed position from 0 to {n_tokens - 1}")
        return value

    @traitlets.validate("view")
    def _valid_view(self, proposal: Any) -> str:
        if proposal["value"] not in self.payload["views"]:
            raise traitlets.TraitError(f"view {proposal['value']!r}: choose from {', '.join(self.payload['views'])}")
        return str(proposal["value"])

    # ---- outside a running kernel -------------------------------------------------------------
    def to_view(self) -> AttentionView:
        """The same views as a self-contained HTML page (for files and places where no kernel runs)."""
        return AttentionView(build_payload(self._record, self.payload["views"], layer=self.layer, heads=self.heads))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle
        line = summary(cast(Payload, self.payload)).replace("the drawing needs JavaScript", "the drawing needs a running kernel")
        data["text/plain"] = line
        data["text/html"] = f'<div class="attnscope-widget-fallback">{html.escape(line)}</div>'
        return data, metadata

    def __repr__(self) -> str:
        return f"AttentionWidget(layer={self.layer}, heads={self.heads}, selected_token={self.selected_token})"


def widget(record: AttentionRecord, views: str | list[str] | tuple[str, ...] = "all", *, norms: bool = True,
           layer: int = 0, heads: Sequence[int] | None = None, title: str | None = None,
           mixing: Mapping[str, Mixing] | Sequence[Mixing] | None = None) -> AttentionWidget:
    """The notebook widget of ``record``: the views of :func:`attnscope.view`, with the selection in
    traitlets (``layer``, ``heads``, ``selected_token``, ``view``) and layers fetched on demand.
    ``mixing``: context-mixing measures of the same text for the Measure control (shipped whole:
    one small map per layer, no heads)."""
    payload = build_payload(record, views, norms=norms, title=title, lazy=True, mixing=mixing)
    selection: dict[str, Any] = {"layer": layer}
    if heads is not None:
        selection["heads"] = list(heads)
    return AttentionWidget(record, payload, **selection)
