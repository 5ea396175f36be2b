"""State-space, recurrent and linear-attention hybrids: softmax attention on some layers, a recurrent block, a Mamba
mixer or linear attention (no attention weights) at the same place on the others, so each row names the attention
class it records (``classes``): RecurrentGemma, Nemotron-H, Kimi Linear, MiniMax, Zamba (a shared transformer
block), GLM-5 Next, Bailing hybrid.
"""

from __future__ import annotations

from ..adapters import Adapter, SiteRule
from .bridging import Bridge


def _softmax_layers_row(family: str, model_type: str, attention_class: str, linear: str, out_proj: str = "o_proj",
                        sparse: str = "") -> Adapter:
    """A hybrid whose layers' ``self_attn`` is softmax attention (``attention_class``) on some layers and
    ``linear`` attention, which has no weights, on the others: the row names the softmax class."""
    rule = SiteRule("self", r"layers\.(\d+)\.self_attn$", out_proj, causal=True, window="sliding_window",
                    classes=(attention_class,))
    return Adapter(family, (model_type,), (rule,), note=f"its softmax attention layers{sparse}; its other layers' "
                   f"self_attn is {linear} attention, which has no attention weights")


ADAPTERS: tuple[Adapter, ...] = (
    # hybrids: attention on some layers, a recurrent block or Mamba mixer at the same place on the others
    Adapter("recurrent-gemma", ("recurrent_gemma",),
            (SiteRule("self", r"layers\.(\d+)\.temporal_block$", "o_proj", causal=True, window="sliding_window",
                      classes=("RecurrentGemmaAttention",)),),
            note="its attention layers slide over a window; its other layers are recurrent (no attention weights)"),
    Adapter("nemotron-h", ("nemotron_h",),
            (SiteRule("self", r"layers\.(\d+)\.mixer$", "o_proj", causal=True, classes=("NemotronHAttention",)),),
            note="its attention layers; its other layers are Mamba mixers and feed-forward blocks (no attention)"),
    _softmax_layers_row("kimi-linear", "kimi_linear", "KimiLinearAttention", "linear (delta-rule)"),
    _softmax_layers_row("minimax", "minimax", "MiniMaxAttention", "lightning (linear)"),
    Adapter("zamba", ("zamba", "zamba2"),
            (SiteRule("self", r"layers\.(\d+)\.shared_transf(?:ormer)?\.self_attn$", "o_proj", causal=True),),
            note="its hybrid layers' attention (a shared transformer block: one set of weights, or Zamba2's few "
            "with per-layer adapters, each layer its own module); its other layers are Mamba mixers (no attention)"),
    _softmax_layers_row("glm5-next", "glm5_next_text", "Glm5NextTextAttention", "linear",
                        sparse=" (sparse: each query attends to the keys its indexer picks)"),
    # no out_proj: its softmax layers multiply their output by a gate (g_proj) before o_proj, so a head's vector in
    # the residual stream is not α f(x) (the measures that need it are unavailable)
    _softmax_layers_row("bailing-hybrid", "bailing_hybrid", "BailingHybridAttention", "linear (delta-rule)", out_proj=""),
)


BRIDGES: dict[str, Bridge] = {}
