"""The explorer's OpenAPI schema says what this server accepts, for the models it offers.

The request models (``app.py``) say what any server takes. What a request may hold also depends
on the model it names, and a server knows its models: which generate (decoder-only), which have a
chat template, which kinds of attention they have, which read a second text as their own (an
encoder-decoder's target). :func:`model_facts` reads these from the model's files without loading
its weights (``config.json`` and the tokenizer's files, or a GGUF file's header), and
:func:`with_model_facts` writes them into the schema: each request body's ``model`` must be one
the server offers, and the options that depend on it are tied to it (``anyOf`` one group of
models per set of facts). A model whose facts cannot be read is offered without such ties.

What still depends on the input and the model together (its token limit, its layers and heads)
is answered with a 422 that says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.architectures import adapter_for
from ..models.loading import LoadedModel


@dataclass(frozen=True)
class ModelFacts:
    """What a request may ask of one model: its ``kinds`` of attention, whether it ``generates``
    (decoder-only), has a ``chat`` template, and reads a second text as its own (``pair_in_measures``:
    an encoder-decoder's target)."""

    kinds: tuple[str, ...]
    generates: bool
    chat: bool

    @property
    def pair_in_measures(self) -> bool:
        return "cross" in self.kinds


def loaded_facts(loaded: LoadedModel) -> ModelFacts:
    """The facts of a model in memory."""
    from ..experiments.interventions import n_heads_per_kind

    return ModelFacts(tuple(n_heads_per_kind(loaded)), not loaded.is_encoder_decoder and loaded.causal,
                      bool(getattr(loaded.tokenizer, "chat_template", None)))


def model_facts(source: Path | None, model_type: str = "") -> ModelFacts | None:
    """The facts of the model at ``source`` (a Hugging Face folder or a .gguf file), read from its
    configuration and tokenizer files, or (no ``source``: a model built on first use) of
    ``model_type`` without a chat template; None when they cannot be read."""
    try:
        model_type, chat = (model_type, False) if source is None else (
            _gguf_facts(source) if source.suffix == ".gguf" else _folder_facts(source))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    rules = adapter_for(model_type).rules  # the adapter table says which attention a model type has
    kinds = tuple(dict.fromkeys(rule.kind for rule in rules))
    # a type read from the model (causal None) is taken for a decoder until it is loaded, as before
    return ModelFacts(kinds, kinds == ("self",) and any(rule.causal is not False for rule in rules), chat)


def _folder_facts(folder: Path) -> tuple[str, bool]:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text(encoding="utf-8")) if tokenizer_config.exists() else {}
    return str(config["model_type"]), bool(settings.get("chat_template")) or any(folder.glob("chat_template.*"))


def _gguf_facts(path: Path) -> tuple[str, bool]:
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    return bytes(fields["general.architecture"].parts[-1]).decode("utf-8"), "tokenizer.chat_template" in fields


# ---- the schema -------------------------------------------------------------------------------------
# request body -> (the option tied to the model, the facts -> its allowed values; None: no tie)
Tie = Callable[[ModelFacts], dict[str, Any] | None]
TIES: dict[str, Tie] = {
    "InterveneRequest": lambda facts: {"kind": {"enum": [*facts.kinds, None]}},
    "MixingRequest": lambda facts: None if facts.pair_in_measures else {"pair": {"type": "null"}},
    "GenerateRequest": lambda facts: None if facts.chat else {"chat": {"const": False}},
}
# request body -> its path: only a decoder-only model answers these (null: the first such model)
DECODER_ONLY = {"GenerateRequest": "/api/generate", "QKRequest": "/api/qk", "RoutesRequest": "/api/routes",
                "HeadScoreRequest": "/api/head-scores", "HeadTrialRequest": "/api/head-trial"}


def with_model_facts(schema: dict[str, Any], facts: Mapping[str, ModelFacts | None], default: str | None,
                     generator: str | None) -> dict[str, Any]:
    """``schema`` (FastAPI's OpenAPI document) with every request body's ``model`` one of ``facts``'
    names (null: ``default``, or for generation, QK attribution, routes and head functions ``generator``, the first
    model that generates) and the options that depend on the model tied to it (:data:`TIES`). Those
    (:data:`DECODER_ONLY`), when no model offered generates, are left out."""
    bodies = schema["components"]["schemas"]
    for name, body in bodies.items():
        if "model" not in body.get("properties", {}):
            continue
        generate = name in DECODER_ONLY
        offered = {model: known for model, known in facts.items() if not generate or (known and known.generates)}
        if not offered:
            continue
        groups = _groups(offered, generator if generate else default, TIES.get(name))
        described = {key: value for key, value in body["properties"]["model"].items() if key != "anyOf"}
        body["properties"]["model"] = {**described, "enum": [*offered, None]}  # one enum: null is no branch to break
        if len(groups) > 1 or any(tie for _, tie in groups):
            ties = [{"properties": {"model": {"enum": names}, **(tie or {})},
                     **({} if None in names else {"required": ["model"]})} for names, tie in groups]  # left out: null
            body["allOf"] = [*body.get("allOf", []), {"anyOf": ties}]
    if generator is None:
        for path in DECODER_ONLY.values():
            schema["paths"].pop(path, None)
    return schema


def _groups(offered: Mapping[str, ModelFacts | None], default: str | None,
            tie: Tie | None) -> list[tuple[list[str | None], dict[str, Any] | None]]:
    """The offered models grouped by what ``tie`` allows them; null (the default model) joins its group."""
    groups: dict[str, tuple[list[str | None], dict[str, Any] | None]] = {}
    for model, known in offered.items():
        allowed = tie(known) if tie and known else None
        names, _ = groups.setdefault(json.dumps(allowed, sort_keys=True), ([], allowed))
        names.append(model)
        if model == default:
            names.append(None)
    return list(groups.values())
