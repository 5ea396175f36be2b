"""Which arcs a dependency probe scores: UD relations as written, their bases, and Clark et al.'s names.

Every arc of a tree is scored under its relation as written (``nmod:poss``), and a second time
under its base with ``:*`` (``nmod:*`` = every ``nmod`` arc, subtypes included; plain ``nmod``
stays the arcs without a subtype). Reports leave out a ``base:*`` row that holds no subtype.

Clark et al. 2019 report Stanford dependencies of the Penn Treebank (``det``, ``dobj``, ``pobj``,
``poss``). UD names three of them differently, and one is built the other way round; the mapping
used here, :data:`CLARK_MAPPING`, adds these arcs under Clark's name:

* ``det`` is ``det`` (the same name; nothing added);
* ``dobj``: the UD ``obj`` arc (verb -> direct object), as is;
* ``poss``: the UD ``nmod:poss`` arc (possessed noun -> possessor), as is;
* ``pobj``: Stanford makes the preposition the head of its object (``in -> house``); UD makes the
  noun the head of the preposition (``house -case-> in``). For each nominal whose relation is
  ``obl`` or ``nmod`` (any subtype) and that has a ``case`` dependent tagged ``ADP``, one ``pobj``
  arc is added from the nominal (dependent) to that preposition (head), the one nearest before the
  nominal when it has several (``out of the house``: ``of``).

Files already labelled in Clark's scheme (spaCy's silver parses) carry ``dobj``/``pobj``/``poss``
themselves; no UD relation occurs in them that would add an arc, so nothing is counted twice.
"""

from __future__ import annotations

from typing import Any

BASE_SUFFIX = ":*"
CLARK_MAPPING = {
    "det": "UD det (the same relation)",
    "dobj": "UD obj",
    "poss": "UD nmod:poss",
    "pobj": "UD obl/nmod (any subtype) with a case ADP: nominal -> preposition (UD's case arc reversed)",
}
CLARK_RELATIONS = tuple(CLARK_MAPPING)
_RENAMED = {"obj": "dobj", "nmod:poss": "poss"}
_PREPOSITIONAL = ("obl", "nmod")


def base_relation(relation: str) -> str:
    """``nmod:poss`` -> ``nmod``; a relation without subtype is its own base.

    >>> base_relation("nmod:poss"), base_relation("det")
    ('nmod', 'det')
    """
    return relation.split(":", 1)[0]


def labelled_arcs(sentence: Any) -> list[tuple[int, int, str]]:
    """``(dependent, head, label)`` for every label an arc is scored under (0-indexed words).

    >>> from attnscope.probing.treebank import sentence_from_units
    >>> s = sentence_from_units([(w, True, [(w, h, r, u)]) for w, h, r, u in
    ...     [("sat", -1, "root", "VERB"), ("in", 2, "case", "ADP"), ("it", 0, "obl:in", "PRON")]])
    >>> labelled_arcs(s)
    [(1, 2, 'case'), (1, 2, 'case:*'), (2, 0, 'obl:in'), (2, 0, 'obl:*'), (2, 1, 'pobj')]
    """
    labelled = []
    for dep, head, relation in sentence.arcs():
        labelled.append((dep, head, relation))
        labelled.append((dep, head, base_relation(relation) + BASE_SUFFIX))  # shown only where subtypes exist
        if relation in _RENAMED:
            labelled.append((dep, head, _RENAMED[relation]))
        preposition = _preposition_of(sentence, dep) if base_relation(relation) in _PREPOSITIONAL else None
        if preposition is not None:
            labelled.append((dep, preposition, "pobj"))
    return labelled


def _preposition_of(sentence: Any, nominal: int) -> int | None:
    """The ``case`` dependent of ``nominal`` tagged ADP nearest before it (None: it has none)."""
    upos = sentence.upos or ("",) * len(sentence)
    found = [word for word in range(nominal) if sentence.heads[word] == nominal
             and base_relation(sentence.relations[word]) == "case" and upos[word] == "ADP"]
    return found[-1] if found else None
