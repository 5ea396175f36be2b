"""The registry of context-mixing measures: one :class:`Measure` object per measure, name-keyed.

A measure is its name, the label the views' measure control shows, the reference (the paper) its
tooltip and figure titles give, its rollout rule, its aliases, its compute function, and whether
it is an intervention (it needs the model re-run, as value zeroing does). The CLI's ``--measure``
/ ``--method`` choices and help, the views' payload labels, the explorer's measure menu and its
request schema's choices are all read from here, so adding a measure is one
:func:`register_measure` call plus a test.

The built-in measures are registered in ``attnscope.analysis.mixing``, beside their compute
functions, which imports this module (not the reverse: no import circle); so read the registry
through ``attnscope.analysis.mixing``, which re-exports these functions once the built-ins are in.

>>> from attnscope.analysis.mixing import get_measure, measures
>>> [m.name for m in measures()]                                   # doctest: +SKIP
['attention', 'norm', 'norm_residual', 'alti', 'value_zeroing']
>>> get_measure("globenc").label                                   # doctest: +SKIP
'GlobEnc'
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import AttnscopeError

if TYPE_CHECKING:
    import numpy as np

# (layers: one mixing.LayerTensors per layer, distances or None) -> (layer maps, head maps or None); the
# layers' type stays Any here, as mixing imports this module (not the reverse)
Compute = Callable[[Sequence[Any], "np.ndarray | None"], "tuple[np.ndarray, np.ndarray | None]"]


@dataclass(frozen=True)
class Measure:
    """One context-mixing measure.

    ``compute(layers, distances)`` takes one :class:`~attnscope.analysis.mixing.LayerTensors` per
    layer (0-indexed) and, for an ``intervention``, the model's distances ``[layer, q_pos, k_pos]``
    (today: value zeroing's, from re-running each block with each token's value zeroed; None
    otherwise), and returns the layer maps ``[layer, q_pos, k_pos]`` and, for measures defined per
    head, the head maps ``[layer, head, q_pos, k_pos]`` (else None).

    ``residual``: the map already holds the residual stream, so rollout aggregates it as it is;
    without it rollout mixes in the identity, ``0.5 * M + 0.5 * I`` (Abnar & Zuidema 2020).
    ``label``: the views' measure control; ``reference``: its tooltip and figure titles; ``cited``:
    the paper as help texts cite it (empty: none).
    """

    name: str
    label: str
    reference: str
    residual: bool
    compute: Compute
    aliases: tuple[str, ...] = ()
    intervention: bool = False
    cited: str = ""

    @property
    def rollout_residual(self) -> float:
        """The identity's share in each rollout step: 0 for a measure that holds the residual, else 0.5."""
        return 0.0 if self.residual else 0.5


_MEASURES: dict[str, Measure] = {}


def register_measure(measure: Measure) -> Measure:
    """Add ``measure`` to the registry (its name and aliases must be new); returns it."""
    taken = set(_MEASURES) | {alias for known in _MEASURES.values() for alias in known.aliases}
    clash = [name for name in (measure.name, *measure.aliases) if name in taken]
    if clash:
        raise AttnscopeError(f"a mixing measure is already registered as {', '.join(clash)}")
    _MEASURES[measure.name] = measure
    return measure


def unregister_measure(name: str) -> Measure:
    """Remove the measure ``name`` from the registry (tests add and remove their own); returns it."""
    return _MEASURES.pop(name)


def _registry() -> dict[str, Measure]:
    return _MEASURES


def measures() -> list[Measure]:
    """Every registered measure, in the order registered (the built-in ones first)."""
    return list(_registry().values())


def aliases() -> dict[str, str]:
    """Each alias -> the name of its measure (``globenc`` -> ``norm_residual``)."""
    return {alias: m.name for m in measures() for alias in m.aliases}


def measure_choices() -> list[str]:
    """What a ``--measure`` / ``method`` may name: the measures' names, then their aliases."""
    return [*(m.name for m in measures()), *aliases()]


def method_name(method: str) -> str:
    """The canonical name of a measure (``globenc`` is ``norm_residual``), or a clear error."""
    name = aliases().get(method, method)
    if name not in _registry():
        known = aliases()
        also = f" (or {', '.join(known)})" if known else ""
        raise AttnscopeError(f"unknown mixing method {method!r}; choose one of {', '.join(_MEASURES)}{also}")
    return name


def method_names(methods: Sequence[str]) -> list[str]:
    """The canonical names of ``methods``, each once, in the order given."""
    return list(dict.fromkeys(method_name(m) for m in methods))


def get_measure(method: str) -> Measure:
    """The registered measure named ``method`` (or one of its aliases)."""
    return _registry()[method_name(method)]


def measures_help(cited: bool = False) -> str:
    """The measures as help texts list them: ``attention, norm, norm_residual = globenc, ...``; with
    ``cited``, each followed by its paper: ``norm (Kobayashi et al. 2020), ...``."""
    def named(m: Measure) -> str:
        names = " = ".join((m.name, *m.aliases))
        return f"{names} ({m.cited})" if cited and m.cited else names

    return ", ".join(named(m) for m in measures())


class MeasureField(Mapping[str, Any]):
    """A read-only ``{name: field}`` view of the registry, read at each access (so measures
    registered later show up): what the old constant tables (``REFERENCES``, ...) now are."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __getitem__(self, name: str) -> Any:
        return getattr(_registry()[name], self.field)

    def __iter__(self) -> Iterator[str]:
        return iter(list(_registry()))

    def __len__(self) -> int:
        return len(_registry())

    def __repr__(self) -> str:
        return repr(dict(self))


class AliasView(Mapping[str, str]):
    """A read-only ``{alias: name}`` view of the registry, read at each access."""

    def __getitem__(self, alias: str) -> str:
        return aliases()[alias]

    def __iter__(self) -> Iterator[str]:
        return iter(aliases())

    def __len__(self) -> int:
        return len(aliases())

    def __repr__(self) -> str:
        return repr(dict(self))
