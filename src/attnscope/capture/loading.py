"""Loading a model for capture: its weights offline (``models.loading``), wired to the one attention function."""

from __future__ import annotations

from ..models.architectures import LOADED_EAGER
from ..models.loading import LoadedModel, load_weights, with_sites
from ..models.registry import DEFAULT_MODEL
from .attention import ATTN_IMPLEMENTATION, register_attention_function
from .bridges import install_bridges


def load_model(name: str = DEFAULT_MODEL, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load ``name`` offline with attnscope's attention function.

    ``dtype`` is ``"float32"``, ``"bfloat16"`` (several times faster on CPUs with bf16 matmuls)
    or ``"float16"`` (the fast type on most GPUs); the extract benchmark reports the deviation of
    both from float32. ``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or ``"auto"``:
    transformers' ``device_map="auto"`` (accelerate) spreads the layers over every GPU, then the
    CPU, so a model larger than one device runs; capture follows each layer where it runs.

    The model's config names attnscope's attention function: build other models from a copy of it
    (``copy.deepcopy(loaded.model.config)``), since ``from_config(config, attn_implementation=...)`` changes the
    config in place, after which every analysis refuses the model (see ``attnscope.capture.running``).
    """
    register_attention_function()
    source, model, tokenizer = load_weights(name, dtype=dtype, device=device, attn_implementation=ATTN_IMPLEMENTATION,
                                            eager_types=LOADED_EAGER)
    install_bridges(model)  # before the sites are found: a bridge is the site of the module it replaces
    return with_sites(name, source, model, tokenizer, dtype, device)
