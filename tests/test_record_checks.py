"""Damaged record files are refused with one line naming the problem; good ones round-trip exactly.

The damaged corpus is built here from good files of tiny random models (BERT with queries, keys,
values and norms; Llama with grouped key/value heads; BART), by editing the safetensors header,
the metadata JSON or the stored bytes, one defect per file. The schema reader is checked against
jsonschema (the reference implementation) on every metadata the corpus holds.
"""

from __future__ import annotations

import copy
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from attnscope import AttentionRecord, AttnscopeError, extract, load_model
from attnscope.cli import main
from attnscope.records.checks import record_schema, row_sum_tolerance, schema_problem

from .conftest import SENTENCES

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
          "U8": np.uint8, "BOOL": np.bool_}


# ---- reading and writing the parts of a safetensors file --------------------------------------
@dataclass
class Parts:
    """A record file taken apart: tensors' header entries, the attnscope metadata, the data bytes."""

    tensors: dict[str, dict[str, Any]]
    meta: Any
    data: bytearray
    raw_meta: str | None = None  # written instead of json.dumps(meta) when set
    drop_meta: bool = False

    def array(self, name: str) -> np.ndarray:
        """A writable view of tensor ``name`` into the data bytes (as its header describes it)."""
        entry = self.tensors[name]
        start, end = entry["data_offsets"]
        return np.frombuffer(memoryview(self.data)[start:end], dtype=DTYPES[entry["dtype"]]).reshape(entry["shape"])


def read_parts(path: Path) -> Parts:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    meta = json.loads(header.pop("__metadata__")["attnscope"])
    return Parts(header, meta, bytearray(raw[8 + size :]))


def write_parts(parts: Parts, path: Path) -> Path:
    """Write ``parts`` back, laying the tensors' bytes out again (so tensors can be dropped or copied)."""
    header: dict[str, Any] = {}
    data = bytearray()
    for name, entry in parts.tensors.items():
        start, end = entry["data_offsets"]
        header[name] = {**entry, "data_offsets": [len(data), len(data) + end - start]}
        data += parts.data[start:end]
    if not parts.drop_meta:
        header["__metadata__"] = {"attnscope": parts.raw_meta if parts.raw_meta is not None else json.dumps(parts.meta)}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data))
    return path


def set_shape(name: str, shape: Callable[[list[int]], list[int]]) -> Callable[[Parts], None]:
    return lambda p: p.tensors[name].__setitem__("shape", shape(p.tensors[name]["shape"]))


def set_dtype(name: str, dtype: str) -> Callable[[Parts], None]:
    return lambda p: p.tensors[name].__setitem__("dtype", dtype)


def set_model(key: str, value: Any) -> Callable[[Parts], None]:
    return lambda p: p.meta["model"].__setitem__(key, value)


def set_meta(key: str, value: Any) -> Callable[[Parts], None]:
    return lambda p: p.meta.__setitem__(key, value)


def raw_meta(text: str) -> Callable[[Parts], None]:
    return lambda p: setattr(p, "raw_meta", text)


def poke(name: str, value: float, where: tuple[int, ...] = (0, 1, 2, 3)) -> Callable[[Parts], None]:
    return lambda p: p.array(name).__setitem__(where, value)


def drop_tensor(name: str) -> Callable[[Parts], None]:
    return lambda p: p.tensors.pop(name)


def flip_high_byte(name: str) -> Callable[[Parts], None]:
    """Overwrite the exponent byte of one float32 weight: 0.1 becomes about 1e31 (a flipped-bytes file)."""
    def damage(parts: Parts) -> None:
        start = parts.tensors[name]["data_offsets"][0]
        parts.data[start + 4 * 5 + 3] = 0x74

    return damage


def scale(name: str, factor: float) -> Callable[[Parts], None]:
    def damage(parts: Parts) -> None:
        parts.array(name)[...] *= factor

    return damage


def both(*damages: Callable[[Parts], None]) -> Callable[[Parts], None]:
    def damage(parts: Parts) -> None:
        for one in damages:
            one(parts)

    return damage


# ---- good records of tiny models ----------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tiny_model_dir) -> dict[str, AttentionRecord]:
    """Records of every kind a user can save: qkv+norms, grouped kv heads, encoder-decoders, word level."""
    bert = load_model(str(tiny_model_dir("bert")))
    llama = load_model(str(tiny_model_dir("llama")))
    records = {
        "bert": extract(bert, SENTENCES[1], SENTENCES[0], qkv=True, norms=True),
        "llama": extract(llama, SENTENCES[2], qkv=True, norms=True),
        "bart": extract(load_model(str(tiny_model_dir("bart"))), SENTENCES[2], "Ich ging zum Laden.", qkv=True,
                        norms=True),
        "marian": extract(load_model(str(tiny_model_dir("marian"))), SENTENCES[0], "Ich ging.", norms=True),
    }
    records["bert_words"] = records["bert"].to_word_level()
    records["bart_words"] = records["bart"].to_word_level()
    assert records["llama"].kv_expanded and records["bert"].queries is not None
    assert records["bart"].arrays["cross.attention"].shape[-2:] == (len(records["bart"].target_tokens),
                                                                    len(records["bart"].tokens))
    return records


@pytest.mark.parametrize("name", ["bert", "llama", "bart", "marian", "bert_words", "bart_words"])
@pytest.mark.parametrize("float16", [False, True])
def test_good_records_round_trip_exactly(good, tmp_path, name, float16):
    record = good[name]
    loaded = AttentionRecord.load(record.save(tmp_path / "r.safetensors", float16=float16))
    assert (loaded.model, loaded.tokens, loaded.target_tokens, loaded.kv_expanded, loaded.level, loaded.text) == (
        record.model, record.tokens, record.target_tokens, record.kv_expanded, record.level, record.text)
    assert loaded.arrays.keys() == record.arrays.keys()
    for key, value in record.arrays.items():
        stored = value.astype(np.float16).astype(np.float32) if float16 and value.dtype.kind == "f" else value
        np.testing.assert_array_equal(loaded.arrays[key], stored, err_msg=key)
        assert loaded.arrays[key].dtype == stored.dtype


def test_float16_rows_of_long_peaked_inputs_pass_the_row_sum_check(tmp_path):
    """Many tiny weights (flushed to 0 in float16) and a few large ones: the worst case of float16 storage."""
    rng = np.random.default_rng(0)
    n = 3000
    logits = rng.normal(scale=6.0, size=(1, 2, n, n)).astype(np.float32)
    attention = np.exp(logits - logits.max(-1, keepdims=True))
    attention = (attention / attention.sum(-1, keepdims=True)).astype(np.float32)
    half = attention.astype(np.float16)
    error = np.abs(half.sum(-1, dtype=np.float64) - 1).max()
    assert 1e-4 < error < row_sum_tolerance(np.dtype(np.float16), n)  # float32's tolerance would refuse it
    from attnscope import ModelInfo

    info = ModelInfo(name="hand", model_type="bert", n_layers=1, n_heads=2, n_kv_heads=2, d_head=4, causal=False,
                     is_encoder_decoder=False, scaling=0.5)
    ids = np.arange(n)
    record = AttentionRecord(model=info, tokens=tuple(f"t{i}" for i in ids), arrays={
        "self.attention": attention, "input.token_ids": ids, "input.special_mask": ids < 0,
        "input.sentence_ids": ids * 0, "input.word_ids": ids})
    loaded = AttentionRecord.load(record.save(tmp_path / "long.safetensors", float16=True))
    np.testing.assert_array_equal(loaded.attention, half.astype(np.float32))


# ---- the damaged corpus ------------------------------------------------------------------------
T = "self.attention"
BERT_DAMAGES: dict[str, tuple[Callable[[Parts], None], str]] = {
    # metadata that is not a record's
    "metadata not JSON": (raw_meta("{not json"), r"metadata is not JSON"),
    "metadata a list": (raw_meta("[1, 2]"), r"metadata is a JSON array, not an object"),
    "metadata a number": (raw_meta("3"), r"metadata is a JSON integer, not an object"),
    "metadata with NaN": (raw_meta('{"format_version": NaN}'), r"NaN, which is not JSON"),
    "no attnscope metadata": (lambda p: setattr(p, "drop_meta", True), r"without attnscope metadata"),
    "format_version 999": (set_meta("format_version", 999), r"format version 999 is newer than .* reads \(1\)"),
    "format_version 2.0": (set_meta("format_version", 2.0), r"format version 2.0 is newer"),
    "format_version a string": (set_meta("format_version", "1"), r"format_version: should be integer, not string"),
    "format_version 0": (set_meta("format_version", 0), r"format_version: should be at least 1"),
    "format_version missing": (lambda p: p.meta.pop("format_version"), r"missing 'format_version'"),
    "extra top-level key": (set_meta("extra", 1), r"the metadata: unexpected key\(s\) 'extra'"),
    # tokens
    "tokens null": (set_meta("tokens", None), r"tokens: should be array, not null"),
    "tokens shortened": (lambda p: p.meta["tokens"].pop(), r"input.token_ids has \d+ tokens .*metadata says"),
    "tokens lengthened": (lambda p: p.meta["tokens"].append("x"), r"input.token_ids has \d+ tokens"),
    "tokens empty": (set_meta("tokens", []), r"tokens: should hold at least 1 item"),
    "a token not a string": (lambda p: p.meta["tokens"].__setitem__(2, 7), r"tokens\[2\]: should be string"),
    "text null": (set_meta("text", None), r"text: should be array, not null"),
    "level unknown": (set_meta("level", "sentence"), r"level: should be one of \"token\", \"word\""),
    "kv_expanded a string": (set_meta("kv_expanded", "yes"), r"kv_expanded: should be boolean"),
    "target tokens on an encoder": (set_meta("target_tokens", ["a"]), r"not an encoder-decoder"),
    # model info
    "model missing": (lambda p: p.meta.pop("model"), r"missing 'model'"),
    "model info null": (set_meta("model", None), r"model: should be object, not null"),
    "model info extra key": (set_model("flavour", "vanilla"), r"model: unexpected key\(s\) 'flavour'"),
    "model info missing n_heads": (lambda p: p.meta["model"].pop("n_heads"), r"model: missing 'n_heads'"),
    "n_layers 99": (set_model("n_layers", 99), r"self.attention has 2 layers .*metadata says 99"),
    "n_layers a string": (set_model("n_layers", "2"), r"model.n_layers: should be integer, not string"),
    "n_layers 0": (set_model("n_layers", 0), r"model.n_layers: should be at least 1, not 0"),
    "n_heads 8": (both(set_model("n_heads", 8), set_model("n_kv_heads", 8)), r"self.attention has 4 heads"),
    "n_kv_heads not dividing n_heads": (set_model("n_kv_heads", 3), r"4 heads, not a multiple of its 3"),
    "d_head wrong": (set_model("d_head", 16), r"self.queries has 8 d_head .*metadata says 16"),
    "scaling negative": (set_model("scaling", -1.0), r"model.scaling: should be more than 0"),
    "causal a number": (set_model("causal", 1), r"model.causal: should be boolean, not integer"),
    # arrays: names, dtypes, shapes
    "attention 3-D": (set_shape(T, lambda s: [s[0] * s[1], s[2], s[3]]), r"self.attention has 3 dimensions"),
    "layers and heads swapped": (set_shape(T, lambda s: [s[1], s[0], *s[2:]]), r"self.attention has 4 layers"),
    "queries reshaped": (set_shape("self.queries", lambda s: [*s[:2], s[2] * 2, s[3] // 2]),
                         r"self.queries has \d+ positions"),
    "norms with heads and queries merged": (set_shape("self.norms", lambda s: [s[0], s[1] * s[2], 1, s[3]]),
                                            r"self.norms has \d+ heads"),
    "attention relabelled int32": (set_dtype(T, "I32"), r"self.attention is int32, should be floating point"),
    "token ids relabelled float64": (set_dtype("input.token_ids", "F64"), r"input.token_ids is float64, should be int"),
    "special mask relabelled uint8": (set_dtype("input.special_mask", "U8"), r"special_mask is uint8, should be bool"),
    "attention missing": (drop_tensor(T), r"no self.attention array"),
    "word ids missing": (drop_tensor("input.word_ids"), r"no input.word_ids array"),
    "unknown array": (lambda p: p.tensors.__setitem__("self.attn", p.tensors[T]), r"unexpected array\(s\) self.attn"),
    # values
    "flipped bytes": (flip_high_byte(T), r"self.attention rows should sum to 1, layer 0 head 0 query 0 sums to \S+e\+3"),
    "NaN in attention": (poke(T, np.nan), r"self.attention holds NaN or infinite values \(layer 0"),
    "NaN in queries": (poke("self.queries", np.nan, (1, 0, 0, 0)), r"self.queries holds NaN .*layer 1"),
    "infinity in norms": (poke("self.norms", np.inf), r"self.norms holds NaN or infinite"),
    "negative attention": (poke(T, -0.5), r"self.attention holds negative weights"),
    "negative norms": (poke("self.norms", -0.5), r"self.norms holds negative weights"),
    "rows sum to 2": (scale(T, 2.0), r"rows should sum to 1, .* sums to 2"),
    "rows sum to 0.999": (scale(T, 0.999), r"rows should sum to 1, .* sums to 0.999"),
}
LLAMA_DAMAGES = {
    "keys not expanded but said so": (set_meta("kv_expanded", False), r"self.keys has 6 heads .*metadata says 2"),
    "values with kv heads": (set_shape("self.values", lambda s: [s[0], 2, s[2] * 3, s[3]]), r"self.values has 2 heads"),
}
BART_DAMAGES = {
    "cross attention transposed": (set_shape("cross.attention", lambda s: [*s[:2], s[3], s[2]]),
                                   r"cross.attention has \d+ queries"),
    "target tokens shortened": (lambda p: p.meta["target_tokens"].pop(), r"target.token_ids has \d+ tokens"),
    "target tokens null": (set_meta("target_tokens", None), r"unexpected array\(s\) cross.attention"),
    "not an encoder-decoder any more": (set_model("is_encoder_decoder", False), r"not an encoder-decoder"),
    "decoder layers disagree with cross": (set_shape("decoder.attention", lambda s: [1, s[1] * 2, *s[2:]]),
                                           r"decoder.norms has 2 layers .*decoder.attention has 1"),
    "self attention in an encoder-decoder": (lambda p: p.tensors.__setitem__("self.attention",
                                                                            p.tensors["encoder.attention"]),
                                             r"unexpected array\(s\) self.attention"),
    "encoder rows sum to 1.5": (scale("encoder.attention", 1.5), r"encoder.attention rows should sum to 1"),
    "NaN in cross attention": (poke("cross.attention", np.nan), r"cross.attention holds NaN"),
}
FLOAT16_DAMAGES = {
    "float16 weight of 60000": (poke(T, 60000.0), r"rows should sum to 1, .* sums to 6\d{4}"),
    "float16 NaN": (poke(T, np.nan), r"self.attention holds NaN"),
    "float16 rows sum to 1.01": (scale(T, 1.01), r"rows should sum to 1"),
}
CORPUS = [(base, name, damage, message)
          for base, damages in (("bert", BERT_DAMAGES), ("llama", LLAMA_DAMAGES), ("bart", BART_DAMAGES),
                                ("bert16", FLOAT16_DAMAGES))
          for name, (damage, message) in damages.items()]


@pytest.fixture(scope="module")
def good_files(good, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("good")
    files = {name: good[name].save(folder / f"{name}.safetensors") for name in ("bert", "llama", "bart")}
    files["bert16"] = good["bert"].save(folder / "bert16.safetensors", float16=True)
    return files


def damaged_file(good_files: dict[str, Path], base: str, damage: Callable[[Parts], None], folder: Path) -> Path:
    parts = read_parts(good_files[base])
    parts.meta = copy.deepcopy(parts.meta)
    damage(parts)
    return write_parts(parts, folder / "damaged.safetensors")


def test_the_corpus_is_large_and_its_parts_reader_is_faithful(good, good_files, tmp_path):
    assert len(CORPUS) >= 34
    copied = write_parts(read_parts(good_files["bert"]), tmp_path / "copy.safetensors")
    loaded = AttentionRecord.load(copied)
    np.testing.assert_array_equal(loaded.attention, good["bert"].attention)


@pytest.mark.parametrize(("base", "name", "damage", "message"), CORPUS, ids=[c[1] for c in CORPUS])
def test_damaged_record_is_refused_with_one_line_naming_the_problem(good_files, tmp_path, base, name, damage,
                                                                    message):
    path = damaged_file(good_files, base, damage, tmp_path)
    with pytest.raises(AttnscopeError, match=message) as caught:
        AttentionRecord.load(path)
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith(f"{path} is not a valid attnscope record: ")


@pytest.mark.parametrize("cut", [0, 7, 100, -10])
def test_truncated_files_are_refused(good_files, tmp_path, cut):
    raw = good_files["bert"].read_bytes()
    path = tmp_path / "cut.safetensors"
    path.write_bytes(raw[:cut])
    with pytest.raises(AttnscopeError, match="cannot read record"):
        AttentionRecord.load(path)


def test_schema_reader_agrees_with_jsonschema_on_every_metadata_of_the_corpus(good, good_files, tmp_path):
    schema = record_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    metadatas = [read_parts(path).meta for path in good_files.values()]
    for base, _, damage, _ in CORPUS:
        parts = read_parts(good_files[base])
        damage(parts)
        if parts.raw_meta is not None:
            try:
                parts.meta = json.loads(parts.raw_meta, parse_constant=lambda c: 1 / 0)
            except (ValueError, ZeroDivisionError):
                continue  # not JSON: neither reader gets it
        metadatas.append(parts.meta)
    verdicts = [(schema_problem(meta, schema) is None, validator.is_valid(meta)) for meta in metadatas]
    assert all(ours == reference for ours, reference in verdicts), [
        (meta, verdict) for meta, verdict in zip(metadatas, verdicts) if verdict[0] != verdict[1]]
    assert sum(not reference for _, reference in verdicts) >= 20  # the schema itself refuses most damaged metadata


def test_schema_reader_refuses_keywords_it_does_not_know():
    with pytest.raises(ValueError, match="pattern"):
        schema_problem("x", {"type": "string", "pattern": "^a"})


def test_cli_turns_a_damaged_record_into_one_error_line(good_files, tmp_path, capsys):
    path = damaged_file(good_files, "bert", set_model("n_layers", 99), tmp_path)
    code = main(["view", "--record", str(path), "-o", str(tmp_path / "v.html")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0 and err.startswith("attnscope: error: ") and "99" in err
    assert not (tmp_path / "v.html").exists()


def test_checks_work_on_memory_mapped_arrays(good, tmp_path):
    """What lazily loaded records will hand the checks: arrays that are read only where looked at."""
    from attnscope.records.attention import FORMAT_VERSION
    from attnscope.records.checks import check_record_parts

    record = good["bert"]
    mapped = {}
    for name, array in record.arrays.items():
        np.save(tmp_path / f"{name}.npy", array)
        mapped[name] = np.load(tmp_path / f"{name}.npy", mmap_mode="r")
    header = json.dumps(record._metadata())
    assert check_record_parts(header, mapped, "mapped", FORMAT_VERSION)["tokens"] == list(record.tokens)
    damaged = np.load(tmp_path / "self.norms.npy", mmap_mode="r+")
    damaged[1, 2, 3, 4] = np.inf
    damaged.flush()
    with pytest.raises(AttnscopeError, match=r"mapped is not a valid attnscope record: self.norms holds NaN .*layer 1"):
        check_record_parts(header, mapped, "mapped", FORMAT_VERSION)


def appended_garbage(good_files: dict[str, Path], folder: Path) -> Path:
    path = folder / "appended.safetensors"
    path.write_bytes(good_files["bert"].read_bytes() + b"garbage after the last array")
    return path


# four damaged records that view and plot drew (exit 0) while AttentionRecord.load refused them (issue 25, item 8)
DRAWN_DAMAGES = {
    "flipped bytes": (lambda files, folder: damaged_file(files, "bert", flip_high_byte(T), folder),
                      r"self.attention rows should sum to 1"),
    "NaN bytes in attention": (lambda files, folder: damaged_file(files, "bert", poke(T, np.nan), folder),
                               r"self.attention holds NaN"),
    "NaN bytes in norms": (lambda files, folder: damaged_file(files, "bert", poke("self.norms", np.nan), folder),
                           r"self.norms holds NaN"),
    "garbage appended": (appended_garbage, r"28 byte\(s\) after its last array|file not fully covered"),
}


@pytest.mark.parametrize("name", list(DRAWN_DAMAGES))
@pytest.mark.parametrize("command", [["view"], ["plot", "--layer", "0", "--head", "1"], ["plot", "--figure", "grid"],
                                     ["plot", "--measure", "attention"]])
def test_view_and_plot_refuse_the_damaged_records_load_refuses(good_files, tmp_path, capsys, name, command):
    make, message = DRAWN_DAMAGES[name]
    path = make(good_files, tmp_path)
    with pytest.raises(AttnscopeError, match=message):
        AttentionRecord.load(path)
    with pytest.raises(AttnscopeError, match=message):  # the lazy path checks the same, when asked to
        AttentionRecord.open(path, values=True)
    output = tmp_path / ("v.html" if command == ["view"] else "p.png")
    code = main([*command, "--record", str(path), "-o", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("attnscope: error: "), err
    assert re.search(message, err) and not output.exists()


def test_the_lazy_open_refuses_bytes_appended_without_reading_the_arrays(good_files, tmp_path):
    with pytest.raises(AttnscopeError, match=r"cannot open record .* byte\(s\) after its last array"):
        AttentionRecord.open(appended_garbage(good_files, tmp_path))


# ---- generation records (issue 25, item 8) --------------------------------------------------------
def truncate(cut: int) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(path.read_bytes()[:cut])


def overwrite(start: int, length: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[start : start + length] = b"\xff" * length
        path.write_bytes(bytes(raw))

    return damage


def flip_row_byte(parts: Parts) -> None:
    """The exponent byte of one kept weight: a row then sums to about 1e31 (flipped data bytes)."""
    parts.data[parts.tensors["rows"]["data_offsets"][0] + 4 * 7 + 3] = 0x74


R = "rows"
GENERATION_DAMAGES: dict[str, tuple[Callable[[Parts], None], str]] = {
    "metadata not JSON": (raw_meta("{not json"), r"metadata is not JSON"),
    "metadata a list": (raw_meta("[]"), r"metadata is a JSON array, not an object"),
    "no attnscope metadata": (lambda p: setattr(p, "drop_meta", True), r"without attnscope metadata"),
    "another format": (set_meta("format", "attnscope-generation/2"), r"format: should be one of"),
    "an attention record's metadata": (lambda p: p.meta.pop("format"), r"missing 'format'"),
    "settings a list": (set_meta("settings", ["greedy"]), r"settings: should be object, not array"),
    "settings missing": (lambda p: p.meta.pop("settings"), r"missing 'settings'"),
    "extra key": (set_meta("extra", 1), r"unexpected key\(s\) 'extra'"),
    "prompt_length 0": (set_meta("prompt_length", 0), r"prompt_length: should be at least 1"),
    "prompt_length a string": (set_meta("prompt_length", "4"), r"prompt_length: should be integer, not string"),
    "prompt as long as the text": (lambda p: p.meta.__setitem__("prompt_length", len(p.meta["tokens"])),
                                   r"leaves no generated token"),
    "first_row past the prompt": (lambda p: p.meta.__setitem__("first_row", p.meta["prompt_length"]),
                                  r"first_row \d+ is past the prompt's last position"),
    "a token dropped": (lambda p: p.meta["tokens"].pop(0), r"candidate_tokens should be|has \d+ "),
    "a step's candidates missing": (lambda p: p.meta["candidate_tokens"].pop(), r"candidate_tokens should be 4 lists"),
    "wrong layer count in the model info": (set_model("n_layers", 30), r"rows has 3 layers .*metadata says 30"),
    "wrong head count in the model info": (set_model("n_heads", 9), r"rows has 6 heads .*metadata says 9"),
    "model info without n_heads": (lambda p: p.meta["model"].pop("n_heads"), r"model: missing 'n_heads'"),
    "rows missing": (drop_tensor(R), r"no rows array"),
    "rows relabelled int32": (set_dtype(R, "I32"), r"rows is int32, should be floating point"),
    "rows with heads and keys merged": (set_shape(R, lambda s: [s[0], 1, s[1] * s[2]]), r"rows has 1 heads"),
    "unknown array": (lambda p: p.tensors.__setitem__("attention", p.tensors[R]), r"unexpected array\(s\) attention"),
    "NaN row": (lambda p: p.array(R).__setitem__((1, 2, slice(None)), np.nan), r"rows holds NaN .*layer 1"),
    "flipped data bytes": (flip_row_byte, r"rows should sum to 1, layer 0 head 0 position \d+ sums to \S+e\+3"),
    "rows sum to 0.999": (scale(R, 0.999), r"rows should sum to 1, .* sums to 0.999"),
    "negative weight": (poke(R, -0.5, (0, 0, 0)), r"rows holds negative values"),
    "infinite norms": (poke("value_norms", np.inf, (2, 1, 3)), r"value_norms holds NaN or infinite values \(layer 2"),
    "candidate probability 3": (poke("candidate_probs", 3.0, (0, 0)), r"candidate_probs holds a value that is no prob"),
    "NaN chosen probability": (poke("chosen_probs", np.nan, (1,)), r"chosen_probs holds a value that is no prob"),
    "candidate ids a step short": (set_shape("candidate_ids", lambda s: [s[0] - 1, s[1] + 1]),
                                   r"candidate_ids has 3 steps"),
}
GENERATION_FILE_DAMAGES: dict[str, Callable[[Path], None]] = {
    "truncated to 0 bytes": truncate(0), "truncated in the header": truncate(100),
    "truncated in the data": truncate(-10), "header overwritten": overwrite(8, 40),
    "length prefix overwritten": overwrite(0, 8), "garbage appended": lambda p: p.write_bytes(p.read_bytes() + b"\0" * 9),
}


@pytest.fixture(scope="module")
def generation_file(tiny_model_dir, tmp_path_factory) -> Path:
    """A real generation (a tiny Llama with grouped key/value heads, sampled, value norms), saved."""
    from attnscope import generate

    record = generate(load_model(str(tiny_model_dir("llama"))), "The cat sat on the mat.", max_new_tokens=4,
                      candidates=3, do_sample=True, temperature=0.8, seed=1)
    assert record.has_norms and record.n_layers == 3 and record.n_heads == 6 and record.n_steps == 4
    return record.save(tmp_path_factory.mktemp("generation") / "gen.safetensors")


def test_a_good_generation_round_trips_through_the_checks(generation_file, tmp_path):
    from attnscope import GenerationRecord

    copied = write_parts(read_parts(generation_file), tmp_path / "copy.safetensors")  # the parts reader is faithful
    again = GenerationRecord.load(copied)
    assert again.settings["temperature"] == 0.8 and again.step_attention(3).shape == (3, 6, again.prompt_length + 3)
    assert len(GENERATION_DAMAGES) + len(GENERATION_FILE_DAMAGES) >= 16


@pytest.mark.parametrize("name", list(GENERATION_DAMAGES))
def test_a_damaged_generation_record_is_refused_by_name(generation_file, tmp_path, name):
    from attnscope import GenerationRecord

    damage, message = GENERATION_DAMAGES[name]
    parts = read_parts(generation_file)
    damage(parts)
    path = write_parts(parts, tmp_path / "damaged.safetensors")
    with pytest.raises(AttnscopeError, match=message) as caught:
        GenerationRecord.load(path)
    assert str(caught.value).startswith(f"{path} is not a valid attnscope generation record: ")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("name", list(GENERATION_FILE_DAMAGES))
def test_a_cut_or_overwritten_generation_file_is_refused(generation_file, tmp_path, name):
    from attnscope import GenerationRecord

    path = tmp_path / "damaged.safetensors"
    path.write_bytes(generation_file.read_bytes())
    GENERATION_FILE_DAMAGES[name](path)
    with pytest.raises(AttnscopeError, match=f"cannot read generation record {path}|{path} is not a valid") as caught:
        GenerationRecord.load(path)
    assert "\n" not in str(caught.value)


def test_the_generation_schema_reader_agrees_with_jsonschema(generation_file):
    from attnscope.records.checks import generation_schema

    schema = generation_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for damage, _ in [(lambda p: None, ""), *GENERATION_DAMAGES.values()]:
        parts = read_parts(generation_file)
        damage(parts)
        if parts.raw_meta is None and not parts.drop_meta:
            assert (schema_problem(parts.meta, schema) is None) == validator.is_valid(parts.meta), parts.meta
