"""The names of the arrays in which a generation record keeps its steps' attribution, written once.

:class:`attnscope.attribution.StepAttribution` writes them (``attnscope generate --attribute``); the record, its
checks, the step table and the step view read them. Shapes: see :class:`~attnscope.records.GenerationRecord`.
"""

from __future__ import annotations

ATTRIBUTION_HEADS = "attribution_heads"  # float32 [step, layer, head]: each head's signed term of the chosen logit
ATTRIBUTION_LOGITS = "attribution_logits"  # float32 [step]: the chosen token's logit, the sum of every term
ATTRIBUTION_TOP = "attribution_top"  # int64 [step, rank, 2]: (layer, head) of the largest |terms|, largest first
ATTRIBUTION_SOURCES = "attribution_sources"  # float32 [step, rank, source_pos]: those heads' terms per source token
LENS_IDS = "lens_ids"  # int64 [step, layer, k]: the logit lens's top tokens at each step's position
LENS_PROBS = "lens_probs"  # float32 [step, layer, k]: their probabilities

ROUTE_EDGES = "route_edges"  # int64 [edge, 8]: step, source (layer, position, kind), target (layer, position, kind), via
ROUTE_IMPORTANCE = "route_importance"  # float32 [edge]: each kept edge's importance
ROUTE_HEADS = "route_heads"  # float32 [edge, head]: an attention edge's per-head split (0 on the other edges)
ROUTE_NODE_KINDS = ("residual", "attention", "ffn")  # the kind codes of route_edges
ROUTE_VIAS = ("attention", "residual", "ffn")  # the via codes of route_edges
ROUTE_ARRAYS = (ROUTE_EDGES, ROUTE_IMPORTANCE, ROUTE_HEADS)

# files of the first version of attribution hold the first two only
ATTRIBUTION_ARRAYS = (ATTRIBUTION_HEADS, ATTRIBUTION_LOGITS, ATTRIBUTION_TOP, ATTRIBUTION_SOURCES, LENS_IDS, LENS_PROBS)
