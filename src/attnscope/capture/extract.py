"""Extraction: texts in, :class:`~attnscope.records.AttentionRecord` out.

``extract_corpus`` tokenizes a window of inputs, sorts it by length so batches carry little
padding, runs each batch once under a capture session and yields the records in input order.
Right padding plus an additive mask make batched results equal one-at-a-time results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from itertools import chain, islice
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..errors import AttnscopeError
from ..models.adapters import HOW_TO_ADD, AttentionSite
from ..models.loading import LoadedModel
from ..records.attention import AttentionRecord, ModelInfo
from .attention import CaptureSession, capture
from .concurrency import OrderedMap, concurrent_map, default_workers
from .linear import OneDNNLinear, PackedWeights, onednn_linear_available
from .loading import load_model
from .plan import FULL_PLAN, CapturePlan, check_memory, estimate_capture_memory
from .planned import StreamingSink, batch_facts, planned_records
from .recorders import CaptureComplete, PerSite, SiteCapture, main_kind
from .rows import RowCapture
from .running import check_attention_function
from .tokens import (
    Encoded,
    Item,
    encode_side,
    encode_sides,
    ids_side,
    ids_within,
    side_arrays,
    split_item,
    target_side,
)

SORT_WINDOW_BATCHES = 16  # inputs are sorted by length within windows of this many batches
# a sort window's records are all held until its first can be yielded in order: windows are cut where their records
# would keep more (long inputs: a 512-token record of a 0.5B model keeps hundreds of MB)
HELD_RECORD_BYTES = 1 << 30


def as_loaded(model: LoadedModel | str) -> LoadedModel:
    """``model`` loaded by :func:`load_model` (a name is loaded), refused before any pass where its attention no
    longer runs attnscope's function (:func:`~attnscope.capture.running.check_attention_function`)."""
    if not isinstance(model, LoadedModel):
        return load_model(model)
    check_attention_function(model.sites)
    return model


def extract(
    model: LoadedModel | str,
    text: str,
    pair: str | None = None,
    *,
    qkv: bool = False,
    norms: bool = False,
    onednn: bool | None = None,
    plan: CapturePlan | None = None,
    max_length: int | None = None,
    progress: bool = False,
) -> AttentionRecord:
    """Capture the attention of every layer and head for one input.

    ``pair`` is the second sentence for encoders and decoders, or the target text for
    encoder-decoders (None: the model's own greedy translation is used as the target).
    ``plan`` says what to keep (:class:`~attnscope.capture.plan.CapturePlan`; default: everything).
    ``progress``: a bar on stderr that advances as each layer's attention runs (a whole document's
    forward pass can take minutes).

    >>> rec = extract("minilm", "I went to the store.")      # doctest: +SKIP
    >>> rec.attention.shape                                  # [layer, head, q_pos, k_pos]
    (6, 12, 8, 8)
    """
    loaded = as_loaded(model)
    with layer_progress(loaded, progress):
        return next(extract_corpus(loaded, [(text, pair)], batch_size=1, qkv=qkv, norms=norms, progress=False,
                                   onednn=onednn, plan=plan, max_length=max_length))


def extract_ids(model: LoadedModel | str, sequences: list[list[int]], *, plan: CapturePlan | None = None,
                batch_size: int = 8) -> list[AttentionRecord]:
    """Capture token id ``sequences`` exactly as given (no tokenizer pass, no special tokens added): one record
    per sequence, in order. For tasks built from ids (repeated random tokens); ``plan`` as :func:`extract`.
    Ids the model has no embedding for, or a sequence longer than its context, are refused before any pass."""
    loaded = as_loaded(model)
    check_ids(loaded, sequences)
    encoded = [Encoded(index, (loaded.tokenizer.decode(ids),), ids_side(loaded.tokenizer, ids))
               for index, ids in enumerate(sequences)]
    return [record for start in range(0, len(encoded), batch_size)
            for record in run_batch(loaded, encoded[start:start + batch_size], False, False, plan=plan)]


def check_ids(loaded: LoadedModel, sequences: list[list[int]]) -> None:
    """One line for an empty sequence, an id outside the model's embedding or a sequence beyond its context."""
    vocabulary = loaded.model.get_input_embeddings().num_embeddings
    for index, ids in enumerate(sequences):
        if not ids:
            raise AttnscopeError(f"sequence {index} holds no token id")
        outside = next((i for i in ids if not 0 <= i < vocabulary), None)
        if outside is not None:
            raise AttnscopeError(f"token id {outside} is outside {loaded.name}'s vocabulary (ids 0..{vocabulary - 1})")
        if len(ids) > loaded.max_length:
            raise AttnscopeError(f"sequence {index} is {len(ids)} tokens long; {loaded.name}'s limit is "
                                 f"{loaded.max_length} tokens")


PROGRESS_DELAY_S = 1.0  # a capture done sooner shows no bar: a short text's would only flash


@contextmanager
def layer_progress(loaded: LoadedModel, enabled: bool = True, desc: str = "capturing") -> Iterator[None]:
    """Inside the block, a progress bar on stderr advances each time one of the model's main attention layers
    finishes (self-attention, or the encoder's; in the calling thread only), and is cleared at the end. It shows
    only once the work has taken :data:`PROGRESS_DELAY_S`."""
    if not enabled:
        yield
        return
    from tqdm.auto import tqdm

    from .hooks import local_hooks

    kind = main_kind(loaded.sites.values())
    modules = [module for module, site in loaded.sites.items() if site.kind == kind]
    with tqdm(total=len(modules), unit="layer", desc=desc, leave=False, delay=PROGRESS_DELAY_S) as bar:

        def advance(_module: nn.Module, _inputs: tuple[Any, ...], _output: Any) -> None:
            bar.update(1)  # returns None: the layer's output is left as it is

        with local_hooks(modules, advance):
            yield


def extract_corpus(
    model: LoadedModel | str,
    items: Iterable[Item],
    *,
    batch_size: int = 16,
    qkv: bool = False,
    norms: bool = False,
    max_length: int | None = None,
    progress: bool = True,
    total: int | None = None,
    onednn: bool | None = None,
    parallel_batches: int | None = None,
    plan: CapturePlan | None = None,
    packed: PackedWeights | None = None,
) -> Iterator[AttentionRecord]:
    """Yield one record per item, in input order, computed in length-sorted batches.

    Items are texts or ``(text, second)`` pairs (see :func:`extract`). Inputs longer than
    ``max_length`` (default: the model's limit) are truncated with a warning.

    ``onednn`` runs the model's float32 and bfloat16 linear layers on oneDNN with weights
    prepacked once per call (:mod:`attnscope.capture.linear`). Where MKL's float32 GEMM is slow, as
    on the AMD EPYC of ``benchmarks/extract.py``, float32 capture runs about 1.75x faster; attention
    equals that of PyTorch's default GEMM up to float32 rounding (a few 1e-6). Packing can cost as
    much as a batch, so the default (None) uses oneDNN only when the inputs fill more than one
    batch; True or False force it on or off. Without oneDNN in the torch build, or on a GPU, it is off.
    ``packed`` keeps the packed weights across calls (a worker that runs one batch per call packs once).

    ``parallel_batches`` batches run at once, each on its own thread with an equal share of torch's
    intra-op threads (:mod:`attnscope.capture.concurrency`); torch's thread count is restored
    afterwards. The default (None) runs 2 when torch has 2 or more threads and the inputs fill more
    than one batch, else 1. Records are the same and in input order either way.

    ``plan`` (:class:`~attnscope.capture.plan.CapturePlan`) keeps only the chosen layers, heads
    and query rows of the input side, statistics, top-k keys or an overview, computed in query
    chunks (partial records; see :class:`~attnscope.records.AttentionRecord`). Before each batch
    runs, the memory it needs is estimated and a batch that would not fit is refused.
    """
    if batch_size < 1:
        raise AttnscopeError("batch size must be at least 1")
    if max_length is not None and max_length < 1:
        raise AttnscopeError(f"the maximum length must be at least 1 token, got {max_length}")
    loaded = as_loaded(model)
    plan = None if plan is None or plan.keeps_everything else plan
    if plan is not None:  # before any forward pass: a head the model lacks is refused at once
        plan.check_against(n_layers=n_main_layers(loaded), n_heads=named_config_heads(loaded))
    limit = min(max_length or loaded.max_length, loaded.max_length)
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)  # type: ignore[arg-type]
    from tqdm.auto import tqdm

    window_size = batch_size * SORT_WINDOW_BATCHES
    numbered = enumerate(items)
    first = list(islice(numbered, window_size))
    several_batches = len(first) > batch_size
    on_cpu = loaded.input_device.type == "cpu"  # oneDNN's linear path is for CPU tensors only
    packed = (packed or PackedWeights()) if on_cpu and use_onednn(onednn, several_batches) else None
    run = partial(run_batch, loaded, qkv=qkv, norms=norms, packed=packed, plan=plan)
    windows = chain([first], iter(lambda: list(islice(numbered, window_size)), []))
    with (tqdm(total=total, unit="text", desc="extracting", disable=not progress) as bar,
          concurrent_map(default_workers(parallel_batches, several_batches)) as run_each):
        for window in filter(None, windows):
            for part in held_parts(loaded, encode_window(loaded, window, limit), batch_size, plan, qkv=qkv, norms=norms):
                yield from window_records(part, batch_size, run, run_each, bar.update)


def extract_to_file(
    model: LoadedModel | str,
    text: str,
    pair: str | None = None,
    *,
    path: str | Path,
    plan: CapturePlan | None = None,
    norms: bool = False,
    float16: bool = False,
    max_length: int | None = None,
    progress: bool = True,
) -> AttentionRecord:
    """Capture one input straight into the record file ``path``, layer by layer, and return it
    opened lazily (:meth:`AttentionRecord.open`): for inputs whose attention does not fit in memory.

    ``plan`` says what to keep (default: everything, computed in query chunks); attention rows and
    top-k keys go into the memory-mapped file as they are computed, so memory holds one layer's
    chunk at a time. ``float16`` stores attention, norms and top-k weights in half precision.

    >>> rec = extract_to_file("smollm2", long_text, path="long.safetensors",
    ...                       plan=CapturePlan(attention=False, statistics=True, top_k=32))  # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    loaded = as_loaded(model)
    plan = plan or FULL_PLAN
    plan.check_against(n_layers=n_main_layers(loaded), n_heads=named_config_heads(loaded))
    limit = min(max_length or loaded.max_length, loaded.max_length)
    encoded = encode_window(loaded, [(0, (text, pair))], limit)[0]
    check_batch_memory(loaded, [encoded], plan, qkv=False, norms=norms, streamed=True)
    kind = main_kind(loaded.sites.values())
    sink = StreamingSink(Path(path), encoded, plan, kind=kind, n_layers=n_main_layers(loaded), norms=norms,
                         float16=float16, learned_sinks=any(s.learned_sinks for s in loaded.sites.values()
                                                            if s.kind == kind))
    with (tqdm(total=len(sink.layers), unit="layer", desc="capturing", disable=not progress) as bar,
          torch.inference_mode(),
          capture(loaded.sites, norms=norms, stop_when_complete=stops_early(loaded), plan=plan,
                  facts=batch_facts([encoded], plan), sink=sink) as session):
        sink.on_layer = bar.update
        forward_until_captured(loaded, [encoded])
    check_calls(loaded, session)
    sink.close(model_info(loaded, session))
    return AttentionRecord.open(path)


def window_records(encoded: list[Encoded], batch_size: int, run: Callable[[list[Encoded]], list[AttentionRecord]],
                   run_each: OrderedMap, done: Callable[[int], object]) -> list[AttentionRecord]:
    """Records of one tokenized window in input order, made by ``run`` in length-sorted batches
    (mapped over them with ``run_each``); ``done(n)`` hears of every finished batch of ``n`` items.

    Longest batches go first, so concurrent workers end a window with short ones and finish together.
    """
    by_length = sorted(range(len(encoded)), key=lambda i: encoded[i].length, reverse=True)
    batches = [by_length[start : start + batch_size] for start in range(0, len(by_length), batch_size)]
    records: dict[int, AttentionRecord] = {}
    for positions, batch_records in zip(batches, run_each(run, [[encoded[i] for i in b] for b in batches])):
        records.update(zip(positions, batch_records))
        done(len(positions))
    return [records[i] for i in range(len(encoded))]


def held_parts(loaded: LoadedModel, encoded: list[Encoded], batch_size: int, plan: CapturePlan | None, *, qkv: bool,
               norms: bool) -> Iterator[list[Encoded]]:
    """One tokenized sort window (input order) cut into consecutive parts whose records keep at most
    :data:`HELD_RECORD_BYTES` together (estimated from their lengths), each at least one batch."""
    n_layers, n_heads = n_main_layers(loaded) * len(_kinds(loaded)), n_config_heads(loaded)
    part: list[Encoded] = []
    held = 0
    for item in encoded:
        kept = estimate_capture_memory(plan, n_layers=n_layers, n_heads=n_heads, length=item.length, qkv=qkv,
                                       norms=norms).kept
        if len(part) >= batch_size and held + kept > HELD_RECORD_BYTES:
            yield part
            part, held = [], 0
        part.append(item)
        held += kept
    if part:
        yield part


def encode_window(loaded: LoadedModel, window: list[tuple[int, Item]], limit: int) -> list[Encoded]:
    """Tokenize a window of numbered items (batched for encoders and decoders)."""
    if loaded.is_encoder_decoder:
        return [encode_item(loaded, item, index, limit) for index, item in window]
    texts = [split_item(item, index) for index, item in window]
    indices = [index for index, _ in window]
    sides = encode_sides(loaded.tokenizer, texts, limit, indices, loaded.max_length)
    return [Encoded(index, tuple(t for t in text if t is not None), side)
            for index, text, side in zip(indices, texts, sides)]


def encode_item(loaded: LoadedModel, item: Item, index: int, limit: int) -> Encoded:
    """Tokenize one encoder-decoder item: the source, and the decoder's input (given or generated)."""
    first, second = split_item(item, index)
    tokenizer = loaded.tokenizer
    source = encode_side(tokenizer, first, None, limit, index)
    start_id = loaded.decoder_start_id
    if second is None:
        decoder_ids = _greedy_target(loaded, source.input_ids, limit)
    else:
        labels = ids_within(tokenizer, [second], limit, f"input {index}: target text", target=True)[0]
        decoder_ids = [start_id, *labels[:-1]] if labels and labels[-1] == tokenizer.eos_token_id else [start_id, *labels]
    return Encoded(index, (first, second or tokenizer.decode(decoder_ids, skip_special_tokens=True)), source,
                   target_side(tokenizer, decoder_ids, start_id))


def _greedy_target(loaded: LoadedModel, source_ids: list[int], limit: int) -> list[int]:
    """The model's greedy output for one source, without its final end-of-sentence token."""
    with torch.inference_mode():
        generated = loaded.model.generate(torch.tensor([source_ids], device=loaded.input_device), do_sample=False,
                                          num_beams=1, decoder_start_token_id=loaded.decoder_start_id,
                                          max_new_tokens=min(limit, 2 * len(source_ids) + 10))[0].tolist()
    eos = loaded.config.eos_token_id
    return generated[:-1] if len(generated) > 1 and generated[-1] == eos else generated


def _pad(rows: list[list[int]], value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``rows``: returns ids ``[batch, pos]`` and the 0/1 mask ``[batch, pos]``."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def model_inputs(loaded: LoadedModel, batch: list[Encoded]) -> dict[str, torch.Tensor]:
    """Padded tensors for one forward pass of the base model (no LM head: it is not needed), built on
    the CPU and moved to the model's input device in one copy each."""
    pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    ids, mask = _pad([e.source.input_ids for e in batch], pad_id)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if getattr(loaded.config, "type_vocab_size", 0) >= 2 and all(e.source.token_type_ids is not None for e in batch):
        inputs["token_type_ids"] = _pad([e.source.token_type_ids for e in batch], 0)[0]  # type: ignore[misc]
    if loaded.is_encoder_decoder:
        targets = [e.target.input_ids for e in batch if e.target is not None]
        inputs["decoder_input_ids"], inputs["decoder_attention_mask"] = _pad(targets, pad_id)
    inputs = {name: tensor.to(loaded.input_device) for name, tensor in inputs.items()}
    if loaded.is_encoder_decoder or loaded.causal:
        inputs["use_cache"] = False  # type: ignore[assignment]
    return inputs


def use_onednn(requested: bool | None, several_batches: bool) -> bool:
    """Whether to run linear layers on oneDNN: as requested, else when packing pays for itself."""
    wanted = several_batches if requested is None else requested
    return wanted and onednn_linear_available()


def run_batch(loaded: LoadedModel, batch: list[Encoded], qkv: bool, norms: bool,
              packed: PackedWeights | None = None, plan: CapturePlan | None = None) -> list[AttentionRecord]:
    """One forward pass over ``batch`` under capture; one record per item.

    With ``packed``, float32 and bfloat16 linear layers run on oneDNN with those prepacked weights.
    With ``plan``, the input side is kept as the plan says (partial records).
    """
    check_batch_memory(loaded, batch, plan, qkv=qkv, norms=norms)
    facts = batch_facts(batch, plan) if plan is not None else None
    with (torch.inference_mode(), linear_backend(packed),
          capture(loaded.sites, qkv=qkv, norms=norms, stop_when_complete=stops_early(loaded), plan=plan,
                  facts=facts) as session):
        forward_until_captured(loaded, batch)
    check_calls(loaded, session)
    info = model_info(loaded, session)
    if plan is not None:
        return planned_records(info, batch, session.layers(info.main_kind), plan)
    stacked = {kind: _stack(session, kind) for kind in _kinds(loaded)}
    return [_record(loaded, info, encoded, row, stacked) for row, encoded in enumerate(batch)]


def stops_early(loaded: LoadedModel) -> bool:
    """Whether a capture may stop the forward pass once every site is in: for model types of the adapters
    table; a type read from the model runs to the end, so that a layer it runs twice is caught."""
    return not loaded.adapter.generic


def check_calls(loaded: LoadedModel, session: CaptureSession) -> None:
    """Refuse a capture that did not get exactly one call from every site it wanted: a site never called
    computes attention inside its own module (or was skipped); one called twice is a layer the model runs
    more than once in a forward pass, which has no single attention. Layers of one kind must have as many
    heads as each other."""
    recorder = cast(PerSite, session.recorder)
    model_type = loaded.config.model_type
    wanted = [site for site in loaded.sites.values() if recorder.wants(site)]
    missing = [site for site in wanted if (site.kind, site.layer) not in recorder.captured]
    if missing:
        raise AttnscopeError(
            f"model type {model_type!r}: {len(missing)} of its {len(wanted)} attention modules (e.g. "
            f"{missing[0].name}) never called attnscope's attention function during the forward pass; it computes "
            f"attention inside its own modules, so attnscope needs a bridge for it ({HOW_TO_ADD})")
    for kind in {site.kind for site in wanted}:
        heads = sorted({captured.n_heads for (k, _), captured in recorder.captured.items() if k == kind})
        if len(heads) > 1:  # a record's [layer, head, q_pos, k_pos] array needs as many heads in every layer
            raise AttnscopeError(
                f"model type {model_type!r} has {kind} layers with different numbers of heads "
                f"({', '.join(map(str, heads))}), which attnscope's [layer, head, q_pos, k_pos] records cannot "
                f"hold; it needs an adapter for it ({HOW_TO_ADD})")
        keys = sorted({int(c.attention.shape[-1]) for (k, _), c in recorder.captured.items()
                       if k == kind and getattr(c, "attention", None) is not None and c.attention.dim() == 4})
        if len(keys) > 1:  # e.g. compressed key/value entries appended to some layers' keys (DeepSeek-V4)
            raise AttnscopeError(
                f"model type {model_type!r} has {kind} layers that attend over different numbers of keys "
                f"({', '.join(map(str, keys))}) for the same input: some keys are not tokens, which attnscope's "
                f"[layer, head, q_pos, k_pos] records cannot hold; it needs an adapter for it ({HOW_TO_ADD})")
    repeated = sorted(key for key, calls in recorder.calls.items() if calls > 1)
    if repeated:
        kind, layer = repeated[0]
        raise AttnscopeError(
            f"model type {model_type!r} runs its attention layers more than once per forward pass ({kind} layer "
            f"{layer} ran {recorder.calls[repeated[0]]} times), so a layer has no single attention to record; "
            f"attnscope needs an adapter for it that names each run ({HOW_TO_ADD})")


def forward_until_captured(loaded: LoadedModel, batch: list[Encoded]) -> None:
    """Run the base model on ``batch`` inside a capture session that stops when complete."""
    try:
        loaded.model.base_model(**model_inputs(loaded, batch))
    except CaptureComplete:
        pass  # every attention site is recorded; the rest of the forward pass is not needed


def linear_backend(packed: PackedWeights | None) -> AbstractContextManager[object]:
    """oneDNN linear layers for one forward pass (entered per batch: a mode must not stay active
    in the caller's code between the generator's yields), or PyTorch's default."""
    return OneDNNLinear(packed) if packed is not None else nullcontext()


def _kinds(loaded: LoadedModel) -> tuple[str, ...]:
    return ("encoder", "decoder", "cross") if loaded.is_encoder_decoder else ("self",)


def _stack(session: CaptureSession, kind: str) -> dict[str, np.ndarray]:
    """Per field, the layers of ``kind`` stacked: ``[batch, layer, head, ...]`` numpy float32."""
    layers = session.layers(kind)
    fields: dict[str, np.ndarray] = {}
    for name in ("attention", "norms", "queries", "keys", "values"):
        tensors = [getattr(capture_, name) for capture_ in layers]
        if tensors and tensors[0] is not None:
            fields[name] = stack_on_cpu(tensors)
    if any(capture_.sink_mass is not None for capture_ in layers):  # a layer without learned sinks gives them none
        fields["sink_mass"] = stack_on_cpu([torch.zeros(c.attention.shape[:-1], device=c.attention.device)
                                            if c.sink_mass is None else c.sink_mass for c in layers])
    return fields


def stack_on_cpu(tensors: list[torch.Tensor]) -> np.ndarray:
    """Per-layer ``[batch, head, ...]`` tensors -> ``[batch, layer, head, ...]`` float32 numpy: stacked
    where they were computed and copied to the CPU once (layer by layer when ``device="auto"`` put
    the layers on several devices)."""
    if len({tensor.device for tensor in tensors}) > 1:
        tensors = [tensor.cpu() for tensor in tensors]
    return torch.stack(tensors, dim=1).float().cpu().numpy()


def n_main_layers(loaded: LoadedModel) -> int:
    """How many attention layers the input side has."""
    main = main_kind(loaded.sites.values())
    return sum(1 for site in loaded.sites.values() if site.kind == main)


def n_config_heads(loaded: LoadedModel) -> int:
    """Query heads per layer as the config names them (16 when it names none), for memory estimates; the most
    of any layer where they vary by layer."""
    return named_config_heads(loaded) or 16


def named_config_heads(loaded: LoadedModel) -> int | None:
    """Query heads per layer where the config names them (the most of any layer where they vary), else None."""
    heads = (_config_value(loaded.config, name) for name in ("num_attention_heads", "encoder_attention_heads", "n_head"))
    return next((int(h) for h in heads if isinstance(h, int)), None)


def _config_value(config: Any, name: str) -> Any:
    """``config.name``; for an attribute that varies by layer (transformers' per-layer configs refuse to read it
    globally), the largest of its layers' values."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError)
        values = [getattr(layer, name, None) for layer in getattr(config, "per_layer_config", None) or ()]
        return max((v for v in values if isinstance(v, int)), default=None)


def check_batch_memory(loaded: LoadedModel, batch: list[Encoded], plan: CapturePlan | None, *, qkv: bool,
                       norms: bool, streamed: bool = False) -> None:
    """Refuse a batch whose capture would not fit in the available memory (one clear line);
    ``streamed``: its rows go to a file, not to memory."""
    longest = max(e.length for e in batch)
    estimate = estimate_capture_memory(plan, n_layers=n_main_layers(loaded) * len(_kinds(loaded)),
                                       n_heads=n_config_heads(loaded),
                                       length=longest, batch=len(batch), qkv=qkv, norms=norms, streamed=streamed)
    what = f"capturing {len(batch)} input(s) of up to {longest} tokens on {loaded.name}"
    check_memory(estimate, what=what)


def model_info(loaded: LoadedModel, session: CaptureSession) -> ModelInfo:
    return model_info_from(loaded, session.layers(main_kind(loaded.sites.values()))[0])


def model_info_from(loaded: LoadedModel, first: SiteCapture | RowCapture) -> ModelInfo:
    """The record's model facts, from what one input-side site captured (heads, kv heads, scaling)."""
    return ModelInfo(
        name=loaded.name,
        model_type=loaded.config.model_type,
        n_layers=n_main_layers(loaded),
        n_heads=first.n_heads,
        n_kv_heads=first.n_kv_heads,
        d_head=first.d_head,
        causal=loaded.causal,
        is_encoder_decoder=loaded.is_encoder_decoder,
        scaling=first.scaling,
        dtype=loaded.dtype,
        windows=layer_windows(loaded),
        learned_sinks=any(site.learned_sinks for site in loaded.sites.values()),
        chunked=tuple(site.layer for site in main_sites(loaded) if site.window and site.chunked),
    )


def layer_windows(loaded: LoadedModel) -> tuple[int, ...]:
    """The input side's window per layer (0 = global; sliding, or a chunk: ``ModelInfo.chunked``), or () when no
    layer has one."""
    windows = tuple(site.window for site in main_sites(loaded))
    return windows if any(windows) else ()


def main_sites(loaded: LoadedModel) -> list[AttentionSite]:
    """The input side's sites, ordered by layer."""
    main = main_kind(loaded.sites.values())
    return [site for site in sorted(loaded.sites.values(), key=lambda s: s.layer) if site.kind == main]


def _record(loaded: LoadedModel, info: ModelInfo, encoded: Encoded, row: int,
            stacked: dict[str, dict[str, np.ndarray]]) -> AttentionRecord:
    """Cut item ``row`` out of the batched arrays, dropping its padding."""
    n_source = len(encoded.source.input_ids)
    n_target = len(encoded.target.input_ids) if encoded.target else 0
    query_len = {"self": n_source, "encoder": n_source, "decoder": n_target, "cross": n_target}
    key_len = {"self": n_source, "encoder": n_source, "decoder": n_target, "cross": n_source}
    arrays: dict[str, np.ndarray] = side_arrays("input", encoded.source)
    if encoded.target is not None:
        arrays.update(side_arrays("target", encoded.target))
    for kind, fields in stacked.items():
        for name, values in fields.items():
            if name in ("attention", "norms"):
                arrays[f"{kind}.{name}"] = values[row, :, :, : query_len[kind], : key_len[kind]].copy()
            elif name == "sink_mass":  # [layer, head, q_pos]
                arrays[f"{kind}.{name}"] = values[row, :, :, : query_len[kind]].copy()
            else:  # queries come from the query side, keys and values from the key side
                length = query_len[kind] if name == "queries" else key_len[kind]
                arrays[f"{kind}.{name}"] = values[row, :, :, :length].copy()
    return AttentionRecord(
        model=info,
        tokens=encoded.source.tokens,
        arrays=arrays,
        target_tokens=encoded.target.tokens if encoded.target else None,
        kv_expanded=info.n_kv_heads != info.n_heads and any(f"{k}.keys" in arrays for k in stacked),
        text=encoded.text,
    )
