"""Gemma 2 and 3 (and OLMo 2): Llama's modules with a norm on each sublayer's output before it joins the residual
stream (the logits see it: :data:`POST_NORM_UNEMBEDDING`); Gemma 3 mixes sliding-window layers with global ones
(the window is a fact of each site; transformers builds it into the mask), Gemma 2 soft-caps its logits (the
attention function applies ``softcap``). Gemma 1 is a row of :mod:`.llama`, RecurrentGemma one of :mod:`.hybrids`.
"""

from __future__ import annotations

from ..adapters import Adapter, Unembedding
from .bridging import Bridge
from .llama import LLAMA_BLOCKS, LLAMA_FFN, LLAMA_LIKE, llama_row

POST_NORM_UNEMBEDDING = Unembedding(r"^(?:model\.)?norm$", r"layers\.(\d+)\.post_attention_layernorm$",
                                    r"layers\.(\d+)\.post_feedforward_layernorm$")


ADAPTERS: tuple[Adapter, ...] = (
    # Llama's modules, but a norm on each sublayer's output before the residual (the logits see it)
    llama_row("gemma2", ("gemma2", "olmo2"), POST_NORM_UNEMBEDDING),
    Adapter(
        "gemma3",
        ("gemma3_text",),
        LLAMA_LIKE,
        blocks=LLAMA_BLOCKS,
        ffn=LLAMA_FFN,  # its post-feed-forward RMSNorm maps a zeroed MLP output to zero
        note="sliding-window layers (5 of every 6 in Gemma 3 270M) mixed with global ones; running from a "
        "middle layer onwards is off (its layers take per-layer-type rotary embeddings)",
        unembedding=POST_NORM_UNEMBEDDING,
    ),
)


BRIDGES: dict[str, Bridge] = {}
