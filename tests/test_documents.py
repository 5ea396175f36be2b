"""The shipped long documents: what the README beside them says they are, and readable by name as ``--file``."""

from __future__ import annotations

import hashlib
import re
from importlib.resources import files
from pathlib import Path

import pytest

from attnscope.data import document, documents
from attnscope.errors import AttnscopeError
from attnscope.inputs import read_document

README = files("attnscope.data").joinpath("documents", "README.md").read_text(encoding="utf-8")


def test_every_document_is_the_file_its_readme_pins():
    pinned = {name.removesuffix(".txt"): digest
                  for digest, name in re.findall(r"^    ([0-9a-f]{64})  (\S+\.txt)$", README, re.MULTILINE)}
    assert sorted(pinned) == list(documents()) and len(pinned) == 9
    for name, digest in pinned.items():
        assert hashlib.sha256(document(name).encode()).hexdigest() == digest, name


def test_the_word_counts_in_the_readme_are_the_documents():
    for name, words in re.findall(r"^\| `(\S+)\.txt` \| .* \| ([\d,]+) \| [\d,]+ \|$", README, re.MULTILINE):
        assert len(document(name).split()) == int(words.replace(",", "")), name


def test_the_longest_address_is_a_whole_context_window_of_text():
    text = document("sotu-1981-jimmy-carter")
    assert text.startswith("To the Congress of the United States: The State of the Union is sound.")
    assert len(text.split()) > 32_768  # more words than Gemma 3 or Qwen2.5 take tokens


def test_a_shipped_name_reads_as_a_document_file_but_a_real_file_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert read_document(Path("moby-dick-001")).startswith("CHAPTER 1. Loomings.\n\nCall me Ishmael.")
    (tmp_path / "moby-dick-001").write_text("my own file")
    assert read_document(Path("moby-dick-001")) == "my own file"


def test_an_unknown_name_lists_the_shipped_documents_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AttnscopeError, match=r"^no such file: sotu-2031 \(nor a shipped document: moby-dick-001, "):
        read_document(Path("sotu-2031"))
    with pytest.raises(AttnscopeError, match=r"^no such file: notes/missing.txt$"):
        read_document(Path("notes/missing.txt"))
    with pytest.raises(AttnscopeError, match="no shipped document 'x'"):
        document("x")


def test_extract_reads_a_shipped_document_by_name(tiny_model_dir, tmp_path, capsys):
    from attnscope import AttentionRecord

    from .test_analysis_cli import run

    out = tmp_path / "records"
    code, _, err = run(capsys, "extract", "--document", "moby-dick-001", "-m", str(tiny_model_dir("llama")),
                       "--max-tokens", "16", "--out", str(out))
    assert code == 0, err
    record = AttentionRecord.open(next(out.glob("*.safetensors")))
    assert [token.lower() for token in record.tokens[1:4]] == ["chapter", "1", "."]
