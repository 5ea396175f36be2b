"""The explorer's web app: the page, its assets (all from the package, no CDN) and a JSON API.

>>> from attnscope.serve.app import create_app                          # doctest: +SKIP
>>> app = create_app(["minilm"])        # then: uvicorn.run(app, host="127.0.0.1", port=8765)  # doctest: +SKIP

Endpoints (the OpenAPI schema is at ``/openapi.json``, its page at ``/docs``):

* ``GET /api/models``: the models offered, the intervention modes and the pattern classes;
* ``POST /api/analyze``: views payload, each head's pattern and statistics for one input;
* ``POST /api/intervene``: the same input with heads ablated / corrupted or sublayers skipped;
* ``POST /api/record``: one input's attention as plain JSON (the page downloads it);
* ``POST /api/mixing``: one context-mixing measure of one text (ALTI, GlobEnc, value zeroing, ...),
  packed as the views payload packs it (the page's Measure control asks for it on demand);
* ``POST /api/generate``: a decoder generates after a prompt; the step view's payload of every step; with
  ``kv_share``, under a KV budget (``attnscope.generate(kv_budget=...)``: which KV heads streamed, the bytes held);
* ``POST /api/qk``: why a decoder's head scores a key for a query (QK attribution of one attention cell:
  the score and its largest [query component x key component] terms; the views' cell click asks it);
* ``POST /api/routes``: the information-flow route of one prediction of a decoder (``attnscope.routes``:
  the graph as ``Routes.to_dict`` writes it; the Routes tab draws it);
* ``POST /api/head-scores``: one registered head-function score of every layer and head of a decoder
  (``attnscope.head_scores`` at small settings, ``HeadScores.to_dict``; the Head functions tab's grid);
* ``POST /api/head-trial``: one head's attention row on one trial of that score's task, the keys the score reads
  marked (``head_trial``; what the tab shows for a clicked head);
* ``POST /api/sentences``: sentence-level attention of a text (``attnscope.experiments.sentences.sentence_report``,
  Bogdan et al. 2025): its tokens and the sentence panel the step view draws (the Sentences tab draws it).

Every endpoint that loads or runs a model is a POST taking ``Content-Type: application/json``;
GET endpoints never load or run one. :mod:`.guard` checks the Host header, the body size and the
content type before the app sees a request (see there why).

Input the user can fix gets a 4xx with ``{"detail": "<one line>"}``: 400 for a Host the server
does not answer as, 404 for an unknown model, 413 for a body over 1 MB, 415 for a body that is
not JSON, 422 for anything else (empty or too long text, bad head indices, unknown mode). The
request models are strict (no number taken for a boolean or the reverse), so the OpenAPI schema
says what the server accepts. Every request is independent: an error in one never touches the
models or the other requests.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, field_validator

from ..analysis.mixing import measure_choices, measures_help
from ..capture.options import PROMPT_ROWS, PROMPT_ROWS_HELP
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from . import service
from .guard import MAX_BODY_BYTES, AllowedHosts, Guard
from .pool import ModelPool, UnknownModel, default_choices
from .schema import with_model_facts

MAX_TEXT_CHARS = 4000  # checked before tokenizing; the token limit (--max-tokens) is checked after
# a prompt may be a long document (a whole context window: SmolLM2's 8,192 tokens are about 35,000 characters);
# generate() checks its memory before it runs. Written compactly, the largest such body stays under the guard's limit
MAX_PROMPT_CHARS = 100_000
# A text is empty when str.strip() leaves nothing (what extract and service.check_input check):
# it must hold a character that is not white space in Python's sense, all of which lie below
# U+10000. Written as \uXXXX escapes, which Python, Rust (pydantic) and JSON Schema read alike.
WHITE_SPACE = "".join(chr(code) for code in range(0x10000) if chr(code).isspace())
NOT_BLANK = "[^" + "".join(f"\\u{ord(c):04x}" for c in WHITE_SPACE) + "]"
DEFAULT_MAX_TOKENS = 128  # beyond this the views are unreadable and the payload grows quadratically
MAX_QK_TOP = 100  # pairs per table in an /api/qk answer (the page draws one bar each)
DEFAULT_TAU = 0.04  # attribution.routes.TAU, repeated so that importing the app imports no torch (a test holds them equal)
MAX_NEW_TOKENS = 256  # per /api/generate request: the model is held (other requests on it wait) while it writes
# /api/sentences reads a few paragraphs at least (a planned capture: memory grows with the sentences, not the tokens);
# the server's --max-tokens raises it
SENTENCE_TOKENS = 2048
MAX_RECEIVERS = 50

# name -> (package, folder) of every asset the page may load
ASSETS = {
    **{name: ("attnscope.present", "static") for name in
       ("decode.js", "scene.js", "head_view.js", "model_view.js", "neuron_view.js", "app.js", "views.css",
        "routes.js", "steps.js", "steps.css", "sentences.js", "sentences.css")},
    **{name: ("attnscope.serve", "static") for name in ("explorer.js", "explorer.css", "head_functions.js")},
}
MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".png": "image/png"}
# Swagger UI's files, from the swagger-ui-bundle-v2 package (FastAPI's default /docs loads them from a CDN)
DOCS_ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png")
# the schema's page: its own assets, one inline script (FastAPI's start-up of Swagger UI), the schema
DOCS_POLICY = ("default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
               "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'")
# the page loads only its own assets and talks only to this server
CONTENT_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
                  "connect-src 'self' data: blob:; frame-ancestors 'none'")

log = logging.getLogger("attnscope.serve")


def _utf8(value: str | None) -> str | None:
    """Reject text that cannot be encoded (lone surrogates from a JSON ``\\ud800`` escape)."""
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text is not valid Unicode (it holds an unpaired surrogate)") from None
    return value


def _whole_number(value: Any) -> Any:
    """``2.0`` -> ``2``: JSON Schema counts a number with a zero fraction as an integer (a boolean never is)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# a 0-indexed layer or head (the bound before the validator, or the schema shows a raw "ge", not "minimum")
Index = Annotated[int, Field(ge=0), BeforeValidator(_whole_number)]


class StrictRequest(BaseModel):
    """A request body: no coercion between types (``0`` is not ``false``), no unknown keys."""

    model_config = ConfigDict(strict=True, extra="forbid")


class InputText(StrictRequest):
    model: str | None = Field(None, description="a model name from GET /api/models (default: the server's first)")
    text: str = Field(..., min_length=1, max_length=MAX_TEXT_CHARS, pattern=NOT_BLANK,
                      description="the text (first sentence); not only spaces", examples=["I went to the store."])
    pair: str | None = Field(None, min_length=1, max_length=MAX_TEXT_CHARS, pattern=NOT_BLANK,
                             description="second sentence (encoders, decoders) or target text (encoder-decoders); "
                                         "leave it out rather than blank",
                             examples=["At the store, I bought fresh strawberries."])

    _check_text = field_validator("text", "pair")(_utf8)


class AnalyzeRequest(InputText):
    vectors: bool = Field(True, description="ship queries and keys for the neuron view")


def mixing_request() -> type[InputText]:
    """``/api/mixing``'s request model, its ``method`` choices read from the measures registered now
    (built when an app is created, not at import: a measure registered later is offered by the next app)."""
    choices: Any = Literal[tuple(measure_choices())]  # type: ignore[misc]
    method = (choices, Field(..., description=f"the measure: {measures_help(cited=True)}"))
    return create_model("MixingRequest", __base__=InputText, __module__=__name__, method=method)


MixingRequest = mixing_request()
"""The request model as the built-in measures make it (each app builds its own: :func:`mixing_request`)."""


class HeadRef(StrictRequest):
    layer: Index = Field(..., description="0-indexed layer")
    head: Index = Field(..., description="0-indexed head")


# What service.check_change enforces, in the schema: at least one head or layer, and 'skip' takes
# layers only (the mode defaults to 'zero'). Bounds that depend on the model are checked there.
CHANGES_SOMETHING: dict[str, Any] = {"anyOf": [
    {"required": ["heads"], "properties": {"heads": {"minItems": 1},
                                           "mode": {"enum": [mode for mode in service.MODES if mode != "skip"]}}},
    {"required": ["layers"], "properties": {"layers": {"minItems": 1}, "heads": {"maxItems": 0}}},
]}


class InterveneRequest(InputText):
    model_config = ConfigDict(json_schema_extra=CHANGES_SOMETHING)

    mode: Literal[tuple(service.MODES)] = Field("zero", description="; ".join(  # type: ignore[valid-type]
        f"{name}: {text}" for name, text in service.MODES.items()))
    heads: list[HeadRef] = Field(default_factory=list, max_length=4096, description="heads to change")
    layers: list[Index] = Field(default_factory=list, max_length=1024,
                                description="whole layers to change (all their heads; for 'skip' the sublayer)")
    kind: Literal["self", "encoder", "decoder", "cross"] | None = Field(
        None, description="which attention the heads belong to (default: the input side's)")


# What generate() refuses and the schema can say: routes under a KV budget (a streaming head's keys leave a gap)
ROUTES_OR_BUDGET: dict[str, Any] = {"not": {"required": ["routes", "kv_share"], "properties": {
    "routes": {"const": True}, "kv_share": {"type": "number"}}}}


class GenerateRequest(StrictRequest):
    model_config = ConfigDict(json_schema_extra=ROUTES_OR_BUDGET)

    model: str | None = Field(None, description="a decoder-only model from GET /api/models (default: the server's "
                              "first decoder-only model)")
    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, pattern=NOT_BLANK,
                        description="the text the model continues (up to a whole document); not only spaces",
                        examples=["Write one sentence about the sea."])
    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS), BeforeValidator(_whole_number)] = Field(
        16, description=f"tokens to generate (1 to {MAX_NEW_TOKENS}; greedy)")
    chat: bool = Field(False, description="wrap the prompt in the model's chat template")
    prompt_rows: Literal[tuple(PROMPT_ROWS)] = Field("auto", description=PROMPT_ROWS_HELP)  # type: ignore[valid-type]
    attribute: bool = Field(False, description="also each step's direct logit attribution (the heads that pushed the "
                            "chosen token up or down, the tokens they pushed through), from the generation's own "
                            "forward passes")
    lens: bool = Field(False, description="also each step's logit lens (each layer's top tokens; implies attribute)")
    routes: bool = Field(False, description="also each step's information-flow route (Ferrando & Voita 2024) above "
                         "the default tau, from the generation's own forward passes (the step view draws the "
                         "chosen step's)")
    kv_share: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                   description="generate with a KV budget: this share (0-1) of the global layers' KV "
                                   "heads keep every key, the others only kv_sink + kv_window keys (null: no budget)")
    kv_sink: Annotated[int, Field(ge=0), BeforeValidator(_whole_number)] = Field(
        4, description="with kv_share: the first keys a streaming KV head keeps")
    kv_window: Annotated[int, Field(ge=1), BeforeValidator(_whole_number)] = Field(
        64, description="with kv_share: the most recent keys a streaming KV head keeps (sink + window must be shorter "
        "than the text)")
    kv_choose: Literal[tuple(service.KV_CHOICES)] = Field(  # type: ignore[valid-type]
        "retrieval", description="with kv_share: which KV heads stay full: " + "; ".join(
            f"{name}: {text}" for name, text in service.KV_CHOICES.items()))
    kv_seed: Annotated[int, Field(ge=0), BeforeValidator(_whole_number)] = Field(
        0, description="with kv_choose random: the seed of the draw")

    _check_prompt = field_validator("prompt")(_utf8)

    def kv_ask(self) -> service.KVAsk | None:
        """The KV budget asked for, or None without ``kv_share``."""
        if self.kv_share is None:
            return None
        return service.KVAsk(self.kv_share, self.kv_sink, self.kv_window, self.kv_choose, self.kv_seed)


# Exactly one of a QK request's text and token ids (service.qk checks it too, in one line)
# (a key that is present may still be null: each branch says its own key is not)
TEXT_OR_IDS: dict[str, Any] = {"oneOf": [
    {"required": ["text"], "properties": {"text": {"type": "string"}, "ids": {"type": "null"}}},
    {"required": ["ids"], "properties": {"ids": {"type": "array"}, "text": {"type": "null"}}}]}
Position = Annotated[int, BeforeValidator(_whole_number)]


class QKRequest(StrictRequest):
    model_config = ConfigDict(json_schema_extra=TEXT_OR_IDS)

    model: str | None = Field(None, description="a decoder-only model from GET /api/models (default: the server's "
                              "first decoder-only model)")
    text: str | None = Field(None, min_length=1, max_length=MAX_TEXT_CHARS, pattern=NOT_BLANK,
                             description="the text, tokenized as /api/analyze does (or give ids)",
                             examples=["The cat sat on the mat. The cat"])
    ids: list[Index] | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS,
                                    description="token ids instead of a text (the step view sends what was generated)")
    layer: Index = Field(..., description="0-indexed layer")
    head: Index = Field(..., description="0-indexed head")
    query: Position = Field(..., description="0-indexed query position (negative counts from the end)")
    key: Position = Field(..., description="0-indexed key position (negative counts from the end)")
    top: Annotated[int, Field(ge=1, le=MAX_QK_TOP), BeforeValidator(_whole_number)] = Field(
        10, description=f"the largest pairs of each table to return (1 to {MAX_QK_TOP})")

    _check_text = field_validator("text")(_utf8)


class RoutesRequest(StrictRequest):
    model: str | None = Field(None, description="a decoder-only model from GET /api/models (default: the server's "
                              "first decoder-only model)")
    text: str = Field(..., min_length=1, max_length=MAX_TEXT_CHARS, pattern=NOT_BLANK,
                      description="the text, tokenized as /api/analyze does", examples=["The capital of France is"])
    position: Position = Field(-1, description="0-indexed position whose prediction is routed (negative counts from "
                               "the end; default: the last)")
    tau: float = Field(DEFAULT_TAU, ge=0.0, lt=1.0, allow_inf_nan=False,
                       description="the importance an edge must exceed to be kept (Ferrando & Voita 2024's default)")

    _check_text = field_validator("text")(_utf8)


def head_score_request() -> type[StrictRequest]:
    """``/api/head-scores``' request model, its ``score`` choices read from the head-function registry now (built
    when an app is created: a score registered later is offered by the next app)."""
    choices: Any = Literal[tuple(f["name"] for f in service.head_function_choices())]  # type: ignore[misc]
    model: Any = (str | None, Field(None, description="a decoder-only model from GET /api/models (default: the server's "
                               "first decoder-only model)"))
    score = (choices, Field(..., description="a registered head-function score (GET /api/models: head_functions)"))
    return create_model("HeadScoreRequest", __base__=StrictRequest, __module__=__name__, model=model, score=score)


def head_trial_request(scores: type[StrictRequest]) -> type[StrictRequest]:
    """``/api/head-trial``'s request model: a score request and one 0-indexed head."""
    return create_model("HeadTrialRequest", __base__=scores, __module__=__name__,
                        layer=(Index, Field(..., description="0-indexed layer")),
                        head=(Index, Field(..., description="0-indexed head")))
class SentencesRequest(StrictRequest):
    model: str | None = Field(None, description="a model name from GET /api/models (default: the server's first "
                              "decoder-only model, else its first)")
    text: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS, pattern=NOT_BLANK,
                      description="the text: at least two sentences (one ends at . ! ? before a space, or at a new "
                      "line); not only spaces",
                      examples=["The cat sat on the mat. It was happy! Then it left.\nThe dog came in. It barked."])
    proximity: Annotated[int, Field(ge=1, le=64), BeforeValidator(_whole_number)] = Field(
        4, description="a sentence's vertical score averages the sentences at least this many later (Bogdan et al.: 4)")
    top: Annotated[int, Field(ge=1, le=MAX_RECEIVERS), BeforeValidator(_whole_number)] = Field(
        10, description=f"receiver heads listed (1 to {MAX_RECEIVERS})")

    _check_text = field_validator("text")(_utf8)


class Problem(BaseModel):
    detail: str


# answers the guard gives to any request (see guard.py)
REFUSALS: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "a Host header this server does not answer as, or a body that is not UTF-8"},
    413: {"model": Problem, "description": f"a request body over {MAX_BODY_BYTES:,} bytes"}}
ERRORS: dict[int | str, dict[str, Any]] = {
    **REFUSALS,
    404: {"model": Problem, "description": "unknown model"},
    415: {"model": Problem, "description": "a body that is not sent as Content-Type: application/json"},
    422: {"model": Problem, "description": "input the user can fix, including what depends on the model: more tokens "
                                           "than the limit, a head, layer or attention kind the model does not have"}}


def create_app(models: Sequence[str] = (), *, loaded: Sequence[LoadedModel] = (), dtype: str = "float32",
               device: str = "cpu", max_tokens: int = DEFAULT_MAX_TOKENS, preload: bool = True,
               installed_aliases: bool = True, hosts: AllowedHosts | None = None) -> FastAPI:
    """The explorer app serving the already ``loaded`` models, then ``models`` (aliases or folders),
    then (``installed_aliases``) every other installed alias; with only ``loaded``, just those.

    ``preload`` loads the first model now, so the first request does not wait for it. ``hosts``:
    the Host names it answers to (default: the loopback names, ``localhost``, ``127.0.0.1`` and
    ``[::1]``, on the port it is served on).
    """
    choices = default_choices(models, installed_aliases) if models or not loaded else []
    pool = ModelPool(choices, dtype=dtype, device=device, loaded=loaded)
    if preload:
        pool.preload(pool.default)
    app = FastAPI(title="attnscope explorer", version="1", docs_url=None, redoc_url=None,
                  description="Capture, classify and intervene on a transformer's attention. "
                              "Layers and heads are 0-indexed everywhere.")
    app.state.pool = pool
    _add_error_handlers(app)
    _add_page_routes(app)
    _add_api_routes(app, pool, max_tokens)
    _add_model_facts(app, pool)
    json_paths = {getattr(route, "path", "") for route in app.routes if "POST" in getattr(route, "methods", ())}
    app.add_middleware(Guard, hosts=hosts or AllowedHosts.listening_on(), json_paths=frozenset(json_paths))
    return app


def _add_model_facts(app: FastAPI, pool: ModelPool) -> None:
    """The schema says what this server accepts for its models (:mod:`.schema`), read on first request."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            facts = {name: pool.facts(name) for name in pool.choices}
            app.openapi_schema = with_model_facts(FastAPI.openapi(app), facts, pool.default, pool.generator)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _named(model: str | None, default: str) -> str:
    """The model a request names; ``default`` when it names none (null, or the key left out; "" names none
    the server offers, so it is refused as the schema says)."""
    return default if model is None else model


def _problem(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(UnknownModel)
    def unknown_model(request: Request, error: UnknownModel) -> JSONResponse:
        return _problem(404, str(error))

    @app.exception_handler(AttnscopeError)
    def user_error(request: Request, error: AttnscopeError) -> JSONResponse:
        return _problem(422, str(error))

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    def invalid_request(request: Request, error: RequestValidationError | ValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            return _problem(422, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'cannot parse')})")
        where = ".".join(str(part) for part in first.get("loc", ()) if part not in ("body", "query"))
        if first.get("type") in ("string_too_short", "string_pattern_mismatch"):  # the NOT_BLANK rule
            return _problem(422, f"{where} is empty" + (" (leave it out instead)" if where == "pair" else ""))
        return _problem(422, f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg")))

    @app.exception_handler(Exception)
    def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("request %s failed", request.url.path)
        return _problem(500, f"internal error ({type(error).__name__}); the server keeps running")


def _asset(name: str) -> str:
    package, folder = ASSETS[name]
    return resources.files(package).joinpath(folder, name).read_text(encoding="utf-8")


def _docs_asset(name: str) -> bytes:
    from swagger_ui_bundle import swagger_ui_path

    return (Path(swagger_ui_path) / name).read_bytes()


def _add_page_routes(app: FastAPI) -> None:
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        html = resources.files("attnscope.serve").joinpath("static", "explorer.html").read_text(encoding="utf-8")
        return HTMLResponse(html, headers={"Content-Security-Policy": CONTENT_POLICY})

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> HTMLResponse:
        """The schema's page (Swagger UI), its script and style served from here: it works offline."""
        page = get_swagger_ui_html(openapi_url="/openapi.json", title="attnscope explorer: API",
                                   swagger_js_url="/docs-assets/swagger-ui-bundle.js",
                                   swagger_css_url="/docs-assets/swagger-ui.css",
                                   swagger_favicon_url="/docs-assets/favicon-32x32.png")
        page.headers["Content-Security-Policy"] = DOCS_POLICY
        return page

    @app.get("/docs-assets/{name}", include_in_schema=False)
    def docs_asset(name: str) -> Response:
        if name not in DOCS_ASSETS:
            return _problem(404, f"no asset {name!r}")
        return Response(_docs_asset(name), media_type=MEDIA_TYPES[name[name.rindex("."):]],
                        headers={"Cache-Control": "max-age=86400"})

    @app.get("/static/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in ASSETS:
            return _problem(404, f"no asset {name!r}")
        return Response(_asset(name), media_type=MEDIA_TYPES[name[name.rindex("."):]],
                        headers={"Cache-Control": "no-cache"})


def _add_api_routes(app: FastAPI, pool: ModelPool, max_tokens: int) -> None:
    def checked(loaded: Any, request: InputText) -> None:
        service.check_input(loaded, request.text, request.pair, max_tokens)

    @app.get("/api/models", summary="models offered, intervention modes and pattern classes", responses=REFUSALS)
    def models() -> dict[str, Any]:
        return {"default": pool.default, "max_tokens": max_tokens, "max_new_tokens": MAX_NEW_TOKENS, "modes": service.MODES,
                "classes": service.pattern_classes(), "measures": service.mixing_methods(),
                "head_functions": service.head_function_choices(),
                "models": [{"name": c.name, "source": c.source, "description": c.description,
                            "loaded": pool.loaded(c.name)} for c in pool.choices.values()]}

    @app.post("/api/analyze", summary="views payload, patterns and statistics of one input", responses=ERRORS)
    def analyze(request: AnalyzeRequest) -> JSONResponse:
        with pool.use(_named(request.model, pool.default)) as loaded:
            checked(loaded, request)
            record = service.extract_record(loaded, request.text, request.pair, vectors=request.vectors)
            model = service.model_summary(loaded)
        # packing the payload, classifying and serialising need no model: let the next request in
        return JSONResponse(service.describe(record, model, request.text, request.pair))

    @app.post("/api/intervene", summary="the input with heads or layers changed, and what changed",
              responses=ERRORS)
    def intervene(request: InterveneRequest) -> JSONResponse:
        change = service.Change(request.mode, tuple((h.layer, h.head) for h in request.heads),
                                tuple(request.layers), request.kind)
        with pool.use(_named(request.model, pool.default)) as loaded:
            checked(loaded, request)
            return JSONResponse(service.intervene(loaded, request.text, request.pair, change))

    @app.post("/api/generate", summary="a decoder generates after a prompt: the step view's payload",
              responses=ERRORS)
    def generate(request: GenerateRequest) -> JSONResponse:
        from ..attribution.generation_routes import StepRoutes
        from ..attribution.steps import StepAttribution
        from ..capture.generate import generate

        recorders = [*([StepAttribution(lens=request.lens)] if request.attribute or request.lens else []),
                     *([StepRoutes()] if request.routes else [])]
        ask = request.kv_ask()
        with pool.use(_named(request.model, pool.generator or pool.default)) as loaded:
            budget = None if ask is None else service.generation_kv_budget(
                loaded, request.prompt, request.chat, request.max_new_tokens, ask, recorders)
            record = generate(loaded, request.prompt, max_new_tokens=request.max_new_tokens, chat=request.chat,
                              prompt_rows=PROMPT_ROWS[request.prompt_rows], recorders=recorders, kv_budget=budget)
        # packing the payload needs no model: let the next request in
        return JSONResponse(service.describe_generation(record, None if ask is None else ask.choose))

    @app.post("/api/qk", summary="why a decoder's head scores a key for a query: QK attribution of one cell",
              responses=ERRORS)
    def qk(request: QKRequest) -> JSONResponse:
        cell = service.Cell(request.layer, request.head, request.query, request.key)
        with pool.use(_named(request.model, pool.generator or pool.default)) as loaded:
            found = service.qk(loaded, request.text, request.ids, cell, max_tokens)
        return JSONResponse(service.describe_qk(found, request.top))

    @app.post("/api/routes", summary="the information-flow route of one prediction of a decoder (Ferrando & Voita "
              "2024)", responses=ERRORS)
    def routes(request: RoutesRequest) -> JSONResponse:
        with pool.use(_named(request.model, pool.generator or pool.default)) as loaded:
            graph = service.routes_of(loaded, request.text, request.position, request.tau, max_tokens)
        return JSONResponse(graph.to_dict())

    def head_scores(request: Any) -> JSONResponse:
        with pool.use(_named(request.model, pool.generator or pool.default)) as loaded:
            found = service.head_function_scores(loaded, request.score)
        return JSONResponse(found.to_dict())

    def head_trial(request: Any) -> JSONResponse:
        with pool.use(_named(request.model, pool.generator or pool.default)) as loaded:
            found = service.head_function_trial(loaded, request.score, request.layer, request.head)
        return JSONResponse(found.to_dict())

    score_request = head_score_request()  # the scores registered now, not at import
    head_scores.__annotations__["request"] = score_request
    head_trial.__annotations__["request"] = head_trial_request(score_request)
    app.post("/api/head-scores", summary="one head-function score of every layer and head of a decoder (small "
             "settings)", responses=ERRORS)(head_scores)
    app.post("/api/head-trial", summary="one head's attention on one trial of a head-function score's task, the keys "
             "it reads marked", responses=ERRORS)(head_trial)
    @app.post("/api/sentences", summary="sentence-level attention of a text: sentence x sentence block means, "
              "vertical scores and receiver heads (Bogdan et al. 2025)", responses=ERRORS)
    def sentences(request: SentencesRequest) -> JSONResponse:
        name = _named(request.model, pool.generator or pool.default)
        with pool.use(name) as loaded:
            report = service.sentences_of(loaded, request.text, request.proximity, max(max_tokens, SENTENCE_TOKENS))
        # packing needs no model: let the next request in
        return JSONResponse(service.describe_sentences(report, name, request.top))

    def mixing(request: Any) -> JSONResponse:
        with pool.use(_named(request.model, pool.default)) as loaded:
            checked(loaded, request)
            measure = service.mixing_of(loaded, request.text, request.pair, request.method)
        # packing needs no model: let the next request in
        return JSONResponse(service.describe_mixing(measure, request.text))

    mixing.__annotations__["request"] = mixing_request()  # the measures registered now, not at import
    app.post("/api/mixing", summary="one context-mixing measure of one text: per-layer maps and their rollout",
             responses=ERRORS)(mixing)

    @app.post("/api/record", summary="one input's attention as plain JSON [kind][layer][head][query][key]",
              responses=ERRORS)
    def record(request: InputText) -> JSONResponse:
        with pool.use(_named(request.model, pool.default)) as loaded:
            checked(loaded, request)
            return JSONResponse(service.record_json(loaded, request.text, request.pair))
