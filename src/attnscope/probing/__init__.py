"""Linguistic probing of attention heads: dependency relations, coreference, attention-only probes.

Following Clark et al. 2019 ("What does BERT look at?") and Coenen et al. 2019, on word-level
attention (sum over the attended word's pieces, mean over the attending word's pieces), for any
model attnscope can load. Layers and heads are 0-indexed everywhere.

>>> from attnscope.probing import probe_dependencies, probe_coref, probe_edges
>>> deps = probe_dependencies("minilm")                      # doctest: +SKIP
>>> deps.headline()["any_relation_acc"]                      # doctest: +SKIP

Data: CoNLL-U files (:func:`read_conllu`), raw text parsed by spaCy as silver annotation
(:func:`parse_texts`), or the shipped silver sample of 1,000 Brown sentences
(:func:`shipped_treebank`); Winograd items from BIG-bench ``winowhy`` (:func:`winowhy_items`).
Reading CoNLL-U needs ``conllu`` and parsing needs spaCy: ``pip install "attnscope[probing]"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

# public name -> module that defines it; imported on first use so `attnscope --help` stays fast


if TYPE_CHECKING:
    from .chains import ChainsResult as ChainsResult
    from .coref import CorefItem as CorefItem
    from .coref import CorefResult as CorefResult
    from .coref import winowhy_items as winowhy_items
    from .dependencies import DependencyResult as DependencyResult
    from .probes import ProbeResult as ProbeResult
    from .run import probe_chains as probe_chains
    from .run import probe_coref as probe_coref
    from .run import probe_dependencies as probe_dependencies
    from .run import probe_edges as probe_edges
    from .treebank import Sentence as Sentence
    from .treebank import Treebank as Treebank
    from .treebank import load_treebank as load_treebank
    from .treebank import parse_texts as parse_texts
    from .treebank import read_conllu as read_conllu
    from .treebank import shipped_treebank as shipped_treebank

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
