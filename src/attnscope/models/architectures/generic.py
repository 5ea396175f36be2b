"""Model types in no family: their attention modules are read from the model, where transformers' Llama-like and
BART-like models keep them, each module's causality from its ``is_causal`` (or, where it has none, from the mask of
each call); whatever cannot be read with certainty is refused (:func:`~attnscope.models.adapters.find_sites`, and at
capture time: every attention call must come from a site, once per forward pass, with a mask where the module does
not say whether it is causal).
"""

from __future__ import annotations

from ..adapters import Adapter, SiteRule
from .bart import BART_BLOCKS
from .llama import LLAMA_BLOCKS, LLAMA_FFN, LLAMA_UNEMBEDDING

NOTE = ("model type not in the table: its attention modules and their causality are read from the model; "
        "running from a middle layer onwards and the whole-layer measures are off")
GENERIC_DECODER = Adapter(
    "generic (read from the model)", (),
    (SiteRule("self", r"layers\.(\d+)\.(?:self_attn|self_attention|attn|attention)$", "o_proj|out_proj|dense",
              causal=None, window="sliding_window"),),
    LLAMA_BLOCKS, LLAMA_FFN, note=NOTE, unembedding=LLAMA_UNEMBEDDING,
)
GENERIC_ENCODER_DECODER = Adapter(
    "generic encoder-decoder (read from the model)", (),
    (
        SiteRule("encoder", r"encoder\.layers\.(\d+)\.self_attn$", "o_proj|out_proj", causal=None,
                 window="sliding_window"),
        SiteRule("decoder", r"decoder\.layers\.(\d+)\.self_attn$", "o_proj|out_proj", causal=None,
                 window="sliding_window"),
        SiteRule("cross", r"decoder\.layers\.(\d+)\.(?:encoder_attn|cross_attn|cross_attention)$",
                 "o_proj|out_proj", causal=None),
    ),
    BART_BLOCKS, note=NOTE,
)
