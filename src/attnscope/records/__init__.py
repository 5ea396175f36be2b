"""What attnscope stores, on the lowest floor: it imports nothing of attnscope but ``errors`` and ``files``.

* :class:`AttentionRecord` (``records.attention``): everything captured for one input;
* :class:`GenerationRecord` and its :class:`Candidate` (``records.generation``): what a decoder
  attended to while it wrote;
* the file format (``records.format``): one safetensors file, the metadata under one header key,
  written whole or streamed layer by layer, read whole or memory-mapped;
* the checks every file passes before it becomes a record (``records.checks``), against the
  written schema ``record.schema.json``;
* records from tensors computed elsewhere (``records.external``).

Views are functions of records (``attnscope.present``); a record never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .attention import AttentionRecord as AttentionRecord
    from .attention import ModelInfo as ModelInfo
    from .attention import Selection as Selection
    from .generation import Candidate as Candidate
    from .generation import GenerationRecord as GenerationRecord

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
