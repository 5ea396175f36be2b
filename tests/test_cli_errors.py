"""Bad input to any command ends in exactly one ``attnscope: error:`` line and exit code 2, never a
traceback (issue 19, item 7): bad UTF-8, unwritable outputs, broken model files, numbers out of
range, files with nothing usable, over-long toy inputs. Cases run through the real entry point
``attnscope.cli.main`` in-process (an escaping exception fails the test); argv bytes need a process.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from attnscope import cli
from attnscope.errors import AttnscopeError

from .conftest import SENTENCES
from .test_probing_chains import synthetic_document_conllu

LONG_ENGLISH = " ".join(["i can eat apples"] * 12)  # 48 words: over the toy translator's 32 positions


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir) -> dict[str, Path]:
    """Damaged and awkward inputs, made once."""
    root = tmp_path_factory.mktemp("bad-inputs")
    made = {"file": root / "a-file", "garbage_gguf": root / "weights.gguf", "broken_model": root / "broken",
            "empty_line_4": root / "inputs.jsonl", "one_word_lines": root / "words.txt", "texts": root / "texts.txt"}
    made["file"].write_text("not a folder")
    made["garbage_gguf"].write_bytes(b"this is not a GGUF file at all")
    shutil.copytree(tiny_model_dir("bert"), made["broken_model"])
    (made["broken_model"] / "model.safetensors").write_bytes(b"\x00" * 64)
    made["empty_line_4"].write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": ""}\n')
    made["one_word_lines"].write_text("Hello\nworld\n")
    made["texts"].write_text("\n".join(SENTENCES) + "\n")
    made["invisible_words"] = root / "invisible.txt"  # spaCy sees words, the tokenizer gives them no piece
    made["invisible_words"].write_text("\u200b \u200c\n\u00ad \u00ad \u00ad\n")
    made["tiny_bert"] = tiny_model_dir("bert")
    made["deep_jsonl"], made["deep_json"] = root / "deep.jsonl", root / "deep.json"  # 100,000 levels of [[[...]]]
    for path in (made["deep_jsonl"], made["deep_json"]):
        path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    made["long_sentences"] = root / "long.conllu"  # one sentence of 600 words: over the tiny BERT's 512 tokens
    made["long_sentences"].write_text("# text = " + " ".join(["word"] * 600) + "\n" + "".join(
        f"{i}\tword\tword\tNOUN\tNN\t_\t{0 if i == 1 else 1}\t{'root' if i == 1 else 'dep'}\t_\t_\n"
        for i in range(1, 601)) + "\n")
    made["coref_document"] = root / "chains.conllu"
    made["coref_document"].write_text(synthetic_document_conllu(8))
    return made


def bad(*args: str, expect: str) -> tuple[tuple[str, ...], str]:
    return args, expect


CASES = {
    # output paths that cannot be written (checked before the model loads: the model named does not exist)
    "extract into a file's sub-folder": bad("extract", "hi", "--out", "{file}/sub", "-m", "nope",
                                            expect="cannot create output folder"),
    "extract into /proc": bad("extract", "hi", "--out", "/proc/attnscope-x", "-m", "nope",
                              expect="cannot create output folder"),
    "ablate into a file": bad("ablate", "-o", "{file}", "-m", "nope", expect="is a file"),
    "prune into a file's sub-folder": bad("prune", "-o", "{file}/sub", "-m", "nope", expect="cannot create"),
    "heads into a file's sub-folder": bad("heads", "brown", "-o", "{file}/sub", "-m", "nope", expect="cannot create"),
    "probe into a file's sub-folder": bad("probe", "deps", "-o", "{file}/sub", "-m", "nope", expect="cannot create"),
    "primer into a file's sub-folder": bad("primer", "-o", "{file}/sub", expect="cannot create"),
    "view into a file's sub-folder": bad("view", "hi", "-o", "{file}/sub/v.html", "-m", "nope",
                                         expect="cannot create the folder"),
    "plot into a file's sub-folder": bad("plot", "hi", "--layer", "0", "--head", "0", "-o", "{file}/sub/p.png",
                                         "-m", "nope", expect="cannot create the folder"),
    "toy step view onto a full disk": bad("toy", "translate", "i can eat apples", "--html", "/dev/full",
                                          expect="cannot write /dev/full"),
    # files that are missing or folders, said in words (not Python's "[Errno 2] No such file or directory: '...'")
    "record that does not exist (view)": bad("view", "--record", "{tmp}/missing.safetensors", "-o", "{tmp}/v.html",
                                             expect="error: no such file: "),
    "record that does not exist (plot)": bad("plot", "--record", "{tmp}/missing.safetensors", "--layer", "0", "--head",
                                             "0", "-o", "{tmp}/p.png", expect="error: no such file: "),
    "record that is a folder": bad("view", "--record", "{tmp}", "-o", "{tmp}/v.html", expect="is a folder, not a record"),
    "text file that is a folder": bad("extract", "--file", "{tmp}", expect="is a folder, not a text file"),
    "prompt file that does not exist": bad("generate", "--file", "{tmp}/missing.txt", expect="no such file: "),
    # broken model files
    "garbage .gguf": bad("report", "hi", "--model", "{garbage_gguf}", expect="cannot read"),
    "corrupt model.safetensors": bad("report", "hi", "--model", "{broken_model}", expect="cannot load model"),
    # numbers out of range
    "negative --max-length": bad("extract", "hi", "--max-length", "-5", expect="--max-length"),
    "zero --max-length": bad("extract", "hi", "--max-length", "0", expect="positive integer"),
    "zero --batch-size": bad("extract", "hi", "--batch-size", "0", expect="--batch-size"),
    "nan --tolerance": bad("prune", "--tolerance", "nan", expect="finite number"),
    "nan --percent": bad("prune", "--percent", "nan", expect="finite number"),
    "negative --tolerance": bad("prune", "--tolerance", "-1", "-m", "nope", expect="--tolerance must be 0 or more"),
    "empty --layers (report)": bad("report", "hi", "--layers", "", expect="--layers"),
    "negative --layers (ablate)": bad("ablate", "--layers", "0,-1", expect="--layers"),
    "negative --bootstrap": bad("ablate", "--bootstrap", "-3", expect="--bootstrap"),
    "negative --seed (ablate)": bad("ablate", "--seed", "-1", expect="--seed"),
    "negative --seed (probe edges)": bad("probe", "edges", "--seed", "-1", expect="--seed"),
    "negative --seed (toy train)": bad("toy", "train", "--seed", "-1", expect="--seed"),
    "zero --limit": bad("heads", "brown", "--limit", "0", expect="--limit"),
    "zero -n": bad("heads", "--top", "sep", "-n", "0", expect="-n"),
    "--runtime-env not an object": bad("heads", "brown", "--engine", "ray", "--runtime-env", "[1]",
                                       expect="must be a JSON object"),
    "--runtime-env not JSON": bad("sinks", "brown", "--engine", "ray", "--runtime-env", "{{env_vars:",
                                  expect="not valid JSON"),
    "--runtime-env file missing": bad("heads", "brown", "--engine", "ray", "--runtime-env", "{file}/env.json",
                                      expect="nor a file"),
    "--runtime-env without ray": bad("heads", "brown", "--runtime-env", "{{}}", "-o", "{file}-h",
                                     expect="option of --engine ray"),
    "--engine ray for one sentence": bad("mixing", "The cat sat.", "--engine", "ray",
                                         expect="runs the evaluation"),
    "negative --layer (plot)": bad("plot", "hi", "--layer", "-1", "--head", "0", expect="--layer"),
    "nan --test-share": bad("probe", "edges", "--test-share", "nan", expect="--test-share"),
    "--top-k over the vocabulary": bad("toy", "translate", "i can eat apples", "--top-k", "100000",
                                       expect="vocabulary size"),
    "zero --beams": bad("toy", "translate", "i can eat apples", "--beams", "0", expect="--beams"),
    "zero --min-arcs (argparse's own refusal, in attnscope's one-line form)": bad("probe", "deps", "--min-arcs", "0",
                                                                                  expect="probe deps: argument"),
    "no command": bad(expect="required: COMMAND"),
    "unknown command": bad("nosuch", expect="invalid choice"),
    # files and texts with nothing usable
    "empty text on JSONL line 4": bad("extract", "--file", "{empty_line_4}", expect="line 4"),
    "one-word sentences for probe deps": bad("probe", "deps", "--text", "{one_word_lines}", "-o", "{tmp}/deps",
                                             expect="no dependency arc"),
    "no word with a word piece for probe deps": bad("probe", "deps", "--text", "{invisible_words}", "-m", "{tiny_bert}",
                                                    "-o", "{tmp}/deps", expect="no dependency arc could be scored"),
    "empty sentence for toy corrupt": bad("toy", "corrupt", "", expect="empty"),
    "empty sentence for toy translate": bad("toy", "translate", " ", expect="empty"),
    # JSON nested deeper than Python's parser goes (issue 36): bad JSON like any other, not a RecursionError
    "deeply nested JSONL line (extract)": bad("extract", "--file", "{deep_jsonl}", "-m", "nope", "-o", "{tmp}/x",
                                              expect="line 1: not valid JSON (nested too deeply)"),
    "deeply nested JSONL line (patch)": bad("patch", "--file", "{deep_jsonl}", "-m", "nope", "-o", "{tmp}/p",
                                            expect="line 1: not valid JSON (nested too deeply)"),
    "deeply nested JSONL line (probe coref)": bad("probe", "coref", "--items", "{deep_jsonl}", "-m", "nope", "-o",
                                                  "{tmp}/c", expect="line 1: expected"),
    "deeply nested --runtime-env file": bad("heads", "brown", "--engine", "ray", "--runtime-env", "{deep_json}",
                                            expect="not valid JSON: nested too deeply"),
    # numbers past what torch, OpenMP or the toy translator's training take
    "--threads past the maximum": bad("report", "hi", "--threads=99999999999999999999",
                                      expect="--threads: expected a thread count of at most 1024"),
    "--seed past 64 bits (generate)": bad("generate", "hi", "--sample", "--seed", "99999999999999999999", "-m", "nope",
                                          expect="--seed: expected a seed of at most"),
    "--seed past 64 bits (probe edges)": bad("probe", "edges", "--seed", "99999999999999999999", "-m", "nope",
                                             expect="--seed: expected a seed of at most"),
    # messages that name the cause
    "every sentence over the model's limit (probe deps)": bad(
        "probe", "deps", "--conllu", "{long_sentences}", "-m", "{tiny_bert}", "-o", "{tmp}/deps",
        expect="all 1 sentence(s) are longer than"),
    "a window too small for the special tokens (probe coref)": bad(
        "probe", "coref", "--conllu", "{coref_document}", "--window", "1", "-m", "{tiny_bert}", "-o", "{tmp}/coref",
        expect="--window 1 is too small: a window of"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_exit_2(name, files, tmp_path, capsys):
    args, expect = CASES[name]
    code = exit_code([arg.format(tmp=tmp_path, **files) for arg in args])
    assert_one_error_line(code, capsys.readouterr().err, expect)


def assert_one_error_line(code: int, err: str, expect: str) -> None:
    """Exit code 2, one ``attnscope: error:`` line holding ``expect``, no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("attnscope: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert expect in lines[0], lines[0]


def test_errors_about_files_never_show_python_s_errno(files, tmp_path, capsys):
    for name, (args, _) in CASES.items():
        exit_code([arg.format(tmp=tmp_path, **files) for arg in args])
        err = capsys.readouterr().err
        assert "[Errno" not in err, (name, err)


def test_a_garbage_gguf_is_one_stderr_line(files, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ATTNSCOPE_CACHE", str(tmp_path))
    assert exit_code(["report", "hi", "--model", str(files["garbage_gguf"])]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "not a GGUF file" in err[0], err


def must_not_run(monkeypatch, target: str) -> None:
    """Make ``target`` (a dotted name) fail the test if called: the slow work a bad input must never reach."""
    def started(*_args, **_kwargs):
        raise AssertionError(f"{target} ran before the input was checked")

    monkeypatch.setattr(target, started)


def exit_code(args: list[str]) -> int:
    try:
        return cli.main(args)
    except SystemExit as stop:  # argparse refusing a value exits from inside the parser
        return int(stop.code or 0)


@pytest.mark.parametrize("command", [["report"], ["extract"], ["view"], ["plot"], ["patterns"], ["toy", "translate"]])
def test_an_argument_that_is_not_utf8_is_one_line(command):
    result = subprocess.run([sys.executable, "-m", "attnscope", *command, b"caf\xe9"], check=False,
                            capture_output=True, timeout=120)
    err = result.stderr.decode("utf-8", "replace")
    lines = [line for line in err.splitlines() if line.startswith("attnscope: error:")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "not valid UTF-8" in lines[0] and "caf\\\\xe9" in lines[0]


def test_over_long_toy_inputs_are_cut_with_a_warning_naming_the_limit(capsys):
    assert cli.main(["toy", "corrupt", LONG_ENGLISH, "--mode", "uniform"]) == 0
    err = capsys.readouterr().err
    assert "attnscope: warning: sentence:" in err and "truncated to 32 (the model's limit)" in err
    assert cli.main(["toy", "translate", LONG_ENGLISH]) == 0
    assert "source text: 49 tokens, truncated to 32 (the model's limit)" in capsys.readouterr().err


def test_an_over_long_encoder_decoder_target_is_cut_with_a_warning():
    from attnscope import extract, load_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = extract(load_model("toy-translator"), "i can eat apples", " ".join(["ich kann äpfel essen"] * 12))
    messages = [str(w.message) for w in caught]
    assert any("target text" in m and "truncated to 32 (the model's limit)" in m for m in messages), messages
    assert record.target_tokens is not None and len(record.target_tokens) == 32


# (command, the slow work it must not start, the refusal): layers and heads are checked against the model first
INDEX_CASES = {
    "generate --ablate LAYER": (["generate", "hi", "-m", "{llama}", "-n", "2", "--ablate", "99:0"],
                                "attnscope.experiments.generation.generate", "--ablate: layer 99 does not exist"),
    "generate --ablate LAYER:HEAD": (["generate", "hi", "-m", "{llama}", "-n", "2", "--ablate", "0:99"],
                                     "attnscope.experiments.generation.generate", "--ablate: head 99 does not exist"),
    "generate --corrupt --layers": (["generate", "hi", "-m", "{llama}", "--corrupt", "uniform", "--layers", "3"],
                                    "attnscope.experiments.generation.generate", "--layers: layer 3 does not exist"),
    "generate --corrupt --heads": (["generate", "hi", "-m", "{llama}", "--corrupt", "uniform", "--heads", "6"],
                                   "attnscope.experiments.generation.generate", "--heads: head 6 does not exist"),
    "generate --skip-ffn": (["generate", "hi", "-m", "{llama}", "--skip-ffn", "7"],
                            "attnscope.experiments.generation.generate", "--skip-ffn: layer 7 does not exist"),
    "generate --skip-attention": (["generate", "hi", "-m", "{llama}", "--skip-attention", "0,3"],
                                  "attnscope.experiments.generation.generate", "--skip-attention: layer 3"),
    "report --layers": (["report", "hi", "-m", "{bert}", "--layers", "2"], "attnscope.capture.extract.extract",
                        "--layers: layer 2 does not exist: the model has 2 layers"),
    "plot --layer": (["plot", "hi", "-m", "{bert}", "--layer", "2", "--head", "0", "-o", "{tmp}/p.png"],
                     "attnscope.capture.extract.extract", "--layer: layer 2 does not exist"),
    "plot --head": (["plot", "hi", "-m", "{bert}", "--layer", "0", "--head", "4", "-o", "{tmp}/p.png"],
                    "attnscope.capture.extract.extract", "--head: head 4 does not exist: the model has 4 heads"),
    "plot --measure --layer": (["plot", "hi", "-m", "{bert}", "--measure", "alti", "--layer", "5", "-o", "{tmp}/p.png"],
                               "attnscope.experiments.mixing.mixing", "--layer: layer 5 does not exist"),
    "ablate --layers": (["ablate", "-m", "{bert}", "--layers", "0,2", "-n", "2", "-o", "{tmp}/ablate"],
                        "attnscope.experiments.metrics.prepare_metric", "--layers: layer 2 does not exist"),
    "extract --heads": (["extract", "hi", "-m", "{bert}", "--heads", "4", "-o", "{tmp}/x"],
                        "transformers.models.bert.modeling_bert.BertModel.forward", "head 4 does not exist: the model has 4"),
    "extract --stream --heads": (["extract", "hi", "-m", "{llama}", "--heads", "0,6", "--stats", "--stream", "-o",
                                  "{tmp}/x"], "transformers.models.llama.modeling_llama.LlamaForCausalLM.forward",
                                 "head 6 does not exist"),
}


@pytest.mark.parametrize("name", list(INDEX_CASES))
def test_layers_and_heads_are_checked_against_the_model_before_the_work(name, tiny_model_dir, tmp_path, capsys,
                                                                          monkeypatch):
    args, slow, expect = INDEX_CASES[name]

    def started(*_args, **_kwargs):
        raise AssertionError(f"{slow} ran before the layers and heads were checked")

    monkeypatch.setattr(slow, started)
    folders = {"llama": tiny_model_dir("llama"), "bert": tiny_model_dir("bert")}
    code = exit_code([arg.format(tmp=tmp_path, **folders) for arg in args])
    assert_one_error_line(code, capsys.readouterr().err, expect)


def test_a_refused_connection_is_named_so_not_a_file_operation(monkeypatch, tmp_path, capsys):
    """``heads --engine ray --address HOST:PORT`` where nothing listens: Ray raises ConnectionError (an OSError)."""
    from attnscope.corpus import engines

    def refused(*_args, **_kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(engines, "analyze_heads", refused)
    assert exit_code(["heads", "brown", "--engine", "ray", "--address", "127.0.0.1:1", "-o", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "attnscope: error: cannot connect: Connection refused", err


# ---- issue 36, item 4: bad input ---------------------------------------------------------------------
SEED_CASES = {
    "toy train --seed past 64 bits": (["toy", "train", "--seed", "99999999999999999999"], "--seed"),
    "toy train --seed whose epochs' seeds pass 64 bits": (["toy", "train", "--seed", str(2**63)], "--seed"),
    "toy evaluate --seeds past 64 bits": (["toy", "evaluate", "--seeds", "99999999999999999999"], "--seeds"),
    "toy evaluate --seeds 0-100000": (["toy", "evaluate", "--seeds", "0-100000"], "at most 100 seeds"),
}


@pytest.mark.parametrize("name", list(SEED_CASES))
def test_seeds_torch_cannot_take_and_too_many_seeds_are_refused_before_training(name, monkeypatch, capsys):
    args, expect = SEED_CASES[name]
    must_not_run(monkeypatch, "attnscope.lab.translator.train")
    must_not_run(monkeypatch, "attnscope.lab.experiments.evaluate_seed")
    assert_one_error_line(exit_code(args), capsys.readouterr().err, expect)


def test_a_huge_range_of_heads_is_refused_before_it_is_built():
    """``--heads 0-9999999999`` was built as a set of ten billion numbers; under a 1 GiB address space the
    parse must still refuse it in one line."""
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))\n"
              "from attnscope.cli import main\nsys.exit(main(['extract', 'hi', '--heads', '0-9999999999']))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert_one_error_line(result.returncode, result.stderr, "--heads: layers and heads go up to 65535, got 9999999999")


@pytest.mark.parametrize("args", [["report", "hi", "--layers", "x" * 100_000], ["extract", "--file", "x" * 100_000]])
def test_a_huge_argument_is_cut_in_the_error_line(args, capsys):
    code = exit_code(args)
    err = capsys.readouterr().err
    assert_one_error_line(code, err, "xxx...xxx")
    assert len(err.splitlines()[-1]) < 400, err[:1000]


def test_a_long_message_of_ordinary_words_is_printed_whole():
    from attnscope.capture.plan import MemoryEstimate, check_memory

    with pytest.raises(AttnscopeError) as refused:  # one of the longest messages attnscope writes itself
        check_memory(MemoryEstimate(kept=2**40, working=2**38), what="capturing 1 input(s) of up to 32768 tokens on "
                     "qwen0.5b", available=2**30)
    assert len(str(refused.value)) > 300 and cli.error_line(str(refused.value)) == str(refused.value)


# (command, its refusal): the model is never loaded, nor the evaluation run, nor Ray started
DEVICE_CASES = {
    "heads --device banana": (["heads", "{texts}", "--device", "banana", "-o", "{tmp}/h"], "unknown device 'banana'"),
    "mixing --evaluate --device banana": (["mixing", "--evaluate", "--device", "banana"], "unknown device 'banana'"),
    "mixing --evaluate --dtype": (["mixing", "--evaluate", "--dtype", "bfloat16"], "in float32 on the CPU"),
    "mixing --evaluate --model": (["mixing", "--evaluate", "--model", "smollm2"], "give --models smollm2"),
    "heads --engine ray --device auto": (["heads", "brown", "--engine", "ray", "--device", "auto", "-o", "{tmp}/h"],
                                         "the Ray engine's actors run on CPUs"),
    "mixing --evaluate --engine ray --device auto": (["mixing", "--evaluate", "--engine", "ray", "--device", "auto"],
                                                     "the Ray engine's actors run on CPUs"),
}


@pytest.mark.parametrize("name", list(DEVICE_CASES))
def test_a_device_or_dtype_a_command_would_ignore_is_refused(name, files, tmp_path, monkeypatch, capsys):
    args, expect = DEVICE_CASES[name]
    for slow in ("attnscope.capture.loading.load_model", "attnscope.experiments.faithfulness.evaluate_mixing",
                 "attnscope.corpus.distributed.ray_module"):
        must_not_run(monkeypatch, slow)
    code = exit_code([arg.format(tmp=tmp_path, **files) for arg in args])
    assert_one_error_line(code, capsys.readouterr().err, expect)
    assert not (tmp_path / "h").exists()


def test_heads_runs_its_model_on_the_device_asked_for(files, tmp_path, monkeypatch, capsys):
    asked = []

    def load_model(name, *, dtype="float32", device="cpu"):
        asked.append((name, dtype, device))
        raise AttnscopeError("stopped where the model would load")

    monkeypatch.setattr("attnscope.capture.loading.load_model", load_model)
    args = ["heads", str(files["texts"]), "-m", "minilm", "--dtype", "bfloat16", "--device", "auto", "-o",
            str(tmp_path / "h")]
    assert_one_error_line(exit_code(args), capsys.readouterr().err, "stopped where the model would load")
    assert asked == [("minilm", "bfloat16", "auto")]


@contextmanager
def listener(answer: bytes | None) -> Iterator[int]:
    """A server on a free local port that answers each connection with ``answer`` (None: never answers)."""
    server = socket.create_server(("127.0.0.1", 0))
    connections = []

    def serve() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            connections.append(connection)
            if answer is not None:
                connection.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for connection in connections:
            connection.close()


@pytest.mark.parametrize(("answer", "expect"), [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "an HTTP server answered (HTTP/1.1 400 Bad Request)"),
    (b"SSH-2.0-OpenSSH_9.6\r\n", "something else answered ('SSH-2.0-OpenSSH_9.6')"),
    (None, "something accepts connections there but did not answer"),
])
def test_something_other_than_ray_at_the_address_is_named_at_once(answer, expect, monkeypatch, tmp_path, capsys):
    """Ray itself retried for minutes, silently, when something other than its GCS listened at --address."""
    pytest.importorskip("ray")
    from attnscope.corpus import ray_engine

    monkeypatch.setattr(ray_engine, "HANDSHAKE_SECONDS", 0.5, raising=False)
    must_not_run(monkeypatch, "ray.init")
    with listener(answer) as port:
        code = exit_code(["sinks", "brown", "--engine", "ray", "--address", f"127.0.0.1:{port}", "-o",
                          str(tmp_path / "sinks")])
    assert_one_error_line(code, capsys.readouterr().err, expect)
    assert not (tmp_path / "sinks").exists()


# the first bytes Ray 2.60's GCS answered the probe with (`ray start --head`): HTTP/2 SETTINGS, 24 bytes of settings
RAY_GCS_ANSWER = bytes.fromhex("000018040000000000") + bytes(24)


def test_a_ray_gcs_passes_the_probe():
    from attnscope.corpus.ray_engine import _check_reachable

    with listener(RAY_GCS_ANSWER) as port:
        _check_reachable(f"127.0.0.1:{port}")  # no error


@pytest.mark.parametrize(("runtime_env", "expect"), [
    ('{"unknown_plugin": {"a": 1}}', "--runtime-env: Ray would ignore 'unknown_plugin'"),
    ('{"env_vars": {"HF_HOME": 1}}', '--runtime-env: "env_vars" value of HF_HOME must be a string (in quotes), got 1'),
])
def test_a_runtime_environment_ray_would_ignore_or_reject_is_one_clear_line(runtime_env, expect, tmp_path,
                                                                              monkeypatch, capsys):
    pytest.importorskip("ray")
    must_not_run(monkeypatch, "ray.init")
    code = exit_code(["heads", "brown", "--engine", "ray", "--runtime-env", runtime_env, "-o", str(tmp_path / "h")])
    assert_one_error_line(code, capsys.readouterr().err, expect)
    assert not (tmp_path / "h").exists()


def test_a_long_runtime_environment_is_json_not_a_file_name():
    from attnscope.corpus.ray_engine import runtime_env_argument

    text = json.dumps({"env_vars": {f"VARIABLE_{i}": "x" * 16 for i in range(20)}})
    assert len(text) > 600 and runtime_env_argument(text) == json.loads(text)


# (arguments, a refusal that comes once the model has loaded); memory: as if the machine had 1 KiB free
LEFT_BEHIND = {
    "extract --heads": (["--heads", "99"], "head 99 does not exist"),
    "extract --stream --heads": (["--heads", "99", "--stats", "--stream"], "head 99 does not exist"),
    "extract --queries": (["--queries", "99"], "query position 99 is outside"),
    "extract over the memory": (["--memory"], "of memory"),
    "extract --stream over the memory": (["--memory", "--stats", "--stream"], "of memory"),
}


@pytest.mark.parametrize("name", list(LEFT_BEHIND))
def test_a_refused_extract_leaves_nothing_it_created(name, files, tmp_path, monkeypatch, capsys):
    options, expect = LEFT_BEHIND[name]
    if "--memory" in options:
        monkeypatch.setattr("attnscope.capture.plan.available_memory", lambda: 1024)
        options = [option for option in options if option != "--memory"]
    made, kept = tmp_path / "new" / "records", tmp_path / "kept"
    kept.mkdir()  # a folder the user made stays, and stays empty
    for out in (made, kept):
        code = exit_code(["extract", "The cat sat on the mat.", "-m", str(files["tiny_bert"]), "-o", str(out),
                          *options])
        assert_one_error_line(code, capsys.readouterr().err, expect)
    assert sorted(tmp_path.iterdir()) == [kept] and not any(kept.iterdir())
