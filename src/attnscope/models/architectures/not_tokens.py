"""Types whose attention runs over positions that are not the input's tokens, which attnscope's ``[q_pos, k_pos]``
records cannot hold, and no setting of the model turns off: refused in one line where the model loads (a bridge
that raises), rather than later as a module that never called the attention function. Funnel (pooled positions)
and CPM-Ant (learned prompt positions); Pegasus-X's and LongT5's such attention is refused in :mod:`.bart` and
:mod:`.t5`.
"""

from __future__ import annotations

from ..adapters import Adapter
from .bridging import Bridge, refused

ADAPTERS: tuple[Adapter, ...] = ()


BRIDGES: dict[str, Bridge] = {
    "FunnelRelMultiheadAttention": refused(
        "model type 'funnel' pools its sequence between blocks, so its later layers attend over pooled positions, "
        "which attnscope's [q_pos, k_pos] records cannot hold; attnscope supports no Funnel model yet"),
    "CpmAntAttention": refused(
        "model type 'cpmant' prepends learned prompt positions that every token attends to, which attnscope's "
        "[q_pos, k_pos] records cannot hold (transformers' eager attentions leave them out, so their rows sum to "
        "less than one); no setting of the model turns them off"),
}
