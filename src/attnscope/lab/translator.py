"""The toy translator: a tiny BART encoder-decoder trained from scratch on the generated corpus.

It is a plain Hugging Face model folder (``config.json``, ``model.safetensors``, a word-level
tokenizer), so capture, views and interventions work on it unchanged. ``load_model("toy-translator")``
trains it on first use (seeded, about a minute on 2 CPU cores) and caches the folder.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..arguments import check_seed
from ..capture.tokens import ids_within
from .corpus import ToyCorpus, make_corpus

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
FORMAT = 1  # bump when the architecture or training changes, so old caches are not reused


@dataclass(frozen=True)
class TrainingSettings:
    seed: int = 0
    epochs: int = 6
    batch_size: int = 32
    learning_rate: float = 2e-3
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    ffn: int = 128

    def __post_init__(self) -> None:
        check_seed(self.seed, "TrainingSettings.seed")  # torch.manual_seed overflows past 64 bits


def build_tokenizer(vocabulary: list[str]) -> Any:
    """A word-level tokenizer (split on spaces) that ends every sequence with ``</s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIALS, *vocabulary])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=32)


def build_model(tokenizer: Any, settings: TrainingSettings) -> Any:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=len(tokenizer), d_model=settings.d_model, encoder_layers=settings.layers,
        decoder_layers=settings.layers, encoder_attention_heads=settings.heads, decoder_attention_heads=settings.heads,
        encoder_ffn_dim=settings.ffn, decoder_ffn_dim=settings.ffn, max_position_embeddings=32, dropout=0.1,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id, forced_eos_token_id=None,
        architectures=["BartForConditionalGeneration"],
    )
    torch.manual_seed(settings.seed)
    return BartForConditionalGeneration(config)


def _batches(corpus: ToyCorpus, tokenizer: Any, settings: TrainingSettings, epoch: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(settings.seed * 1000 + epoch)
    order = torch.randperm(len(corpus.train), generator=generator).tolist()
    batches = []
    for start in range(0, len(order), settings.batch_size):
        pairs = [corpus.train[i] for i in order[start : start + settings.batch_size]]
        batch = tokenizer([p.english for p in pairs], text_target=[p.german for p in pairs], padding=True,
                          return_tensors="pt")
        batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100  # no loss on padding
        batches.append(batch)
    return batches


def train(folder: Path, settings: TrainingSettings = TrainingSettings(), corpus: ToyCorpus | None = None,
          progress: bool = True) -> dict[str, float]:
    """Train from scratch and save a model folder; returns the training figures (also in ``training.json``)."""
    from tqdm.auto import tqdm

    corpus = corpus or make_corpus(settings.seed)
    tokenizer = build_tokenizer(corpus.vocabulary())
    model = build_model(tokenizer, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.01)
    steps = settings.epochs * math.ceil(len(corpus.train) / settings.batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings.learning_rate, total_steps=steps,
                                                   pct_start=0.1)
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small run faster on one thread than split over several
    model.train()
    with tqdm(total=steps, desc="training toy translator", unit="step", disable=not progress) as bar:
        for epoch in range(settings.epochs):
            for batch in _batches(corpus, tokenizer, settings, epoch):
                loss = model(**batch).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                schedule.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
    torch.set_num_threads(threads)
    model.eval()
    figures = {"train_seconds": round(time.perf_counter() - started, 1), "final_loss": round(loss.item(), 4),
               "train_pairs": len(corpus.train), "test_pairs": len(corpus.test), "seed": settings.seed,
               "format": FORMAT}
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "training.json").write_text(json.dumps(figures, indent=1))
    return figures


def translate(model: Any, tokenizer: Any, sentences: list[str], batch_size: int = 128,
              use_cache: bool = True) -> list[str]:
    """Greedy translations of ``sentences`` (``use_cache=False`` reruns the whole prefix at every step)."""
    outputs: list[str] = []
    limit = min(tokenizer.model_max_length, model.config.max_position_embeddings)  # longer sources are cut, with a warning
    source_ids = ids_within(tokenizer, sentences, limit, "sentence") if sentences else []
    with torch.inference_mode():
        for start in range(0, len(sentences), batch_size):
            batch = tokenizer.pad({"input_ids": source_ids[start : start + batch_size]}, return_tensors="pt")
            generated = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       do_sample=False, num_beams=1, max_new_tokens=16, use_cache=use_cache)
            outputs.extend(tokenizer.batch_decode(generated, skip_special_tokens=True))
    return outputs


def exact_match(predictions: list[str], references: list[str]) -> float:
    """Share of predictions equal to their reference, word for word."""
    return sum(p.split() == r.split() for p, r in zip(predictions, references, strict=True)) / len(references)


def cached_folder(seed: int = 0) -> Path:
    from ..models.loading import cache_dir

    return cache_dir() / f"toy-translator-v{FORMAT}-seed{seed}"


def build(seed: int = 0, progress: bool = True) -> Path:
    """The cached toy translator folder, trained first if missing (the ``toy-translator`` alias)."""
    from ..models.loading import publish_folder

    check_seed(seed, "seed")  # before the folder is named or made
    folder = cached_folder(seed)
    if not (folder / "model.safetensors").exists():
        publish_folder(folder, lambda staging: train(staging, TrainingSettings(seed=seed), progress=progress))
    return folder
