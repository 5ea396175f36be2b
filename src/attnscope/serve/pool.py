"""The explorer's models: loaded once, kept warm, one request at a time per model.

A request holds its model's lock for the whole computation. Interventions that skip sublayers
put forward hooks on the model's modules, and a hook would leak into any other request running
on the same model at that moment; with one lock per model, requests on different models still
run side by side.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import AttnscopeError
from ..models.loading import LoadedModel, check_device
from .schema import ModelFacts, loaded_facts, model_facts


@dataclass(frozen=True)
class ModelChoice:
    """A model the page may pick: ``name`` as the user sees it, ``source`` as load_model takes it."""

    name: str
    source: str
    description: str


class UnknownModel(AttnscopeError):
    """A model name the server does not offer."""


def default_choices(extra: Sequence[str] = (), installed_aliases: bool = True) -> list[ModelChoice]:
    """The models given with ``--model`` first (aliases or local folders), then (``installed_aliases``)
    every installed alias.

    Aliases built on first use count as installed when their source is (the toy translator, gemma3).
    """
    from ..models.registry import ALIASES

    choices = {}
    for given in extra:
        alias = ALIASES.get(given)
        name = given if alias else Path(given).name or given
        choices[name] = ModelChoice(name, given, alias.description if alias else f"local model {given}")
    for alias in ALIASES.values() if installed_aliases else ():
        if alias.name not in choices and (alias.buildable or alias.installed):
            choices[alias.name] = ModelChoice(alias.name, alias.name, alias.description)
    return list(choices.values())


def _source_facts(source: str) -> ModelFacts | None:
    """The facts of an alias (its files, or its model type while it is not built yet) or of a local model."""
    from ..models.registry import ALIASES

    alias = ALIASES.get(source)
    if alias is None:
        return model_facts(Path(source).expanduser())
    return model_facts(alias.locate(), alias.architecture)


class ModelPool:
    """Named models, each loaded on first use (or by :meth:`preload`) and kept for the server's life."""

    def __init__(self, choices: list[ModelChoice], dtype: str = "float32", loaded: Sequence[LoadedModel] = (),
                 device: str = "cpu") -> None:
        """``loaded``: models already in memory (e.g. in a notebook), offered first under their names."""
        given = [ModelChoice(model.name, str(model.source), f"{model.name} (loaded by the caller)") for model in loaded]
        choices = given + [choice for choice in choices if choice.name not in {model.name for model in loaded}]
        if not choices:
            raise AttnscopeError("no model to serve: install one (attnscope models) or pass --model FOLDER")
        self.choices = {choice.name: choice for choice in choices}
        check_device(device)  # a server whose models cannot load is not started
        self.dtype, self.device = dtype, device
        self._models: dict[str, LoadedModel] = {model.name: model for model in loaded}
        self._locks = {name: threading.Lock() for name in self.choices}
        self._facts: dict[str, ModelFacts | None] = {}

    @property
    def default(self) -> str:
        return next(iter(self.choices))

    def facts(self, name: str) -> ModelFacts | None:
        """What requests may ask of model ``name`` (see :mod:`.schema`), read once without loading it."""
        if name not in self._facts:
            self._facts[name] = loaded_facts(self._models[name]) if name in self._models else _source_facts(
                self.choices[name].source)
        return self._facts[name]

    @property
    def generator(self) -> str | None:
        """The first model offered that generates (decoder-only), or None."""
        return next((name for name in self.choices if (facts := self.facts(name)) and facts.generates), None)

    def loaded(self, name: str) -> bool:
        return name in self._models

    def check(self, name: str) -> ModelChoice:
        if name not in self.choices:
            raise UnknownModel(f"unknown model {name!r}; this server offers {', '.join(self.choices)}")
        return self.choices[name]

    def _load(self, name: str) -> LoadedModel:
        """The model, loading it under its lock if this is its first use."""
        if name not in self._models:
            from ..capture.loading import load_model

            loaded = load_model(self.choices[name].source, dtype=self.dtype, device=self.device)
            self._models[name] = replace(loaded, name=name)
        return self._models[name]

    def preload(self, name: str) -> LoadedModel:
        self.check(name)
        with self._locks[name]:
            return self._load(name)

    @contextmanager
    def use(self, name: str) -> Iterator[LoadedModel]:
        """The model ``name``, held alone for the block (other requests on it wait)."""
        self.check(name)
        with self._locks[name]:
            yield self._load(name)
